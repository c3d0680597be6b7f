//! Leased mode on SQLite: the same state machine as on PostgreSQL. The claim is a
//! short `BEGIN IMMEDIATE` transaction (SQLite has no stored procedures, and the
//! write lock it takes at once is what serialises claimers); the fenced statements
//! are single `UPDATE`s and `DELETE`s that match the owner token.
//!
//! SQLite has one write lock for all keys, so a claim waits for it as long as the
//! connection's busy timeout (sqlx's default is 5 s) and answers `Busy` past it
//! (`503 store-busy`); PostgreSQL's claim waits at most 200 ms for its key's row lock. Holders are
//! short (a claim, a renewal, a completion), unless a transactional handler on
//! the same database runs long. Owner tokens are
//! 128 random bits, made here; timestamps are Unix milliseconds from SQLite's clock.

use sqlx::{Connection, Pool, Sqlite};

use super::{is_busy, now_ms};
use crate::db::dialect::placeholder_rows;
use crate::db::leases::NewOwner;
use crate::db::leases::SqlLeases;
use crate::db::restoring::Restoring;
use crate::db::rows::{encode_text, leased_step, stored_from_text};
use crate::db::shared::BindKey;
use crate::db::shared::{owned_row, stored_row, uncertain_and_release_sql};
use crate::decide::LeasedStep;
use crate::model::{
    Acquisition, LeaseRequest, LeasedOutcome, Renewal, Renewed, StoreError, StoredResponse, millis,
};

const READ_SQL: &str = concat!(
    "SELECT fingerprint, state, generation, lease_expires_at, expires_at, \
            response_status, response_headers, response_body, ",
    now_ms!(),
    " AS now FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3"
);

const INSERT_SQL: &str = concat!(
    "INSERT INTO idempotency_requests \
        (tenant_id, operation, key_digest, fingerprint, state, generation, owner_token, \
         lease_expires_at, created_at, expires_at, downstream_key) \
     SELECT $1, $2, $3, $4, 'processing', 1, $5, t.now + $6, t.now, t.now + $7, $8 \
       FROM (SELECT ",
    now_ms!(),
    " AS now) t \
     RETURNING generation"
);

const RECLAIM_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET fingerprint = $4, state = 'processing', generation = generation + 1, \
            owner_token = $5, lease_expires_at = t.now + $6, \
            response_status = NULL, response_headers = NULL, response_body = NULL, \
            created_at = t.now, completed_at = NULL, expires_at = t.now + $7, \
            downstream_key = $8 \
       FROM (SELECT ",
    now_ms!(),
    " AS now) t \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
     RETURNING generation"
);

const TAKEOVER_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET owner_token = $4, generation = generation + 1, \
            downstream_key = $6, lease_expires_at = ",
    now_ms!(),
    " + $5 \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
     RETURNING generation"
);

/// The claim, inside the `BEGIN IMMEDIATE` transaction on `conn`: the row read,
/// `decide::leased` over it (PostgreSQL's `idem_claim_leased` decides the same,
/// as `tests/decide_oracle.rs` checks), and its write.
async fn claim_under_lock(
    conn: &mut sqlx::SqliteConnection,
    req: &LeaseRequest<'_>,
) -> Result<LeasedOutcome, StoreError> {
    let row = sqlx::query(READ_SQL)
        .bind_key(req.tenant, req.operation, req.key.digest())
        .fetch_optional(&mut *conn)
        .await?;
    let owner = NewOwner::of(req);
    let (write, acquisition) = match leased_step(row.as_ref(), &req.fingerprint, stored_from_text)?
    {
        LeasedStep::Answer(outcome) => return Ok(outcome),
        // The same parameters: a new row, or an expired one written over.
        step @ (LeasedStep::Insert | LeasedStep::Reclaim { .. }) => {
            let (sql, acquisition) = match step {
                LeasedStep::Insert => (INSERT_SQL, Acquisition::New),
                _ => (RECLAIM_SQL, Acquisition::Reclaimed),
            };
            let write = sqlx::query_scalar(sql)
                .bind_key(req.tenant, req.operation, req.key.digest())
                .bind(&req.fingerprint.as_bytes()[..])
                .bind(&owner.token)
                .bind(owner.lease)
                .bind(owner.retention)
                .bind(&owner.downstream);
            (write, acquisition)
        }
        // fencing the old owner out: a new token and generation
        LeasedStep::TakeOver { .. } => (
            sqlx::query_scalar(TAKEOVER_SQL)
                .bind_key(req.tenant, req.operation, req.key.digest())
                .bind(&owner.token)
                .bind(owner.lease)
                .bind(&owner.downstream),
            Acquisition::TakenOver,
        ),
    };
    let generation: i64 = write.fetch_one(&mut *conn).await?;
    Ok(owner.acquired(acquisition, generation))
}

/// Leased mode's statements on Sqlite: the texts and encodings the shared
/// statements bind (`crate::db::leases`), and the claim and the batch renewal,
/// which are this database's own.
impl SqlLeases for Sqlite {
    type Status = i64;
    type Headers<'r> = String;

