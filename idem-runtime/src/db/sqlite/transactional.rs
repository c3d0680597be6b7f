//! The transactional mode on SQLite: the same state machine as on PostgreSQL, in
//! the caller's transaction.
//!
//! SQLite serialises writers. The claim's `INSERT ... ON CONFLICT` is the
//! transaction's first statement, so a duplicate waits for a concurrent first
//! writer to commit or roll back, then replays, executes, or (past the wait,
//! `SQLITE_BUSY`) reports [`Claim::Busy`]. A transaction that already read or
//! wrote before claiming cannot wait that way; claim first.
//!
//! The wait is the connection's own busy timeout
//! (`SqliteConnectOptions::busy_timeout`), as on the handler's path, not the
//! request's in-flight wait: `busy_timeout` belongs to the connection, and this
//! connection is the caller's. Changing it for the claim and giving it back
//! after would leave idem's value on it if the claim's future were dropped in
//! between (a request deadline), and idem cannot close a connection it only
//! borrows (docs/decisions.md, "Session settings that survive a cancelled
//! future").
//!
//! SQLite has one write lock for the whole database, so a claim also waits for
//! writers of *other* keys, and past the bound cannot tell whose lock it met:
//! it reports [`Claim::Busy`] (`503` `store-busy` with `Retry-After`), never a
//! duplicate in flight. Keep handlers short.

use std::time::Duration;

use sqlx::{Row, Sqlite, SqliteConnection};

use super::now_ms;
use crate::db::rows::stored_from_text;
use crate::db::shared::BindKey;
use crate::db::stores::Claims;
use crate::decide::RowState;
use crate::model::{Claim, ClaimRequest, Execution, StoreError, StoredResponse, millis};

const CLAIM_SQL: &str = concat!(
    "INSERT INTO idempotency_requests AS r \
        (tenant_id, operation, key_digest, fingerprint, state, generation, created_at, expires_at) \
     VALUES ($1, $2, $3, $4, 'processing', 1, ",
    now_ms!(),
    ", ",
    now_ms!(),
    " + $5) \
     ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE \
        SET fingerprint = excluded.fingerprint, state = 'processing', generation = r.generation + 1, \
            response_status = NULL, response_headers = NULL, response_body = NULL, \
            owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, \
            created_at = excluded.created_at, \
            completed_at = NULL, expires_at = excluded.expires_at \
      WHERE r.expires_at <= excluded.created_at AND r.state IN ('completed', 'failed') \
     RETURNING generation"
);

const READ_SQL: &str = "SELECT fingerprint, state, generation, response_status, response_headers, response_body \
       FROM idempotency_requests WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";

const COMPLETE_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET state = $5, response_status = $6, response_headers = $7, response_body = $8, \
            completed_at = ",
    now_ms!(),
    ", expires_at = ",
    now_ms!(),
    " + $9 \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND generation = $4 AND state = 'processing'"
);

/// The claim and the completion in the caller's transaction; the handler's
/// path is `hot_path`'s.
impl Claims for Sqlite {
    /// Claims `req.key` on the connection of a transaction begun by the caller (see
    /// the module docs).
    async fn claim(
        conn: &mut SqliteConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        let inserted = sqlx::query(CLAIM_SQL)
            .bind_key(req.tenant, req.operation, req.key.digest())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(millis(req.retention))
            .fetch_optional(&mut *conn)
            .await;
        let generation: Option<i64> = match inserted {
            Ok(row) => row.map(|r| r.try_get(0)).transpose()?,
            Err(e) if super::is_busy(&e) => {
                return Ok(Claim::Busy {
                    retry_after: super::BUSY_RETRY_AFTER,
                });
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(generation) = generation {
            return Ok(Claim::Execute(Execution::new(req, generation)));
        }
        // A committed, unexpired row holds the key: this transaction now has the write
        // lock, so nobody changes it under us.
        let row = sqlx::query(READ_SQL)
            .bind_key(req.tenant, req.operation, req.key.digest())
            .fetch_one(&mut *conn)
            .await?;
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        if fingerprint != req.fingerprint.as_bytes() {
            return Ok(Claim::Mismatch);
        }
        let state: RowState = row.try_get("state")?;
        if !state.is_finished() {
            return Ok(Claim::InFlight {
                retry_after: req.in_flight_wait.max(Duration::from_secs(1)),
            });
        }
        Ok(Claim::Replay(stored_from_text(&row)?))
    }

    /// Stores an execution's outcome on the connection of the transaction that
    /// claimed the key.
    async fn complete(
        execution: Execution,
        conn: &mut SqliteConnection,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let state = response.state();
        let headers = serde_json::to_string(&response.headers)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let done = sqlx::query(COMPLETE_SQL)
            .bind_key(&execution.tenant, &execution.operation, execution.key)
            .bind(execution.generation)
            .bind(state)
            .bind(i64::from(response.status))
            .bind(headers)
            .bind(&response.body[..])
            .bind(millis(execution.retention))
            .execute(&mut *conn)
            .await?;
        execution.completed(done.rows_affected())
    }
}
