//! Leased mode: what a leased claim asks and decides, the owner token that
//! fences an execution's writes, renewals, and the rows reconciliation and the
//! operation resource read.

use std::sync::Arc;
use std::time::Duration;

use super::{StoreError, StoredResponse};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyDigest};

/// What a leased claim needs.
#[derive(Debug, Clone)]
pub struct LeaseRequest<'a> {
    /// The caller's tenant id.
    pub tenant: &'a str,
    /// The operation's stable name.
    pub operation: &'a str,
    /// The validated key.
    pub key: &'a IdempotencyKey,
    /// The logical request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the outcome is kept after completion: at least 1 ms (less is
    /// refused), at most a century (more is taken as that, as is a lease).
    pub retention: Duration,
    /// How long the claim is owned without renewal.
    pub lease: Duration,
}

/// How a lease was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquisition {
    /// A new key.
    New,
    /// A finished outcome whose retention had passed: a new execution.
    Reclaimed,
    /// An execution whose lease lapsed: its worker died or stalled. The effect may
    /// have happened; call downstream with [`crate::Lease::downstream_key`] so it
    /// is not repeated.
    TakenOver,
}

/// What a leased claim decided, before a [`crate::Lease`] is built around it.
#[derive(Debug)]
pub enum LeasedOutcome {
    /// The caller owns the execution under `token`.
    Acquired {
        /// How the execution was acquired.
        acquisition: Acquisition,
        /// The owner token that fences every later statement.
        token: OwnerToken,
        /// The generation the execution holds.
        generation: i64,
    },
    /// A stored outcome with the same fingerprint.
    Replay(StoredResponse),
    /// The key is in use for a different request.
    Mismatch,
    /// Another worker holds a live lease, seen on the key's record.
    InFlight {
        /// How long the caller is asked to wait.
        retry_after: Duration,
    },
    /// Another claim of the key held its record past the claim's wait (or
    /// won the race to create it): nothing was read, not even whether this
    /// request is the one the key was first used for.
    Contended {
        /// How long the caller is asked to wait.
        retry_after: Duration,
    },
    /// The database stayed locked by other writers (see [`crate::Claim::Busy`]).
    Busy {
        /// How long the caller is asked to wait.
        retry_after: Duration,
    },
    /// An earlier execution's effect is unknown.
    Uncertain,
}

/// An execution's owner token: what every fenced write of leased mode matches,
/// new at every claim (a UUID made by PostgreSQL's claim, 128 random bits as
/// hex made here for SQLite, MySQL and Redis). Cheap to clone: the lease, its renewer and
/// the uncertain marker each hold it. Binds and reads back as text.
#[derive(Clone, PartialEq, Eq)]
pub struct OwnerToken(Arc<str>);

impl OwnerToken {
    /// A fresh token: 128 random bits, as hex (PostgreSQL's `uuid` takes
    /// them too).
    pub(crate) fn random() -> Self {
        OwnerToken(format!("{:032x}", fastrand::u128(..)).into())
    }

    /// The token's text, as stores compare it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for OwnerToken {
    fn from(token: String) -> Self {
        OwnerToken(token.into())
    }
}

impl std::fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OwnerToken({})", self.0)
    }
}

text_column!(OwnerToken, |text| Ok(OwnerToken(text.into())));

// ... and as a Redis script's argument.
#[cfg(feature = "redis")]
impl redis::ToRedisArgs for OwnerToken {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.write_arg(self.as_str().as_bytes());
    }
}

#[cfg(feature = "redis")]
impl redis::ToSingleRedisArg for OwnerToken {}

/// An owned row, as the fenced statements match it: primary key and owner token.
#[derive(Debug, Clone, Copy)]
pub struct Owned<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) key: KeyDigest,
    pub(crate) token: &'a OwnerToken,
}

/// One lease of a batch renewal: the owned row and its lease's length, counted
/// from when the store renews it.
#[derive(Debug, Clone, Copy)]
pub struct Renewal<'a> {
    pub(crate) row: Owned<'a>,
    pub(crate) lease: Duration,
}

