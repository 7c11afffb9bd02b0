-- One server's token throughput, shared by every gateway replica (the gpu-hour cost provider):
-- add a settled call's tokens, spread evenly over the seconds it ran, and answer the server's
-- tokens per busy second over the last `window` seconds (Redis' clock). A second's busy time runs
-- from the earliest start to the latest end of the calls in it (so a burst of short calls is busy
-- for as long as it lasts, not for the whole second).
--
-- KEYS[1] {exa:tput}:<endpoint>:<replica>  HASH  "<unix second>" -> "tokens|first start|last end"
--                                                (tokens fractional; start and end in s, within the second)
-- ARGV  1 the call's tokens (prompt + completion)   2 its duration in s   3 window in s
-- Returns the tokens per busy second over the window, as a string ('0' when there were none).

-- split() comes from _prelude.lua.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tokens, dur, win = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local last = math.floor(now)
local first = last - win + 1
if tokens > 0 then
  local start = now - math.max(dur, 0)
  for s = math.max(math.floor(start), first), last do
    local a, b = math.max(s, start), math.min(s + 1, now)
    local share = dur > 0 and tokens * (b - a) / dur or tokens
    if b > a or dur <= 0 then
      local field = string.format('%d', s)
      local old = redis.call('HGET', KEYS[1], field)
      if old then
        local o = split(old)
        share, a, b = share + tonumber(o[1]), math.min(a, tonumber(o[2])), math.max(b, tonumber(o[3]))
      end
      redis.call('HSET', KEYS[1], field, string.format('%.6f|%.6f|%.6f', share, a, b))
    end
  end
end
local total, busy = 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if tonumber(all[i]) < first then
    redis.call('HDEL', KEYS[1], all[i])
  else
    local o = split(all[i + 1])
    total = total + tonumber(o[1])
    busy = busy + math.max(tonumber(o[3]) - tonumber(o[2]), 0.001)  -- at least a millisecond
  end
end
redis.call('PEXPIRE', KEYS[1], (win + 60) * 1000)
if busy == 0 then return '0' end
return string.format('%.6f', total / busy)
