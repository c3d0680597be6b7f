//! The handler's path on PostgreSQL: one row per execution, written once, by
//! the statement that also claims the key.
//!
//! ```text
//! SELECT .. FROM idempotency_requests WHERE <key>          prepared, outside any transaction
//! BEGIN ISOLATION LEVEL READ COMMITTED; SELECT set_config(..), set_config(..)   one message, no key in it
//! ... the handler's statements ...
//! INSERT INTO idempotency_requests .. ON CONFLICT .. DO UPDATE .. WHERE <expired> RETURNING generation
//! COMMIT
//! ```
//!
//! * **The lookup** answers every retry of a finished key (replay, or `422`) with
//!   one prepared statement and no transaction: a retry never runs the handler,
//!   whatever the handler would answer now.
//! * **The claim is the completion.** The finished row is inserted beside the
//!   effect, in the handler's transaction, so a first execution writes idem's row
//!   once (no claim row updated at completion: one heap tuple, one set of index
//!   entries). The primary key is the lock: a concurrent duplicate that gets to
//!   its own insert first waits there for the holder's transaction (bounded by the
//!   in-flight wait, set as `lock_timeout` by the insert itself), then finds the
//!   key taken and rolls back its whole transaction, effect included, and answers
//!   what the holder stored. Only a finished row past its retention is taken over
//!   (`DO UPDATE .. WHERE`); a leased execution's row never is.
//! * **Bound parameters only**: keys (their digests) and fingerprints never
//!   travel as SQL text, and nothing raises an error to say "replay".
//!
//! The price, said in ARCHITECTURE.md: a duplicate on another process that
//! arrives while the first is still running its handler runs its own handler too,
//! and that transaction rolls back. With [`Idem::with_claims_at_commit`] off, the
//! key is claimed before the handler instead (`idem_claim`, the hand-written
//! path), and the duplicate waits before it runs anything.

use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, SqlSafeStr};

use super::BEGIN_READ_COMMITTED;
use super::transactional::{claim_on, complete_on, stored_from_row};
use crate::db::ClaimContext;
use crate::db::Tx;
use crate::decide::{self, KeySnapshot};
use crate::fingerprint::Fingerprint;
use crate::key::KeyDigest;
use crate::model::{Claim, ClaimRequest, Execution, Finish, StoreError, StoredResponse, millis};

/// Everything the decision needs about a key, in one prepared statement.
const LOOKUP_SQL: &str = "SELECT fingerprint, state, generation, expires_at > now() AS live, \
            response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";

/// The finished row, inserted once, claiming the key. `lock_timeout` is set by
/// the row source, before the insert can wait on a concurrent holder of the key
/// (the handler's own statements ran without it), and given back by `RETURNING`
/// once the row is written, so the `COMMIT` that follows (the handler's deferred
/// constraints and triggers) waits as the transaction did before. The value to
/// give back is kept in `idem.lock_timeout`, transaction-local like the bound.
/// The source's columns are evaluated left to right: saved, then bounded.
const INSERT_SQL: &str = "INSERT INTO idempotency_requests AS r \
            (tenant_id, operation, key_digest, fingerprint, state, generation, response_status, \
             response_headers, response_body, created_at, completed_at, expires_at) \
     SELECT $1, $2, $3, $4, $5, 1, $6, $7, $8, now(), c.t, c.t + $9 * interval '1 millisecond' \
       FROM (SELECT clock_timestamp() AS t, \
                    set_config('idem.lock_timeout', current_setting('lock_timeout'), true) AS saved, \
                    set_config('lock_timeout', $10::text, true) AS bounded) c \
     ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE \
        SET fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, \
            generation = r.generation + 1, response_status = EXCLUDED.response_status, \
            response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body, \
            owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, \
            created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, \
            expires_at = EXCLUDED.expires_at \
      WHERE r.expires_at <= now() AND r.state IN ('completed', 'failed') \
     RETURNING r.generation, set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";

/// PostgreSQL's `lock_not_available`: the insert waited past `lock_timeout`.
const LOCK_TIMEOUT: &str = "55P03";

/// Looks the key up and, unless that answers the request, begins the handler's
/// transaction (see the module docs).
pub(crate) async fn begin_claim(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let mut conn = ctx.pool.acquire().await?;
    let begin = begin_statement(ctx);
    if !ctx.claims_at_commit {
        return claim_first(conn, req, begin).await;
    }
    let snapshot = lookup(
        &mut conn,
        req.tenant,
        req.operation,
        req.key.digest(),
        &req.fingerprint,
    )
    .await?;
    let generation = match decide::transactional(snapshot, req.in_flight_wait) {
        decide::Transactional::Execute { generation } => generation,
        decide::Transactional::Answer(claim) => return Ok((Tx::idle(conn), claim)),
    };
    let tx = Tx::begin_on(conn, begin).await.map_err(|(_, e)| e)?;
    Ok((tx, Claim::Execute(Execution::at_commit(req, generation))))
}

/// `BEGIN` with the request deadline as `statement_timeout` (no statement of the
/// handler's, nor idem's, runs longer) and `idle_in_transaction_session_timeout`
/// (a client that stalls or vanishes mid-transaction has its session ended by
/// the server), one simple-query message. A second longer than the deadline
/// itself: the server's bound is the backstop for a client that vanished, and
/// must not cancel a statement just before the client abandons the request.
/// Both take at most `i32::MAX` milliseconds (about 24.8 days).
fn begin_statement(ctx: &ClaimContext<'_, Postgres>) -> sqlx::SqlStr {
    let deadline = ctx.deadline;
    let ms = millis(deadline.saturating_add(Duration::from_secs(1))).min(i64::from(i32::MAX));
    AssertSqlSafe(format!(
        "{BEGIN_READ_COMMITTED}; SELECT set_config('statement_timeout', '{ms}', true), \
         set_config('idle_in_transaction_session_timeout', '{ms}', true)"
    ))
    .into_sql_str()
}

