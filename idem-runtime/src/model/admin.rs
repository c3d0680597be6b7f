//! One key, as the admin reads and purges it (re-exported by `crate::admin`).

use super::StoreError;
use crate::key::{IdempotencyKey, KeyDigest};

/// One key's address: the three parts of the table's primary key.
#[derive(Debug, Clone, Copy)]
pub struct KeyAddress<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Operation name.
    pub operation: &'a str,
    /// The digest of the `Idempotency-Key` ([`IdempotencyKey::digest`]): what the
    /// table keeps instead of the key.
    pub digest: KeyDigest,
}

impl<'a> KeyAddress<'a> {
    /// The address of `key` under `tenant` and `operation`.
    pub fn of(tenant: &'a str, operation: &'a str, key: &IdempotencyKey) -> Self {
        KeyAddress {
            tenant,
            operation,
            digest: key.digest(),
        }
    }
}

/// One key's row, in the same form on every database: timestamps as RFC 3339
/// text in UTC (whole seconds, formatted by the database from its own values),
/// the fingerprint in lowercase hex, the header JSON as text.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// `processing`, `completed`, `failed` or `uncertain`.
    pub state: String,
    /// Which execution of the key the row holds (1 for the first).
    pub generation: i64,
    /// The request's fingerprint, in lowercase hex.
    pub fingerprint: String,
    /// When the current execution claimed the key.
    pub created_at: String,
    /// When its outcome was stored, if it was.
    pub completed_at: Option<String>,
    /// When the key is forgotten.
    pub expires_at: String,
    /// `expires_at` has passed, by the database clock.
    pub expired: bool,
    /// Leased mode: when the running execution's lease ends.
    pub lease_expires_at: Option<String>,
    /// The stored status, if an outcome is stored.
    pub response_status: Option<i64>,
    /// The stored body's size in bytes.
    pub body_bytes: Option<i64>,
    /// The stored headers' JSON (`[[name, value], ...]`), as text.
    pub response_headers: Option<String>,
    /// The body, only when asked for.
    pub body: Option<Vec<u8>>,
}

/// Why a [`crate::admin::purge`] deleted nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PurgeError<E> {
    /// The key's row (on SQLite: the database) stayed locked by a running request
    /// for the whole wait.
    #[error("{0}")]
    Locked(&'static str),
    /// The caller's check refused the row's state.
    #[error("refused")]
    Refused(E),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What [`crate::admin::erase_tenant`] did: the tenant's rows it deleted, and
/// the rows it left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TenantErasure {
    /// Rows deleted.
    pub erased: u64,
    /// Rows of the tenant still there: executions in flight (a live lease, an
    /// uncertain outcome the reconciler owes an answer) and rows a running
    /// transaction holds, unless [`InFlightRows::Erase`] was asked for. Erase
    /// again once they have finished.
    pub left: u64,
}

/// What [`crate::admin::erase_tenant`] does with a tenant's executions that
/// are in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlightRows {
    /// Leaves them (counted in [`TenantErasure::left`]): a live lease's row and
    /// an uncertain row are what stands between a retry and a second effect.
    Keep,
    /// Deletes them too. A retry of such a key executes again, and an
    /// uncertain effect is never reconciled: for a tenant whose traffic has
    /// stopped, or when a second effect does not matter.
    Erase,
}
