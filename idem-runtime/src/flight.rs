//! Duplicates of a key that arrive in one process while its first request runs
//! wait here, without a database connection, and go to the database once the
//! first request has finished (usually to replay its committed outcome).
//!
//! Without this, each duplicate waits for the first request's row lock inside
//! the database, holding a pooled connection: a burst of retries of one slow key
//! empties the pool, and every other tenant's requests queue behind it. Waiting
//! here costs a task and a channel receiver; the number of waiters is bounded per
//! key and in all, and a duplicate past a bound is answered `409` with
//! `Retry-After` at once.
//!
//! It is only a waiting room: nothing is decided here. Every request still
//! claims its key in the database, which alone keeps the promise (and which is
//! what duplicates in other processes wait on).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::key::KeyDigest;

/// The key a flight is for: tenant and operation hashed with this process's
/// random seed, and the key's digest. No allocation per request; two flights
/// share an entry only if their keys are equal and their tenant and operation
/// collide in 64 seeded bits, and then a duplicate merely waits for the other
/// request before it claims (nothing is decided here).
type FlightKey = (u64, KeyDigest);

/// Shards of the map, so that requests of different keys rarely meet on a lock.
const SHARDS: usize = 16;

/// The flights of one [`crate::Idem`] and its clones.
#[derive(Debug)]
pub(crate) struct Flights {
    shards: [Mutex<HashMap<FlightKey, Slot>>; SHARDS],
    seed: RandomState,
    /// Duplicates waiting now, over all keys.
    waiting: AtomicUsize,
    per_key: usize,
    total: usize,
}

/// A key's entry: its first request is running; the channel and the count of
/// waiters exist only once a duplicate came.
type Slot = Option<Arc<Flight>>;

/// The duplicates waiting for one key's first request.
#[derive(Debug)]
struct Flight {
    /// Flips to `true` when the first request has finished.
    done: watch::Sender<bool>,
    /// Duplicates waiting for this flight now.
    waiting: AtomicUsize,
}

/// How a request joined its key's flight.
pub(crate) enum Joined {
    /// The first: it goes to the database; the flight ends when this is dropped.
    Leader(Leader),
    /// A duplicate: wait for the leader with [`Waiter::finished`].
    Follower(Waiter),
    /// A duplicate past a bound on waiters: answer "in flight" at once.
    Full,
}

/// The first request of a flight. Dropping it (after the commit, a rollback or
/// any answer) wakes the duplicates, if any came.
pub struct Leader {
    flights: Arc<Flights>,
    key: FlightKey,
}

/// A duplicate waiting for its flight's leader. Counted among the waiters until
/// dropped.
pub(crate) struct Waiter {
    flights: Arc<Flights>,
    flight: Arc<Flight>,
    done: watch::Receiver<bool>,
}

impl Flights {
    /// At most `per_key` duplicates wait for one key, and `total` for all keys.
    pub(crate) fn new(per_key: usize, total: usize) -> Self {
        Flights {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            seed: RandomState::new(),
            waiting: AtomicUsize::new(0),
            per_key,
            total,
        }
    }

    /// Duplicates waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &FlightKey) -> &Mutex<HashMap<FlightKey, Slot>> {
        // The digest's bytes are uniform: any of them picks a shard.
        &self.shards[usize::from(key.1.as_bytes()[0]) % SHARDS]
    }

    /// Joins the flight of `(tenant, operation, key)`, starting it if there is none.
    pub(crate) fn join(self: &Arc<Self>, tenant: &str, operation: &str, key: &KeyDigest) -> Joined {
        let flight_key = (self.seed.hash_one((tenant, operation)), *key);
        let mut running = self
            .shard(&flight_key)
            .lock()
            // A panic while the lock was held left the map as it was.
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(slot) = running.get_mut(&flight_key) else {
            running.insert(flight_key, None);
            return Joined::Leader(Leader {
                flights: self.clone(),
                key: flight_key,
            });
        };
        let flight = slot.get_or_insert_with(|| {
            Arc::new(Flight {
                done: watch::Sender::new(false),
                waiting: AtomicUsize::new(0),
            })
        });
        // The key's count under its shard's lock; the total, shared by every
        // shard, taken atomically: neither bound can be passed by two
        // duplicates taking the last place at once.
        if flight.waiting.load(Ordering::Relaxed) >= self.per_key
            || self
                .waiting
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                    (w < self.total).then_some(w + 1)
                })
                .is_err()
        {
            return Joined::Full;
        }
        flight.waiting.fetch_add(1, Ordering::Relaxed);
        // Subscribed under the lock: the leader flips `done` only after taking
        // the flight out under the same lock, so no wake-up is missed.
        let done = flight.done.subscribe();
        Joined::Follower(Waiter {
            flights: self.clone(),
            flight: flight.clone(),
            done,
        })
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        let slot = self
            .flights
            .shard(&self.key)
            .lock()
            // A drop during a panic must not panic again (an abort): the map
            // holds no invariant a panicking holder could have broken.
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key);
        if let Some(Some(flight)) = slot {
            flight.done.send_replace(true);
        }
    }
}

