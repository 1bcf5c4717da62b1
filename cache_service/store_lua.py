"""The draft cache's atomic operations on a session, as Lua scripts run inside Redis
(``cache_service.store`` holds the key layout and calls them).

PUSH_MANY (ARGV: the key prefix, the wake channel, then the chunks packed as
``store_records.packed_chunk`` packs them) appends each chunk, in order, if the session is the
device's (a device given: the cache's owner check in the same round trip) and its epoch and start
are current, within the window; its branches (alternatives to the kept tokens) are kept while the
session holds fewer than max_branches. Each chunk is answered apart ({kept, committed end} or
{negative code, message}): one refused, or failing, leaves the others stored.

COMMIT (a function of COMMIT_MANY's script: the session's key base and id, then the verdict as
COMMIT_MANY unpacks it, typed: epoch, n, packed token, done, start, first fix token, own branch
1/0, the draft tokens the step asked of the session or -1, finish, packed branch tokens, the
fix's further tokens as CSV; the ttl, the inbox's maxlen and the devices' key prefix from the
script's arguments) appends draft[:n]
+ branch + token to the committed tokens. A commit the draft held keeps the branches still
ahead; anything else (a rejection, a bonus token, a branch) is a fix: the draft and its branches
are dropped, the epoch moves on, and the drafter's inbox gets the fix (every commit reaches the
inbox, with what the step asked of the session: the drafter's lead follows it; but once a
drafter was told that a step asked none of a session, the commits that ask none after it do
not: the first that asks again carries all it missed, one fix from the end it knows when a fix
came meanwhile, else a commit; a rested board costs the server's core no event a step; a board
that attaches again is sent the session whole and told of every commit again:
``RedisSessionStore.told_afresh``). A verdict that
names a branch the draft does not hold is refused, unless the branch is the verifier's own (a
draft head's). A commit replayed after it landed (its reply lost with the connection) is
recognised by its position and last token and answered with code 2, not applied twice; any
other verdict for a finished session (closed: ended, cancelled, failed) is refused. These
rules are the in-process store's too (``edgespec.protocol.local_store``);
tests/test_store_contract.py holds the two stores to the same cases. The session's keys expire
ttl seconds after the commit that last crossed a multiple of 16 tokens (or finished it). """

PUSH_MANY_LUA = """
local prefix, wake, chunks = ARGV[1], ARGV[2], ARGV[3]
local function push(base, epoch, start, tokens, idle, window, maxbr, device, brs)
  local tokk, draftk, brk = base .. ':tok', base .. ':draft', base .. ':br'
  local h = redis.call('HMGET', base, 'epoch', 'done', 'idle', 'device')
  if not h[1] then return {-1, 'unknown session'} end
  if device ~= '' and h[4] ~= device then return {-6, 'not assigned to this device'} end
  if h[2] == '1' then return {-3, 'session is finished'} end
  if tonumber(h[1]) ~= epoch then
    return {-2, 'chunk from epoch ' .. epoch .. ', session is at epoch ' .. h[1]}
  end
  local endpos = redis.call('STRLEN', tokk) / 4
  local dlen = redis.call('STRLEN', draftk) / 4
  if start ~= endpos + dlen then
    return {-4, 'chunk starts at ' .. start .. ', the draft ends at ' .. (endpos + dlen)}
  end
  local keep = math.min(string.len(tokens) / 4, window - dlen)
  if keep < 0 then keep = 0 end
  if keep > 0 then
    redis.call('APPEND', draftk, string.sub(tokens, 1, keep * 4))
    local have = redis.call('LLEN', brk)
    local added = 0
    for i = 1, #brs, 2 do
      if have + added < maxbr and brs[i] < start + keep then
        redis.call('RPUSH', brk, brs[i + 1])
        added = added + 1
      end
    end
    -- the branch list is created here: it expires with the session, even if no commit follows
    local ttl = redis.call('PTTL', base)
    if ttl > 0 and added > 0 then redis.call('PEXPIRE', brk, ttl) end
  end
  idle = tostring(idle)
  redis.call('HSET', base, 'idle', idle)
  -- wake the verifier only for news, what may make a draft it waits for ready: kept tokens, or
  -- the drafter saying it has no more (an empty chunk repeated in a loop, or one flipping the
  -- flag back, must not keep it re-reading); the message names the session's key, so a waiting
  -- verifier reads again only the sessions that moved. The cache paces chunks with no news.
  local news = keep > 0 or (idle == '1' and h[3] ~= '1')
  if news then redis.call('PUBLISH', wake, base) end
  return {keep, endpos, news and 1 or 0}
end
local out, p = {}, 1
while p <= #chunks do
  local epoch, start, idle, window, maxbr, nb, sid, tokens, device
  epoch, start, idle, window, maxbr, nb, sid, tokens, device, p =
    struct.unpack('<i4i4i4i4i4i4i4c0i4c0i4c0', chunks, p)
  local brs = {}
  for i = 1, nb do
    brs[2 * i - 1], brs[2 * i], p = struct.unpack('<i4i4c0', chunks, p)
  end
  local ok, res = pcall(push, prefix .. 's:' .. sid, epoch, start, tokens, idle, window, maxbr,
                        device, brs)
  if not ok then res = {-7, type(res) == 'table' and res.err or tostring(res)} end
  out[#out + 1] = res
end
return out
"""

