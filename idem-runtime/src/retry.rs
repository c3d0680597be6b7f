//! A bounded retry policy for calls to downstream systems: exponential backoff
//! with full jitter, capped in attempts and in total delay.
//!
//! The schedule and the retry loop are [`backon`]'s. Its own jitter is not used:
//! backon adds a random share of the delay on top (a delay in `[d, 2d)`), while
//! full jitter draws each delay uniformly from `[0, d]`, which spreads a crowd of
//! clients retrying after an outage much better (the "Exponential Backoff And
//! Jitter" analysis). [`RetryPolicy`] wraps backon's exponential schedule and
//! replaces each delay `d` with a uniform draw from `[0, d]`.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::retry::RetryPolicy;
//!
//! # async fn charge() -> Result<u32, std::io::Error> { Ok(1) }
//! # async fn demo() -> Result<(), std::io::Error> {
//! let policy = RetryPolicy::new()
//!     .with_max_attempts(5)
//!     .with_min_delay(Duration::from_millis(50))
//!     .with_max_delay(Duration::from_secs(2))
//!     .with_max_total_delay(Duration::from_secs(5));
//! // Retried while the error is one worth retrying (here: every error).
//! let charge_id = policy.run(charge, |_| true).await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Exponential backoff with full jitter, bounded in attempts and total delay.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    max_attempts: usize,
    min_delay: Duration,
    max_delay: Duration,
    max_total_delay: Duration,
    factor: f32,
    seed: Option<u64>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryPolicy {
    /// Calls `op` until it succeeds, `retry_if` says its error is not worth
    /// retrying, or the policy's attempts or total delay are used up; the last
    /// result is returned. The delays are the policy's, slept on tokio's clock.
    ///
    /// ```no_run
    /// # use idem_runtime::retry::RetryPolicy;
    /// # #[derive(Debug)] enum ProviderError { Unavailable, Declined }
    /// # async fn charge(key: &str) -> Result<String, ProviderError> { Ok("ch_1".into()) }
    /// # async fn demo() -> Result<(), ProviderError> {
    /// let charge = RetryPolicy::new()
    ///     .run(|| charge("order-42"), |e| matches!(e, ProviderError::Unavailable))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run<T, E, F, Fut>(&self, op: F, retry_if: impl FnMut(&E) -> bool) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        use backon::Retryable;
        op.retry(self.clone()).when(retry_if).await
    }

    /// 4 attempts in all (3 retries), delays from 100 ms doubling up to 2 s, at
    /// most 5 s of waiting in total.
    pub fn new() -> Self {
        RetryPolicy {
            max_attempts: 4,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            max_total_delay: Duration::from_secs(5),
            factor: 2.0,
            seed: None,
        }
    }

    /// Attempts in all, the first included (at least 1).
    pub fn with_max_attempts(mut self, n: usize) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The cap of the first delay.
    pub fn with_min_delay(mut self, d: Duration) -> Self {
        self.min_delay = d;
        self
    }

    /// The largest cap any one delay can have.
    pub fn with_max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }

    /// The most time spent waiting between attempts, summed over the caps; the
    /// actual waits, being drawn below their caps, sum to no more.
    pub fn with_max_total_delay(mut self, d: Duration) -> Self {
        self.max_total_delay = d;
        self
    }

    /// A fixed random seed, for reproducible delays in tests.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The most attempts this policy makes: an upper bound on downstream calls.
    pub fn max_attempts(&self) -> usize {
        self.max_attempts
    }
}

/// The delays of one retry loop (see [`RetryPolicy`]).
#[derive(Debug)]
pub struct FullJitter {
    caps: ExponentialBackoff,
    rng: fastrand::Rng,
}

impl Iterator for FullJitter {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let cap = self.caps.next()?;
        let nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
        Some(Duration::from_nanos(self.rng.u64(0..=nanos)))
    }
}

impl BackoffBuilder for RetryPolicy {
    type Backoff = FullJitter;

    fn build(self) -> FullJitter {
        let caps = ExponentialBuilder::new()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(self.factor)
            .with_max_times(self.max_attempts - 1)
            .with_total_delay(Some(self.max_total_delay))
            .build();
        let rng = match self.seed {
            Some(s) => fastrand::Rng::with_seed(s),
            None => fastrand::Rng::new(),
        };
        FullJitter { caps, rng }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy of `attempts`, its delays capped from `min_ms` up to `max_ms`,
    /// and `total` in all.
    fn policy(attempts: usize, min_ms: u64, max_ms: u64, total: Duration) -> RetryPolicy {
        RetryPolicy::new()
            .with_max_attempts(attempts)
            .with_min_delay(Duration::from_millis(min_ms))
            .with_max_delay(Duration::from_millis(max_ms))
            .with_max_total_delay(total)
    }

    #[test]
    fn delays_are_drawn_below_exponential_caps_and_bounded() {
        let policy = policy(6, 100, 800, Duration::from_secs(60));
        let caps = [100u64, 200, 400, 800, 800];
        for seed in 0..200 {
            let delays: Vec<Duration> = policy.clone().with_seed(seed).build().collect();
            assert_eq!(delays.len(), 5, "max_attempts - 1 retries");
            for (d, cap) in delays.iter().zip(caps) {
                assert!(*d <= Duration::from_millis(cap), "{d:?} above cap {cap} ms");
            }
        }
        // Full jitter really spreads: over many seeds the first delay covers its range.
        let firsts: Vec<Duration> = (0..200)
            .map(|s| policy.clone().with_seed(s).build().next().unwrap())
            .collect();
        assert!(firsts.iter().any(|d| *d < Duration::from_millis(20)));
        assert!(firsts.iter().any(|d| *d > Duration::from_millis(80)));
    }

    #[test]
    fn the_total_delay_is_capped() {
        let policy = policy(100, 100, 100, Duration::from_millis(450));
        let delays: Vec<Duration> = policy.with_seed(7).build().collect();
        assert_eq!(delays.len(), 4, "four caps of 100 ms fit in 450 ms");
        assert!(delays.iter().sum::<Duration>() <= Duration::from_millis(450));
    }
}
