//! Table statistics for a dashboard or a health check: rows by state and operation,
//! stored bytes, the oldest valid row, the oldest in-flight age and the rows that
//! have expired but are not swept yet.
//!
//! ```no_run
//! use idem_runtime::{Backend, StoreError};
//!
//! // `pool` is a `PgPool`, a `SqlitePool` or a `MySqlPool`: the backend comes
//! // from the pool, and the same call reads each database's table.
//! async fn check<DB: Backend>(pool: &sqlx::Pool<DB>) -> Result<(), StoreError> {
//!     let s = idem_runtime::stats(pool).await?;
//!     if s.oldest_in_flight_seconds.is_some_and(|age| age > 900.0) {
//!         eprintln!("an execution has been in flight for over 15 minutes");
//!     }
//!     Ok(())
//! }
//! ```
//!
//! [`stats`] reads the whole table (it sums body sizes), so it suits an admin
//! command or a dashboard refreshed every minute or so, not a per-request probe.
//! Ages and timestamps come from the database clock.
//!
//! It runs on PostgreSQL, SQLite and MySQL / MariaDB. The summing up is the same
//! on each; only the snapshot (a transaction and two queries) is each database's
//! own.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::Pool;

use crate::db::Backend;
use crate::decide::RowState;
use crate::model::{StatsSnapshot, StoreError};

/// A snapshot of the idempotency table.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// When the snapshot was taken, by the database clock (RFC 3339, UTC).
    pub taken_at: String,
    /// All rows.
    pub rows: u64,
    /// All rows by state.
    pub by_state: StateCounts,
    /// Rows, bytes and unswept rows per operation, sorted by operation name (by
    /// its bytes, whatever the database's collation).
    pub by_operation: Vec<OperationStats>,
    /// Bytes of stored outcomes: response bodies plus the text of their headers,
    /// as the database stores that text (PostgreSQL: `jsonb`'s text form; SQLite:
    /// the JSON as written).
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
#[non_exhaustive]
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
        match state.parse::<RowState>()? {
            RowState::Processing => self.processing += n,
            RowState::Completed => self.completed += n,
            RowState::Failed => self.failed += n,
            RowState::Uncertain => self.uncertain += n,
        }
        Ok(())
    }
}

/// One operation's share of the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
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

/// Reads a [`Stats`] snapshot of the idempotency table, on PostgreSQL, SQLite or
/// MySQL / MariaDB (the backend is the pool's).
///
/// On PostgreSQL the reads run in one `REPEATABLE READ, READ ONLY` transaction;
/// on MySQL in one too, `WITH CONSISTENT SNAPSHOT`; on SQLite in one read
/// transaction, a snapshot in WAL mode. Either way the numbers agree with each
/// other and with one instant of the database clock. The result is the same on
/// every backend for the same rows, except for
/// [`Stats::stored_bytes`], which counts the header text as each database stores
/// it.
///
/// # Errors
///
/// [`StoreError::Database`] when a query fails (a missing table included: run the
/// migrations first), [`StoreError::Corrupt`] for a state the schema does not allow.
pub async fn stats<DB: Backend>(pool: &Pool<DB>) -> Result<Stats, StoreError> {
    let snapshot = DB::snapshot(pool).await?;
    summarise(snapshot)
}

/// Adds a snapshot's groups up by state and by operation. Operations are sorted
/// here, by their bytes, rather than by the database: collations differ between
/// databases (and between PostgreSQL databases), the order must not.
fn summarise(snapshot: StatsSnapshot) -> Result<Stats, StoreError> {
    let mut by_state = StateCounts::default();
    let mut by_operation: BTreeMap<String, OperationStats> = BTreeMap::new();
    let mut stored_bytes = 0u64;
    let mut expired_unswept = 0u64;
    for group in snapshot.groups {
        by_state.add(&group.state, group.rows)?;
        stored_bytes += group.stored_bytes;
        expired_unswept += group.expired_unswept;
        let entry = by_operation
            .entry(group.operation)
            .or_insert_with_key(|operation| OperationStats {
                operation: operation.clone(),
                rows: 0,
                by_state: StateCounts::default(),
                stored_bytes: 0,
                expired_unswept: 0,
            });
        entry.rows += group.rows;
        entry.by_state.add(&group.state, group.rows)?;
        entry.stored_bytes += group.stored_bytes;
        entry.expired_unswept += group.expired_unswept;
    }
    Ok(Stats {
        taken_at: snapshot.taken_at,
        rows: by_state.total(),
        by_state,
        by_operation: by_operation.into_values().collect(),
        stored_bytes,
        oldest_valid_created_at: snapshot.oldest_valid_created_at,
        oldest_valid_age_seconds: snapshot.oldest_valid_age_seconds,
        oldest_in_flight_seconds: snapshot.oldest_in_flight_seconds,
        expired_unswept,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::StatsGroup;

    fn group(operation: &str, state: &str, rows: u64, bytes: u64, expired: u64) -> StatsGroup {
        StatsGroup {
            operation: operation.to_owned(),
            state: state.to_owned(),
            rows,
            stored_bytes: bytes,
            expired_unswept: expired,
        }
    }

    fn snapshot(groups: Vec<StatsGroup>) -> StatsSnapshot {
        StatsSnapshot {
            taken_at: "2026-11-30T04:57:10Z".to_owned(),
            groups,
            oldest_valid_created_at: Some("2026-11-30T01:57:10Z".to_owned()),
            oldest_valid_age_seconds: Some(10800.0),
            oldest_in_flight_seconds: None,
        }
    }

    #[test]
    fn stats_sum_the_groups_by_state_and_by_operation_sorted_by_bytes() {
        // In no particular order, as a backend may return them.
        let s = summarise(snapshot(vec![
            group("pay", "failed", 1, 2, 1),
            group("create-order", "processing", 1, 0, 0),
            group("Zeta", "uncertain", 2, 0, 0),
            group("create-order", "completed", 1, 73, 0),
        ]))
        .unwrap();
        assert_eq!(s.rows, 5);
        assert_eq!(
            s.by_state,
            StateCounts {
                processing: 1,
                completed: 1,
                failed: 1,
                uncertain: 2
            }
        );
        assert_eq!((s.stored_bytes, s.expired_unswept), (75, 1));
        let ops: Vec<_> = s
            .by_operation
            .iter()
            .map(|o| {
                (
                    o.operation.as_str(),
                    o.rows,
                    o.stored_bytes,
                    o.expired_unswept,
                )
            })
            .collect();
        assert_eq!(
            ops,
            [
                ("Zeta", 2, 0, 0),
                ("create-order", 2, 73, 0),
                ("pay", 1, 2, 1)
            ]
        );
        assert_eq!(s.by_operation[1].by_state.in_flight(), 1);
        assert_eq!(s.taken_at, "2026-11-30T04:57:10Z");
        assert_eq!(s.oldest_valid_age_seconds, Some(10800.0));
    }

    #[test]
    fn stats_refuse_a_state_the_schema_does_not_allow() {
        let e = summarise(snapshot(vec![group("pay", "done", 1, 0, 0)])).unwrap_err();
        assert!(matches!(e, StoreError::Corrupt(m) if m.contains("done")));
    }
}
