//! Where leased mode keeps its records: every SQL database idem runs on (the
//! pool's [`Backend`](super::Backend)), or Redis (feature `redis`, `idem_runtime::redis::Redis`).
//!
//! [`LeaseBackend`] is the one seam: [`crate::Lease`], [`crate::LeasedClaim`],
//! the handler's leased path and the [`crate::Reconciler`] are written once over
//! it. On SQL it is implemented once, here, over [`SqlLeases`]: what each
//! database module gives (its statement texts, how it encodes a stored
//! answer, and the two statements that are its own, the claim and the batch
//! renewal); the statements over one owned row bind the same parameters in
//! the same order on every database. Redis implements it in its module, one
//! Lua script per state change (see `docs/redis.md`).

use std::future::Future;
use std::time::Duration;

use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};

use crate::db::shared::BindKey;
use crate::key::KeyDigest;
use crate::model::{
    Fence, KeyAddress, LeaseRequest, LeasedOutcome, OperationRow, Owned, OwnerToken, Renewal,
    Renewed, StoreError, StoredResponse, UncertainOutcome, UncertainRow,
};

pub(crate) mod sealed {
    /// Only idem's own stores implement [`super::LeaseBackend`]: the SQL
    /// databases here, Redis in its module.
    pub trait Sealed {}
    impl<DB: super::SqlLeases> Sealed for DB {}
}

