//! Leased mode on MySQL and MariaDB: the same state machine as on PostgreSQL. The
//! claim is a short READ COMMITTED transaction of its own (a locking read of the
//! key's row, then an insert, a re-claim or a takeover); the fenced statements
//! are single `UPDATE`s and `DELETE`s that match the owner token.
//!
//! A claim waits for a concurrent holder of the key's row at most 1 s (the
//! smallest `innodb_lock_wait_timeout`; PostgreSQL waits 200 ms), then answers
//! contended (it read nothing). The rows a fenced statement reports are the
//! rows it matched (sqlx connects with `CLIENT_FOUND_ROWS`), so a renewal
//! within the same millisecond still counts. Owner tokens are 128 random bits, made here.

use std::collections::HashSet;
use std::time::Duration;

use sqlx::{Connection, MySql, MySqlConnection, Pool, Row};

use super::{
    BEGIN_READ_COMMITTED, READ_SQL, bound_lock_wait, created_now, is_deadlock, is_lock_timeout,
    now_ms, restarted_row, restore_lock_wait, store_outcome,
};
use crate::db::dialect::{placeholder_rows, question_marks};
use crate::db::leases::NewOwner;
use crate::db::leases::{SqlLeases, renew_one_on};
use crate::db::restoring::Restoring;
use crate::db::rows::{encode_text, leased_step, stored_from_text};
use crate::db::shared::BindKey;
use crate::db::shared::{self, owned_row, stored_row, uncertain_and_release_sql};
use crate::decide::LeasedStep;
use crate::model::{
    Acquisition, LeaseRequest, LeasedOutcome, Renewal, Renewed, StoreError, StoredResponse, millis,
};

const INSERT_SQL: &str = concat!(
    "INSERT INTO idempotency_requests \
        (tenant_id, operation, key_digest, fingerprint, state, generation, owner_token, \
         lease_expires_at, created_at, expires_at, downstream_key) \
     VALUES (?, ?, ?, ?, 'processing', 1, ?, ",
    now_ms!(),
    " + ?, ",
    created_now!(),
    ", ?)"
);

const RECLAIM_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET fingerprint = ?, state = 'processing', generation = generation + 1, \
            owner_token = ?, downstream_key = ?, lease_expires_at = ",
    now_ms!(),
    " + ?, ",
    restarted_row!()
);

const TAKEOVER_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET owner_token = ?, downstream_key = ?, generation = generation + 1, lease_expires_at = ",
    now_ms!(),
    " + ? WHERE tenant_id = ? AND operation = ? AND key_digest = ?"
);

