//! Hooks for idem's own tests and bench (feature `test-util`, off by default,
//! as tokio's): the store traits' methods below the handler's path, the
//! decision core the oracle test holds every store to, and switches that force
//! one path of a store. Not a public API: names and signatures here change
//! without notice, and nothing in a service should turn the feature on.

use std::time::Duration;

pub use crate::db::ClaimContext;
pub use crate::db::stores::{Claims, HandlerPath};
pub use crate::model::Finish;
pub use crate::response::replay;

/// MySQL's handler path: which form of its claiming insert to send, whatever
/// the server would be found to support (`None` gives the choice back).
#[cfg(feature = "mysql")]
pub use crate::db::mysql::hot_path::{assume_in_transaction, assume_set_statement};

/// The claim decisions, transactional and leased, as pure functions over a
/// snapshot of the key's row.
pub mod decide {
    pub use crate::decide::{
        KeySnapshot, LeasedStep, RowState, TransactionalStep, after_execution, leased,
        transactional,
    };
    pub use crate::model::LeasedOutcome;
}

/// `idem` as a replica that answered none of the keys it meets: replay hints
/// on (with what they allow, such as the read after a failed probe on an idle
/// connection), and no key ever remembered, so that every retry begins with the
/// probe, as one that reaches another process does.
#[cfg(feature = "postgres")]
pub fn as_another_replica(idem: crate::Idem<sqlx::Postgres>) -> crate::Idem<sqlx::Postgres> {
    idem.with_forgetful_hints()
}

/// What a claim on the handler's path needs of `idem`, for a request whose
/// in-flight wait is `in_flight_wait`: the argument of [`HandlerPath::begin_claim`]
/// and [`HandlerPath::finish`].
pub fn claim_context<DB: crate::db::Backend>(
    idem: &crate::Idem<DB>,
    in_flight_wait: Duration,
) -> ClaimContext<'_, DB> {
    idem.claim_context(in_flight_wait)
}

pub use crate::model::Renewed;

/// Renews `leases` (all of one store) in one batch, as the process's renewal
/// task does, and answers what the batch learned of each, in order.
///
/// # Panics
///
/// When `leases` is empty.
pub async fn renew_together<DB: crate::lease::LeaseBackend>(
    leases: &[&crate::Lease<DB>],
) -> Result<Vec<Renewed>, crate::StoreError> {
    let rows: Vec<crate::model::Renewal<'_>> = leases.iter().map(|l| l.renewal()).collect();
    DB::lease_renew_many(leases[0].store(), &rows).await
}

/// Marks `lease`'s execution uncertain, then sends the same mark again, as
/// one whose answer was lost is (the handler's path tries a mark three times):
/// what the second answers (it must be `Ok`: the mark is this execution's).
pub async fn mark_uncertain_again<DB: crate::lease::LeaseBackend>(
    lease: crate::Lease<DB>,
) -> Result<(), crate::lease::LeaseError> {
    lease.record_uncertain().await?;
    lease.record_uncertain().await
}

/// Stores `response` as `lease`'s outcome, then sends the same store again, as
/// one whose answer was lost is (the handler's path tries a store three
/// times): what the second answers (it must be `Ok`: the outcome is this
/// execution's).
pub async fn store_outcome_again<DB: crate::lease::LeaseBackend>(
    lease: crate::Lease<DB>,
    response: &crate::StoredResponse,
) -> Result<(), crate::lease::LeaseError> {
    lease.store_outcome(response).await?;
    lease.store_outcome(response).await
}

/// Marks `lease`'s execution uncertain, runs `meanwhile` (a reconciler's
/// round, say), then stores `response` under the lease's token, as a store
/// sent before the mark and held up on its way would arrive: what it answers
/// (it must be a stale owner's: the row is not this execution's to finish).
pub async fn store_after_uncertain<DB: crate::lease::LeaseBackend>(
    lease: crate::Lease<DB>,
    response: &crate::StoredResponse,
    meanwhile: impl std::future::Future<Output = ()>,
) -> Result<(), crate::lease::LeaseError> {
    lease.record_uncertain().await?;
    meanwhile.await;
    lease.store_outcome(response).await
}

/// Lapses `lease` as a taken-over execution that failed does, then renews its
/// old token in a batch, as a renewal sent before the lapse and arriving
/// after it would: what that renewal learns (the lease must be lost).
pub async fn lapse_then_renew<DB: crate::lease::LeaseBackend>(
    lease: crate::Lease<DB>,
) -> Result<Renewed, crate::StoreError> {
    lease.lapse_then_renew().await
}

/// Ends `lease` now as a taken-over execution that failed does: the row stays
/// `processing`, its lease lapsed, as a dead worker's is once its lease ran out.
pub async fn lapse<DB: crate::lease::LeaseBackend>(
    lease: crate::Lease<DB>,
) -> Result<(), crate::lease::LeaseError> {
    lease.lapse().await
}
