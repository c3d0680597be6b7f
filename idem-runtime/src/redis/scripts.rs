//! The Lua scripts: one per state change, each reading the record, checking
//! the owner token (or generation) and only then writing, atomically on the
//! server. Times are the server's (`TIME`), never the client's.
//!
//! A record is a hash (see `docs/redis.md`): `v` (format, "1"), `state`, `fp`
//! (fingerprint, hex), `gen`, `token`, `lease_until` and `created` (server
//! milliseconds), `retention` (ms), `tenant`, `dkey` (the downstream key) and,
//! once finished, `status`, `headers` (JSON pairs) and `body`.
//!
//! `gen` is 1 when CLAIM writes a record where there was none, and one more at
//! each takeover; it is kept as long as the record is. A record that is gone
//! (released, or finished and expired with its retention) takes its `gen` with
//! it, and the next claim writes 1 again, as a SQL store does once the sweeper
//! has deleted a row. Every fence checks `token`, new at every claim and at a
//! lapse (RESOLVE checks `gen` with it), so a `gen` that starts again lets no
//! old write through.
//!
//! Every script validates what it read before its first write, so a record it
//! cannot read (foreign data, another format) is answered with an error and
//! left exactly as it was.
//!
//! The owner's scripts answer the same when sent twice (a cluster client
//! resends a command whose connection failed, though it may have run): a claim
//! that finds its own new token answers its acquisition again, a store or a
//! mark that finds its own token and state answers 1. Renewing twice is
//! harmless; a release sent again finds nothing and answers 0 (stale owner),
//! which gives the key up all the same.

/// Shared helpers, prepended to every script.
macro_rules! prelude {
    () => {
        r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(x) return string.format('%d', x) end
-- nil when absent; the record's fields when it is idem's; an error otherwise
local function load(k)
  if redis.call('EXISTS', k) == 0 then return nil end
  if redis.call('TYPE', k)['ok'] ~= 'hash' then
    return redis.error_reply('idem: the record at this key is not a hash; refusing to touch it')
  end
  local r = redis.call('HMGET', k, 'v', 'state', 'fp', 'gen', 'token', 'lease_until', 'retention')
  local rec = {v = r[1], state = r[2], fp = r[3], gen = tonumber(r[4]), token = r[5],
               lease_until = tonumber(r[6]), retention = tonumber(r[7])}
  if rec.v ~= '1' then
    return redis.error_reply('idem: not an idem record of format 1; refusing to touch it')
  end
  local s = rec.state
  if not (s == 'processing' or s == 'uncertain' or s == 'completed' or s == 'failed')
     or not rec.fp or not rec.gen or not rec.token or not rec.retention
     or (s == 'processing' and not rec.lease_until) then
    return redis.error_reply('idem: corrupt idem record (state or fields); refusing to touch it')
  end
  return rec
end
local function is_err(r) return type(r) == 'table' and r['err'] ~= nil end
"#
    };
}

/// A script over the record at `KEYS[1]`: the prelude, then `$body` with the
/// record loaded as `rec` (`nil` when there is none); a key that holds no idem
/// record answers its error before `$body` runs.
macro_rules! on_record {
    ($body:literal) => {
        concat!(
            prelude!(),
            "\nlocal rec = load(KEYS[1])\nif is_err(rec) then return rec end",
            $body
        )
    };
}

/// KEYS: record, the claim's give-up mark (`Layout::abandoned` of its new
/// token). ARGV: fingerprint, new token, lease ms, retention ms, tenant,
/// downstream key. Answers `{outcome, ...}`; `{'abandoned'}` when its caller
/// gave it up before it ran (ABANDON), writing nothing.
pub(super) const CLAIM: &str = concat!(
    prelude!(),
    r#"
-- Given up by its caller before it got here (queued behind a WAIT, or sent
-- again by a cluster client after its caller had stopped waiting): nobody
-- would hold the lease it writes, so it writes nothing.
if redis.call('EXISTS', KEYS[2]) == 1 then return {'abandoned'} end
local rec = load(KEYS[1])
if is_err(rec) then return rec end
local now = now_ms()
local lease = tonumber(ARGV[3])
local ret = tonumber(ARGV[4])
if not rec then
  redis.call('HSET', KEYS[1], 'v', '1', 'state', 'processing', 'fp', ARGV[1], 'gen', '1',
    'token', ARGV[2], 'lease_until', int(now + lease), 'created', int(now),
    'retention', ARGV[4], 'tenant', ARGV[5], 'dkey', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], int(lease + ret))
  return {'acquired', 1}
