-- Give one lease back. Releasing one that expired or was released already does nothing.
-- KEYS as in reserve.lua; ARGV[1] lease id. Returns 1 when something was released.
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
local b, tn, blk, tok = string.match(v, '^(.*)|(.*)|(%d+)|(%d+)$')
redis.call('HINCRBY', KEYS[3], b, -tonumber(blk))
redis.call('INCRBY', KEYS[4], -tonumber(tok))
redis.call('HINCRBY', KEYS[5], tn, -tonumber(blk))
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
