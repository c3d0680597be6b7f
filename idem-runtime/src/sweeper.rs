//! The retention sweeper: deletes finished outcomes whose retention has passed.
//!
//! A key must not be stored forever, nor deleted casually: once its row is gone, an
//! old retry with that key executes as a new request. So the sweeper deletes only
//! rows that are **finished** (`completed` or `failed`) **and** past `expires_at`,
//! which is exactly the set a claim would execute anew anyway. Rows that are
//! `processing` or `uncertain` are never deleted, however old: an execution may
//! still be running, or its effect may have happened without being recorded.
//! Instead, rows in flight for longer than [`Sweeper::with_stale_after`] are
//! reported (a `tracing` warning with counts, and the gauges
//! [`STALE_IN_FLIGHT`] and [`OLDEST_IN_FLIGHT_SECONDS`]) so
//! that an operator resolves them.
//!
//! The sweeper runs on PostgreSQL, SQLite and MySQL / MariaDB: [`Sweeper::new`]
//! takes the backend from its pool (a `PgPool`, a `SqlitePool` or a
//! `MySqlPool`). The run itself (batches, metrics, warnings, the [`SweepReport`])
//! is the same on each; only its statements are each database's, and "now" is
//! always the database's clock, as for the claims.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::{Backend, Sweeper};
//!
//! // `pool` is a `PgPool`, a `SqlitePool` or a `MySqlPool`: the sweeper is a
//! // `Sweeper<DB>` of the pool's backend.
//! fn start_sweeper<DB: Backend>(pool: sqlx::Pool<DB>) -> tokio::task::JoinHandle<()> {
//!     Sweeper::new(pool)
//!         .with_interval(Duration::from_secs(60))
//!         .with_batch_size(1000)
//!         .spawn()
//! }
//! ```
//!
//! ## Concurrency
//!
//! Deletion runs in bounded batches, each its own short statement.
//!
//! On PostgreSQL each batch locks its rows with `FOR UPDATE SKIP LOCKED`: several
//! replicas may sweep at once, each takes rows the others have not, and none waits
//! on a row that a request is re-claiming at that moment. On MySQL / MariaDB a
//! `DELETE` cannot skip locked rows, so each batch is chosen with a locking read
//! that does (`FOR UPDATE SKIP LOCKED`, at READ COMMITTED) and then deleted by
//! primary key in the same transaction: the same sharing between replicas.
//!
//! On SQLite there is nothing to skip: SQLite serialises writers, so a batch takes
//! the database's single write lock (waiting for it through the connection's busy
//! timeout, like any writer) and no other transaction can hold or change its rows
//! meanwhile; two sweepers simply take turns. The flip side is that while a batch
//! runs, every claim (of any key) waits for it, so keep batches small enough to be
//! short next to the claims' in-flight wait. A batch that cannot get the lock
//! within the busy timeout fails the run with [`StoreError::Database`]
//! ([`Sweeper::spawn`] logs it and tries again at the next interval).
//!
//! ## Cost
//!
//! Each batch walks the index `idempotency_requests_expires_at_idx (expires_at)`
//! (on every backend) from the oldest expiry and deletes by row address (`ctid`,
//! `rowid`; on MySQL by primary key), so a batch costs about its size however
//! large the table or the backlog. The backlog count after a run is a range scan
//! over the same index, proportional to the backlog itself: cheap while the
//! sweeper keeps up, and the number an operator needs when it does not.
//!
//! The in-flight check uses the index `idempotency_requests_in_flight_idx`:
//! partial on PostgreSQL and SQLite (there since
//! `migrations/sqlite/…02_in_flight_index.sql`), `(state, created_at)` on MySQL,
//! which has no partial indexes.

use std::time::Duration;

use serde::Serialize;
use sqlx::Pool;

use crate::db::Backend;
use crate::metrics::{
    OLDEST_IN_FLIGHT_SECONDS, STALE_IN_FLIGHT, SWEEPER_BACKLOG, SWEEPER_DELETED_TOTAL,
    UNCERTAIN_ROWS,
};
use crate::model::{InFlightSummary, StoreError};

