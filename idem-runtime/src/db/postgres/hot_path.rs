//! The handler's path on PostgreSQL: one row per execution, written once, by
//! the statement that also claims the key, in the round trips of the handler's
//! own transaction.
//!
//! Where each connection keeps its server session (no pooler, or session
//! pooling: see [`super::session`]), idem's statements ride with `BEGIN` and
//! `COMMIT`:
//!
//! ```text
//! BEGIN ISOLATION LEVEL READ COMMITTED; EXECUTE idem_probe_3(<key>, <deadline>)
//!                                                          one message: fails if the key has a row
//! ... the handler's statements ...
//! EXECUTE idem_insert_1(<row>); COMMIT AND CHAIN           one message: fails if the key was taken
//! ```
//!
//! A new key's finished row is a plain insert (`idem_insert_1`): the probe saw
//! no row, so there is none to take over, and a row another execution wrote
//! since is a unique violation. A key whose expired row is taken over finishes
//! with `idem_finish_2`, the insert with `ON CONFLICT .. DO UPDATE .. WHERE
//! <expired>`, which fails when it claimed nothing. The takeover binds the
//! execution's generation (the new key's insert writes 1): an expired row swept
//! between the lookup and the insert leaves a plain insert at that generation,
//! so the row holds the generation the execution's answer (sealed, it is bound
//! to it) was made for.
//!
//! A new key, the common case, costs no round trip of idem's own. A key that has
//! a row makes the first message fail (the transaction is then aborted, nothing
//! has run): the driver queues its `ROLLBACK` of the failed `BEGIN` (sqlx 0.9.1
//! on), and the key is read (the prepared lookup with bound parameters, as
//! on the path below) on another connection idle in the pool while the failed
//! one goes back with that `ROLLBACK` (`after_probe`): one more round trip, or
//! two where none is idle (the read then waits for the `ROLLBACK`); a retry of
//! a finished key is answered from that, as below. A key this process has seen
//! finished lately (`crate::recent`) is read first instead, the same lookup
//! alone, on an idle connection taken without the pool's acquire ping
//! (`begin_remembered` says why that is safe): its retry waits for one round trip
//! and no failed probe, and the lookup decides as after a probe. With
//! `Idem::with_checkout_test(false)` a first execution's connection is taken the
//! same way, and its first message is the pool's test (`begin_in_session`):
//! three round trips on its path, not four. So is it from a pool that does not
//! ping its checkouts (`test_before_acquire(false)`), whose `before_acquire`
//! still runs: a connection its first message finds dropped is closed and the
//! claim begins on another (`Checkout::Untested`).
//! The probe
//! also sets the request deadline (`statement_timeout`,
//! `idle_in_transaction_session_timeout`). `AND CHAIN` opens an empty transaction
//! whose `ROLLBACK` the driver sends with the connection's release (see
//! `Tx::committed_by_message`): sqlx counts the transaction it began, and only
//! its rollback brings the count back without a message of its own.
//!
//! Elsewhere (a pooler that keeps only protocol-level prepared statements), each
//! of idem's statements is sent with bound parameters:
//!
//! ```text
//! SELECT .. FROM idempotency_requests WHERE <key>          prepared, outside any transaction
//! BEGIN ISOLATION LEVEL READ COMMITTED; SELECT set_config(..), set_config(..)   one message, no key in it
//! ... the handler's statements ...
//! INSERT INTO idempotency_requests ..   (a new key; for an expired row: .. ON CONFLICT .. DO UPDATE .. WHERE <expired>)
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
//! * **Values that cannot inject**: on the bound-parameter path nothing travels
//!   as SQL text; on the session path the probe's and the finished row's
//!   values travel only in the encodings of [`super::session`] (text as `E'..'`
//!   with quotes and backslashes doubled, bytes as hex, numbers formatted from
//!   integers), and a key's read binds its values.
//!
//! The price, said in ARCHITECTURE.md: a duplicate on another process that
//! arrives while the first is still running its handler runs its own handler too,
//! and that transaction rolls back. With
//! [`Idem::with_claims_at_commit`](crate::Idem::with_claims_at_commit) off, the
//! key is claimed before the handler instead (`idem_claim`, the hand-written
//! path), and the duplicate waits before it runs anything.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, SqlSafeStr};

