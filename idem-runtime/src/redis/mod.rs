//! A Redis store for leased mode (feature `redis`): for a service whose effect
//! lives entirely downstream (a provider call) and that keeps no SQL database
//! of its own.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_runtime::StoreError> {
//! use idem_runtime::redis::{Redis, RedisLeaseStore};
//!
//! let store = RedisLeaseStore::connect("redis://127.0.0.1:6379").await?;
//! let idem: idem_runtime::Idem<Redis> = store.idem();
//! // handlers: #[idempotent(operation = "create-payment", lease = "30s")]
//! //           async fn pay(lease: &mut idem_runtime::Lease<Redis>, ...) -> ...
//! # Ok(()) }
//! ```
//!
//! Every state change is one Lua script that compares the owner token (or the
//! generation) before it writes; lease expiry is counted on the server's clock.
//! A raw idempotency key is never sent to Redis: records are named by tenant,
//! operation and the key's SHA-256 digest, and hold the downstream key for the
//! reconciler. What Redis cannot promise (a failover that loses acknowledged
//! writes, eviction under `maxmemory`, a restart without persistence) is in
//! `docs/redis.md`; [`RedisLeaseStore::connect`] refuses a server older than
//! 6.2 ([`MIN_REDIS_VERSION`]) and an eviction policy that may drop any key, and
//! warns on one that may drop keys with a TTL.
//!
//! A record's generation counts its executions while it is kept, as on SQL: 1
//! for a claim that finds no record, one more at each takeover. A finished
//! record expires with its retention, and the next claim of its key starts
//! again at generation 1 (`Acquisition::New`), as a SQL store's does once its
//! sweeper has deleted the row (before that, SQL reclaims at the next
//! generation; Redis never answers `Reclaimed`). See `docs/redis.md`.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Script, Value};

use crate::config::Idem;
use crate::key::{IdempotencyKey, KeyDigest};
use crate::lease::{LeaseBackend, LeasedClaim};
use crate::model::{
    Acquisition, Fence, KeyAddress, LeaseRequest, LeasedOutcome, OperationRow, Owned, StoreError,
    StoredResponse, millis,
};
use crate::reconcile::UncertainOutcome;

mod scripts;

/// Leased mode on Redis: the type parameter of `Lease<Redis>`, `Idem<Redis>`
/// and `Reconciler<R, Redis>`. Never a value.
#[derive(Debug)]
pub enum Redis {}

/// The records of leased mode in one Redis server, under a key prefix.
///
/// Cheap to clone (a [`ConnectionManager`] multiplexes one connection and
/// reconnects by itself).
#[derive(Clone)]
pub struct RedisLeaseStore {
    conn: ConnectionManager,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
}

impl std::fmt::Debug for RedisLeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLeaseStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

struct Scripts {
    claim: Script,
    store: Script,
    renew: Script,
    uncertain: Script,
    release: Script,
    resolve: Script,
    prune: Script,
}

/// What the start-up check makes of the server's eviction settings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionVerdict {
    /// Nothing idem keeps can be evicted.
    Safe,
    /// Something may be evicted, or the settings could not be read; why.
    Warn(String),
    /// Any record may be evicted, uncertain ones included; why.
    Refuse(String),
}

/// Judges a server's `maxmemory-policy` and `maxmemory` (bytes, 0 = no limit).
///
/// * `noeviction`: safe.
/// * `allkeys-*`: refused, whatever `maxmemory` is now: any record may go, an
///   in-flight lease (a retry then runs concurrently) or an uncertain outcome
///   (which then never gets reconciled) alike; a later `CONFIG SET maxmemory`
///   would turn it on without a word.
/// * `volatile-*`: a warning when `maxmemory` is set: only keys with a TTL may
///   go (finished outcomes and in-flight leases; an uncertain record has none),
///   and a retry of an evicted key runs again with the same downstream key.
/// * anything else: a warning.
pub fn eviction_verdict(policy: &str, maxmemory: u64) -> EvictionVerdict {
    let policy = policy.to_ascii_lowercase();
    if policy == "noeviction" {
        EvictionVerdict::Safe
    } else if policy.starts_with("allkeys-") {
        EvictionVerdict::Refuse(format!(
            "maxmemory-policy is {policy}: Redis may evict any of idem's records, uncertain \
             outcomes and live leases included; set it to noeviction (or volatile-*)"
        ))
    } else if policy.starts_with("volatile-") {
        if maxmemory == 0 {
            EvictionVerdict::Safe
        } else {
            EvictionVerdict::Warn(format!(
                "maxmemory-policy is {policy} with maxmemory {maxmemory}: finished outcomes \
                 and live leases may be evicted before their time; a retry of such a key \
                 executes again, even while its first execution still runs (with the same \
                 downstream key, so only a provider honouring it keeps the effect single)"
            ))
        }
    } else {
        EvictionVerdict::Warn(format!(
            "maxmemory-policy {policy:?} is not one idem knows; it may evict idem's records"
        ))
    }
}

