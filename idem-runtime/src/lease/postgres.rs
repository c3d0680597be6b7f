//! Leased mode on PostgreSQL: the claim is one call of the `idem_claim_leased`
//! function (migrations/), which locks the row for a moment at most; the fenced
//! statements are single `UPDATE`s and `DELETE`s that match the owner token.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Row};

use super::{Acquisition, Fence, LeaseBackend, LeaseRequest, LeasedOutcome, Owned, UncertainRow};
use crate::store::postgres::stored_from_row;
use crate::store::{StoreError, StoredResponse};

const CLAIM_SQL: &str = "SELECT outcome, generation, owner_token, retry_after_ms, \
        response_status, response_headers, response_body \
   FROM idem_claim_leased($1, $2, $3, $4, $5, $6)";

/// The owned row: its primary key and owner token, as `$1..$4`.
macro_rules! owned {
    () => {
        " tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
          AND owner_token = $4::uuid AND state = 'processing'"
    };
}

const STORE_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET state = $5, response_status = $6, response_headers = $7, response_body = $8, \
            completed_at = c.t, expires_at = c.t + $9 * interval '1 millisecond', \
            lease_expires_at = NULL \
       FROM (SELECT clock_timestamp() AS t) c \
      WHERE",
    owned!()
);

const RENEW_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET lease_expires_at = clock_timestamp() + $5 * interval '1 millisecond' \
      WHERE",
    owned!()
);

const UNCERTAIN_SQL: &str = concat!(
    "UPDATE idempotency_requests SET state = 'uncertain', lease_expires_at = NULL WHERE",
    owned!()
);

const RELEASE_SQL: &str = concat!("DELETE FROM idempotency_requests WHERE", owned!());

const CURRENT_SQL: &str = "SELECT fingerprint, response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
        AND state IN ('completed', 'failed')";

const UNCERTAIN_ROWS_SQL: &str = "SELECT tenant_id, idempotency_key, generation FROM idempotency_requests \
      WHERE operation = $1 AND state = 'uncertain' ORDER BY created_at LIMIT $2";

// The retention runs from the resolution, as for any completion: a row resolved
// late must not be already expired.
const RESOLVE_SQL: &str = "UPDATE idempotency_requests r \
        SET state = $5, response_status = $6, response_headers = $7, \
            response_body = $8, completed_at = c.t, lease_expires_at = NULL, \
            expires_at = c.t + (r.expires_at - r.created_at) \
       FROM (SELECT clock_timestamp() AS t) c \
      WHERE r.tenant_id = $1 AND r.operation = $2 AND r.idempotency_key = $3 \
        AND r.generation = $4 AND r.state = 'uncertain'";

const FORGET_SQL: &str = "DELETE FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 \
        AND generation = $4 AND state = 'uncertain'";

fn status(response: &StoredResponse) -> Result<i16, StoreError> {
    i16::try_from(response.status)
        .map_err(|_| StoreError::Corrupt(format!("status {}", response.status)))
}

impl LeaseBackend for Postgres {
    async fn claim_leased(
        pool: &PgPool,
        req: &LeaseRequest<'_>,
    ) -> Result<LeasedOutcome, StoreError> {
        let row = sqlx::query(CLAIM_SQL)
            .bind(req.tenant)
            .bind(req.operation)
            .bind(req.key.as_str())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(super::millis(req.retention))
            .bind(super::millis(req.lease))
            .fetch_one(pool)
            .await?;
        let outcome: &str = row.try_get("outcome")?;
        let acquired = |acquisition| -> Result<LeasedOutcome, StoreError> {
            Ok(LeasedOutcome::Acquired {
                acquisition,
                token: row.try_get("owner_token")?,
                generation: row.try_get("generation")?,
            })
        };
        match outcome {
            "acquired" => acquired(Acquisition::New),
            "reclaimed" => acquired(Acquisition::Reclaimed),
            "taken_over" => acquired(Acquisition::TakenOver),
            "replay" => Ok(LeasedOutcome::Replay(stored_from_row(&row)?)),
            "mismatch" => Ok(LeasedOutcome::Mismatch),
            "uncertain" => Ok(LeasedOutcome::Uncertain),
            "in_flight" => {
                let ms: Option<i64> = row.try_get("retry_after_ms")?;
                let ms = u64::try_from(ms.unwrap_or(1000)).unwrap_or(1000);
                Ok(LeasedOutcome::InFlight {
                    retry_after: Duration::from_millis(ms),
                })
            }
            other => Err(StoreError::Corrupt(format!(
                "leased claim outcome {other:?}"
            ))),
        }
    }

    async fn store_outcome(
        pool: &PgPool,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(STORE_SQL)
            .bind(row.tenant)
            .bind(row.operation)
            .bind(row.key)
            .bind(row.token)
            .bind(response.state())
            .bind(status(response)?)
            .bind(sqlx::types::Json(&response.headers))
            .bind(&response.body[..])
            .bind(super::millis(retention))
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn fence(pool: &PgPool, row: Owned<'_>, what: Fence) -> Result<u64, StoreError> {
        let query = match what {
            Fence::Renew(_) => sqlx::query(RENEW_SQL),
            Fence::Uncertain => sqlx::query(UNCERTAIN_SQL),
            Fence::Release => sqlx::query(RELEASE_SQL),
        };
        let query = query
            .bind(row.tenant)
            .bind(row.operation)
            .bind(row.key)
            .bind(row.token);
        let query = match what {
            Fence::Renew(lease) => query.bind(super::millis(lease)),
            Fence::Uncertain | Fence::Release => query,
        };
        Ok(query.execute(pool).await?.rows_affected())
    }

    async fn current(
        pool: &PgPool,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<(Vec<u8>, StoredResponse)>, StoreError> {
        let row = sqlx::query(CURRENT_SQL)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .fetch_optional(pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some((row.try_get("fingerprint")?, stored_from_row(&row)?)))
    }

    async fn uncertain_rows(
        pool: &PgPool,
        operation: &str,
        limit: i64,
    ) -> Result<Vec<UncertainRow>, StoreError> {
        let rows = sqlx::query(UNCERTAIN_ROWS_SQL)
            .bind(operation)
            .bind(limit)
            .fetch_all(pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(UncertainRow {
                    tenant: r.try_get("tenant_id")?,
                    key: r.try_get("idempotency_key")?,
                    generation: r.try_get("generation")?,
                })
            })
            .collect()
    }

    async fn resolve(
        pool: &PgPool,
        operation: &str,
        row: &UncertainRow,
        outcome: Option<&StoredResponse>,
    ) -> Result<u64, StoreError> {
        let query = match outcome {
            Some(stored) => sqlx::query(RESOLVE_SQL)
                .bind(&row.tenant)
                .bind(operation)
                .bind(&row.key)
                .bind(row.generation)
                .bind(stored.state())
                .bind(status(stored)?)
                .bind(sqlx::types::Json(&stored.headers))
                .bind(&stored.body[..]),
            None => sqlx::query(FORGET_SQL)
                .bind(&row.tenant)
                .bind(operation)
                .bind(&row.key)
                .bind(row.generation),
        };
        Ok(query.execute(pool).await?.rows_affected())
    }
}