use super::BEGIN_READ_COMMITTED;
use super::session::{self, bytea_literal, text_literal};
use super::transactional::stored_from_row;
use crate::db::ClaimContext;
use crate::db::Tx;
use crate::db::at_commit::{self, KeyLookup};
use crate::db::shared::BindKey;
use crate::db::stores::{Claims, HandlerPath};
use crate::db::tx::ClosedIfDropped;
use crate::decide::{self, KeySnapshot};
use crate::fingerprint::Fingerprint;
use crate::key::KeyDigest;
use crate::model::{Claim, ClaimRequest, Execution, Finish, StoreError, StoredResponse, millis};

/// Everything the decision needs about a key, in one prepared statement.
const LOOKUP_SQL: &str = "SELECT fingerprint, state, generation, expires_at > now() AS live, \
            response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";

/// The finished row, inserted once, claiming the key, or taking over an
/// expired finished row (see `finished_row_insert!` for the bounded wait).
const INSERT_SQL: &str = concat!(
    finished_row_insert!("$11"),
    take_over_expired!(),
    " RETURNING ",
    restore_lock_timeout!()
);

/// [`INSERT_SQL`] for a key the lookup found no row for (a new key, the common
/// case): a plain insert, without the conflict arbiter, whose unique violation
/// ([`session::is_key_taken`]) means that another execution claimed the key
/// meanwhile.
const INSERT_NEW_SQL: &str = concat!(
    finished_row_insert!("1"),
    " RETURNING ",
    restore_lock_timeout!()
);

/// How a claim's connection left the pool.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Checkout {
    /// Through `acquire()`, from a pool that pings its checkouts: the ping and
    /// `before_acquire` saw it.
    Tested,
    /// Idle, as it was (`Idem::with_checkout_test(false)`), or through
    /// `acquire()` from a pool that does not ping (`test_before_acquire(false)`:
    /// only its `before_acquire` saw it): the claim's first message is its
    /// test.
    Untested,
}

impl Checkout {
    /// A connection `acquire()` gave: tested only where the pool pings it.
    fn acquired(pool: &sqlx::PgPool) -> Self {
        if pool.options().get_test_before_acquire() {
            Checkout::Tested
        } else {
            Checkout::Untested
        }
    }

    /// How many untested connections found dropped a claim closes before it
    /// gives up: a pool that does not ping may hand out every idle connection
    /// dropped (after a server restart, all of them), and by one more than
    /// the pool holds `acquire()` has opened a new one.
    fn most_lost(pool: &sqlx::PgPool) -> u32 {
        pool.options().get_max_connections().saturating_add(1)
    }
}

/// The session path's claim (see the module docs): `BEGIN` with the probe; a
/// key with a row is looked up and decided as on the other path.
///
/// On an untested connection the first message is the pool's test too: it
/// reads the key and changes nothing, so where it finds the connection lost
/// (what the ping is there to find) the connection is closed and the claim
/// begins again on one from `acquire()`, with nothing run twice. Any other
/// failure is the claim's, as on a tested connection.
async fn begin_in_session(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
    mut conn: PoolConnection<Postgres>,
    mut checkout: Checkout,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let probe = || -> Result<sqlx::SqlStr, StoreError> {
        let mut begin = String::from(BEGIN_READ_COMMITTED);
        begin.push_str("; EXECUTE ");
        begin.push_str(session::PROBE);
        push_key(&mut begin, req.tenant, req.operation, req.key.digest())?;
        begin.pop(); // the key's closing parenthesis: the deadline goes on
        begin.push_str(", '");
        let _ = write!(begin, "{}", deadline_ms(ctx));
        begin.push_str("')");
        Ok(AssertSqlSafe(begin).into_sql_str())
    };
    let mut prepared = false;
    let mut lost = 0;
    loop {
        // Built anew for the second attempt (a session prepared just now)
        // rather than copied for every first one.
        let e = match Tx::begin_on(conn, probe()?).await {
            Ok(tx) => return Ok((tx, Claim::Execute(in_session(req, 1)))),
            Err((returned, e)) => {
                conn = returned;
                e
            }
        };
        if session::is_marker(&e, session::PROBE_MARKER) {
            return after_probe(ctx, req, conn).await;
        }
        if checkout == Checkout::Untested
            && lost_connection(&e)
            && lost < Checkout::most_lost(ctx.pool)
        {
            tracing::debug!(
                error = %e,
                "idem: a claim's untested connection was lost; beginning on another"
            );
            conn.close_on_drop();
            drop(conn);
            conn = ctx.pool.acquire().await?;
            checkout = Checkout::acquired(ctx.pool);
            lost += 1;
            // A session of its own, which may not have met idem yet either.
            prepared = false;
            continue;
        }
        // The message failed after `BEGIN` (or in it): the driver's queued
        // `ROLLBACK` goes now, before the connection is used or given back.
        conn = end_failed_begin(conn).await?;
        if prepared || !session::is_missing_statement(&e) {
            return Err(e.into());
        }
        // A session that has not met idem yet (or lost its statements): prepare
        // them, once, and begin again. Failing, or dropped half-way, the
        // connection is closed.
        let mut held = ClosedIfDropped::new(conn);
        session::prepare(held.conn()).await?;
        conn = held.release();
        prepared = true;
    }
}

