//! MySQL 8 and MariaDB 10.11 (InnoDB): every statement idem runs there. The same
//! state machine as on PostgreSQL and SQLite (docs/mysql.md says what differs).
//!
//! * [`transactional`]: the claim (a locking read, then an insert or a
//!   re-claim) and the completion in the caller's transaction, begun READ
//!   COMMITTED; the in-flight bound is InnoDB's `innodb_lock_wait_timeout`.
//! * [`leased`]: leased mode's claim (a short transaction of its own) and its
//!   fenced statements.
//! * [`upkeep`]: the sweeper's statements and the stats snapshot.
//! * [`admin`]: what the CLI shows and purges.
//!
//! Timestamps are Unix milliseconds from the database's clock ([`now_ms`]).
//! Placeholders are `?`, bound in the order they appear, so no statement of the
//! shared module (written with `$n`) is used here.

use std::time::Duration;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{MySql, MySqlConnection, MySqlPool, Pool, Row};

use super::Backend;
use crate::model::{FencedWrite, Resource};
use crate::model::{InFlightSummary, StatsSnapshot, StoreError};
use crate::model::{KeyAddress, KeyRecord, PurgeError};

mod admin;
pub(crate) mod hot_path;
mod leased;
mod operations;
mod resume;
pub(crate) mod transactional;
mod upkeep;

/// Now, in Unix milliseconds, from MySQL's clock: the one expression every MySQL
/// timestamp of idem (`created_at`, `completed_at`, `expires_at`,
/// `lease_expires_at`) is written and compared with, as a string literal for
/// `concat!`, for your own queries against `idempotency_requests`.
/// `UTC_TIMESTAMP(3)` does not depend on the session's time zone, and like
/// `NOW()` it is fixed for the whole statement.
///
/// ```
/// const EXPIRED: &str = concat!(
///     "SELECT count(*) FROM idempotency_requests WHERE expires_at <= ",
///     idem_runtime::mysql_now_ms!()
/// );
/// assert!(EXPIRED.contains("UTC_TIMESTAMP(3)"));
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
#[macro_export]
macro_rules! mysql_now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)"
    };
}
pub(crate) use crate::mysql_now_ms as now_ms;

/// A key's row under its lock, with the database's clock as `now`: what both
/// modes' claims decide over.
pub(super) const READ_SQL: &str = concat!(
    "SELECT fingerprint, state, generation, lease_expires_at, expires_at, \
            response_status, response_headers, response_body, ",
    now_ms!(),
    " AS now FROM idempotency_requests \
      WHERE tenant_id = ? AND operation = ? AND key_digest = ? FOR UPDATE"
);

/// The start of a statement that stores an outcome: `state` and the response
/// bound in that order, `completed_at` now; the caller goes on with `, ..`.
macro_rules! store_outcome {
    () => {
        concat!(
            "UPDATE idempotency_requests \
                SET state = ?, response_status = ?, response_headers = ?, response_body = ?, \
                    completed_at = ",
            now_ms!()
        )
    };
}
pub(super) use store_outcome;

/// `now, now + ?`: the values of a row's start (`created_at`, or a finished
/// row's `completed_at`) and of its `expires_at`, the retention bound in
/// milliseconds.
macro_rules! created_now {
    () => {
        concat!(now_ms!(), ", ", now_ms!(), " + ?")
    };
}
pub(super) use created_now;

/// The end of a re-claim: the stored outcome cleared, the row's times begun
/// again (the retention bound), and the key's address bound.
macro_rules! restarted_row {
    () => {
        concat!(
            "response_status = NULL, response_headers = NULL, response_body = NULL, \
             created_at = ",
            now_ms!(),
            ", completed_at = NULL, expires_at = ",
            now_ms!(),
            " + ? WHERE tenant_id = ? AND operation = ? AND key_digest = ?"
        )
    };
}
pub(super) use restarted_row;

/// How idem begins a transaction for a claim: READ COMMITTED for that
/// transaction (InnoDB's default, REPEATABLE READ, takes gap locks on a locking
/// read that finds no row, so a claim of one key would hold up the claims of
/// its neighbours, and two claims of the same new key would deadlock).
pub(crate) const BEGIN_READ_COMMITTED: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// How the handler's transaction begins on the claims-at-commit path: as
/// [`BEGIN_READ_COMMITTED`], and the savepoint `idem_tx`, in the same message.
/// Where the server has no `@@in_transaction` for the insert to read (MySQL
/// 8), the insert's message opens with `RELEASE SAVEPOINT idem_tx`, which fails
/// (1305) once the transaction has ended under the handler (InnoDB's rollback
/// of a deadlock's victim, an implicit commit): any end of a transaction takes
/// its savepoints with it.
pub(crate) const BEGIN_HANDLER: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; SAVEPOINT idem_tx";