/// Deletes expired finished rows in bounded batches and reports old in-flight rows.
///
/// Build it with [`Sweeper::new`] and the `with_*` methods, then either call
/// [`Sweeper::sweep_once`] yourself (from a cron job, say) or [`Sweeper::spawn`] it
/// in the service. Safe to run on every replica at once.
///
/// [`Sweeper::new`] on a `PgPool` gives a `Sweeper<Postgres>`, on a `SqlitePool` a
/// `Sweeper<Sqlite>`, on a `MySqlPool` a `Sweeper<MySql>`.
#[derive(Debug)]
pub struct Sweeper<DB: Backend> {
    pool: Pool<DB>,
    batch_size: u32,
    max_batches: u32,
    interval: Duration,
    stale_after: Duration,
}

// By hand rather than derived: a derive would demand `DB: Clone` of the backend
// marker type, which the pool does not need. (`Debug` every backend has.)
impl<DB: Backend> Clone for Sweeper<DB> {
    fn clone(&self) -> Self {
        Sweeper {
            pool: self.pool.clone(),
            batch_size: self.batch_size,
            max_batches: self.max_batches,
            interval: self.interval,
            stale_after: self.stale_after,
        }
    }
}

/// What one [`Sweeper::sweep_once`] did and saw.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SweepReport {
    /// Rows deleted by this run.
    pub deleted: u64,
    /// `DELETE` statements this run issued, at most the configured maximum. The
    /// last one may delete fewer rows than the batch size (or none): that is how
    /// the run learns the backlog is drained.
    pub batches: u32,
    /// Expired finished rows still present after the run: more than the run could
    /// take, rows another sweeper or a claim held locked (PostgreSQL), or rows
    /// that expired meanwhile. A backlog that keeps growing means the sweeper
    /// cannot keep up.
    pub backlog: u64,
    /// Rows in flight (`processing` or `uncertain`) for longer than the stale
    /// threshold. They are never deleted by the sweeper.
    pub stale_in_flight: u64,
    /// Age of the oldest in-flight row, if there is one.
    #[serde(rename = "oldest_in_flight_seconds", serialize_with = "as_seconds")]
    pub oldest_in_flight: Option<Duration>,
}

fn as_seconds<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// The defaults, the same for every backend; name one to read them
/// (`Sweeper::<Postgres>::DEFAULT_BATCH_SIZE`), as idem's types have no default
/// database.
impl<DB: Backend> Sweeper<DB> {
    /// Rows deleted per statement unless configured otherwise.
    pub const DEFAULT_BATCH_SIZE: u32 = 1000;
    /// Statements per run unless configured otherwise.
    pub const DEFAULT_MAX_BATCHES: u32 = 100;
    /// Pause between runs of [`Sweeper::spawn`] unless configured otherwise.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
    /// In-flight age beyond which a row is reported as stale unless configured
    /// otherwise.
    pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(15 * 60);
    /// The longest [`Sweeper::with_stale_after`] age: a century of 365.25-day
    /// years, which every database counts without overflow.
    pub const MAX_STALE_AFTER: Duration =
        Duration::from_millis(crate::model::CENTURY_MS.unsigned_abs());
}

impl<DB: Backend> Sweeper<DB> {
    /// A sweeper on `pool` with the default settings; the backend (PostgreSQL,
    /// SQLite or MySQL) is the pool's.
    pub fn new(pool: Pool<DB>) -> Self {
        Sweeper {
            pool,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            max_batches: Self::DEFAULT_MAX_BATCHES,
            interval: Self::DEFAULT_INTERVAL,
            stale_after: Self::DEFAULT_STALE_AFTER,
        }
    }

    /// Rows deleted per statement (at least 1). Each statement is its own short
    /// transaction, so a smaller batch holds locks for less time (on SQLite, the
    /// write lock every claim waits for).
    pub fn with_batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// The most statements one run issues (at least 1), which bounds the work and
    /// the time of a run; what is left is reported as the backlog and taken by the
    /// next run.
    pub fn with_max_batches(mut self, batches: u32) -> Self {
        self.max_batches = batches.max(1);
        self
    }

    /// The pause between two runs of [`Sweeper::spawn`] (at least a millisecond,
    /// since a zero interval would spin).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The age beyond which a `processing` or `uncertain` row is reported as stale.
    /// Set it well above your longest legitimate execution (or lease). At most
    /// [`Sweeper::MAX_STALE_AFTER`] (a century): a longer age is taken as that,
    /// where the database's interval or integer arithmetic would overflow.
    pub fn with_stale_after(mut self, age: Duration) -> Self {
        self.stale_after = age.min(Self::MAX_STALE_AFTER);
        self
    }

