//! The connections replica acknowledgement runs on
//! ([`super::RedisLeaseStore::with_replica_acks`]), apart from the store's
//! first.
//!
//! Redis blocks a connection while a `WAIT` on it waits, and everything sent
//! after it on that connection waits too. On the one multiplexed connection
//! per node that redis-rs keeps, every request's state change would queue
//! behind the others' acknowledgements, a renewal included: during a replica
//! outage each `WAIT` holds the connection for its whole timeout, and a renewal
//! behind a few of them misses its window, so a live worker loses its lease.
//! So, once acknowledgement is on:
//!
//! * the pipelines that carry a `WAIT` (claims, completions, marks, releases,
//!   resolutions) go over [`WAIT_CONNECTIONS`] connections (each one per
//!   node), each to the one with the fewest in flight, so acknowledgements
//!   that arrive together unblock several requests at once instead of one
//!   after another;
//! * renewals, and the give-ups of claims whose answer never came, go over one
//!   more connection (one per node) that never carries a `WAIT`, so nothing
//!   another request waits for can hold them up;
//! * everything else (reads, the reconciler's listing, the service's own
//!   commands) stays on the store's first connection, which carries no `WAIT`
//!   either.
//!
//! They are opened on first use, from what the store was built from (a client,
//! never a bare connection: see `with_replica_acks`), and shared by every clone
//! of the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::future::BoxFuture;
use redis::RedisError;
use tokio::sync::OnceCell;

use super::connection::RedisConnection;
use super::redis_err;
use crate::model::StoreError;

/// How many connections (each one per node) carry the pipelines that end in
/// `WAIT`, once [`super::RedisLeaseStore::with_replica_acks`] is on. Four:
/// about as many state changes as a few workers keep in flight on one master
/// at once, so an acknowledgement rarely has another `WAIT` ahead of it on
/// its connection; more only adds connections to every node. Renewals have
/// one more of their own.
pub const WAIT_CONNECTIONS: usize = 4;

/// Opens one more connection like the store's first (to the same server, or
/// to the same cluster, with the client's own settings).
pub(super) type Opener =
    Arc<dyn Fn() -> BoxFuture<'static, Result<RedisConnection, RedisError>> + Send + Sync>;

/// The store's extra connections: how to open them, and once opened, them.
pub(super) struct Lanes {
    opener: Option<Opener>,
    opened: OnceCell<Opened>,
}

struct Opened {
    /// Renewals and give-ups: never a `WAIT` on it.
    renewals: RedisConnection,
    /// The pipelines that end in `WAIT`.
    waits: Vec<Lane>,
    /// Where the search for the least busy starts, turned on each time, so
    /// that ties do not all land on the first.
    next: AtomicUsize,
}

struct Lane {
    conn: RedisConnection,
    /// Pipelines sent on it whose answer has not come back.
    in_flight: AtomicUsize,
}

/// A connection taken for one pipeline that ends in `WAIT`; it counts as in
/// flight until dropped.
pub(super) struct WaitLane<'a> {
    lane: &'a Lane,
}

impl WaitLane<'_> {
    /// The connection to send the pipeline on.
    pub(super) fn conn(&self) -> RedisConnection {
        self.lane.conn.clone()
    }
}

impl Drop for WaitLane<'_> {
    fn drop(&mut self) {
        self.lane.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Lanes {
    /// Lanes that `opener` opens on first use; none without one.
    pub(super) fn new(opener: Option<Opener>) -> Self {
        Lanes {
            opener,
            opened: OnceCell::new(),
        }
    }

    /// Whether there is a way to open them (the store was built from a
    /// client).
    pub(super) fn can_open(&self) -> bool {
        self.opener.is_some()
    }

    async fn opened(&self) -> Result<&Opened, StoreError> {
        self.opened
            .get_or_try_init(|| async {
                let Some(open) = &self.opener else {
                    // with_replica_acks refuses a store without an opener.
                    return Err(StoreError::Redis(
                        "replica acknowledgement needs connections of its own, and this store \
                         was handed one connection"
                            .into(),
                    ));
                };
                // Opened all at once: a cluster connection asks a node for the
                // slots before it answers.
                let mut conns =
                    futures_util::future::try_join_all((0..=WAIT_CONNECTIONS).map(|_| open()))
                        .await
                        .map_err(redis_err)?;
                let renewals = conns.pop().expect("one more than WAIT_CONNECTIONS");
                Ok(Opened {
                    renewals,
                    waits: conns
                        .into_iter()
                        .map(|conn| Lane {
                            conn,
                            in_flight: AtomicUsize::new(0),
                        })
                        .collect(),
                    next: AtomicUsize::new(0),
                })
            })
            .await
    }

    /// The connection renewals and give-ups go on: no `WAIT` ever blocks it.
    pub(super) async fn renewals(&self) -> Result<RedisConnection, StoreError> {
        Ok(self.opened().await?.renewals.clone())
    }

    /// The renewals' connection if the lanes are open already: a claim sent
    /// on one of them opened them all.
    pub(super) fn renewals_if_open(&self) -> Option<RedisConnection> {
        self.opened.get().map(|o| o.renewals.clone())
    }

    /// The least busy of the connections that carry `WAIT`s, for one
    /// pipeline.
    pub(super) async fn for_wait(&self) -> Result<WaitLane<'_>, StoreError> {
        let opened = self.opened().await?;
        let n = opened.waits.len();
        let start = opened.next.fetch_add(1, Ordering::Relaxed) % n;
        let lane = (0..n)
            .map(|i| &opened.waits[(start + i) % n])
            .min_by_key(|lane| lane.in_flight.load(Ordering::Acquire))
            .expect("WAIT_CONNECTIONS is not zero");
        lane.in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(WaitLane { lane })
    }
}
