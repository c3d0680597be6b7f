//! The SQLite store: the same state machine as [`super::postgres`], in the
//! caller's `sqlx::Transaction<'_, Sqlite>`.
//!
//! SQLite serialises writers. The claim's `INSERT ... ON CONFLICT` is the
//! transaction's first statement after setting `PRAGMA busy_timeout` to the
//! in-flight bound, so a duplicate waits for a concurrent first writer to commit
//! or roll back, then replays, executes, or (past the bound, `SQLITE_BUSY`)
//! reports [`Claim::InFlight`]. A transaction that already read or wrote before
//! claiming cannot wait that way; claim first.
//!
//! SQLite has one write lock for the whole database, so a claim also waits for
//! writers of *other* keys; past the bound it reports [`Claim::InFlight`] (`409`
//! with `Retry-After`) even when the holder was another key. Keep handlers short.
//!
//! The retention sweeper ([`crate::Sweeper`] on a `SqlitePool`), leased mode
//! ([`crate::lease`]) and its reconciler, [`crate::stats()`] and the `idem` CLI
//! work here too.

use std::time::Duration;

use bytes::Bytes;
use sqlx::{Row, Sqlite, SqliteConnection, SqlitePool, Transaction};

use super::{Claim, ClaimRequest, Execution, StoreError, StoredResponse};

/// Now, in Unix milliseconds, from SQLite's clock: the one expression every
/// SQLite timestamp of idem is written and compared with, as a string literal for
/// `concat!`. Exported (hidden) so the CLI and the tests use the same clock.
#[doc(hidden)]
#[macro_export]
macro_rules! sqlite_now_ms {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
    };
}
pub(crate) use crate::sqlite_now_ms as now_ms;

/// The embedded SQLite migrations of `migrations/sqlite/`, tracked in
/// [`super::postgres::MIGRATIONS_TABLE`].
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!("../migrations/sqlite");
    m.dangerous_set_table_name(super::postgres::MIGRATIONS_TABLE);
    m
}

/// Creates or updates the idempotency table in a SQLite database.
///
/// # Errors
///
/// [`StoreError::Migrate`] when the database refuses the migration.
pub async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    migrator().run(pool).await?;
    Ok(())
}

const CLAIM_SQL: &str = concat!(
    "INSERT INTO idempotency_requests AS r \
        (tenant_id, operation, idempotency_key, fingerprint, state, generation, created_at, expires_at) \
     VALUES ($1, $2, $3, $4, 'processing', 1, ",
    now_ms!(),
    ", ",
    now_ms!(),
    " + $5) \
     ON CONFLICT (tenant_id, operation, idempotency_key) DO UPDATE \
        SET fingerprint = excluded.fingerprint, state = 'processing', generation = r.generation + 1, \
            response_status = NULL, response_headers = NULL, response_body = NULL, \
            owner_token = NULL, lease_expires_at = NULL, created_at = excluded.created_at, \
            completed_at = NULL, expires_at = excluded.expires_at \
      WHERE r.expires_at <= excluded.created_at AND r.state IN ('completed', 'failed') \
     RETURNING generation"
);

const READ_SQL: &str = "SELECT fingerprint, state, generation, response_status, response_headers, response_body \
       FROM idempotency_requests WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3";

const COMPLETE_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET state = $5, response_status = $6, response_headers = $7, response_body = $8, \
            completed_at = ",
    now_ms!(),
    ", expires_at = ",
    now_ms!(),
    " + $9 \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
        AND generation = $4 AND state = 'processing'"
);

pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    // SQLITE_BUSY (5) and its extended codes (517 BUSY_SNAPSHOT, ...); SQLITE_LOCKED (6).
    matches!(e, sqlx::Error::Database(db)
        if db.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| c & 0xff == 5 || c & 0xff == 6))
}

/// Claims `req.key` inside `tx` (see the module docs).
///
/// # Errors
///
/// [`StoreError::Database`] when the database fails; nothing is claimed then.
pub async fn claim(
    tx: &mut Transaction<'_, Sqlite>,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    claim_on(tx, req).await
}

/// [`claim`] on the connection of a transaction begun by the caller.
pub(crate) async fn claim_on(
    conn: &mut SqliteConnection,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    // busy_timeout belongs to the connection: set the bound for the claim only,
    // and give the connection its own back for the rest of the transaction.
    let saved: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await?;
    let wait = millis(req.in_flight_wait).max(1);
    sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA busy_timeout = {wait}")))
        .execute(&mut *conn)
        .await?;
    let inserted = sqlx::query(CLAIM_SQL)
        .bind(req.tenant)
        .bind(req.operation)
        .bind(req.key.as_str())
        .bind(&req.fingerprint.as_bytes()[..])
        .bind(millis(req.retention))
        .fetch_optional(&mut *conn)
        .await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "PRAGMA busy_timeout = {saved}"
    )))
    .execute(&mut *conn)
    .await?;
    let generation: Option<i64> = match inserted {
        Ok(row) => row.map(|r| r.try_get(0)).transpose()?,
        Err(e) if is_busy(&e) => {
            return Ok(Claim::InFlight {
                retry_after: req.in_flight_wait.max(Duration::from_secs(1)),
            });
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(generation) = generation {
        return Ok(Claim::Execute(Execution {
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.clone(),
            generation,
            retention: req.retention,
        }));
    }
    // A committed, unexpired row holds the key: this transaction now has the write
    // lock, so nobody changes it under us.
    let row = sqlx::query(READ_SQL)
        .bind(req.tenant)
        .bind(req.operation)
        .bind(req.key.as_str())
        .fetch_one(&mut *conn)
        .await?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    if fingerprint != req.fingerprint.as_bytes() {
        return Ok(Claim::Mismatch);
    }
    let state: String = row.try_get("state")?;
    if state != "completed" && state != "failed" {
        return Ok(Claim::InFlight {
            retry_after: req.in_flight_wait.max(Duration::from_secs(1)),
        });
    }
    Ok(Claim::Replay(stored_from_row(&row)?))
}

/// A stored outcome from a row with `response_status` (INTEGER),
/// `response_headers` (JSON text) and `response_body` (BLOB).
pub(crate) fn stored_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<StoredResponse, StoreError> {
    let status: i64 = row.try_get("response_status")?;
    let headers: Option<String> = row.try_get("response_headers")?;
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    let headers = match headers {
        Some(text) => {
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt(e.to_string()))?
        }
        None => Vec::new(),
    };
    Ok(StoredResponse {
        status: u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
        headers,
        body: Bytes::from(body.unwrap_or_default()),
    })
}

/// Stores an execution's outcome in the transaction that claimed it.
///
/// # Errors
///
/// As [`Execution::complete`].
pub async fn complete(
    execution: Execution,
    tx: &mut Transaction<'_, Sqlite>,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    complete_on(execution, tx, response).await
}

/// [`complete`] on the connection of the transaction that claimed the key.
pub(crate) async fn complete_on(
    execution: Execution,
    conn: &mut SqliteConnection,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let state = response.state();
    let headers =
        serde_json::to_string(&response.headers).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let done = sqlx::query(COMPLETE_SQL)
        .bind(&execution.tenant)
        .bind(&execution.operation)
        .bind(execution.key.as_str())
        .bind(execution.generation)
        .bind(state)
        .bind(i64::from(response.status))
        .bind(headers)
        .bind(&response.body[..])
        .bind(millis(execution.retention))
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() != 1 {
        return Err(StoreError::LostClaim {
            generation: execution.generation,
        });
    }
    Ok(())
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
