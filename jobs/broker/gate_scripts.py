"""The Lua scripts of jobs.broker.concurrency's waiting rooms (one atomic decision each, on Redis'
own clock); what each reads and writes is listed above it."""

COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function tat()
  local v = tonumber(redis.call('GET', KEYS[6]) or '0')
  if v < now then v = now end
  return v
end
local function take_token(interval, at)
  local nxt = at + interval
  redis.call('SET', KEYS[6], string.format('%.6f', nxt), 'PX', math.ceil((nxt - now) * 1000) + 1000)
end
"""

# KEYS: 1 wait, 2 messages, 3 grants, 4 conf, 5 holders, 6 bucket, 7 GATES, 8 QUEUES, 9 OWNER,
#       10 SEQUENCE, 11 the gates waiting on the holders' slots, 12 the bucket's last starts
# ARGV: job, gate, limit (0: none), interval (0: none), lease, early, horizon, message,
#       queue, holders name, bucket name, "1" to park it whatever the slots (at enqueue)
# Returns {verdict, wait, jobs waiting}: "go" (let in, a slot taken), "held" (it already held its
# slot: a redelivery), "early" (granted: run after wait), "parked", "waiting" (already parked: a
# duplicate).
ADMIT = (
    COMMON
    + """
local job, gate = ARGV[1], ARGV[2]
local function answer(verdict, wait)
  return {verdict, wait, redis.call('ZCARD', KEYS[1])}
end
local limit, interval, lease = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local early, horizon = tonumber(ARGV[6]), tonumber(ARGV[7])
local function hold(expiry)
  if limit > 0 then
    redis.call('ZADD', KEYS[5], expiry, job)
    redis.call('HSET', KEYS[9], job, gate)
  end
end
local function full()
  -- seconds until the bucket's last second of starts leaves room for one more, or false: every
  -- start, on time or not, keeps any 1-second window within the rate (late ones bunch up)
  if interval == 0 then return false end
  redis.call('ZREMRANGEBYSCORE', KEYS[12], '-inf', now - 1)
  local last = redis.call('ZRANGE', KEYS[12], -1, -1, 'WITHSCORES')
  if last[2] and now - tonumber(last[2]) < interval / 2 then
    -- late ones catch up at twice the rate at most, never in a clump
    return math.max(0.001, tonumber(last[2]) + interval / 2 - now)
  end
  -- up to 10 % over the rate less room for timing jitter (jobs.broker.concurrency.catch_up_cap),
  -- so a second lost to a busy pool is caught up on while the busiest second stays within + 10 %
  local rate = math.floor(1 / interval + 1e-9)
  local over = math.floor(1.1 / interval + 1e-9)
  local cap = math.max(1, rate, math.min(over - 1, math.max(rate + 1, over - 2)))
  if redis.call('ZCARD', KEYS[12]) < cap then return false end
  local oldest = redis.call('ZRANGE', KEYS[12], 0, 0, 'WITHSCORES')
  return math.max(0.001, tonumber(oldest[2]) + 1 - now)
end
local function started()
  -- the last second's starts of the bucket (read for late grants, below)
  if interval > 0 then
    redis.call('ZADD', KEYS[12], now, job)
    redis.call('ZREMRANGEBYSCORE', KEYS[12], '-inf', now - 1)
    redis.call('PEXPIRE', KEYS[12], 2000)
  end
  return answer('go', '0')
end
local function park(at_head)
  local score
  if at_head then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    score = (tonumber(first[2]) or 0) - 1
  else
    score = redis.call('INCR', KEYS[10])
  end
  redis.call('ZADD', KEYS[1], score, job)
  redis.call('HSET', KEYS[2], job, ARGV[8])
  redis.call('HSET', KEYS[4], 'limit', limit, 'interval', interval, 'lease', lease,
    'queue', ARGV[9], 'holders', ARGV[10], 'bucket', ARGV[11])
  redis.call('SADD', KEYS[7], gate)
  if limit > 0 then redis.call('SADD', KEYS[11], gate) end
  redis.call('HINCRBY', KEYS[8], ARGV[9], 1)
  redis.call('HSET', KEYS[9], job, gate)
  return answer('parked', '0')
end
if redis.call('ZSCORE', KEYS[1], job) then return answer('waiting', '0') end
if ARGV[12] == '1' then return park(false) end -- parked at enqueue: the gate decides, in order
if limit > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now) end
local holding = limit > 0 and redis.call('ZSCORE', KEYS[5], job) ~= false
local grant = redis.call('HGET', KEYS[3], job)
if grant then
  redis.call('HDEL', KEYS[3], job)
  local slot = tonumber(grant)
  if limit > 0 and not holding then
    grant = false -- its slot lapsed on the way: it is a newcomer again
  elseif interval == 0 then
    hold(now + lease)
    return answer('go', '0')
  elseif now < slot - early then
    redis.call('HSET', KEYS[3], job, grant)
    return answer('early', tostring(slot - now))
  else
    -- on time, or late (its token went unused at its time, and is still its own: the total
    -- stays within the tokens given): it runs once the last second's starts leave room
    local busy = full()
    if busy then
      redis.call('HSET', KEYS[3], job, grant)
      return answer('early', tostring(busy))
    end
    hold(now + lease)
    return started()
  end
