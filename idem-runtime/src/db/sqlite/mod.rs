//! SQLite: every statement idem runs there. The same state machine as on
//! PostgreSQL, for a single-machine service.
//!
//! * [`transactional`]: the claim and the completion in the caller's
//!   transaction (SQLite serialises writers: see there what that means for
//!   waiting duplicates); [`hot_path`]: the handler's path, the write lock
//!   first and the finished row inserted once.
//! * [`leased`]: leased mode's claim (a short `BEGIN IMMEDIATE` transaction) and
//!   its fenced statements.
//! * [`upkeep`]: the sweeper's statements and the stats snapshot.
//! * [`admin`]: what the CLI shows and purges.
//!
//! Timestamps are Unix milliseconds from SQLite's own clock ([`now_ms`]).

use sqlx::{Pool, Sqlite};

use super::Backend;
use crate::model::Resource;
use crate::model::StoreError;

mod admin;
mod digests;
mod hot_path;
mod leased;
mod operations;
pub(crate) mod transactional;
mod upkeep;

/// Now, in Unix milliseconds, from SQLite's clock (whole milliseconds:
/// `julianday` holds them in a double, and the product is rounded, not
/// truncated, so none is lost to the arithmetic): the one expression every
/// SQLite timestamp of idem (`created_at`, `completed_at`, `expires_at`,
/// `lease_expires_at`) is written and compared with, as a string literal for
/// `concat!`, for your own queries against `idempotency_requests`.
///
/// ```
/// const EXPIRED: &str = concat!(
///     "SELECT count(*) FROM idempotency_requests WHERE expires_at <= ",
///     idem_runtime::sqlite_now_ms!()
/// );
/// assert!(EXPIRED.contains("julianday('now')"));
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
#[macro_export]
macro_rules! sqlite_now_ms {
    () => {
        "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
    };
}
pub(crate) use crate::sqlite_now_ms as now_ms;

/// The `Retry-After` of a claim that met the write lock held past its wait
/// ([`crate::Claim::Busy`]): the holder may be any writer, of any key, so
/// nothing says when it lets go; the shortest wait the header can say, and the
/// client's backoff spreads the retries.
pub(crate) const BUSY_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether another connection holds the lock this one needs: SQLITE_BUSY (5) and
/// its extended codes (517 BUSY_SNAPSHOT, ...), SQLITE_LOCKED (6).
pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| c & 0xff == 5 || c & 0xff == 6))
}

impl super::sealed::Sealed for Sqlite {}

impl Backend for Sqlite {
    /// Deferred: the claim's INSERT is the first statement and takes the write
    /// lock, waiting through the busy timeout.
    const BEGIN: &'static str = "BEGIN";
}

impl super::stores::Schema for Sqlite {
    fn migrator() -> sqlx::migrate::Migrator {
        super::tracked(sqlx::migrate!("migrations/sqlite"))
    }

    /// The SQL migrations, then the conversion of raw keys to digests that
    /// SQLite cannot do in SQL (see [`digests`]).
    ///
    /// sqlx's migration lock does nothing on SQLite, and it lists the applied
    /// migrations before any write: two processes migrating one file would
    /// both apply the first missing one, and one would fail. So the migrations
    /// run inside `BEGIN IMMEDIATE` (each one a savepoint in it): a second
    /// process waits for the write lock (its busy timeout), then finds them
    /// applied. A file with every migration applied is left without taking
    /// the lock, so that a start does not wait behind the writers of a
    /// running service.
    async fn migrate(pool: &Pool<Self>) -> Result<(), StoreError> {
        let migrator = Self::migrator();
        if !all_applied(pool, &migrator).await? {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            run_on(&migrator, &mut tx).await?;
            tx.commit().await?;
        }
        digests::convert_raw_keys(pool).await
    }
}

/// Runs `migrator` on `conn`, where each migration's transaction is a
/// savepoint of the one `conn` has open. Through `run_direct` (what `run`
/// calls once it has a connection, public though hidden from sqlx's docs):
/// `run` over `&mut SqliteConnection` gives a future the compiler cannot
/// prove `Send` for every lifetime, which this trait's method must be.
async fn run_on(
    migrator: &sqlx::migrate::Migrator,
    conn: &mut sqlx::SqliteConnection,
) -> Result<(), sqlx::migrate::MigrateError> {
    migrator.run_direct(None, conn, false).await
}

/// Whether the file has exactly `migrator`'s migrations applied, each with its
/// checksum and finished: anything else (no table yet, one missing, one failed
/// half-way, a checksum that differs, one this build does not know) is for the
/// migrator to apply or to report, as it does on the other databases.
async fn all_applied(
    pool: &Pool<Sqlite>,
    migrator: &sqlx::migrate::Migrator,
) -> Result<bool, StoreError> {
    let applied: Vec<(i64, Vec<u8>, bool)> = match sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT version, checksum, success FROM {}",
        super::MIGRATIONS_TABLE
    )))
    .fetch_all(pool)
    .await
    {
        Ok(rows) => rows,
        Err(e) if super::is_undefined_table(&e) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let wanted: std::collections::HashMap<i64, &[u8]> = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| (m.version, &m.checksum[..]))
        .collect();
    Ok(applied.len() == wanted.len()
        && applied.iter().all(|(version, checksum, success)| {
            *success && wanted.get(version).is_some_and(|c| *c == &checksum[..])
        }))
}

impl super::shared::SqlTransitions for Sqlite {
    const NULL_PARAM: &'static str = "$2";

    /// The statement that reads `state, version` of a resource and holds it against
    /// other transitions. SQLite has no row locks: writing the row unchanged
    /// (`UPDATE ... RETURNING`) takes the database's write lock, waiting for a
    /// concurrent holder through the busy timeout, before the state is read. It
    /// fires the table's `UPDATE` triggers even when the transition is a no-op.
    fn transition_read_sql(resource: &Resource) -> String {
        format!(
            "UPDATE {table} SET {version} = {version} WHERE {id} = $1{scope} \
             RETURNING {state}, {version}",
            state = resource.state_column,
            version = resource.version_column,
            table = resource.table,
            id = resource.id_column,
            scope = super::shared::scope_sql(resource, "$2"),
        )
    }
}

#[cfg(test)]
mod tests {
    use sqlx::sqlite::SqlitePoolOptions;

    /// Every millisecond of a second, written by SQLite as a timestamp, comes
    /// back from idem's expression exactly: an `expires_at` a millisecond
    /// early would let the replay cache outlive its row.
    #[tokio::test]
    async fn sqlites_clock_in_milliseconds_loses_none() {
        let pool = SqlitePoolOptions::new()
            .connect("sqlite::memory:")
            .await
            .unwrap();
        // 2026-12-07T00:00:00Z
        let midnight: i64 = 1_796_601_600_000;
        let mut wrong = vec![];
        for ms in 0..1000_i64 {
            let at = format!("'2026-12-07 00:00:00.{ms:03}'");
            let sql = format!("SELECT {}", crate::sqlite_now_ms!().replace("'now'", &at));
            let got: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap();
            if got != midnight + ms {
                wrong.push((ms, got - midnight));
            }
        }
        assert!(
            wrong.is_empty(),
            "{} of 1,000 milliseconds read wrong (written, read), first: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
    }
}
