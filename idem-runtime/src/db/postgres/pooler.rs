//! What a connection pooler between idem and PostgreSQL must keep, checked at
//! start (docs/pgbouncer.md).
//!
//! sqlx prepares every statement it sends with bound parameters as a named
//! statement of the server session and executes it by name afterwards. A
//! pooler in transaction (or statement) pooling mode hands each transaction, and
//! each statement outside one, whichever server connection is free: a statement
//! prepared on one server is then executed on another, which never saw it
//! (`prepared statement "sqlx_s_1" does not exist`). PgBouncer before 1.21 does
//! not follow prepared statements at all; 1.21 and later re-prepare them when
//! `max_prepared_statements` is above 0. Under light load the same server
//! usually comes back, so the failure shows only under load; this check provokes
//! it at start instead.
//!
//! The probe: on a new connection, a session setting and a prepared statement;
//! then a second new connection opens a transaction (a pooler that reuses the
//! most recently released server first, as PgBouncer does by default, hands it
//! the server the first connection just used); then the first connection runs
//! its statement again. Without a pooler, or through session pooling, it runs on
//! its own session and reads its setting back. Through transaction pooling it
//! runs on another server: without prepared-statement support it fails there
//! (the statement is missing, or another client's statement of the same name is
//! in the way); with it, it runs but the setting is gone. Where the pooler has
//! no other server free, the first connection waits for the second's
//! transaction instead, on the server the first ran on (the probe compares
//! their `pg_backend_pid()`), which says as much: it has no server of its own.
//! Three rounds, since a busy pooler may hand out servers in another order.

use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection, PgPool, Row};

use crate::model::StoreError;

/// PostgreSQL's `invalid_sql_statement_name`: a prepared statement the session
/// does not have.
const MISSING_STATEMENT: &str = "26000";

/// PostgreSQL's `duplicate_prepared_statement`: the name is taken in the
/// session, by a statement the connection never prepared.
const DUPLICATE_STATEMENT: &str = "42P05";

/// What the probe saw of the pool's sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sessions {
    /// A session of its own for every connection: no pooler, or session pooling.
    Kept,
    /// Transactions run on whichever server is free, and prepared statements
    /// follow them (PgBouncer 1.21 or later with `max_prepared_statements`).
    TransactionPooled,
    /// Transactions run on whichever server is free, and prepared statements
    /// stay behind: every statement idem sends can fail.
    PreparedStatementsLost,
}

/// Runs the probe (see the module docs) three times, each on two connections
/// opened with the pool's options: a pooler hands out servers as its load and
/// its reuse order decide, so one round can miss what another shows. Without a
/// pooler, and through session pooling, no round can see a lost statement or
/// setting: the probe never refuses a pool that works.
pub(crate) async fn probe(pool: &PgPool) -> Result<Sessions, StoreError> {
    let options = pool.connect_options();
    let mut seen = Sessions::Kept;
    for _ in 0..3 {
        match round(&options).await? {
            Sessions::PreparedStatementsLost => return Ok(Sessions::PreparedStatementsLost),
            Sessions::TransactionPooled => seen = Sessions::TransactionPooled,
            Sessions::Kept => {}
        }
    }
    Ok(seen)
}

