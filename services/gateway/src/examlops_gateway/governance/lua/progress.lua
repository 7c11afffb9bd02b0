-- Note what a call in flight has delivered so far, in its reservation, so that if its gateway dies
-- (or cannot settle) the reaper charges that instead of nothing. Written only while the
-- reservation is open: a progress note arriving after the settle changes nothing.
--
-- KEYS[1] {vk:<id>}:res  HASH   ('owed:<res_id>' -> "cost|prompt tokens|completion tokens")
-- ARGV (built by _scripts.ProgressArgs)  1 reservation id   2 cost in micro-USD so far
--       3 prompt tokens   4 completion tokens delivered so far
-- Returns 1 when noted, 0 when the reservation is no longer open.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'owed:' .. ARGV[1], ARGV[2] .. '|' .. ARGV[3] .. '|' .. ARGV[4])
return 1