/// The probe found a row: the key is read and decided, without a second probe.
///
/// The probe's connection has the driver's `ROLLBACK` of the failed `BEGIN`
/// queued, and sqlx sends nothing after a queued message until its answer is
/// in: a read there waits for two round trips. So where a connection is idle in
/// the pool, the key is read on it, taken as it is (safe for a read, as
/// `begin_remembered` says), and the probe's connection goes back to the pool,
/// its `ROLLBACK` riding with the release ping off the request's path: a retry
/// that reaches a process without the key's hint waits for the probe and the
/// read. Where the key is to be executed (its row expired), the read's
/// connection goes back and the transaction begins on the probe's, which the
/// pool tested where the checkout test is on (its `ROLLBACK` goes first). With
/// no connection idle, or one that turns out dropped, or where no connection
/// is to be taken untested (replay hints off and the checkout test on), the key
/// is read on the probe's connection, after the `ROLLBACK`.
async fn after_probe(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
    conn: PoolConnection<Postgres>,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    // Where every checkout must be tested (replay hints off, the checkout test
    // on: the pool's `before_acquire` sees each connection idem uses), the key
    // is read here.
    let untested_reads = ctx.recent.is_some() || !ctx.checkout_test;
    if untested_reads && let Some(idle) = ctx.pool.try_acquire() {
        match read_key(idle, req).await {
            Ok((idle, snapshot)) => {
                return match decide::transactional(snapshot, req.in_flight_wait) {
                    decide::TransactionalStep::Answer(claim) => {
                        drop(conn);
                        Ok(answered(ctx, req, idle, claim))
                    }
                    decide::TransactionalStep::Execute { generation } => {
                        drop(idle);
                        begin_decided(ctx, req, conn, generation).await
                    }
                };
            }
            // An error the server answered (or idem's own) would be the same
            // on the probe's connection.
            Err(e) if !connection_lost(&e) => return Err(e),
            Err(e) => tracing::debug!(
                error = %e,
                "idem: a key's read after the probe lost its idle connection; reading it on the probe's"
            ),
        }
    }
    let (conn, snapshot) = read_key(conn, req).await?;
    decided(ctx, req, conn, snapshot).await
}

/// An execution on the session path at `generation`.
fn in_session(req: &ClaimRequest<'_>, generation: i64) -> Execution {
    Execution {
        in_session: true,
        ..Execution::at_commit(req, generation)
    }
}

/// Whether this process has seen the request's key finished lately
/// (`Idem::with_replay_hints`).
fn remembered(ctx: &ClaimContext<'_, Postgres>, req: &ClaimRequest<'_>) -> bool {
    ctx.recent
        .is_some_and(|r| r.seen_finished(req.tenant, req.operation, &req.key.digest()))
}

