//! The vocabulary every layer shares: what a claim asks and decides, what an
//! outcome is stored as, what a leased execution owns, and what goes wrong.
//!
//! The database modules ([`crate::db`]) speak it to the features above them
//! (handler, lease, sweeper, stats, reconciler, consumer, CLI), so that neither
//! side knows the other's details.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyDigest};

/// Everything a claim needs to know.
#[derive(Debug, Clone)]
pub struct ClaimRequest<'a> {
    /// The caller's tenant id (see [`crate::TenantScope`]).
    pub tenant: &'a str,
    /// The operation's stable name, such as `create-order`.
    pub operation: &'a str,
    /// The validated key.
    pub key: &'a IdempotencyKey,
    /// The logical request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the key and its outcome are kept after completion.
    pub retention: Duration,
    /// How long a duplicate waits for a concurrent first request to finish.
    pub in_flight_wait: Duration,
}

/// What a claim decided. Exactly one of these; nothing else is possible.
#[derive(Debug)]
#[must_use = "a claim that is not acted on leaves the transaction holding the key"]
#[non_exhaustive]
pub enum Claim {
    /// The caller owns the key: run the operation in the same transaction, then
    /// [`Execution::complete`] it and commit.
    Execute(Execution),
    /// The operation already ran with the same fingerprint: answer with this.
    Replay(StoredResponse),
    /// The key was used for a different request (another fingerprint). Nothing ran.
    Mismatch,
    /// Another request with this key is still running. Nothing ran; ask the client
    /// to retry after `retry_after`.
    InFlight {
        /// A hint for the `Retry-After` header.
        retry_after: Duration,
    },
    /// The database stayed locked by other writers for longer than the claim
    /// could wait (SQLite's one write lock, held for another key): the key was
    /// not looked at and nothing ran. Ask the client to retry after
    /// `retry_after`; this says nothing about the key.
    Busy {
        /// A hint for the `Retry-After` header.
        retry_after: Duration,
    },
}

/// Proof that this transaction owns a key. Consumed by [`Execution::complete`].
#[derive(Debug)]
#[must_use = "an execution must be completed before the transaction commits"]
pub struct Execution {
    pub(crate) tenant: String,
    pub(crate) operation: String,
    /// The key's digest: all the completion needs (the key itself stays with
    /// the request).
    pub(crate) key: KeyDigest,
    pub(crate) generation: i64,
    pub(crate) retention: Duration,
    /// The request's fingerprint, which a claim made at commit stores.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fingerprint: Fingerprint,
    /// How long a claim made at commit waits for another holder of the key.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) in_flight_wait: Duration,
    /// Whether the key is claimed by the completion itself (the PostgreSQL and
    /// MySQL handler paths) rather than by a row written before the handler ran.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) at_commit: bool,
    /// Whether its transaction began with idem's statements prepared in the
    /// session (PostgreSQL), so that its finished row rides with `COMMIT`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) in_session: bool,
    /// When the execution began, in Unix milliseconds on the database's clock
    /// (SQLite's handler path, which writes `created_at` only at commit).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) started_ms: i64,
}

impl Execution {
    /// The execution of `req` at `generation`, whose claim row exists.
    pub(crate) fn new(req: &ClaimRequest<'_>, generation: i64) -> Self {
        Execution {
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.digest(),
            generation,
            retention: req.retention,
            fingerprint: req.fingerprint,
            in_flight_wait: req.in_flight_wait,
            at_commit: false,
            in_session: false,
            started_ms: 0,
        }
    }

    /// The execution of `req` at `generation`, whose key is claimed by its
    /// completion.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn at_commit(req: &ClaimRequest<'_>, generation: i64) -> Self {
        Execution {
            at_commit: true,
            ..Execution::new(req, generation)
        }
    }

    /// The execution's generation: 1 for a new key, one more each time an expired
    /// key is executed anew.
    pub fn generation(&self) -> i64 {
        self.generation
    }
}

