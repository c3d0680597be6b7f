//! The transactional mode on PostgreSQL: one `idem_claim` call to claim, one
//! `UPDATE` to complete, both in the caller's transaction.

use std::time::Duration;

use bytes::Bytes;

use sqlx::{PgConnection, Postgres, Row};

use crate::db::shared::BindKey;
use crate::db::stores::Claims;

use crate::model::{Claim, ClaimRequest, Execution, StoreError, StoredResponse, millis};

const CLAIM_SQL: &str = "SELECT outcome, generation, response_status, response_headers, response_body, \
            wait_seconds \
     FROM idem_claim($1, $2, $3, $4, $5, $6)";

const COMPLETE_SQL: &str = "UPDATE idempotency_requests \
        SET state = $5, response_status = $6, response_headers = $7, response_body = $8, \
            completed_at = c.t, expires_at = c.t + $9 * interval '1 millisecond' \
       FROM (SELECT clock_timestamp() AS t) c \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND generation = $4 AND state = 'processing'";

/// A stored outcome from a row with `response_status` (`smallint`),
/// `response_headers` (`jsonb`) and `response_body` (`bytea`).
pub(crate) fn stored_from_row(row: &sqlx::postgres::PgRow) -> Result<StoredResponse, StoreError> {
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    let status: i16 = row.try_get("response_status")?;
    let headers: Option<sqlx::types::Json<Vec<(String, String)>>> =
        row.try_get("response_headers").map_err(|e| match &e {
            // The driver's message would carry serde_json's, which quotes
            // what it did not expect (a header's value).
            sqlx::Error::ColumnDecode { source, .. } => match source.downcast_ref() {
                Some(json) => StoreError::unreadable_headers("headers", json),
                None => e.into(),
            },
            _ => e.into(),
        })?;
    let stored = StoredResponse {
        status: u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
        headers: headers.map(|h| h.0).unwrap_or_default(),
        body: Bytes::from(body.unwrap_or_default()),
    };
    crate::db::rows::with_generation(row, stored)
}

/// The claim and the completion in the caller's transaction; the handler's
/// path is `hot_path`'s.
impl Claims for Postgres {
    /// Claims `req.key` on the connection of a transaction begun by the caller
    /// (READ COMMITTED): when another transaction holds the key, this waits up to
    /// `req.in_flight_wait` for it to end; a timeout is reported as
    /// [`Claim::InFlight`] and leaves the transaction usable.
    async fn claim(conn: &mut PgConnection, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let row = sqlx::query(CLAIM_SQL)
            .bind_key(req.tenant, req.operation, req.key.digest())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(millis(req.retention))
            .bind(super::lock_wait_ms(req.in_flight_wait))
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| match &e {
                sqlx::Error::Database(db) if db.code().as_deref() == Some("IDEM1") => {
                    StoreError::Isolation
                }
                _ => StoreError::Database(e),
            })?;
        let wait: f64 = row.try_get("wait_seconds")?;
        if wait > 0.0 {
            crate::metrics::seconds(
                crate::metrics::CLAIM_WAIT_SECONDS,
                req.operation.to_owned(),
                wait,
            );
        }
        let outcome: &str = row.try_get("outcome")?;
        match outcome {
            "execute" => Ok(Claim::Execute(Execution::new(
                req,
                row.try_get("generation")?,
            ))),
            "replay" => Ok(Claim::Replay(stored_from_row(&row)?)),
            "mismatch" => Ok(Claim::Mismatch),
            "in_flight" => Ok(Claim::InFlight {
                retry_after: req.in_flight_wait.max(Duration::from_secs(1)),
            }),
            other => Err(StoreError::Corrupt(format!("claim outcome {other:?}"))),
        }
    }

    /// Stores an execution's outcome on the connection of the transaction that
    /// claimed the key.
    async fn complete(
        execution: Execution,
        conn: &mut PgConnection,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let state = response.state();
        let status = i16::try_from(response.status)
            .map_err(|_| StoreError::Corrupt(format!("status {}", response.status)))?;
        let done = sqlx::query(COMPLETE_SQL)
            .bind_key(&execution.tenant, &execution.operation, execution.key)
            .bind(execution.generation)
            .bind(state)
            .bind(status)
            .bind(sqlx::types::Json(&response.headers))
            .bind(&response.body[..])
            .bind(millis(execution.retention))
            .execute(&mut *conn)
            .await?;
        execution.completed(done.rows_affected())
    }
}
