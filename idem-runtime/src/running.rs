//! Bounds on the leased executions of one operation that run at once in this
//! process ([`crate::Idem::with_running_limit`]).
//!
//! A leased execution holds a slot from the moment its claim acquires the key
//! until its handler returns (or panics), or until its lease is lost, whichever
//! comes first: a lost lease's key may be taken over, in this process too, and a
//! stalled handler must not keep that takeover out. A long operation's work
//! holds its slot on its own task, past the `202`. A process that dies takes its
//! slots with it, and its leases lapse for a takeover elsewhere.
//! A first request that finds the operation full (or its tenant's share full)
//! gives the key back and is answered `503` with `Retry-After`; retries of a
//! running or finished key never take a slot and are answered as always.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How many leased executions of one operation may run at once in one process,
/// and how many of those one tenant may hold.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::RunningLimit;
///
/// // 200 exports at once, at most 20 of them for any one tenant; refused
/// // requests are told to come back in 30 s.
/// let limit = RunningLimit::new(200)
///     .per_tenant(20)
///     .retry_after(Duration::from_secs(30));
/// assert_eq!(limit.total(), 200);
/// assert_eq!(limit.tenant_share(), 20);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunningLimit {
    total: usize,
    per_tenant: usize,
    retry_after: Option<Duration>,
}

impl RunningLimit {
    /// At most `total` executions at once; every tenant may take all of them
    /// until [`RunningLimit::per_tenant`] says otherwise. A total or a share of
    /// 0 is refused by [`crate::Idem::with_running_limit`]: an operation that can
    /// never run is a mistake, not a bound.
    pub fn new(total: usize) -> Self {
        RunningLimit {
            total,
            per_tenant: total,
            retry_after: None,
        }
    }

    /// At most `share` of the executions for any one tenant (a share above the
    /// total is the total), so that one tenant, or one client stuck in a loop,
    /// cannot take every slot.
    pub fn per_tenant(mut self, share: usize) -> Self {
        self.per_tenant = share.min(self.total);
        self
    }

    /// The `Retry-After` of a refused request. By default the operation's lease
    /// length: a slot frees when an execution ends, and a long operation's
    /// executions rarely end sooner.
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// The bound on all tenants' executions together.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The bound on one tenant's executions.
    pub fn tenant_share(&self) -> usize {
        self.per_tenant
    }

    /// The `Retry-After` given with a refusal, if set (else the lease length).
    pub fn wait(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// The limits of an `Idem` and its clones, by operation.
#[derive(Debug, Clone, Default)]
pub(crate) struct RunningLimits {
    by_operation: HashMap<String, Arc<Slots>>,
}

impl RunningLimits {
    pub(crate) fn set(&mut self, operation: &str, limit: RunningLimit) {
        self.by_operation.insert(
            operation.to_owned(),
            Arc::new(Slots {
                limit,
                held: Mutex::default(),
            }),
        );
    }

    /// The operation's slots, if it has a limit.
    pub(crate) fn of(&self, operation: &str) -> Option<&Arc<Slots>> {
        if self.by_operation.is_empty() {
            return None;
        }
        self.by_operation.get(operation)
    }
}

/// One operation's limit and the slots held now.
#[derive(Debug)]
pub(crate) struct Slots {
    limit: RunningLimit,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_tenant: HashMap<String, usize>,
}

impl Slots {
    pub(crate) fn limit(&self) -> RunningLimit {
        self.limit
    }

    /// Executions holding a slot now.
    pub(crate) fn running(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }

    /// A slot for `tenant`, or `None` when the operation or the tenant's share is
    /// full.
    pub(crate) fn take(self: &Arc<Self>, operation: &'static str, tenant: &str) -> Option<Slot> {
        {
            let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            let mine = held.by_tenant.get(tenant).copied().unwrap_or(0);
            if held.total >= self.limit.total || mine >= self.limit.per_tenant {
                return None;
            }
            held.total += 1;
            *held.by_tenant.entry(tenant.to_owned()).or_default() += 1;
            // Under the lock: a take and a give-back that interleave would
            // otherwise set the gauge in the other order, and leave it wrong
            // until the next change.
            crate::metrics::running(operation, held.total, self.limit.total);
        }
        Some(Slot {
            slots: self.clone(),
            operation,
            tenant: tenant.to_owned(),
        })
    }
}

/// A held slot, given back when dropped (the execution's work ended, however).
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    operation: &'static str,
    tenant: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self
            .slots
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        held.total = held.total.saturating_sub(1);
        if let Some(mine) = held.by_tenant.get_mut(&self.tenant) {
            *mine -= 1;
            if *mine == 0 {
                held.by_tenant.remove(&self.tenant);
            }
        }
        // Under the lock, as in `take`.
        crate::metrics::running(self.operation, held.total, self.slots.limit.total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(limit: RunningLimit) -> Arc<Slots> {
        let mut limits = RunningLimits::default();
        limits.set("op", limit);
        limits.of("op").unwrap().clone()
    }

    #[test]
    fn the_total_and_each_tenants_share_bound_the_slots_and_a_dropped_slot_frees_one() {
        let s = slots(RunningLimit::new(3).per_tenant(2));
        let a1 = s.take("op", "a").expect("a's first");
        let _a2 = s.take("op", "a").expect("a's second");
        assert!(s.take("op", "a").is_none(), "a's share is full");
        let _b1 = s.take("op", "b").expect("b's first");
        assert!(s.take("op", "c").is_none(), "the total is full");
        assert_eq!(s.running(), 3);
        drop(a1);
        assert_eq!(s.running(), 2);
        let _c1 = s.take("op", "c").expect("the freed slot");
    }

    #[test]
    fn a_share_never_exceeds_the_total() {
        assert_eq!(RunningLimit::new(5).per_tenant(9).tenant_share(), 5);
        assert_eq!(RunningLimit::new(5).tenant_share(), 5);
    }

    #[test]
    fn an_operation_without_a_limit_has_no_slots() {
        let mut limits = RunningLimits::default();
        assert!(limits.of("op").is_none());
        limits.set("other", RunningLimit::new(1));
        assert!(limits.of("op").is_none());
    }
}