    /// The configured batch size.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// The configured maximum of statements per run.
    pub fn max_batches(&self) -> u32 {
        self.max_batches
    }

    /// The configured pause between runs.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The configured stale threshold.
    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Runs once: deletes up to `batch_size * max_batches` expired finished rows,
    /// then measures the backlog and the in-flight rows, updates the gauges and
    /// warns about stale in-flight rows.
    ///
    /// Rows deleted before an error stay deleted and are counted in
    /// [`SWEEPER_DELETED_TOTAL`]; the gauges are only updated by a complete run.
    ///
    /// # Errors
    ///
    /// [`StoreError::Database`] when a statement fails (a missing table included;
    /// on SQLite also a write lock not obtained within the busy timeout).
    pub async fn sweep_once(&self) -> Result<SweepReport, StoreError> {
        let mut deleted = 0u64;
        let mut batches = 0u32;
        while batches < self.max_batches {
            let rows = DB::delete_batch(&self.pool, self.batch_size).await?;
            batches += 1;
            deleted += rows;
            // Counted per batch so that a run that fails half-way still reports
            // the rows it did remove.
            metrics::counter!(SWEEPER_DELETED_TOTAL).increment(rows);
            if rows < u64::from(self.batch_size) {
                break;
            }
        }

        let backlog = DB::backlog(&self.pool).await?;
        let InFlightSummary {
            stale_processing,
            stale_uncertain,
            uncertain,
            oldest_seconds,
        } = DB::in_flight(&self.pool, self.stale_after).await?;
        let stale_in_flight = stale_processing.saturating_add(stale_uncertain);
        // A row created "in the future" (clock skew between primaries, a manual
        // insert) would give a negative age, which Duration cannot hold; one
        // from "before time" (PostgreSQL's `-infinity`, a REAL written by hand
        // into SQLite's column) an age past what it holds, which is reported
        // as the longest there is rather than ending the spawned sweeper.
        let oldest_in_flight = oldest_seconds
            .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX));

        metrics::gauge!(SWEEPER_BACKLOG).set(backlog as f64);
        metrics::gauge!(STALE_IN_FLIGHT).set(stale_in_flight as f64);
        metrics::gauge!(UNCERTAIN_ROWS).set(uncertain as f64);
        metrics::gauge!(OLDEST_IN_FLIGHT_SECONDS)
            .set(oldest_in_flight.map_or(0.0, |d| d.as_secs_f64()));

        if stale_in_flight > 0 {
            // Counts only: keys and tenants stay out of logs.
            tracing::warn!(
                stale_processing,
                stale_uncertain,
                oldest_in_flight_seconds = oldest_in_flight.map_or(0.0, |d| d.as_secs_f64()),
                stale_after_seconds = self.stale_after.as_secs_f64(),
                "idem: rows in flight for longer than the stale threshold; the sweeper never deletes them: \
                 reconcile uncertain rows, and inspect or purge them with `idem show` / `idem purge --force`"
            );
        }
        if batches == self.max_batches && backlog > 0 {
            tracing::info!(
                deleted,
                backlog,
                "idem: sweep stopped at its batch limit; the rest is left for the next run"
            );
        }

        let report = SweepReport {
            deleted,
            batches,
            backlog,
            stale_in_flight,
            oldest_in_flight,
        };
        tracing::debug!(
            deleted,
            batches,
            backlog,
            stale_in_flight,
            "idem: sweep done"
        );
        Ok(report)
    }

    /// Runs [`Sweeper::sweep_once`] now and then after every interval, forever, on
    /// the current Tokio runtime. An error is logged and the next run goes ahead:
    /// a database that is briefly away must not stop retention for good. Abort the
    /// returned handle to stop it.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, as [`tokio::spawn`].
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.interval);
            // After a slow run, wait a whole interval rather than running back to
            // back to catch up: the backlog is taken by the next run anyway.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(error) = self.sweep_once().await {
                    tracing::error!(%error, "idem: sweep failed; retrying at the next interval");
                }
            }
        })
    }
}
