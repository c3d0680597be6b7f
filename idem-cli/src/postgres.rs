//! PostgreSQL: connecting, `show`'s query and `purge`'s row lock.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;
use sqlx::{PgPool, Pool, Postgres, Row};

use crate::backend::{
    KeyRef, SELECT_STATE_SQL, Store, StoredRow, applied_versions_sql, delete_if_allowed,
    probe_then_pool, stored_row,
};
use crate::{Failure, PURGE_LOCK_WAIT, is_undefined_table, locked};

/// Connects to the server the URL names, or says clearly why not.
pub async fn connect(url: &str) -> Result<PgPool, Failure> {
    // The parser's message is enough to fix the URL; the URL itself is not echoed,
    // since it may hold a password.
    let opts = PgConnectOptions::from_str(url)
        .map_err(|e| Failure::Usage(format!("invalid database URL: {e}")))?
        .application_name("idem-cli");
    probe_then_pool(opts, "cannot reach the database").await
}

/// A timestamp column as RFC 3339 text in UTC, formatted by the database (the
/// crate has no date library, and the database clock is the reference anyway).
macro_rules! rfc3339 {
    ($col:literal) => {
        concat!(
            "to_char(",
            $col,
            " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS ",
            $col
        )
    };
}

// The body leaves the database only when asked for ($4), so that a plain `show`
// cannot leak it into a terminal's scrollback or a log.
const SHOW_SQL: &str = concat!(
    "SELECT state, generation, encode(fingerprint, 'hex') AS fingerprint, ",
    rfc3339!("created_at"),
    ", ",
    rfc3339!("completed_at"),
    ", ",
    rfc3339!("expires_at"),
    ", ",
    rfc3339!("lease_expires_at"),
    ", expires_at <= now() AS expired, response_status::bigint AS response_status, ",
    "octet_length(response_body)::bigint AS body_bytes, ",
    "response_headers::text AS response_headers, ",
    "CASE WHEN $4 THEN response_body END AS body ",
    "FROM idempotency_requests ",
    "WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3"
);

impl Store for Postgres {
    fn migrator() -> sqlx::migrate::Migrator {
        idem_runtime::store::postgres::migrator()
    }

    crate::backend::same_on_both!();

    async fn purge(
        pool: &Pool<Self>,
        key: &KeyRef<'_>,
        allow: impl FnOnce(&str) -> Result<(), Failure>,
    ) -> Result<Option<(String, i64)>, Failure> {
        let mut tx = pool.begin().await?;
        // A row locked by a request that is executing right now: waiting for it
        // would hang the operator's terminal, and deleting it after would race the
        // request.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{}ms'",
            PURGE_LOCK_WAIT.as_millis()
        )))
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "{SELECT_STATE_SQL} FOR UPDATE"
        )))
        .bind(key.tenant)
        .bind(key.operation)
        .bind(key.key)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| match &e {
            // lock_not_available: the wait above ran out.
            sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => {
                locked("the key is locked by a request that is running now")
            }
            _ => Failure::from(e),
        })?;
        let (state, generation) = delete_if_allowed!(tx, row, key, allow);
        tx.commit().await?;
        Ok(Some((state, generation)))
    }
}
