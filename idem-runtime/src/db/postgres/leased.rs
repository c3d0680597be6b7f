//! Leased mode on PostgreSQL: the claim is one call of the `idem_claim_leased`
//! function (`migrations/postgres/`), which locks the row for a moment at most; the fenced
//! statements are single `UPDATE`s and `DELETE`s that match the owner token.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, Pool, Postgres, Row};

use super::transactional::stored_from_row;
use super::{BEGIN_READ_COMMITTED, is_lock_timeout, lock_wait_ms};
use crate::db::leases::{SqlLeases, renew_one_on};
use crate::db::restoring::Restoring;
use crate::db::shared::BindKey;
use crate::db::shared::{owned_row, stored_row, uncertain_and_release_sql};
use crate::model::{
    Acquisition, LeaseRequest, LeasedOutcome, Renewal, Renewed, StoreError, StoredResponse, millis,
};

const CLAIM_SQL: &str = "SELECT outcome, generation, owner_token, retry_after_ms, \
        response_status, response_headers, response_body \
   FROM idem_claim_leased($1, $2, $3, $4, $5, $6, $7)";

/// Renews a batch of leases in one statement, each by its own length. A row
/// another transaction holds is skipped, not waited for (so one held row cannot
/// hold up every lease of the process), and reported as still owned but not
/// renewed; a row no longer owned is reported lost. `owned` reads the
/// statement's snapshot, before the renewal.
const RENEW_MANY_SQL: &str = "WITH l AS ( \
        SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[]::uuid[], $5::bigint[]) \
            WITH ORDINALITY AS l(tenant_id, operation, key_digest, owner_token, ms, ord)), \
     held AS ( \
        SELECT r.tenant_id, r.operation, r.key_digest, l.ms \
          FROM idempotency_requests r \
          JOIN l ON r.tenant_id = l.tenant_id AND r.operation = l.operation \
                AND r.key_digest = l.key_digest AND r.owner_token = l.owner_token \
         WHERE r.state = 'processing' \
           FOR UPDATE OF r SKIP LOCKED), \
     renewed AS ( \
        UPDATE idempotency_requests r \
           SET lease_expires_at = clock_timestamp() + h.ms * interval '1 millisecond' \
          FROM held h \
         WHERE r.tenant_id = h.tenant_id AND r.operation = h.operation AND r.key_digest = h.key_digest \
        RETURNING r.tenant_id, r.operation, r.key_digest, r.owner_token) \
SELECT EXISTS (SELECT 1 FROM renewed x \
                WHERE x.tenant_id = l.tenant_id AND x.operation = l.operation \
                  AND x.key_digest = l.key_digest AND x.owner_token = l.owner_token) AS renewed, \
       EXISTS (SELECT 1 FROM idempotency_requests r \
                WHERE r.tenant_id = l.tenant_id AND r.operation = l.operation \
                  AND r.key_digest = l.key_digest AND r.owner_token = l.owner_token \
                  AND r.state = 'processing') AS owned \
  FROM l ORDER BY l.ord";

/// Stored headers as the `jsonb` column takes them.
pub(super) type JsonHeaders<'a> = sqlx::types::Json<&'a Vec<(String, String)>>;

/// Leased mode's statements on Postgres: the texts and encodings the shared
/// statements bind (`crate::db::leases`), and the claim and the batch renewal,
/// which are this database's own.
impl SqlLeases for Postgres {
    type Status = i16;
    type Headers<'r> = JsonHeaders<'r>;

