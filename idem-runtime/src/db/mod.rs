//! The databases idem keeps its table in: one module per database, each holding
//! every statement and encoding that database needs, behind one sealed trait.
//!
//! Everything above this module (the handler pipeline, leased mode, the
//! reconciler, the sweeper, stats, transitions, the consumer helper and the
//! admin reads of the CLI) is written once, generic over [`Backend`], and holds
//! no SQL. Adding a database means adding a module here that implements
//! [`Backend`], its migrations under `migrations/<name>/`, a cargo feature, and
//! the stamping of the behaviour tests (see ARCHITECTURE.md).

use std::future::Future;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::{Pool, Transaction};

/// Which of a tenant's rows an erasure takes (`admin::erase_tenant`), with the
/// database's spelling of the "every row" flag (`$all`): the finished ones, or
/// every one when the flag is set. A `processing` row stays whether or not its
/// lease lapsed: a lapsed one is an execution that may have had its effect, and
/// its retry is told so (`Acquisition::TakenOver`), where a retry of a deleted
/// row would be told `New`. One rule for every SQL store; Redis's `ERASE`
/// script is its Lua twin.
macro_rules! erasable {
    ($all:literal) => {
        concat!("(", $all, " OR state IN ('completed', 'failed'))")
    };
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod at_commit;
mod dialect;
pub(crate) mod leases;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) mod restoring;
pub(crate) mod rows;
mod shared;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
pub(crate) mod stores;
pub(crate) mod tx;

pub use tx::Tx;

#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
compile_error!(
    "idem-runtime needs a database: enable the feature `postgres` (the default), `sqlite` or `mysql`, or several"
);

/// A database that is always enabled, for the attribute's expansion of a
/// handler it has already refused (so that one error is reported, not a
/// cascade). Not a default: idem's types name their database, as sqlx's do
/// (docs/decisions.md, "No default database").
#[doc(hidden)]
#[cfg(feature = "postgres")]
pub type AnyBackend = sqlx::Postgres;
#[doc(hidden)]
#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
pub type AnyBackend = sqlx::Sqlite;
#[doc(hidden)]
#[cfg(all(feature = "mysql", not(feature = "postgres"), not(feature = "sqlite")))]
pub type AnyBackend = sqlx::MySql;

/// The table in which idem records its own migrations, apart from the
/// application's `_sqlx_migrations`, on every database.
pub const MIGRATIONS_TABLE: &str = "_idem_migrations";

/// What the handler's path needs of its [`crate::Idem`]: the pool, whether
/// keys are claimed at commit, and how long the request may take (its deadline,
/// never shorter than its in-flight wait and a second). Built by the handler, so
/// that this module needs nothing of the layers above it.
#[doc(hidden)]
pub struct ClaimContext<'a, DB: sqlx::Database> {
    /// The pool the request's transaction runs on.
    pub(crate) pool: &'a Pool<DB>,
    /// See `Idem::with_claims_at_commit`.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) claims_at_commit: bool,
    /// The request's deadline, for the database's own bound on the transaction.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) deadline: Duration,
    /// When the request's deadline passes, where the handler's path knows it:
    /// the database's bound is then what is left of it when the transaction
    /// begins (the waiting room and the pool's wait took the rest), not the
    /// whole of [`ClaimContext::deadline`].
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) ends_at: Option<tokio::time::Instant>,
    /// See `Idem::with_session_statements` (`None`: as the pooler probe says).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) session_statements: Option<bool>,
    /// What this `Idem` has decided of it, once decided.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) session_path: &'a std::sync::OnceLock<bool>,
    /// See `Idem::with_checkout_test`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) checkout_test: bool,
    /// Keys seen finished lately (see `Idem::with_replay_hints`), if kept.
    #[cfg(feature = "postgres")]
    pub(crate) recent: Option<&'a crate::recent::Recent>,
}

mod sealed {
    /// Only idem's own database modules implement [`super::Backend`].
    pub trait Sealed {}
}

/// A database idem can keep its table in: `sqlx::Postgres` (feature `postgres`,
/// the default), `sqlx::Sqlite` (feature `sqlite`) and `sqlx::MySql` (feature
/// `mysql`: MySQL 8 and MariaDB 10.11).
///
/// Sealed: its methods are idem's own statements, not an interface to implement.
/// Name it in generic code that works on either database:
///
/// ```no_run
/// use idem_runtime::{Backend, Sweeper};
///
/// fn start_sweeper<DB: Backend>(pool: sqlx::Pool<DB>) {
///     Sweeper::new(pool).spawn();
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "idem does not run on `{Self}`",
    label = "not a database idem keeps its table in",
    note = "idem runs on `sqlx::Postgres` (feature `postgres`, the default), `sqlx::Sqlite` (feature `sqlite`) and `sqlx::MySql` (feature `mysql`); the pool, transaction or `Tx` type picks the database"
)]
pub trait Backend:
    sqlx::Database
    + sealed::Sealed
    + stores::Schema
    + stores::Claims
    + stores::HandlerPath
    + leases::LeaseBackend<Store = Pool<Self>, UncertainRow = leases::SqlUncertain>
    + stores::Upkeep
    + stores::Transitions
    + stores::Admin
{
    /// The statement that begins a transaction fit for a claim.
    #[doc(hidden)]
    const BEGIN: &'static str;

    /// Begins a transaction fit for a claim, with [`Backend::BEGIN`].
    #[doc(hidden)]
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        pool.begin_with(Self::BEGIN)
    }
}

/// Whether `e` says the table (or the migrations table) does not exist yet.
pub(crate) fn is_undefined_table(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    // PostgreSQL's undefined_table, MySQL's ER_NO_SUCH_TABLE (SQLSTATE 42S02);
    // SQLite has no code for it, only the message.
    matches!(db.code().as_deref(), Some("42P01" | "42S02"))
        || db.message().contains("no such table")
}

/// Closes `conn`, the migrator's, rather than pooling it where its run
/// failed: sqlx's migrator answers an error without giving back the session
/// lock it took (PostgreSQL's advisory lock, MySQL's `GET_LOCK`), and a
/// connection pooled holding it would make the next run, on another
/// connection, wait for it forever.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn close_if_failed<DB: sqlx::Database, T, E>(
    conn: &mut sqlx::pool::PoolConnection<DB>,
    ran: &Result<T, E>,
) {
    if ran.is_err() {
        conn.close_on_drop();
    }
}

/// Shared by the modules: the migrator of `dir`, tracked in [`MIGRATIONS_TABLE`].
pub(crate) fn tracked(mut m: Migrator) -> Migrator {
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}
