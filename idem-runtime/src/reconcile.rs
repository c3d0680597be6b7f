//! Resolving `uncertain` outcomes: executions whose external effect is unknown (the
//! provider timed out after it may have charged). Retries of such a key never run
//! the effect again; they wait until a [`Reconciler`] has asked the downstream
//! system, by the stable [`crate::lease::downstream_key`], what happened.

use std::future::Future;
use std::time::Duration;

use std::sync::Mutex;

use sqlx::Pool;

use crate::db::Backend;
use crate::lease::LeaseBackend;
use crate::model::{StoreError, StoredResponse};

pub use crate::model::UncertainOutcome;

/// What the downstream system said.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Resolution {
    /// The effect happened: store this outcome; retries replay it, its
    /// headers as given but for [`crate::NEVER_STORED_HEADERS`] (the
    /// service's stored-header list is the handlers', which a reconciler
    /// does not see: give it only what a retry should get). A status
    /// that is not a final answer a retry may replay (a `5xx`, a `1xx`, or a
    /// gRPC status a live call rolls back) is not stored: the row stays
    /// uncertain for the next round.
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
#[non_exhaustive]
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

/// Runs a [`Reconcile`] over the uncertain rows of its operation, on any SQL
/// database (the pool's type decides) or on Redis ([`Reconciler::on_store`]). Several replicas may run one each: an answer
/// is applied only to the same uncertain execution it was asked about, so a row
/// is resolved once.
pub struct Reconciler<R, DB: LeaseBackend> {
    pool: DB::Store,
    reconcile: R,
    batch: i64,
    interval: Duration,
    /// Where the next round starts: after the last row of the previous one, so
    /// that rows that stay uncertain round after round (a downstream that never
    /// answers) cannot keep newer rows from being asked about. `None`: from the
    /// oldest.
    resume_after: Mutex<Option<DB::UncertainRow>>,
    /// What the outcomes it stores are sealed with (see
    /// [`Reconciler::with_key_ring`]).
    ring: Option<crate::at_rest::KeyRing>,
}

impl<R, DB: LeaseBackend> std::fmt::Debug for Reconciler<R, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("batch", &self.batch)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl<R: Reconcile, DB: Backend> Reconciler<R, DB> {
    /// A reconciler of up to 100 rows a round, every 10 seconds. It seals
    /// nothing unless given a key ring ([`Reconciler::with_key_ring`]);
    /// [`crate::Idem::reconciler`] builds one with the service's.
    pub fn new(pool: Pool<DB>, reconcile: R) -> Self {
        Self::on_store(pool, reconcile)
    }
}

impl<R: Reconcile, DB: LeaseBackend> Reconciler<R, DB> {
    /// A reconciler over any lease store ([`Reconciler::new`] for a pool), of
    /// up to 100 rows a round, every 10 seconds.
    pub fn on_store(store: DB::Store, reconcile: R) -> Self {
        Reconciler {
            reconcile,
            batch: 100,
            interval: Duration::from_secs(10),
            resume_after: Mutex::new(None),
            ring: DB::store_key_ring(&store).cloned(),
            pool: store,
        }
    }

    /// Seals the outcomes it stores with `ring`, as the service's
    /// [`crate::Idem::with_key_ring`] seals its handlers' (see
    /// [`crate::at_rest`]). A reconciler on a Redis store with a key ring takes
    /// that ring by itself.
    pub fn with_key_ring(mut self, ring: crate::at_rest::KeyRing) -> Self {
        self.ring = Some(ring);
        self
    }

    /// Rows per round.
    pub fn with_batch(mut self, rows: i64) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// Time between rounds of [`Reconciler::spawn`]; at least a millisecond
    /// (0 would run the rounds in a tight loop), as the sweeper's.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// One round: up to a batch of the operation's uncertain rows in creation
    /// order, starting after the last row the previous round asked about (and
    /// from the oldest again once a round reaches the newest), so every uncertain
    /// row is asked about within a few rounds however many never resolve.
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
        let after = self.resume_after.lock().expect("not poisoned").take();
        let rows = DB::lease_uncertain(&self.pool, &op, after.as_ref(), self.batch).await?;
        // A short page reached the newest row: the next round starts over.
        let next = if (rows.len() as i64) < self.batch {
            None
        } else {
            rows.last().cloned()
        };
        *self.resume_after.lock().expect("not poisoned") = next;
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
            crate::metrics::reconciled(op.clone(), outcome);
        }
        Ok(report)
    }

    async fn resolve(&self, op: &str, row: &DB::UncertainRow) -> Result<&'static str, StoreError> {
        let outcome = DB::lease_describe(op, row)?;
        let (stored, applied) = match self.reconcile.reconcile(&outcome).await {
            Resolution::Completed(stored) if !(200..500).contains(&stored.status) => {
                // A 5xx is never stored (a retry must be able to run), nor an
                // interim 1xx (no final answer to replay); the row waits for a
                // definite answer.
                tracing::warn!(operation = %op, status = stored.status, "idem: a reconciliation answered a 5xx or an interim 1xx; the row stays uncertain");
                return Ok("still_uncertain");
            }
            Resolution::Completed(stored) if !grpc_status_kept(&stored) => {
                // A gRPC status a live method's call would roll back
                // (`ABORTED`, `RESOURCE_EXHAUSTED`, `CANCELLED`, ...): stored,
                // it would be replayed for the whole retention.
                tracing::warn!(operation = %op, status = stored.status, "idem: a reconciliation answered a gRPC status that is never stored; the row stays uncertain");
                return Ok("still_uncertain");
            }
            Resolution::Completed(stored) => (Some(without_never_stored(op, stored)), "completed"),
            Resolution::Released => (None, "released"),
            Resolution::StillUncertain => return Ok("still_uncertain"),
        };
        let kept = match &stored {
            Some(stored) => {
                let at = crate::at_rest::RowId {
                    tenant: &outcome.tenant,
                    operation: op,
                    key: &outcome.key_digest,
                    generation: outcome.generation,
                };
                Some(crate::at_rest::seal(self.ring.as_ref(), &at, stored)?)
            }
            None => None,
        };
        let rows = DB::lease_resolve(&self.pool, op, row, kept.as_deref()).await?;
        Ok(if rows == 1 { applied } else { "raced" })
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

/// A reconciler's answer without the headers no answer keeps
/// ([`crate::NEVER_STORED_HEADERS`]): a handler's are left out when it is
/// captured, and a replay would send a reconciler's to every retry for the
/// whole retention.
fn without_never_stored(op: &str, mut stored: StoredResponse) -> StoredResponse {
    stored.headers.retain(|(name, _)| {
        let never = crate::NEVER_STORED_HEADERS
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name));
        if never {
            tracing::warn!(operation = %op, header = %name, "idem: a reconciliation's answer carried a header that is never stored; left out");
        }
        !never
    });
    stored
}

/// Whether a reconciler's answer may be stored as far as gRPC's statuses go
/// (see `grpc::status_kept`); anything but a gRPC status is.
#[cfg(feature = "grpc")]
fn grpc_status_kept(stored: &StoredResponse) -> bool {
    crate::grpc::status_kept(stored).unwrap_or(true)
}

/// Without gRPC there are no gRPC statuses to refuse.
#[cfg(not(feature = "grpc"))]
fn grpc_status_kept(_: &StoredResponse) -> bool {
    true
}
