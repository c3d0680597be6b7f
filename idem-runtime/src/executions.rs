//! The executions running now, so that a server shutting down can wait for them.
//!
//! idem runs claimed work on a task of its own, so that a client that
//! disconnects does not cancel a half-done operation. A graceful shutdown that
//! waits for the server's connections does not wait for those tasks: a client
//! gone before the work finished leaves it running while the process exits. That
//! is safe (the transaction rolls back, a leased row is taken over after its
//! lease) but it is work thrown away. [`Executions::drained`] waits for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// The executions of an [`crate::Idem`] and its clones that are running now
/// (from [`crate::Idem::executions`]). Cheap to clone.
///
/// ```no_run
/// # #[cfg(feature = "postgres")] // the example's database is PostgreSQL
/// # async fn demo(idem: idem_runtime::Idem<sqlx::Postgres>, app: axum::Router, listener: tokio::net::TcpListener) {
/// use std::time::Duration;
///
/// let executions = idem.executions();
/// axum::serve(listener, app)
///     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
///     .await
///     .unwrap();
/// // The connections are closed; let the work their requests started finish.
/// if tokio::time::timeout(Duration::from_secs(30), executions.drained()).await.is_err() {
///     eprintln!("{} execution(s) still running; they roll back", executions.running());
/// }
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct Executions(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    running: AtomicUsize,
    idle: Notify,
}

/// One running execution, counted until dropped.
pub(crate) struct Running(Arc<Inner>);

impl Executions {
    /// How many executions run now.
    pub fn running(&self) -> usize {
        self.0.running.load(Ordering::Acquire)
    }

    /// Resolves once no execution runs (at once when none does). Executions that
    /// start meanwhile are waited for too: stop accepting requests first.
    pub async fn drained(&self) {
        loop {
            let idle = self.0.idle.notified();
            let mut idle = std::pin::pin!(idle);
            // Registered before the count is read, so the last execution's
            // notification cannot slip between the two.
            idle.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            idle.await;
        }
    }

    /// Counts an execution from now until the returned value is dropped.
    pub(crate) fn start(&self) -> Running {
        self.0.running.fetch_add(1, Ordering::AcqRel);
        Running(self.0.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;

    #[tokio::test]
    async fn drained_waits_for_the_last_execution() {
        let executions = Executions::default();
        assert!(
            executions.drained().now_or_never().is_some(),
            "none running"
        );
        let first = executions.start();
        let second = executions.start();
        let drained = executions.drained();
        let mut drained = std::pin::pin!(drained);
        assert!(drained.as_mut().now_or_never().is_none());
        drop(first);
        assert!(drained.as_mut().now_or_never().is_none(), "one still runs");
        drop(second);
        assert!(drained.now_or_never().is_some());
        assert_eq!(executions.running(), 0);
    }
}
