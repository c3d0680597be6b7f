//! [`ReplayCache`]: an opt-in, in-process tier in front of the database for
//! finished outcomes, so that a hot replay needs no database round trip.
//!
//! What it keeps: the outcomes this process itself completed (transactional mode),
//! with their fingerprints, each until the earlier of its retention and the
//! cache's `max_age`. A finished, unexpired outcome never changes in the
//! database, so the cache answers exactly what the database would:
//!
//! * a retry with the same fingerprint gets the stored answer, byte for byte;
//! * one with another fingerprint gets the mismatch answer;
//! * nothing else is answered from the cache: keys it does not hold (first
//!   executions, outcomes completed by another replica, leased executions) go to
//!   the database as before.
//!
//! **Retention.** An entry's deadline is taken on this process's monotonic clock
//! *before* the completion is sent, and the database starts the retention when it
//! runs the completion, which is later; and it is a millisecond short of the
//! retention, the step of the coarsest database clock (SQLite's and MySQL's
//! `expires_at` are whole milliseconds): an entry never outlives its row's
//! retention.
//!
//! **Purges and sweeps elsewhere.** A row deleted before its expiry (`idem purge`,
//! a manual `DELETE`) is not seen by the caches of running processes: they keep
//! replaying it for at most `max_age`. The sweeper deletes only expired rows,
//! which no cache holds any more. Choose `max_age` (it has no default) as short
//! as a purge or a tenant's erasure must take effect: a minute is enough for a
//! retry storm.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The coarsest step of a database clock idem writes `expires_at` with (SQLite's
/// and MySQL's Unix milliseconds): what an entry's deadline gives up so that it
/// never outlives its row.
const CLOCK_GRAIN: Duration = Duration::from_millis(1);

use crate::fingerprint::Fingerprint;
use crate::model::{ClaimRequest, StoredResponse};

/// An in-process cache of finished outcomes (see the [module docs](self)).
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{Idem, ReplayCache};
///
/// # async fn demo(pool: sqlx::PgPool) {
/// // at most 64 MiB of stored answers, none kept longer than a minute
/// let idem = Idem::new(pool)
///     .with_replay_cache(ReplayCache::new(64 * 1024 * 1024, Duration::from_secs(60)));
/// # }
/// ```
#[derive(Clone)]
pub struct ReplayCache {
    entries: moka::sync::Cache<CacheKey, Arc<Entry>>,
    /// How many times [`ReplayCache::clear`] has run: an outcome committed
    /// before a clear (an erasure's, say) but inserted after it is not kept.
    clears: Arc<AtomicU64>,
}

/// When a completion was sent, as [`ReplayCache::insert`] needs it: the
/// process's clock, and the cache's clears so far.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sent {
    at: Instant,
    clears: u64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    tenant: Box<str>,
    operation: &'static str,
    key: Box<str>,
}

struct Entry {
    fingerprint: Fingerprint,
    stored: StoredResponse,
    deadline: Instant,
}

/// What the cache knows of a request.
#[derive(Debug)]
pub(crate) enum Cached {
    /// The stored answer of the same logical request.
    Replay(StoredResponse),
    /// The key holds another request's answer.
    Mismatch,
}

impl ReplayCache {
    /// The longest `max_age` taken; a longer one is cut to it (the cache crate
    /// refuses lifetimes over 1,000 years, and no retention is that long).
    pub const MAX_AGE_LIMIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

