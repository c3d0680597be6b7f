//! The handler's path on MySQL and MariaDB: one row per execution, written once,
//! by the statement that also claims the key (the shape PostgreSQL's handler
//! path has, measured on MariaDB in BENCHMARKS.md, "MySQL's shapes").
//!
//! ```text
//! SELECT .. FROM idempotency_requests WHERE <key>     prepared, outside any transaction
//! SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; SAVEPOINT idem_tx
//! ... the handler's statements ...
//! [SET STATEMENT innodb_lock_wait_timeout = N FOR] INSERT .. ON DUPLICATE KEY UPDATE ..
//! [RELEASE SAVEPOINT idem_tx;] COMMIT [AND CHAIN]           one message
//! ```
//!
//! * **The lookup** answers every retry of a finished key (replay, or `422`) with
//!   one prepared statement and no transaction, decided by [`crate::decide`] as on
//!   the other databases: a retry never runs the handler.
//! * **The claim is the completion**: the finished row, inserted beside the effect
//!   before `COMMIT`. A concurrent duplicate's insert waits for the holder's
//!   transaction (InnoDB's lock on the uncommitted row), then finds the key taken,
//!   rolls its whole transaction back, effect included, and answers what the
//!   holder stored. Only a finished row past its retention is taken over; a
//!   leased execution's row, or a live outcome, is left as it is.
//! * **The wait is bounded for that statement alone**: MariaDB's `SET STATEMENT
//!   innodb_lock_wait_timeout = N FOR` (the in-flight wait, rounded up to whole
//!   seconds), so the handler's own statements wait as they would without idem.
//!   MySQL 8 has no `SET STATEMENT` (its `SET_VAR` hint does not take InnoDB's
//!   variable): there the session's wait is set before the insert and given back
//!   after it, two more round trips. Which server this is, is learned from the
//!   first insert (MySQL answers the `SET STATEMENT` form with a syntax error,
//!   and the insert is sent again in the other form), never assumed.
//!
//! MySQL has no `RETURNING`, and sqlx connects with `CLIENT_FOUND_ROWS`, so a row
//! left alone counts as one affected row, like an insert: the insert reports
//! whether it took the key through `LAST_INSERT_ID(expr)` instead, the generation
//! it wrote, or 0 for a row left alone. It writes the execution's generation
//! (bound: 1 for a new key, the expired row's plus one for a takeover), so an
//! expired row swept between the lookup and the insert leaves a new row at the
//! generation the execution's answer was made for. Unlike PostgreSQL's and
//! SQLite's takeovers, it does not also check that the expired row is still at
//! the generation before the execution's: `take!` is read by every assignment,
//! and the generation's comes first (see `upsert!`), so it cannot read the
//! generation too; a row taken over, finished and expired again within one
//! execution (a retention shorter than the handler) is replaced at the
//! execution's generation, as the others would answer in flight.
//!
//! On MariaDB the insert's row comes from `SELECT .. WHERE @@in_transaction = 1`:
//! where InnoDB rolled the handler's transaction back under it (a deadlock the
//! handler swallowed), it writes nothing rather than commit the answer alone
//! (see `upsert!`); its `COMMIT` then comes after the `RELEASE` of the
//! savepoint `idem_tx` the handler's transaction began with ([`BEGIN_HANDLER`]),
//! in one message (`commit_in_handlers_transaction`): a MariaDB release before
//! the fix for MDEV-36959 opens a new transaction after such a rollback, which
//! the variable reports, but without the savepoint. MySQL 8 lacks the
//! variable, and sends `VALUES`: there the message that bounds the insert's
//! wait opens with the `RELEASE`, which fails where the transaction has ended
//! (every end of a transaction takes its savepoints), so the insert is not
//! sent.
//!
//! With [`Idem::with_claims_at_commit`](crate::Idem::with_claims_at_commit) off
//! the key is claimed before the handler (the locking read of
//! [`super::transactional`], as hand-written claims do).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use sqlx::Arguments as _;
use sqlx::mysql::{MySqlArguments, MySqlQueryResult};
use sqlx::{MySql, MySqlConnection, Row};

