"""The Lua scripts of admission (:class:`models.admission.Admission` registers and calls
them): each runs atomically in Redis and reads Redis' own clock (``TIME``), so every host
shares one clock and no two callers interleave within a script."""

from __future__ import annotations

# Shared by both scripts: may the route take one more delivery now? (budget, then rate)
LUA_COMMON = """
local prefix = ARGV[1]
-- Redis' own clock, read by the script: one round trip per call, not two.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local function fits(route, budget, interval)
    if redis.call('ZCARD', prefix .. 'f:' .. route) >= budget then return false end
    if interval > 0 then
        local tat = tonumber(redis.call('GET', prefix .. 'r:' .. route) or '0')
        if tat > now then return false end
        local ttl = math.ceil(interval) + 1000
        redis.call('SET', prefix .. 'r:' .. route, tostring(now + interval), 'PX', ttl)
    end
    return true
end
local function admit(route, id)
    redis.call('ZADD', prefix .. 'f:' .. route, now, id)
    redis.call('SADD', prefix .. 'routes', route)
    redis.call('ZREM', prefix .. 'w:' .. route, id)
end
"""

# Offer deliveries: ARGV 2.. = (route, id, budget, interval ms, held) per delivery. Answers
# per delivery: 'a' admitted (publish it), 'd' already in flight (do not), 'w' waiting.
ADMIT = (
    LUA_COMMON
    + """
local out = {}
for i = 2, #ARGV, 5 do
    local route, id = ARGV[i], ARGV[i + 1]
    local budget, interval = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    if redis.call('ZSCORE', prefix .. 'f:' .. route, id) then
        table.insert(out, 'd')
    elseif ARGV[i + 4] == '0' and fits(route, budget, interval) then
        admit(route, id)
        table.insert(out, 'a')
    else
        redis.call('ZADD', prefix .. 'w:' .. route, id, id)
        redis.call('SADD', prefix .. 'waiting', route)
        table.insert(out, 'w')
    end
end
return out
"""
)

# Admit waiting deliveries round-robin: ARGV 2 = most to admit, 3 = the elastic budget (the
# live workers' slots times ELASTIC_FACTOR), 4.. = (route, budget, interval ms, elastic 0/1)
# per route that may admit. A lone elastic route (the only one passed: no other route that
# may admit has deliveries waiting) takes the larger of its budget and the elastic one.
# Answers route, id, route, id, ... and, last, the earliest instant (ms) a rate-limited route
# may admit again (0: none waits on a rate).
DRAIN = (
    LUA_COMMON
    + """
local limit = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local routes = {}
for i = 4, #ARGV, 4 do
    table.insert(routes, {ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])})
end
if #routes == 1 and ARGV[7] == '1' and cap > routes[1][2] then routes[1][2] = cap end
local out, wake, count = {}, 0, 0
while #routes > 0 and count < limit do
    local still = {}
    for _, r in ipairs(routes) do
        if count < limit then
            local waiting = prefix .. 'w:' .. r[1]
            if redis.call('ZCARD', waiting) == 0 then
                redis.call('SREM', prefix .. 'waiting', r[1])
            elseif fits(r[1], r[2], r[3]) then
                local id = redis.call('ZRANGE', waiting, 0, 0)[1]
                admit(r[1], id)
                table.insert(out, r[1])
                table.insert(out, id)
                count = count + 1
                table.insert(still, r)
            elseif r[3] > 0 then
                local tat = tonumber(redis.call('GET', prefix .. 'r:' .. r[1]) or '0')
                if tat > now and (wake == 0 or tat < wake) then wake = tat end
            end
        end
    end
    routes = still
end
table.insert(out, tostring(wake))
return out
"""
)


# A dispatcher round's first call (:meth:`Admission.start_round`): free the finished
# deliveries' slots (ARGV 3.. = route, count, ids... per route), then answer the scheduled
# retries due by Redis' clock (at most ARGV 2) and the routes with deliveries waiting. One round
# trip where it was four (release, TIME, ZRANGEBYSCORE, SMEMBERS), every round.
ROUND = """
local prefix = ARGV[1]
local most = tonumber(ARGV[2])
local i = 3
while i <= #ARGV do
    local key, n = prefix .. 'f:' .. ARGV[i], tonumber(ARGV[i + 1])
    for first = i + 2, i + 1 + n, 1000 do
        redis.call('ZREM', key, unpack(ARGV, first, math.min(first + 999, i + 1 + n)))
    end
    i = i + 2 + n
end
local clock = redis.call('TIME')
local now = string.format('%.3f', tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', prefix .. 'd', '-inf', now, 'LIMIT', 0, most)
return {due, redis.call('SMEMBERS', prefix .. 'waiting')}
"""


# A lane's next head takes the slot its predecessor left (tasks.deliver.lane_heads): ARGV
# 2.. = (route, head, count, predecessor ids...) per lane. Each predecessor still in the
# route's in-flight set leaves it; when one did, the head enters it in the same step (the
# route's count unchanged: no dispatch round, no moment over the budget) and the answer is
# 'a'; when none did (its slot was freed already, or it was never admitted) the answer is
# 'u' and the set is left alone.
HAND_OVER = """
local prefix = ARGV[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local out = {}
local i = 2
while i <= #ARGV do
    local route, head, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
    local key = prefix .. 'f:' .. route
    local freed = 0
    for j = i + 3, i + 2 + n do
        freed = freed + redis.call('ZREM', key, ARGV[j])
    end
    if freed > 0 then
        redis.call('ZADD', key, now, head)
        redis.call('ZREM', prefix .. 'w:' .. route, head)
        table.insert(out, 'a')
    else
        table.insert(out, 'u')
    end
    i = i + 3 + n
end
return out
"""


# A reservation of the next call of a rate-limited route (ARGV 1 = the key, 2 = the interval
# in ms): answers how long (ms, Redis clock) the caller waits before its call.
PACE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local interval = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', ARGV[1]) or '0')
if tat < now then tat = now end
redis.call('SET', ARGV[1], tostring(tat + interval), 'PX', math.ceil(tat + interval - now) + 1000)
return tostring(tat - now)
"""


# The gate right before a call (ARGV 1 = the key, 2 = the interval in ms): passes (answers
# 0 and records the pass) when the route's last pass is at least the interval ago on Redis'
# clock, else answers the ms left.
GATE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local interval = tonumber(ARGV[2])
local last = tonumber(redis.call('GET', ARGV[1]) or '0')
if now - last < interval then return tostring(interval - (now - last)) end
redis.call('SET', ARGV[1], tostring(now), 'PX', math.ceil(interval) + 1000)
return '0'
"""