COMMIT_LUA = """
local function commit(base, sid, epoch_in, n, tok, done, start, first, own, want, finish, branch,
                      more)
local tokk, draftk, brk = base .. ':tok', base .. ':draft', base .. ':br'
local h = redis.call('HMGET', base, 'epoch', 'device', 'done', 'rest', 'hush', 'hushep')
if not h[1] then return {-1, 'unknown session'} end
local endpos = redis.call('STRLEN', tokk) / 4
local nbr = string.len(branch) / 4
if endpos == start + n + nbr + 1
    and redis.call('GETRANGE', tokk, endpos * 4 - 4, -1) == tok then
  return {2, tonumber(h[1]), endpos}
end
if h[3] == '1' then return {-3, 'session is finished'} end
if endpos ~= start then
  return {-4, 'verdict at ' .. start .. ', the session ends at ' .. endpos}
end
local epoch = tonumber(h[1])
if epoch ~= epoch_in then return {-2, 'verdict for a stale epoch'} end
local draft = redis.call('GET', draftk) or ''
local dlen = string.len(draft) / 4
if n > dlen then return {-4, 'accepted more tokens than were drafted'} end
if nbr > 0 and own ~= 1 then
  local held = false
  for _, b in ipairs(redis.call('LRANGE', brk, 0, -1)) do
    if struct.unpack('<I4', b) == start + n and string.sub(b, 5, 4 + nbr * 4) == branch then
      held = true
      break
    end
  end
  if not held then return {-5, 'the verdict accepted a branch the draft does not hold'} end
end
redis.call('APPEND', tokk, string.sub(draft, 1, n * 4) .. branch .. tok)
endpos = start + n + nbr + 1
local isfix = 1
if nbr == 0 and dlen > n and string.sub(draft, n * 4 + 1, n * 4 + 4) == tok then
  isfix = 0
  redis.call('SET', draftk, string.sub(draft, n * 4 + 5), 'KEEPTTL')
  -- keep the branches that are alternatives to tokens still ahead
  local all = redis.call('LRANGE', brk, 0, -1)
  local kept = {}
  for _, b in ipairs(all) do
    if struct.unpack('<I4', b) >= endpos then table.insert(kept, b) end
  end
  if #kept < #all then
    redis.call('DEL', brk)
    if #kept > 0 then  -- made anew: it expires with the session's hash
      redis.call('RPUSH', brk, unpack(kept))
      local pttl = redis.call('PTTL', base)
      if pttl > 0 then redis.call('PEXPIRE', brk, pttl) end
    end
  end
else
  -- an empty draft holds no branches (a chunk's branches lie within its tokens, and a commit
  -- the draft held keeps only those still ahead): nothing to drop (2 of 7 commands a verdict
  -- of a session without drafts)
  if dlen > 0 then
    redis.call('SET', draftk, '', 'KEEPTTL')
    redis.call('DEL', brk)
  end
  epoch = epoch + 1
  redis.call('HSET', base, 'epoch', epoch, 'idle', '0')
end
if done == 1 then redis.call('HSET', base, 'done', '1', 'finish', finish) end
if h[2] and h[2] ~= '' then
  if want == 0 and h[4] == '1' then
    -- the board was told that no step asks its drafts: it hears of what is committed meanwhile
    -- once a step asks again ('hush': the end it knows, 'hushep': the epoch it knows)
    if not h[5] then redis.call('HSET', base, 'hush', start, 'hushep', h[1]) end
  else
    local pos, f, f1, mo = start + n, isfix, first, more
    if h[5] then
      local from = tonumber(h[5])
      if epoch > tonumber(h[6]) then
        -- a fix came meanwhile: one fix from the end the board knows, every token since
        local toks = redis.call('GETRANGE', tokk, from * 4, endpos * 4 - 1)
        local rest = {}
        for i = 5, #toks, 4 do rest[#rest + 1] = struct.unpack('<I4', toks, i) end
        pos, f, f1, mo = from, 1, struct.unpack('<I4', toks), table.concat(rest, ',')
      end  -- else its draft held every token committed since: a commit says the new end
      redis.call('HDEL', base, 'hush', 'hushep')
    end
    -- a fix: roll back to pos, then append tok and the tokens in more
    redis.call('XADD', devprefix .. h[2] .. ':inbox', 'MAXLEN', '~', maxlen, '*', 't',
               'commit', 'sid', sid, 'epoch', epoch, 'end', endpos, 'fix', f, 'tok', f1,
               'pos', pos, 'more', mo, 'want', want)
    if want == 0 then redis.call('HSET', base, 'rest', '1')
    elseif h[4] then redis.call('HDEL', base, 'rest') end
  end
end
-- the keys' expiry moves on whenever the session's end crosses a multiple of 16 tokens (4
-- commands a session and step spared; every key keeps its expiry meanwhile)
if math.floor(endpos / 16) ~= math.floor(start / 16) or done == 1 then
  for _, key in ipairs({base, tokk, draftk, brk}) do redis.call('EXPIRE', key, ttl) end
end
return {isfix, epoch, endpos}
end
"""