use super::transactional::{self, DEADLOCK_RETRIES};
use super::{
    BEGIN_HANDLER, BEGIN_READ_COMMITTED, NO_SUCH_SAVEPOINT, bound_lock_wait, created_now,
    error_number, is_deadlock, is_lock_timeout, lock_wait_seconds, now_ms, released_with_lock_wait,
    restore_lock_wait,
};
use crate::db::ClaimContext;
use crate::db::Tx;
use crate::db::at_commit::{self, KeyLookup};
use crate::db::rows::{encode_text, stored_from_text};
use crate::db::shared::BindKey;
use crate::db::stores::{Claims, HandlerPath};
use crate::decide::{self, KeySnapshot};
use crate::fingerprint::Fingerprint;
use crate::key::KeyDigest;
use crate::model::{Claim, ClaimRequest, Execution, Finish, StoreError, StoredResponse, millis};

/// Everything the decision needs about a key, in one prepared statement.
///
/// Each column is read through an expression (`COALESCE(c) AS c`, the value
/// unchanged) rather than as the table's column: for a table's column sqlx-mysql
/// decodes where it comes from (schema, table, about eight allocations a column)
/// on every execution, and this statement runs on every first execution and
/// every replay. An expression has no origin to decode.
const LOOKUP_SQL: &str = concat!(
    "SELECT COALESCE(fingerprint) AS fingerprint, COALESCE(state) AS state, \
            COALESCE(generation) AS generation, expires_at > ",
    now_ms!(),
    " AS live, COALESCE(response_status) AS response_status, \
            COALESCE(response_headers) AS response_headers, \
            COALESCE(response_body) AS response_body \
       FROM idempotency_requests \
      WHERE tenant_id = ? AND operation = ? AND key_digest = ?"
);

/// Whether the row the insert ran into is to be taken over: a finished outcome
/// past its retention.
macro_rules! take {
    () => {
        concat!(
            "(state IN ('completed', 'failed') AND expires_at <= ",
            now_ms!(),
            ")"
        )
    };
}

/// `, col = IF(take, VALUES(col), col)` for each `col`: the new row's value
/// where the row is taken over, else the stored one.
macro_rules! new_if_taken {
    ($($col:ident),+) => {
        concat!($(", ", stringify!($col), " = IF(", take!(), ", VALUES(", stringify!($col), "), ", stringify!($col), ")"),+)
    };
}

/// `, col = IF(take, NULL, col)` for each `col`: cleared where the row is
/// taken over.
macro_rules! null_if_taken {
    ($($col:ident),+) => {
        concat!($(", ", stringify!($col), " = IF(", take!(), ", NULL, ", stringify!($col), ")"),+)
    };
}

/// The finished row, claiming the key (see the module docs). Every assignment
/// is `IF(take, new, old)`; MySQL evaluates them left to right and a later one
/// reads what an earlier one wrote, so the two columns `take!` reads come last:
/// `state` (whose new value is a finished state, so `take!` still holds for the
/// last assignment exactly when it held at first), then `expires_at`.
/// `VALUES()` in `ON DUPLICATE KEY UPDATE` is what MariaDB and MySQL both take
/// (MySQL 8.0.20 deprecates it with a warning, for a row alias MariaDB lacks).
///
/// `upsert!(in_transaction)` is MariaDB's form: the row comes from a `SELECT ..
/// WHERE @@in_transaction = 1` instead of `VALUES`, so that where InnoDB has
/// rolled the handler's whole transaction back (a deadlock, 1213, that the
/// handler did not return as its error) and the session has gone back to
/// autocommit, the insert writes nothing, rather than commit the key's answer
/// alone for an effect that was undone: it then affects no row at all (with
/// `CLIENT_FOUND_ROWS` a row left alone counts one). MySQL 8 has no
/// `@@in_transaction`.
macro_rules! upsert {
    () => {
        upsert!("VALUES (", ")")
    };
    (in_transaction) => {
        upsert!("SELECT ", " FROM DUAL WHERE @@in_transaction = 1")
    };
    ($open:literal, $close:literal) => {
        concat!(
            "INSERT INTO idempotency_requests \
                (tenant_id, operation, key_digest, fingerprint, state, generation, \
                 response_status, response_headers, response_body, created_at, completed_at, \
                 expires_at) ",
            $open,
            "?, ?, ?, ?, ?, LAST_INSERT_ID(?), ?, ?, ?, ",
            now_ms!(),
            ", ",
            created_now!(),
            $close,
            " ON DUPLICATE KEY UPDATE generation = IF(",
            take!(),
            ", LAST_INSERT_ID(VALUES(generation)), generation + LAST_INSERT_ID(0))",
            new_if_taken!(
                fingerprint,
                response_status,
                response_headers,
                response_body
            ),
            null_if_taken!(owner_token, lease_expires_at, downstream_key),
            new_if_taken!(created_at, completed_at, state, expires_at)
        )
    };
}