/// A key this process has seen finished lately: read first, so that its retry
/// costs one message and no failed probe.
///
/// The read takes an idle connection as it is (`Pool::try_acquire`: no
/// acquire ping, no `before_acquire`), so that a replay waits for one round
/// trip, not two. That is safe for a read: where the connection turns out
/// dropped (what the ping is there to find), or none is idle, the key is read
/// on a connection from `acquire()` (`read_acquired`); a read that
/// stalls is bounded by the request's deadline, and its connection closed
/// (`read_key`). Only an answer is decided on the untested connection;
/// where the key is to be executed (its row expired, swept or purged since),
/// the connection goes back and the claim begins on one from `acquire()`,
/// with the probe (which reads the key again); without the checkout test
/// (`Idem::with_checkout_test(false)`) it begins on the connection the read
/// just used.
async fn begin_remembered(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    if let Some(conn) = ctx.pool.try_acquire() {
        match read_key(conn, req).await {
            Ok((conn, snapshot)) => match decide::transactional(snapshot, req.in_flight_wait) {
                decide::TransactionalStep::Answer(claim) => {
                    return Ok(answered(ctx, req, conn, claim));
                }
                // Without the checkout test, the read was the connection's test.
                decide::TransactionalStep::Execute { .. } if !ctx.checkout_test => {
                    return begin_in_session(ctx, req, conn, Checkout::Untested).await;
                }
                decide::TransactionalStep::Execute { .. } => {
                    drop(conn);
                    let conn = ctx.pool.acquire().await?;
                    let checkout = Checkout::acquired(ctx.pool);
                    return begin_in_session(ctx, req, conn, checkout).await;
                }
            },
            // An error the server answered (or idem's own) would be the same
            // on another connection.
            Err(e) if !connection_lost(&e) => return Err(e),
            Err(e) => tracing::debug!(
                error = %e,
                "idem: a remembered key's read lost its idle connection; reading it on one from acquire()"
            ),
        }
    }
    let (conn, snapshot) = read_acquired(ctx, req).await?;
    match decide::transactional(snapshot, req.in_flight_wait) {
        decide::TransactionalStep::Answer(claim) => Ok(answered(ctx, req, conn, claim)),
        // With the probe, which prepares a session that lacks idem's statements
        // (the read needed none) and reads the key again.
        decide::TransactionalStep::Execute { .. } => {
            let checkout = Checkout::acquired(ctx.pool);
            begin_in_session(ctx, req, conn, checkout).await
        }
    }
}

/// The key read on a connection from `acquire()`. From a pool that does not
/// ping its checkouts, a connection the read finds dropped is closed
/// (`read_key` closes a connection whose read failed) and the read made on
/// another, as [`begin_in_session`] does.
async fn read_acquired(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
) -> Result<(PoolConnection<Postgres>, Option<KeySnapshot>), StoreError> {
    let mut lost = 0;
    loop {
        let conn = ctx.pool.acquire().await?;
        match read_key(conn, req).await {
            Err(e)
                if connection_lost(&e)
                    && Checkout::acquired(ctx.pool) == Checkout::Untested
                    && lost < Checkout::most_lost(ctx.pool) =>
            {
                tracing::debug!(error = %e, "idem: a key's read lost its untested connection; reading it on another");
                lost += 1;
            }
            read => return read,
        }
    }
}

/// Whether `e` says the connection was lost (what the pool's acquire ping
/// finds) rather than that the server refused the statement: the I/O or the
/// protocol failed, or the server ended the session (`08xxx`, or
/// `57P01`–`57P03`: an administrator's termination, a crash, a server
/// starting up; `57P05`: a session idle longer than the server's
/// `idle_session_timeout`).
fn connection_lost(e: &StoreError) -> bool {
    matches!(e, StoreError::Database(e) if lost_connection(e))
}