end
-- This very claim, sent again (a cluster client resends after a lost
-- connection or a failover): its own new token is there, so its own answer.
if rec.state == 'processing' and rec.token == ARGV[2] then
  if rec.gen == 1 then return {'acquired', 1} end
  return {'taken_over', rec.gen}
end
if rec.fp ~= ARGV[1] then return {'mismatch'} end
if rec.state == 'completed' or rec.state == 'failed' then
  local r = redis.call('HMGET', KEYS[1], 'status', 'headers', 'body')
  if not r[1] or not r[2] or not r[3] then
    return redis.error_reply('idem: corrupt idem record (a finished outcome without its response)')
  end
  return {'replay', r[1], r[2], r[3], int(rec.gen)}
end
if rec.state == 'uncertain' then return {'uncertain'} end
if rec.lease_until > now then return {'in_flight', int(rec.lease_until - now)} end
local gen = rec.gen + 1
redis.call('HSET', KEYS[1], 'gen', int(gen), 'token', ARGV[2], 'lease_until', int(now + lease),
  'retention', ARGV[4])
redis.call('PEXPIRE', KEYS[1], int(lease + ret))
return {'taken_over', gen}
"#
);

/// KEYS: record. ARGV: token, state, status, headers, body, retention ms.
pub(super) const STORE: &str = on_record!(
    r#"
-- This very store, sent again: the owner's outcome is there already.
if rec and rec.state == ARGV[2] and rec.token == ARGV[1] then return 1 end
if not rec or rec.state ~= 'processing' or rec.token ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'status', ARGV[3], 'headers', ARGV[4],
  'body', ARGV[5], 'retention', ARGV[6])
redis.call('HDEL', KEYS[1], 'lease_until')
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
"#
);

/// KEYS: record. ARGV: token, lease ms.
pub(super) const RENEW: &str = on_record!(
    r#"
if not rec or rec.state ~= 'processing' or rec.token ~= ARGV[1] then return 0 end
local lease = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_until', int(now_ms() + lease))
redis.call('PEXPIRE', KEYS[1], int(lease + rec.retention))
return 1
"#
);

/// KEYS: records of one slot (one operation's shard). ARGV: each record's
/// token and lease ms, in the order of KEYS. Answers per record 1 (renewed),
/// 0 (not this owner's lease any more) or -1 (a record it cannot read, left
/// as it was): RENEW for a batch, in one call instead of one per lease.
pub(super) const RENEW_MANY: &str = concat!(
    prelude!(),
    r#"
local now = now_ms()
local out = {}
for i, k in ipairs(KEYS) do
  local rec = load(k)
  if is_err(rec) then
    out[i] = -1
  elseif not rec or rec.state ~= 'processing' or rec.token ~= ARGV[2 * i - 1] then
    out[i] = 0
  else
    local lease = tonumber(ARGV[2 * i])
    redis.call('HSET', k, 'lease_until', int(now + lease))
    redis.call('PEXPIRE', k, int(lease + rec.retention))
    out[i] = 1
  end
end
return out
"#
);

/// KEYS: record, uncertain index. ARGV: token, index member.
pub(super) const UNCERTAIN: &str = on_record!(
    r#"
-- This very mark, sent again: the record and its entry are there already.
if rec and rec.state == 'uncertain' and rec.token == ARGV[1] then return 1 end
if not rec or rec.state ~= 'processing' or rec.token ~= ARGV[1] then return 0 end
local now = now_ms()
redis.call('HSET', KEYS[1], 'state', 'uncertain', 'uncertain_at', int(now))
redis.call('HDEL', KEYS[1], 'lease_until')
-- never expires before it is reconciled
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[2], int(now), ARGV[2])
return 1
"#
);