/// The insert on a server without `SET STATEMENT`, the session's wait set around
/// it.
const UPSERT_SQL: &str = upsert!();

/// The insert on MariaDB, behind its `SET STATEMENT` (see `upsert!`).
const UPSERT_IN_TRANSACTION_SQL: &str = upsert!(in_transaction);

/// MariaDB's `SET STATEMENT ... FOR` with ER_PARSE_ERROR: MySQL's answer to it.
pub(super) const PARSE_ERROR: u16 = 1064;

/// ER_UNKNOWN_SYSTEM_VARIABLE: `@@in_transaction` on a server that takes `SET
/// STATEMENT` but is not MariaDB (Percona Server); the statement changed
/// nothing, and the transaction goes on.
const UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;

/// Whether the server has `@@in_transaction`, as far as the insert has seen
/// (`UNKNOWN` until a server without it answers 1193 naming it).
static IN_TRANSACTION: AtomicU8 = AtomicU8::new(UNKNOWN);

/// What the insert learned of the server: whether it takes `SET STATEMENT`.
/// A hint (which form to send first), for the process, not per pool: a wrong
/// guess costs one round trip, and on MariaDB taken for MySQL 8 (a process
/// that also talks to MySQL 8) the `@@in_transaction` guard, which only the
/// `SET STATEMENT` form carries.
static SET_STATEMENT: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const TAKEN: u8 = 1;
const REFUSED: u8 = 2;

/// Whether a server refused `SET STATEMENT` (MySQL 8), as far as idem has seen.
pub(super) fn set_statement_refused() -> bool {
    set_statement_hint() == REFUSED
}

/// What is known of `SET STATEMENT` here: a test's choice for this thread,
/// else what the process learned.
fn set_statement_hint() -> u8 {
    chosen_on_this_thread(0).unwrap_or_else(|| SET_STATEMENT.load(Ordering::Relaxed))
}

/// What is known of `@@in_transaction` here, as [`set_statement_hint`].
fn in_transaction_hint() -> u8 {
    chosen_on_this_thread(1).unwrap_or_else(|| IN_TRANSACTION.load(Ordering::Relaxed))
}

// A test's choice of the insert's form, for the thread it runs on (a
// current-thread runtime's test runs every request there): the process's
// learned hints are left alone, so tests that choose run beside tests that do
// not without changing the form under them mid-request.
#[cfg(feature = "test-util")]
thread_local! {
    static CHOSEN: std::cell::Cell<[u8; 2]> = const { std::cell::Cell::new([UNKNOWN; 2]) };
}

#[cfg(feature = "test-util")]
fn chosen_on_this_thread(which: usize) -> Option<u8> {
    Some(CHOSEN.with(|c| c.get()[which])).filter(|&h| h != UNKNOWN)
}

#[cfg(not(feature = "test-util"))]
fn chosen_on_this_thread(_: usize) -> Option<u8> {
    None
}

/// Records what a statement sent with `SET STATEMENT` learned of the server.
pub(super) fn learned_set_statement(taken: bool) {
    SET_STATEMENT.store(if taken { TAKEN } else { REFUSED }, Ordering::Relaxed);
}

