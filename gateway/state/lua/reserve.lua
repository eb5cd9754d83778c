-- Check and take one lease atomically; time from Redis, so replicas' clocks do not matter.
-- KEYS[1] {pool} lease expiries (zset id -> ms)
-- KEYS[2] {pool} leases (hash id -> "backend|tenant|blocks|tokens")
-- KEYS[3] {pool} reserved blocks per backend (hash)  KEYS[4] {pool} reserved tokens (string)
-- KEYS[5] {pool} reserved blocks per tenant (hash)
-- ARGV: lease id, backend, blocks, tokens, max blocks, max tokens (-1: none), ttl ms,
--       tenant, tenant max blocks (-1: none)
-- Returns {ok (1/0), backend blocks after, pool tokens after, reason}
-- (purge.lua runs first: `now` is Redis time, expired leases are gone)

local backend = ARGV[2]
local blocks = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local max_blocks = tonumber(ARGV[5])
local max_tokens = tonumber(ARGV[6])
local used_b = tonumber(redis.call('HGET', KEYS[3], backend) or '0')
local used_t = tonumber(redis.call('GET', KEYS[4]) or '0')

if used_b + blocks > max_blocks then
  return {0, used_b, used_t, 'kv_blocks'}
end
if max_tokens >= 0 and used_t > 0 and used_t + tokens > max_tokens then
  return {0, used_b, used_t, 'inflight_tokens'}
end
local tenant = ARGV[8]
local tenant_max = tonumber(ARGV[9])
local held = tonumber(redis.call('HGET', KEYS[5], tenant) or '0')
if tenant_max >= 0 and held > 0 and held + blocks > tenant_max then
  return {0, used_b, used_t, 'tenant_share'}
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return {1, used_b, used_t, ''}  -- already held: a retried call must not take it twice
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[7]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], backend .. '|' .. tenant .. '|' .. blocks .. '|' .. tokens)
redis.call('HINCRBY', KEYS[5], tenant, blocks)
redis.call('HINCRBY', KEYS[3], backend, blocks)
redis.call('INCRBY', KEYS[4], tokens)
return {1, used_b + blocks, used_t + tokens, ''}
