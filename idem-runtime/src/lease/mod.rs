//! Leased mode: for operations whose effect lives outside the database (a payment
//! provider, an e-mail service), where no local transaction can hold the effect
//! and its record together.
//!
//! ```text
//! [none] --claim (commits at once)--> processing(owner A, gen 1, lease)
//! processing --A renews while alive--> processing (lease extended)
//! processing --lease lapses, B claims--> processing(owner B, gen 2)   "taken over"
//! processing --owner completes (fenced by token)--> completed | failed
//! processing --owner reports the effect unknown--> uncertain
//! processing --owner fails before the effect--> [none] (released)
//! uncertain --reconciler asks downstream--> completed | failed | [none]
//! A completes after B took over --> rejected: A's result is never published
//! ```
//!
//! Every claim commits on its own with a fresh owner token and a higher
//! generation. Completion is `UPDATE ... WHERE owner_token = $`: a worker that
//! stalled past its lease and was taken over cannot publish. Downstream calls
//! carry [`Lease::downstream_key`], identical for every owner of the key, so the
//! downstream system's own idempotency turns a taken-over retry into a no-op.
//!
//! It runs on every database idem runs on (the pool's type picks it) and, with
//! the feature `redis`, on a Redis store ([`LeaseBackend`] is the seam). A claim
//! that cannot get its lock in time answers [`LeasedClaim::Contended`] (retry,
//! as for "in flight"): on PostgreSQL after 200 ms on the key's row, on MySQL
//! after its lock wait. On SQLite, past the connection's busy timeout on the
//! database's one write lock, it answers [`LeasedClaim::Busy`] (`503`
//! `store-busy`) instead. On Redis a claim is one
//! script and waits for nothing. On Redis a finished record that expired
//! is forgotten whole, so its next execution starts again at generation 1.
//!
//! The module holds the lease itself ([`Lease`], [`claim_leased`]); its background
//! renewal is in `renewal`, the answer for an unknown outcome ([`Uncertain`]) in
//! `answer`, and the statements in each database's module.
use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use crate::at_rest::{KeyRing, open, open_replay};
use crate::db::Backend;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyDigest};
use crate::model::{Fence, LeasedOutcome, Owned, OwnerToken, StoreError, StoredResponse};

mod answer;
mod renewal;
mod renewals;

pub use crate::db::leases::LeaseBackend;
pub use crate::model::{Acquisition, LeaseRequest};
pub use answer::Uncertain;
pub(crate) use answer::UncertainMarker;
pub(crate) use renewal::Renewer;
pub(crate) use renewals::Renewals;

/// What a leased claim decided.
#[must_use = "an acquired lease must be completed, marked uncertain or released"]
#[non_exhaustive]
pub enum LeasedClaim<DB: LeaseBackend> {
    /// The caller owns the execution.
    Acquired(Lease<DB>),
    /// A stored outcome with the same fingerprint.
    Replay(StoredResponse),
    /// The key is in use for a different request.
    Mismatch,
    /// Another worker holds a live lease.
    InFlight {
        /// Until its lease lapses, at least one second.
        retry_after: Duration,
    },
    /// Another claim of the key held its record longer than the claim waits
    /// for it (on PostgreSQL 200 ms, on MySQL its lock wait), or created it
    /// at the same moment: nothing was looked at, not even whether this
    /// request is the one the key was first used for. Answer it as
    /// [`LeasedClaim::InFlight`] (retry later), never as that execution's.
    Contended {
        /// A hint for `Retry-After`, at least one second.
        retry_after: Duration,
    },
    /// An earlier execution's effect is unknown and awaits reconciliation; nothing
    /// runs again until it is resolved.
    Uncertain,
    /// The database stayed locked by other writers longer than the claim could
    /// wait (SQLite's one write lock): nothing was looked at or reserved.
    Busy {
        /// A hint for `Retry-After`, at least one second.
        retry_after: Duration,
    },
}

/// Ownership of one execution in leased mode.
///
/// Dropping it without completing leaves the row `processing` until its lease
/// lapses; the next claim then takes it over (what a crash does).
pub struct Lease<DB: LeaseBackend> {
    pool: DB::Store,
    tenant: String,
    operation: String,
    key: IdempotencyKey,
    token: OwnerToken,
    generation: i64,
    acquisition: Acquisition,
    lease: Duration,
    retention: Duration,
    fingerprint: Fingerprint,
    /// When the lease is to be taken as lost (see `renewal::Deadline`).
    deadline: Arc<renewal::Deadline>,
    /// What its outcome is sealed with, if anything (see [`crate::at_rest`]).
    ring: Option<KeyRing>,
}

