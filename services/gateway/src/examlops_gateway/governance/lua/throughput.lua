-- One server's token throughput, shared by every gateway replica (the gpu-hour cost provider):
-- add a settled call's tokens, spread evenly over the seconds it ran, and answer the server's
-- tokens per busy second over the last `window` seconds (Redis' clock).
--
-- KEYS[1] {exa:tput}:<endpoint>:<replica>  HASH  unix second -> tokens (fractional)
-- ARGV  1 the call's tokens (prompt + completion)   2 its duration in s   3 window in s
-- Returns the tokens per second over the window's busy seconds (those with any tokens), as a string.

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tokens, dur, win = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local last = math.floor(now)
local first = last - win + 1
if tokens > 0 then
  local start = now - dur
  if dur <= 0 then
    redis.call('HINCRBYFLOAT', KEYS[1], string.format('%d', last), tokens)
  else
    for s = math.max(math.floor(start), first), last do
      local overlap = math.min(s + 1, now) - math.max(s, start)
      if overlap > 0 then
        redis.call('HINCRBYFLOAT', KEYS[1], string.format('%d', s), string.format('%.6f', tokens * overlap / dur))
      end
    end
  end
end
local total, busy = 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if tonumber(all[i]) < first then
    redis.call('HDEL', KEYS[1], all[i])
  else
    total = total + tonumber(all[i + 1])
    busy = busy + 1
  end
end
redis.call('PEXPIRE', KEYS[1], (win + 60) * 1000)
if busy == 0 then return '0' end
return string.format('%.6f', total / busy)