/// ER_SP_DOES_NOT_EXIST: `RELEASE SAVEPOINT idem_tx` where the transaction
/// that held it has ended.
pub(crate) const NO_SUCH_SAVEPOINT: u16 = 1305;

/// The error number of a MySQL error, if `e` is one.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// ER_LOCK_WAIT_TIMEOUT: a lock was not had within `innodb_lock_wait_timeout`.
/// Only the statement is rolled back (unless the server runs with
/// `innodb_rollback_on_timeout`).
pub(crate) fn is_lock_timeout(e: &sqlx::Error) -> bool {
    error_number(e) == Some(1205)
}

/// ER_LOCK_DEADLOCK: InnoDB chose this transaction as a deadlock's victim and
/// rolled all of it back.
pub(crate) fn is_deadlock(e: &sqlx::Error) -> bool {
    error_number(e) == Some(1213)
}

/// ER_DUP_ENTRY.
pub(crate) fn is_duplicate(e: &sqlx::Error) -> bool {
    error_number(e) == Some(1062)
}

/// `innodb_lock_wait_timeout` counts whole seconds, at least 1: a wait is
/// rounded up (200 ms waits 1 s, 1.5 s waits 2 s), so a claim never gives up
/// sooner than configured, and at most a second later.
pub(crate) fn lock_wait_seconds(wait: Duration) -> u64 {
    let secs = wait
        .as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0));
    secs.clamp(1, 1_073_741_824)
}

/// `SET STATEMENT innodb_lock_wait_timeout = secs FOR <base>`: MariaDB's bound
/// for one statement, which leaves the session as it was. Built once per
/// statement and wait (a handful per service), then the same `&'static str`
/// that sqlx's statement cache knows.
pub(crate) fn lock_wait_for_statement(base: &'static str, secs: u64) -> &'static str {
    static TEXTS: std::sync::Mutex<Vec<(usize, u64, &'static str)>> =
        std::sync::Mutex::new(Vec::new());
    let mut texts = TEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let id = base.as_ptr() as usize;
    if let Some((_, _, text)) = texts.iter().find(|(b, s, _)| *b == id && *s == secs) {
        return text;
    }
    let text: &'static str = Box::leak(
        format!("SET STATEMENT innodb_lock_wait_timeout = {secs} FOR {base}").into_boxed_str(),
    );
    texts.push((id, secs, text));
    text
}

/// Sets the session's lock wait to `wait` (rounded up to whole seconds), saving
/// the one it had in `@idem_saved_lock_wait` for [`restore_lock_wait`].
pub(crate) async fn bound_lock_wait(
    conn: &mut MySqlConnection,
    wait: Duration,
) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(lock_wait_sql(wait)))
        .execute(conn)
        .await?;
    Ok(())
}

/// Saves the session's lock wait and bounds it by `wait` (whole seconds).
fn lock_wait_sql(wait: Duration) -> String {
    format!(
        "SET @idem_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, \
             SESSION innodb_lock_wait_timeout = {}",
        lock_wait_seconds(wait)
    )
}

/// As [`bound_lock_wait`], in one text message after `RELEASE SAVEPOINT
/// idem_tx` (see [`BEGIN_HANDLER`]): where the transaction has ended under the
/// handler the `RELEASE` fails with [`NO_SUCH_SAVEPOINT`] and the server runs
/// nothing after it, so the session's wait is left as it was.
pub(crate) async fn released_with_lock_wait(
    conn: &mut MySqlConnection,
    wait: Duration,
) -> Result<(), sqlx::Error> {
    let sql = format!("RELEASE SAVEPOINT idem_tx; {}", lock_wait_sql(wait));
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(conn)
        .await?;
    Ok(())
}

/// Gives the session the lock wait [`bound_lock_wait`] saved.
pub(crate) async fn restore_lock_wait(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET SESSION innodb_lock_wait_timeout = @idem_saved_lock_wait")
        .execute(conn)
        .await?;
    Ok(())
}

/// The statement that reads `state, version` of a resource and holds the row
/// against other transitions: a concurrent transition waits for the lock, then
/// sees the committed state (a locking read reads the latest committed version
/// at any isolation level).
fn transition_read_sql(resource: &Resource) -> String {
    format!(
        "SELECT {state}, {version} FROM {table} WHERE {id} = ?{scope} FOR UPDATE",
        state = resource.state_column,
        version = resource.version_column,
        table = resource.table,
        id = resource.id_column,
        scope = scope_sql(resource),
    )
}

/// `AND <scope> = ?`, or a condition that binds the parameter without using it.
fn scope_sql(resource: &Resource) -> String {
    match resource.scope_column {
        Some(col) => format!(" AND {col} = ?"),
        None => " AND ? IS NULL".to_owned(),
    }
}