/// Why a leased completion was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The lease was taken over: this worker no longer owns the execution, and its
    /// result must not be published.
    #[error("the lease of generation {generation} was taken over; its result is not published")]
    StaleOwner {
        /// The stale generation.
        generation: i64,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for LeaseError {
    fn from(e: sqlx::Error) -> Self {
        LeaseError::Store(StoreError::Database(e))
    }
}

pub use crate::key::downstream_key;

/// Claims `req.key` in leased mode. The claim commits at
/// once, on its own.
///
/// # Errors
///
/// [`StoreError::InvalidRequest`] for a lease or retention under a
/// millisecond, [`StoreError`] when the database fails; nothing is claimed then.
pub async fn claim_leased<DB: Backend>(
    pool: &Pool<DB>,
    req: &LeaseRequest<'_>,
) -> Result<LeasedClaim<DB>, StoreError> {
    claim_in::<DB>(pool, req, None).await
}

/// [`claim_leased`] where answers are sealed with `ring` (see
/// [`crate::at_rest`]): a replay is opened with it, and the lease's outcome is
/// sealed with its active key.
///
/// # Errors
///
/// As [`claim_leased`], and [`StoreError::SealKeyMissing`] or
/// [`StoreError::SealBroken`] for a stored answer that does not open.
pub async fn claim_leased_with_key_ring<DB: Backend>(
    pool: &Pool<DB>,
    req: &LeaseRequest<'_>,
    ring: &KeyRing,
) -> Result<LeasedClaim<DB>, StoreError> {
    claim_in::<DB>(pool, req, Some(ring)).await
}

/// [`claim_leased`] on any [`LeaseBackend`]'s store: every leased claim,
/// hand-written or the handler's, comes through here. A replay is opened with
/// `ring` (a sealed one without a ring is refused), and the lease's outcome
/// sealed with it.
pub(crate) async fn claim_in<DB: LeaseBackend>(
    store: &DB::Store,
    req: &LeaseRequest<'_>,
    ring: Option<&KeyRing>,
) -> Result<LeasedClaim<DB>, StoreError> {
    crate::model::refuse_under_a_millisecond(req.retention, Some(req.lease))?;
    // The lease is measured from the claim's send time: the store starts it no
    // earlier than it receives the claim.
    let sent = tokio::time::Instant::now();
    let opened = |stored| open_replay(ring, req.tenant, req.operation, req.key, stored);
    Ok(match DB::lease_claim(store, req).await? {
        LeasedOutcome::Acquired {
            acquisition,
            token,
            generation,
        } => LeasedClaim::Acquired(Lease {
            pool: store.clone(),
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.clone(),
            token,
            generation,
            acquisition,
            lease: req.lease,
            retention: req.retention,
            fingerprint: req.fingerprint,
            deadline: Arc::new(renewal::Deadline::new(sent, req.lease)),
            ring: ring.cloned(),
        }),
        LeasedOutcome::Replay(stored) => LeasedClaim::Replay(opened(stored)?),
        LeasedOutcome::Mismatch => LeasedClaim::Mismatch,
        LeasedOutcome::Uncertain => LeasedClaim::Uncertain,
        LeasedOutcome::InFlight { retry_after } => LeasedClaim::InFlight {
            retry_after: retry_after.max(Duration::from_secs(1)),
        },
        LeasedOutcome::Contended { retry_after } => LeasedClaim::Contended {
            retry_after: retry_after.max(Duration::from_secs(1)),
        },
        LeasedOutcome::Busy { retry_after } => LeasedClaim::Busy {
            retry_after: retry_after.max(Duration::from_secs(1)),
        },
    })
}

// Written by hand: derived impls would ask `DB: Debug`.
impl<DB: LeaseBackend> std::fmt::Debug for Lease<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("operation", &self.operation)
            .field("key", &self.key)
            .field("generation", &self.generation)
            .field("acquisition", &self.acquisition)
            .field("lease", &self.lease)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl<DB: LeaseBackend> std::fmt::Debug for LeasedClaim<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeasedClaim::Acquired(lease) => f.debug_tuple("Acquired").field(lease).finish(),
            LeasedClaim::Replay(stored) => f.debug_tuple("Replay").field(stored).finish(),
            LeasedClaim::Mismatch => f.write_str("Mismatch"),
            LeasedClaim::InFlight { retry_after } => f
                .debug_struct("InFlight")
                .field("retry_after", retry_after)
                .finish(),
            LeasedClaim::Contended { retry_after } => f
                .debug_struct("Contended")
                .field("retry_after", retry_after)
                .finish(),
            LeasedClaim::Uncertain => f.write_str("Uncertain"),
            LeasedClaim::Busy { retry_after } => f
                .debug_struct("Busy")
                .field("retry_after", retry_after)
                .finish(),
        }
    }
}

