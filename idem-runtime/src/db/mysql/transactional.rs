//! The transactional mode on MySQL and MariaDB: the same state machine as on
//! PostgreSQL, in the caller's InnoDB transaction.
//!
//! The claim is a locking read of the key's row (`SELECT ... FOR UPDATE`), then,
//! by what it found, an `INSERT` (no row), a re-claim `UPDATE` (a finished,
//! expired row) or a decision (replay, mismatch, in flight). A locking read
//! reads the latest committed version and waits for a transaction that holds
//! the row, including one that inserted it and has not committed: so a
//! duplicate waits for the first transaction to end and then sees its committed
//! row (or, after a rollback, no row). Two claims of a new key that both found
//! no row race on the `INSERT`: the second waits for the first's row and gets
//! a duplicate-key error once it commits, then reads again.
//!
//! The wait is bounded by `innodb_lock_wait_timeout`, `in_flight_wait` rounded
//! up to whole seconds (at least 1); past it (error 1205, which rolls back the
//! statement only) the claim answers [`Claim::InFlight`]. On a connection idem
//! holds (the handler's path with claims at commit off) the bound is set on the
//! session for the claim and given back after; dropped in between, idem closes
//! that connection. On the caller's own transaction, whose connection idem only
//! borrows and cannot close, no session setting is changed: on MariaDB each
//! statement carries its bound (`SET STATEMENT .. FOR`), and on MySQL 8, which
//! has no such form, the claim waits the session's own lock wait. A deadlock (1213) rolls back the whole
//! transaction: the handler's path begins again and retries, a bounded number of
//! times ([`DEADLOCK_RETRIES`]), then answers in flight.
//!
//! In READ COMMITTED (how idem begins its transactions) InnoDB takes no gap
//! locks for these reads, so a claim of one key never holds up another key.

use std::time::Duration;

use sqlx::{MySql, MySqlConnection, Row};

use super::hot_path::{PARSE_ERROR, learned_set_statement, set_statement_refused};
use super::{
    READ_SQL, bound_lock_wait, created_now, error_number, is_deadlock, is_duplicate,
    is_lock_timeout, lock_wait_for_statement, lock_wait_seconds, now_ms, restarted_row,
    restore_lock_wait, store_outcome,
};
use crate::db::rows::{encode_text, stored_from_text};
use crate::db::shared::BindKey;
use crate::db::stores::Claims;
use crate::decide::RowState;
use crate::model::{Claim, ClaimRequest, Execution, StoreError, StoredResponse, millis};

/// How many times the handler's path begins a claim's transaction when InnoDB
/// picks it as a deadlock's victim, before answering in flight.
pub(crate) const DEADLOCK_RETRIES: u32 = 3;

// The clock expression is fixed for the statement, so both timestamps are the
// same instant.
const INSERT_SQL: &str = concat!(
    "INSERT INTO idempotency_requests \
        (tenant_id, operation, key_digest, fingerprint, state, generation, created_at, expires_at) \
     VALUES (?, ?, ?, ?, 'processing', 1, ",
    created_now!(),
    ")"
);

// Under the row lock the locking read took: the generation is the one read plus
// one.
const RECLAIM_SQL: &str = concat!(
    "UPDATE idempotency_requests \
        SET fingerprint = ?, state = 'processing', generation = generation + 1, \
            owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, ",
    restarted_row!()
);

// The WHERE clause is evaluated before the SET clause's assignments.
const COMPLETE_SQL: &str = concat!(
    store_outcome!(),
    ", expires_at = ",
    now_ms!(),
    " + ? \
      WHERE tenant_id = ? AND operation = ? AND key_digest = ? \
        AND generation = ? AND state = 'processing'"
);

/// In flight: retry after the bound, at least a second.
pub(crate) fn in_flight(req: &ClaimRequest<'_>) -> Claim {
    Claim::InFlight {
        retry_after: req.in_flight_wait.max(Duration::from_secs(1)),
    }
}

/// Claims `req.key` on a connection idem holds, in a transaction it began, the
/// session's lock wait bounded for the claim and given back after (the caller
/// closes the connection if this is dropped in between). A deadlock comes back
/// as the database error it is, for the caller to retry or answer.
pub(crate) async fn claim_on(
    conn: &mut MySqlConnection,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    bound_lock_wait(conn, req.in_flight_wait).await?;
    let claimed = claim_bounded(conn, req, None).await;
    restore_lock_wait(conn).await?;
    claimed
}

