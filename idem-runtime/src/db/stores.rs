//! The narrow traits a database implements, by concern; [`super::Backend`] is
//! the sealed marker that requires them all. They are `pub` in this private
//! module: reachable through `Backend` by idem's generic code, and nameable
//! outside the crate only with the feature `test-util` (idem's own tests reach
//! [`Claims`] through `idem_runtime::test_util`), so a service can neither
//! implement nor call them.

use std::future::Future;
use std::time::Duration;

use sqlx::Pool;
use sqlx::migrate::Migrator;

use super::{Backend, ClaimContext, Tx};
use crate::model::{
    Claim, ClaimRequest, Execution, FencedWrite, Finish, InFlightSummary, KeyAddress, KeyRecord,
    KeyUse, PurgeError, ResealRow, Resource, StatsSnapshot, StoreError, StoredResponse,
};

/// idem's table and how it comes to be: the migrations.
pub trait Schema: sqlx::Database {
    /// idem's embedded migrations for this database, tracked in
    /// [`super::MIGRATIONS_TABLE`].
    fn migrator() -> Migrator;

    /// Applies `migrator`'s migrations (and, on SQLite, converts what SQL
    /// cannot).
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The transactional mode: the claim and the completion on the connection of
/// a transaction the caller began (`idem_runtime::claim`, `Execution::complete`),
/// and the handler's path when its claims are not at commit.
pub trait Claims: sqlx::Database {
    /// Claims a key on the connection of the caller's transaction.
    fn claim(
        conn: &mut Self::Connection,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Stores an execution's outcome on the connection of the transaction that
    /// claimed it.
    fn complete(
        execution: Execution,
        conn: &mut Self::Connection,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The handler's path: the transaction idem begins for an `#[idempotent]`
/// handler, claimed in as few round trips as the database allows, and its end.
pub trait HandlerPath: Claims {
    /// Begins a transaction on a connection of `ctx`'s pool and claims the key
    /// in it. The [`Tx`] comes back whatever the claim decided (dropping it
    /// releases the connection); only [`Claim::Execute`] leaves its transaction
    /// open.
    fn begin_claim(
        ctx: &ClaimContext<'_, Self>,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<(Tx<Self>, Claim), StoreError>> + Send
    where
        Self: Backend;

    /// Stores the outcome in `tx` and commits.
    fn finish(
        ctx: &ClaimContext<'_, Self>,
        tx: Tx<Self>,
        execution: Execution,
        response: &StoredResponse,
    ) -> impl Future<Output = Finish> + Send
    where
        Self: Backend;

    /// After `execution` rolled back: what to answer instead of its own
    /// outcome, when another execution finished the key meanwhile. Only a
    /// database that claims at commit can find one; the others held the key
    /// from the claim on.
    fn taken_since(
        ctx: &ClaimContext<'_, Self>,
        execution: &Execution,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send {
        let _ = (ctx, execution);
        std::future::ready(Ok(None))
    }
}

/// Retention and numbers, on the database's clock.
pub trait Upkeep: sqlx::Database {
    /// Deletes at most `limit` finished, expired rows, oldest expiry first, in a
    /// statement of its own; never a `processing` or `uncertain` row.
    fn delete_batch(
        pool: &Pool<Self>,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts the finished, expired rows still present.
    fn backlog(pool: &Pool<Self>) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Summarises the rows in flight (`processing` or `uncertain`).
    fn in_flight(
        pool: &Pool<Self>,
        stale_after: Duration,
    ) -> impl Future<Output = Result<InFlightSummary, StoreError>> + Send;

    /// The table's numbers in one consistent snapshot.
    fn snapshot(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<StatsSnapshot, StoreError>> + Send;
}

/// State transitions of the application's own rows.
pub trait Transitions: sqlx::Database {
    /// Reads `(state, version)` of a resource and holds it against other
    /// transitions until the transaction ends.
    fn lock_state<'c>(
        conn: &'c mut Self::Connection,
        resource: &'c Resource,
        id: i64,
        scope: Option<&'c str>,
    ) -> impl Future<Output = Result<Option<(String, i64)>, sqlx::Error>> + Send + 'c;

    /// Moves the state if the version is still the one read; the new version.
    fn write_state<'c>(
        conn: &'c mut Self::Connection,
        write: FencedWrite<'c>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'c;
}

/// The admin purge of one key, which each database locks the row for its own
/// way.
pub trait Purge: sqlx::Database {
    /// Deletes one key's row under a lock taken within `wait`, if `allow` agrees
    /// with its state; the deleted row's state and generation.
    fn purge<E: Send>(
        pool: &Pool<Self>,
        key: &KeyAddress<'_>,
        wait: Duration,
        allow: impl FnOnce(&str) -> Result<(), E> + Send,
    ) -> impl Future<Output = Result<Option<(String, i64)>, PurgeError<E>>> + Send;
}

/// Re-sealing stored answers under a key ring's active key (`admin::rekey`).
pub trait Rekey: sqlx::Database {
    /// Up to `limit` finished rows after `after` (in primary key order) whose
    /// answer is sealed with another key than `active`, and those stored in
    /// clear when `clear`.
    fn rekey_page(
        pool: &Pool<Self>,
        active: &str,
        clear: bool,
        after: Option<&ResealRow>,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<ResealRow>, StoreError>> + Send;

    /// Writes `sealed` over `row`'s answer if the row still holds the
    /// execution and the answer `row` read; the rows written (0 or 1).
    fn reseal(
        pool: &Pool<Self>,
        row: &ResealRow,
        sealed: &StoredResponse,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Finished rows by the key their answer is sealed with (`None`: clear).
    fn keys_in_use(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<KeyUse>, StoreError>> + Send;
}

/// What the admin CLI reads and deletes.
pub trait Admin: Purge + Rekey {
    /// The migration versions recorded as applied; none before the first.
    fn applied_versions(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<i64>, StoreError>> + Send;

    /// One key's row, its body only when `with_body`.
    fn fetch_record(
        pool: &Pool<Self>,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<KeyRecord>, StoreError>> + Send;

    /// Deletes at most `limit` of `tenant`'s rows in a statement of its own: the
    /// finished ones (not a leased execution's, live or lapsed), or every one
    /// with `all`;
    /// never a row a running transaction holds. How many it deleted.
    fn erase_tenant_batch(
        pool: &Pool<Self>,
        tenant: &str,
        limit: u32,
        all: bool,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// How many rows `tenant` has, in every operation and state.
    fn tenant_rows(
        pool: &Pool<Self>,
        tenant: &str,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}