    const STORE_SQL: &'static str = concat!(
        "UPDATE idempotency_requests \
            SET state = $1, response_status = $2, response_headers = $3, response_body = $4, \
                completed_at = c.t, expires_at = c.t + $5 * interval '1 millisecond', \
                lease_expires_at = NULL \
           FROM (SELECT clock_timestamp() AS t) c \
          WHERE",
        stored_row!("$6", "$7", "$8", "$9", "::uuid")
    );

    const RENEW_SQL: &'static str = concat!(
        "UPDATE idempotency_requests \
            SET lease_expires_at = clock_timestamp() + $1 * interval '1 millisecond' \
          WHERE",
        owned_row!("$2", "$3", "$4", "$5", "::uuid")
    );

    const LAPSE_SQL: &'static str = concat!(
        "UPDATE idempotency_requests \
            SET lease_expires_at = clock_timestamp(), owner_token = $1::uuid \
          WHERE",
        owned_row!("$2", "$3", "$4", "$5", "::uuid")
    );

    uncertain_and_release_sql!("$1", "$2", "$3", "$4", "::uuid");

    // Paged by (created_at, tenant, key), so that rows that never resolve cannot
    // keep newer ones from being asked about; the position is `created_at` in
    // microseconds since the epoch (PostgreSQL's own resolution, so it reads back
    // exactly). The `state IN (...)` term repeats the partial in-flight index's
    // condition word for word.
    const UNCERTAIN_ROWS_SQL: &'static str = "SELECT tenant_id, key_digest, downstream_key, generation, \
                CAST(owner_token AS text) AS owner_token, \
                (extract(epoch FROM created_at) * 1000000)::bigint AS created \
           FROM idempotency_requests \
          WHERE operation = $1 AND state IN ('processing', 'uncertain') AND state = 'uncertain' \
            AND ($2::bigint IS NULL \
                 OR (created_at, tenant_id, key_digest) \
                    > (to_timestamp(0) + $2::bigint * interval '1 microsecond', $3::text, $4::bytea)) \
          ORDER BY created_at, tenant_id, key_digest LIMIT $5";

    // The retention runs from the resolution, as for any completion: a row resolved
    // late must not be already expired.
    const RESOLVE_SQL: &'static str = "UPDATE idempotency_requests r \
            SET state = $1, response_status = $2, response_headers = $3, \
                response_body = $4, completed_at = c.t, lease_expires_at = NULL, \
                owner_token = NULL, expires_at = c.t + (r.expires_at - r.created_at) \
           FROM (SELECT clock_timestamp() AS t) c \
          WHERE r.tenant_id = $5 AND r.operation = $6 AND r.key_digest = $7 \
            AND r.generation = $8 AND r.state = 'uncertain' AND r.owner_token = $9::uuid";

    const OPERATION_STATUS_SQL: &'static str = super::operations::OPERATION_STATUS_SQL;

    const OPERATION_RESULT_SQL: &'static str = super::operations::OPERATION_RESULT_SQL;

    /// An outcome's status and headers as PostgreSQL's columns take them
    /// (`smallint`, `jsonb`).
    fn encode(response: &StoredResponse) -> Result<(Self::Status, Self::Headers<'_>), StoreError> {
        let status = i16::try_from(response.status)
            .map_err(|_| StoreError::Corrupt(format!("status {}", response.status)))?;
        Ok((status, sqlx::types::Json(&response.headers)))
    }

    fn stored_from_row(row: &sqlx::postgres::PgRow) -> Result<StoredResponse, StoreError> {
        super::transactional::stored_from_row(row)
    }

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Claims `req.key` in leased mode, committing at once.
    async fn claim_leased(
        pool: &Pool<Self>,
        req: &LeaseRequest<'_>,
    ) -> Result<LeasedOutcome, StoreError> {
        let row = sqlx::query(CLAIM_SQL)
            .bind_key(req.tenant, req.operation, req.key.digest())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(millis(req.retention))
            .bind(millis(req.lease))
            .bind(crate::key::downstream_key(
                req.tenant,
                req.operation,
                req.key,
            ))
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
                let retry_after =
                    Duration::from_millis(u64::try_from(ms.unwrap_or(1000)).unwrap_or(1000));
                // Without a generation the function's wait for the key's row
                // ran out: it read nothing of it.
                let seen: Option<i64> = row.try_get("generation")?;
                Ok(match seen {
                    Some(_) => LeasedOutcome::InFlight { retry_after },
                    None => LeasedOutcome::Contended { retry_after },
                })
            }
            other => Err(StoreError::Corrupt(format!(
                "leased claim outcome {other:?}"
            ))),
        }
    }

    /// Renews one lease ([`renew_one_on`]) in a transaction whose
    /// `lock_timeout` bounds the wait for its row (`SET LOCAL`: the session is
    /// as it was after it); the wait run out, unknown.
    async fn renew_waiting(
        pool: &Pool<Self>,
        row: &Renewal<'_>,
        wait: Duration,
    ) -> Result<Renewed, StoreError> {
        let mut conn = pool.acquire().await?;
        // Dropped half-way (its time ran out), the connection is closed, not
        // pooled inside the transaction.
        let mut guard = Restoring::new(&mut conn);
        let begin = format!(
            "{BEGIN_READ_COMMITTED}; SET LOCAL lock_timeout = {}",
            lock_wait_ms(wait).max(1)
        );
        let mut tx = guard.conn().begin_with(AssertSqlSafe(begin)).await?;
        let renewed = match renew_one_on::<Self>(&mut tx, row).await {
            Ok(renewed) => {
                tx.commit().await?;
                renewed
            }
            Err(e) if is_lock_timeout(&e) => {
                tx.rollback().await?;
                Renewed::Unknown
            }
            Err(e) => return Err(e.into()),
        };
        guard.restored();
        Ok(renewed)
    }

    /// Renews `rows` in one statement ([`RENEW_MANY_SQL`]).
    async fn renew_many(
        pool: &Pool<Self>,
        rows: &[Renewal<'_>],
    ) -> Result<Vec<Renewed>, StoreError> {
        let mut tenants = Vec::with_capacity(rows.len());
        let mut operations = Vec::with_capacity(rows.len());
        let mut keys = Vec::with_capacity(rows.len());
        let mut tokens = Vec::with_capacity(rows.len());
        let mut leases = Vec::with_capacity(rows.len());
        for r in rows {
            tenants.push(r.row.tenant);
            operations.push(r.row.operation);
            keys.push(r.row.key.as_bytes().to_vec());
            tokens.push(r.row.token.as_str());
            leases.push(millis(r.lease));
        }
        let found = sqlx::query(RENEW_MANY_SQL)
            .bind(tenants)
            .bind(operations)
            .bind(keys)
            .bind(tokens)
            .bind(leases)
            .fetch_all(pool)
            .await?;
        found
            .iter()
            .map(|row| {
                Ok(
                    match (
                        row.try_get::<bool, _>("renewed")?,
                        row.try_get::<bool, _>("owned")?,
                    ) {
                        (true, _) => Renewed::Kept,
                        (false, true) => Renewed::Unknown,
                        (false, false) => Renewed::Lost,
                    },
                )
            })
            .collect()
    }
}