/// Claims `req.key` on the connection of a transaction begun by the caller,
/// changing no session setting (see the module docs): whatever point this is
/// dropped at, the connection is as the caller left it.
pub(crate) async fn claim_borrowed(
    conn: &mut MySqlConnection,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    if set_statement_refused() {
        return claim_bounded(conn, req, None).await;
    }
    let secs = lock_wait_seconds(req.in_flight_wait);
    match claim_bounded(conn, req, Some(secs)).await {
        // MySQL 8: a statement that did not parse changed nothing, and the
        // transaction goes on.
        Err(StoreError::Database(e)) if error_number(&e) == Some(PARSE_ERROR) => {
            learned_set_statement(false);
            claim_bounded(conn, req, None).await
        }
        claimed => {
            if claimed.is_ok() {
                learned_set_statement(true);
            }
            claimed
        }
    }
}

/// Records the locking read's wait for a concurrent holder of the key, as the
/// other databases record theirs. MySQL does not say whether a read waited for a
/// lock: a read of 5 ms or more (well past a round trip in one data centre, and
/// every read that ran into the lock-wait bound, at least 1 s) is counted as one
/// that did; shorter waits go unrecorded.
fn waited(req: &ClaimRequest<'_>, started: std::time::Instant) {
    let waited = started.elapsed();
    if waited >= std::time::Duration::from_millis(5) {
        crate::metrics::seconds(
            crate::metrics::CLAIM_WAIT_SECONDS,
            req.operation.to_owned(),
            waited.as_secs_f64(),
        );
    }
}

/// The claim's statements; with `per_statement`, the statements that can wait
/// for a holder of the key carry that bound (seconds) themselves.
async fn claim_bounded(
    conn: &mut MySqlConnection,
    req: &ClaimRequest<'_>,
    per_statement: Option<u64>,
) -> Result<Claim, StoreError> {
    let bounded = |sql: &'static str| match per_statement {
        Some(secs) => lock_wait_for_statement(sql, secs),
        None => sql,
    };
    // At most twice: a second read follows only a lost INSERT race, and then the
    // row exists (committed) unless its writer deleted it in the meantime.
    for _ in 0..2 {
        let started = std::time::Instant::now();
        let read = sqlx::query(bounded(READ_SQL))
            .bind_key(req.tenant, req.operation, req.key.digest())
            .fetch_optional(&mut *conn)
            .await;
        waited(req, started);
        let row = match read {
            Ok(row) => row,
            Err(e) if is_lock_timeout(&e) => return Ok(in_flight(req)),
            Err(e) => return Err(e.into()),
        };
        let Some(row) = row else {
            match sqlx::query(bounded(INSERT_SQL))
                .bind_key(req.tenant, req.operation, req.key.digest())
                .bind(&req.fingerprint.as_bytes()[..])
                .bind(millis(req.retention))
                .execute(&mut *conn)
                .await
            {
                Ok(_) => return Ok(Claim::Execute(Execution::new(req, 1))),
                Err(e) if is_lock_timeout(&e) => return Ok(in_flight(req)),
                Err(e) if is_duplicate(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let now: i64 = row.try_get("now")?;
        let state: RowState = row.try_get("state")?;
        let finished = state.is_finished();
        let expires_at: i64 = row.try_get("expires_at")?;
        if finished && expires_at <= now {
            let generation: i64 = row.try_get("generation")?;
            sqlx::query(RECLAIM_SQL)
                .bind(&req.fingerprint.as_bytes()[..])
                .bind(millis(req.retention))
                .bind_key(req.tenant, req.operation, req.key.digest())
                .execute(&mut *conn)
                .await?;
            return Ok(Claim::Execute(Execution::new(req, generation + 1)));
        }
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        if fingerprint != req.fingerprint.as_bytes() {
            return Ok(Claim::Mismatch);
        }
        if !finished {
            // A leased execution's row, committed `processing` or `uncertain`.
            return Ok(in_flight(req));
        }
        return Ok(Claim::Replay(stored_from_text(&row)?));
    }
    Ok(in_flight(req))
}

/// The claim and the completion in the caller's transaction; the handler's
/// path is `hot_path`'s.
impl Claims for MySql {
    /// In a transaction the caller began: a deadlock (the whole transaction was
    /// rolled back by InnoDB) is answered as in flight, since it cannot be
    /// retried here.
    async fn claim(
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        match claim_borrowed(conn, req).await {
            Err(StoreError::Database(e)) if is_deadlock(&e) => Ok(in_flight(req)),
            other => other,
        }
    }

    /// Stores an execution's outcome on the connection of the transaction that
    /// claimed the key.
    async fn complete(
        execution: Execution,
        conn: &mut MySqlConnection,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let (status, headers) = encode_text(response)?;
        let done = sqlx::query(COMPLETE_SQL)
            .bind(response.state())
            .bind(status)
            .bind(headers)
            .bind(&response.body[..])
            .bind(millis(execution.retention))
            .bind_key(&execution.tenant, &execution.operation, execution.key)
            .bind(execution.generation)
            .execute(&mut *conn)
            .await?;
        // sqlx connects with CLIENT_FOUND_ROWS: the rows matched, not only changed.
        execution.completed(done.rows_affected())
    }
}
