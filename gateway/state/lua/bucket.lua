-- Token bucket: take ARGV[1] tokens (or, with ARGV[4] == 'adjust', add ARGV[1], which may be
-- negative). KEYS[1] hash {level, at}. ARGV[2] capacity, ARGV[3] refill per second.
-- A full bucket always gives, even more than it holds: a request larger than a whole quota
-- window runs once instead of being refused forever. Returns {ok, remaining, reset ms}.
-- ARGV[5] the level the calling replica last saw ('' if none), ARGV[6] how many ms ago: a
-- bucket Redis lost (a restart) starts from it, refilled since, not full, so a tenant's debt
-- survives. Only a missing key is seeded, and atomically: the first replica to ask sets it,
-- as SET NX would, and everyone after uses that.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local amount = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local rate = tonumber(ARGV[3]) / 1000  -- per ms
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
if ARGV[4] == 'adjust' then
  level = math.min(capacity, level + amount)
elseif level >= amount or level >= capacity then
  level = level - amount
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
