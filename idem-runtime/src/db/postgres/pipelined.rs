//! The handler's path on PostgreSQL: the claim travels with `BEGIN` and the
//! completion with `COMMIT`, so idem adds no round trip to the handler's own
//! transaction.
//!
//! ```text
//! SELECT idem_precheck(..); BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL ..; SELECT idem_take(..)
//! ... the handler's statements ...
//! SELECT idem_finish(..); COMMIT; BEGIN
//! ```
//!
//! The first message is the driver's own `begin` with a statement of idem's, so
//! the driver counts the transaction exactly as for a `sqlx::Transaction` (nested
//! `begin`s in the handler are savepoints). The driver reads no rows from it, only
//! whether it ended inside a transaction; every outcome but "claimed" is therefore
//! an error with an SQLSTATE of idem's (see the migration
//! `20261201000001_pipelined_claim.sql`):
//!
//! | answer | left | what follows |
//! | --- | --- | --- |
//! | transaction begun | claimed, generation 1 | run the handler |
//! | `IDEM4` from the precheck | idle | read the stored outcome and replay it (one round trip) |
//! | `IDEM5` from the precheck | idle | mismatch |
//! | `55P03` from the take | aborted | roll back, answer in flight |
//! | `IDEM6` from the take | aborted | `ROLLBACK; BEGIN`, then `idem_claim` as hand-written callers do |
//! | `25001` (the role's default isolation is not READ COMMITTED), `42883` (the migration is missing) | idle | the same long way; pipelining is switched off for this [`Idem`] |
//!
//! The cost is a line in PostgreSQL's log for each replay, mismatch and contended
//! claim (the server logs every error); [`Idem::with_pipelined_claims`] turns the
//! whole path off.
//!
//! The second message stores the outcome and commits; the `BEGIN` after `COMMIT`
//! leaves an empty transaction whose rollback the driver queues and sends with the
//! connection's release, so the driver's count of transactions stays right without
//! a round trip. If `idem_finish` fails (`IDEM3`: the execution lost its key), the
//! `COMMIT` is never reached and nothing commits.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Database, Postgres, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use super::BEGIN_READ_COMMITTED;
use super::sql_literal::{push_bytea, push_int, push_text};
use super::transactional::{claim_on, complete_on, stored_from_row};
use crate::config::Idem;
use crate::model::{Claim, ClaimRequest, Execution, Finish, StoreError, StoredResponse, millis};
use crate::tx::Tx;

/// SQLSTATEs of idem's pipelined functions, and the two of PostgreSQL's own that
/// the path handles.
mod code {
    pub const REPLAY: &str = "IDEM4";
    pub const MISMATCH: &str = "IDEM5";
    pub const TAKEN: &str = "IDEM6";
    pub const LOST_CLAIM: &str = "IDEM3";
    pub const LOCK_TIMEOUT: &str = "55P03";
    /// "SET TRANSACTION ISOLATION LEVEL must be called before any query": the
    /// role's default isolation is not READ COMMITTED.
    pub const ACTIVE_SQL_TRANSACTION: &str = "25001";
    pub const UNDEFINED_FUNCTION: &str = "42883";
    pub const IN_FAILED_TRANSACTION: &str = "25P02";
}

const READ_STORED_SQL: &str = "SELECT fingerprint, response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND expires_at > now() AND state IN ('completed', 'failed')";

