//! Operating on single keys, for an admin tool (the `idem` CLI is one): which
//! migrations are applied, what one key's row holds, and deleting one key's row
//! safely.
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

pub use crate::model::{KeyAddress, KeyRecord, PurgeError};

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