/// The key as it stands, if it has a row; `fingerprint` is the request's.
async fn lookup(
    conn: &mut PgConnection,
    tenant: &str,
    operation: &str,
    key: KeyDigest,
    fingerprint: &Fingerprint,
) -> Result<Option<KeySnapshot>, StoreError> {
    let row = sqlx::query(LOOKUP_SQL)
        .bind(tenant)
        .bind(operation)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else { return Ok(None) };
    let stored: Vec<u8> = row.try_get("fingerprint")?;
    KeySnapshot::read(
        row.try_get("state")?,
        &stored,
        fingerprint,
        row.try_get("generation")?,
        row.try_get("live")?,
        || stored_from_row(&row),
    )
    .map(Some)
}

/// Claims before the handler runs: `idem_claim` in the transaction, as
/// hand-written callers do, and the `UPDATE` completion.
async fn claim_first(
    conn: PoolConnection<Postgres>,
    req: &ClaimRequest<'_>,
    begin: sqlx::SqlStr,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let mut tx = Tx::begin_on(conn, begin).await.map_err(|(_, e)| e)?;
    let claim = claim_on(tx.connection(), req).await?;
    Ok((tx, claim))
}

/// Stores the outcome, claiming the key with it, and commits (see the module
/// docs). Another execution's hold on the key is [`Finish::Taken`], with what
/// to answer instead.
pub(crate) async fn finish(
    ctx: &ClaimContext<'_, Postgres>,
    mut tx: Tx<Postgres>,
    execution: Execution,
    response: &StoredResponse,
) -> Finish {
    if !execution.at_commit {
        let stored = complete_on(execution, tx.connection(), response).await;
        return tx.commit_after(stored).await;
    }
    let Ok(status) = i16::try_from(response.status) else {
        return Finish::NotStored(StoreError::Corrupt(format!("status {}", response.status)));
    };
    // Milliseconds, lock_timeout's unit: bound as a number, no string built.
    let wait = super::lock_wait_ms(execution.in_flight_wait).max(1);
    let started = Instant::now();
    let inserted = sqlx::query(INSERT_SQL)
        .bind(&execution.tenant)
        .bind(&execution.operation)
        .bind(execution.key)
        .bind(&execution.fingerprint.as_bytes()[..])
        .bind(response.state())
        .bind(status)
        .bind(sqlx::types::Json(&response.headers))
        .bind(&response.body[..])
        .bind(millis(execution.retention))
        .bind(wait)
        .fetch_optional(&mut **tx.connection())
        .await;
    match inserted {
        Ok(Some(_)) => match tx.commit().await {
            Ok(()) => Finish::Committed,
            Err(e) => Finish::Unknown(e.into()),
        },
        Ok(None) => {
            // A finished row that has not expired, or a leased execution's: this
            // execution loses, and answers what the key holds now.
            crate::metrics::claim_waited(execution.operation.clone(), started);
            if let Err(e) = tx.rollback().await {
                return Finish::NotStored(e.into());
            }
            match answer_instead(ctx, &execution).await {
                Ok(claim) => Finish::Taken(claim),
                Err(e) => Finish::NotStored(e),
            }
        }
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(LOCK_TIMEOUT) => {
            crate::metrics::claim_waited(execution.operation.clone(), started);
            drop(tx); // rolls the aborted transaction back
            Finish::Taken(Claim::InFlight {
                retry_after: execution.in_flight_wait.max(Duration::from_secs(1)),
            })
        }
        // The transaction is aborted and COMMIT was never sent: nothing
        // committed. The handler may have run into the winner of a race for
        // the key (its own unique row, say, then answered a 4xx): if another
        // execution finished the key meanwhile, its outcome is the answer.
        Err(e @ sqlx::Error::Database(_)) => {
            if let Err(rollback) = tx.rollback().await {
                return Finish::NotStored(rollback.into());
            }
            match answer_instead(ctx, &execution)
                .await
                .map(decide::answers_instead)
            {
                Ok(Some(claim)) => Finish::Taken(claim),
                _ => Finish::NotStored(e.into()),
            }
        }
        Err(e) => {
            // Where the connection stopped is not known: close it.
            tx.discard();
            Finish::NotStored(e.into())
        }
    }
}

/// What a request that did not commit answers instead of its own outcome, when
/// its key was to be claimed at commit: a finished outcome another execution
/// stored meanwhile (replayed, or `422`), or `None` (its own answer stands).
pub(crate) async fn taken_since(
    ctx: &ClaimContext<'_, Postgres>,
    execution: &Execution,
) -> Result<Option<Claim>, StoreError> {
    if !execution.at_commit {
        return Ok(None);
    }
    Ok(decide::answers_instead(
        answer_instead(ctx, execution).await?,
    ))
}

/// The decision for a key whose execution already ran: what it holds now.
async fn answer_instead(
    ctx: &ClaimContext<'_, Postgres>,
    execution: &Execution,
) -> Result<Claim, StoreError> {
    let mut conn = ctx.pool.acquire().await?;
    let snapshot = lookup(
        &mut conn,
        &execution.tenant,
        &execution.operation,
        execution.key,
        &execution.fingerprint,
    )
    .await?;
    Ok(decide::after_execution(snapshot, execution.in_flight_wait))
}