/// Begins the handler's transaction and claims the key in it (see the module docs).
pub(crate) async fn begin_claim(
    idem: &Idem<Postgres>,
    req: &ClaimRequest<'_>,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let bounds = bounds(idem, req);
    let statement = match idem
        .pipelined_claims()
        .then(|| claim_statement(req, &bounds))
    {
        Some(Some(sql)) => sql,
        // Off, or a value a simple query cannot carry.
        _ => return long_way(idem.pool().acquire().await?, req, false, &bounds).await,
    };
    let mut conn = idem.pool().acquire().await?;
    let started = std::time::Instant::now();
    let begun = <Postgres as Database>::TransactionManager::begin(
        &mut conn,
        Some(AssertSqlSafe(statement).into_sql_str()),
    )
    .await;
    let e = match begun {
        Ok(()) => {
            let claim = Claim::Execute(Execution::new(req, 1));
            return Ok((Tx::begun(conn), claim));
        }
        Err(e) => e,
    };
    let sqlstate = match &e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    };
    if matches!(sqlstate.as_deref(), Some(code::LOCK_TIMEOUT | code::TAKEN)) {
        // The take waited for a concurrent holder of the key (or found it at once).
        crate::metrics::seconds(
            crate::metrics::CLAIM_WAIT_SECONDS,
            req.operation.to_owned(),
            started.elapsed().as_secs_f64(),
        );
    }
    match sqlstate.as_deref() {
        Some(code::REPLAY) => replay(conn, req, &bounds).await,
        Some(code::MISMATCH) => Ok((Tx::idle(conn), Claim::Mismatch)),
        Some(code::LOCK_TIMEOUT) => {
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
            Ok((Tx::idle(conn), in_flight(req)))
        }
        Some(code::TAKEN) => long_way(conn, req, true, &bounds).await,
        Some(code::ACTIVE_SQL_TRANSACTION) => {
            idem.stop_pipelined_claims(
                "the database role's default transaction isolation is not READ COMMITTED",
            );
            long_way(conn, req, false, &bounds).await
        }
        Some(code::UNDEFINED_FUNCTION) => {
            idem.stop_pipelined_claims(
                "idem's migration 20261201000001_pipelined_claim has not been applied",
            );
            long_way(conn, req, false, &bounds).await
        }
        _ => {
            // Where the message stopped is not known: do not give the connection
            // back to the pool in an unknown state.
            conn.close_on_drop();
            Err(e.into())
        }
    }
}

/// `; SET LOCAL ...` for the claim's transaction: the request deadline as
/// `statement_timeout` (no statement of the handler's, nor idem's, runs longer)
/// and `idle_in_transaction_session_timeout` (a client that stalls or vanishes
/// mid-transaction has its session ended, and the key freed, by the server).
/// A second longer than the deadline itself: the server's bound is the backstop
/// for a client that vanished, and must not cancel a statement just before the
/// client abandons the request (the handler would see its statement fail and
/// answer its own error instead of idem's `503`). Both take at most `i32::MAX`
/// milliseconds (about 24.8 days); a longer bound is that.
fn bounds(idem: &Idem<Postgres>, req: &ClaimRequest<'_>) -> String {
    let deadline = idem.deadline_with_wait(req.in_flight_wait);
    let ms = millis(deadline.saturating_add(Duration::from_secs(1))).min(i64::from(i32::MAX));
    format!(
        "; SET LOCAL statement_timeout = {ms}; SET LOCAL idle_in_transaction_session_timeout = {ms}"
    )
}

/// `SELECT idem_precheck(..); BEGIN ...; SET LOCAL ..; SELECT idem_take(..)` with
/// `req`'s values, or `None` when one of them cannot be written as a literal.
fn claim_statement(req: &ClaimRequest<'_>, bounds: &str) -> Option<String> {
    let mut args = String::with_capacity(200);
    push_text(&mut args, req.tenant)?;
    args.push_str(", ");
    push_text(&mut args, req.operation)?;
    args.push_str(", ");
    push_bytea(&mut args, req.key.digest().as_bytes());
    args.push_str(", ");
    push_bytea(&mut args, req.fingerprint.as_bytes());
    let mut sql = String::with_capacity(2 * args.len() + bounds.len() + 120);
    sql.push_str("SELECT idem_precheck(");
    sql.push_str(&args);
    sql.push_str("); ");
    sql.push_str(BEGIN_READ_COMMITTED);
    sql.push_str(bounds);
    sql.push_str("; SELECT idem_take(");
    sql.push_str(&args);
    sql.push_str(", ");
    push_int(&mut sql, millis(req.retention));
    sql.push_str(", ");
    push_int(&mut sql, super::lock_wait_ms(req.in_flight_wait));
    sql.push(')');
    Some(sql)
}

fn in_flight(req: &ClaimRequest<'_>) -> Claim {
    Claim::InFlight {
        retry_after: req.in_flight_wait.max(Duration::from_secs(1)),
    }
}

