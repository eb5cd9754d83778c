-- Reserved blocks per backend and tokens of a pool, after dropping expired leases.
-- KEYS as in reserve.lua. Returns {tokens, backend1, blocks1, backend2, blocks2, ...}
-- (purge.lua runs first: `now` is Redis time, expired leases are gone)
local out = {tonumber(redis.call('GET', KEYS[4]) or '0')}
local h = redis.call('HGETALL', KEYS[3])
for i = 1, #h, 2 do
  table.insert(out, h[i])
  table.insert(out, tonumber(h[i + 1]))
end
return out