impl<DB: Backend> Lease<DB> {
    /// The pool, for the handler's own database work.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }
}

impl<DB: LeaseBackend> Lease<DB> {
    /// The key for the downstream system's idempotency (see [`downstream_key`]).
    pub fn downstream_key(&self) -> String {
        downstream_key(&self.tenant, &self.operation, &self.key)
    }

    /// This execution's generation: one more at every takeover or reclaim of the
    /// key's record. It counts within one record's life: once the record is gone
    /// (released; on SQL deleted by the sweeper, on Redis expired with its
    /// retention) the next claim starts again at 1, so compare generations only
    /// together with the owner token, never across a record's absence.
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// How the lease was obtained.
    pub fn acquisition(&self) -> Acquisition {
        self.acquisition
    }

    /// The lease's length.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// True once the lease is lost or taken to be: a renewal found the execution
    /// taken over, or the lease's length has passed since the claim or the last
    /// renewal that got through was *sent*, less a margin for the store's
    /// clock and this process's running at rates apart (a millisecond and a
    /// thousandth of the lease), for renewals that hang, the renewal ceiling, or
    /// a hand-written lease nobody renews. Measured from the send time, it turns
    /// true no later than the store could hand the execution to another worker;
    /// once true it stays true. Stop before calling downstream
    /// again. What the handler
    /// returns is still stored if no other worker took over (every store is fenced
    /// by the owner token), and never if one did.
    pub fn is_lost(&self) -> bool {
        self.deadline.is_lost()
    }

    /// The store the lease lives in (a pool, or a Redis store).
    pub fn store(&self) -> &DB::Store {
        &self.pool
    }