/// The precheck found a stored outcome with this fingerprint: read it, outside
/// any transaction (a finished, unexpired outcome does not change). If it is gone
/// by now (purged, or just expired), claim the long way.
async fn replay(
    mut conn: PoolConnection<Postgres>,
    req: &ClaimRequest<'_>,
    bounds: &str,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let row = sqlx::query(READ_STORED_SQL)
        .bind(req.tenant)
        .bind(req.operation)
        .bind(req.key.digest())
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        return long_way(conn, req, false, bounds).await;
    };
    let fingerprint: Vec<u8> = sqlx::Row::try_get(&row, "fingerprint")?;
    let claim = if fingerprint == req.fingerprint.as_bytes() {
        Claim::Replay(stored_from_row(&row)?)
    } else {
        // Expired and executed anew for another request in between.
        Claim::Mismatch
    };
    Ok((Tx::idle(conn), claim))
}

/// Begins a transaction (after rolling back an aborted one) and claims with
/// `idem_claim`, which handles every state a key can be in.
async fn long_way(
    mut conn: PoolConnection<Postgres>,
    req: &ClaimRequest<'_>,
    aborted: bool,
    bounds: &str,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let rollback = if aborted { "ROLLBACK; " } else { "" };
    let begin = AssertSqlSafe(format!("{rollback}{BEGIN_READ_COMMITTED}{bounds}")).into_sql_str();
    <Postgres as Database>::TransactionManager::begin(&mut conn, Some(begin)).await?;
    let mut tx = Tx::begun(conn);
    let claim = claim_on(tx.connection(), req).await?;
    Ok((tx, claim))
}

/// Stores the outcome and commits, in one message (see the module docs).
pub(crate) async fn finish(
    idem: &Idem<Postgres>,
    mut tx: Tx<Postgres>,
    execution: Execution,
    response: &StoredResponse,
) -> Finish {
    let statement = idem
        .pipelined_claims()
        .then(|| finish_statement(&execution, response));
    let Some(Some(sql)) = statement else {
        let stored = complete_on(execution, tx.connection(), response).await;
        return tx.commit_after(stored).await;
    };
    match sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut **tx.connection())
        .await
    {
        Ok(_) => {
            tx.committed_and_rebegun();
            Finish::Committed
        }
        Err(sqlx::Error::Database(db)) => {
            let lost = db.code().as_deref() == Some(code::LOST_CLAIM);
            let aborted = db.code().as_deref() == Some(code::IN_FAILED_TRANSACTION);
            if !(lost || aborted) {
                // A failed COMMIT (a deferred constraint, a serialization
                // failure) leaves no transaction to roll back: rather than
                // reason about the driver's count, close the connection.
                tx.discard();
            }
            // Dropping `tx` otherwise rolls the aborted transaction back.
            Finish::NotStored(if lost {
                StoreError::LostClaim {
                    generation: execution.generation,
                }
            } else {
                StoreError::Database(sqlx::Error::Database(db))
            })
        }
        Err(e) => {
            tx.discard();
            Finish::Unknown(e.into())
        }
    }
}

/// `SELECT idem_finish(..); COMMIT; BEGIN` for `execution` and `response`, or
/// `None` when a value cannot be written as a literal.
fn finish_statement(execution: &Execution, response: &StoredResponse) -> Option<String> {
    let headers = serde_json::to_string(&response.headers).ok()?;
    let mut sql = String::with_capacity(300 + headers.len() + 2 * response.body.len());
    sql.push_str("SELECT idem_finish(");
    push_text(&mut sql, &execution.tenant)?;
    sql.push_str(", ");
    push_text(&mut sql, &execution.operation)?;
    sql.push_str(", ");
    push_bytea(&mut sql, execution.key.as_bytes());
    sql.push_str(", ");
    push_int(&mut sql, execution.generation);
    sql.push_str(", '");
    sql.push_str(response.state());
    sql.push_str("', ");
    push_int(&mut sql, i64::from(response.status));
    sql.push_str("::smallint, ");
    push_text(&mut sql, &headers)?;
    sql.push_str("::jsonb, ");
    push_bytea(&mut sql, &response.body);
    sql.push_str(", ");
    push_int(&mut sql, millis(execution.retention));
    sql.push_str("); COMMIT; BEGIN");
    Some(sql)
}