/// The oldest Redis the store runs on: 6.2, the first with `ZRANGE ...
/// BYSCORE`, which lists uncertain records for the reconciler. (The scripts
/// themselves need 5.0: `redis.call('TIME')` before a write.)
pub const MIN_REDIS_VERSION: (u32, u32) = (6, 2);

/// What the start-up check makes of the server's version.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VersionVerdict {
    /// [`MIN_REDIS_VERSION`] or newer: the version the server reports.
    Supported(String),
    /// The version could not be read; why (a warning).
    Unknown(String),
    /// Older than [`MIN_REDIS_VERSION`]; why.
    Refuse(String),
}

/// Judges the text of `INFO server` by its `redis_version` line: 6.2 or newer
/// is supported, anything older refused; no such line, or a version that is
/// not `major.minor...`, is unknown (a warning: a server that does not say
/// may still be recent).
pub fn version_verdict(info_server: &str) -> VersionVerdict {
    let Some(version) = info_server
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))
        .map(str::trim)
    else {
        return VersionVerdict::Unknown(
            "INFO server names no redis_version: the server's version is unknown; the store \
             needs Redis 6.2 or newer"
                .into(),
        );
    };
    // Each part's leading digits: "7.2.0", "7.4-rc1"...
    let number = |part: Option<&str>| -> Option<u32> {
        let part = part?;
        let digits = part.len() - part.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        part[..digits].parse().ok()
    };
    let mut parts = version.split('.');
    match (number(parts.next()), number(parts.next())) {
        (Some(major), Some(minor)) if (major, minor) >= MIN_REDIS_VERSION => {
            VersionVerdict::Supported(version.to_owned())
        }
        (Some(_), Some(_)) => VersionVerdict::Refuse(format!(
            "Redis {version} is older than 6.2, which the store needs (the reconciler lists \
             uncertain records with ZRANGE ... BYSCORE); upgrade the server"
        )),
        _ => VersionVerdict::Unknown(format!(
            "redis_version {version:?} is not a version idem can read; the store needs Redis \
             6.2 or newer"
        )),
    }
}

fn redis_err(e: redis::RedisError) -> StoreError {
    StoreError::Redis(Box::new(e))
}

fn refused(why: String) -> StoreError {
    StoreError::Redis(why.into())
}

