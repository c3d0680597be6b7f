//! Renewing a lease in the background of a running handler, and deciding when
//! it must be taken as lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::LeaseBackend;
use crate::key::KeyDigest;
use crate::model::{Fence, Owned, OwnerToken, StoreError};

/// When a lease must be taken as lost, on this process's clock: a lease whose
/// claim (or last renewal) was *sent* at `t` holds on the store until `t + lease`
/// at the latest, since the store starts counting no earlier than it receives
/// the statement. Measuring from the send time, not from the reply, makes
/// [`Lease::is_lost`](super::Lease::is_lost) true no later than the moment the
/// store could hand the execution to another worker, whatever a hanging renewal
/// does. Once lost, always lost: a late renewal does not revive it.
///
/// The two clocks are not one, though: the store reads its own (in whole
/// milliseconds on MySQL, SQLite and Redis, so up to one earlier than the
/// instant it reads), and the two may run at rates apart by what time
/// synchronisation allows (NTP slews by at most 500 parts per million). So the
/// lease is taken as lost [`Deadline::margin`] before `t + lease`.
#[derive(Debug)]
pub(crate) struct Deadline {
    base: Instant,
    /// Nanoseconds from `base` until which the lease holds.
    until: AtomicU64,
    lost: AtomicBool,
}

impl Deadline {
    /// A lease claimed by a statement sent at `sent`.
    pub(crate) fn new(sent: Instant, lease: Duration) -> Self {
        Deadline {
            base: sent,
            until: AtomicU64::new(nanos(Self::held(lease))),
            lost: AtomicBool::new(false),
        }
    }

    /// How much sooner than `sent + lease` the lease is taken as lost: a
    /// millisecond for the store's clock, and a thousandth of the lease (twice
    /// NTP's largest slew) for clocks running at different rates.
    pub(crate) fn margin(lease: Duration) -> Duration {
        Duration::from_millis(1) + lease / 1000
    }

    /// How long a lease sent for `lease` is taken to hold on this clock: the
    /// store keeps it in whole milliseconds (`millis` truncates), so a
    /// fraction of one is not counted.
    fn held(lease: Duration) -> Duration {
        let stored = Duration::from_millis(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX));
        stored.saturating_sub(Self::margin(lease))
    }

    /// A renewal sent at `sent` succeeded: the lease holds until `sent + lease`
    /// less the margin (never shortened, and never revived once lost).
    pub(crate) fn renewed(&self, sent: Instant, lease: Duration) {
        if self.is_lost() {
            return;
        }
        let until = nanos(
            sent.saturating_duration_since(self.base)
                .saturating_add(Self::held(lease)),
        );
        self.until.fetch_max(until, Ordering::AcqRel);
    }

    /// The lease was taken over, or is to be taken as lost.
    pub(crate) fn lose(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// Whether the lease is lost: marked so, or past its deadline now.
    pub(crate) fn is_lost(&self) -> bool {
        if self.lost.load(Ordering::Acquire) {
            return true;
        }
        let until = Duration::from_nanos(self.until.load(Ordering::Acquire));
        if self.base.elapsed() >= until {
            self.lose();
            return true;
        }
        false
    }

    /// How long the lease holds from now (zero once lost).
    pub(crate) fn left(&self) -> Duration {
        if self.is_lost() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.until.load(Ordering::Acquire)).saturating_sub(self.base.elapsed())
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What renews one lease: by itself ([`Renewer::renew`], for
/// [`Lease::renew`](super::Lease::renew)), or with the process's other leases
/// ([`super::renewals::Renewals`]).
pub(crate) struct Renewer<DB: LeaseBackend> {
    pub(super) pool: DB::Store,
    pub(super) tenant: String,
    pub(super) operation: String,
    pub(super) key: KeyDigest,
    pub(super) token: OwnerToken,
    pub(super) lease: Duration,
    pub(super) deadline: Arc<Deadline>,
}

impl<DB: LeaseBackend> Renewer<DB> {
    /// The row the lease owns, as its fenced statements match it.
    pub(super) fn owned(&self) -> Owned<'_> {
        Owned {
            tenant: &self.tenant,
            operation: &self.operation,
            key: self.key,
            token: &self.token,
        }
    }

    /// One renewal; `false` when the lease was taken over.
    pub(crate) async fn renew(&self) -> Result<bool, StoreError> {
        let sent = Instant::now();
        let kept = DB::lease_fence(&self.pool, self.owned(), Fence::Renew(self.lease)).await? == 1;
        if kept {
            self.deadline.renewed(sent, self.lease);
        } else {
            self.deadline.lose();
        }
        Ok(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_taken_as_lost_its_margin_before_the_store_counts_it_out() {
        let lease = Duration::from_secs(30);
        let margin = Deadline::margin(lease);
        assert_eq!(margin, Duration::from_millis(31));
        let now = Instant::now();
        let sent_ago = |ago: Duration| now.checked_sub(ago).unwrap();
        assert!(
            Deadline::new(sent_ago(lease - margin), lease).is_lost(),
            "lost with only the margin left of the store's count"
        );
        let held = Deadline::new(sent_ago(lease - margin - Duration::from_secs(5)), lease);
        assert!(!held.is_lost(), "held with more than the margin left");
        assert!(held.left() <= Duration::from_secs(5));
        // A renewal counts from its send time the same way.
        held.renewed(sent_ago(Duration::from_secs(1)), lease);
        let left = held.left();
        assert!(
            left <= lease - margin - Duration::from_secs(1) && left > Duration::from_secs(20),
            "{left:?}"
        );
    }

    /// The store keeps whole milliseconds: a lease of 100.6 ms is 100 ms
    /// there, and its margin comes off those.
    #[test]
    fn a_fraction_of_a_millisecond_is_not_counted_as_held() {
        let lease = Duration::from_micros(100_600);
        let left = Deadline::new(Instant::now(), lease).left();
        assert!(
            left <= Duration::from_millis(100) - Deadline::margin(lease),
            "{left:?}"
        );
    }
}