impl<'a> Renewal<'a> {
    /// `rows` grouped by lease length, in order of length: a statement can then
    /// set one expiry expression for all of a group's rows (the leases of one
    /// operation share their length).
    #[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
    pub(crate) fn by_lease<'r>(rows: &'r [Renewal<'a>]) -> Vec<(Duration, Vec<&'r Renewal<'a>>)> {
        let mut groups: Vec<(Duration, Vec<&'r Renewal<'a>>)> = Vec::new();
        for r in rows {
            match groups.iter_mut().find(|(lease, _)| *lease == r.lease) {
                Some((_, of)) => of.push(r),
                None => groups.push((r.lease, vec![r])),
            }
        }
        groups.sort_unstable_by_key(|(lease, _)| *lease);
        groups
    }
}

/// What a batch renewal learned of one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// Renewed: the lease holds for its length from the statement.
    Kept,
    /// The row is not this execution's any more (taken over, released,
    /// finished): the lease is lost.
    Lost,
    /// Neither (another transaction held the row, and the batch did not wait
    /// for it): renew again soon.
    Unknown,
}

/// A fenced statement other than storing the outcome.
#[derive(Debug, Clone, Copy)]
pub enum Fence {
    /// Extend the lease by this much from now.
    Renew(Duration),
    /// Mark the row `uncertain`.
    Uncertain,
    /// Delete the row: the effect did not happen.
    Release,
    /// End the lease now, the row kept `processing` under a fresh token (a
    /// renewal of the old one already sent finds it lost): the next claim
    /// takes the key over (see `Lease::lapse`).
    Lapse,
}

/// An `uncertain` row awaiting reconciliation.
#[derive(Debug, Clone)]
pub struct UncertainRow {
    pub(crate) tenant: String,
    /// The key's digest (the key itself is not stored).
    pub(crate) key: KeyDigest,
    /// The key the downstream system knows the effect by, stored at the claim
    /// because it cannot be derived from the digest. `None` only in a row
    /// written by hand: it cannot be reconciled.
    pub(crate) downstream_key: Option<String>,
    /// The generation that became uncertain.
    pub(crate) generation: i64,
    /// The owner token of the execution that became uncertain: what a
    /// resolution is fenced by.
    pub(crate) token: Option<OwnerToken>,
    /// When it was created, in the database's own units (for paging).
    pub(crate) created: i64,
}

/// One key's row as its operation resource reads it (see `crate::operations`):
/// what state it is in, whether its lease is live by the store's clock, and the
/// stored outcome once there is one. A finished row past its retention is read
/// as no row: the key no longer answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationRow {
    /// The row's state.
    pub(crate) state: crate::decide::RowState,
    /// `processing` only: the owner's lease has not lapsed.
    pub(crate) lease_live: bool,
    /// `completed` and `failed`: the stored outcome (its body empty unless it
    /// was asked for).
    pub(crate) outcome: Option<StoredResponse>,
}

/// An uncertain execution to resolve.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UncertainOutcome {
    /// The tenant.
    pub tenant: String,
    /// The operation.
    pub operation: String,
    /// The digest of the key the client sent ([`crate::IdempotencyKey::digest`]):
    /// stores keep no raw key, so neither can the reconciler.
    pub key_digest: KeyDigest,
    /// The key the downstream system knows the effect by, as recorded when the
    /// execution claimed the key ([`crate::lease::downstream_key`]).
    pub downstream_key: String,
    /// The generation of the execution that became uncertain.
    pub generation: i64,
}

impl UncertainRow {
    /// What the reconciler asks the application about for this row of
    /// `operation`.
    pub(crate) fn outcome(&self, operation: &str) -> Result<UncertainOutcome, StoreError> {
        let downstream_key = self.downstream_key.clone().ok_or_else(|| {
            StoreError::Corrupt("an uncertain row without its downstream key".into())
        })?;
        Ok(UncertainOutcome {
            downstream_key,
            tenant: self.tenant.clone(),
            operation: operation.to_owned(),
            key_digest: self.key,
            generation: self.generation,
        })
    }
}
