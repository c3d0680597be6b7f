//! What PostgreSQL's and MySQL's handler paths share, where the key is claimed
//! by the finished row at commit: the answer of an execution whose transaction
//! did not commit its own row.
//!
//! A read here dropped half-way (the request's deadline on a connection cut
//! without a word) closes its connection rather than give it back to the pool,
//! where its release ping would wait, with no bound, for an answer that is
//! not coming, and hold a slot of the pool while it does.

use std::future::Future;

use sqlx::Database;
use sqlx::pool::PoolConnection;

use crate::db::ClaimContext;
use crate::db::tx::ClosedIfDropped;
use crate::decide::{self, KeySnapshot};
use crate::fingerprint::Fingerprint;
use crate::key::KeyDigest;
use crate::model::{Claim, ClaimRequest, Execution, StoreError};

/// A database whose handler path claims the key at commit: how it reads the
/// key's row for a decision.
pub(crate) trait KeyLookup: Database {
    /// The key as it stands, if it has a row; `fingerprint` is the request's.
    fn lookup<'c>(
        conn: &'c mut Self::Connection,
        tenant: &'c str,
        operation: &'c str,
        key: KeyDigest,
        fingerprint: &'c Fingerprint,
    ) -> impl Future<Output = Result<Option<KeySnapshot>, StoreError>> + Send + 'c;
}

/// The handler path's first step where the key is claimed at commit: `req`'s
/// key looked up on `conn`, outside any transaction, and the claim decided on
/// it. The connection comes back with the decision.
pub(crate) async fn decide_claim<DB: KeyLookup>(
    conn: PoolConnection<DB>,
    req: &ClaimRequest<'_>,
) -> Result<(PoolConnection<DB>, decide::TransactionalStep), StoreError> {
    let mut conn = ClosedIfDropped::new(conn);
    let snapshot = DB::lookup(
        conn.conn(),
        req.tenant,
        req.operation,
        req.key.digest(),
        &req.fingerprint,
    )
    .await;
    let conn = conn.release();
    Ok((conn, decide::transactional(snapshot?, req.in_flight_wait)))
}

/// What a request that did not commit answers instead of its own outcome, when
/// its key was to be claimed at commit: a finished outcome another execution
/// stored meanwhile (replayed, or `422`), or `None` (its own answer stands).
pub(crate) async fn taken_since<DB: KeyLookup>(
    ctx: &ClaimContext<'_, DB>,
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
pub(crate) async fn answer_instead<DB: KeyLookup>(
    ctx: &ClaimContext<'_, DB>,
    execution: &Execution,
) -> Result<Claim, StoreError> {
    let mut conn = ClosedIfDropped::new(ctx.pool.acquire().await?);
    let snapshot = DB::lookup(
        conn.conn(),
        &execution.tenant,
        &execution.operation,
        execution.key,
        &execution.fingerprint,
    )
    .await;
    drop(conn.release());
    Ok(decide::after_execution(snapshot?, execution.in_flight_wait))
}