/// A record's or index's name part: letters, digits, `.`, `_` and `-` as they
/// are, every other byte as `%XX`; so `:`, `{` and `}` never appear and two
/// different (tenant, operation) pairs never share a name.
fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl RedisLeaseStore {
    /// Connects to `url` (`redis://host:port/db`), with the prefix `idem`, and
    /// runs the start-up check (see [`RedisLeaseStore::with_connection`]).
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis cannot be reached, is older than 6.2
    /// or its eviction policy may drop any key.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_prefix(url, "idem").await
    }

    /// [`RedisLeaseStore::connect`] with another key prefix.
    ///
    /// # Errors
    ///
    /// As [`RedisLeaseStore::connect`].
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(redis_err)?;
        let conn = ConnectionManager::new(client).await.map_err(redis_err)?;
        Self::with_connection(conn, prefix).await
    }

    /// Uses `conn`, naming every key `{prefix}:...` (give each service, or each
    /// test, its own prefix; it may not contain `{` or `}`), after checking the
    /// server's version and eviction settings: a server older than 6.2
    /// ([`MIN_REDIS_VERSION`]) is refused, and so is an `allkeys-*` policy; a
    /// `volatile-*` one with `maxmemory` set is logged as a warning, and so is a
    /// server that does not let `INFO` or `CONFIG GET` be read (as managed ones
    /// may not).
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when the version or the policy is refused, the
    /// prefix unusable or Redis unreachable.
    pub async fn with_connection(
        conn: ConnectionManager,
        prefix: &str,
    ) -> Result<Self, StoreError> {
        if prefix.is_empty() || prefix.contains(['{', '}']) {
            return Err(refused(format!(
                "the key prefix {prefix:?} must be non-empty and hold no `{{` or `}}`"
            )));
        }
        let store = RedisLeaseStore {
            conn,
            prefix: prefix.into(),
            scripts: Arc::new(Scripts {
                claim: Script::new(scripts::CLAIM),
                store: Script::new(scripts::STORE),
                renew: Script::new(scripts::RENEW),
                uncertain: Script::new(scripts::UNCERTAIN),
                release: Script::new(scripts::RELEASE),
                resolve: Script::new(scripts::RESOLVE),
                prune: Script::new(scripts::PRUNE),
            }),
        };
        match store.check_version().await? {
            VersionVerdict::Supported(_) => {}
            VersionVerdict::Unknown(why) => tracing::warn!("idem: redis: {why}"),
            VersionVerdict::Refuse(why) => return Err(refused(why)),
        }
        match store.check_eviction().await? {
            EvictionVerdict::Safe => {}
            EvictionVerdict::Warn(why) => tracing::warn!("idem: redis: {why}"),
            EvictionVerdict::Refuse(why) => return Err(refused(why)),
        }
        Ok(store)
    }

    /// Reads the server's version (`INFO server`) and judges it
    /// ([`version_verdict`]); a server that refuses `INFO` gets a warning, not
    /// a refusal.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis cannot be reached.
    pub async fn check_version(&self) -> Result<VersionVerdict, StoreError> {
        let info: Result<String, _> = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut self.conn.clone())
            .await;
        Ok(match info {
            Ok(info) => version_verdict(&info),
            Err(e) if e.is_io_error() || e.is_connection_dropped() => return Err(redis_err(e)),
            Err(e) => VersionVerdict::Unknown(format!(
                "INFO server was refused ({e}): the server's version is unknown; the store \
                 needs Redis 6.2 or newer"
            )),
        })
    }

    /// Reads the server's eviction settings and judges them
    /// ([`eviction_verdict`]); a server that refuses `CONFIG GET` gets a
    /// warning, not a refusal.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis cannot be reached.
    pub async fn check_eviction(&self) -> Result<EvictionVerdict, StoreError> {
        let mut conn = self.conn.clone();
        let read = async {
            let policy: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory-policy")
                .query_async(&mut conn)
                .await?;
            let max: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory")
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>((policy, max))
        };
        Ok(match read.await {
            Ok((policy, max)) => match (policy.get(1), max.get(1)) {
                (Some(policy), Some(max)) => {
                    eviction_verdict(policy, max.parse::<u64>().unwrap_or(u64::MAX))
                }
                _ => EvictionVerdict::Warn(
                    "CONFIG GET answered nothing: the eviction policy is unknown; make sure it \
                     is noeviction"
                        .into(),
                ),
            },
            Err(e) if e.is_io_error() || e.is_connection_dropped() => return Err(redis_err(e)),
            Err(e) => EvictionVerdict::Warn(format!(
                "CONFIG GET was refused ({e}): the eviction policy is unknown; make sure it is \
                 noeviction"
            )),
        })
    }

    /// An [`Idem`] whose leased handlers (`&mut Lease<Redis>`) run on this
    /// store, with the default settings.
    ///
    /// It has the settings of leased mode and of the answers (stored headers,
    /// response limit, tenant label, waiting-room limits), and none of the SQL
    /// transaction's: the in-flight wait, the request deadline and claims at
    /// commit configure a transaction a Redis lease never has, so they are not
    /// there to be set by mistake.
    ///
    /// ```compile_fail
    /// # fn demo(store: idem_runtime::redis::RedisLeaseStore) {
    /// let idem = store.idem().with_in_flight_wait(std::time::Duration::from_secs(1));
    /// # }
    /// ```
    pub fn idem(&self) -> Idem<Redis> {
        Idem::on_store(self.clone())
    }

    /// Claims `req.key` in leased mode on this store (the Redis
    /// [`crate::claim_leased`]).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis fails or holds a record it cannot read;
    /// nothing is claimed then.
    pub async fn claim(&self, req: &LeaseRequest<'_>) -> Result<LeasedClaim<Redis>, StoreError> {
        crate::lease::claim_in::<Redis>(self, req).await
    }

    /// The connection, for the service's own commands (and tests).
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// The name of the record of `key` (no raw key in it: its digest).
    pub fn record_key(&self, tenant: &str, operation: &str, key: &IdempotencyKey) -> String {
        self.record_name(tenant, operation, &key.digest().to_string())
    }

    /// The name of `operation`'s index of uncertain records (a sorted set by
    /// the time they became uncertain).
    pub fn uncertain_index(&self, operation: &str) -> String {
        format!("{}:{{{}}}:uncertain", self.prefix, escape(operation))
    }

    // The operation is the hash tag: one operation's records and its index are
    // in one cluster slot, so every script's keys are.
    fn record_name(&self, tenant: &str, operation: &str, digest: &str) -> String {
        format!(
            "{}:{{{}}}:r:{}",
            self.prefix,
            escape(operation),
            member(tenant, digest)
        )
    }

    fn owned_name(&self, row: &Owned<'_>) -> String {
        self.record_name(row.tenant, row.operation, &row.key.to_string())
    }
}