/// KEYS: record. ARGV: token, the fresh token. Ends the lease now (the next
/// claim takes the record over) under the fresh token, so that a renewal of
/// the old one already on its way finds it lost rather than extend it.
pub(super) const LAPSE: &str = on_record!(
    r#"
-- This very lapse, sent again: done already.
if rec and rec.state == 'processing' and rec.token == ARGV[2] then return 1 end
if not rec or rec.state ~= 'processing' or rec.token ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', int(now_ms()), 'token', ARGV[2])
redis.call('PEXPIRE', KEYS[1], int(rec.retention))
return 1
"#
);

/// KEYS: record. ARGV: token.
pub(super) const RELEASE: &str = on_record!(
    r#"
if not rec or rec.state ~= 'processing' or rec.token ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#
);

/// KEYS: record, the claim's give-up mark. ARGV: the claim's token, the mark's
/// life in ms. Gives back a claim whose caller will not use it: its answer
/// never came (a timeout, a dropped connection) or its replicas did not
/// acknowledge it. The mark is written first, so a claim that has not run yet
/// never does (CLAIM reads it); a claim that ran, found by its token, is
/// undone: a record it created is deleted, one it took over has its lease
/// lapse now, so the next claim takes it over at once and is still told an
/// earlier execution may have run. Answers 1 when it undid a claim, 0 when
/// there was none of that token (yet) to undo.
pub(super) const ABANDON: &str = on_record!(
    r#"
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
if not rec or rec.state ~= 'processing' or rec.token ~= ARGV[1] then return 0 end
if rec.gen == 1 then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'lease_until', int(now_ms()))
end
return 1
"#
);

/// KEYS: record, uncertain index. ARGV: member, generation, token, "1" to
/// store (then state, status, headers, body) or "0" to forget the key.
pub(super) const RESOLVE: &str = on_record!(
    r#"
if not rec then
  -- the record is gone (deleted by hand, or the server lost it): so is its entry
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
if rec.state ~= 'uncertain' or int(rec.gen) ~= ARGV[2] or rec.token ~= ARGV[3] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
if ARGV[4] == '1' then
  -- The token is no claim's any more: a store sent again by the execution
  -- that marked it uncertain finds the reconciler's outcome, not its own.
  redis.call('HSET', KEYS[1], 'state', ARGV[5], 'status', ARGV[6], 'headers', ARGV[7], 'body', ARGV[8],
    'token', 'resolved')
  redis.call('PEXPIRE', KEYS[1], int(rec.retention))
else
  redis.call('DEL', KEYS[1])
end
return 1
"#
);

/// KEYS: record, uncertain index. ARGV: index member. Removes the entry unless
/// the record is uncertain (now, under the script's atomicity): a stale entry
/// (its record resolved, re-executed or gone) would otherwise stay for ever.
pub(super) const PRUNE: &str = r#"
if redis.call('TYPE', KEYS[1])['ok'] == 'hash'
   and redis.call('HGET', KEYS[1], 'state') == 'uncertain' then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"#;

/// KEYS: record, its shard's uncertain index. ARGV: the record's index entry,
/// `1` to erase a record in flight too. Deletes the record and its index entry
/// (1); leaves a record in flight (`processing`, its lease live or lapsed: a
/// lapsed one's retry is a takeover, not a new key) or whose outcome is
/// uncertain unless `ARGV[2]` is `1` (-1); 0 when there is no record.
pub(super) const ERASE: &str = on_record!(
    r#"
if not rec then return 0 end
if ARGV[2] ~= '1' then
  if rec.state == 'uncertain' then return -1 end
  if rec.state == 'processing' then return -1 end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"#
);

/// KEYS: record. ARGV: the generation and the body the rekey read, then the
/// re-sealed headers and body, then the record's `created` as read (empty
/// where it had none). Writes them only over the same finished execution's
/// same answer (run again, purged or re-sealed meanwhile: 0; a record expired
/// and claimed again has generation 1 again, but another `created`); the
/// record's expiry stays. Answers 1 when it wrote.
pub(super) const REKEY: &str = on_record!(
    r#"
if not rec then return 0 end
if (rec.state ~= 'completed' and rec.state ~= 'failed') or int(rec.gen) ~= ARGV[1] then return 0 end
if (redis.call('HGET', KEYS[1], 'created') or '') ~= ARGV[5] then return 0 end
if redis.call('HGET', KEYS[1], 'body') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'headers', ARGV[3], 'body', ARGV[4])
return 1
"#
);
