//! PostgreSQL: every statement idem runs there.
//!
//! * [`transactional`]: the claim (`idem_claim`, one round trip) and the
//!   completion, in the caller's transaction; [`hot_path`]: the handler's path,
//!   a lookup before the transaction and one row inserted at its commit.
//! * [`leased`]: leased mode's claim (`idem_claim_leased`) and its fenced
//!   statements.
//! * [`upkeep`]: the sweeper's statements and the stats snapshot.
//! * [`admin`]: what the CLI shows and purges.
//!
//! The functions the statements call live in `migrations/postgres/`.

use std::time::Duration;

use sqlx::{Pool, Postgres};

use super::Backend;
use crate::model::Resource;
use crate::model::StoreError;

/// The finished row's insert on the handler's path, up to what it does on a
/// conflict: the bound statements (`hot_path`) and the session's prepared ones
/// (`session`) are this text. `lock_timeout` is bounded by the row source, before
/// the insert can wait on a concurrent holder of the key (the handler's own
/// statements ran without it); the value to give back is kept in
/// `idem.lock_timeout`, transaction-local like the bound. The source's columns
/// are evaluated left to right: saved, then bounded. `$generation` is the
/// generation the row is written at: `"1"` for a key the lookup found no row
/// for, `"$11"` (the execution's, bound) where an expired row may be taken over,
/// so that the row holds the generation its execution decided on whether it
/// replaces that row or, the row swept meanwhile, begins the key again.
macro_rules! finished_row_insert {
    ($generation:literal) => {
        concat!(
            "INSERT INTO idempotency_requests AS r \
                (tenant_id, operation, key_digest, fingerprint, state, generation, \
                 response_status, response_headers, response_body, created_at, \
                 completed_at, expires_at) \
             SELECT $1, $2, $3, $4, $5, ",
            $generation,
            ", $6, $7, $8, now(), c.t, \
                c.t + $9 * interval '1 millisecond' \
               FROM (SELECT clock_timestamp() AS t, \
                        set_config('idem.lock_timeout', current_setting('lock_timeout'), true) \
                          AS saved, \
                        set_config('lock_timeout', $10::text, true) AS bounded) c"
        )
    };
}

/// What [`finished_row_insert`] does on a conflict when it may take over an
/// expired row: only a finished row past its retention, never a leased
/// execution's, and only the one its execution decided on (the generation
/// before the execution's, as SQLite's takeover checks); nothing otherwise.
macro_rules! take_over_expired {
    () => {
        " ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE \
            SET fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, \
                generation = EXCLUDED.generation, response_status = EXCLUDED.response_status, \
                response_headers = EXCLUDED.response_headers, \
                response_body = EXCLUDED.response_body, \
                owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, \
                created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, \
                expires_at = EXCLUDED.expires_at \
          WHERE r.expires_at <= now() AND r.state IN ('completed', 'failed') \
            AND r.generation = EXCLUDED.generation - 1"
    };
}

/// Gives `lock_timeout` back once the row is written, so the `COMMIT` that
/// follows (the handler's deferred constraints and triggers) waits as the
/// transaction did before.
macro_rules! restore_lock_timeout {
    () => {
        "set_config('lock_timeout', current_setting('idem.lock_timeout'), true)"
    };
}

mod admin;
pub(crate) mod hot_path;
mod leased;
mod operations;
pub(crate) mod pooler;
pub(crate) mod session;
pub(crate) mod transactional;
mod upkeep;

/// How idem begins a transaction for a claim: explicitly READ COMMITTED, so a
/// server or role whose default isolation is stricter still gets what claims need.
pub(crate) const BEGIN_READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// The in-flight wait as the claim functions take it (they set it as
/// `lock_timeout`, whose ceiling is `i32::MAX` milliseconds, about 24.8 days): a
/// longer wait, from a hand-written [`ClaimRequest`](crate::model::ClaimRequest) or an attribute's
/// `in_flight_wait`, is that ceiling rather than a claim that always fails.
pub(crate) fn lock_wait_ms(wait: Duration) -> i64 {
    crate::model::millis(wait).min(i64::from(i32::MAX))
}

/// PostgreSQL's `lock_not_available`: a statement waited for a row's lock past
/// `lock_timeout`.
pub(crate) fn is_lock_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// `25P02`: the transaction was already aborted when idem's statement came, by
/// a statement of the handler's that failed and that it answered rather than
/// returned as its error.
pub(crate) fn is_aborted(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"))
}

/// `e` as idem reports it: [`StoreError::TransactionAborted`] for
/// [`is_aborted`].
pub(crate) fn store_error(e: sqlx::Error) -> StoreError {
    if is_aborted(&e) {
        StoreError::TransactionAborted
    } else {
        StoreError::Database(e)
    }
}

impl super::sealed::Sealed for Postgres {}

impl Backend for Postgres {
    /// Explicitly READ COMMITTED, so a server or role whose default isolation is
    /// stricter still gets what claims need.
    const BEGIN: &'static str = BEGIN_READ_COMMITTED;
}

impl super::stores::Schema for Postgres {
    fn migrator() -> sqlx::migrate::Migrator {
        super::tracked(sqlx::migrate!("migrations/postgres"))
    }

    /// Behind a connection pooler, only through one that keeps sessions: the
    /// migrator holds a session-level advisory lock (see [`pooler`]).
    async fn migrate(pool: &Pool<Self>) -> Result<(), StoreError> {
        let sessions = pooler::probe(pool).await?;
        session::record(pool, sessions);
        match sessions {
            pooler::Sessions::Kept => {}
            pooler::Sessions::TransactionPooled => return Err(pooler::migrations_need_a_session()),
            pooler::Sessions::PreparedStatementsLost => {
                return Err(pooler::prepared_statements_lost());
            }
        }
        // On one connection: see `close_if_failed`.
        let mut conn = pool.acquire().await?;
        let ran = Self::migrator().run_direct(None, &mut *conn, false).await;
        super::close_if_failed(&mut conn, &ran);
        Ok(ran?)
    }
}

impl super::shared::SqlTransitions for Postgres {
    const NULL_PARAM: &'static str = "$2::text";

    /// The statement that reads `state, version` of a resource and holds the row
    /// against other transitions: a concurrent transition waits for the lock, then
    /// sees the committed state.
    fn transition_read_sql(resource: &Resource) -> String {
        format!(
            "SELECT {state}, {version} FROM {table} WHERE {id} = $1{scope} FOR UPDATE",
            state = resource.state_column,
            version = resource.version_column,
            table = resource.table,
            id = resource.id_column,
            scope = super::shared::scope_sql(resource, "$2::text"),
        )
    }
}