/// An entry of an uncertain index, as the listing reads it.
enum Entry {
    /// For the reconciler: an uncertain record, or one it cannot ask about
    /// (`broken`), which the round counts as an error.
    Listed(RedisUncertain),
    /// Its record is no longer uncertain, or gone: the entry is to be pruned.
    Stale { name: String, member: String },
}

impl RedisLeaseStore {
    /// Reads the records of `chunk`'s index entries in one pipeline and tells,
    /// entry by entry in the chunk's order, which are listed and which stale.
    async fn read_entries(
        &self,
        operation: &str,
        index: &str,
        chunk: Vec<(String, f64)>,
    ) -> Result<Vec<Entry>, StoreError> {
        // An entry names its record by `tenant:digest`; one without the `:`
        // names no record idem writes.
        let names: Vec<Option<String>> = chunk
            .iter()
            .map(|(m, _)| {
                m.contains(':')
                    .then(|| format!("{}:{{{}}}:r:{m}", self.prefix, escape(operation)))
            })
            .collect();
        let mut pipe = redis::pipe();
        // A foreign value at a record's name (not a hash) is one broken entry,
        // not an error of the whole page, which would starve the others.
        pipe.ignore_errors();
        for name in names.iter().flatten() {
            pipe.cmd("HMGET")
                .arg(name)
                .arg(&["state", "gen", "token", "tenant", "dkey"]);
        }
        let reads = names.iter().flatten().count();
        let replies: Vec<redis::RedisResult<Vec<Value>>> = if reads == 0 {
            Vec::new()
        } else {
            pipe.query_async(&mut self.conn.clone())
                .await
                .map_err(redis_err)?
        };
        let mut replies = replies.into_iter();
        let broken = |member: String, score: f64, digest: &str, why: &'static str| {
            Entry::Listed(RedisUncertain {
                member,
                score,
                tenant: String::new(),
                digest: digest.to_owned(),
                downstream_key: String::new(),
                generation: 0,
                token: String::new(),
                broken: Some(why),
            })
        };
        let mut entries = Vec::with_capacity(chunk.len());
        for ((m, score), name) in chunk.into_iter().zip(names) {
            let (Some(name), Some((tenant_esc, digest))) = (name, m.rsplit_once(':')) else {
                tracing::warn!(index = %index, "idem: redis: a foreign entry in the uncertain index; counted as an error and left as it is");
                entries.push(broken(
                    m,
                    score,
                    "",
                    "an uncertain index entry that names no record (no `tenant:` part); left for a person to look at",
                ));
                continue;
            };
            let (tenant_esc, digest) = (tenant_esc.to_owned(), digest.to_owned());
            let fields: Vec<Option<String>> = match replies.next() {
                Some(Ok(r)) => r.iter().map(text).collect(),
                Some(Err(e)) => {
                    tracing::warn!(index = %index, error = %e, "idem: redis: an uncertain index entry whose record cannot be read");
                    vec![Some("uncertain".to_owned())]
                }
                None => return Err(corrupt("the uncertain index's records: a reply short")),
            };
            match &fields[..] {
                // A generation that is not a number is a broken record (below),
                // not an error of the whole page, which would starve the others.
                [Some(state), Some(g), Some(token), Some(tenant), Some(dkey)]
                    if state == "uncertain"
                        && escape(tenant) == tenant_esc
                        && g.parse::<i64>().is_ok() =>
                {
                    entries.push(Entry::Listed(RedisUncertain {
                        member: m,
                        score,
                        tenant: tenant.clone(),
                        digest,
                        downstream_key: dkey.clone(),
                        generation: g.parse().unwrap_or_default(),
                        token: token.clone(),
                        broken: None,
                    }))
                }
                // Listed, so that describing it fails and the round reports (and
                // counts) an error, as on SQL; it is never resolved.
                [Some(state), ..] if state == "uncertain" => entries.push(broken(
                    m,
                    score,
                    &digest,
                    "an uncertain record without its fields (or with a malformed one); left for a person to look at",
                )),
                // Not uncertain any more (resolved or re-executed meanwhile), or
                // gone (a restart without persistence, a hand deletion): the
                // entry is pruned.
                _ => entries.push(Entry::Stale { name, member: m }),
            }
        }
        Ok(entries)
    }

    /// Removes stale index entries, in one pipeline of scripts that each check
    /// the record again, so an execution that became uncertain since keeps its
    /// entry. A failure is logged and leaves the entries for a later round.
    async fn prune(&self, index: &str, stale: &[(String, String)]) {
        if stale.is_empty() {
            return;
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        // EVALSHA in a pipeline does not load a script the server lacks.
        pipe.load_script(&self.scripts.prune).ignore();
        for (name, member) in stale {
            let mut inv = self.scripts.prune.key(name);
            inv.key(index).arg(member);
            pipe.invoke_script(&inv);
        }
        let done: Result<Vec<redis::RedisResult<u64>>, _> =
            pipe.query_async(&mut self.conn.clone()).await;
        let failed = match done {
            Ok(results) => results.into_iter().find_map(Result::err),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            tracing::warn!(index = %index, error = %e, "idem: redis: entries of the uncertain index without their records; left as they are");
        }
    }
}