/// An outcome as stored and replayed: status, allow-listed headers and body.
///
/// ```
/// use idem_runtime::StoredResponse;
///
/// let declined = StoredResponse { status: 402, headers: vec![], body: "declined".into() };
/// assert_eq!(declined.state(), "failed"); // a 4xx is stored as `failed`, and replayed alike
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header names (lower case) and values, in response order.
    pub headers: Vec<(String, String)>,
    /// The body bytes, exactly as first sent.
    pub body: Bytes,
}

impl StoredResponse {
    /// Whether this outcome is stored as `failed` (4xx) rather than `completed`.
    pub fn is_failure(&self) -> bool {
        self.status >= 400
    }

    /// The row state this outcome is stored under: `failed` for a 4xx, else
    /// `completed`.
    pub fn state(&self) -> &'static str {
        if self.is_failure() {
            "failed"
        } else {
            "completed"
        }
    }
}

/// Why the store could not do its part. None of these carries a raw key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The transaction does not run at READ COMMITTED.
    #[error(
        "idem claims need READ COMMITTED isolation; run the claim in a transaction at the default level"
    )]
    Isolation,
    /// The claim this execution held is gone (deleted, or taken over after expiry).
    #[error("the execution no longer holds its key (generation {generation}); nothing was stored")]
    LostClaim {
        /// The generation that tried to complete.
        generation: i64,
    },
    /// A stored row could not be decoded.
    #[error("a stored outcome is corrupt: {0}")]
    Corrupt(String),
    /// The database refused or failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The migrations could not be applied.
    #[error("migration error: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A connection pooler between idem and PostgreSQL would lose what idem's
    /// statements need (found at start by [`crate::migrate`] or
    /// `check_pooler`; docs/pgbouncer.md says which settings work).
    #[error("connection pooler: {0}")]
    Pooler(String),
    /// A hand-written request that no store accepts, refused before anything
    /// is written: a lease or retention under a millisecond (every store
    /// counts whole milliseconds). The message names which.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The Redis lease store refused or failed (feature `redis`), or refused to
    /// start (see the module `idem_runtime::redis`).
    #[error("redis error: {0}")]
    Redis(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// How the handler's path ended a transaction: stored and committed, or not.
#[doc(hidden)]
#[derive(Debug)]
pub enum Finish {
    /// Stored and committed.
    Committed,
    /// Nothing was committed: neither the effect nor its record.
    NotStored(StoreError),
    /// The commit may or may not have happened (the connection failed on the way);
    /// a retry with the same key replays or executes, either way safely.
    Unknown(StoreError),
    /// Nothing was committed: another execution holds the key (its key was to be
    /// claimed at commit). The request answers this instead of its own outcome.
    Taken(Claim),
}

/// What a leased claim needs.
#[derive(Debug, Clone)]
pub struct LeaseRequest<'a> {
    /// The caller's tenant id.
    pub tenant: &'a str,
    /// The operation's stable name.
    pub operation: &'a str,
    /// The validated key.
    pub key: &'a IdempotencyKey,
    /// The logical request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the outcome is kept after completion.
    pub retention: Duration,
    /// How long the claim is owned without renewal.
    pub lease: Duration,
}

/// How a lease was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquisition {
    /// A new key.
    New,
    /// A finished outcome whose retention had passed: a new execution.
    Reclaimed,
    /// An execution whose lease lapsed: its worker died or stalled. The effect may
    /// have happened; call downstream with [`crate::Lease::downstream_key`] so it
    /// is not repeated.
    TakenOver,
}

/// What a leased claim decided, before a [`crate::Lease`] is built around it.
#[derive(Debug)]
pub enum LeasedOutcome {
    /// The caller owns the execution under `token`.
    Acquired {
        /// How the execution was acquired.
        acquisition: Acquisition,
        /// The owner token that fences every later statement.
        token: OwnerToken,
        /// The generation the execution holds.
        generation: i64,
    },
    /// A stored outcome with the same fingerprint.
    Replay(StoredResponse),
    /// The key is in use for a different request.
    Mismatch,
    /// Another worker holds a live lease (or the lock, for a moment).
    InFlight {
        /// How long the caller is asked to wait.
        retry_after: Duration,
    },
    /// The database stayed locked by other writers (see [`Claim::Busy`]).
    Busy {
        /// How long the caller is asked to wait.
        retry_after: Duration,
    },
    /// An earlier execution's effect is unknown.
    Uncertain,
}