/// One round: a setting and a prepared statement on a new connection (whose
/// statement names start again at sqlx's first: a server that kept another
/// client's statement refuses it), then a second new connection opens a
/// transaction, taking the server the first just released if a pooler reuses
/// servers most-recent-first (PgBouncer's default), and the first connection
/// runs its statement again.
async fn round(options: &sqlx::postgres::PgConnectOptions) -> Result<Sessions, StoreError> {
    // This round's own value: a transaction pooler does not reset a session's
    // settings between clients, so a value every round wrote alike would be
    // left on its servers by earlier probes, and a read on another server
    // would find it there as if it had been kept.
    let mark = format!("kept-{:016x}", fastrand::u64(..));
    let mut first = PgConnection::connect_with(options).await?;
    // A simple query, so that it prepares nothing (the read below must be
    // the connection's first prepared statement); the mark is hex digits.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT set_config('idem.pooler_probe', '{mark}', false)"
    )))
    .execute(&mut first)
    .await?;
    let mut kept = match read_back(&mut first, &mark).await {
        Ok(kept) => kept,
        Err(e) if is_lost_statement(&e) => return Ok(Sessions::PreparedStatementsLost),
        Err(e) => return Err(e.into()),
    };
    let first_server = backend_pid(&mut first).await?;
    let mut second = PgConnection::connect_with(options).await?;
    second.execute("BEGIN; SELECT 1").await?;
    // A first connection that waits while the second's transaction holds the
    // very server the first ran on has no server of its own (a transaction
    // pooler with no other server free): it is answered once that transaction
    // ends, and its answer says whether its statement followed it. A wait
    // beside another server is a slow server, and says nothing.
    let (again, waited) = {
        let again = read_back(&mut first, &mark);
        tokio::pin!(again);
        match tokio::time::timeout(Duration::from_secs(2), &mut again).await {
            Ok(again) => (again, false),
            Err(_) => {
                let shared = backend_pid(&mut second).await? == first_server;
                second.execute("ROLLBACK").await?;
                match tokio::time::timeout(Duration::from_secs(30), &mut again).await {
                    Ok(again) => (again, shared),
                    // Neither connection is closed politely: a statement
                    // may still be on its way.
                    Err(_) => {
                        return Err(StoreError::Pooler(
                            "the pooler probe's statement got no answer in 30 s".to_owned(),
                        ));
                    }
                }
            }
        }
    };
    second.execute("ROLLBACK").await.ok();
    second.close().await.ok();
    let seen = match again {
        Ok(again) => {
            kept &= again;
            if kept && !waited {
                Sessions::Kept
            } else {
                Sessions::TransactionPooled
            }
        }
        Err(e) if is_lost_statement(&e) => Sessions::PreparedStatementsLost,
        Err(e) => return Err(e.into()),
    };
    first.close().await.ok();
    Ok(seen)
}

/// The server process the connection's statement runs on: its own session's
/// without a pooler, whichever server the pooler hands it through one. A
/// simple query, so that it prepares nothing (the probe's statement names
/// must start at sqlx's first).
async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    sqlx::raw_sql("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)
}

/// Whether the session still holds the round's setting, `mark`, read by a
/// prepared statement (the same one each time, by name, as sqlx caches it).
async fn read_back(conn: &mut PgConnection, mark: &str) -> Result<bool, sqlx::Error> {
    let row = sqlx::query("SELECT current_setting('idem.pooler_probe', true) AS kept")
        .fetch_one(&mut *conn)
        .await?;
    let kept: Option<String> = row.try_get("kept")?;
    Ok(kept.as_deref() == Some(mark))
}

/// A prepared statement the server does not have (`26000`), or one of another
/// client's that it kept (`42P05`): either says statements do not stay with
/// their session.
fn is_lost_statement(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            Some(MISSING_STATEMENT | DUPLICATE_STATEMENT)
        ),
        _ => false,
    }
}

/// The error for a pool whose pooler loses prepared statements.
pub(crate) fn prepared_statements_lost() -> StoreError {
    StoreError::Pooler(
        "the pool's connections go through a pooler that runs transactions on any free server \
         and does not carry prepared statements to it (PgBouncer in transaction or statement \
         pooling mode, before 1.21 or with max_prepared_statements = 0): sqlx prepares every \
         statement idem sends, so they would fail under load. Use pool_mode = session, or \
         PgBouncer 1.21 or later with max_prepared_statements above 0 (docs/pgbouncer.md)"
            .to_owned(),
    )
}

/// The error for migrations through a transaction pool.
pub(crate) fn migrations_need_a_session() -> StoreError {
    StoreError::Pooler(
        "the pool's connections go through a transaction-pooling pooler: migrations hold a \
         session-level advisory lock (sqlx's migrator), which such a pooler would leave on \
         some server connection. Run idem_runtime::migrate on a direct or session-pooled \
         connection (docs/pgbouncer.md)"
            .to_owned(),
    )
}

/// Checks that `pool` keeps what idem needs of PostgreSQL sessions: a clear
/// error at start where a connection pooler would make idem's statements fail
/// under load (see docs/pgbouncer.md). [`crate::migrate`] runs the same check
/// (and refuses any transaction pooling, which its lock cannot run through);
/// call this at start when migrations run elsewhere, before serving.
///
/// Passes without a pooler, through session pooling, and through transaction
/// pooling that carries prepared statements (PgBouncer 1.21 or later with
/// `max_prepared_statements` above 0).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// idem_runtime::check_pooler(&pool).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`StoreError::Pooler`] when prepared statements do not survive a
/// transaction; [`StoreError::Database`] when the probe's statements fail.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub async fn check_pooler(pool: &PgPool) -> Result<(), StoreError> {
    let sessions = probe(pool).await?;
    super::session::record(pool, sessions);
    match sessions {
        Sessions::PreparedStatementsLost => Err(prepared_statements_lost()),
        Sessions::Kept | Sessions::TransactionPooled => Ok(()),
    }
}
