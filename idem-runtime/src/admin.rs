//! Operating on single keys and on a whole tenant, for an admin tool (the
//! `idem` CLI is one): which migrations are applied, what one key's row holds,
//! deleting one key's row safely, erasing every row of a tenant, and
//! re-sealing stored answers under a key ring's active key.
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

use std::ops::ControlFlow;
use std::time::Duration;

use sqlx::Pool;

use crate::at_rest::KeyRing;
use crate::db::Backend;
use crate::model::StoreError;

pub use crate::model::{
    InFlightRows, KeyAddress, KeyRecord, KeyUse, PurgeError, RekeyOptions, RekeyReport,
    TenantErasure,
};

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
/// again) or lapsed (its effect may have happened: its retry takes it over and
/// is told [`crate::lease::Acquisition::TakenOver`], where a retry of a deleted row
/// would be told `New`), an `uncertain` row (the reconciler's only record that an effect may
/// have happened), and a row a running transaction holds (never waited on;
/// SQLite has no row locks, so there a writer holding the database's write
/// lock past the pool's busy timeout makes the erasure fail instead, to be run
/// again).
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

/// Re-seals every finished answer that is not sealed with `ring`'s active key
/// (and, with [`RekeyOptions::seal_clear`], every answer stored in clear),
/// a page of [`RekeyOptions::batch`] rows at a time, so that a key can be
/// retired before the rows it sealed have passed their retention (see
/// `docs/security.md`, "Rotation").
///
/// Safe beside live traffic and beside another rekey: each answer is written
/// back in a statement of its own, and only if its row still holds the same
/// execution and the same sealed bytes it read; one that changed meanwhile
/// (run again, purged, swept, or re-sealed by the other rekey) is left and
/// counted in [`RekeyReport::changed`]. Killed at any point, it loses nothing:
/// every answer is whole under one key or the other, and a second run does
/// what is left. Answers sealed with a key the ring lacks are counted by key
/// in [`RekeyReport::unreadable`] and left; so are answers that do not open for
/// their row ([`RekeyReport::broken`]).
///
/// `progress` is told the report so far after each page; `ControlFlow::Break`
/// stops the run there ([`RekeyReport::stopped`]).
///
/// ```no_run
/// use std::ops::ControlFlow;
/// use idem_runtime::{KeyRing, admin::{self, RekeyOptions}};
///
/// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
/// # async fn demo(pool: sqlx::PgPool, ring: KeyRing) -> Result<(), idem_runtime::StoreError> {
/// let report = admin::rekey(&pool, &ring, RekeyOptions::default(), |so_far| {
///     eprintln!("{} re-sealed", so_far.resealed);
///     ControlFlow::Continue(())
/// })
/// .await?;
/// for used in admin::keys_in_use(&pool).await? {
///     println!("{:?}: {} rows", used.key_id, used.rows);
/// }
/// # drop(report);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`StoreError::Database`] when the database fails; what was re-sealed
/// before stays re-sealed.
pub async fn rekey<DB: Backend>(
    pool: &Pool<DB>,
    ring: &KeyRing,
    options: RekeyOptions,
    mut progress: impl FnMut(&RekeyReport) -> ControlFlow<()>,
) -> Result<RekeyReport, StoreError> {
    let batch = options.batch.max(1);
    let mut report = RekeyReport::default();
    let mut after = None;
    loop {
        let page = DB::rekey_page(
            pool,
            ring.active_id(),
            options.seal_clear,
            after.as_ref(),
            batch,
        )
        .await?;
        for row in &page {
            let (tenant, operation, key) = &row.at;
            let Some(stored) = row.stored.clone() else {
                report.broken += 1;
                continue;
            };
            let Some(clear) = crate::at_rest::opened_to_reseal(
                ring,
                tenant,
                operation,
                key,
                stored,
                &mut report,
            )?
            else {
                continue;
            };
            let at = crate::at_rest::RowId {
                tenant,
                operation,
                key,
                generation: row.generation,
            };
            let sealed = ring.seal(&at, &clear)?;
            match DB::reseal(pool, row, &sealed).await? {
                0 => report.changed += 1,
                _ => report.resealed += 1,
            }
        }
        report.pages += 1;
        let full = page.len() >= batch as usize;
        after = page.into_iter().last();
        if progress(&report).is_break() {
            report.stopped = full;
            break;
        }
        if !full {
            break;
        }
    }
    Ok(report)
}

/// How many finished rows hold an answer sealed with each key, and in clear
/// (`key_id` `None`), in the order of the keys' ids (clear first): which keys
/// a ring must still hold.
///
/// # Errors
///
/// [`StoreError::Database`] when the database fails.
pub async fn keys_in_use<DB: Backend>(pool: &Pool<DB>) -> Result<Vec<KeyUse>, StoreError> {
    let mut used = DB::keys_in_use(pool).await?;
    // Databases sort NULL apart: clear first, everywhere.
    used.sort_by(|a, b| a.key_id.cmp(&b.key_id));
    Ok(used)
}
