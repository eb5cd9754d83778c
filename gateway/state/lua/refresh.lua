-- Push live leases' expiry forward. KEYS[1] the pool's expiry zset; ARGV[1] ttl ms, ARGV[2..] ids.
-- XX: a lease that expired (and was purged) is not brought back.
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
end
return n
