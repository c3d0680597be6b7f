//! The durable half of the state machine: claiming a key and storing its outcome.
//!
//! ```text
//! [none] --claim--> processing --complete (same transaction)--> completed | failed
//! completed/failed --claim, same fingerprint--> replay
//! completed/failed --claim, other fingerprint--> mismatch
//! processing (another transaction) --claim--> waits, then replay | execute | in flight
//! any state past expires_at --claim--> processing (a new execution)
//! ```
//!
//! PostgreSQL is the reference backend ([`postgres`]); SQLite ([`sqlite`]) keeps the
//! same promise for a single-machine service. [`claim`], [`Execution::complete`]
//! and [`migrate`] work with either, chosen by the transaction's or pool's type.

pub mod postgres;
pub mod sqlite;

use std::time::Duration;

use bytes::Bytes;

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;

pub use postgres::migrator;

use std::future::Future;

use sqlx::{Pool, Transaction};

use crate::config::Idem;
use crate::tx::Tx;

/// A database idem can keep its table in: PostgreSQL and SQLite.
pub trait Backend: sqlx::Database {
    /// Claims a key inside `tx`.
    fn claim(
        tx: &mut Transaction<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Stores an execution's outcome inside `tx`.
    fn complete(
        execution: Execution,
        tx: &mut Transaction<'_, Self>,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Applies idem's migrations for this database.
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Begins a transaction fit for a claim.
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;

    /// The handler's path: begins a transaction on a connection of `idem`'s pool
    /// and claims the key in it, in as few round trips as the database allows.
    /// The [`Tx`] comes back whatever the claim decided (dropping it releases the
    /// connection); only [`Claim::Execute`] leaves its transaction open.
    #[doc(hidden)]
    fn begin_claim(
        idem: &Idem<Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<(Tx<Self>, Claim), StoreError>> + Send;

    /// The handler's path: stores the outcome in `tx` and commits.
    #[doc(hidden)]
    fn finish(
        idem: &Idem<Self>,
        tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> impl Future<Output = Finish> + Send;
}

/// How [`Backend::finish`] ended.
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
}

/// [`Backend::finish`] as a backend without a pipelined path ends it: after the
/// outcome's store (`stored`), commit.
pub(crate) async fn commit_after<DB: Backend>(
    tx: Tx<DB>,
    stored: Result<(), StoreError>,
) -> Finish {
    if let Err(e) = stored {
        return Finish::NotStored(e);
    }
    match tx.commit().await {
        Ok(()) => Finish::Committed,
        Err(e) => Finish::Unknown(e.into()),
    }
}

impl Backend for sqlx::Postgres {
    fn claim(
        tx: &mut Transaction<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        postgres::claim(tx, req)
    }

    fn complete(
        execution: Execution,
        tx: &mut Transaction<'_, Self>,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        postgres::complete(execution, tx, response)
    }

    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), StoreError>> + Send {
        postgres::migrate(pool)
    }

    /// Explicitly READ COMMITTED, so a server or role whose default isolation is
    /// stricter still gets what claims need.
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        pool.begin_with(postgres::BEGIN_READ_COMMITTED)
    }

    fn begin_claim(
        idem: &Idem<Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<(Tx<Self>, Claim), StoreError>> + Send {
        postgres::pipelined::begin_claim(idem, req)
    }

    fn finish(
        idem: &Idem<Self>,
        tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> impl Future<Output = Finish> + Send {
        postgres::pipelined::finish(idem, tx, execution, response)
    }
}

impl Backend for sqlx::Sqlite {
    fn claim(
        tx: &mut Transaction<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        sqlite::claim(tx, req)
    }

    fn complete(
        execution: Execution,
        tx: &mut Transaction<'_, Self>,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        sqlite::complete(execution, tx, response)
    }

    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), StoreError>> + Send {
        sqlite::migrate(pool)
    }

    /// Deferred: the claim's INSERT is the first statement and takes the write
    /// lock, waiting through the busy timeout (see [`sqlite`]).
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        pool.begin()
    }

    /// In-process: nothing to save in round trips, so begin, then claim.
    async fn begin_claim(
        idem: &Idem<Self>,
        req: &ClaimRequest<'_>,
    ) -> Result<(Tx<Self>, Claim), StoreError> {
        let mut tx = Tx::begin(idem.pool(), None).await?;
        let claim = sqlite::claim_on(tx.connection(), req).await?;
        Ok((tx, claim))
    }

    async fn finish(
        _: &Idem<Self>,
        mut tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> Finish {
        let stored = sqlite::complete_on(execution, tx.connection(), response).await;
        commit_after(tx, stored).await
    }
}

/// Claims `req.key` inside `tx`, atomically, on PostgreSQL or SQLite.
///
/// On PostgreSQL the transaction must run at READ COMMITTED (the default); a
/// duplicate waits up to `req.in_flight_wait` for a concurrent holder of the key
/// (a `lock_timeout` in a subtransaction, which leaves `tx` usable). On SQLite it
/// waits through the busy timeout; claim before any other statement (see
/// [`sqlite`]).
///
/// # Errors
///
/// [`StoreError::Isolation`] at another isolation level (PostgreSQL),
/// [`StoreError::Database`] when the database fails. Nothing is claimed then.
pub async fn claim<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    DB::claim(tx, req).await
}

/// Creates or updates idem's table (and, on PostgreSQL, its functions). Safe to
/// call at every start and from several processes at once.
///
/// # Errors
///
/// [`StoreError::Migrate`] when the database refuses the migration.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), StoreError> {
    DB::migrate(pool).await
}

impl Execution {
    /// Stores the outcome in the same transaction that claimed the key. Commit the
    /// transaction afterwards; until then nobody else sees the key as finished.
    ///
    /// A 4xx status is stored as `failed`, anything else as `completed`; both are
    /// replayed alike. The retention runs from this moment (the database's own
    /// clock), so a slow operation is not already expired when it commits. Do not
    /// store 5xx outcomes: roll back instead, so a retry runs again.
    ///
    /// # Errors
    ///
    /// [`StoreError::LostClaim`] when the row no longer belongs to this execution,
    /// [`StoreError::Database`] when the update fails. Roll back in both cases.
    pub async fn complete<DB: Backend>(
        self,
        tx: &mut Transaction<'_, DB>,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        DB::complete(self, tx, response).await
    }
}

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
    /// How long the key and its outcome are kept after the claim.
    pub retention: Duration,
    /// How long a duplicate waits for a concurrent first request to finish.
    pub in_flight_wait: Duration,
}

/// What a claim decided. Exactly one of these; nothing else is possible.
#[derive(Debug)]
#[must_use = "a claim that is not acted on leaves the transaction holding the key"]
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
}

/// Proof that this transaction owns a key. Consumed by [`Execution::complete`].
#[derive(Debug)]
#[must_use = "an execution must be completed before the transaction commits"]
pub struct Execution {
    pub(crate) tenant: String,
    pub(crate) operation: String,
    pub(crate) key: IdempotencyKey,
    pub(crate) generation: i64,
    pub(crate) retention: std::time::Duration,
}

impl Execution {
    /// The execution of `req` at `generation`.
    pub(crate) fn new(req: &ClaimRequest<'_>, generation: i64) -> Self {
        Execution {
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.clone(),
            generation,
            retention: req.retention,
        }
    }

    /// The execution's generation: 1 for a new key, one more each time an expired
    /// key is executed anew.
    pub fn generation(&self) -> i64 {
        self.generation
    }
}

/// An outcome as stored and replayed: status, allow-listed headers and body.
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
}