/// A transition's fenced write: MySQL's `UPDATE` has no `RETURNING`, so the new
/// version is the one read plus one when the row matched (the rows an `UPDATE`
/// reports are the rows it matched: sqlx connects with `CLIENT_FOUND_ROWS`).
fn write_sql(resource: &Resource) -> String {
    format!(
        "UPDATE {table} SET {state} = ?, {version_col} = {version_col} + 1 \
          WHERE {id_col} = ?{scope} AND {version_col} = ? AND {state} = ?",
        table = resource.table,
        state = resource.state_column,
        version_col = resource.version_column,
        id_col = resource.id_column,
        scope = scope_sql(resource),
    )
}

impl super::sealed::Sealed for MySql {}

impl Backend for MySql {
    /// READ COMMITTED (see [`BEGIN_READ_COMMITTED`]).
    const BEGIN: &'static str = BEGIN_READ_COMMITTED;
}

impl super::stores::Schema for MySql {
    fn migrator() -> sqlx::migrate::Migrator {
        super::tracked(sqlx::migrate!("migrations/mysql"))
    }

    async fn migrate(pool: &Pool<Self>) -> Result<(), StoreError> {
        resume::run(&Self::migrator(), pool).await
    }
}

impl super::stores::Upkeep for MySql {
    async fn delete_batch(pool: &MySqlPool, limit: u32) -> Result<u64, StoreError> {
        upkeep::delete_batch(pool, limit).await
    }

    async fn backlog(pool: &MySqlPool) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(upkeep::BACKLOG_SQL)
            .fetch_one(pool)
            .await?;
        Ok(crate::model::count(n))
    }

    async fn in_flight(
        pool: &MySqlPool,
        stale_after: Duration,
    ) -> Result<InFlightSummary, StoreError> {
        let stale = crate::model::millis(stale_after);
        let row = sqlx::query(upkeep::IN_FLIGHT_SQL)
            .bind(stale)
            .bind(stale)
            .fetch_one(pool)
            .await?;
        Ok(InFlightSummary {
            stale_processing: crate::model::count(row.try_get("stale_processing")?),
            stale_uncertain: crate::model::count(row.try_get("stale_uncertain")?),
            uncertain: crate::model::count(row.try_get("uncertain")?),
            oldest_seconds: row.try_get("oldest_seconds")?,
        })
    }

    async fn snapshot(pool: &MySqlPool) -> Result<StatsSnapshot, StoreError> {
        super::shared::stats_snapshot(pool, &upkeep::SNAPSHOT).await
    }
}

impl super::stores::Transitions for MySql {
    async fn lock_state<'c>(
        conn: &'c mut MySqlConnection,
        resource: &'c Resource,
        id: i64,
        scope: Option<&'c str>,
    ) -> Result<Option<(String, i64)>, sqlx::Error> {
        super::shared::read_state::<MySql>(conn, transition_read_sql(resource), id, scope).await
    }

    async fn write_state<'c>(
        conn: &'c mut MySqlConnection,
        w: FencedWrite<'c>,
    ) -> Result<Option<i64>, sqlx::Error> {
        let done = sqlx::query(sqlx::AssertSqlSafe(write_sql(w.resource)))
            .bind(w.to)
            .bind(w.id)
            .bind(w.scope)
            .bind(w.version)
            .bind(w.from)
            .execute(conn)
            .await?;
        Ok((done.rows_affected() == 1).then_some(w.version + 1))
    }
}

impl super::stores::Purge for MySql {
    async fn purge<E: Send>(
        pool: &MySqlPool,
        key: &KeyAddress<'_>,
        wait: Duration,
        allow: impl FnOnce(&str) -> Result<(), E> + Send,
    ) -> Result<Option<(String, i64)>, PurgeError<E>> {
        admin::purge(pool, key, wait, allow).await
    }
}

impl super::stores::Admin for MySql {
    fn applied_versions(
        pool: &MySqlPool,
    ) -> impl std::future::Future<Output = Result<Vec<i64>, StoreError>> + Send {
        super::shared::applied_versions(pool)
    }

    async fn fetch_record(
        pool: &MySqlPool,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> Result<Option<KeyRecord>, StoreError> {
        admin::fetch_record(pool, key, with_body).await
    }

    async fn erase_tenant_batch(
        pool: &MySqlPool,
        tenant: &str,
        limit: u32,
        all: bool,
    ) -> Result<u64, StoreError> {
        admin::erase_tenant_batch(pool, tenant, limit, all).await
    }

    async fn tenant_rows(pool: &MySqlPool, tenant: &str) -> Result<u64, StoreError> {
        admin::tenant_rows(pool, tenant).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_wait_rounds_up_to_whole_seconds() {
        assert_eq!(lock_wait_seconds(Duration::ZERO), 1);
        assert_eq!(lock_wait_seconds(Duration::from_millis(200)), 1);
        assert_eq!(lock_wait_seconds(Duration::from_secs(1)), 1);
        assert_eq!(lock_wait_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(lock_wait_seconds(Duration::from_secs(5)), 5);
        assert_eq!(lock_wait_seconds(Duration::MAX), 1_073_741_824);
    }
}
