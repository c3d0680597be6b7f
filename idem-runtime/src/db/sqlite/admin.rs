//! What the admin CLI reads and deletes on SQLite: one key's row as `show`
//! prints it, and `purge` under the database's write lock.

use std::time::Duration;

use sqlx::{Pool, Sqlite, SqliteConnection};

use super::{is_busy, now_ms};
use crate::db::restoring::Restoring;
use crate::db::shared::{DELETE_SQL, PurgeSql, SqlAdmin, SqlRekey, purge_row, rekey_sql};
use crate::db::stores::Purge;
use crate::model::{KeyAddress, PurgeError};
use crate::model::{StoreError, millis};

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

/// The key's state and generation, read under the database's write lock.
const SELECT_STATE_SQL: &str = "SELECT state, generation FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";

/// A purge that could not get the write lock in time is refused, as on
/// PostgreSQL; anything else is what it is.
fn locked_or<E>(e: sqlx::Error) -> PurgeError<E> {
    if is_busy(&e) {
        PurgeError::Locked(
            "the database is locked by a request that is running now (SQLite has one write \
             lock for the whole database: a request of any key, a sweep or another purge \
             may hold it)",
        )
    } else {
        PurgeError::Store(e.into())
    }
}

async fn set_busy_timeout(conn: &mut SqliteConnection, ms: i64) -> Result<(), StoreError> {
    sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA busy_timeout = {ms}")))
        .execute(conn)
        .await?;
    Ok(())
}

/// `show`'s statement and the tenant's erasure on SQLite.
impl SqlAdmin for Sqlite {
    // SQLite's one write lock serialises the statement with every writer, so no
    // row it reads can change under it.
    const ERASE_TENANT_SQL: &'static str = concat!(
        "DELETE FROM idempotency_requests \
          WHERE rowid IN ( \
                SELECT rowid FROM idempotency_requests \
                 WHERE tenant_id = $1 AND ",
        erasable!("$3"),
        " LIMIT $2)"
    );

    // The body leaves the database only when asked for ($4). length() of a BLOB is
    // its size in bytes.
    const SHOW_SQL: &'static str = concat!(
        "SELECT state, generation, lower(hex(fingerprint)) AS fingerprint, ",
        rfc3339!("created_at"),
        ", ",
        rfc3339!("completed_at"),
        ", ",
        rfc3339!("expires_at"),
        ", ",
        rfc3339!("lease_expires_at"),
        ", expires_at <= ",
        now_ms!(),
        " AS expired, response_status, ",
        "length(CAST(response_body AS BLOB)) AS body_bytes, response_headers, ",
        "CASE WHEN $4 THEN CAST(response_body AS BLOB) END AS body ",
        "FROM idempotency_requests ",
        "WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3"
    );
}

/// The rekey on SQLite: the headers are JSON text; a body written as text by
/// an older release compares as its bytes.
impl SqlRekey for Sqlite {
    rekey_sql!(
        // `json_extract` fails the statement on text that is not JSON (a row
        // spoiled by hand): such a row reads as clear, and is counted broken
        // by a rekey that reads it.
        key_id: "(CASE WHEN json_valid(response_headers) THEN \
                 (CASE WHEN json_extract(response_headers, '$[0][0]') = ':idem-sealed' \
                 THEN json_extract(response_headers, '$[0][1]') END) END)",
        body: "CAST(response_body AS BLOB)",
        tenant: "tenant_id",
        operation: "operation",
        empty_digest: "X''",
        created: "created_at",
        cursor: row,
        params: ["$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8"],
    );
}

impl Purge for Sqlite {
    /// SQLite has no row locks and serialises writers: `BEGIN IMMEDIATE` takes the
    /// database's write lock before the row is read, so no request can claim,
    /// complete or re-claim the key between the check and the delete. The wait for
    /// that lock is the busy timeout, set to `wait` on this connection for the purge
    /// and given back after; past it the purge is refused. A request in the middle of
    /// its transaction holds the lock whatever key it works on, so on SQLite a purge
    /// is also refused while an unrelated request runs longer than the wait.
    async fn purge<E: Send>(
        pool: &Pool<Self>,
        key: &KeyAddress<'_>,
        wait: Duration,
        allow: impl FnOnce(&str) -> Result<(), E> + Send,
    ) -> Result<Option<(String, i64)>, PurgeError<E>> {
        let mut conn = pool.acquire().await.map_err(StoreError::from)?;
        let saved: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *conn)
            .await
            .map_err(StoreError::from)?;
        let mut session = Restoring::new(&mut conn);
        set_busy_timeout(session.conn(), millis(wait).max(1)).await?;
        let sql = PurgeSql {
            begin: "BEGIN IMMEDIATE".to_owned(),
            select: SELECT_STATE_SQL,
            delete: DELETE_SQL,
        };
        let purged = purge_row::<Sqlite, E>(session.conn(), sql, key, allow, locked_or).await;
        // What the purge did is the answer (see MySQL's purge).
        match set_busy_timeout(session.conn(), saved).await {
            Ok(()) => session.restored(),
            Err(e) => {
                tracing::warn!(error = %e, "idem: could not restore the session's busy timeout after a purge; the connection is closed");
            }
        }
        purged
    }
}