/// Refuses a hand-written request whose lease or retention is under a
/// millisecond (zero included): the store counts whole milliseconds, so either
/// would be zero to it, a lease that lapses as it is claimed (the next claim
/// takes the execution over at once) or an outcome forgotten as it is stored.
/// (`#[idempotent]` refuses such durations where it is written.)
fn refuse_under_a_millisecond(req: &LeaseRequest<'_>) -> Result<(), StoreError> {
    for (what, d, why) in [
        (
            "lease",
            req.lease,
            "it would lapse as it is claimed, and the next claim would take the execution over",
        ),
        (
            "retention",
            req.retention,
            "the outcome would be forgotten as it is stored, and a retry would execute again",
        ),
    ] {
        if d < Duration::from_millis(1) {
            return Err(refused(format!(
                "a {what} of {d:?} is refused: the Redis store counts whole milliseconds and \
                 needs at least 1 ms; {why}"
            )));
        }
    }
    Ok(())
}

/// A duration as the scripts take it: at least 1 ms (a claim refuses less, so
/// a lease's own renewals and completion never send less; `PEXPIRE 0` would
/// delete the record) and at most a century (Lua's numbers are doubles, and
/// `string.format('%d')` of one past 2^63 is undefined: the record could get a
/// negative expiry, which deletes it).
fn script_ms(d: Duration) -> i64 {
    const CENTURY_MS: i64 = 100 * 365 * 24 * 3600 * 1000;
    millis(d).clamp(1, CENTURY_MS)
}

/// A record's entry in its operation's uncertain index.
fn member(tenant: &str, digest: &str) -> String {
    format!("{}:{digest}", escape(tenant))
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("redis record: {what}"))
}

/// A finished outcome from its stored fields.
fn stored_from(
    status: &Value,
    headers: &Value,
    body: &Value,
) -> Result<StoredResponse, StoreError> {
    let status = int(status)
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupt("status"))?;
    let headers: Vec<(String, String)> = text(headers)
        .and_then(|h| serde_json::from_str(&h).ok())
        .ok_or_else(|| corrupt("headers"))?;
    let body = match body {
        Value::BulkString(b) => bytes::Bytes::from(b.clone()),
        _ => return Err(corrupt("body")),
    };
    Ok(StoredResponse {
        status,
        headers,
        body,
    })
}

fn new_token() -> String {
    format!("{:032x}", fastrand::u128(..))
}