/// [`connection_lost`], of the driver's error.
fn lost_connection(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03" | "57P05")
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// An answer decided without a transaction; a key replayed is remembered for
/// its next retry.
fn answered(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
    conn: PoolConnection<Postgres>,
    claim: Claim,
) -> (Tx<Postgres>, Claim) {
    // A mismatch is left out: it is decided before the row's state, which may
    // be an execution still in flight.
    if matches!(claim, Claim::Replay(_)) {
        remember(ctx, req.tenant, req.operation, &req.key.digest());
    }
    (Tx::idle(conn), claim)
}

/// Decides the claim from what the lookup read: an answer without a
/// transaction, or the handler's transaction begun (the request deadline with
/// `BEGIN`, no probe: the key was just read). A `BEGIN` message that fails is
/// rolled back before the connection goes back (it may have failed after
/// `BEGIN`).
async fn decided(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
    conn: PoolConnection<Postgres>,
    snapshot: Option<KeySnapshot>,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    match decide::transactional(snapshot, req.in_flight_wait) {
        decide::TransactionalStep::Answer(claim) => Ok(answered(ctx, req, conn, claim)),
        decide::TransactionalStep::Execute { generation } => {
            begin_decided(ctx, req, conn, generation).await
        }
    }
}

/// Begins the handler's transaction for a key just read and decided to
/// execute at `generation` (see [`decided`]).
async fn begin_decided(
    ctx: &ClaimContext<'_, Postgres>,
    req: &ClaimRequest<'_>,
    conn: PoolConnection<Postgres>,
    generation: i64,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let tx = begun(Tx::begin_on(conn, begin_statement(ctx)).await).await?;
    Ok((tx, Claim::Execute(in_session(req, generation))))
}

/// Records that the key has a finished row, where hints are kept.
fn remember(ctx: &ClaimContext<'_, Postgres>, tenant: &str, operation: &str, key: &KeyDigest) {
    if let Some(recent) = ctx.recent {
        recent.finished(tenant, operation, key);
    }
}

/// Reads the key with the driver's prepared lookup ([`LOOKUP_SQL`]: bound
/// parameters, binary results, outside any transaction): first, for a key this
/// process has seen finished; after a failed probe, on an idle connection or on
/// the probe's once the driver's queued `ROLLBACK` has gone. A protocol-level
/// statement rather than the session's: it needs no session statement, and
/// the stored body comes back as it is where the simple-query protocol's text
/// doubled it as hex (a replay's PostgreSQL time, BENCHMARKS.md). A read that
/// fails closes the connection, as does dropping it half-way (the request's
/// deadline on a stalled connection): given back, it would hold its slot of
/// the pool for as long as its release ping waits for an answer that is not
/// coming. A row read whole but not readable by idem fails the request and
/// leaves the connection as it was.
async fn read_key(
    conn: PoolConnection<Postgres>,
    req: &ClaimRequest<'_>,
) -> Result<(PoolConnection<Postgres>, Option<KeySnapshot>), StoreError> {
    let mut conn = ClosedIfDropped::new(conn);
    let row = fetch_key(conn.conn(), req.tenant, req.operation, req.key.digest()).await?;
    // The answer is in: the connection is as it was, whatever the row holds
    // (a row idem cannot read fails the request, not the connection).
    let conn = conn.release();
    let snapshot = row
        .map(|row| snapshot_of(&row, &req.fingerprint))
        .transpose()?;
    Ok((conn, snapshot))
}

/// The key's row, if it has one ([`LOOKUP_SQL`]).
async fn fetch_key(
    conn: &mut PgConnection,
    tenant: &str,
    operation: &str,
    key: KeyDigest,
) -> Result<Option<sqlx::postgres::PgRow>, sqlx::Error> {
    sqlx::query(LOOKUP_SQL)
        .bind_key(tenant, operation, key)
        .fetch_optional(conn)
        .await
}

/// The key as [`LOOKUP_SQL`]'s row has it; `fingerprint` is the request's.
fn snapshot_of(
    row: &sqlx::postgres::PgRow,
    fingerprint: &Fingerprint,
) -> Result<KeySnapshot, StoreError> {
    let stored: &[u8] = row.try_get("fingerprint")?;
    KeySnapshot::read(
        row.try_get("state")?,
        stored,
        fingerprint,
        row.try_get("generation")?,
        row.try_get("live")?,
        || stored_from_row(row),
    )
}

/// Sends the `ROLLBACK` the driver queued when a `BEGIN` message failed, and
/// waits for it (sqlx's ping: a sync after the queued message). idem sends no
/// `ROLLBACK` of its own there: the server would find no transaction to end and
/// log a warning. Failing, or dropped half-way (the request's deadline on a
/// connection cut without a word), the connection is closed rather than given
/// back to wait in the pool's release ping, which has no bound.
async fn end_failed_begin(
    conn: PoolConnection<Postgres>,
) -> Result<PoolConnection<Postgres>, sqlx::Error> {
    let mut held = ClosedIfDropped::new(conn);
    sqlx::Connection::ping(&mut **held.conn()).await?;
    Ok(held.release())
}

/// A `BEGIN`'s outcome: its transaction, or its error once the connection
/// is through [`end_failed_begin`] (back to the pool, or closed).
async fn begun(
    begun: Result<Tx<Postgres>, (PoolConnection<Postgres>, sqlx::Error)>,
) -> Result<Tx<Postgres>, sqlx::Error> {
    match begun {
        Ok(tx) => Ok(tx),
        Err((conn, e)) => {
            let _ = end_failed_begin(conn).await;
            Err(e)
        }
    }
}

/// `(<tenant>, <operation>, <key digest>)` as the session statements take them.
fn push_key(
    sql: &mut String,
    tenant: &str,
    operation: &str,
    key: KeyDigest,
) -> Result<(), StoreError> {
    sql.push('(');
    text_literal(sql, tenant)?;
    sql.push_str(", ");
    text_literal(sql, operation)?;
    sql.push_str(", ");
    bytea_literal(sql, key.as_bytes());
    sql.push(')');
    Ok(())
}

/// `BEGIN` with the request deadline as `statement_timeout` (no statement of the
/// handler's, nor idem's, runs longer) and `idle_in_transaction_session_timeout`
/// (a client that stalls or vanishes mid-transaction has its session ended by
/// the server), one simple-query message. A second longer than what is left of
/// the deadline (the waiting room and the pool's wait took the rest): the
/// server's bound is the backstop for a client that vanished, and must not
/// cancel a statement just before the client abandons the request.
/// Both take at most `i32::MAX` milliseconds (about 24.8 days).
fn begin_statement(ctx: &ClaimContext<'_, Postgres>) -> sqlx::SqlStr {
    AssertSqlSafe(begin_text(ctx)).into_sql_str()
}

/// The request deadline as the server bounds it: a second longer than what
/// is left of the client's, in milliseconds (see [`begin_statement`]).
fn deadline_ms(ctx: &ClaimContext<'_, Postgres>) -> i64 {
    let left = ctx.ends_at.map_or(ctx.deadline, |at| {
        at.saturating_duration_since(tokio::time::Instant::now())
    });
    millis(left.saturating_add(Duration::from_secs(1))).min(i64::from(i32::MAX))
}

/// The text of [`begin_statement`].
fn begin_text(ctx: &ClaimContext<'_, Postgres>) -> String {
    let ms = deadline_ms(ctx);
    format!(
        "{BEGIN_READ_COMMITTED}; SELECT set_config('statement_timeout', '{ms}', true), \
         set_config('idle_in_transaction_session_timeout', '{ms}', true)"
    )
}

/// The handler's path; the claim and the completion in the caller's
/// transaction are `transactional`'s.
impl HandlerPath for Postgres {
    /// Looks the key up and, unless that answers the request, begins the handler's
    /// transaction (see the module docs).
    async fn begin_claim(
        ctx: &ClaimContext<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> Result<(Tx<Self>, Claim), StoreError> {
        let in_session = ctx.claims_at_commit
            && session::uses_session_statements(ctx.pool, ctx.session_statements, ctx.session_path)
                .await;
        if in_session && remembered(ctx, req) {
            return begin_remembered(ctx, req).await;
        }
        if in_session
            && !ctx.checkout_test
            && let Some(conn) = ctx.pool.try_acquire()
        {
            return begin_in_session(ctx, req, conn, Checkout::Untested).await;
        }
        let conn = ctx.pool.acquire().await?;
        if in_session {
            return begin_in_session(ctx, req, conn, Checkout::acquired(ctx.pool)).await;
        }
        let begin = begin_statement(ctx);
        if !ctx.claims_at_commit {
            return claim_first(conn, req, begin).await;
        }
        let (conn, step) = at_commit::decide_claim::<Postgres>(conn, req).await?;
        let generation = match step {
            decide::TransactionalStep::Execute { generation } => generation,
            decide::TransactionalStep::Answer(claim) => return Ok((Tx::idle(conn), claim)),
        };
        let tx = begun(Tx::begin_on(conn, begin).await).await?;
        Ok((tx, Claim::Execute(Execution::at_commit(req, generation))))
    }

    /// Stores the outcome, claiming the key with it, and commits (see the module
    /// docs). Another execution's hold on the key is [`Finish::Taken`], with what
    /// to answer instead.
    async fn finish(
        ctx: &ClaimContext<'_, Self>,
        mut tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> Finish {
        if !execution.at_commit {
            let stored = Postgres::complete(execution, tx.connection(), response)
                .await
                .map_err(|e| match e {
                    StoreError::Database(e) => super::store_error(e),
                    e => e,
                });
            return tx.commit_after(stored).await;
        }
        let Ok(status) = i16::try_from(response.status) else {
            return Finish::NotStored(StoreError::Corrupt(format!("status {}", response.status)));
        };
        // Milliseconds, lock_timeout's unit.
        let wait = super::lock_wait_ms(execution.in_flight_wait).max(1);
        let started = Instant::now();
        if execution.in_session {
            return finish_in_session(ctx, tx, execution, response, status, wait, started).await;
        }
        // Generation 1: the lookup found no row, so no row is there to take over
        // (and the plain insert writes 1); a takeover binds the generation.
        let new_key = execution.generation == 1;
        let row = sqlx::query(if new_key { INSERT_NEW_SQL } else { INSERT_SQL })
            .bind_key(&execution.tenant, &execution.operation, execution.key)
            .bind(&execution.fingerprint.as_bytes()[..])
            .bind(response.state())
            .bind(status)
            .bind(sqlx::types::Json(&response.headers))
            .bind(&response.body[..])
            .bind(kept_for_ms(&execution, wait))
            .bind(wait);
        let inserted = if new_key {
            row
        } else {
            row.bind(execution.generation)
        }
        .fetch_optional(&mut **tx.connection())
        .await;
        match inserted {
            Ok(Some(_)) => tx.commit_stored().await,
            // A finished row that has not expired, or a leased execution's: this
            // execution loses, and answers what the key holds now.
            Ok(None) => lost(ctx, tx, &execution, started).await,
            Err(e) if session::is_key_taken(&e) => lost(ctx, tx, &execution, started).await,
            Err(e) => not_inserted(ctx, tx, &execution, started, e).await,
        }
    }

    async fn taken_since(
        ctx: &ClaimContext<'_, Self>,
        execution: &Execution,
    ) -> Result<Option<Claim>, StoreError> {
        at_commit::taken_since(ctx, execution).await
    }
}

impl KeyLookup for Postgres {
    /// The key as it stands, if it has a row; `fingerprint` is the request's.
    async fn lookup<'c>(
        conn: &'c mut PgConnection,
        tenant: &'c str,
        operation: &'c str,
        key: KeyDigest,
        fingerprint: &'c Fingerprint,
    ) -> Result<Option<KeySnapshot>, StoreError> {
        let row = fetch_key(conn, tenant, operation, key).await?;
        row.map(|row| snapshot_of(&row, fingerprint)).transpose()
    }
}

/// Claims before the handler runs: `idem_claim` in the transaction, as
/// hand-written callers do, and the `UPDATE` completion.
async fn claim_first(
    conn: PoolConnection<Postgres>,
    req: &ClaimRequest<'_>,
    begin: sqlx::SqlStr,
) -> Result<(Tx<Postgres>, Claim), StoreError> {
    let mut tx = begun(Tx::begin_on(conn, begin).await).await?;
    tx.close_if_dropped(true);
    let claim = Postgres::claim(tx.connection(), req).await;
    tx.close_if_dropped(false);
    Ok((tx, claim?))
}

/// The session path's finish: the finished row and `COMMIT AND CHAIN` in one
/// message (see the module docs).
async fn finish_in_session(
    ctx: &ClaimContext<'_, Postgres>,
    mut tx: Tx<Postgres>,
    execution: Execution,
    response: &StoredResponse,
    status: i16,
    wait: i64,
    started: Instant,
) -> Finish {
    let sql = match finish_text(&execution, response, status, wait) {
        Ok(sql) => sql,
        Err(e) => return Finish::NotStored(e),
    };
    match sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut **tx.connection())
        .await
    {
        Ok(_) => {
            tx.committed_by_message();
            remember(ctx, &execution.tenant, &execution.operation, &execution.key);
            Finish::Committed
        }
        // The insert claimed nothing and the cast after it failed, or the plain
        // insert met the key's row: `COMMIT` never ran, and the transaction is
        // aborted.
        Err(e) if session::is_marker(&e, session::TAKEN_MARKER) || session::is_key_taken(&e) => {
            lost(ctx, tx, &execution, started).await
        }
        // The server ending the session (an administrator's or a shutdown's
        // FATAL, 57P01 and its kind) may do so after `COMMIT` ran and before
        // it reported ready: as a connection lost mid-message.
        Err(e) if lost_connection(&e) => {
            tx.discard();
            Finish::Unknown(e.into())
        }
        // An error the server answered: the message stopped there, before or at
        // `COMMIT`, and nothing committed (a `COMMIT` that fails rolls back).
        Err(e @ sqlx::Error::Database(_)) => not_inserted(ctx, tx, &execution, started, e).await,
        // The connection failed mid-message: `COMMIT` may have run.
        Err(e) => {
            tx.discard();
            Finish::Unknown(e.into())
        }
    }
}

/// `EXECUTE idem_insert_1(..); COMMIT AND CHAIN` (or `idem_finish_2` for a key
/// whose expired row is taken over), every value in an encoding that
/// cannot inject (see [`super::session`]).
fn finish_text(
    execution: &Execution,
    response: &StoredResponse,
    status: i16,
    wait: i64,
) -> Result<String, StoreError> {
    let headers_len: usize = response
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + 8)
        .sum();
    let mut sql = String::with_capacity(
        256 + execution.tenant.len()
            + execution.operation.len()
            + headers_len
            + 2 * response.body.len(),
    );
    sql.push_str("EXECUTE ");
    // Generation 1: the probe (or the lookup) found no row, so no row is there
    // to take over, and the plain insert does.
    sql.push_str(if execution.generation == 1 {
        session::INSERT
    } else {
        session::FINISH
    });
    push_key(
        &mut sql,
        &execution.tenant,
        &execution.operation,
        execution.key,
    )?;
    sql.pop(); // the key's closing parenthesis: the row goes on
    sql.push_str(", ");
    bytea_literal(&mut sql, execution.fingerprint.as_bytes());
    sql.push_str(", ");
    text_literal(&mut sql, response.state())?;
    sql.push_str(", ");
    let _ = write!(sql, "{status}");
    sql.push_str(", ");
    session::json_literal(&mut sql, &response.headers)?;
    sql.push_str(", ");
    bytea_literal(&mut sql, &response.body);
    sql.push_str(", ");
    let _ = write!(sql, "{}", kept_for_ms(execution, wait));
    sql.push_str(", '");
    let _ = write!(sql, "{wait}");
    sql.push('\'');
    if execution.generation != 1 {
        let _ = write!(sql, ", {}", execution.generation);
    }
    sql.push_str("); COMMIT AND CHAIN");
    Ok(sql)
}

