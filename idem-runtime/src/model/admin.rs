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
    /// Rows of the tenant still there: executions in flight (a lease, live or
    /// lapsed, an uncertain outcome the reconciler owes an answer) and rows a running
    /// transaction holds, unless [`InFlightRows::Erase`] was asked for. Erase
    /// again once they have finished.
    pub left: u64,
}

/// What [`crate::admin::erase_tenant`] does with a tenant's executions that
/// are in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlightRows {
    /// Leaves them (counted in [`TenantErasure::left`]): a leased execution's
    /// row (its lease live, or lapsed: the retry is then a takeover, told so)
    /// and an uncertain row are what stands between a retry and a second
    /// effect.
    Keep,
    /// Deletes them too. A retry of such a key executes again, and an
    /// uncertain effect is never reconciled: for a tenant whose traffic has
    /// stopped, or when a second effect does not matter.
    Erase,
}

/// How [`crate::admin::rekey`] goes through the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RekeyOptions {
    /// Rows read and re-sealed per page (at least 1).
    pub batch: u32,
    /// Also seal the answers stored in clear (before sealing was turned on).
    pub seal_clear: bool,
}

impl Default for RekeyOptions {
    /// 500 rows a page; clear answers left as they are.
    fn default() -> Self {
        RekeyOptions {
            batch: 500,
            seal_clear: false,
        }
    }
}

/// What a [`crate::admin::rekey`] did, so far (its progress) or in all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RekeyReport {
    /// Answers re-sealed with the active key.
    pub resealed: u64,
    /// Answers that changed while they were re-sealed (the key ran again,
    /// was purged or swept, or another rekey got there first): left as they
    /// now are.
    pub changed: u64,
    /// Answers sealed with a key the ring lacks, by that key's id: left as
    /// they are (add the key to the ring and run again).
    pub unreadable: std::collections::BTreeMap<String, u64>,
    /// Answers that did not open for their row (changed in the table by
    /// someone else), rows whose answer does not read as one at all, and,
    /// with a ring that refuses clear answers
    /// (`KeyRing::refusing_clear_answers`), answers in clear: left as they
    /// are, and never replayed.
    pub broken: u64,
    /// Records of `consumer::process_once`: they hold no answer, so they are
    /// left in clear (with any ring) and are not broken.
    pub messages: u64,
    /// Pages read.
    pub pages: u64,
    /// Whether the progress callback stopped the run before the end.
    pub stopped: bool,
}

impl RekeyReport {
    /// Whether every answer that needed it was re-sealed: none left
    /// unreadable or broken, and the run not stopped.
    pub fn complete(&self) -> bool {
        self.unreadable.is_empty() && self.broken == 0 && !self.stopped
    }
}

/// How many finished rows hold an answer sealed with one key, or in clear
/// (`key_id` `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyUse {
    /// The key's id; `None` for answers stored in clear.
    pub key_id: Option<String>,
    /// Finished rows.
    pub rows: u64,
}

/// A finished row a rekey reads: its address and generation, its answer as
/// stored, and its body as stored (what the re-seal checks is still there).
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct ResealRow {
    /// Tenant, operation and key digest: the row's primary key.
    pub(crate) at: (String, String, KeyDigest),
    pub(crate) generation: i64,
    /// When the row's execution began, in the database's units: with the
    /// generation, what tells it from a later execution of the key.
    pub(crate) created: i64,
    /// The answer as stored; `None` where the row's columns do not read as
    /// one (spoiled by hand): counted as broken, never written.
    pub(crate) stored: Option<super::StoredResponse>,
}
