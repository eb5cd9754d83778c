-- Token bucket: take ARGV[1] tokens (or, with ARGV[4] == 'adjust', add ARGV[1], which may be
-- negative). KEYS[1] hash {level, at}. ARGV[2] capacity, ARGV[3] refill per second.
-- A full bucket always gives, even more than it holds: a request larger than a whole quota
-- window runs once instead of being refused forever. Returns {ok, remaining, reset ms}.
-- ARGV[5] the level the calling replica last saw ('' if none), ARGV[6] how many ms ago: a
-- bucket Redis lost (a restart) starts from it, refilled since, not full, so a tenant's debt
-- survives. Only a missing key is seeded, and atomically: the first replica to ask sets it,
-- as SET NX would, and everyone after uses that.
--
-- Holds: a take with a hold id (ARGV[7], '' for none) records what it took, KEYS[2] hash
-- id -> tokens and KEYS[3] zset id -> expiry ms (ARGV[8] ttl ms), until the request settles:
-- ARGV[4] == 'settle' adds ARGV[1] (the refund: taken - used, negative for usage beyond the
-- reservation) and drops the hold, only while the hold is there, so a settle sent twice (a
-- retry after a failure that may have run) counts once; ok = 0 when there was none. A hold
-- not settled by its expiry (its replica died) is dropped: what it took stays taken.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)
for _, id in ipairs(expired) do
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[3], id)
end
local amount = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local rate = tonumber(ARGV[3]) / 1000  -- per ms
local op = ARGV[4]
local hold = ARGV[7] or ''
local state = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(state[1])
local at = tonumber(state[2]) or now
if level == nil then
  local seen = tonumber(ARGV[5] or '')
  if seen then
    level = seen + tonumber(ARGV[6]) * rate
  else
    level = capacity
  end
end
level = math.min(capacity, level + (now - at) * rate)
local ok = 1
if op == 'adjust' then
  level = math.min(capacity, level + amount)
elseif op == 'settle' then
  if redis.call('HEXISTS', KEYS[2], hold) == 1 then
    level = math.min(capacity, level + amount)
    redis.call('HDEL', KEYS[2], hold)
    redis.call('ZREM', KEYS[3], hold)
  else
    ok = 0
  end
elseif hold ~= '' and redis.call('HEXISTS', KEYS[2], hold) == 1 then
  -- already taken under this hold: a retried take must not take twice
elseif level >= amount or level >= capacity then
  level = level - amount
  if hold ~= '' then
    local ttl = tonumber(ARGV[8])
    redis.call('HSET', KEYS[2], hold, amount)
    redis.call('ZADD', KEYS[3], now + ttl, hold)
    redis.call('PEXPIRE', KEYS[2], ttl + 60000)
    redis.call('PEXPIRE', KEYS[3], ttl + 60000)
  end
else
  ok = 0
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', now)
local reset = 0
if rate > 0 then
  reset = math.ceil((capacity - level) / rate)
  redis.call('PEXPIRE', KEYS[1], reset + 60000)
end
return {ok, math.floor(level), reset}
