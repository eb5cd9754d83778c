-- Shared prelude of the scripts that read a pool's totals: drop expired leases first
-- (bounded per call; a later call takes the rest). Time comes from Redis, not the replicas.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 500)
for _, id in ipairs(expired) do
  local v = redis.call('HGET', KEYS[2], id)
  if v then
    local b, tn, blk, tok = string.match(v, '^(.*)|(.*)|(%d+)|(%d+)$')
    redis.call('HINCRBY', KEYS[3], b, -tonumber(blk))
    redis.call('INCRBY', KEYS[4], -tonumber(tok))
    redis.call('HINCRBY', KEYS[5], tn, -tonumber(blk))
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREM', KEYS[1], id)
end
