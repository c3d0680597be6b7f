//! The client half for tonic (feature `grpc`): one key per logical call, the
//! same key on every attempt, and retries by the answers an idem service gives.
//!
//! | answer | what [`Retrying`] does |
//! | --- | --- |
//! | `ABORTED` (in flight, outcome uncertain) | retry after its `google.rpc.RetryInfo` wait (else the backoff) |
//! | `UNAVAILABLE` (the store, the service, the connection) | retry after `RetryInfo`, else the backoff |
//! | `DEADLINE_EXCEEDED`, `CANCELLED`, `UNKNOWN`, `INTERNAL` (the answer lost, a stream reset on the way, or a failure that rolled back) | retry after the backoff: under the same key it replays or runs once |
//! | `FAILED_PRECONDITION` (the key belongs to another request) and every other status | returned at once |
//! | a message | returned |
//! | attempts used up | the last status |
//!
//! A `RetryInfo` wait is waited out with the backoff's jitter on top, so that
//! callers told the same wait do not come back at one instant; one that
//! reaches [`Retrying::max_wait`] is cut to it (see there). Every status
//! [`Retrying`] returns carries the call's key in its metadata
//! ([`KEY_METADATA`], read with [`key_of`]): after a status that leaves the
//! outcome unknown the call may have run, so try it again later under that
//! key, never a new one.
//!
//! ```no_run
//! # use idem_client::grpc::Retrying;
//! # async fn run<C: Clone>(client: C) {
//! # let call = |_c: C, r: tonic::Request<u32>| async move { Ok::<_, tonic::Status>(tonic::Response::new(r.into_inner())) };
//! let answer = Retrying::new()
//!     .call(7_u32, |request| call(client.clone(), request))
//!     .await;
//! # }
//! ```

use std::future::Future;
use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use tonic_types::StatusExt as _;

use crate::IdempotencyKey;

/// The request metadata entry the key travels in (and the entry of a status
/// [`Retrying`] returns that holds it: see [`key_of`]).
pub const KEY_METADATA: &str = "idempotency-key";

/// The key of the logical call a status [`Retrying`] returned ended, to try
/// the call again under it ([`Retrying::call_with_key`]).
///
/// ```
/// use idem_client::grpc::{KEY_METADATA, key_of};
///
/// let mut status = tonic::Status::unavailable("down");
/// assert!(key_of(&status).is_none());
/// status.metadata_mut().insert(KEY_METADATA, "k-1".parse().unwrap());
/// assert_eq!(key_of(&status).unwrap().as_str(), "k-1");
/// ```
pub fn key_of(status: &Status) -> Option<IdempotencyKey> {
    let value = status.metadata().get(KEY_METADATA)?.to_str().ok()?;
    IdempotencyKey::new(value).ok()
}

/// Retries one logical call under one key (see the module's table).
#[derive(Debug, Clone)]
pub struct Retrying {
    attempts: u32,
    backoff: Duration,
    max_wait: Duration,
}

impl Default for Retrying {
    fn default() -> Self {
        Self::new()
    }
}

impl Retrying {
    /// Five attempts, a backoff from 100 ms (doubling, with jitter), no single
    /// wait over 30 s.
    pub fn new() -> Self {
        Retrying {
            attempts: 5,
            backoff: Duration::from_millis(100),
            max_wait: Duration::from_secs(30),
        }
    }

    /// At most `attempts` attempts in all (at least one).
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The first backoff wait, when an answer names none.
    pub fn backoff(mut self, first: Duration) -> Self {
        self.backoff = first;
        self
    }

    /// The longest single wait, whatever `RetryInfo` asks (30 s by default). A
    /// `RetryInfo` wait that the backoff's jitter would push past it ends
    /// between the asked wait and `max`; one asked for `max` or longer is
    /// `max`, with no jitter (a retry sooner would be refused again), so
    /// callers told it come back together: set it above the longest lease of
    /// the methods called (an uncertain outcome's wait is the lease).
    pub fn max_wait(mut self, max: Duration) -> Self {
        self.max_wait = max;
        self
    }