# The verifier's two calls a step, each one script over all of the step's sessions: one command
# of four arguments whatever their number, packed both ways (encoding 64 sessions' 320 keys and
# as many arguments cost the client more than the script, and parsing a nested reply as much).
# The scripts make each session's keys from the key prefix and its id, as
# ``codec.KeyLayout`` does (a session's keys are not declared: neither script runs on a Redis
# cluster, whose slots a step's sessions would cross anyway), and a session's drafter's keys
# from the device its hash names.
#
# TAKE_MANY (ARGV[1]: the key prefix; ARGV[2]: per session '<i4i4' the draft bytes wanted (4 a
# token) and the branches wanted, then its id '<i4c0') returns one string: per session its
# header '<i4i4i4i4' (epoch, -1 when the session vanished; idle 0/1; committed bytes; 1 when it
# has a drafter that is alive), the draft's first bytes '<i4c0' (at most those wanted: whether
# the draft holds more does not matter to the step, so its length is not read), the number of
# branches '<i4' and each branch '<i4c0'. Atomic, as the transaction it replaces.
TAKE_MANY_LUA = """
local prefix, wants = ARGV[1], ARGV[2]
local out, p, alive = {}, 1, {}
while p <= #wants do
  local want, nbr, sid
  want, nbr, sid, p = struct.unpack('<i4i4i4c0', wants, p)
  local base = prefix .. 's:' .. sid
  local h = redis.call('HMGET', base, 'epoch', 'idle', 'device')
  local draft = ''
  if want > 0 then draft = redis.call('GETRANGE', base .. ':draft', 0, want - 1) end
  local branches = {}
  if nbr > 0 then branches = redis.call('LRANGE', base .. ':br', 0, nbr - 1) end
  local drafting = 0
  local device = h[3]
  if device and device ~= '' then
    if alive[device] == nil then  -- read once a script: a board's sessions share it
      alive[device] = redis.call('EXISTS', prefix .. 'dev:' .. device .. ':alive')
    end
    drafting = alive[device]
  end
  out[#out + 1] = struct.pack('<i4i4i4i4i4', h[1] and tonumber(h[1]) or -1,
                              h[2] == '1' and 1 or 0, redis.call('STRLEN', base .. ':tok'),
                              drafting, #draft)
  out[#out + 1] = draft
  out[#out + 1] = struct.pack('<i4', #branches)
  for _, b in ipairs(branches) do out[#out + 1] = struct.pack('<i4', #b) .. b end
end
return table.concat(out)
"""