/// An execution's owner token: what every fenced write of leased mode matches,
/// new at every claim (a UUID made by PostgreSQL's claim, 128 random bits as
/// hex made here for SQLite, MySQL and Redis). Cheap to clone: the lease, its renewer and
/// the uncertain marker each hold it. Binds and reads back as text.
#[derive(Clone, PartialEq, Eq)]
pub struct OwnerToken(Arc<str>);

impl OwnerToken {
    /// A fresh token: 128 random bits, as hex.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "mysql", feature = "redis")),
        allow(dead_code)
    )]
    pub(crate) fn random() -> Self {
        OwnerToken(format!("{:032x}", fastrand::u128(..)).into())
    }

    /// The token's text, as stores compare it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for OwnerToken {
    fn from(token: String) -> Self {
        OwnerToken(token.into())
    }
}

impl std::fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OwnerToken({})", self.0)
    }
}

/// A type stored as a text column: `sqlx::Type`, `Encode` and `Decode` through
/// `str`, with `as_str` to encode and `$decode` (from `&str`, fallible) to
/// decode; for every database whose driver takes `str`.
macro_rules! text_column {
    ($ty:ty, |$text:ident| $decode:expr) => {
        impl<DB: sqlx::Database> sqlx::Type<DB> for $ty
        where
            str: sqlx::Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <str as sqlx::Type<DB>>::type_info()
            }

            fn compatible(ty: &DB::TypeInfo) -> bool {
                <str as sqlx::Type<DB>>::compatible(ty)
            }
        }

        impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for $ty
        where
            for<'a> &'a str: sqlx::Encode<'q, DB>,
        {
            fn encode_by_ref(
                &self,
                buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<'q, DB>>::encode(self.as_str(), buf)
            }
        }

        impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for $ty
        where
            &'r str: sqlx::Decode<'r, DB>,
        {
            fn decode(value: DB::ValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                let $text = <&str as sqlx::Decode<'r, DB>>::decode(value)?;
                $decode
            }
        }
    };
}
pub(crate) use text_column;

text_column!(OwnerToken, |text| Ok(OwnerToken(text.into())));

// ... and as a Redis script's argument.
#[cfg(feature = "redis")]
impl redis::ToRedisArgs for OwnerToken {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.write_arg(self.as_str().as_bytes());
    }
}

#[cfg(feature = "redis")]
impl redis::ToSingleRedisArg for OwnerToken {}

/// An owned row, as the fenced statements match it: primary key and owner token.
#[derive(Debug, Clone, Copy)]
pub struct Owned<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) key: KeyDigest,
    pub(crate) token: &'a OwnerToken,
}

/// One lease of a batch renewal: the owned row and its lease's length, counted
/// from when the store renews it.
#[derive(Debug, Clone, Copy)]
pub struct Renewal<'a> {
    pub(crate) row: Owned<'a>,
    pub(crate) lease: Duration,
}

impl<'a> Renewal<'a> {
    /// `rows` grouped by lease length, in order of length: a statement can then
    /// set one expiry expression for all of a group's rows (the leases of one
    /// operation share their length).
    #[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
    pub(crate) fn by_lease<'r>(rows: &'r [Renewal<'a>]) -> Vec<(Duration, Vec<&'r Renewal<'a>>)> {
        let mut groups: Vec<(Duration, Vec<&'r Renewal<'a>>)> = Vec::new();
        for r in rows {
            match groups.iter_mut().find(|(lease, _)| *lease == r.lease) {
                Some((_, of)) => of.push(r),
                None => groups.push((r.lease, vec![r])),
            }
        }
        groups.sort_unstable_by_key(|(lease, _)| *lease);
        groups
    }
}

/// What a batch renewal learned of one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// Renewed: the lease holds for its length from the statement.
    Kept,
    /// The row is not this execution's any more (taken over, released,
    /// finished): the lease is lost.
    Lost,
    /// Neither (another transaction held the row, and the batch did not wait
    /// for it): renew again soon.
    Unknown,
}