/// An uncertain record as the reconciler lists it on Redis.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct RedisUncertain {
    member: String,
    score: f64,
    tenant: String,
    digest: String,
    downstream_key: String,
    /// The record's `gen`: its executions while it is kept (it starts again at
    /// 1 once the record is gone, as on SQL once a row is swept).
    generation: i64,
    token: String,
    /// Why this uncertain record cannot be reconciled (a field gone), if so:
    /// listed all the same, so the round counts it as an error as it does a SQL
    /// row without its downstream key, rather than skip it in silence.
    broken: Option<&'static str>,
}

impl LeaseBackend for Redis {
    type Store = RedisLeaseStore;
    type UncertainRow = RedisUncertain;

    async fn lease_claim(
        store: &RedisLeaseStore,
        req: &LeaseRequest<'_>,
    ) -> Result<LeasedOutcome, StoreError> {
        refuse_under_a_millisecond(req)?;
        let name = store.record_key(req.tenant, req.operation, req.key);
        let token = new_token();
        let downstream = crate::lease::downstream_key(req.tenant, req.operation, req.key);
        let reply: Vec<Value> = store
            .scripts
            .claim
            .key(&name)
            .arg(hex::encode(req.fingerprint.as_bytes()))
            .arg(&token)
            .arg(script_ms(req.lease))
            .arg(script_ms(req.retention))
            .arg(req.tenant)
            .arg(downstream)
            .invoke_async(&mut store.conn.clone())
            .await
            .map_err(redis_err)?;
        let outcome = reply.first().and_then(text).unwrap_or_default();
        let acquired = |acquisition| -> Result<LeasedOutcome, StoreError> {
            Ok(LeasedOutcome::Acquired {
                acquisition,
                token: token.clone().into(),
                generation: reply
                    .get(1)
                    .and_then(int)
                    .ok_or_else(|| corrupt("generation"))?,
            })
        };
        match outcome.as_str() {
            "acquired" => acquired(Acquisition::New),
            "taken_over" => acquired(Acquisition::TakenOver),
            "replay" => match &reply[1..] {
                [status, headers, body] => {
                    Ok(LeasedOutcome::Replay(stored_from(status, headers, body)?))
                }
                _ => Err(corrupt("replay")),
            },
            "mismatch" => Ok(LeasedOutcome::Mismatch),
            "uncertain" => Ok(LeasedOutcome::Uncertain),
            "in_flight" => {
                let ms = reply.get(1).and_then(int).unwrap_or(1000);
                Ok(LeasedOutcome::InFlight {
                    retry_after: Duration::from_millis(u64::try_from(ms).unwrap_or(1000)),
                })
            }
            other => Err(corrupt(&format!("claim outcome {other:?}"))),
        }
    }

