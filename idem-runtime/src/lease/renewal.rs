//! Renewing a lease in the background of a running handler, and deciding when
//! it must be taken as lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::LeaseBackend;
use crate::key::KeyDigest;
use crate::model::{Fence, Owned, OwnerToken, StoreError};

/// Renews a lease in the background of a running handler.
pub(crate) struct Renewer<DB: LeaseBackend> {
    pub(super) pool: DB::Store,
    pub(super) tenant: String,
    pub(super) operation: String,
    pub(super) key: KeyDigest,
    pub(super) token: OwnerToken,
    pub(super) lease: Duration,
    pub(super) lost: Arc<AtomicBool>,
}

impl<DB: LeaseBackend> Renewer<DB> {
    /// One renewal; `false` when the lease was taken over.
    pub(crate) async fn renew(&self) -> Result<bool, StoreError> {
        let owned = Owned {
            tenant: &self.tenant,
            operation: &self.operation,
            key: self.key,
            token: &self.token,
        };
        let kept = DB::lease_fence(&self.pool, owned, Fence::Renew(self.lease)).await? == 1;
        if !kept {
            self.lost.store(true, Ordering::Release);
        }
        Ok(kept)
    }

    /// Renews every third of the lease until `ceiling` has passed or the lease is
    /// lost, then stops (and never returns, so it can be raced against a handler).
    ///
    /// A renewal that does not answer within a third of the lease counts as
    /// failed; once no renewal has succeeded for a whole lease, the lease is taken
    /// as lapsed and [`Lease::is_lost`] says so, so the handler can stop before
    /// calling downstream again.
    pub(crate) async fn run(self, ceiling: Duration) -> std::convert::Infallible {
        let started = tokio::time::Instant::now();
        let every = (self.lease / 3).max(Duration::from_millis(10));
        let mut last_ok = started;
        loop {
            tokio::time::sleep(every).await;
            if started.elapsed() + every > ceiling {
                tracing::warn!(operation = %self.operation, "idem: lease renewal ceiling reached; the execution may be taken over");
                break;
            }
            match tokio::time::timeout(every, self.renew()).await {
                Ok(Ok(true)) => last_ok = tokio::time::Instant::now(),
                Ok(Ok(false)) => {
                    tracing::warn!(operation = %self.operation, "idem: lease taken over; this worker's result will not be published");
                    break;
                }
                Ok(Err(e)) => {
                    tracing::warn!(operation = %self.operation, error = %e, "idem: lease renewal failed; retrying")
                }
                Err(_) => {
                    tracing::warn!(operation = %self.operation, "idem: lease renewal timed out; retrying")
                }
            }
            if last_ok.elapsed() >= self.lease {
                self.lost.store(true, Ordering::Release);
                tracing::warn!(operation = %self.operation, "idem: no renewal for a whole lease; taking the lease as lost");
                break;
            }
        }
        // Past the last renewal the lease runs out; say so when it does.
        tokio::time::sleep(self.lease.saturating_sub(last_ok.elapsed())).await;
        self.lost.store(true, Ordering::Release);
        std::future::pending().await
    }
}