/// The owner tokens of `rows` that `select .. WHERE state = 'processing' AND
/// (tenant_id, operation, key_digest, owner_token) IN (..) {tail}` finds: the
/// rows still owned as `rows` say. The text depends on how many rows there are,
/// so it is not kept in the connection's statement cache.
async fn owner_tokens(
    conn: &mut MySqlConnection,
    select: &str,
    tail: &str,
    rows: &[&Renewal<'_>],
) -> Result<HashSet<String>, sqlx::Error> {
    let sql = format!(
        "{select} WHERE state = 'processing' AND \
         (tenant_id, operation, key_digest, owner_token) IN ({}){tail}",
        placeholder_rows(4, rows.len())
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for r in rows {
        query = query
            .bind(r.row.tenant)
            .bind(r.row.operation)
            .bind(r.row.key)
            .bind(r.row.token);
    }
    query
        .persistent(false)
        .fetch_all(conn)
        .await?
        .iter()
        .map(|r| r.try_get::<String, _>(0))
        .collect()
}

/// Another claim of the key holds or has just created its row: this one read
/// nothing of it.
fn contended() -> LeasedOutcome {
    LeasedOutcome::Contended {
        retry_after: Duration::from_secs(1),
    }
}

async fn claim_in_transaction(
    conn: &mut MySqlConnection,
    req: &LeaseRequest<'_>,
) -> Result<LeasedOutcome, StoreError> {
    let mut tx = conn.begin_with(BEGIN_READ_COMMITTED).await?;
    let outcome = claim_under_lock(&mut tx, req).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// The claim under the key's row lock: the row read, `decide::leased` over it
/// (PostgreSQL's `idem_claim_leased` decides the same, as
/// `tests/decide_oracle.rs` checks), and its write.
async fn claim_under_lock(
    conn: &mut MySqlConnection,
    req: &LeaseRequest<'_>,
) -> Result<LeasedOutcome, StoreError> {
    let owner = NewOwner::of(req);
    let row = sqlx::query(READ_SQL)
        .bind_key(req.tenant, req.operation, req.key.digest())
        .fetch_optional(&mut *conn)
        .await?;
    // MySQL has no RETURNING: under the row lock, the generation is the one
    // decided.
    let (update, acquisition, generation) =
        match leased_step(row.as_ref(), &req.fingerprint, stored_from_text)? {
            LeasedStep::Answer(outcome) => return Ok(outcome),
            // Two claimers that both found no row race here: the second waits for
            // the first's row and then fails on the duplicate key, and
            // `claim_leased` claims again (the row is there then).
            LeasedStep::Insert => {
                return match sqlx::query(INSERT_SQL)
                    .bind_key(req.tenant, req.operation, req.key.digest())
                    .bind(&req.fingerprint.as_bytes()[..])
                    .bind(&owner.token)
                    .bind(owner.lease)
                    .bind(owner.retention)
                    .bind(&owner.downstream)
                    .execute(&mut *conn)
                    .await
                {
                    Ok(_) => Ok(owner.acquired(Acquisition::New, 1)),
                    Err(e) if super::is_duplicate(&e) => Ok(contended()),
                    Err(e) => Err(e.into()),
                };
            }
            LeasedStep::Reclaim { generation } => (
                sqlx::query(RECLAIM_SQL)
                    .bind(&req.fingerprint.as_bytes()[..])
                    .bind(&owner.token)
                    .bind(&owner.downstream)
                    .bind(owner.lease)
                    .bind(owner.retention),
                Acquisition::Reclaimed,
                generation,
            ),
            // fencing the old owner out: a new token and generation
            LeasedStep::TakeOver { generation } => (
                sqlx::query(TAKEOVER_SQL)
                    .bind(&owner.token)
                    .bind(&owner.downstream)
                    .bind(owner.lease),
                Acquisition::TakenOver,
                generation,
            ),
        };
    update
        .bind_key(req.tenant, req.operation, req.key.digest())
        .execute(&mut *conn)
        .await?;
    Ok(owner.acquired(acquisition, generation))
}

/// Leased mode's statements on MySql: the texts and encodings the shared
/// statements bind (`crate::db::leases`), and the claim and the batch renewal,
/// which are this database's own.
impl SqlLeases for MySql {
    type Status = i64;
    type Headers<'r> = String;

    const STORE_SQL: &'static str = concat!(
        store_outcome!(),
        ", expires_at = ",
        now_ms!(),
        " + ?, lease_expires_at = NULL WHERE",
        stored_row!("?", "?", "?", "?", "")
    );

    const RENEW_SQL: &'static str = concat!(
        "UPDATE idempotency_requests SET lease_expires_at = ",
        now_ms!(),
        " + ? WHERE",
        owned_row!("?", "?", "?", "?", "")
    );

    const LAPSE_SQL: &'static str = concat!(
        "UPDATE idempotency_requests SET lease_expires_at = ",
        now_ms!(),
        ", owner_token = ? WHERE",
        owned_row!("?", "?", "?", "?", "")
    );

    uncertain_and_release_sql!("?", "?", "?", "?", "");

    const CURRENT_SQL: &'static str = question_marks!(shared::CURRENT_SQL);

    // Paged by (created_at, tenant, key), so that rows that never resolve cannot
    // keep newer ones from being asked about; the in-flight index (state,
    // created_at) serves `state = 'uncertain'`. The key columns are VARBINARY, read
    // back as text; the order names the column (unqualified, `tenant_id` would be
    // the text alias, ordered by its collation where the resume point compares
    // bytes). The first page has no position: -1 (before every `created_at`,
    // which are Unix milliseconds) stands for it. The resume point is spelt out
    // column by column, over a one-row derived table that holds each parameter
    // once, in the order every database binds them: MariaDB uses no index for
    // a row comparison, and each page would read every uncertain row before it.
    // The order names `operation` (one value here) so that it is the in-flight
    // index's own (state, created_at, then the primary key): the derived
    // table's operation is not taken for a constant, and without it the page
    // would be sorted from every row after the resume point.
    const UNCERTAIN_ROWS_SQL: &'static str = "SELECT CONVERT(tenant_id USING utf8mb4) AS tenant_id, \
                key_digest, downstream_key, generation, \
                owner_token, created_at AS created \
           FROM idempotency_requests, \
                (SELECT ? AS op, COALESCE(?, -1) AS c, COALESCE(?, '') AS t, COALESCE(?, '') AS k) AS page \
          WHERE operation = page.op AND state = 'uncertain' \
            AND (created_at > page.c \
                 OR (created_at = page.c \
                     AND (idempotency_requests.tenant_id > page.t \
                          OR (idempotency_requests.tenant_id = page.t AND key_digest > page.k)))) \
          ORDER BY created_at, idempotency_requests.tenant_id, idempotency_requests.operation, \
                   key_digest LIMIT ?";

    // The retention runs from the resolution, as for any completion; the
    // assignments run left to right, so expires_at is computed before created_at
    // would change (it does not).
    const RESOLVE_SQL: &'static str = concat!(
        store_outcome!(),
        ", lease_expires_at = NULL, owner_token = NULL, expires_at = ",
        now_ms!(),
        " + (expires_at - created_at) \
          WHERE tenant_id = ? AND operation = ? AND key_digest = ? \
            AND generation = ? AND state = 'uncertain' AND owner_token = ?"
    );

    // A resolution applies to the execution it was asked about and no other.
    const FORGET_SQL: &'static str = "DELETE FROM idempotency_requests \
          WHERE tenant_id = ? AND operation = ? AND key_digest = ? \
            AND generation = ? AND state = 'uncertain' AND owner_token = ?";

    const OPERATION_STATUS_SQL: &'static str = super::operations::OPERATION_STATUS_SQL;

    const OPERATION_RESULT_SQL: &'static str = super::operations::OPERATION_RESULT_SQL;

    fn encode(response: &StoredResponse) -> Result<(Self::Status, Self::Headers<'_>), StoreError> {
        encode_text(response)
    }

    fn stored_from_row(row: &sqlx::mysql::MySqlRow) -> Result<StoredResponse, StoreError> {
        stored_from_text(row)
    }

    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Claims `req.key` in leased mode, committing at once.
    async fn claim_leased(
        pool: &Pool<Self>,
        req: &LeaseRequest<'_>,
    ) -> Result<LeasedOutcome, StoreError> {
        let mut conn = pool.acquire().await?;
        // Dropped before the lock wait is given back (a caller's timeout), the
        // connection is closed rather than pooled with idem's bound on it.
        let mut session = Restoring::new(&mut conn);
        bound_lock_wait(session.conn(), Duration::from_secs(1)).await?;
        let mut outcome = claim_in_transaction(session.conn(), req).await;
        // Lost the race to create the row (the only `Contended` a claim that
        // ran through gives): the row is there now, to read and decide on, as
        // PostgreSQL's claim function looks again.
        if matches!(outcome, Ok(LeasedOutcome::Contended { .. })) {
            outcome = claim_in_transaction(session.conn(), req).await;
        }
        // The claim has committed (or not) by now: what the restore does must not
        // lose it. An acquired row dropped here would wait out its whole lease.
        // A session whose lock wait could not be restored is not given back to the
        // pool.
        match restore_lock_wait(session.conn()).await {
            Ok(()) => session.restored(),
            Err(e) => {
                tracing::warn!(error = %e, "idem: could not restore the session's lock wait after a leased claim; closing the connection");
            }
        }
        match outcome {
            Ok(outcome) => Ok(outcome),
            // Another claim of the key held it past the wait, or InnoDB chose this
            // claim as a deadlock's victim (and rolled it back): someone else is
            // deciding the key right now.
            Err(StoreError::Database(e)) if is_lock_timeout(&e) || is_deadlock(&e) => {
                Ok(contended())
            }
            Err(e) => Err(e),
        }
    }

    /// Renews one lease ([`renew_one_on`]) with the session's lock wait bounded
    /// to about `wait` (in whole seconds, at least 1; given back after it);
    /// the wait run out (or a deadlock's victim), unknown.
    async fn renew_waiting(
        pool: &Pool<Self>,
        row: &Renewal<'_>,
        wait: Duration,
    ) -> Result<Renewed, StoreError> {
        let mut conn = pool.acquire().await?;
        // Dropped before the lock wait is given back, the connection is closed
        // rather than pooled with idem's bound on it.
        let mut session = Restoring::new(&mut conn);
        bound_lock_wait(session.conn(), wait).await?;
        let renewed = renew_one_on::<Self>(session.conn(), row).await;
        match restore_lock_wait(session.conn()).await {
            Ok(()) => session.restored(),
            Err(e) => {
                tracing::warn!(error = %e, "idem: could not restore the session's lock wait after a lease renewal; closing the connection");
            }
        }
        match renewed {
            Err(e) if is_lock_timeout(&e) || is_deadlock(&e) => Ok(Renewed::Unknown),
            other => Ok(other?),
        }
    }

    /// Renews `rows` in one short transaction: the rows nobody else holds are locked
    /// through the primary key (`FOR UPDATE SKIP LOCKED`: a row another transaction
    /// holds is not waited for, so one held row cannot hold up every lease of the
    /// process) and renewed by one `UPDATE` by primary key per distinct lease length. Rows not locked are read once more without a
    /// lock: still owned (held by another transaction: renew again soon), or lost.
    /// The statements' texts depend on the batch's size, so they are not kept in
    /// the connection's statement cache.
    async fn renew_many(
        pool: &Pool<Self>,
        rows: &[Renewal<'_>],
    ) -> Result<Vec<Renewed>, StoreError> {
        let all: Vec<&Renewal<'_>> = rows.iter().collect();
        let mut conn = pool.acquire().await?;
        // A batch dropped half-way (its time ran out) must not return a connection
        // to the pool inside a transaction that holds the rows it locked: it is
        // closed instead, and the server rolls the transaction back.
        let mut guard = Restoring::new(&mut conn);
        let mut tx = guard.conn().begin_with(BEGIN_READ_COMMITTED).await?;
        let locked = owner_tokens(
            &mut tx,
            "SELECT owner_token FROM idempotency_requests FORCE INDEX (PRIMARY)",
            " FOR UPDATE SKIP LOCKED",
            &all,
        )
        .await?;
        let held: Vec<&Renewal<'_>> = all
            .iter()
            .copied()
            .filter(|r| locked.contains(r.row.token.as_str()))
            .collect();
        // One `UPDATE` per distinct lease length (in practice one), by primary key
        // alone: the rows are locked and checked above, and a condition on `state`
        // could lead InnoDB through the in-flight index, where it would wait for
        // rows others hold.
        let held: Vec<Renewal<'_>> = held.into_iter().copied().collect();
        for (lease, of) in Renewal::by_lease(&held) {
            let keys = format!(
                "(tenant_id, operation, key_digest) IN ({})",
                placeholder_rows(3, of.len())
            );
            let renew = format!(
                "UPDATE idempotency_requests SET lease_expires_at = {} + ? WHERE {keys}",
                now_ms!(),
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(renew)).bind(millis(lease));
            for r in &of {
                query = query
                    .bind(r.row.tenant)
                    .bind(r.row.operation)
                    .bind(r.row.key);
            }
            query.persistent(false).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        guard.restored();
        let rest: Vec<&Renewal<'_>> = all
            .iter()
            .copied()
            .filter(|r| !locked.contains(r.row.token.as_str()))
            .collect();
        let owned = if rest.is_empty() {
            HashSet::new()
        } else {
            let select = "SELECT owner_token FROM idempotency_requests";
            owner_tokens(&mut conn, select, "", &rest).await?
        };
        Ok(rows
            .iter()
            .map(|r| {
                let token = r.row.token.as_str();
                if locked.contains(token) {
                    Renewed::Kept
                } else if owned.contains(token) {
                    Renewed::Unknown
                } else {
                    Renewed::Lost
                }
            })
            .collect())
    }
}