/// A store leased mode runs on: every [`Backend`](super::Backend) (`sqlx::Postgres`,
/// `sqlx::Sqlite`, `sqlx::MySql`, its store a `sqlx::Pool`) and, with the
/// feature `redis`, `idem_runtime::redis::Redis` (its store a
/// `RedisLeaseStore`).
///
/// Sealed: its methods are idem's own statements and scripts. Name it in code
/// generic over where leases live, as `Lease<B>` or `Idem<B>`.
#[diagnostic::on_unimplemented(
    message = "leased mode does not run on `{Self}`",
    label = "not a store idem keeps leases in",
    note = "leases live in `sqlx::Postgres`, `sqlx::Sqlite`, `sqlx::MySql` (a pool) or, with the feature `redis`, `idem_runtime::redis::Redis`"
)]
pub trait LeaseBackend: sealed::Sealed + Send + Sized + 'static {
    /// The handle the records are reached through: a pool, or a Redis store.
    type Store: Clone + Send + Sync + 'static;

    /// An uncertain execution as the store lists it for the reconciler, with
    /// what a resolution is fenced by.
    #[doc(hidden)]
    type UncertainRow: Clone + Send + Sync + 'static;

    /// Claims `req.key`, committing at once.
    #[doc(hidden)]
    fn lease_claim(
        store: &Self::Store,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedOutcome, StoreError>> + Send;

    /// Stores the owned execution's outcome, its retention counted from now; the
    /// records touched (1, or 0 for a stale owner). Sent again after its answer
    /// was lost, it finds its own outcome and touches the record again (1).
    #[doc(hidden)]
    fn lease_store(
        store: &Self::Store,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Renews, marks uncertain or releases the owned execution; the records
    /// touched.
    #[doc(hidden)]
    fn lease_fence(
        store: &Self::Store,
        row: Owned<'_>,
        what: Fence,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Renews many owned executions at once (the process's renewal batch); what
    /// it learned of each, in order.
    #[doc(hidden)]
    fn lease_renew_many(
        store: &Self::Store,
        rows: &[Renewal<'_>],
    ) -> impl Future<Output = Result<Vec<Renewed>, StoreError>> + Send;

    /// Renews one owned execution that the batch found held by another
    /// transaction at its last renewal, waiting for its record at most about `wait`
    /// (see `crate::lease::renewals`). Where records are not held by anyone
    /// (Redis), the batch's renewal, for one.
    #[doc(hidden)]
    fn lease_renew_waiting(
        store: &Self::Store,
        row: &Renewal<'_>,
        _wait: Duration,
    ) -> impl Future<Output = Result<Renewed, StoreError>> + Send {
        async move {
            let renewed = Self::lease_renew_many(store, std::slice::from_ref(row)).await?;
            Ok(renewed.first().copied().unwrap_or(Renewed::Unknown))
        }
    }

    /// The key's finished outcome, if it has one, with its fingerprint.
    #[doc(hidden)]
    fn lease_current(
        store: &Self::Store,
        tenant: &str,
        operation: &str,
        key: &KeyDigest,
    ) -> impl Future<Output = Result<Option<(Vec<u8>, StoredResponse)>, StoreError>> + Send;

    /// The key's record as its operation resource shows it (`crate::operations`):
    /// its state, whether its lease is live by the store's clock, and its
    /// outcome (the body only `with_body`); `None` when there is none or it is
    /// finished and past its retention.
    #[doc(hidden)]
    fn lease_operation(
        store: &Self::Store,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<OperationRow>, StoreError>> + Send;

    /// Up to `limit` uncertain executions of `operation`, oldest first, after
    /// `after` (the last of an earlier page). Fewer than `limit` only when none
    /// is left after them: the reconciler takes a short page for the newest and
    /// starts over from the oldest, so a store that drops entries while listing
    /// reads on past them.
    #[doc(hidden)]
    fn lease_uncertain(
        store: &Self::Store,
        operation: &str,
        after: Option<&Self::UncertainRow>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Self::UncertainRow>, StoreError>> + Send;

    /// What the reconciler asks the application about for `row`.
    #[doc(hidden)]
    fn lease_describe(
        operation: &str,
        row: &Self::UncertainRow,
    ) -> Result<UncertainOutcome, StoreError>;

    /// The key ring a store of this kind was given, if it keeps one (the
    /// Redis store); the SQL pools keep none.
    #[doc(hidden)]
    fn store_key_ring(store: &Self::Store) -> Option<&crate::at_rest::KeyRing> {
        let _ = store;
        None
    }

    /// Resolves `row` if it is still that uncertain execution: stores `outcome`
    /// (retention from now) or forgets the key when `None`; the records touched.
    #[doc(hidden)]
    fn lease_resolve(
        store: &Self::Store,
        operation: &str,
        row: &Self::UncertainRow,
        outcome: Option<&StoredResponse>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// What a SQL database module gives leased mode: the texts of the statements
/// over one owned row (each binds the values it sets first, then the row's
/// primary key and owner token: MySQL's `?` are bound in the order they
/// appear, and `SET` comes before `WHERE`), how an outcome's status and headers
/// are written and read, and the claim and the batch renewal, which differ by
/// database in more than their text.
pub trait SqlLeases: Database {
    /// The status column's Rust type.
    type Status: for<'q> Encode<'q, Self> + Type<Self> + Send;
    /// The headers column's Rust type, borrowing the response where it can.
    type Headers<'r>: for<'q> Encode<'q, Self> + Type<Self> + Send;

    /// Stores the outcome: `state, status, headers, body, retention ms`, then
    /// the owned row, running or already finished under its token
    /// (`crate::db::shared::stored_row`).
    const STORE_SQL: &'static str;
    /// Renews the lease: `lease ms`, then the owned row.
    const RENEW_SQL: &'static str;
    /// Marks the execution uncertain: the owned row.
    const UNCERTAIN_SQL: &'static str;
    /// Releases the key: the owned row.
    const RELEASE_SQL: &'static str;
    /// Ends the lease now, the row kept `processing` under a fresh token (so
    /// that a renewal of the old one already on its way cannot extend it):
    /// `new token`, then the owned row.
    const LAPSE_SQL: &'static str;
    /// A finished row's fingerprint and outcome: `tenant, operation, digest`
    /// (by default the statement written with `$n` in `shared`).
    const CURRENT_SQL: &'static str = super::shared::CURRENT_SQL;
    /// A page of uncertain rows: `operation`, then the last row's `created,
    /// tenant, digest` (all `NULL` for the first page), then `limit`.
    const UNCERTAIN_ROWS_SQL: &'static str;
    /// Stores an uncertain row's outcome: `state, status, headers, body`, then
    /// `tenant, operation, digest, generation, owner token`; clears the owner
    /// token (see `crate::db::shared::stored_row`).
    const RESOLVE_SQL: &'static str;
    /// Forgets an uncertain row: `tenant, operation, digest, generation, owner
    /// token` (by default the statement written with `$n` in `shared`).
    const FORGET_SQL: &'static str = super::shared::FORGET_SQL;
    /// A long operation's row without its body: `tenant, operation, digest`.
    const OPERATION_STATUS_SQL: &'static str;
    /// The same with its body.
    const OPERATION_RESULT_SQL: &'static str;

    /// An outcome's status and headers as the columns take them.
    fn encode(response: &StoredResponse) -> Result<(Self::Status, Self::Headers<'_>), StoreError>;

    /// The stored outcome of a row that has one (`response_status`,
    /// `response_headers`, `response_body`).
    fn stored_from_row(row: &Self::Row) -> Result<StoredResponse, StoreError>;

    /// The rows a statement wrote.
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// Claims `req.key`, committing at once.
    fn claim_leased(
        pool: &Pool<Self>,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedOutcome, StoreError>> + Send;

    /// Renews many owned executions at once, each by its own lease from now, in
    /// one statement (or one transaction) that waits for no row another
    /// transaction holds; what it learned of each, in order.
    fn renew_many(
        pool: &Pool<Self>,
        rows: &[Renewal<'_>],
    ) -> impl Future<Output = Result<Vec<Renewed>, StoreError>> + Send;

    /// Renews one owned execution whose row [`SqlLeases::renew_many`] found
    /// held by another transaction at its last renewal, waiting for the row's lock
    /// at most about `wait`; [`Renewed::Unknown`] when the wait ran out. Where
    /// a database has no row locks (SQLite), the batch statement.
    fn renew_waiting(
        pool: &Pool<Self>,
        row: &Renewal<'_>,
        _wait: Duration,
    ) -> impl Future<Output = Result<Renewed, StoreError>> + Send {
        async move {
            let renewed = Self::renew_many(pool, std::slice::from_ref(row)).await?;
            Ok(renewed.first().copied().unwrap_or(Renewed::Unknown))
        }
    }
}

/// What a leased claim that reads and writes the row itself (SQLite, MySQL)
/// writes when it takes the key: a new owner token, the key for downstream
/// systems, and the lease and the retention in milliseconds.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) struct NewOwner {
    pub(crate) token: OwnerToken,
    pub(crate) downstream: String,
    pub(crate) lease: i64,
    pub(crate) retention: i64,
}

#[cfg(any(feature = "sqlite", feature = "mysql"))]
impl NewOwner {
    pub(crate) fn of(req: &LeaseRequest<'_>) -> Self {
        NewOwner {
            token: OwnerToken::random(),
            downstream: crate::key::downstream_key(req.tenant, req.operation, req.key),
            lease: crate::model::millis(req.lease),
            retention: crate::model::millis(req.retention),
        }
    }

    /// The claim's outcome once the row is written.
    pub(crate) fn acquired(
        self,
        acquisition: crate::model::Acquisition,
        generation: i64,
    ) -> LeasedOutcome {
        LeasedOutcome::Acquired {
            acquisition,
            token: self.token,
            generation,
        }
    }
}

/// [`SqlLeases::RENEW_SQL`] for one owned execution on `conn`, whose session
/// bounds how long it waits for the row ([`SqlLeases::renew_waiting`]): 1 row
/// renewed; 0 lost (the row's lock was had, so the row is not merely held).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn renew_one_on<DB>(
    conn: &mut DB::Connection,
    row: &Renewal<'_>,
) -> Result<Renewed, sqlx::Error>
where
    DB: SqlLeases,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> KeyDigest: Encode<'q, DB> + Type<DB>,
    for<'q> OwnerToken: Encode<'q, DB> + Type<DB>,
{
    let done = sqlx::query(DB::RENEW_SQL)
        .bind(crate::model::millis(row.lease))
        .bind_key(row.row.tenant, row.row.operation, row.row.key)
        .bind(row.row.token)
        .execute(conn)
        .await?;
    Ok(if DB::rows_affected(&done) == 1 {
        Renewed::Kept
    } else {
        Renewed::Lost
    })
}

/// Runs a fenced statement: `query` with the values it sets bound, then the
/// owned row (primary key and owner token), which every fenced statement
/// matches last; the rows it wrote (0 when the execution is no longer owned).
async fn fenced<DB>(
    store: &Pool<DB>,
    query: sqlx::query::Query<'_, DB, DB::Arguments>,
    row: Owned<'_>,
) -> Result<u64, StoreError>
where
    DB: SqlLeases,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> KeyDigest: Encode<'q, DB> + Type<DB>,
    for<'q> OwnerToken: Encode<'q, DB> + Type<DB>,
{
    let done = query
        .bind_key(row.tenant, row.operation, row.key)
        .bind(row.token)
        .execute(store)
        .await?;
    Ok(DB::rows_affected(&done))
}

/// Leased mode on a SQL database, once for all of them: the statements of
/// `SqlLeases` (what each database module gives), bound and read here.
impl<DB> LeaseBackend for DB
where
    DB: SqlLeases,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB> + ColumnIndex<DB::Row>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Decode<'q, DB> + Type<DB>,
    for<'q> KeyDigest: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> OwnerToken: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> crate::decide::RowState: Decode<'q, DB> + Type<DB>,
    // Each driver encodes `Option` itself, not through its inner type.
    for<'q> Option<i64>: Encode<'q, DB>,
    for<'q> Option<&'q str>: Encode<'q, DB>,
    for<'q> Option<KeyDigest>: Encode<'q, DB>,
    for<'q> Option<&'q OwnerToken>: Encode<'q, DB>,
{
    type Store = Pool<DB>;
    type UncertainRow = SqlUncertain;

    fn lease_claim(
        store: &Pool<DB>,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedOutcome, StoreError>> + Send {
        DB::claim_leased(store, req)
    }

    async fn lease_store(
        store: &Pool<DB>,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<u64, StoreError> {
        let (status, headers) = DB::encode(response)?;
        let query = sqlx::query(DB::STORE_SQL)
            .bind(response.state())
            .bind(status)
            .bind(headers)
            .bind(&response.body[..])
            .bind(crate::model::millis(retention));
        fenced(store, query, row).await
    }

    async fn lease_fence(store: &Pool<DB>, row: Owned<'_>, what: Fence) -> Result<u64, StoreError> {
        let query = match what {
            Fence::Renew(lease) => sqlx::query(DB::RENEW_SQL).bind(crate::model::millis(lease)),
            Fence::Lapse => sqlx::query(DB::LAPSE_SQL).bind(OwnerToken::random()),
            Fence::Uncertain => sqlx::query(DB::UNCERTAIN_SQL),
            Fence::Release => sqlx::query(DB::RELEASE_SQL),
        };
        fenced(store, query, row).await
    }

    fn lease_renew_many(
        store: &Pool<DB>,
        rows: &[Renewal<'_>],
    ) -> impl Future<Output = Result<Vec<Renewed>, StoreError>> + Send {
        DB::renew_many(store, rows)
    }

    fn lease_renew_waiting(
        store: &Pool<DB>,
        row: &Renewal<'_>,
        wait: Duration,
    ) -> impl Future<Output = Result<Renewed, StoreError>> + Send {
        DB::renew_waiting(store, row, wait)
    }

    async fn lease_current(
        store: &Pool<DB>,
        tenant: &str,
        operation: &str,
        key: &KeyDigest,
    ) -> Result<Option<(Vec<u8>, StoredResponse)>, StoreError> {
        let row = sqlx::query(DB::CURRENT_SQL)
            .bind_key(tenant, operation, *key)
            .fetch_optional(store)
            .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some((
            row.try_get("fingerprint")?,
            DB::stored_from_row(&row)?,
        )))
    }

    async fn lease_operation(
        store: &Pool<DB>,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> Result<Option<OperationRow>, StoreError> {
        let sql = if with_body {
            DB::OPERATION_RESULT_SQL
        } else {
            DB::OPERATION_STATUS_SQL
        };
        let row = sqlx::query(sql)
            .bind_key(key.tenant, key.operation, key.digest)
            .fetch_optional(store)
            .await?;
        row.as_ref()
            .map(|row| super::rows::operation(row, || DB::stored_from_row(row)))
            .transpose()
    }

    async fn lease_uncertain(
        store: &Pool<DB>,
        operation: &str,
        after: Option<&SqlUncertain>,
        limit: i64,
    ) -> Result<Vec<SqlUncertain>, StoreError> {
        let after = after.map(|a| &a.0);
        let rows = sqlx::query(DB::UNCERTAIN_ROWS_SQL)
            .bind(operation)
            .bind(after.map(|r| r.created))
            .bind(after.map(|r| r.tenant.as_str()))
            .bind(after.map(|r| r.key))
            .bind(limit)
            .fetch_all(store)
            .await?;
        rows.iter()
            .map(|row| super::rows::uncertain(row).map(SqlUncertain))
            .collect()
    }

    fn lease_describe(operation: &str, row: &SqlUncertain) -> Result<UncertainOutcome, StoreError> {
        row.0.outcome(operation)
    }

    async fn lease_resolve(
        store: &Pool<DB>,
        operation: &str,
        row: &SqlUncertain,
        outcome: Option<&StoredResponse>,
    ) -> Result<u64, StoreError> {
        let row = &row.0;
        let query = match outcome {
            Some(stored) => {
                let (status, headers) = DB::encode(stored)?;
                sqlx::query(DB::RESOLVE_SQL)
                    .bind(stored.state())
                    .bind(status)
                    .bind(headers)
                    .bind(&stored.body[..])
            }
            None => sqlx::query(DB::FORGET_SQL),
        };
        let done = query
            .bind(row.tenant.as_str())
            .bind(operation)
            .bind(row.key)
            .bind(row.generation)
            .bind(row.token.as_ref())
            .execute(store)
            .await?;
        Ok(DB::rows_affected(&done))
    }
}

/// An uncertain SQL row, as the reconciler pages through them.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct SqlUncertain(pub(crate) UncertainRow);
