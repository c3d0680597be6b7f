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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::{StoreError, StoredResponse};

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
#[derive(Debug)]
#[must_use = "an acquired lease must be completed, marked uncertain or released"]
pub enum LeasedClaim {
    /// The caller owns the execution.
    Acquired(Lease),
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
#[derive(Debug)]
pub struct Lease {
    pool: PgPool,
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

const CLAIM_SQL: &str = "SELECT outcome, generation, owner_token, retry_after_ms, \
        response_status, response_headers, response_body \
   FROM idem_claim_leased($1, $2, $3, $4, $5, $6)";

/// The primary key condition, as a literal so statements stay `&'static str`.
macro_rules! pk {
    () => {
        " tenant_id = $1 AND operation = $2 AND idempotency_key = $3 "
    };
}

/// Claims `req.key` in leased mode. The claim commits at once, in its own
/// statement on `pool`.
///
/// # Errors
///
/// [`StoreError`] when the database fails; nothing is claimed then.
pub async fn claim_leased(
    pool: &PgPool,
    req: &LeaseRequest<'_>,
) -> Result<LeasedClaim, StoreError> {
    let row = sqlx::query(CLAIM_SQL)
        .bind(req.tenant)
        .bind(req.operation)
        .bind(req.key.as_str())
        .bind(&req.fingerprint.as_bytes()[..])
        .bind(millis(req.retention))
        .bind(millis(req.lease))
        .fetch_one(pool)
        .await?;
    let outcome: &str = row.try_get("outcome")?;
    let acquired = |acquisition| -> Result<LeasedClaim, StoreError> {
        Ok(LeasedClaim::Acquired(Lease {
            pool: pool.clone(),
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.clone(),
            token: row.try_get("owner_token")?,
            generation: row.try_get("generation")?,
            acquisition,
            lease: req.lease,
            retention: req.retention,
            fingerprint: req.fingerprint,
            lost: Arc::new(AtomicBool::new(false)),
        }))
    };
    match outcome {
        "acquired" => acquired(Acquisition::New),
        "reclaimed" => acquired(Acquisition::Reclaimed),
        "taken_over" => acquired(Acquisition::TakenOver),
        "replay" => Ok(LeasedClaim::Replay(stored_from_row(&row)?)),
        "mismatch" => Ok(LeasedClaim::Mismatch),
        "uncertain" => Ok(LeasedClaim::Uncertain),
        "in_flight" => {
            let ms: Option<i64> = row.try_get("retry_after_ms")?;
            let ms = u64::try_from(ms.unwrap_or(1000)).unwrap_or(1000);
            Ok(LeasedClaim::InFlight {
                retry_after: Duration::from_millis(ms).max(Duration::from_secs(1)),
            })
        }
        other => Err(StoreError::Corrupt(format!(
            "leased claim outcome {other:?}"
        ))),
    }
}

pub(crate) fn stored_from_row(row: &sqlx::postgres::PgRow) -> Result<StoredResponse, StoreError> {
    let status: i16 = row.try_get("response_status")?;
    let headers: Option<sqlx::types::Json<Vec<(String, String)>>> =
        row.try_get("response_headers")?;
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    Ok(StoredResponse {
        status: u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
        headers: headers.map(|h| h.0).unwrap_or_default(),
        body: Bytes::from(body.unwrap_or_default()),
    })
}

impl Lease {
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

    /// True once a renewal found the execution taken over: stop, the result will
    /// not be published.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// The pool, for the handler's own database work.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(crate) fn renewer(&self) -> Renewer {
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
        let state = response.state();
        let status = i16::try_from(response.status)
            .map_err(|_| StoreError::Corrupt(format!("status {}", response.status)))?;
        let done = sqlx::query(concat!(
            "UPDATE idempotency_requests \
                SET state = $5, response_status = $6, response_headers = $7, response_body = $8, \
                    completed_at = c.t, expires_at = c.t + $9 * interval '1 millisecond', \
                    lease_expires_at = NULL \
               FROM (SELECT clock_timestamp() AS t) c \
              WHERE",
            pk!(),
            "AND owner_token = $4::uuid AND state = 'processing'"
        ))
        .bind(&self.tenant)
        .bind(&self.operation)
        .bind(self.key.as_str())
        .bind(&self.token)
        .bind(state)
        .bind(status)
        .bind(sqlx::types::Json(&response.headers))
        .bind(&response.body[..])
        .bind(millis(self.retention))
        .execute(&self.pool)
        .await?;
        self.fenced(done.rows_affected())
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
        self.fenced_statement(concat!(
            "UPDATE idempotency_requests SET state = 'uncertain', lease_expires_at = NULL \
              WHERE",
            pk!(),
            "AND owner_token = $4::uuid AND state = 'processing'"
        ))
        .await
    }

    /// Gives the key up: the effect did not happen, and a retry may execute anew.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over.
    pub async fn release(self) -> Result<(), LeaseError> {
        self.fenced_statement(concat!(
            "DELETE FROM idempotency_requests WHERE",
            pk!(),
            "AND owner_token = $4::uuid AND state = 'processing'"
        ))
        .await
    }

    /// Runs a statement over this lease's row (`$1..$4`: tenant, operation, key,
    /// owner token) that must touch exactly that row while this lease owns it.
    async fn fenced_statement(&self, sql: &'static str) -> Result<(), LeaseError> {
        let done = sqlx::query(sql)
            .bind(&self.tenant)
            .bind(&self.operation)
            .bind(self.key.as_str())
            .bind(&self.token)
            .execute(&self.pool)
            .await?;
        self.fenced(done.rows_affected())
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

    pub(crate) fn probe(&self) -> Probe {
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
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    pool: PgPool,
    tenant: String,
    operation: String,
    key: String,
    fingerprint: Fingerprint,
}

impl Probe {
    pub(crate) async fn current(&self) -> Result<Option<StoredResponse>, StoreError> {
        let row = sqlx::query(concat!(
            "SELECT fingerprint, response_status, response_headers, response_body FROM idempotency_requests \
              WHERE",
            pk!(),
            "AND state IN ('completed', 'failed')"
        ))
        .bind(&self.tenant)
        .bind(&self.operation)
        .bind(&self.key)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        // The key may since have been released and reused for another request:
        // its answer is not this client's.
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        if fingerprint != self.fingerprint.as_bytes() {
            return Ok(None);
        }
        stored_from_row(&row).map(Some)
    }
}

/// Renews a lease in the background of a running handler.
#[derive(Debug, Clone)]
pub(crate) struct Renewer {
    pool: PgPool,
    tenant: String,
    operation: String,
    key: String,
    token: String,
    lease: Duration,
    lost: Arc<AtomicBool>,
}

impl Renewer {
    /// One renewal; `false` when the lease was taken over.
    pub(crate) async fn renew(&self) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE idempotency_requests \
                SET lease_expires_at = clock_timestamp() + $5 * interval '1 millisecond' \
              WHERE",
            pk!(),
            "AND owner_token = $4::uuid AND state = 'processing'"
        ))
        .bind(&self.tenant)
        .bind(&self.operation)
        .bind(&self.key)
        .bind(&self.token)
        .bind(millis(self.lease))
        .execute(&self.pool)
        .await?;
        let kept = done.rows_affected() == 1;
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

fn millis(d: Duration) -> i64 {
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
