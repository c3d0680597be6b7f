//! What the admin CLI reads and deletes on PostgreSQL: one key's row as `show`
//! prints it, and `purge` under the row's lock.

use std::time::Duration;

use sqlx::{Pool, Postgres};

use crate::db::postgres::BEGIN_READ_COMMITTED;
use crate::db::shared::{DELETE_SQL, PurgeSql, SqlAdmin, SqlRekey, purge_row, rekey_sql};
use crate::db::stores::Purge;
use crate::model::StoreError;
use crate::model::{KeyAddress, PurgeError};

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

/// lock_not_available: the row's lock was not had within the wait.
fn locked_or<E>(e: sqlx::Error) -> PurgeError<E> {
    if super::is_lock_timeout(&e) {
        PurgeError::Locked("the key is locked by a request that is running now")
    } else {
        PurgeError::Store(e.into())
    }
}

/// `show`'s statement and the tenant's erasure on PostgreSQL.
impl SqlAdmin for Postgres {
    // As the sweeper's batch (`upkeep.rs`): the inner SELECT locks its batch,
    // skipping rows a running transaction holds, and the DELETE reaches them by
    // ctid; the outer conditions repeat the inner ones for a row changed
    // between the snapshot and the lock.
    const ERASE_TENANT_SQL: &'static str = concat!(
        "DELETE FROM idempotency_requests \
          WHERE ctid = ANY(ARRAY( \
                SELECT ctid FROM idempotency_requests \
                 WHERE tenant_id = $1 AND ",
        erasable!("$3"),
        " LIMIT $2 \
                 FOR UPDATE SKIP LOCKED)) \
            AND tenant_id = $1 AND ",
        erasable!("$3")
    );

    // The body leaves the database only when asked for ($4), so that a plain `show`
    // cannot leak it into a terminal's scrollback or a log.
    const SHOW_SQL: &'static str = concat!(
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
        "WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3"
    );
}

/// The key's state and generation, its row locked until the purge ends.
const SELECT_FOR_UPDATE_SQL: &str = "SELECT state, generation FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 FOR UPDATE";

/// The rekey on PostgreSQL: a sealed answer's key id is the second element of
/// the headers' first pair.
impl SqlRekey for Postgres {
    rekey_sql!(
        key_id: "(CASE WHEN response_headers->0->>0 = ':idem-sealed' THEN response_headers->0->>1 END)",
        body: "response_body",
        tenant: "tenant_id",
        operation: "operation",
        empty_digest: "''::bytea",
        created: "(extract(epoch FROM created_at) * 1000000)::bigint",
        cursor: row,
        params: ["$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8"],
    );
}

impl Purge for Postgres {
    /// Deletes the key's row in one transaction that first locks it (waiting at
    /// most `wait`: a row locked by a request that is executing right now would
    /// hang the operator's terminal, and deleting it after would race the request).
    async fn purge<E: Send>(
        pool: &Pool<Self>,
        key: &KeyAddress<'_>,
        wait: Duration,
        allow: impl FnOnce(&str) -> Result<(), E> + Send,
    ) -> Result<Option<(String, i64)>, PurgeError<E>> {
        let mut conn = pool.acquire().await.map_err(StoreError::from)?;
        let sql = PurgeSql {
            begin: format!(
                "{BEGIN_READ_COMMITTED}; SET LOCAL lock_timeout = '{}ms'",
                wait.as_millis().max(1)
            ),
            select: SELECT_FOR_UPDATE_SQL,
            delete: DELETE_SQL,
        };
        purge_row::<Postgres, E>(&mut conn, sql, key, allow, locked_or).await
    }
}
