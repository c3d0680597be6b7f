//! Resolving `uncertain` outcomes: executions whose external effect is unknown (the
//! provider timed out after it may have charged). Retries of such a key never run
//! the effect again; they wait until a [`Reconciler`] has asked the downstream
//! system, by the stable [`crate::lease::downstream_key`], what happened.

use std::future::Future;
use std::time::Duration;

use sqlx::{PgPool, Row};

use crate::store::{StoreError, StoredResponse};

/// An uncertain execution to resolve.
#[derive(Debug, Clone)]
pub struct UncertainOutcome {
    /// The tenant.
    pub tenant: String,
    /// The operation.
    pub operation: String,
    /// The key the client sent (for the application's own lookups; do not log it).
    pub key: String,
    /// The key the downstream system knows the effect by.
    pub downstream_key: String,
    /// The generation of the execution that became uncertain.
    pub generation: i64,
}

/// What the downstream system said.
#[derive(Debug, Clone)]
pub enum Resolution {
    /// The effect happened: store this outcome; retries replay it.
    Completed(StoredResponse),
    /// The effect did not happen: forget the key; a retry executes anew.
    Released,
    /// Still unknown: ask again on the next round.
    StillUncertain,
}

/// The application's question to its downstream system, for one operation.
pub trait Reconcile: Send + Sync + 'static {
    /// The operation whose uncertain rows this resolves.
    fn operation(&self) -> &str;

    /// Asks the downstream system about one execution.
    fn reconcile(&self, outcome: &UncertainOutcome) -> impl Future<Output = Resolution> + Send;
}

/// What one reconciliation round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Rows resolved as completed (or failed, for a 4xx outcome).
    pub completed: u64,
    /// Rows released.
    pub released: u64,
    /// Rows still uncertain.
    pub still_uncertain: u64,
    /// Rows whose reconciliation failed; they stay uncertain for the next round.
    pub errors: u64,
}

/// Runs a [`Reconcile`] over the uncertain rows of its operation. Several replicas
/// may run one each: rows are taken with `FOR UPDATE SKIP LOCKED`.
#[derive(Debug)]
pub struct Reconciler<R> {
    pool: PgPool,
    reconcile: R,
    batch: i64,
    interval: Duration,
}

impl<R: Reconcile> Reconciler<R> {
    /// A reconciler of up to 100 rows a round, every 10 seconds.
    pub fn new(pool: PgPool, reconcile: R) -> Self {
        Reconciler {
            pool,
            reconcile,
            batch: 100,
            interval: Duration::from_secs(10),
        }
    }

    /// Rows per round.
    pub fn with_batch(mut self, rows: i64) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// Time between rounds of [`Reconciler::spawn`].
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// One round: up to a batch of the operation's uncertain rows, oldest first.
    /// Each row's downstream is asked without holding a lock (a client retry of
    /// that key is answered at once meanwhile), and the answer is applied only if
    /// the row is still the same uncertain execution, so two reconcilers never
    /// apply twice. A row that fails is logged, counted and left for the next
    /// round; it does not stop the others.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the batch cannot be read; rows resolved before stay
    /// resolved.
    pub async fn run_once(&self) -> Result<ReconcileReport, StoreError> {
        let op = self.reconcile.operation().to_owned();
        let rows = sqlx::query(
            "SELECT tenant_id, idempotency_key, generation FROM idempotency_requests \
              WHERE operation = $1 AND state = 'uncertain' ORDER BY created_at LIMIT $2",
        )
        .bind(&op)
        .bind(self.batch)
        .fetch_all(&self.pool)
        .await?;
        let mut report = ReconcileReport::default();
        for row in rows {
            let outcome = match self.resolve(&op, &row).await {
                Ok(outcome) => outcome,
                Err(e) => {
                    tracing::error!(operation = %op, error = %e, "idem: reconciling a row failed; it stays uncertain");
                    "error"
                }
            };
            match outcome {
                "completed" => report.completed += 1,
                "released" => report.released += 1,
                "still_uncertain" => report.still_uncertain += 1,
                "error" => report.errors += 1,
                _ => {}
            }
            crate::metrics::reconciled(&op, outcome);
        }
        Ok(report)
    }

    async fn resolve(
        &self,
        op: &str,
        row: &sqlx::postgres::PgRow,
    ) -> Result<&'static str, StoreError> {
        let tenant: String = row.try_get("tenant_id")?;
        let key: String = row.try_get("idempotency_key")?;
        let generation: i64 = row.try_get("generation")?;
        let parsed = crate::IdempotencyKey::parse(&key)
            .map_err(|e| StoreError::Corrupt(format!("stored key: {e}")))?;
        let outcome = UncertainOutcome {
            downstream_key: crate::lease::downstream_key(&tenant, op, &parsed),
            tenant: tenant.clone(),
            operation: op.to_owned(),
            key: key.clone(),
            generation,
        };
        match self.reconcile.reconcile(&outcome).await {
            Resolution::Completed(stored) if stored.status >= 500 => {
                // A 5xx is never stored (a retry must be able to run); the row
                // waits for a definite answer.
                tracing::warn!(operation = %op, status = stored.status, "idem: a reconciliation answered 5xx; the row stays uncertain");
                Ok("still_uncertain")
            }
            Resolution::Completed(stored) => {
                let state = stored.state();
                // The retention runs from now, as for any completion: a row
                // resolved late must not be already expired.
                let done = sqlx::query(
                    "UPDATE idempotency_requests r \
                        SET state = $5, response_status = $6, response_headers = $7, \
                            response_body = $8, completed_at = c.t, lease_expires_at = NULL, \
                            expires_at = c.t + (r.expires_at - r.created_at) \
                       FROM (SELECT clock_timestamp() AS t) c \
                      WHERE r.tenant_id = $1 AND r.operation = $2 AND r.idempotency_key = $3 \
                        AND r.generation = $4 AND r.state = 'uncertain'",
                )
                .bind(&tenant)
                .bind(op)
                .bind(&key)
                .bind(generation)
                .bind(state)
                .bind(
                    i16::try_from(stored.status)
                        .map_err(|_| StoreError::Corrupt(format!("status {}", stored.status)))?,
                )
                .bind(sqlx::types::Json(&stored.headers))
                .bind(&stored.body[..])
                .execute(&self.pool)
                .await?;
                Ok(if done.rows_affected() == 1 {
                    "completed"
                } else {
                    "raced"
                })
            }
            Resolution::Released => {
                let done = sqlx::query(
                    "DELETE FROM idempotency_requests \
                      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
                        AND generation = $4 AND state = 'uncertain'",
                )
                .bind(&tenant)
                .bind(op)
                .bind(&key)
                .bind(generation)
                .execute(&self.pool)
                .await?;
                Ok(if done.rows_affected() == 1 {
                    "released"
                } else {
                    "raced"
                })
            }
            Resolution::StillUncertain => Ok("still_uncertain"),
        }
    }

    /// Runs rounds forever, every interval; errors are logged and the loop goes on.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                if let Err(e) = self.run_once().await {
                    tracing::error!(operation = self.reconcile.operation(), error = %e, "idem: reconciliation round failed");
                }
                tokio::time::sleep(self.interval).await;
            }
        })
    }
}