/// The bounded insert's text for a wait of `secs` seconds, `guarded` by
/// `@@in_transaction` or not: built once per value (a handful per service),
/// then the same `&'static str` that sqlx's statement cache knows.
fn bounded_upsert(secs: u64, guarded: bool) -> &'static str {
    const CACHED: usize = 300;
    static TEXTS: [OnceLock<String>; CACHED] = [const { OnceLock::new() }; CACHED];
    static UNGUARDED: [OnceLock<String>; CACHED] = [const { OnceLock::new() }; CACHED];
    let insert = if guarded {
        UPSERT_IN_TRANSACTION_SQL
    } else {
        UPSERT_SQL
    };
    let text = || format!("SET STATEMENT innodb_lock_wait_timeout = {secs} FOR {insert}");
    let texts = if guarded { &TEXTS } else { &UNGUARDED };
    match usize::try_from(secs) {
        Ok(i) if (1..=CACHED).contains(&i) => texts[i - 1].get_or_init(text),
        // A wait of minutes is no hot path: leaked once per distinct value.
        _ => {
            static LONG: std::sync::Mutex<Vec<(u64, bool, &'static str)>> =
                std::sync::Mutex::new(Vec::new());
            let mut long = LONG.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, _, t)) = long.iter().find(|(s, g, _)| *s == secs && *g == guarded) {
                return t;
            }
            let t: &'static str = Box::leak(text().into_boxed_str());
            long.push((secs, guarded, t));
            t
        }
    }
}

/// Begin READ COMMITTED, then claim with the locking read; a deadlock rolled
/// the transaction back, so the claim is retried in a new one, a bounded number
/// of times.
async fn claim_first(
    ctx: &ClaimContext<'_, MySql>,
    req: &ClaimRequest<'_>,
) -> Result<(Tx<MySql>, Claim), StoreError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut tx = Tx::begin(
            ctx.pool,
            Some(sqlx::SqlStr::from_static(BEGIN_READ_COMMITTED)),
        )
        .await?;
        // The claim bounds the session's lock wait and gives it back; dropped in
        // between, the connection is closed (a failed claim's too).
        tx.close_if_dropped(true);
        match transactional::claim_on(tx.connection(), req).await {
            Ok(claim) => {
                tx.close_if_dropped(false);
                return Ok((tx, claim));
            }
            Err(StoreError::Database(e)) if is_deadlock(&e) => {
                // `claim_on` gave the lock wait back before it returned: the
                // session is clean, and the connection may go back to the pool.
                tx.close_if_dropped(false);
                if attempt >= DEADLOCK_RETRIES {
                    return Ok((tx, transactional::in_flight(req)));
                }
                drop(tx);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(1..20))).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The handler's path; the claim and the completion in the caller's