    const STORE_SQL: &'static str = concat!(
        "UPDATE idempotency_requests \
            SET state = $1, response_status = $2, response_headers = $3, response_body = $4, \
                completed_at = t.now, expires_at = t.now + $5, lease_expires_at = NULL \
           FROM (SELECT ",
        now_ms!(),
        " AS now) t \
          WHERE",
        stored_row!("$6", "$7", "$8", "$9", "")
    );

    const RENEW_SQL: &'static str = concat!(
        "UPDATE idempotency_requests SET lease_expires_at = ",
        now_ms!(),
        " + $1 WHERE",
        owned_row!("$2", "$3", "$4", "$5", "")
    );

    const LAPSE_SQL: &'static str = concat!(
        "UPDATE idempotency_requests SET lease_expires_at = ",
        now_ms!(),
        ", owner_token = $1 WHERE",
        owned_row!("$2", "$3", "$4", "$5", "")
    );

    uncertain_and_release_sql!("$1", "$2", "$3", "$4", "");

    // Paged by (created_at, tenant, key), so that rows that never resolve cannot
    // keep newer ones from being asked about. The `state IN (...)` term repeats the
    // partial in-flight index's condition word for word: SQLite uses a partial index
    // only for a query that states it so.
    const UNCERTAIN_ROWS_SQL: &'static str = "SELECT tenant_id, key_digest, downstream_key, generation, \
                CAST(owner_token AS text) AS owner_token, created_at AS created \
           FROM idempotency_requests \
          WHERE operation = $1 AND state IN ('processing', 'uncertain') AND state = 'uncertain' \
            AND ($2 IS NULL OR (created_at, tenant_id, key_digest) > ($2, $3, $4)) \
          ORDER BY created_at, tenant_id, key_digest LIMIT $5";

    // The retention runs from the resolution, as for any completion.
    const RESOLVE_SQL: &'static str = concat!(
        "UPDATE idempotency_requests \
            SET state = $1, response_status = $2, response_headers = $3, response_body = $4, \
                completed_at = t.now, lease_expires_at = NULL, owner_token = NULL, \
                expires_at = t.now + (expires_at - created_at) \
           FROM (SELECT ",
        now_ms!(),
        " AS now) t \
          WHERE tenant_id = $5 AND operation = $6 AND key_digest = $7 \
            AND generation = $8 AND state = 'uncertain' AND owner_token = $9"
    );

    const OPERATION_STATUS_SQL: &'static str = super::operations::OPERATION_STATUS_SQL;

    const OPERATION_RESULT_SQL: &'static str = super::operations::OPERATION_RESULT_SQL;

    fn encode(response: &StoredResponse) -> Result<(Self::Status, Self::Headers<'_>), StoreError> {
        encode_text(response)
    }

    fn stored_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<StoredResponse, StoreError> {
        stored_from_text(row)
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Claims `req.key` in leased mode, committing at once.
    async fn claim_leased(
        pool: &Pool<Self>,
        req: &LeaseRequest<'_>,
    ) -> Result<LeasedOutcome, StoreError> {
        // IMMEDIATE: the write lock at once, so the read and the write below see
        // the same row; a concurrent claimer waits through the busy timeout.
        let mut tx = match pool.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => tx,
            Err(e) if is_busy(&e) => {
                return Ok(LeasedOutcome::Busy {
                    retry_after: super::BUSY_RETRY_AFTER,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let outcome = claim_under_lock(&mut tx, req).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    /// Renews `rows` in one transaction: SQLite has one writer at a time, so the
    /// batch takes the write lock once (through the busy timeout) and holds it as
    /// briefly as it can: one `UPDATE .. RETURNING` per distinct lease length (in
    /// practice one), each over all its rows, rather than a statement per lease.
    /// Under the write lock no row can be held by anyone else: a row not returned
    /// is not this execution's any more. The statements' texts depend on the
    /// batch's size, so they are not kept in the connection's statement cache.
    async fn renew_many(
        pool: &Pool<Self>,
        rows: &[Renewal<'_>],
    ) -> Result<Vec<Renewed>, StoreError> {
        use sqlx::Row as _;

        let mut conn = pool.acquire().await?;
        // A batch dropped half-way (its time ran out) must not return a connection
        // to the pool holding the database's write lock: it is closed instead.
        let mut guard = Restoring::new(&mut conn);
        let mut tx = guard.conn().begin_with("BEGIN IMMEDIATE").await?;
        let mut kept = std::collections::HashSet::new();
        for (lease, of) in Renewal::by_lease(rows) {
            let sql = format!(
                "UPDATE idempotency_requests SET lease_expires_at = {} + ? \
                  WHERE state = 'processing' \
                    AND (tenant_id, operation, key_digest, owner_token) IN (VALUES {}) \
                 RETURNING owner_token",
                now_ms!(),
                placeholder_rows(4, of.len())
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(millis(lease));
            for r in &of {
                query = query
                    .bind(r.row.tenant)
                    .bind(r.row.operation)
                    .bind(r.row.key)
                    .bind(r.row.token);
            }
            for row in query.persistent(false).fetch_all(&mut *tx).await? {
                kept.insert(row.try_get::<String, _>(0)?);
            }
        }
        tx.commit().await?;
        guard.restored();
        Ok(rows
            .iter()
            .map(|r| {
                if kept.contains(r.row.token.as_str()) {
                    Renewed::Kept
                } else {
                    Renewed::Lost
                }
            })
            .collect())
    }
}
