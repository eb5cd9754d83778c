-- Announce a replica and count the ones alive. KEYS[1] zset replica id -> expiry ms;
-- ARGV[1] replica id, ARGV[2] ttl ms. Time from Redis, so replicas' clocks do not matter.
-- Returns how many replicas are alive.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
