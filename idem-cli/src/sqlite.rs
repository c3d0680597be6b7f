//! SQLite: opening the file (never creating it, except for `migrate`), `show`'s
//! query and `purge`'s write lock.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Connection, Pool, Row, Sqlite, SqliteConnection, SqlitePool};

use crate::backend::{
    KeyRef, SELECT_STATE_SQL, Store, StoredRow, applied_versions_sql, delete_if_allowed,
    probe_then_pool, stored_row,
};
use crate::{Failure, PURGE_LOCK_WAIT, is_undefined_table, locked};

/// How long a command that writes (`migrate`, `sweep`) waits for SQLite's write
/// lock before it fails; `purge` waits [`PURGE_LOCK_WAIT`] instead.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the SQLite file the URL names (`sqlite:PATH` or `sqlite://PATH`, with
/// sqlx's query parameters). A missing file is created only when `create` (for
/// `migrate`); otherwise it is reported and left alone. The journal mode is left
/// as the file has it.
pub async fn connect(url: &str, create: bool) -> Result<SqlitePool, Failure> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let (path, params) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() {
        return Err(Failure::Usage(
            "invalid database URL: no file path after sqlite: (e.g. sqlite:app.db)".to_owned(),
        ));
    }
    if path == ":memory:" || params.split('&').any(|p| p == "mode=memory") {
        return Err(Failure::Usage(
            "invalid database URL: an in-memory SQLite database starts empty and ends with \
             the command; give the path of the service's file"
                .to_owned(),
        ));
    }
    let opts = SqliteConnectOptions::from_str(url)
        .map_err(|e| Failure::Usage(format!("invalid database URL: {e}")))?
        // After parsing, so that it wins over `?mode=rwc`.
        .create_if_missing(create)
        .busy_timeout(BUSY_TIMEOUT);
    if !create {
        // SQLite would refuse to open it too (create_if_missing is off), but with
        // a message that does not say which file or what to do.
        let file = opts.get_filename();
        match std::fs::metadata(file) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let shown = std::path::absolute(file).unwrap_or_else(|_| file.to_owned());
                return Err(Failure::Database(format!(
                    "the SQLite database {} does not exist; nothing was created \
                     (`idem migrate` creates it)",
                    shown.display()
                )));
            }
            Err(e) => {
                return Err(Failure::Database(format!(
                    "cannot open the SQLite database {}: {e}",
                    file.display()
                )));
            }
        }
    }
    probe_then_pool(opts, "cannot open the SQLite database").await
}

/// A timestamp column (Unix milliseconds) as RFC 3339 text in UTC, whole seconds,
/// as PostgreSQL's `to_char` gives it. A float division, so that a time before
/// 1970 rounds down as well.
macro_rules! rfc3339 {
    ($col:literal) => {
        concat!(
            "strftime('%Y-%m-%dT%H:%M:%SZ', ",
            $col,
            " / 1000.0, 'unixepoch') AS ",
            $col
        )
    };
}

// The body leaves the database only when asked for ($4). length() of a BLOB is
// its size in bytes.
const SHOW_SQL: &str = concat!(
    "SELECT state, generation, lower(hex(fingerprint)) AS fingerprint, ",
    rfc3339!("created_at"),
    ", ",
    rfc3339!("completed_at"),
    ", ",
    rfc3339!("expires_at"),
    ", ",
    rfc3339!("lease_expires_at"),
    ", expires_at <= ",
    idem_runtime::sqlite_now_ms!(),
    " AS expired, response_status, ",
    "length(CAST(response_body AS BLOB)) AS body_bytes, response_headers, ",
    "CASE WHEN $4 THEN CAST(response_body AS BLOB) END AS body ",
    "FROM idempotency_requests ",
    "WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3"
);

/// SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes: another
/// connection holds the lock this one needs.
fn is_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| c & 0xff == 5 || c & 0xff == 6))
}

/// A purge that could not get the write lock in time is refused, as on
/// PostgreSQL; anything else is what it is.
fn refused_if_busy(e: sqlx::Error) -> Failure {
    if is_busy(&e) {
        locked(
            "the database is locked by a request that is running now (SQLite has one write \
             lock for the whole database: a request of any key, a sweep or another purge \
             may hold it)",
        )
    } else {
        e.into()
    }
}

impl Store for Sqlite {
    fn migrator() -> sqlx::migrate::Migrator {
        idem_runtime::store::sqlite::migrator()
    }

    crate::backend::same_on_both!();

    /// SQLite has no row locks and serialises writers: `BEGIN IMMEDIATE` takes
    /// the database's write lock before the row is read, so no request can claim,
    /// complete or re-claim the key between the check and the delete. The wait
    /// for that lock is the busy timeout, set to [`PURGE_LOCK_WAIT`] on this
    /// connection for the purge; past it the purge is refused. A request in the
    /// middle of its transaction holds the lock whatever key it works on, so on
    /// SQLite a purge is also refused while an unrelated request runs longer than
    /// the wait.
    async fn purge(
        pool: &Pool<Self>,
        key: &KeyRef<'_>,
        allow: impl FnOnce(&str) -> Result<(), Failure>,
    ) -> Result<Option<(String, i64)>, Failure> {
        let mut conn = pool.acquire().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PRAGMA busy_timeout = {}",
            PURGE_LOCK_WAIT.as_millis()
        )))
        .execute(&mut *conn)
        .await?;
        let purged = purge_locked(&mut conn, key, allow).await;
        // The connection goes back to the pool with the pool's own timeout.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PRAGMA busy_timeout = {}",
            BUSY_TIMEOUT.as_millis()
        )))
        .execute(&mut *conn)
        .await?;
        purged
    }
}

async fn purge_locked(
    conn: &mut SqliteConnection,
    key: &KeyRef<'_>,
    allow: impl FnOnce(&str) -> Result<(), Failure>,
) -> Result<Option<(String, i64)>, Failure> {
    let mut tx = conn
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(refused_if_busy)?;
    let row = sqlx::query(SELECT_STATE_SQL)
        .bind(key.tenant)
        .bind(key.operation)
        .bind(key.key)
        .fetch_optional(&mut *tx)
        .await?;
    let (state, generation) = delete_if_allowed!(tx, row, key, allow);
    // In a rollback-journal mode the commit also waits for readers to finish;
    // past the wait nothing is deleted, and that too is a refusal.
    tx.commit().await.map_err(refused_if_busy)?;
    Ok(Some((state, generation)))
}