/// transaction are `transactional`'s.
impl HandlerPath for MySql {
    /// Looks the key up and, unless that answers the request, begins the handler's
    /// transaction (see the module docs).
    async fn begin_claim(
        ctx: &ClaimContext<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> Result<(Tx<Self>, Claim), StoreError> {
        if !ctx.claims_at_commit {
            return claim_first(ctx, req).await;
        }
        let conn = ctx.pool.acquire().await?;
        let (conn, step) = at_commit::decide_claim::<MySql>(conn, req).await?;
        let generation = match step {
            decide::TransactionalStep::Execute { generation } => generation,
            decide::TransactionalStep::Answer(claim) => return Ok((Tx::idle(conn), claim)),
        };
        let tx = Tx::begin_on(conn, sqlx::SqlStr::from_static(BEGIN_HANDLER))
            .await
            .map_err(|(mut conn, e)| {
                // The message may have failed after its `START TRANSACTION`
                // (at the `SAVEPOINT`), leaving a transaction the driver did
                // not count and will not end: the connection is not given back.
                conn.close_on_drop();
                e
            })?;
        Ok((tx, Claim::Execute(Execution::at_commit(req, generation))))
    }

    /// Stores the outcome, claiming the key with it, and commits (see the module
    /// docs). Another execution's hold on the key is [`Finish::Taken`], with what to
    /// answer instead.
    async fn finish(
        ctx: &ClaimContext<'_, Self>,
        mut tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> Finish {
        if !execution.at_commit {
            let stored = MySql::complete(execution, tx.connection(), response).await;
            return tx.commit_after(stored).await;
        }
        let (status, headers) = match encode_text(response) {
            Ok(encoded) => encoded,
            Err(e) => return Finish::NotStored(e),
        };
        let started = Instant::now();
        match upsert(&mut tx, &execution, response, status, &headers).await {
            Ok(Upserted::Took {
                savepoint_held: true,
            }) => commit_in_handlers_transaction(tx).await,
            Ok(Upserted::Took { .. }) => tx.commit_stored().await,
            Ok(Upserted::OutsideTransaction) => {
                // The handler's transaction had ended, and the key's row was
                // not written: the retry runs the handler again. The
                // `ROLLBACK` only ends sqlx's count of the transaction.
                if let Err(e) = tx.rollback().await {
                    return Finish::NotStored(e.into());
                }
                Finish::NotStored(StoreError::TransactionEnded)
            }
            Ok(Upserted::LeftAlone) => {
                // A finished row that has not expired, or a leased execution's: this
                // execution loses, and answers what the key holds now.
                crate::metrics::claim_waited(execution.operation.clone(), started);
                if let Err(e) = tx.rollback().await {
                    return Finish::Overtaken(e.into());
                }
                match at_commit::answer_instead(ctx, &execution).await {
                    Ok(claim) => Finish::Taken(claim),
                    Err(e) => Finish::Overtaken(e),
                }
            }
            Err(e) if is_lock_timeout(&e) => {
                crate::metrics::claim_waited(execution.operation.clone(), started);
                if let Err(e) = tx.rollback().await {
                    return Finish::Overtaken(e.into());
                }
                Finish::Taken(Claim::InFlight {
                    retry_after: execution.in_flight_wait.max(Duration::from_secs(1)),
                })
            }
            // InnoDB rolled the whole transaction back (a deadlock), or the insert
            // failed: nothing committed. If another execution finished the key
            // meanwhile, its outcome is the answer; a deadlock over the key means
            // another holds it, so in flight.
            Err(e @ sqlx::Error::Database(_)) => {
                if let Err(rollback) = tx.rollback().await {
                    tracing::warn!(error = %e, "idem: the finishing statement failed");
                    return Finish::Overtaken(rollback.into());
                }
                match at_commit::answer_instead(ctx, &execution).await {
                    Ok(claim) if is_deadlock(&e) => Finish::Taken(claim),
                    Ok(claim) => match decide::answers_instead(claim) {
                        Some(claim) => Finish::Taken(claim),
                        None => Finish::NotStored(e.into()),
                    },
                    Err(lookup) => {
                        tracing::warn!(error = %e, "idem: the finishing statement failed");
                        Finish::Overtaken(lookup)
                    }
                }
            }
            Err(e) => {
                // Where the connection stopped is not known: close it.
                tx.discard();
                Finish::NotStored(e.into())
            }
        }
    }

    async fn taken_since(
        ctx: &ClaimContext<'_, Self>,
        execution: &Execution,
    ) -> Result<Option<Claim>, StoreError> {
        at_commit::taken_since(ctx, execution).await
    }
}

impl KeyLookup for MySql {
    /// The key as it stands, if it has a row; `fingerprint` is the request's.
    async fn lookup<'c>(
        conn: &'c mut MySqlConnection,
        tenant: &'c str,
        operation: &'c str,
        key: KeyDigest,
        fingerprint: &'c Fingerprint,
    ) -> Result<Option<KeySnapshot>, StoreError> {
        let row = sqlx::query(LOOKUP_SQL)
            .bind_key(tenant, operation, key)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let stored: Vec<u8> = row.try_get("fingerprint")?;
        let live: i64 = row.try_get("live")?;
        KeySnapshot::read(
            row.try_get("state")?,
            &stored,
            fingerprint,
            row.try_get("generation")?,
            live != 0,
            || stored_from_text(&row),
        )
        .map(Some)
    }
}

/// What the insert that claims the key did.
enum Upserted {
    /// It took the key; `savepoint_held` where `idem_tx` has not been released
    /// yet (MariaDB's guarded form), for the commit to check.
    Took { savepoint_held: bool },
    /// It left another execution's row alone.
    LeftAlone,
    /// It wrote nothing: the session is no longer in the handler's transaction
    /// (MariaDB's form reads `@@in_transaction`, see `upsert!`; the others'
    /// `RELEASE SAVEPOINT idem_tx` fails).
    OutsideTransaction,
}

/// The insert that claims the key, its wait bounded by the in-flight wait.
///
/// On MySQL 8 the lock wait is a session setting set around the insert: from
/// the change until it is given back (a lock-wait timeout included, the common
/// failure under contention), a drop or an error closes the connection rather
/// than pool it with idem's setting on it (see `Tx::close_if_dropped`).
async fn upsert(
    tx: &mut Tx<MySql>,
    execution: &Execution,
    response: &StoredResponse,
    status: i64,
    headers: &str,
) -> Result<Upserted, sqlx::Error> {
    // The retention and the insert's bounded wait for another holder of the
    // key, which passes after the statement reads its time (as on PostgreSQL:
    // docs/decisions.md, "Retention").
    let kept_for = millis(execution.retention).saturating_add(
        i64::try_from(lock_wait_seconds(execution.in_flight_wait) * 1000).unwrap_or(i64::MAX),
    );
    // One argument buffer sized for the whole row (the body is most of it),
    // rather than one that `bind` grows value by value.
    let bind = |sql: &'static str| -> Result<_, sqlx::Error> {
        let mut args = MySqlArguments::default();
        args.reserve(
            10,
            96 + execution.tenant.len()
                + execution.operation.len()
                + headers.len()
                + response.body.len(),
        );
        let encode = sqlx::Error::Encode;
        args.add(execution.tenant.as_str()).map_err(encode)?;
        args.add(execution.operation.as_str()).map_err(encode)?;
        args.add(execution.key).map_err(encode)?;
        args.add(&execution.fingerprint.as_bytes()[..])
            .map_err(encode)?;
        args.add(response.state()).map_err(encode)?;
        args.add(execution.generation).map_err(encode)?;
        args.add(status).map_err(encode)?;
        args.add(headers).map_err(encode)?;
        args.add(&response.body[..]).map_err(encode)?;
        args.add(kept_for).map_err(encode)?;
        Ok(sqlx::query_with(sql, args))
    };
    // Whether `idem_tx` has been released already (it is released once: a
    // second `RELEASE` would fail as if the transaction had ended).
    let mut released = false;
    if set_statement_hint() != REFUSED {
        let secs = lock_wait_seconds(execution.in_flight_wait);
        let mut guarded = in_transaction_hint() != REFUSED;
        if !guarded {
            if !still_in_transaction(tx.connection()).await? {
                return Ok(Upserted::OutsideTransaction);
            }
            released = true;
        }
        let mut done = bind(bounded_upsert(secs, guarded))?
            .execute(&mut **tx.connection())
            .await;
        if let Err(e) = &done
            && guarded
            && error_number(e) == Some(UNKNOWN_SYSTEM_VARIABLE)
            && e.to_string().contains("in_transaction")
        {
            // `SET STATEMENT` without `@@in_transaction`: the statement changed
            // nothing, and is sent again without the guard, after the
            // savepoint's (a round trip of its own on such a server).
            IN_TRANSACTION.store(REFUSED, Ordering::Relaxed);
            guarded = false;
            if !still_in_transaction(tx.connection()).await? {
                return Ok(Upserted::OutsideTransaction);
            }
            released = true;
            done = bind(bounded_upsert(secs, false))?
                .execute(&mut **tx.connection())
                .await;
        }
        match done {
            Err(e) if error_number(&e) == Some(PARSE_ERROR) => {
                // MySQL: a statement that did not parse changed nothing, and the
                // transaction goes on.
                SET_STATEMENT.store(REFUSED, Ordering::Relaxed);
            }
            done => {
                if done.is_ok() {
                    SET_STATEMENT.store(TAKEN, Ordering::Relaxed);
                }
                return done.map(|done| taken(done, guarded));
            }
        }
    }
    // Encoded before the session's lock wait changes: an encoding error then
    // leaves the session as it was.
    let upsert = bind(UPSERT_SQL)?;
    tx.close_if_dropped(true);
    let bounded = if released {
        // Released before the `SET STATEMENT` form, which this server then
        // refused to parse (MySQL 8, in a process that learned of a server
        // without `@@in_transaction` first).
        bound_lock_wait(tx.connection(), execution.in_flight_wait).await
    } else {
        released_with_lock_wait(tx.connection(), execution.in_flight_wait).await
    };
    match bounded {
        Ok(()) => {}
        Err(e) if error_number(&e) == Some(NO_SUCH_SAVEPOINT) => {
            // The handler's transaction has ended: nothing after the `RELEASE`
            // ran, so the session is as it was, and the answer is not written.
            tx.close_if_dropped(false);
            return Ok(Upserted::OutsideTransaction);
        }
        Err(e) => return Err(e),
    }
    let done = upsert.execute(&mut **tx.connection()).await;
    // Given back whatever the insert did: a lock-wait timeout rolled back the
    // statement only, and the connection goes back to the pool.
    restore_lock_wait(tx.connection()).await?;
    tx.close_if_dropped(false);
    done.map(|done| taken(done, false))
}

