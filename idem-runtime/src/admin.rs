//! Operating on single keys and on a whole tenant, for an admin tool (the
//! `idem` CLI is one): which migrations are applied, what one key's row holds,
//! deleting one key's row safely, and erasing every row of a tenant.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::admin::{self, KeyAddress};
//! use idem_runtime::IdempotencyKey;
//!
//! # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! // Stores keep the key's digest; an address holds nothing else.
//! let key = KeyAddress::of("acme", "create-order", &IdempotencyKey::parse("order-42")?);
//! if let Some(record) = admin::show(&pool, &key, false).await? {
//!     println!("{} (generation {})", record.state, record.generation);
//! }
//! // Refuse to delete a row whose effect may have happened without its record.
//! let purged = admin::purge(&pool, &key, Duration::from_secs(2), |state| {
//!     if state == "uncertain" { Err("reconcile it first") } else { Ok(()) }
//! })
//! .await?;
//! # drop(purged);
//! # Ok(()) }
//! ```

use std::time::Duration;

use sqlx::Pool;

use crate::db::Backend;
use crate::model::StoreError;

pub use crate::model::{InFlightRows, KeyAddress, KeyRecord, PurgeError, TenantErasure};

/// The versions of idem's migrations recorded as applied (in
/// [`crate::MIGRATIONS_TABLE`]); none before the first migration.
///
/// # Errors
///
/// [`StoreError::Database`] when the database fails.
pub async fn applied_migrations<DB: Backend>(pool: &Pool<DB>) -> Result<Vec<i64>, StoreError> {
    DB::applied_versions(pool).await
}

/// The key's row, its body only when `with_body` (so that a plain look never
/// moves a body out of the database); `None` when there is no row.
///
/// # Errors
///
/// [`StoreError::Database`] when the database fails (a missing table included).
pub async fn show<DB: Backend>(
    pool: &Pool<DB>,
    key: &KeyAddress<'_>,
    with_body: bool,
) -> Result<Option<KeyRecord>, StoreError> {
    DB::fetch_record(pool, key, with_body).await
}

/// Deletes the key's row in one transaction that first locks it against running
/// requests (PostgreSQL: the row; SQLite: the database's write lock, the only
/// lock it has), waiting at most `wait`. `allow` sees the locked row's state and
/// may refuse; then nothing is deleted. Returns the deleted row's state and
/// generation, `None` when there was no row.
///
/// Once the row is gone, a retry with that key executes anew: purge only what
/// you know is safe to run again.
///
/// # Errors
///
/// [`PurgeError::Locked`] past the wait, [`PurgeError::Refused`] with what
/// `allow` said, [`PurgeError::Store`] when the database fails.
pub async fn purge<DB: Backend, E: Send>(
    pool: &Pool<DB>,
    key: &KeyAddress<'_>,
    wait: Duration,
    allow: impl FnOnce(&str) -> Result<(), E> + Send,
) -> Result<Option<(String, i64)>, PurgeError<E>> {
    DB::purge(pool, key, wait, allow).await
}

/// How many rows [`erase_tenant`] deletes per statement by default.
pub const ERASE_BATCH: u32 = 1_000;

/// Deletes every row of `tenant`, in every operation, in statements of at most
/// `batch` rows (each its own transaction, so that erasing a large tenant holds
/// no long lock): its stored answers, the resources of its long operations and
/// everything the stats count of it go with them.
///
/// Rows of executions in flight are left unless `in_flight` is
/// [`InFlightRows::Erase`]: a leased execution's row whose lease is live (its
/// fenced completion would find nothing, and a retry would run the effect
/// again), an `uncertain` row (the reconciler's only record that an effect may
/// have happened), and a row a running transaction holds (never waited on).
/// They are counted in [`TenantErasure::left`]: erase again once they have
/// finished. A request of the tenant that commits after the erasure writes its
/// row as ever, so stop the tenant's traffic first. Each process's replay cache
/// (feature `replay-cache`) keeps what it holds until its
/// `Idem::clear_replay_cache` ([`crate::Idem::erase_tenant`] clears its own).
///
/// ```no_run
/// use idem_runtime::admin::{self, InFlightRows};
///
/// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// let done = admin::erase_tenant(&pool, "acme", admin::ERASE_BATCH, InFlightRows::Keep).await?;
/// println!("{} rows erased, {} in flight left", done.erased, done.left);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`StoreError::InvalidRequest`] for an empty tenant id, [`StoreError::Database`]
/// when the database fails (the batches before it stay erased: erase again).
pub async fn erase_tenant<DB: Backend>(
    pool: &Pool<DB>,
    tenant: &str,
    batch: u32,
    in_flight: InFlightRows,
) -> Result<TenantErasure, StoreError> {
    if tenant.is_empty() {
        return Err(StoreError::InvalidRequest(
            "an empty tenant id: no row has one".to_owned(),
        ));
    }
    let batch = batch.max(1);
    let all = in_flight == InFlightRows::Erase;
    let mut erased = 0;
    loop {
        let n = DB::erase_tenant_batch(pool, tenant, batch, all).await?;
        erased += n;
        // A short batch found nothing more it may delete (`SKIP LOCKED` leaves
        // out only rows it must not wait on).
        if n < u64::from(batch) {
            break;
        }
    }
    let left = DB::tenant_rows(pool, tenant).await?;
    Ok(TenantErasure { erased, left })
}