    /// Sends `message` under a fresh key (a random UUID) with `send`, and
    /// retries it by the answers. To try the same logical call again after it
    /// gave up, keep the key: [`Retrying::call_with_key`].
    ///
    /// # Errors
    ///
    /// The final status: one that is not retried, or the last after the
    /// attempts.
    pub async fn call<M, T, F, Fut>(
        &self,
        message: M,
        send: F,
    ) -> Result<tonic::Response<T>, Status>
    where
        M: Clone,
        F: FnMut(tonic::Request<M>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_with_key(&IdempotencyKey::random(), message, send)
            .await
    }

    /// As [`Retrying::call`], under `key` (a key kept from an earlier try of
    /// the same logical call).
    ///
    /// # Errors
    ///
    /// As [`Retrying::call`].
    pub async fn call_with_key<M, T, F, Fut>(
        &self,
        key: &IdempotencyKey,
        message: M,
        mut send: F,
    ) -> Result<tonic::Response<T>, Status>
    where
        M: Clone,
        F: FnMut(tonic::Request<M>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut value: MetadataValue<_> = key
            .as_str()
            .parse()
            .map_err(|_| Status::invalid_argument("the idempotency key is not valid metadata"))?;
        // A key is as good as a capability: `Status`'s `Debug` prints its
        // metadata (an `unwrap()`, a `?status` in a log), and sensitive values
        // are printed as such; HTTP/2 also never indexes them.
        value.set_sensitive(true);
        let mut backoff = self.backoff;
        let mut attempt = 1;
        loop {
            let mut request = tonic::Request::new(message.clone());
            request.metadata_mut().insert(KEY_METADATA, value.clone());
            let mut status = match send(request).await {
                Ok(answer) => return Ok(answer),
                Err(status) => status,
            };
            if attempt >= self.attempts || !retried(&status) {
                // The caller's way back to the call: it may have run.
                status.metadata_mut().insert(KEY_METADATA, value);
                return Err(status);
            }
            let wait = wait_after(&status, backoff, self.max_wait);
            tokio::time::sleep(wait).await;
            backoff = backoff.saturating_mul(2).min(self.max_wait);
            attempt += 1;
        }
    }
}

/// Whether a status is retried under the same key: idem's waits, and the
/// failures after which the call's outcome is unknown to the client (a retry
/// under the key replays it, or runs it once if it did not happen).
pub fn retried(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Aborted
            | Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
    )
}

/// The wait before the next attempt after `status`: its `RetryInfo` wait with
/// the jitter of `backoff` on top, or that jitter alone; never over `max`, and
/// never under the `RetryInfo` wait where that is under `max` (a retry sent
/// before it would be refused again, an attempt lost). Where the jitter would
/// pass `max`, the wait falls between the asked one and `max`, so that callers
/// told the same wait still come back apart; one asked for `max` or longer is
/// `max`, which leaves them in step (set `max_wait` above the longest lease).
fn wait_after(status: &Status, backoff: Duration, max: Duration) -> Duration {
    let asked = status
        .get_details_retry_info()
        .and_then(|r| r.retry_delay)
        .unwrap_or_default();
    if asked >= max {
        return max;
    }
    match asked.checked_add(jitter(backoff)) {
        Some(wait) if wait <= max => wait,
        _ => asked + jitter(max - asked),
    }
}