# COMMIT_MANY (ARGV: the ttl, the inbox's maxlen, the key prefix, then one string: per verdict
# its numbers '<i4i4I4i4i4I4i4i4' (epoch, n, token, done, start, first fix token, own branch,
# wanted), then '<i4c0' each: its session id, finish reason, packed branch tokens, the fix's
# further tokens): COMMIT for each verdict in turn. Returns {per verdict '<i4i4i4' (COMMIT's
# three numbers, or the error's code and its message's index in the list), the messages}; a
# verdict whose commit raised (a key of the wrong type) is answered -6 in its slot, the others
# still land.
COMMIT_MANY_LUA = ("""
local ttl, maxlen, prefix, verdicts = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local devprefix = prefix .. 'dev:'
""" + COMMIT_LUA + """
local out, errors, p = {}, {}, 1
while p <= #verdicts do
  local epoch, n, tok, done, start, first, own, want, sid, finish, branch, more
  epoch, n, tok, done, start, first, own, want, sid, finish, branch, more, p =
    struct.unpack('<i4i4c4i4i4I4i4i4i4c0i4c0i4c0i4c0', verdicts, p)
  local ok, res = pcall(commit, prefix .. 's:' .. sid, sid, epoch, n, tok, done, start, first,
                        own, want, finish, branch, more)
  if not ok then res = {-6, type(res) == 'table' and res.err or tostring(res)} end
  if res[1] < 0 then
    errors[#errors + 1] = res[2]
    res = {res[1], #errors, 0}
  end
  out[#out + 1] = struct.pack('<i4i4i4', res[1], res[2], res[3])
end
return {table.concat(out), errors}
""")


# Forget drafters last seen before ARGV[1] that are not alive now, the longest unseen first.
# KEYS: the devices hash, the last-seen sorted set; ARGV[2]: the device key prefix ('es:dev:');
# ARGV[3]: most to read per call; ARGV[4]: most to forget.
PRUNE_LUA = """
local gone = {}
local most = tonumber(ARGV[4])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, dev in ipairs(old) do
  if #gone >= most then break end
  local base = ARGV[2] .. dev
  if redis.call('EXISTS', base .. ':alive') == 0 then
    redis.call('HDEL', KEYS[1], dev)
    redis.call('ZREM', KEYS[2], dev)
    redis.call('DEL', base .. ':sessions', base .. ':inbox')
    table.insert(gone, dev)
  end
end
return gone
"""

# A device's sessions that exist and are not done; the rest leave the set, whose expiry is
# refreshed. KEYS[1]: the set; ARGV[1]: the session key prefix ('es:s:'); ARGV[2]: TTL (s).
LIVE_SESSIONS_LUA = """
local live = {}
for _, sid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local done = redis.pcall('HGET', ARGV[1] .. sid, 'done')
  if type(done) == 'string' and done ~= '1' then
    table.insert(live, sid)
  else
    redis.call('SREM', KEYS[1], sid)
  end
end
if #live > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return live
"""