    async fn lease_store(
        store: &RedisLeaseStore,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<u64, StoreError> {
        let headers = serde_json::to_string(&response.headers)
            .map_err(|e| StoreError::Corrupt(format!("headers: {e}")))?;
        let n: u64 = store
            .scripts
            .store
            .key(store.owned_name(&row))
            .arg(row.token)
            .arg(response.state())
            .arg(response.status)
            .arg(headers)
            .arg(&response.body[..])
            .arg(script_ms(retention))
            .invoke_async(&mut store.conn.clone())
            .await
            .map_err(redis_err)?;
        Ok(n)
    }

    async fn lease_fence(
        store: &RedisLeaseStore,
        row: Owned<'_>,
        what: Fence,
    ) -> Result<u64, StoreError> {
        let name = store.owned_name(&row);
        let mut conn = store.conn.clone();
        let n: u64 = match what {
            Fence::Renew(lease) => {
                store
                    .scripts
                    .renew
                    .key(&name)
                    .arg(row.token)
                    .arg(script_ms(lease))
                    .invoke_async(&mut conn)
                    .await
            }
            Fence::Uncertain => {
                store
                    .scripts
                    .uncertain
                    .key(&name)
                    .key(store.uncertain_index(row.operation))
                    .arg(row.token)
                    .arg(member(row.tenant, &row.key.to_string()))
                    .invoke_async(&mut conn)
                    .await
            }
            Fence::Release => {
                store
                    .scripts
                    .release
                    .key(&name)
                    .arg(row.token)
                    .invoke_async(&mut conn)
                    .await
            }
        }
        .map_err(redis_err)?;
        Ok(n)
    }

    async fn lease_current(
        store: &RedisLeaseStore,
        tenant: &str,
        operation: &str,
        key: &KeyDigest,
    ) -> Result<Option<(Vec<u8>, StoredResponse)>, StoreError> {
        let name = store.record_name(tenant, operation, &key.to_string());
        let r: Vec<Value> = redis::cmd("HMGET")
            .arg(&name)
            .arg(&["state", "fp", "status", "headers", "body"])
            .query_async(&mut store.conn.clone())
            .await
            .map_err(redis_err)?;
        let [state, fp, status, headers, body] = &r[..] else {
            return Err(corrupt("HMGET"));
        };
        match text(state).as_deref() {
            Some("completed" | "failed") => {
                let fp = text(fp)
                    .and_then(|f| hex::decode(f).ok())
                    .ok_or_else(|| corrupt("fingerprint"))?;
                Ok(Some((fp, stored_from(status, headers, body)?)))
            }
            _ => Ok(None),
        }
    }

    // A long operation's resource (`crate::operations`): one read-only script,
    // so that the lease is judged on the server's clock and the record and the
    // clock are read at one instant. A finished record expires with its
    // retention, so whatever is found still answers.
    async fn lease_operation(
        store: &RedisLeaseStore,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> Result<Option<OperationRow>, StoreError> {
        static READ: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
            Script::new(
                r"
local r = redis.call('HMGET', KEYS[1], 'state', 'lease_until', 'status', 'headers', ARGV[1])
if not r[1] then return {} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = 0
if r[2] and tonumber(r[2]) and tonumber(r[2]) > now then live = 1 end
return {r[1], live, r[3] or false, r[4] or false, r[5] or false}
",
            )
        });
        let name = store.record_name(key.tenant, key.operation, &key.digest.to_string());
        // Without the body, the field asked for is one no record has.
        let body = if with_body { "body" } else { "-" };
        let reply: Vec<Value> = READ
            .key(&name)
            .arg(body)
            .invoke_async(&mut store.conn.clone())
            .await
            .map_err(redis_err)?;
        let [state, live, status, headers, body] = &reply[..] else {
            return if reply.is_empty() {
                Ok(None)
            } else {
                Err(corrupt("operation"))
            };
        };
        let state = text(state).ok_or_else(|| corrupt("state"))?;
        let empty = Value::BulkString(Vec::new());
        let body = if with_body { body } else { &empty };
        let outcome = match state.as_str() {
            "completed" | "failed" => Some(stored_from(status, headers, body)?),
            _ => None,
        };
        Ok(Some(OperationRow {
            state,
            lease_live: int(live) == Some(1),
            outcome,
        }))
    }

