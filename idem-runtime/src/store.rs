//! The transactional mode by hand: claiming a key in your transaction and storing
//! its outcome there, without the attribute.
//!
//! ```text
//! [none] --claim--> processing --complete (same transaction)--> completed | failed
//! completed/failed --claim, same fingerprint--> replay
//! completed/failed --claim, other fingerprint--> mismatch
//! processing (another transaction) --claim--> waits, then replay | execute | in flight
//! completed/failed past expires_at --claim--> processing (a new execution)
//! ```
//!
//! [`claim`], [`Execution::complete`] and [`migrate`] work on every database idem
//! runs on, chosen by the transaction's or pool's type.

use sqlx::{Pool, Transaction};

use crate::at_rest::{KeyRing, open_replay};
use crate::db::Backend;
use crate::model::{Claim, ClaimRequest, Execution, StoreError, StoredResponse};

/// Claims `req.key` inside `tx`, atomically.
///
/// On PostgreSQL the transaction must run at READ COMMITTED (the default); a
/// duplicate waits up to `req.in_flight_wait` for a concurrent holder of the key
/// (a `lock_timeout` in a subtransaction, which leaves `tx` usable). On SQLite it
/// waits through the busy timeout; claim before any other statement, since
/// SQLite serialises writers.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::{claim, Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, StoredResponse};
///
/// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let key = IdempotencyKey::parse("order-42")?;
/// let mut tx = pool.begin().await?;
/// let req = ClaimRequest {
///     tenant: "acme",
///     operation: "create-order",
///     key: &key,
///     fingerprint: FingerprintBuilder::new("acme", "create-order", "JOB", "orders").finish(),
///     retention: Duration::from_secs(24 * 3600),
///     in_flight_wait: Duration::from_secs(2),
/// };
/// if let Claim::Execute(execution) = claim(&mut tx, &req).await? {
///     // ... the effect, in `tx` ...
///     let outcome = StoredResponse { status: 201, headers: vec![], body: "created".into() };
///     execution.complete(&mut tx, &outcome).await?;
///     tx.commit().await?;
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`StoreError::InvalidRequest`] for a retention under a millisecond,
/// [`StoreError::Isolation`] at another isolation level (PostgreSQL),
/// [`StoreError::Database`] when the database fails. Nothing is claimed then.
pub async fn claim<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    claim_sealed(tx, req, None).await
}

/// [`claim`] where answers are sealed with `ring` (see [`crate::at_rest`]): a
/// replay is opened with it, and [`Execution::complete`] seals the outcome
/// with its active key.
///
/// # Errors
///
/// As [`claim`], and [`StoreError::SealKeyMissing`] or
/// [`StoreError::SealBroken`] for a stored answer that does not open (nothing
/// is claimed then).
pub async fn claim_with_key_ring<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    req: &ClaimRequest<'_>,
    ring: &KeyRing,
) -> Result<Claim, StoreError> {
    claim_sealed(tx, req, Some(ring)).await
}

/// [`claim`] for a caller that needs only to know that a key was finished,
/// never its answer (the consumer helper: a redelivery is a duplicate, its
/// stored record unread): a replay's stored answer is handed back as it is,
/// not opened, so one sealed with a key this process lacks (say, by `idem
/// rekey --seal-clear`) is still a replay rather than an error.
pub(crate) async fn claim_answer_unread<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    crate::model::refuse_under_a_millisecond(req.retention, None)?;
    DB::claim(&mut **tx, req).await
}

async fn claim_sealed<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    req: &ClaimRequest<'_>,
    ring: Option<&KeyRing>,
) -> Result<Claim, StoreError> {
    let opened = |stored| open_replay(ring, req.tenant, req.operation, req.key, stored);
    Ok(match claim_answer_unread(tx, req).await? {
        Claim::Replay(stored) => Claim::Replay(opened(stored)?),
        Claim::Execute(mut execution) => {
            execution.ring = ring.cloned();
            Claim::Execute(execution)
        }
        other => other,
    })
}

/// Creates or updates idem's table (and, on PostgreSQL, its functions). Safe to
/// call at every start and from several processes at once.
///
/// ```no_run
/// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// idem_runtime::migrate(&pool).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`StoreError::Migrate`] when the database refuses the migration.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), StoreError> {
    DB::migrate(pool).await
}

/// idem's embedded migrations for `DB`, tracked in [`crate::MIGRATIONS_TABLE`]
/// (apart from the application's own `_sqlx_migrations`), to run with options
/// of your own or to list; [`migrate`] runs them as they are.
///
/// On SQLite, call [`migrate`] after running them yourself: it also converts
/// rows written before keys were digested (idem 0.1), which SQL cannot do
/// there (SQLite has no SHA-256). Until it has, such a key is not found, and
/// its retry runs the handler again. Elsewhere the migrations convert them.
///
/// ```
/// # #[cfg(feature = "postgres")] { // the example names PostgreSQL's migrations
/// let pending = idem_runtime::migrator::<sqlx::Postgres>().iter().count();
/// assert!(pending > 0);
/// # }
/// ```
pub fn migrator<DB: Backend>() -> sqlx::migrate::Migrator {
    DB::migrator()
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
        let ring = self.ring.clone();
        let kept = crate::at_rest::seal(ring.as_ref(), &self.row_id(), response)?;
        DB::complete(self, &mut **tx, &kept).await
    }
}
