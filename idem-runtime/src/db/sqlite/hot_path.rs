//! The handler's path on SQLite: the write lock first, a read under it, and the
//! finished row inserted once.
//!
//! ```text
//! BEGIN IMMEDIATE; SAVEPOINT idem_tx                the database's write lock, through the busy timeout
//! SELECT .. FROM idempotency_requests WHERE <key>   the decision (decide.rs), under the lock
//! ... the handler's statements ...
//! RELEASE idem_tx                                   fails if SQLite ended the transaction meanwhile
//! INSERT INTO idempotency_requests .. ON CONFLICT .. DO UPDATE ..   the finished row, once
//! COMMIT
//! ```
//!
//! The savepoint is how the insert knows it is still in the handler's
//! transaction: SQLite rolls a whole transaction back by itself on a trigger's
//! `RAISE(ROLLBACK)` and on some errors (`SQLITE_FULL`, `SQLITE_IOERR`, ..),
//! after which the connection runs in autocommit. A handler that swallowed
//! such an error would otherwise have idem commit the key's answer alone, for
//! an effect that was undone; the savepoint went with the transaction, its
//! `RELEASE` fails, and nothing is stored (`StoreError::TransactionEnded`).
//! Both statements run in the process, with no round trip.
//!
//! SQLite has one writer at a time, so the transaction takes the write lock at
//! its start and holds it to the end: nobody can change the key between the read
//! and the insert, and the claim writes nothing until the outcome is known (no
//! claim row updated at completion). A replay or a mismatch is answered from the
//! read, and the empty transaction rolls back.
//!
//! The wait for the write lock is the connection's own busy timeout
//! (`SqliteConnectOptions::busy_timeout`, 5 s in sqlx by default), set once per
//! connection by the pool, never read, changed and restored per claim; past it
//! the store is busy (`503` with `Retry-After: 1`). The lock is the whole database's, so that
//! wait is for any writer, not only for a duplicate of the key; duplicates in the
//! same process wait in the waiting room, bounded by the in-flight wait.

use std::time::Duration;

use sqlx::{Row, SqlSafeStr, Sqlite, SqliteConnection};

use super::now_ms;
use crate::db::ClaimContext;
use crate::db::Tx;
use crate::db::rows::stored_from_text;
use crate::db::shared::BindKey;
use crate::db::stores::HandlerPath;
use crate::decide::{self, KeySnapshot, RowState};
use crate::model::{Claim, ClaimRequest, Execution, Finish, StoreError, StoredResponse, millis};

/// The handler's transaction: the write lock, and the savepoint whose
/// `RELEASE` ([`RELEASE_SQL`]) tells the finish it is still in it.
const BEGIN_SQL: &str = "BEGIN IMMEDIATE; SAVEPOINT idem_tx";

/// Fails (`no such savepoint`) where the transaction has ended under the
/// handler; otherwise leaves it as it was, the savepoint merged into it.
const RELEASE_SQL: &str = "RELEASE idem_tx";

/// The key's row, if any, and the database's clock, in one statement.
const LOOKUP_SQL: &str = concat!(
    "SELECT c.now, r.fingerprint, r.state, r.generation, r.expires_at > c.now AS live, \
            r.response_status, r.response_headers, r.response_body \
       FROM (SELECT ",
    now_ms!(),
    " AS now) c \
       LEFT JOIN idempotency_requests r \
         ON r.tenant_id = $1 AND r.operation = $2 AND r.key_digest = $3"
);

/// The finished row. Under the write lock the key cannot have changed since the
/// read: an expired row is replaced at the generation the read decided, and
/// anything else (a handler that wrote idem's table itself) inserts nothing.
const INSERT_SQL: &str = concat!(
    "INSERT INTO idempotency_requests AS r \
        (tenant_id, operation, key_digest, fingerprint, state, generation, response_status, \
         response_headers, response_body, created_at, completed_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, ",
    now_ms!(),
    ", ",
    now_ms!(),
    " + $11) \
     ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE \
        SET fingerprint = excluded.fingerprint, state = excluded.state, \
            generation = excluded.generation, response_status = excluded.response_status, \
            response_headers = excluded.response_headers, response_body = excluded.response_body, \
            owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, \
            created_at = excluded.created_at, completed_at = excluded.completed_at, \
            expires_at = excluded.expires_at \
      WHERE r.generation = excluded.generation - 1 AND r.state IN ('completed', 'failed') \
        AND r.expires_at <= excluded.completed_at"
);

