//! Leased mode: for operations whose effect lives outside the database (a payment
//! provider, an e-mail service), where no local transaction can hold the effect
//! and its record together.
//!
//! ```text
//! [none] --claim (commits at once)--> processing(owner A, gen 1, lease)
//! processing --A renews while alive--> processing (lease extended)
//! processing --lease lapses, B claims--> processing(owner B, gen 2)   "taken over"
//! processing --owner completes (fenced by token)--> completed | failed
//! processing --owner reports the effect unknown--> uncertain
//! processing --owner fails before the effect--> [none] (released)
//! uncertain --reconciler asks downstream--> completed | failed | [none]
//! A completes after B took over --> rejected: A's result is never published
//! ```
//!
//! Every claim commits on its own with a fresh owner token and a higher
//! generation. Completion is `UPDATE ... WHERE owner_token = $`: a worker that
//! stalled past its lease and was taken over cannot publish. Downstream calls
//! carry [`Lease::downstream_key`], identical for every owner of the key, so the
//! downstream system's own idempotency turns a taken-over retry into a no-op.
//!
//! PostgreSQL and SQLite both implement it ([`LeaseBackend`]); the pool's type
//! picks the backend. A claim that cannot get its lock in time answers "in
//! flight": on PostgreSQL after 200 ms on the key's row, on SQLite after the
//! connection's busy timeout on the database's one write lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use std::future::Future;

use sha2::{Digest, Sha256};
use sqlx::{Pool, Postgres};

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::{Backend, StoreError, StoredResponse};

/// Statements over one key's row that are the same on both backends but for their
/// SQL and how an outcome is encoded: expanded inside each `impl LeaseBackend`,
/// where `STORE_SQL`, `RENEW_SQL`, `UNCERTAIN_SQL`, `RELEASE_SQL`, `RESOLVE_SQL`,
/// `encode` and `stored_from_row` are that backend's.
macro_rules! shared_statements {
    () => {
        async fn store_outcome(
            pool: &sqlx::Pool<Self>,
            row: Owned<'_>,
            response: &StoredResponse,
            retention: Duration,
        ) -> Result<u64, StoreError> {
            let (status, headers) = encode(response)?;
            let done = sqlx::query(STORE_SQL)
                .bind(row.tenant)
                .bind(row.operation)
                .bind(row.key)
                .bind(row.token)
                .bind(response.state())
                .bind(status)
                .bind(headers)
                .bind(&response.body[..])
                .bind(super::millis(retention))
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn fence(
            pool: &sqlx::Pool<Self>,
            row: Owned<'_>,
            what: Fence,
        ) -> Result<u64, StoreError> {
            let query = match what {
                Fence::Renew(_) => sqlx::query(RENEW_SQL),
                Fence::Uncertain => sqlx::query(UNCERTAIN_SQL),
                Fence::Release => sqlx::query(RELEASE_SQL),
            };
            let query = query
                .bind(row.tenant)
                .bind(row.operation)
                .bind(row.key)
                .bind(row.token);
            let query = match what {
                Fence::Renew(lease) => query.bind(super::millis(lease)),
                Fence::Uncertain | Fence::Release => query,
            };
            Ok(query.execute(pool).await?.rows_affected())
        }

        async fn current(
            pool: &sqlx::Pool<Self>,
            tenant: &str,
            operation: &str,
            key: &str,
        ) -> Result<Option<(Vec<u8>, StoredResponse)>, StoreError> {
            let row = sqlx::query(super::CURRENT_SQL)
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .fetch_optional(pool)
                .await?;
            let Some(row) = row else { return Ok(None) };
            Ok(Some((row.try_get("fingerprint")?, stored_from_row(&row)?)))
        }

        async fn uncertain_rows(
            pool: &sqlx::Pool<Self>,
            operation: &str,
            limit: i64,
        ) -> Result<Vec<UncertainRow>, StoreError> {
            let rows = sqlx::query(super::UNCERTAIN_ROWS_SQL)
                .bind(operation)
                .bind(limit)
                .fetch_all(pool)
                .await?;
            rows.iter()
                .map(|r| {
                    Ok(UncertainRow {
                        tenant: r.try_get("tenant_id")?,
                        key: r.try_get("idempotency_key")?,
                        generation: r.try_get("generation")?,
                        token: r.try_get("owner_token")?,
                    })
                })
                .collect()
        }

        async fn resolve(
            pool: &sqlx::Pool<Self>,
            operation: &str,
            row: &UncertainRow,
            outcome: Option<&StoredResponse>,
        ) -> Result<u64, StoreError> {
            let query = match outcome {
                Some(stored) => {
                    let (status, headers) = encode(stored)?;
                    sqlx::query(RESOLVE_SQL)
                        .bind(&row.tenant)
                        .bind(operation)
                        .bind(&row.key)
                        .bind(row.generation)
                        .bind(stored.state())
                        .bind(status)
                        .bind(headers)
                        .bind(&stored.body[..])
                        .bind(&row.token)
                }
                None => sqlx::query(super::FORGET_SQL)
                    .bind(&row.tenant)
                    .bind(operation)
                    .bind(&row.key)
                    .bind(row.generation)
                    .bind(&row.token),
            };
            Ok(query.execute(pool).await?.rows_affected())
        }
    };
}

const CURRENT_SQL: &str = "SELECT fingerprint, response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
        AND state IN ('completed', 'failed')";

// The `state IN (...)` term repeats the partial in-flight index's condition word
// for word: SQLite uses a partial index only for a query that states it so.
const UNCERTAIN_ROWS_SQL: &str = "SELECT tenant_id, idempotency_key, generation, \
            CAST(owner_token AS text) AS owner_token \
       FROM idempotency_requests \
      WHERE operation = $1 AND state IN ('processing', 'uncertain') AND state = 'uncertain' \
      ORDER BY created_at LIMIT $2";

// A resolution applies to the execution it was asked about and no other: a
// generation alone could match a later one (a released key starts again at 1),
// its owner token cannot.
const FORGET_SQL: &str = "DELETE FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
        AND generation = $4 AND state = 'uncertain' AND CAST(owner_token AS text) = $5";

pub(crate) mod postgres;
pub(crate) mod sqlite;

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

/// How the lease was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquisition {
    /// A new key.
    New,
    /// A finished outcome whose retention had passed: a new execution.
    Reclaimed,
    /// An execution whose lease lapsed: its worker died or stalled. The effect may
    /// have happened; call downstream with [`Lease::downstream_key`] so it is not
    /// repeated.
    TakenOver,
}

