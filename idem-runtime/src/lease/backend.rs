//! Where leased mode keeps its records: every SQL database idem runs on (the
//! pool's [`Backend`]), or Redis (feature `redis`, `idem_runtime::redis::Redis`).
//!
//! [`LeaseBackend`] is the one seam: [`crate::Lease`], [`crate::LeasedClaim`],
//! the handler's leased path and the [`crate::Reconciler`] are written once over
//! it. A SQL database delegates to its [`Backend`]'s leased statements, so
//! nothing changes for a service on a pool; Redis runs one Lua script per state
//! change (see `docs/redis.md`).

use std::future::Future;
use std::time::Duration;

use sqlx::Pool;

use crate::db::Backend;
use crate::key::KeyDigest;
use crate::model::{
    Fence, KeyAddress, LeaseRequest, LeasedOutcome, OperationRow, Owned, Renewal, Renewed,
    StoreError, StoredResponse,
};
use crate::reconcile::UncertainOutcome;

mod sealed {
    /// Only idem's own stores implement [`super::LeaseBackend`].
    pub trait Sealed {}
    impl<DB: crate::db::Backend> Sealed for DB {}
    #[cfg(feature = "redis")]
    impl Sealed for crate::redis::Redis {}
}

/// A store leased mode runs on: every [`Backend`] (`sqlx::Postgres`,
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
    /// records touched (1, or 0 for a stale owner).
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

impl<DB: Backend> LeaseBackend for DB {
    type Store = Pool<DB>;
    type UncertainRow = SqlUncertain;

    fn lease_claim(
        store: &Pool<DB>,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedOutcome, StoreError>> + Send {
        <DB as crate::db::stores::LeaseRows>::claim_leased(store, req)
    }

    fn lease_store(
        store: &Pool<DB>,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        <DB as crate::db::stores::LeaseRows>::store_outcome(store, row, response, retention)
    }

    fn lease_fence(
        store: &Pool<DB>,
        row: Owned<'_>,
        what: Fence,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        <DB as crate::db::stores::LeaseRows>::fence(store, row, what)
    }

    fn lease_renew_many(
        store: &Pool<DB>,
        rows: &[Renewal<'_>],
    ) -> impl Future<Output = Result<Vec<Renewed>, StoreError>> + Send {
        <DB as crate::db::stores::LeaseRows>::renew_many(store, rows)
    }

    fn lease_current(
        store: &Pool<DB>,
        tenant: &str,
        operation: &str,
        key: &KeyDigest,
    ) -> impl Future<Output = Result<Option<(Vec<u8>, StoredResponse)>, StoreError>> + Send {
        <DB as crate::db::stores::LeaseRows>::current(store, tenant, operation, key)
    }

    fn lease_operation(
        store: &Pool<DB>,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<OperationRow>, StoreError>> + Send {
        <DB as crate::db::stores::OperationRows>::operation(store, key, with_body)
    }

    async fn lease_uncertain(
        store: &Pool<DB>,
        operation: &str,
        after: Option<&SqlUncertain>,
        limit: i64,
    ) -> Result<Vec<SqlUncertain>, StoreError> {
        let rows = <DB as crate::db::stores::LeaseRows>::uncertain_rows(
            store,
            operation,
            after.map(|a| &a.0),
            limit,
        )
        .await?;
        Ok(rows.into_iter().map(SqlUncertain).collect())
    }

    fn lease_describe(operation: &str, row: &SqlUncertain) -> Result<UncertainOutcome, StoreError> {
        crate::reconcile::sql_uncertain_outcome(operation, &row.0)
    }

    fn lease_resolve(
        store: &Pool<DB>,
        operation: &str,
        row: &SqlUncertain,
        outcome: Option<&StoredResponse>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        <DB as crate::db::stores::LeaseRows>::resolve(store, operation, &row.0, outcome)
    }
}

/// An uncertain SQL row, as the reconciler pages through them.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct SqlUncertain(pub(crate) crate::model::UncertainRow);
