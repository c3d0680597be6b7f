//! Table statistics for a dashboard or a health check: rows by state and operation,
//! stored bytes, the oldest valid row, the oldest in-flight age and the rows that
//! have expired but are not swept yet.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool, lite: sqlx::SqlitePool) -> Result<(), idem_runtime::StoreError> {
//! let s = idem_runtime::stats(&pool).await?;
//! if s.oldest_in_flight_seconds.is_some_and(|age| age > 900.0) {
//!     eprintln!("an execution has been in flight for over 15 minutes");
//! }
//! // The same on SQLite: the backend comes from the pool.
//! let s = idem_runtime::stats(&lite).await?;
//! # drop(s);
//! # Ok(()) }
//! ```
//!
//! [`stats`] reads the whole table (it sums body sizes), so it suits an admin
//! command or a dashboard refreshed every minute or so, not a per-request probe.
//! Ages and timestamps come from the database clock.
//!
//! It runs on PostgreSQL and on SQLite. The summing up is the same on both; only
//! the snapshot behind [`StatsBackend`] (a transaction and two queries) is each
//! backend's own.

use std::collections::BTreeMap;
use std::future::Future;

use serde::Serialize;
use sqlx::{ColumnIndex, Decode, Pool, Postgres, Row, Sqlite, Type};

use crate::store::sqlite::now_ms;
use crate::store::{Backend, StoreError};

/// A database [`stats`] can read: the table's numbers in one consistent snapshot,
/// in that backend's SQL.
///
/// The sums, the checks and the [`Stats`] themselves are shared; a backend only
/// says how to take a snapshot and what its rows hold. Implemented for
/// [`sqlx::Postgres`] and [`sqlx::Sqlite`]. "Now" is the database's clock, one
/// instant for the whole snapshot, never the application's.
pub trait StatsBackend: Backend {
    /// Reads, in one read-only snapshot of the table, the rows, bytes and unswept
    /// rows of every (operation, state) pair and the ages, every comparison with
    /// "now" made against the same instant of the database clock.
    fn snapshot(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<StatsSnapshot, StoreError>> + Send;
}

/// The raw numbers of one [`StatsBackend::snapshot`], before [`stats`] adds them
/// up into [`Stats`].
#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    /// "Now" of the snapshot, by the database clock (RFC 3339, UTC, whole seconds).
    pub taken_at: String,
    /// One entry per (operation, state) pair present in the table, in any order.
    pub groups: Vec<StatsGroup>,
    /// As [`Stats::oldest_valid_created_at`].
    pub oldest_valid_created_at: Option<String>,
    /// As [`Stats::oldest_valid_age_seconds`].
    pub oldest_valid_age_seconds: Option<f64>,
    /// As [`Stats::oldest_in_flight_seconds`].
    pub oldest_in_flight_seconds: Option<f64>,
}

/// The rows of one operation in one state, as a [`StatsSnapshot`] holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsGroup {
    /// The operation name.
    pub operation: String,
    /// The state as stored; [`stats`] refuses one the schema does not allow.
    pub state: String,
    /// Its rows.
    pub rows: u64,
    /// Bytes of its stored outcomes: bodies plus the text of their headers.
    pub stored_bytes: u64,
    /// Its finished rows (`completed`, `failed`) past `expires_at`.
    pub expired_unswept: u64,
}

// Both queries run in one REPEATABLE READ snapshot so that their numbers agree
// with each other (and now() is the transaction's start, the same instant for
// both).
const PG_BY_GROUP_SQL: &str = "SELECT operation, state, count(*) AS rows, \
        coalesce(sum(coalesce(octet_length(response_body), 0)::bigint \
                     + coalesce(octet_length(response_headers::text), 0)), 0)::bigint AS bytes, \
        count(*) FILTER (WHERE expires_at <= now() AND state IN ('completed', 'failed')) AS expired \
      FROM idempotency_requests GROUP BY operation, state";

const PG_AGES_SQL: &str = "SELECT \
        to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS taken_at, \
        to_char(min(created_at) FILTER (WHERE expires_at > now()) AT TIME ZONE 'UTC', \
                'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS oldest_valid, \
        extract(epoch FROM now() - min(created_at) FILTER (WHERE expires_at > now()))::float8 \
            AS oldest_valid_age, \
        extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('processing', 'uncertain')))::float8 \
            AS oldest_in_flight \
      FROM idempotency_requests";

/// PostgreSQL: both queries in one `REPEATABLE READ, READ ONLY` transaction.
impl StatsBackend for Postgres {
    async fn snapshot(pool: &Pool<Self>) -> Result<StatsSnapshot, StoreError> {
        let mut tx = pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await?;
        let ages = sqlx::query(PG_AGES_SQL).fetch_one(&mut *tx).await?;
        let groups = sqlx::query(PG_BY_GROUP_SQL).fetch_all(&mut *tx).await?;
        let snapshot = snapshot_from_rows(&ages, &groups)?;
        // Read only: there is nothing to commit.
        tx.rollback().await?;
        Ok(snapshot)
    }
}

