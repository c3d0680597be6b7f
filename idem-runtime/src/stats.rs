//! Table statistics for a dashboard or a health check: rows by state and operation,
//! stored bytes, the oldest valid row, the oldest in-flight age and the rows that
//! have expired but are not swept yet.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
//! let s = idem_runtime::stats(&pool).await?;
//! if s.oldest_in_flight_seconds.is_some_and(|age| age > 900.0) {
//!     eprintln!("an execution has been in flight for over 15 minutes");
//! }
//! # Ok(()) }
//! ```
//!
//! [`stats`] reads the whole table (it sums body sizes), so it suits an admin
//! command or a dashboard refreshed every minute or so, not a per-request probe.
//! Ages and timestamps come from the database clock.

use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::store::StoreError;

// Both queries run in one REPEATABLE READ snapshot so that their numbers agree
// with each other (and now() is the same instant for both).
const BY_GROUP_SQL: &str = "SELECT operation, state, count(*) AS rows, \
        coalesce(sum(coalesce(octet_length(response_body), 0)::bigint \
                     + coalesce(octet_length(response_headers::text), 0)), 0)::bigint AS bytes, \
        count(*) FILTER (WHERE expires_at <= now() AND state IN ('completed', 'failed')) AS expired \
      FROM idempotency_requests GROUP BY operation, state ORDER BY operation, state";

const AGES_SQL: &str = "SELECT \
        to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS taken_at, \
        to_char(min(created_at) FILTER (WHERE expires_at > now()) AT TIME ZONE 'UTC', \
                'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS oldest_valid, \
        extract(epoch FROM now() - min(created_at) FILTER (WHERE expires_at > now()))::float8 \
            AS oldest_valid_age, \
        extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('processing', 'uncertain')))::float8 \
            AS oldest_in_flight \
      FROM idempotency_requests";

/// A snapshot of the idempotency table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// When the snapshot was taken, by the database clock (RFC 3339, UTC).
    pub taken_at: String,
    /// All rows.
    pub rows: u64,
    /// All rows by state.
    pub by_state: StateCounts,
    /// Rows, bytes and unswept rows per operation, sorted by operation name.
    pub by_operation: Vec<OperationStats>,
    /// Bytes of stored outcomes: response bodies plus the text of their headers.
    pub stored_bytes: u64,
    /// `created_at` of the oldest row that has not expired (RFC 3339, UTC); `None`
    /// when every row has expired or the table is empty. How far back the
    /// retention promise reaches right now.
    pub oldest_valid_created_at: Option<String>,
    /// Age in seconds of that oldest unexpired row.
    pub oldest_valid_age_seconds: Option<f64>,
    /// Age in seconds of the oldest `processing` or `uncertain` row; `None` when
    /// nothing is in flight. Transactional executions that have not committed are
    /// invisible here, so this is about leased or stuck rows.
    pub oldest_in_flight_seconds: Option<f64>,
    /// Finished rows past their retention that the sweeper has not deleted yet.
    /// (Expired in-flight rows are not counted: the sweeper never deletes them.)
    pub expired_unswept: u64,
}

/// Row counts by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StateCounts {
    /// Rows being executed (committed only in leased mode, or left behind).
    pub processing: u64,
    /// Rows holding a successful (non-4xx) outcome.
    pub completed: u64,
    /// Rows holding a 4xx outcome, replayed like any other.
    pub failed: u64,
    /// Rows whose effect may or may not have happened, awaiting reconciliation.
    pub uncertain: u64,
}

impl StateCounts {
    /// The sum of all states.
    pub fn total(&self) -> u64 {
        self.processing + self.completed + self.failed + self.uncertain
    }

    /// Rows that are `processing` or `uncertain`.
    pub fn in_flight(&self) -> u64 {
        self.processing + self.uncertain
    }

    fn add(&mut self, state: &str, n: u64) -> Result<(), StoreError> {
        match state {
            "processing" => self.processing += n,
            "completed" => self.completed += n,
            "failed" => self.failed += n,
            "uncertain" => self.uncertain += n,
            other => return Err(StoreError::Corrupt(format!("state {other:?}"))),
        }
        Ok(())
    }
}

/// One operation's share of the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OperationStats {
    /// The operation name, as given to `#[idempotent(operation = ...)]`.
    pub operation: String,
    /// Its rows.
    pub rows: u64,
    /// Its rows by state.
    pub by_state: StateCounts,
    /// Its stored bytes (bodies plus header text).
    pub stored_bytes: u64,
    /// Its finished rows past retention, not swept yet.
    pub expired_unswept: u64,
}

/// Reads a [`Stats`] snapshot of the idempotency table.
///
/// # Errors
///
/// [`StoreError::Database`] when a query fails (a missing table included: run the
/// migrations first), [`StoreError::Corrupt`] for a state the schema does not allow.
pub async fn stats(pool: &PgPool) -> Result<Stats, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;

    let mut by_state = StateCounts::default();
    let mut by_operation: Vec<OperationStats> = Vec::new();
    let mut stored_bytes = 0u64;
    let mut expired_unswept = 0u64;
    for row in sqlx::query(BY_GROUP_SQL).fetch_all(&mut *tx).await? {
        let operation: String = row.try_get("operation")?;
        let state: String = row.try_get("state")?;
        let rows = count(row.try_get("rows")?);
        let bytes = count(row.try_get("bytes")?);
        let expired = count(row.try_get("expired")?);
        by_state.add(&state, rows)?;
        stored_bytes += bytes;
        expired_unswept += expired;
        // The query is ordered by operation, so an operation's groups are adjacent.
        let entry = match by_operation.last_mut() {
            Some(last) if last.operation == operation => last,
            _ => {
                by_operation.push(OperationStats {
                    operation,
                    rows: 0,
                    by_state: StateCounts::default(),
                    stored_bytes: 0,
                    expired_unswept: 0,
                });
                by_operation.last_mut().expect("just pushed")
            }
        };
        entry.rows += rows;
        entry.by_state.add(&state, rows)?;
        entry.stored_bytes += bytes;
        entry.expired_unswept += expired;
    }

    let ages = sqlx::query(AGES_SQL).fetch_one(&mut *tx).await?;
    let stats = Stats {
        taken_at: ages.try_get("taken_at")?,
        rows: by_state.total(),
        by_state,
        by_operation,
        stored_bytes,
        oldest_valid_created_at: ages.try_get("oldest_valid")?,
        oldest_valid_age_seconds: ages.try_get("oldest_valid_age")?,
        oldest_in_flight_seconds: ages.try_get("oldest_in_flight")?,
        expired_unswept,
    };
    // Read only: there is nothing to commit.
    tx.rollback().await?;
    Ok(stats)
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