/// A fenced statement other than storing the outcome.
#[derive(Debug, Clone, Copy)]
pub enum Fence {
    /// Extend the lease by this much from now.
    Renew(Duration),
    /// Mark the row `uncertain`.
    Uncertain,
    /// Delete the row: the effect did not happen.
    Release,
}

/// An `uncertain` row awaiting reconciliation.
#[derive(Debug, Clone)]
pub struct UncertainRow {
    pub(crate) tenant: String,
    /// The key's digest (the key itself is not stored).
    pub(crate) key: KeyDigest,
    /// The key the downstream system knows the effect by, stored at the claim
    /// because it cannot be derived from the digest. `None` only in a row
    /// written by hand: it cannot be reconciled.
    pub(crate) downstream_key: Option<String>,
    /// The generation that became uncertain.
    pub(crate) generation: i64,
    /// The owner token of the execution that became uncertain: what a
    /// resolution is fenced by.
    pub(crate) token: Option<OwnerToken>,
    /// When it was created, in the database's own units (for paging).
    pub(crate) created: i64,
}

/// One key's row as its operation resource reads it (see `crate::operations`):
/// what state it is in, whether its lease is live by the store's clock, and the
/// stored outcome once there is one. A finished row past its retention is read
/// as no row: the key no longer answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationRow {
    /// The row's state.
    pub(crate) state: crate::decide::RowState,
    /// `processing` only: the owner's lease has not lapsed.
    pub(crate) lease_live: bool,
    /// `completed` and `failed`: the stored outcome (its body empty unless it
    /// was asked for).
    pub(crate) outcome: Option<StoredResponse>,
}

/// The in-flight rows as one sweep sees them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct InFlightSummary {
    /// `processing` rows created at least the stale threshold ago.
    pub(crate) stale_processing: u64,
    /// `uncertain` rows created at least the stale threshold ago.
    pub(crate) stale_uncertain: u64,
    /// All `uncertain` rows, however young.
    pub(crate) uncertain: u64,
    /// Seconds since the oldest in-flight row was created, as the database
    /// computed it; `None` when no row is in flight. Left raw (it may be negative
    /// for a row created "in the future") so that the sweeper clamps it in one
    /// place for every backend.
    pub(crate) oldest_seconds: Option<f64>,
}

/// The raw numbers of one stats snapshot, before [`crate::stats()`] adds them up.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    /// "Now" of the snapshot, by the database clock (RFC 3339, UTC, whole seconds).
    pub(crate) taken_at: String,
    /// One entry per (operation, state) pair present in the table, in any order.
    pub(crate) groups: Vec<StatsGroup>,
    pub(crate) oldest_valid_created_at: Option<String>,
    pub(crate) oldest_valid_age_seconds: Option<f64>,
    pub(crate) oldest_in_flight_seconds: Option<f64>,
}

/// The rows of one operation in one state, as a [`StatsSnapshot`] holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsGroup {
    pub(crate) operation: String,
    /// The state as stored; stats refuse one the schema does not allow.
    pub(crate) state: String,
    pub(crate) rows: u64,
    /// Bytes of its stored outcomes: bodies plus the text of their headers.
    pub(crate) stored_bytes: u64,
    /// Its finished rows (`completed`, `failed`) past `expires_at`.
    pub(crate) expired_unswept: u64,
}

/// Refuses a retention, or a lease, under a millisecond (zero included), the
/// same on every store, before anything is written. Every store counts whole
/// milliseconds, so either would be zero to it: a lease that lapses as it is
/// claimed (the next claim takes the execution over) or an outcome forgotten as
/// it is stored (a retry executes again). `#[idempotent]` refuses such values
/// where they are written; this holds hand-written requests to the same.
///
/// # Errors
///
/// [`StoreError::InvalidRequest`], naming the duration.
pub(crate) fn refuse_under_a_millisecond(
    retention: Duration,
    lease: Option<Duration>,
) -> Result<(), StoreError> {
    let lease = lease.map(|d| {
        (
            "lease",
            d,
            "it would lapse as it is claimed, and the next claim would take the execution over",
        )
    });
    let retention = (
        "retention",
        retention,
        "the outcome would be forgotten as it is stored, and a retry would execute again",
    );
    for (what, d, why) in lease.into_iter().chain([retention]) {
        if d < Duration::from_millis(1) {
            return Err(StoreError::InvalidRequest(format!(
                "a {what} of {d:?} is refused: idem counts durations in whole milliseconds and \
                 needs at least 1 ms; {why}"
            )));
        }
    }
    Ok(())
}