/// How long the finished row is kept past the time its insert reads: the
/// retention, and the insert's own bounded wait for another holder of the key
/// (`wait`, milliseconds), which passes after that time is read and before the
/// row exists. So a row never commits with less than its retention left for
/// that wait (docs/decisions.md, "Retention").
fn kept_for_ms(execution: &Execution, wait: i64) -> i64 {
    millis(execution.retention).saturating_add(wait)
}

/// The key is held by another execution's finished or leased row: this one
/// rolls back and answers what the key holds now.
async fn lost(
    ctx: &ClaimContext<'_, Postgres>,
    tx: Tx<Postgres>,
    execution: &Execution,
    started: Instant,
) -> Finish {
    crate::metrics::claim_waited(execution.operation.clone(), started);
    if let Err(e) = tx.rollback().await {
        return Finish::Overtaken(e.into());
    }
    match at_commit::answer_instead(ctx, execution).await {
        Ok(claim) => Finish::Taken(claim),
        Err(e) => Finish::Overtaken(e),
    }
}

/// The insert (or, on the session path, its message) failed with `e`.
async fn not_inserted(
    ctx: &ClaimContext<'_, Postgres>,
    tx: Tx<Postgres>,
    execution: &Execution,
    started: Instant,
    e: sqlx::Error,
) -> Finish {
    match e {
        // The insert waited past `lock_timeout`.
        e if super::is_lock_timeout(&e) => {
            crate::metrics::claim_waited(execution.operation.clone(), started);
            drop(tx); // rolls the aborted transaction back
            Finish::Taken(Claim::InFlight {
                retry_after: execution.in_flight_wait.max(Duration::from_secs(1)),
            })
        }
        // The transaction is aborted and COMMIT never took: nothing committed.
        // The handler may have run into the winner of a race for the key (its
        // own unique row, say, then answered a 4xx): if another execution
        // finished the key meanwhile, its outcome is the answer.
        e @ sqlx::Error::Database(_) => {
            // Whether another execution finished the key is read below; a
            // rollback that fails leaves it unread.
            if let Err(rollback) = tx.rollback().await {
                tracing::warn!(error = %e, "idem: the finishing statement failed");
                return Finish::Overtaken(rollback.into());
            }
            match at_commit::answer_instead(ctx, execution)
                .await
                .map(decide::answers_instead)
            {
                Ok(Some(claim)) => Finish::Taken(claim),
                Ok(None) => Finish::NotStored(super::store_error(e)),
                Err(lookup) => {
                    tracing::warn!(error = %e, "idem: the finishing statement failed");
                    Finish::Overtaken(lookup)
                }
            }
        }
        e => {
            // Where the connection stopped is not known: close it.
            tx.discard();
            Finish::NotStored(e.into())
        }
    }
}
