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

use crate::model::{
    Claim, ClaimRequest, Execution, Fence, Finish, InFlightSummary, LeaseRequest, LeasedOutcome,
    Owned, StatsSnapshot, StoreError, StoredResponse, UncertainRow,
};
use crate::model::{FencedWrite, Resource};
use crate::model::{KeyAddress, KeyRecord, PurgeError};

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod rows;
mod shared;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
pub(crate) mod tx;

pub use tx::Tx;

#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
compile_error!(
    "idem-runtime needs a database: enable the feature `postgres` (the default), `sqlite` or `mysql`, or several"
);

/// The database a bare `Idem`, `Tx`, `Lease` or `Sweeper` uses: PostgreSQL when
/// the `postgres` feature is on (the default), else SQLite, else MySQL.
///
/// Features add up over the whole build: a service on SQLite whose dependency
/// graph enables idem-runtime's `postgres` feature anywhere (it is the default
/// feature) gets `Tx` = `Tx<Postgres>`. Name the database in a service on SQLite
/// or MySQL (`Idem<Sqlite>`, `Tx<Sqlite>`, `Lease<Sqlite>`); the examples and docs
/// do. A bare type then fails to compile against your pool rather than run on
/// another database (docs/decisions.md).
#[cfg(feature = "postgres")]
pub type DefaultBackend = sqlx::Postgres;
/// The database a bare `Idem`, `Tx`, `Lease` or `Sweeper` uses: PostgreSQL when
/// the `postgres` feature is on (the default), else SQLite.
#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
pub type DefaultBackend = sqlx::Sqlite;
/// The database a bare `Idem`, `Tx`, `Lease` or `Sweeper` uses: PostgreSQL when
/// the `postgres` feature is on (the default), else SQLite, else MySQL.
#[cfg(all(feature = "mysql", not(feature = "postgres"), not(feature = "sqlite")))]
pub type DefaultBackend = sqlx::MySql;

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
pub trait Backend: sqlx::Database + sealed::Sealed {
    // --- the transactional mode ------------------------------------------------