/// A duration as the milliseconds every backend's SQL takes. Saturates rather
/// than fails: a bound of centuries means "never" either way.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A database count as an unsigned number. A count is never negative; the
/// fallback only keeps a corrupt answer from panicking a background task.
pub(crate) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

// --- one key, as the admin reads and purges it (re-exported by `crate::admin`) ---

/// One key's address: the three parts of the table's primary key.
#[derive(Debug, Clone, Copy)]
pub struct KeyAddress<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Operation name.
    pub operation: &'a str,
    /// The digest of the `Idempotency-Key` ([`IdempotencyKey::digest`]): what the
    /// table keeps instead of the key.
    pub digest: KeyDigest,
}

impl<'a> KeyAddress<'a> {
    /// The address of `key` under `tenant` and `operation`.
    pub fn of(tenant: &'a str, operation: &'a str, key: &IdempotencyKey) -> Self {
        KeyAddress {
            tenant,
            operation,
            digest: key.digest(),
        }
    }
}

/// One key's row, in the same form on every database: timestamps as RFC 3339
/// text in UTC (whole seconds, formatted by the database from its own values),
/// the fingerprint in lowercase hex, the header JSON as text.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// `processing`, `completed`, `failed` or `uncertain`.
    pub state: String,
    /// Which execution of the key the row holds (1 for the first).
    pub generation: i64,
    /// The request's fingerprint, in lowercase hex.
    pub fingerprint: String,
    /// When the current execution claimed the key.
    pub created_at: String,
    /// When its outcome was stored, if it was.
    pub completed_at: Option<String>,
    /// When the key is forgotten.
    pub expires_at: String,
    /// `expires_at` has passed, by the database clock.
    pub expired: bool,
    /// Leased mode: when the running execution's lease ends.
    pub lease_expires_at: Option<String>,
    /// The stored status, if an outcome is stored.
    pub response_status: Option<i64>,
    /// The stored body's size in bytes.
    pub body_bytes: Option<i64>,
    /// The stored headers' JSON (`[[name, value], ...]`), as text.
    pub response_headers: Option<String>,
    /// The body, only when asked for.
    pub body: Option<Vec<u8>>,
}

/// Why a [`crate::admin::purge`] deleted nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PurgeError<E> {
    /// The key's row (on SQLite: the database) stayed locked by a running request
    /// for the whole wait.
    #[error("{0}")]
    Locked(&'static str),
    /// The caller's check refused the row's state.
    #[error("refused")]
    Refused(E),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

// --- a state transition of the application's own rows (used by `crate::transition`) ---

/// Where a resource's state lives. The names are trusted SQL identifiers (write
/// them as literals; they are not escaped).
#[derive(Debug, Clone, Copy)]
pub struct Resource {
    /// The table.
    pub table: &'static str,
    /// The primary key column (a `bigint`).
    pub id_column: &'static str,
    /// The state column (`text`).
    pub state_column: &'static str,
    /// The version column (`bigint`), incremented by every transition.
    pub version_column: &'static str,
    /// An extra `column = $2` condition that scopes the row (such as a tenant), or
    /// `None`.
    pub scope_column: Option<&'static str>,
}

/// The fenced update of one transition: the new state if the version is still
/// the one the locking read saw.
#[derive(Debug, Clone, Copy)]
pub struct FencedWrite<'a> {
    pub(crate) resource: &'a Resource,
    pub(crate) id: i64,
    pub(crate) scope: Option<&'a str>,
    /// The state the locking read saw.
    pub(crate) from: &'static str,
    pub(crate) to: &'static str,
    /// The version the locking read saw.
    pub(crate) version: i64,
}