end
if holding then
  -- a redelivery of a job whose run held the slot (its worker died): it keeps the slot
  if interval > 0 then
    local at = tat()
    if at > now + early then
      redis.call('ZREM', KEYS[5], job)
      return park(true)
    end
    take_token(interval, at)
  end
  hold(now + lease)
  return answer('held', '0')
end
-- a newcomer: it may pass only when nobody waits before it and every slot it needs is free
if redis.call('ZCARD', KEYS[1]) == 0 and (limit == 0 or redis.call('ZCARD', KEYS[5]) < limit) then
  if interval == 0 then
    hold(now + lease)
    return answer('go', '0')
  end
  local at = tat()
  if at <= now + early and not full() then
    take_token(interval, at)
    hold(now + lease)
    return started()
  end
end
return park(false)
"""
)

# KEYS: 1 wait, 2 messages, 3 grants, 4 conf, 5 holders, 6 bucket, 7 GATES, 8 QUEUES, 9 OWNER,
#       10 the gates waiting on the holders' slots
# ARGV: gate, limit, interval, lease, horizon, max, queue
# Returns a flat list: job, message, wait (seconds until its slot), ... for each released job.
DISPATCH = (
    COMMON
    + """
local gate = ARGV[1]
local limit, interval, lease = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local horizon, most = tonumber(ARGV[5]), tonumber(ARGV[6])
local out = {}
if limit > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now) end
local released = 0
while released < most do
  local head = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #head == 0 then break end
  if limit > 0 and redis.call('ZCARD', KEYS[5]) >= limit then break end
  local slot = now
  if interval > 0 then
    local at = tat()
    if at - now > horizon then break end
    slot = at
    take_token(interval, at)
  end
  local job = head[1]
  redis.call('ZREM', KEYS[1], job)
  local message = redis.call('HGET', KEYS[2], job)
  redis.call('HDEL', KEYS[2], job)
  redis.call('HINCRBY', KEYS[8], ARGV[7], -1)
  if limit > 0 then
    redis.call('ZADD', KEYS[5], slot + lease, job)
  else
    redis.call('HDEL', KEYS[9], job)
  end
  -- the grant tells its delivery that it was let in (and when), not merely redelivered
  redis.call('HSET', KEYS[3], job, string.format('%.6f', slot))
  redis.call('EXPIRE', KEYS[3], 86400)
  if message then
    out[#out + 1] = job
    out[#out + 1] = message
    out[#out + 1] = tostring(slot - now)
  end
  released = released + 1
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[7], gate)
  redis.call('SREM', KEYS[10], gate)
end
return out
"""
)

# KEYS: 1 wait, 2 messages, 3 grants, 4 holders, 5 QUEUES, 6 OWNER; ARGV: job, queue
# Takes a job out of its gate (cancelled while parked, finished, or dropped at claim): 1 when it
# was parked or held a slot.
FORGET = """
local job = ARGV[1]
local was = 0
if redis.call('ZREM', KEYS[1], job) == 1 then
  redis.call('HDEL', KEYS[2], job)
  redis.call('HINCRBY', KEYS[5], ARGV[2], -1)
  was = 1
end
redis.call('HDEL', KEYS[3], job)
if redis.call('ZREM', KEYS[4], job) == 1 then was = 1 end
redis.call('HDEL', KEYS[6], job)
return was
"""

# KEYS: 1 the bucket's runs of the last second (job id -> when its run began)
# ARGV: job, most per second, least seconds between two runs
# Returns 0 once the run may begin (recorded), else the seconds until it may: the last check
# before a rate-limited job's code runs, after its claim, so a stall that lets several claims
# finish together (a slow database) still starts no more than `most` in any second.
PACE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local most, spacing = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 1)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] and now - tonumber(last[2]) < spacing then
  return tostring(tonumber(last[2]) + spacing - now)
end
if redis.call('ZCARD', KEYS[1]) >= most then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(math.max(0.001, tonumber(oldest[2]) + 1 - now))
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2000)
return '0'
"""

# KEYS: 1 the per-task count of rate-limit waits, then each rate gate's wait
# ARGV: task, then for each of those gates its number of jobs and their ids
# Returns how many of the jobs still wait in their gate (counted under the task): run after the
# dispatches of an enqueue's park, in the same round trip, it counts the jobs parked there that
# wait for a later token (the backlot_rate_limit_waits metric).
WAITING = """
local waiting, at = 0, 2
for g = 2, #KEYS do
  local n = tonumber(ARGV[at])
  for i = at + 1, at + n do
    if redis.call('ZSCORE', KEYS[g], ARGV[i]) then waiting = waiting + 1 end
  end
  at = at + n + 1
end
if waiting > 0 then redis.call('HINCRBY', KEYS[1], ARGV[1], waiting) end
return waiting
"""