/// Between half and all of `wait` (`mul_f64` would panic where the product
/// rounds past what a `Duration` holds: a backoff near `Duration::MAX`).
fn jitter(wait: Duration) -> Duration {
    Duration::try_from_secs_f64(wait.as_secs_f64() * (0.5 + fastrand::f64() / 2.0)).unwrap_or(wait)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use tonic_types::ErrorDetails;

    fn in_flight(wait_ms: u64) -> Status {
        Status::with_error_details(
            Code::Aborted,
            "in flight",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(wait_ms))),
        )
    }

    #[tokio::test]
    async fn every_attempt_carries_one_key_and_retries_follow_the_answers() {
        let seen = Mutex::new(Vec::new());
        let answers = Mutex::new(vec![
            Err(in_flight(1)),
            Err(Status::unavailable("down")),
            Ok(tonic::Response::new(7_u32)),
        ]);
        let out = Retrying::new()
            .backoff(Duration::from_millis(1))
            .call(1_u32, |r: tonic::Request<u32>| {
                seen.lock().unwrap().push(
                    r.metadata()
                        .get(KEY_METADATA)
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .to_owned(),
                );
                let next = answers.lock().unwrap().remove(0);
                async move { next }
            })
            .await
            .unwrap();
        assert_eq!(out.into_inner(), 7);
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|k| k == &seen[0]), "{seen:?}");
    }

    #[test]
    fn a_retry_info_wait_gets_the_jitter_on_top() {
        let (backoff, max) = (Duration::from_millis(100), Duration::from_secs(30));
        let waits: Vec<Duration> = (0..200)
            .map(|_| wait_after(&in_flight(1000), backoff, max))
            .collect();
        let second = Duration::from_secs(1);
        assert!(waits.iter().all(|w| *w >= second && *w <= second + backoff));
        assert!(
            waits.iter().any(|w| *w != waits[0]),
            "every caller told the same wait would come back at once"
        );
        assert!(wait_after(&Status::unavailable("down"), backoff, max) <= backoff);
        // A wait whose jitter would pass the longest falls between the asked
        // one and the longest, never under what was asked.
        let asked = max - Duration::from_millis(40);
        let near: Vec<Duration> = (0..200)
            .map(|_| wait_after(&in_flight(29_960), backoff, max))
            .collect();
        assert!(near.iter().all(|w| *w >= asked && *w <= max), "{near:?}");
        assert!(
            near.iter().any(|w| *w != near[0]),
            "every caller told the same wait would come back at once"
        );
        // One asked for the longest or longer is the longest.
        assert_eq!(wait_after(&in_flight(60_000), backoff, max), max);
        // A backoff as long as a Duration gets stays within the longest wait.
        let longest = wait_after(&Status::unavailable("down"), Duration::MAX, max);
        assert!(longest >= max / 2 && longest <= max, "{longest:?}");
    }

    #[tokio::test]
    async fn a_stream_reset_is_retried_and_a_final_status_carries_the_key() {
        let seen = Mutex::new(Vec::new());
        let answers = Mutex::new(vec![
            Err(Status::internal("h2 protocol error: stream reset")),
            Err(Status::unavailable("down")),
        ]);
        let status = Retrying::new()
            .attempts(2)
            .backoff(Duration::from_millis(1))
            .call(1_u32, |r: tonic::Request<u32>| {
                seen.lock()
                    .unwrap()
                    .push(r.metadata().get(KEY_METADATA).unwrap().clone());
                let next: Result<tonic::Response<u32>, Status> = answers.lock().unwrap().remove(0);
                async move { next }
            })
            .await
            .unwrap_err();
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 2, "INTERNAL (a reset stream) is retried");
        assert_eq!(status.code(), Code::Unavailable);
        let key = key_of(&status).expect("the key comes with the status");
        assert_eq!(key.as_str(), seen[0].to_str().unwrap());
        // ... and never in its `Debug`, which an `unwrap()` or a log prints.
        let printed = format!("{status:?}");
        assert!(!printed.contains(key.as_str()), "{printed}");
        assert!(seen.iter().all(|v| v.is_sensitive()));
    }

    #[tokio::test]
    async fn a_reused_key_is_never_retried_and_attempts_are_bounded() {
        let calls = Mutex::new(0);
        let status = Retrying::new()
            .call(1_u32, |_| {
                *calls.lock().unwrap() += 1;
                async { Err::<tonic::Response<u32>, _>(Status::failed_precondition("reused")) }
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(*calls.lock().unwrap(), 1);

        let calls = Mutex::new(0);
        let status = Retrying::new()
            .attempts(3)
            .backoff(Duration::from_millis(1))
            .call(1_u32, |_| {
                *calls.lock().unwrap() += 1;
                async { Err::<tonic::Response<u32>, _>(Status::unavailable("down")) }
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(*calls.lock().unwrap(), 3);
    }
}