// SQLite fixes 'now' for one statement only, so the ages query (the snapshot's
// first read) also returns the instant it used, and the groups query is given
// that instant ($1) rather than reading the clock again: every comparison of
// the snapshot is against the same "now", as on PostgreSQL. Timestamps are Unix
// milliseconds: ages are divided by 1000.0 (a float division, for fractional
// seconds), and strftime formats whole seconds in UTC. On no rows, min() is NULL
// and so are the ages and the oldest valid timestamp. count() skips the NULL a
// CASE without ELSE gives, so each count is of its own rows. Byte counts take
// length() of a BLOB, which is its size in bytes (of TEXT it would be
// characters), so the header text is cast to its UTF-8 bytes.
const SQLITE_AGES_SQL: &str = concat!(
    "SELECT ",
    now_ms!(),
    " AS now_ms, \
        strftime('%Y-%m-%dT%H:%M:%SZ', ",
    now_ms!(),
    " / 1000.0, 'unixepoch') AS taken_at, \
        strftime('%Y-%m-%dT%H:%M:%SZ', \
                 min(CASE WHEN expires_at > ",
    now_ms!(),
    " THEN created_at END) / 1000.0, 'unixepoch') AS oldest_valid, \
        (",
    now_ms!(),
    " - min(CASE WHEN expires_at > ",
    now_ms!(),
    " THEN created_at END)) / 1000.0 AS oldest_valid_age, \
        (",
    now_ms!(),
    " - min(CASE WHEN state IN ('processing', 'uncertain') THEN created_at END)) / 1000.0 \
            AS oldest_in_flight \
      FROM idempotency_requests"
);

const SQLITE_BY_GROUP_SQL: &str = "SELECT operation, state, count(*) AS rows, \
        coalesce(sum(coalesce(length(CAST(response_body AS BLOB)), 0) \
                     + coalesce(length(CAST(response_headers AS BLOB)), 0)), 0) AS bytes, \
        count(CASE WHEN expires_at <= $1 AND state IN ('completed', 'failed') THEN 1 END) AS expired \
      FROM idempotency_requests GROUP BY operation, state";

/// SQLite: both queries in one read transaction.
impl StatsBackend for Sqlite {
    async fn snapshot(pool: &Pool<Self>) -> Result<StatsSnapshot, StoreError> {
        // SQLite has no REPEATABLE READ, and needs none here: a deferred `BEGIN`
        // takes no lock, the first read starts a read transaction, and every read
        // of that transaction sees the database as it was at that first read. In
        // WAL mode (recommended for idem) that is a snapshot: writers go on
        // committing meanwhile and this transaction does not see them. In a
        // rollback-journal mode the shared lock it holds keeps writers from
        // committing until it ends, which is just as consistent (and as short).
        let mut tx = pool.begin().await?;
        let ages = sqlx::query(SQLITE_AGES_SQL).fetch_one(&mut *tx).await?;
        let now: i64 = ages.try_get("now_ms")?;
        let groups = sqlx::query(SQLITE_BY_GROUP_SQL)
            .bind(now)
            .fetch_all(&mut *tx)
            .await?;
        let snapshot = snapshot_from_rows(&ages, &groups)?;
        // Read only: there is nothing to commit.
        tx.rollback().await?;
        Ok(snapshot)
    }
}

/// Decodes the rows of the two queries, which have the same column names and
/// (as Rust types) the same column types on every backend.
fn snapshot_from_rows<R>(ages: &R, groups: &[R]) -> Result<StatsSnapshot, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> f64: Decode<'r, R::Database> + Type<R::Database>,
{
    let groups = groups
        .iter()
        .map(|row| {
            Ok(StatsGroup {
                operation: row.try_get("operation")?,
                state: row.try_get("state")?,
                rows: count(row.try_get("rows")?),
                stored_bytes: count(row.try_get("bytes")?),
                expired_unswept: count(row.try_get("expired")?),
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(StatsSnapshot {
        taken_at: ages.try_get("taken_at")?,
        groups,
        oldest_valid_created_at: ages.try_get("oldest_valid")?,
        oldest_valid_age_seconds: ages.try_get("oldest_valid_age")?,
        oldest_in_flight_seconds: ages.try_get("oldest_in_flight")?,
    })
}

/// A snapshot of the idempotency table.
#[derive(Debug, Clone, PartialEq, Serialize)]
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

/// Reads a [`Stats`] snapshot of the idempotency table, on PostgreSQL or SQLite
/// (the backend is the pool's).
///
/// On PostgreSQL the reads run in one `REPEATABLE READ, READ ONLY` transaction;
/// on SQLite in one read transaction, a snapshot in WAL mode. Either way the
/// numbers agree with each other and with one instant of the database clock. The
/// result is the same on both backends for the same rows, except for
/// [`Stats::stored_bytes`], which counts the header text as each database stores
/// it.
///
/// # Errors
///
/// [`StoreError::Database`] when a query fails (a missing table included: run the
/// migrations first), [`StoreError::Corrupt`] for a state the schema does not allow.
pub async fn stats<DB: StatsBackend>(pool: &Pool<DB>) -> Result<Stats, StoreError> {
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

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

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