    /// Claims a key inside the caller's transaction.
    #[doc(hidden)]
    fn claim(
        tx: &mut Transaction<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Stores an execution's outcome inside the transaction that claimed it.
    #[doc(hidden)]
    fn complete(
        execution: Execution,
        tx: &mut Transaction<'_, Self>,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// idem's embedded migrations for this database, tracked in
    /// [`MIGRATIONS_TABLE`].
    #[doc(hidden)]
    fn migrator() -> Migrator;

    /// Applies [`Backend::migrator`]'s migrations.
    #[doc(hidden)]
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Begins a transaction fit for a claim.
    #[doc(hidden)]
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;

    /// The handler's path: begins a transaction on a connection of `ctx`'s pool
    /// and claims the key in it, in as few round trips as the database allows.
    /// The [`Tx`] comes back whatever the claim decided (dropping it releases the
    /// connection); only [`Claim::Execute`] leaves its transaction open.
    #[doc(hidden)]
    fn begin_claim(
        ctx: &ClaimContext<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<(Tx<Self>, Claim), StoreError>> + Send;

    /// The handler's path: stores the outcome in `tx` and commits.
    #[doc(hidden)]
    fn finish(
        ctx: &ClaimContext<'_, Self>,
        tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> impl Future<Output = Finish> + Send;

    /// The handler's path, after `execution` rolled back: what to answer instead
    /// of its own outcome, when another execution finished the key meanwhile.
    /// Only a database that claims at commit can find one; the others held the
    /// key from the claim on.
    #[doc(hidden)]
    fn taken_since(
        ctx: &ClaimContext<'_, Self>,
        execution: &Execution,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send {
        let _ = (ctx, execution);
        std::future::ready(Ok(None))
    }

    // --- leased mode: one short statement (or transaction) each; every statement
    // over an owned row matches the owner token and answers the rows it touched,
    // so a stale owner touches none ----------------------------------------------

    /// Claims `req.key`, committing at once.
    #[doc(hidden)]
    fn claim_leased(
        pool: &Pool<Self>,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedOutcome, StoreError>> + Send;

    /// Stores the owned execution's outcome, its retention counted from now.
    #[doc(hidden)]
    fn store_outcome(
        pool: &Pool<Self>,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Renews, marks uncertain or releases the owned execution.
    #[doc(hidden)]
    fn fence(
        pool: &Pool<Self>,
        row: Owned<'_>,
        what: Fence,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The key's finished outcome, if it has one, with its fingerprint.
    #[doc(hidden)]
    fn current(
        pool: &Pool<Self>,
        tenant: &str,
        operation: &str,
        key: &crate::key::KeyDigest,
    ) -> impl Future<Output = Result<Option<(Vec<u8>, StoredResponse)>, StoreError>> + Send;

    /// Up to `limit` uncertain rows of `operation` in creation order, starting
    /// after `after` (a row of an earlier page), so that rows that never resolve
    /// cannot keep newer ones from being asked about.
    #[doc(hidden)]
    fn uncertain_rows(
        pool: &Pool<Self>,
        operation: &str,
        after: Option<&UncertainRow>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<UncertainRow>, StoreError>> + Send;

    /// Resolves an uncertain row if it is still that execution (same generation and
    /// owner token): stores `outcome` (retention from now), or forgets the key when
    /// `None`.
    #[doc(hidden)]
    fn resolve(
        pool: &Pool<Self>,
        operation: &str,
        row: &UncertainRow,
        outcome: Option<&StoredResponse>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    // --- retention and numbers (database clock, never the application's) -------

    /// Deletes at most `limit` finished, expired rows, oldest expiry first, in a
    /// statement of its own; never a `processing` or `uncertain` row.
    #[doc(hidden)]
    fn delete_batch(
        pool: &Pool<Self>,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts the finished, expired rows still present.
    #[doc(hidden)]
    fn backlog(pool: &Pool<Self>) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Summarises the rows in flight (`processing` or `uncertain`).
    #[doc(hidden)]
    fn in_flight(
        pool: &Pool<Self>,
        stale_after: Duration,
    ) -> impl Future<Output = Result<InFlightSummary, StoreError>> + Send;

    /// The table's numbers in one consistent snapshot.
    #[doc(hidden)]
    fn snapshot(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<StatsSnapshot, StoreError>> + Send;

    // --- state transitions of the application's own rows --------------------------

    /// Reads `(state, version)` of a resource and holds it against other
    /// transitions until the transaction ends.
    #[doc(hidden)]
    fn lock_state<'c>(
        conn: &'c mut Self::Connection,
        resource: &'c Resource,
        id: i64,
        scope: Option<&'c str>,
    ) -> impl Future<Output = Result<Option<(String, i64)>, sqlx::Error>> + Send + 'c;

    /// Moves the state if the version is still the one read; the new version.
    #[doc(hidden)]
    fn write_state<'c>(
        conn: &'c mut Self::Connection,
        write: FencedWrite<'c>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'c;

    // --- what the admin CLI reads and deletes -------------------------------------

    /// The migration versions recorded as applied; none before the first.
    #[doc(hidden)]
    fn applied_versions(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<i64>, StoreError>> + Send;

    /// One key's row, its body only when `with_body`.
    #[doc(hidden)]
    fn fetch_record(
        pool: &Pool<Self>,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<KeyRecord>, StoreError>> + Send;

    /// Deletes one key's row under a lock taken within `wait`, if `allow` agrees
    /// with its state; the deleted row's state and generation.
    #[doc(hidden)]
    fn purge<E: Send>(
        pool: &Pool<Self>,
        key: &KeyAddress<'_>,
        wait: Duration,
        allow: impl FnOnce(&str) -> Result<(), E> + Send,
    ) -> impl Future<Output = Result<Option<(String, i64)>, PurgeError<E>>> + Send;
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

/// Shared by the modules: the migrator of `dir`, tracked in [`MIGRATIONS_TABLE`].
pub(crate) fn tracked(mut m: Migrator) -> Migrator {
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}