    async fn lease_uncertain(
        store: &RedisLeaseStore,
        operation: &str,
        after: Option<&RedisUncertain>,
        limit: i64,
    ) -> Result<Vec<RedisUncertain>, StoreError> {
        let index = store.uncertain_index(operation);
        let mut conn = store.conn.clone();
        let limit = usize::try_from(limit.max(1)).unwrap_or(1);
        let min = after.map_or("-inf".to_owned(), |a| a.score.to_string());
        // A page is `limit` entries for the reconciler, or fewer only at the
        // index's end: the reconciler takes a short page for the newest and
        // starts over from the oldest. So the stale entries dropped here never
        // shorten a page: the listing reads on past them, a chunk of the index
        // at a time, each chunk's records in one pipeline, and stops at the
        // `limit`-th entry it lists (whose position is the next page's cursor).
        // Chunks go by offset from `after`'s score, in (score, member) order;
        // entries at that score up to `after` itself were on an earlier page.
        // Stale entries are pruned after the scan, so the offsets hold while it
        // runs.
        let mut rows = Vec::with_capacity(limit);
        let mut stale = Vec::new();
        let mut offset = 0usize;
        'scan: loop {
            let chunk: Vec<(String, f64)> = redis::cmd("ZRANGE")
                .arg(&index)
                .arg(&min)
                .arg("+inf")
                .arg("BYSCORE")
                .arg("LIMIT")
                .arg(offset)
                .arg(limit)
                .arg("WITHSCORES")
                .query_async(&mut conn)
                .await
                .map_err(redis_err)?;
            let end = chunk.len() < limit;
            offset += chunk.len();
            let chunk: Vec<(String, f64)> = chunk
                .into_iter()
                .filter(|(m, s)| match after {
                    Some(a) => *s > a.score || (*s == a.score && *m > a.member),
                    None => true,
                })
                .collect();
            for entry in store.read_entries(operation, &index, chunk).await? {
                match entry {
                    Entry::Listed(row) => {
                        rows.push(row);
                        if rows.len() == limit {
                            break 'scan;
                        }
                    }
                    Entry::Stale { name, member } => stale.push((name, member)),
                }
            }
            if end {
                break;
            }
        }
        store.prune(&index, &stale).await;
        Ok(rows)
    }

    fn lease_describe(
        operation: &str,
        row: &RedisUncertain,
    ) -> Result<UncertainOutcome, StoreError> {
        if let Some(why) = row.broken {
            return Err(corrupt(why));
        }
        Ok(UncertainOutcome {
            tenant: row.tenant.clone(),
            operation: operation.to_owned(),
            key_digest: KeyDigest::from_hex(&row.digest)
                .map_err(|e| StoreError::Corrupt(format!("uncertain index entry: {e}")))?,
            downstream_key: row.downstream_key.clone(),
            generation: row.generation,
        })
    }

    async fn lease_resolve(
        store: &RedisLeaseStore,
        operation: &str,
        row: &RedisUncertain,
        outcome: Option<&StoredResponse>,
    ) -> Result<u64, StoreError> {
        let name = store.record_name(&row.tenant, operation, &row.digest);
        let mut inv = store.scripts.resolve.key(&name);
        inv.key(store.uncertain_index(operation))
            .arg(&row.member)
            .arg(row.generation)
            .arg(&row.token);
        match outcome {
            Some(stored) => {
                let headers = serde_json::to_string(&stored.headers)
                    .map_err(|e| StoreError::Corrupt(format!("headers: {e}")))?;
                inv.arg("1")
                    .arg(stored.state())
                    .arg(stored.status)
                    .arg(headers)
                    .arg(&stored.body[..]);
            }
            None => {
                inv.arg("0");
            }
        }
        let n: u64 = inv
            .invoke_async(&mut store.conn.clone())
            .await
            .map_err(redis_err)?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_escape_separators_and_never_hold_the_raw_key() {
        assert_eq!(escape("acme"), "acme");
        assert_eq!(escape("a:b"), "a%3Ab");
        assert_eq!(escape("{x}"), "%7Bx%7D");
        assert_ne!(member("a:b", "d"), member("a", "b:d"));
    }

    #[test]
    fn versions_older_than_6_2_are_refused() {
        let info = |v: &str| {
            format!(
                "# Server\r\nredis_version:{v}\r\nredis_git_sha1:00000000\r\n\
                 redis_mode:standalone\r\n"
            )
        };
        for old in ["6.0.16", "6.1.99", "5.0.14", "2.8.24"] {
            match version_verdict(&info(old)) {
                VersionVerdict::Refuse(why) => {
                    assert!(why.contains(old) && why.contains("6.2"), "{why}")
                }
                other => panic!("{old}: {other:?}"),
            }
        }
        for new in [
            "6.2.0",
            "6.2.14",
            "7.0.15",
            "7.4-rc1",
            "10.0.0",
            "255.255.255",
        ] {
            assert_eq!(
                version_verdict(&info(new)),
                VersionVerdict::Supported(new.to_owned())
            );
        }
        // Lines ending in \n alone, and a server that says more after it.
        assert_eq!(
            version_verdict("# Server\nredis_version:6.2.6\nvalkey_version:8.0.1\n"),
            VersionVerdict::Supported("6.2.6".into())
        );
        for unreadable in [
            "# Server\r\nredis_mode:standalone\r\n",
            &info("unstable"),
            &info("7"),
        ] {
            assert!(
                matches!(version_verdict(unreadable), VersionVerdict::Unknown(_)),
                "{unreadable:?}"
            );
        }
    }

    #[test]
    fn eviction_policies_are_judged() {
        assert_eq!(eviction_verdict("noeviction", 0), EvictionVerdict::Safe);
        assert!(matches!(
            eviction_verdict("allkeys-lru", 0),
            EvictionVerdict::Refuse(_)
        ));
        assert!(matches!(
            eviction_verdict("allkeys-random", 1 << 30),
            EvictionVerdict::Refuse(_)
        ));
        assert_eq!(eviction_verdict("volatile-ttl", 0), EvictionVerdict::Safe);
        assert!(matches!(
            eviction_verdict("volatile-lru", 1 << 30),
            EvictionVerdict::Warn(_)
        ));
        assert!(matches!(
            eviction_verdict("something-new", 0),
            EvictionVerdict::Warn(_)
        ));
    }
}
