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

    /// One round: each uncertain row of the operation, at most the batch, locked
    /// while its downstream is asked, then resolved.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database fails; rows resolved before stay resolved.
    pub async fn run_once(&self) -> Result<ReconcileReport, StoreError> {
        let mut report = ReconcileReport::default();
        let op = self.reconcile.operation().to_owned();
        let mut skip_tenants: Vec<String> = Vec::new();
        let mut skip_keys: Vec<String> = Vec::new();
        for _ in 0..self.batch {
            let mut tx = self.pool.begin().await?;
            // Rows this round left uncertain are skipped so the round ends.
            let row = sqlx::query(
                "SELECT tenant_id, idempotency_key, generation FROM idempotency_requests \
                  WHERE operation = $1 AND state = 'uncertain' \
                    AND (tenant_id, idempotency_key) NOT IN \
                        (SELECT t, k FROM unnest($2::text[], $3::text[]) AS s(t, k)) \
                  ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED",
            )
            .bind(&op)
            .bind(&skip_tenants)
            .bind(&skip_keys)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else { break };
            let tenant: String = row.try_get("tenant_id")?;
            let key: String = row.try_get("idempotency_key")?;
            let parsed = crate::IdempotencyKey::parse(&key)
                .map_err(|e| StoreError::Corrupt(format!("stored key: {e}")))?;
            let outcome = UncertainOutcome {
                downstream_key: crate::lease::downstream_key(&tenant, &op, &parsed),
                tenant: tenant.clone(),
                operation: op.clone(),
                key: key.clone(),
                generation: row.try_get("generation")?,
            };
            match self.reconcile.reconcile(&outcome).await {
                Resolution::Completed(stored) => {
                    let state = if stored.is_failure() {
                        "failed"
                    } else {
                        "completed"
                    };
                    sqlx::query(
                        "UPDATE idempotency_requests \
                            SET state = $4, response_status = $5, response_headers = $6, \
                                response_body = $7, completed_at = clock_timestamp() \
                          WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3",
                    )
                    .bind(&tenant)
                    .bind(&op)
                    .bind(&key)
                    .bind(state)
                    .bind(i16::try_from(stored.status).unwrap_or(500))
                    .bind(sqlx::types::Json(&stored.headers))
                    .bind(&stored.body[..])
                    .execute(&mut *tx)
                    .await?;
                    report.completed += 1;
                    crate::metrics::reconciled(&op, "completed");
                }
                Resolution::Released => {
                    sqlx::query(
                        "DELETE FROM idempotency_requests \
                          WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3",
                    )
                    .bind(&tenant)
                    .bind(&op)
                    .bind(&key)
                    .execute(&mut *tx)
                    .await?;
                    report.released += 1;
                    crate::metrics::reconciled(&op, "released");
                }
                Resolution::StillUncertain => {
                    skip_tenants.push(tenant.clone());
                    skip_keys.push(key.clone());
                    report.still_uncertain += 1;
                    crate::metrics::reconciled(&op, "still_uncertain");
                }
            }
            tx.commit().await?;
        }
        Ok(report)
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