/// Commits after MariaDB's guarded insert, `RELEASE SAVEPOINT idem_tx` first
/// in the same message (`COMMIT AND CHAIN`: see `Tx::committed_by_message`),
/// so that only the transaction idem began commits the answer. MariaDB
/// releases before the fix for MDEV-36959 keep a deadlocked transaction's
/// `BEGIN`: the next statement opens a new transaction, which
/// `@@in_transaction` reports like the handler's, but the rollback removed
/// the savepoint. Its `RELEASE` then fails ([`NO_SUCH_SAVEPOINT`]), the
/// `COMMIT` does not run, and what that new transaction holds is rolled back:
/// nothing stored. No round trip is added: the `RELEASE` rides with the
/// `COMMIT`.
async fn commit_in_handlers_transaction(mut tx: Tx<MySql>) -> Finish {
    if tx.nested_left_open() {
        return Finish::NotStored(StoreError::NestedTransactionLeftOpen);
    }
    match sqlx::raw_sql("RELEASE SAVEPOINT idem_tx; COMMIT AND CHAIN")
        .execute(&mut **tx.connection())
        .await
    {
        Ok(_) => {
            tx.committed_by_message();
            Finish::Committed
        }
        Err(e) if error_number(&e) == Some(NO_SUCH_SAVEPOINT) => {
            if let Err(e) = tx.rollback().await {
                return Finish::NotStored(e.into());
            }
            Finish::NotStored(StoreError::TransactionEnded)
        }
        Err(e) => Finish::Unknown(e.into()),
    }
}