/// The key as it stands, if it has a row, and the database's clock.
async fn lookup(
    conn: &mut SqliteConnection,
    req: &ClaimRequest<'_>,
) -> Result<(Option<KeySnapshot>, i64), StoreError> {
    let row = sqlx::query(LOOKUP_SQL)
        .bind_key(req.tenant, req.operation, req.key.digest())
        .fetch_one(&mut *conn)
        .await?;
    let now: i64 = row.try_get("now")?;
    let state: Option<RowState> = row.try_get("state")?;
    let Some(state) = state else {
        return Ok((None, now));
    };
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let snapshot = KeySnapshot::read(
        state,
        &fingerprint,
        &req.fingerprint,
        row.try_get("generation")?,
        row.try_get("live")?,
        || stored_from_text(&row),
    )?;
    Ok((Some(snapshot), now))
}

/// The handler's path; the claim and the completion in the caller's
/// transaction are `transactional`'s.
impl HandlerPath for Sqlite {
    /// Begins the handler's transaction with the write lock, reads the key and
    /// decides (see the module docs).
    async fn begin_claim(
        ctx: &ClaimContext<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> Result<(Tx<Self>, Claim), StoreError> {
        let conn = ctx.pool.acquire().await?;
        let started = std::time::Instant::now();
        let begun = Tx::begin_on(conn, SqlSafeStr::into_sql_str(BEGIN_SQL)).await;
        // An uncontended BEGIN IMMEDIATE takes microseconds: a millisecond or more
        // is a wait for another writer, recorded as the other databases record theirs.
        let waited = started.elapsed();
        if waited >= Duration::from_millis(1) {
            crate::metrics::seconds(
                crate::metrics::CLAIM_WAIT_SECONDS,
                req.operation.to_owned(),
                waited.as_secs_f64(),
            );
        }
        let mut tx = match begun {
            Ok(tx) => tx,
            // Another writer kept the database past the busy timeout.
            Err((conn, e)) if super::is_busy(&e) => {
                return Ok((
                    Tx::idle(conn),
                    Claim::Busy {
                        retry_after: super::BUSY_RETRY_AFTER,
                    },
                ));
            }
            Err((mut conn, e)) => {
                // Where the `BEGIN IMMEDIATE` went through and the `SAVEPOINT`
                // did not (out of memory), the connection holds a transaction
                // sqlx does not count: closed, not pooled.
                conn.close_on_drop();
                return Err(e.into());
            }
        };
        let (snapshot, now) = lookup(tx.connection(), req).await?;
        match decide::transactional(snapshot, req.in_flight_wait) {
            decide::TransactionalStep::Execute { generation } => {
                let mut execution = Execution::at_commit(req, generation);
                execution.started_ms = now;
                Ok((tx, Claim::Execute(execution)))
            }
            // Dropping `tx` rolls the empty transaction back.
            decide::TransactionalStep::Answer(claim) => Ok((tx, claim)),
        }
    }

    /// Inserts the finished row and commits.
    async fn finish(
        _: &ClaimContext<'_, Self>,
        mut tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> Finish {
        let headers = match serde_json::to_string(&response.headers) {
            Ok(h) => h,
            Err(e) => return Finish::NotStored(StoreError::Corrupt(e.to_string())),
        };
        match sqlx::query(RELEASE_SQL)
            .execute(&mut **tx.connection())
            .await
        {
            Ok(_) => {}
            // Dropping `tx` ends sqlx's count of the transaction SQLite ended.
            Err(e) if is_no_such_savepoint(&e) => {
                return Finish::NotStored(StoreError::TransactionEnded);
            }
            Err(e) => return Finish::NotStored(e.into()),
        }
        let inserted = sqlx::query(INSERT_SQL)
            .bind_key(&execution.tenant, &execution.operation, execution.key)
            .bind(&execution.fingerprint.as_bytes()[..])
            .bind(response.state())
            .bind(execution.generation)
            .bind(i64::from(response.status))
            .bind(headers)
            .bind(&response.body[..])
            .bind(execution.started_ms)
            .bind(millis(execution.retention))
            .execute(&mut **tx.connection())
            .await;
        match inserted {
            Ok(done) if done.rows_affected() == 1 => tx.commit_stored().await,
            // Dropping `tx` rolls back: nothing of this execution commits.
            Ok(_) => Finish::NotStored(StoreError::LostClaim {
                generation: execution.generation,
            }),
            Err(e) => Finish::NotStored(e.into()),
        }
    }
}

/// SQLite's answer to `RELEASE` of a savepoint that is not there.
fn is_no_such_savepoint(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.message().starts_with("no such savepoint"))
}