    fn owned(&self) -> Owned<'_> {
        Owned {
            tenant: &self.tenant,
            operation: &self.operation,
            key: self.key.digest(),
            token: &self.token,
        }
    }

    /// This lease as a batch renewal names it.
    #[cfg(feature = "test-util")]
    pub(crate) fn renewal(&self) -> crate::model::Renewal<'_> {
        crate::model::Renewal {
            row: self.owned(),
            lease: self.lease,
        }
    }

    /// Lapses the lease, then renews its old token in a batch, as a renewal
    /// sent before the lapse and arriving after it would: what that renewal
    /// learns.
    #[cfg(feature = "test-util")]
    pub(crate) async fn lapse_then_renew(self) -> Result<crate::model::Renewed, crate::StoreError> {
        // What the renewal task holds of the lease, taken before the lapse.
        let late = self.renewer();
        self.lapse().await.map_err(|e| match e {
            LeaseError::Store(e) => e,
            other => crate::StoreError::Corrupt(format!("the lapse: {other}")),
        })?;
        let row = crate::model::Renewal {
            row: late.owned(),
            lease: late.lease,
        };
        Ok(DB::lease_renew_many(&late.pool, &[row]).await?[0])
    }

    pub(crate) fn renewer(&self) -> Renewer<DB> {
        Renewer {
            pool: self.pool.clone(),
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            key: self.key.digest(),
            token: self.token.clone(),
            lease: self.lease,
            deadline: self.deadline.clone(),
        }
    }

    /// Extends the lease by its length from now.
    ///
    /// A lease already taken as lost ([`Lease::is_lost`]: no renewal got
    /// through for a whole lease) stays lost after a renewal that gets
    /// through, and the background renewals have given it up: the renewal
    /// only keeps the key from being taken over for one more lease. Stop
    /// before calling downstream again, and return.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when it was taken over meanwhile.
    pub async fn renew(&self) -> Result<(), LeaseError> {
        if self.renewer().renew().await? {
            Ok(())
        } else {
            Err(LeaseError::StaleOwner {
                generation: self.generation,
            })
        }
    }

    /// Stores the outcome, fenced by this lease's owner token. A 4xx is stored as
    /// `failed`, anything else as `completed`.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over: nothing is stored,
    /// and the result must not be published.
    pub async fn complete(self, response: &StoredResponse) -> Result<(), LeaseError> {
        self.store_outcome(response).await
    }

    /// [`Lease::complete`] without giving the lease up, so a failed attempt can be
    /// retried.
    pub(crate) async fn store_outcome(&self, response: &StoredResponse) -> Result<(), LeaseError> {
        let row = crate::at_rest::RowId {
            tenant: &self.tenant,
            operation: &self.operation,
            key: &self.key.digest(),
            generation: self.generation,
        };
        let kept = crate::at_rest::seal(self.ring.as_ref(), &row, response)?;
        let rows = DB::lease_store(&self.pool, self.owned(), &kept, self.retention).await?;
        self.fenced(rows)
    }

    /// Records that the external effect's outcome is unknown (the provider timed
    /// out after it may have charged). Retries then never execute again; a
    /// [`crate::Reconciler`] resolves the row.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over.
    pub async fn mark_uncertain(self) -> Result<(), LeaseError> {
        self.record_uncertain().await
    }

    /// [`Lease::mark_uncertain`] without giving the lease up.
    pub(crate) async fn record_uncertain(&self) -> Result<(), LeaseError> {
        self.fenced_statement(Fence::Uncertain).await
    }

    /// Gives the key up: the effect did not happen, and a retry may execute anew.
    ///
    /// On a lease that [`Acquisition::TakenOver`] the key, this says that no
    /// earlier execution's effect happened either (you asked downstream): the
    /// next claim is [`Acquisition::New`]. Where only this execution failed,
    /// an `#[idempotent]` handler's `Err` or 5xx lets the lease lapse at once
    /// instead, and the next claim is a takeover again.
    ///
    /// # Errors
    ///
    /// [`LeaseError::StaleOwner`] when the lease was taken over.
    pub async fn release(self) -> Result<(), LeaseError> {
        self.fenced_statement(Fence::Release).await
    }

    /// Ends the lease now and keeps the row `processing`: the next claim takes
    /// the key over at once (generation + 1, [`Acquisition::TakenOver`]), so
    /// it still learns that an earlier execution may have called downstream.
    /// What a taken-over execution that failed leaves, where releasing the key
    /// would tell the next one it is new. The row takes a fresh owner token:
    /// a renewal of this one already on its way (the batch does not wait for
    /// this execution to end) then finds the lease lost instead of renewing
    /// what was just lapsed.
    pub(crate) async fn lapse(self) -> Result<(), LeaseError> {
        self.fenced_statement(Fence::Lapse).await
    }

    /// Runs a fenced statement that must touch exactly this lease's row.
    async fn fenced_statement(&self, what: Fence) -> Result<(), LeaseError> {
        let rows = DB::lease_fence(&self.pool, self.owned(), what).await?;
        self.fenced(rows)
    }

    fn fenced(&self, rows: u64) -> Result<(), LeaseError> {
        if rows == 1 {
            Ok(())
        } else {
            self.deadline.lose();
            Err(LeaseError::StaleOwner {
                generation: self.generation,
            })
        }
    }

    /// The key's current stored outcome, if it has one: what a stale owner's client
    /// is answered with.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database fails.
    pub async fn current_outcome(&self) -> Result<Option<StoredResponse>, StoreError> {
        self.probe().current().await
    }

    pub(crate) fn probe(&self) -> Probe<DB> {
        Probe {
            pool: self.pool.clone(),
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            key: self.key.digest(),
            fingerprint: self.fingerprint,
            ring: self.ring.clone(),
        }
    }
}

/// Reads a key's stored outcome after its lease object is gone.
pub(crate) struct Probe<DB: LeaseBackend> {
    pool: DB::Store,
    tenant: String,
    operation: String,
    key: KeyDigest,
    fingerprint: Fingerprint,
    ring: Option<KeyRing>,
}

impl<DB: LeaseBackend> Probe<DB> {
    pub(crate) async fn current(&self) -> Result<Option<StoredResponse>, StoreError> {
        let found = DB::lease_current(&self.pool, &self.tenant, &self.operation, &self.key).await?;
        // The key may since have been released and reused for another request:
        // its answer is not this client's.
        found
            .filter(|(fingerprint, _)| fingerprint[..] == self.fingerprint.as_bytes()[..])
            .map(|(_, stored)| {
                open(
                    self.ring.as_ref(),
                    &self.tenant,
                    &self.operation,
                    &self.key,
                    stored,
                )
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downstream_keys_are_stable_and_scoped() {
        let k = IdempotencyKey::parse("k1").unwrap();
        let a = downstream_key("acme", "pay", &k);
        assert_eq!(a, downstream_key("acme", "pay", &k));
        assert_eq!(a.len(), 32);
        assert_ne!(a, downstream_key("globex", "pay", &k));
        assert_ne!(a, downstream_key("acme", "refund", &k));
        assert!(!a.contains("k1"));
    }
}