/// `RELEASE SAVEPOINT idem_tx` in a message of its own, for the insert's form
/// that neither reads `@@in_transaction` nor carries the `RELEASE` (`SET
/// STATEMENT` on a server without the variable): `false` where the handler's
/// transaction has ended (see [`BEGIN_HANDLER`]).
async fn still_in_transaction(conn: &mut MySqlConnection) -> Result<bool, sqlx::Error> {
    match sqlx::raw_sql("RELEASE SAVEPOINT idem_tx")
        .execute(conn)
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if error_number(&e) == Some(NO_SUCH_SAVEPOINT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What the insert did: no row affected at all is the `guarded` form finding
/// no transaction; otherwise `LAST_INSERT_ID(expr)` is the generation it took,
/// or 0 for a row left alone.
fn taken(done: MySqlQueryResult, guarded: bool) -> Upserted {
    if guarded && done.rows_affected() == 0 {
        return Upserted::OutsideTransaction;
    }
    match done.last_insert_id() {
        0 => Upserted::LeftAlone,
        _ => Upserted::Took {
            savepoint_held: guarded,
        },
    }
}

/// Whether to try `SET STATEMENT` at all, for requests on this thread:
/// `Some(false)` sends MySQL 8's form on MariaDB too, so a test can hold that
/// form to the same promises; `None` goes back to what the process learned
/// (feature `test-util`).
#[cfg(feature = "test-util")]
pub fn assume_set_statement(taken: Option<bool>) {
    CHOSEN.with(|c| c.set([hint(taken), c.get()[1]]));
}

/// Whether the server has `@@in_transaction`, for requests on this thread:
/// `Some(false)` sends the `SET STATEMENT` form without its guard, as on a
/// server that lacks it (feature `test-util`).
#[cfg(feature = "test-util")]
pub fn assume_in_transaction(has: Option<bool>) {
    CHOSEN.with(|c| c.set([c.get()[0], hint(has)]));
}

/// A hint as a test chooses it: `None` chooses nothing.
#[cfg(feature = "test-util")]
fn hint(taken: Option<bool>) -> u8 {
    match taken {
        None => UNKNOWN,
        Some(true) => TAKEN,
        Some(false) => REFUSED,
    }
}