impl Waiter {
    /// Waits until the leader has finished (however it finished).
    pub(crate) async fn finished(&mut self) {
        // An error means the sender is gone, which happens only after `done`
        // flipped: finished either way.
        let _ = self.done.wait_for(|done| *done).await;
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.flight.waiting.fetch_sub(1, Ordering::Relaxed);
        self.flights.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(key: &str) -> KeyDigest {
        crate::IdempotencyKey::parse(key).unwrap().digest()
    }

    #[tokio::test]
    async fn duplicates_wait_for_the_leader_within_their_bounds() {
        let flights = Arc::new(Flights::new(2, 3));
        let Joined::Leader(leader) = flights.join("t", "op", &k("k")) else {
            panic!("the first request leads");
        };
        let Joined::Follower(mut a) = flights.join("t", "op", &k("k")) else {
            panic!("a duplicate follows");
        };
        let Joined::Follower(_b) = flights.join("t", "op", &k("k")) else {
            panic!("a second duplicate follows");
        };
        assert!(
            matches!(flights.join("t", "op", &k("k")), Joined::Full),
            "per key"
        );
        assert_eq!(flights.waiting(), 2);
        // Another key has its own flight; the total bound still counts.
        let Joined::Leader(_other) = flights.join("t", "op", &k("other")) else {
            panic!("another key leads its own flight");
        };
        let Joined::Follower(_c) = flights.join("t", "op", &k("other")) else {
            panic!("a duplicate of the other key follows");
        };
        assert!(
            matches!(flights.join("u", "op", &k("other")), Joined::Leader(_)),
            "tenants apart"
        );
        let Joined::Leader(_third) = flights.join("t", "op", &k("third")) else {
            panic!("a third key leads");
        };
        assert!(
            matches!(flights.join("t", "op", &k("third")), Joined::Full),
            "in all"
        );
        drop(leader);
        a.finished().await;
        drop(a);
        // The finished flight is gone: the next request of the key leads anew.
        assert!(matches!(
            flights.join("t", "op", &k("k")),
            Joined::Leader(_)
        ));
    }

    #[test]
    fn a_key_without_duplicates_makes_no_channel_and_leaves_nothing_behind() {
        let flights = Arc::new(Flights::new(2, 3));
        let Joined::Leader(leader) = flights.join("t", "op", &k("alone")) else {
            panic!("the first request leads");
        };
        let entries = |f: &Flights| -> Vec<bool> {
            f.shards
                .iter()
                .flat_map(|s| {
                    s.lock()
                        .unwrap()
                        .values()
                        .map(Option::is_some)
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        assert_eq!(entries(&flights), [false], "an entry, and no flight state");
        drop(leader);
        assert!(entries(&flights).is_empty());
    }

    #[test]
    fn tenants_and_operations_keep_their_flights_apart() {
        let flights = Arc::new(Flights::new(2, 3));
        let Joined::Leader(_a) = flights.join("t", "op", &k("same")) else {
            panic!()
        };
        for (tenant, operation) in [("u", "op"), ("t", "other-op"), ("top", ""), ("", "top")] {
            assert!(
                matches!(
                    flights.join(tenant, operation, &k("same")),
                    Joined::Leader(_)
                ),
                "{tenant}/{operation}"
            );
        }
    }
}