/// What a leased claim decided.
#[must_use = "an acquired lease must be completed, marked uncertain or released"]
pub enum LeasedClaim<DB: LeaseBackend = Postgres> {
    /// The caller owns the execution.
    Acquired(Lease<DB>),
    /// A stored outcome with the same fingerprint.
    Replay(StoredResponse),
    /// The key is in use for a different request.
    Mismatch,
    /// Another worker holds a live lease.
    InFlight {
        /// Until its lease lapses, at least one second.
        retry_after: Duration,
    },
    /// An earlier execution's effect is unknown and awaits reconciliation; nothing
    /// runs again until it is resolved.
    Uncertain,
}

/// Ownership of one execution in leased mode.
///
/// Dropping it without completing leaves the row `processing` until its lease
/// lapses; the next claim then takes it over (what a crash does).
pub struct Lease<DB: LeaseBackend = Postgres> {
    pool: Pool<DB>,
    tenant: String,
    operation: String,
    key: IdempotencyKey,
    token: String,
    generation: i64,
    acquisition: Acquisition,
    lease: Duration,
    retention: Duration,
    fingerprint: Fingerprint,
    lost: Arc<AtomicBool>,
}

/// Why a leased completion was refused.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The lease was taken over: this worker no longer owns the execution, and its
    /// result must not be published.
    #[error("the lease of generation {generation} was taken over; its result is not published")]
    StaleOwner {
        /// The stale generation.
        generation: i64,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for LeaseError {
    fn from(e: sqlx::Error) -> Self {
        LeaseError::Store(StoreError::Database(e))
    }
}

/// The key to give the downstream system's own idempotency mechanism: derived from
/// tenant, operation and key, the same for every owner and generation.
pub fn downstream_key(tenant: &str, operation: &str, key: &IdempotencyKey) -> String {
    let mut h = Sha256::new();
    for part in ["idem-downstream-v1", tenant, operation, key.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// What a leased claim decided, before a [`Lease`] is built around it; what a
/// [`LeaseBackend`] answers.
#[derive(Debug)]
pub enum LeasedOutcome {
    /// The caller owns the execution under `token`.
    Acquired {
        /// How.
        acquisition: Acquisition,
        /// The owner token that fences every later statement.
        token: String,
        /// The execution's generation.
        generation: i64,
    },
    /// A stored outcome with the same fingerprint.
    Replay(StoredResponse),
    /// The key is in use for a different request.
    Mismatch,
    /// Another worker holds a live lease (or the lock, for a moment).
    InFlight {
        /// Until its lease lapses.
        retry_after: Duration,
    },
    /// An earlier execution's effect is unknown.
    Uncertain,
}

/// An owned row, as the fenced statements match it: primary key and owner token.
#[derive(Debug, Clone, Copy)]
pub struct Owned<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// The operation.
    pub operation: &'a str,
    /// The key.
    pub key: &'a str,
    /// The owner token.
    pub token: &'a str,
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
    /// The tenant.
    pub tenant: String,
    /// The key as the client sent it.
    pub key: String,
    /// The generation that became uncertain.
    pub generation: i64,
    /// The owner token of the execution that became uncertain: what a
    /// resolution is fenced by.
    pub token: Option<String>,
}

/// A database leased mode can keep its rows in: PostgreSQL and SQLite. Each
/// method is one short statement (or, for the claim, one short transaction) of
/// its own; every statement over an owned row matches the owner token and
/// answers how many rows it touched, so a stale owner touches none.
pub trait LeaseBackend: Backend {
    /// Claims `req.key`, committing at once.
    fn claim_leased(
        pool: &Pool<Self>,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedOutcome, StoreError>> + Send;

    /// Stores the outcome of the owned execution (`failed` for a 4xx, else
    /// `completed`), its retention counted from now; the rows touched.
    fn store_outcome(
        pool: &Pool<Self>,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Renews, marks uncertain or releases the owned execution; the rows touched.
    fn fence(
        pool: &Pool<Self>,
        row: Owned<'_>,
        what: Fence,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The key's finished outcome, if it has one, with its fingerprint.
    fn current(
        pool: &Pool<Self>,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<(Vec<u8>, StoredResponse)>, StoreError>> + Send;

    /// Up to `limit` uncertain rows of `operation`, oldest first.
    fn uncertain_rows(
        pool: &Pool<Self>,
        operation: &str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<UncertainRow>, StoreError>> + Send;

    /// Resolves an uncertain row if it is still that execution (same generation and
    /// owner token): stores `outcome` (retention from now), or forgets the key when
    /// `None`; the rows touched.
    fn resolve(
        pool: &Pool<Self>,
        operation: &str,
        row: &UncertainRow,
        outcome: Option<&StoredResponse>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Claims `req.key` in leased mode, on PostgreSQL or SQLite. The claim commits at
/// once, on its own.
///
/// # Errors
///
/// [`StoreError`] when the database fails; nothing is claimed then.
pub async fn claim_leased<DB: LeaseBackend>(
    pool: &Pool<DB>,
    req: &LeaseRequest<'_>,
) -> Result<LeasedClaim<DB>, StoreError> {
    Ok(match DB::claim_leased(pool, req).await? {
        LeasedOutcome::Acquired {
            acquisition,
            token,
            generation,
        } => LeasedClaim::Acquired(Lease {
            pool: pool.clone(),
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.clone(),
            token,
            generation,
            acquisition,
            lease: req.lease,
            retention: req.retention,
            fingerprint: req.fingerprint,
            lost: Arc::new(AtomicBool::new(false)),
        }),
        LeasedOutcome::Replay(stored) => LeasedClaim::Replay(stored),
        LeasedOutcome::Mismatch => LeasedClaim::Mismatch,
        LeasedOutcome::Uncertain => LeasedClaim::Uncertain,
        LeasedOutcome::InFlight { retry_after } => LeasedClaim::InFlight {
            retry_after: retry_after.max(Duration::from_secs(1)),
        },
    })
}

// Written by hand: derived impls would ask `DB: Debug`.
impl<DB: LeaseBackend> std::fmt::Debug for Lease<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("operation", &self.operation)
            .field("key", &self.key)
            .field("generation", &self.generation)
            .field("acquisition", &self.acquisition)
            .field("lease", &self.lease)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl<DB: LeaseBackend> std::fmt::Debug for LeasedClaim<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeasedClaim::Acquired(lease) => f.debug_tuple("Acquired").field(lease).finish(),
            LeasedClaim::Replay(stored) => f.debug_tuple("Replay").field(stored).finish(),
            LeasedClaim::Mismatch => f.write_str("Mismatch"),
            LeasedClaim::InFlight { retry_after } => f
                .debug_struct("InFlight")
                .field("retry_after", retry_after)
                .finish(),
            LeasedClaim::Uncertain => f.write_str("Uncertain"),
        }
    }
}

impl<DB: LeaseBackend> Lease<DB> {
    /// The key for the downstream system's idempotency (see [`downstream_key`]).
    pub fn downstream_key(&self) -> String {
        downstream_key(&self.tenant, &self.operation, &self.key)
    }

    /// This execution's generation: one more at every takeover or reclaim.
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// How the lease was obtained.
    pub fn acquisition(&self) -> Acquisition {
        self.acquisition
    }

    /// The lease's length.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// True once the lease is lost or taken to be: a renewal found the execution
    /// taken over, no renewal got through for a whole lease, or the renewal
    /// ceiling passed. Stop before calling downstream again. What the handler
    /// returns is still stored if no other worker took over (every store is fenced
    /// by the owner token), and never if one did.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// The pool, for the handler's own database work.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    fn owned(&self) -> Owned<'_> {
        Owned {
            tenant: &self.tenant,
            operation: &self.operation,
            key: self.key.as_str(),
            token: &self.token,
        }
    }

    pub(crate) fn renewer(&self) -> Renewer<DB> {
        Renewer {
            pool: self.pool.clone(),
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            key: self.key.as_str().to_owned(),
            token: self.token.clone(),
            lease: self.lease,
            lost: self.lost.clone(),
        }
    }

    /// Extends the lease by its length from now.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when it was taken over meanwhile.
    pub async fn renew(&self) -> Result<(), LeaseError> {
        if self.renewer().renew().await? {
            Ok(())
        } else {
            Err(LeaseError::StaleOwner {
                generation: self.generation,
            })
        }
    }

    /// Stores the outcome, fenced by this lease's owner token. A 4xx is stored as
    /// `failed`, anything else as `completed`.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over: nothing is stored,
    /// and the result must not be published.
    pub async fn complete(self, response: &StoredResponse) -> Result<(), LeaseError> {
        self.store_outcome(response).await
    }

    /// [`Lease::complete`] without giving the lease up, so a failed attempt can be
    /// retried.
    pub(crate) async fn store_outcome(&self, response: &StoredResponse) -> Result<(), LeaseError> {
        let rows = DB::store_outcome(&self.pool, self.owned(), response, self.retention).await?;
        self.fenced(rows)
    }

    /// Records that the external effect's outcome is unknown (the provider timed
    /// out after it may have charged). Retries then never execute again; a
    /// [`crate::reconcile::Reconciler`] resolves the row.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over.
    pub async fn mark_uncertain(self) -> Result<(), LeaseError> {
        self.record_uncertain().await
    }

    /// [`Lease::mark_uncertain`] without giving the lease up.
    pub(crate) async fn record_uncertain(&self) -> Result<(), LeaseError> {
        self.fenced_statement(Fence::Uncertain).await
    }

    /// Gives the key up: the effect did not happen, and a retry may execute anew.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over.
    pub async fn release(self) -> Result<(), LeaseError> {
        self.fenced_statement(Fence::Release).await
    }

    /// Runs a fenced statement that must touch exactly this lease's row.
    async fn fenced_statement(&self, what: Fence) -> Result<(), LeaseError> {
        let rows = DB::fence(&self.pool, self.owned(), what).await?;
        self.fenced(rows)
    }

    fn fenced(&self, rows: u64) -> Result<(), LeaseError> {
        if rows == 1 {
            Ok(())
        } else {
            self.lost.store(true, Ordering::Release);
            Err(LeaseError::StaleOwner {
                generation: self.generation,
            })
        }
    }

    /// The key's current stored outcome, if it has one: what a stale owner's client
    /// is answered with.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database fails.
    pub async fn current_outcome(&self) -> Result<Option<StoredResponse>, StoreError> {
        self.probe().current().await
    }

    pub(crate) fn probe(&self) -> Probe<DB> {
        Probe {
            pool: self.pool.clone(),
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            key: self.key.as_str().to_owned(),
            fingerprint: self.fingerprint,
        }
    }
}

/// Reads a key's stored outcome after its lease object is gone.
pub(crate) struct Probe<DB: LeaseBackend> {
    pool: Pool<DB>,
    tenant: String,
    operation: String,
    key: String,
    fingerprint: Fingerprint,
}

impl<DB: LeaseBackend> Probe<DB> {
    pub(crate) async fn current(&self) -> Result<Option<StoredResponse>, StoreError> {
        let found = DB::current(&self.pool, &self.tenant, &self.operation, &self.key).await?;
        // The key may since have been released and reused for another request:
        // its answer is not this client's.
        Ok(found
            .filter(|(fingerprint, _)| fingerprint[..] == self.fingerprint.as_bytes()[..])
            .map(|(_, stored)| stored))
    }
}

/// Renews a lease in the background of a running handler.
pub(crate) struct Renewer<DB: LeaseBackend> {
    pool: Pool<DB>,
    tenant: String,
    operation: String,
    key: String,
    token: String,
    lease: Duration,
    lost: Arc<AtomicBool>,
}

impl<DB: LeaseBackend> Renewer<DB> {
    /// One renewal; `false` when the lease was taken over.
    pub(crate) async fn renew(&self) -> Result<bool, StoreError> {
        let owned = Owned {
            tenant: &self.tenant,
            operation: &self.operation,
            key: &self.key,
            token: &self.token,
        };
        let kept = DB::fence(&self.pool, owned, Fence::Renew(self.lease)).await? == 1;
        if !kept {
            self.lost.store(true, Ordering::Release);
        }
        Ok(kept)
    }

    /// Renews every third of the lease until `ceiling` has passed or the lease is
    /// lost, then stops (and never returns, so it can be raced against a handler).
    ///
    /// A renewal that does not answer within a third of the lease counts as
    /// failed; once no renewal has succeeded for a whole lease, the lease is taken
    /// as lapsed and [`Lease::is_lost`] says so, so the handler can stop before
    /// calling downstream again.
    pub(crate) async fn run(self, ceiling: Duration) -> std::convert::Infallible {
        let started = tokio::time::Instant::now();
        let every = (self.lease / 3).max(Duration::from_millis(10));
        let mut last_ok = started;
        loop {
            tokio::time::sleep(every).await;
            if started.elapsed() + every > ceiling {
                tracing::warn!(operation = %self.operation, "idem: lease renewal ceiling reached; the execution may be taken over");
                break;
            }
            match tokio::time::timeout(every, self.renew()).await {
                Ok(Ok(true)) => last_ok = tokio::time::Instant::now(),
                Ok(Ok(false)) => {
                    tracing::warn!(operation = %self.operation, "idem: lease taken over; this worker's result will not be published");
                    break;
                }
                Ok(Err(e)) => {
                    tracing::warn!(operation = %self.operation, error = %e, "idem: lease renewal failed; retrying")
                }
                Err(_) => {
                    tracing::warn!(operation = %self.operation, "idem: lease renewal timed out; retrying")
                }
            }
            if last_ok.elapsed() >= self.lease {
                self.lost.store(true, Ordering::Release);
                tracing::warn!(operation = %self.operation, "idem: no renewal for a whole lease; taking the lease as lost");
                break;
            }
        }
        // Past the last renewal the lease runs out; say so when it does.
        tokio::time::sleep(self.lease.saturating_sub(last_ok.elapsed())).await;
        self.lost.store(true, Ordering::Release);
        std::future::pending().await
    }
}

/// Marks a leased handler's response: the external effect's outcome is unknown.
#[derive(Debug, Clone, Copy)]
pub struct UncertainMarker;

/// What a leased handler returns when it cannot know whether the external effect
/// happened (the provider timed out after it may have charged). The row becomes
/// `uncertain`; retries get `202` until a reconciler resolves it; the effect is
/// never run again meanwhile.
///
/// ```
/// use idem_runtime::lease::Uncertain;
/// use axum::response::IntoResponse;
///
/// let resp = Uncertain::new("the payment provider timed out").into_response();
/// assert_eq!(resp.status(), 202);
/// ```
#[derive(Debug, Clone)]
pub struct Uncertain {
    detail: String,
}

impl Uncertain {
    /// With a detail for the client (no secrets: it is sent as is).
    pub fn new(detail: impl Into<String>) -> Self {
        Uncertain {
            detail: detail.into(),
        }
    }
}

impl axum::response::IntoResponse for Uncertain {
    fn into_response(self) -> axum::response::Response {
        let mut resp = crate::Problem::uncertain(Duration::from_secs(5))
            .with_detail(self.detail)
            .into_response();
        resp.extensions_mut().insert(UncertainMarker);
        resp
    }
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downstream_keys_are_stable_and_scoped() {
        let k = IdempotencyKey::parse("k1").unwrap();
        let a = downstream_key("acme", "pay", &k);
        assert_eq!(a, downstream_key("acme", "pay", &k));
        assert_eq!(a.len(), 32);
        assert_ne!(a, downstream_key("globex", "pay", &k));
        assert_ne!(a, downstream_key("acme", "refund", &k));
        assert!(!a.contains("k1"));
    }
}
