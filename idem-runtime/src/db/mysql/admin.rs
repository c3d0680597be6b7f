//! What the admin CLI reads and deletes on MySQL and MariaDB: one key's row as
//! `show` prints it, and `purge` under the row's lock.

use std::time::Duration;

use sqlx::{MySql, MySqlPool};

use super::upkeep::rfc3339;
use super::{BEGIN_READ_COMMITTED, bound_lock_wait, is_lock_timeout, now_ms, restore_lock_wait};
use crate::db::dialect::question_marks;
use crate::db::restoring::Restoring;
use crate::db::shared::{BindKey, PurgeSql, SqlRekey, purge_row, rekey_sql};
use crate::model::StoreError;
use crate::model::{KeyAddress, KeyRecord, PurgeError};

// The body leaves the database only when asked for (the first `?`, in the
// select list).
const SHOW_SQL: &str = concat!(
    "SELECT state, generation, lower(hex(fingerprint)) AS fingerprint, ",
    rfc3339!("created_at"),
    " AS created_at, ",
    rfc3339!("completed_at"),
    " AS completed_at, ",
    rfc3339!("expires_at"),
    " AS expires_at, ",
    rfc3339!("lease_expires_at"),
    " AS lease_expires_at, expires_at <= ",
    now_ms!(),
    " AS expired, response_status, ",
    "length(response_body) AS body_bytes, response_headers, ",
    "CASE WHEN ? THEN response_body END AS body ",
    "FROM idempotency_requests ",
    "WHERE tenant_id = ? AND operation = ? AND key_digest = ?"
);

/// Chooses at most `?` rows of tenant `?` for [`erase_tenant_batch`]: the
/// finished ones, or every one when `?`.
const CHOOSE_TENANT_SQL: &str = concat!(
    "SELECT CONVERT(tenant_id USING utf8mb4), CONVERT(operation USING utf8mb4), \
            key_digest FROM idempotency_requests \
      WHERE tenant_id = ? AND ",
    erasable!("?"),
    " LIMIT ? FOR UPDATE SKIP LOCKED"
);

const TENANT_ROWS_SQL: &str = question_marks!(crate::db::shared::TENANT_ROWS_SQL);

const SELECT_STATE_SQL: &str = "SELECT state, generation FROM idempotency_requests \
      WHERE tenant_id = ? AND operation = ? AND key_digest = ? FOR UPDATE";

const DELETE_SQL: &str = question_marks!(crate::db::shared::DELETE_SQL);

pub(super) async fn fetch_record(
    pool: &MySqlPool,
    key: &KeyAddress<'_>,
    with_body: bool,
) -> Result<Option<KeyRecord>, StoreError> {
    let row = sqlx::query(SHOW_SQL)
        .bind(with_body)
        .bind_key(key.tenant, key.operation, key.digest)
        .fetch_optional(pool)
        .await?;
    row.as_ref().map(crate::db::rows::key_record).transpose()
}

/// The row's lock was not had within the wait.
fn locked_or<E>(e: sqlx::Error) -> PurgeError<E> {
    if is_lock_timeout(&e) {
        PurgeError::Locked("the key is locked by a request that is running now")
    } else {
        PurgeError::Store(e.into())
    }
}

/// Deletes the key's row in one transaction that first locks it, waiting at most
/// `wait` rounded up to whole seconds (InnoDB's `innodb_lock_wait_timeout`).
pub(super) async fn purge<E>(
    pool: &MySqlPool,
    key: &KeyAddress<'_>,
    wait: Duration,
    allow: impl FnOnce(&str) -> Result<(), E>,
) -> Result<Option<(String, i64)>, PurgeError<E>> {
    let mut conn = pool.acquire().await.map_err(StoreError::from)?;
    let mut session = Restoring::new(&mut conn);
    bound_lock_wait(session.conn(), wait)
        .await
        .map_err(StoreError::from)?;
    let sql = PurgeSql {
        begin: BEGIN_READ_COMMITTED.to_owned(),
        select: SELECT_STATE_SQL,
        delete: DELETE_SQL,
    };
    let purged = purge_row::<MySql, E>(session.conn(), sql, key, allow, locked_or).await;
    // What the purge did is the answer: an error here, after its commit, would
    // report a deleted row as a failure. A session whose lock wait could not
    // be restored is not given back to the pool.
    match restore_lock_wait(session.conn()).await {
        Ok(()) => session.restored(),
        Err(e) => {
            tracing::warn!(error = %e, "idem: could not restore the session's lock wait after a purge; the connection is closed");
        }
    }
    purged
}

/// Deletes one batch of `tenant`'s rows (see `Admin::erase_tenant_batch`).
pub(super) async fn erase_tenant_batch(
    pool: &MySqlPool,
    tenant: &str,
    limit: u32,
    all: bool,
) -> Result<u64, StoreError> {
    let choose = sqlx::query(CHOOSE_TENANT_SQL)
        .bind(tenant)
        .bind(all)
        .bind(i64::from(limit));
    super::upkeep::delete_chosen(pool, choose).await
}

/// How many rows `tenant` has.
pub(super) async fn tenant_rows(pool: &MySqlPool, tenant: &str) -> Result<u64, StoreError> {
    let n: i64 = sqlx::query_scalar(TENANT_ROWS_SQL)
        .bind(tenant)
        .fetch_one(pool)
        .await?;
    Ok(crate::model::count(n))
}

/// The rekey on MySQL and MariaDB: the headers are JSON text, the key columns
/// VARBINARY (read back as text).
impl SqlRekey for MySql {
    rekey_sql!(
        // `JSON_EXTRACT` fails the statement on text that is not JSON (a row
        // spoiled by hand): such a row reads as clear, and is counted broken
        // by a rekey that reads it.
        key_id: "(CASE WHEN JSON_VALID(response_headers) THEN \
                 (CASE WHEN JSON_UNQUOTE(JSON_EXTRACT(response_headers, '$[0][0]')) = ':idem-sealed' \
                 THEN JSON_UNQUOTE(JSON_EXTRACT(response_headers, '$[0][1]')) END) END)",
        body: "response_body",
        tenant: "CONVERT(tenant_id USING utf8mb4)",
        operation: "CONVERT(operation USING utf8mb4)",
        empty_digest: "''",
        created: "created_at",
        cursor: expanded,
        params: ["?", "?", "?", "?", "?", "?", "?", "?"],
    );
}