    /// A cache of at most `max_bytes` of stored answers (bodies and headers),
    /// each kept at most `max_age` (and never past its retention). Answers larger
    /// than an eighth of `max_bytes` are not cached.
    pub fn new(max_bytes: u64, max_age: Duration) -> Self {
        let max_age = max_age.min(Self::MAX_AGE_LIMIT);
        ReplayCache {
            entries: moka::sync::Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|k: &CacheKey, e: &Arc<Entry>| {
                    u32::try_from(weight(k, &e.stored)).unwrap_or(u32::MAX)
                })
                .time_to_live(max_age)
                .build(),
            clears: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Forgets every entry (see `Idem::clear_replay_cache`), and every outcome
    /// whose completion was sent before and is inserted after.
    pub fn clear(&self) {
        // Counted first: an insert that reads the old count happened before
        // this line, so `invalidate_all` takes it; one that reads the new count
        // drops its entry itself.
        self.clears.fetch_add(1, Ordering::SeqCst);
        self.entries.invalidate_all();
    }

    /// Taken just before a completion is sent: what [`ReplayCache::insert`]
    /// needs once it has committed.
    pub(crate) fn sent(&self) -> Sent {
        Sent {
            at: Instant::now(),
            clears: self.clears.load(Ordering::SeqCst),
        }
    }

    /// What the cache holds for `req`'s key, if anything that has not expired.
    pub(crate) fn get(&self, operation: &'static str, req: &ClaimRequest<'_>) -> Option<Cached> {
        let k = CacheKey::of(operation, req);
        let entry = self.entries.get(&k)?;
        if Instant::now() >= entry.deadline {
            self.entries.invalidate(&k);
            return None;
        }
        Some(if entry.fingerprint == req.fingerprint {
            Cached::Replay(entry.stored.clone())
        } else {
            Cached::Mismatch
        })
    }

    /// Keeps the outcome of `req`, whose completion was sent at `sent`, until
    /// its retention less [`CLOCK_GRAIN`] has passed (or `max_age`); not at all
    /// if the cache was cleared since `sent`: the clear (an erasure's, a
    /// failover's) may have been meant for this very row, committed in between.
    pub(crate) fn insert(
        &self,
        operation: &'static str,
        req: &ClaimRequest<'_>,
        stored: &StoredResponse,
        sent: Sent,
    ) {
        let k = CacheKey::of(operation, req);
        // moka refuses nothing by size itself; an answer that would take a large
        // share of the cache would only evict many small ones.
        if weight(&k, stored) > self.entries.policy().max_capacity().unwrap_or(0) / 8 {
            return;
        }
        // The database's clock counts whole milliseconds on SQLite and MySQL
        // (`expires_at` truncated), so its row can expire up to a millisecond
        // before `completion + retention` in real time, and an in-process SQLite
        // completion runs well within a millisecond of `sent`: the entry gives
        // that millisecond up.
        let Some(deadline) = sent
            .at
            .checked_add(req.retention.saturating_sub(CLOCK_GRAIN))
        else {
            return;
        };
        if self.cleared_since(sent) {
            return;
        }
        let entry = Entry {
            fingerprint: req.fingerprint,
            stored: stored.clone(),
            deadline,
        };
        self.entries.insert(k, Arc::new(entry));
        // A clear between the check above and the insert did not see the entry.
        if self.cleared_since(sent) {
            self.entries.invalidate(&CacheKey::of(operation, req));
        }
    }

    fn cleared_since(&self, sent: Sent) -> bool {
        self.clears.load(Ordering::SeqCst) != sent.clears
    }
}

impl CacheKey {
    fn of(operation: &'static str, req: &ClaimRequest<'_>) -> Self {
        CacheKey {
            tenant: req.tenant.into(),
            operation,
            key: req.key.as_str().into(),
        }
    }
}

fn weight(k: &CacheKey, stored: &StoredResponse) -> u64 {
    let headers: usize = stored.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    (stored.body.len() + headers + k.tenant.len() + k.key.len() + 128) as u64
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("entries", &self.entries.entry_count())
            .field("bytes", &self.entries.weighted_size())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_max_age_builds_a_cache() {
        // moka panics on a time to live over 1,000 years.
        let cache = ReplayCache::new(1024, Duration::MAX);
        assert_eq!(
            cache.entries.policy().time_to_live(),
            Some(ReplayCache::MAX_AGE_LIMIT)
        );
        let _ = ReplayCache::new(0, Duration::ZERO);
    }

    /// A clear that runs while a completion commits (an erasure's, whose
    /// batch deleted that very row) must not be followed by the entry.
    #[test]
    fn an_outcome_sent_before_a_clear_is_not_kept() {
        let cache = ReplayCache::new(1024 * 1024, Duration::from_secs(60));
        let key = crate::IdempotencyKey::parse("k1").unwrap();
        let req = ClaimRequest {
            tenant: "acme",
            operation: "pay",
            key: &key,
            fingerprint: crate::FingerprintBuilder::new("acme", "pay", "POST", "/p").finish(),
            retention: Duration::from_secs(3600),
            in_flight_wait: Duration::from_secs(2),
        };
        let stored = StoredResponse {
            status: 201,
            headers: vec![],
            body: b"paid".to_vec().into(),
        };
        let sent = cache.sent();
        cache.clear();
        cache.insert("pay", &req, &stored, sent);
        assert!(cache.get("pay", &req).is_none(), "kept after a clear");
        // Without a clear in between it is kept: the test above is not vacuous.
        cache.insert("pay", &req, &stored, cache.sent());
        assert!(matches!(cache.get("pay", &req), Some(Cached::Replay(_))));
    }
}
