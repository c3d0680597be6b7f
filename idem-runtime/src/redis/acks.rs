//! Replication acknowledgement ([`super::RedisLeaseStore::with_replica_acks`]):
//! each state change's script pipelined with `WAIT n timeout`, so the `WAIT`
//! runs on the very connection, and so the very node, that ran the script.
//! Those pipelines go over connections of their own, renewals over another
//! that never waits (see `lanes`).
//!
//! On a cluster redis-rs sends a pipeline to the slot of its first keyed
//! command (the script's record), and a `WAIT` has no key, so it follows; a
//! `MOVED` answer to the script resends the whole pipeline to the new master.
//!
//! Between the script and the `WAIT`, a write of the record's ack mark
//! (`P:{O:s}:ack`, in its slot): from Redis 7.2 a `WAIT` counts the replicas
//! that have the last write *its own connection* made, not everything the
//! master had written (up to 7.0, every command moved that mark, a read
//! included). A script that writes nothing (a replay, a completion sent again
//! that finds its own outcome) would leave it at that connection's last write,
//! perhaps none, and the `WAIT` would pass at once with the record on the
//! master alone. The mark's write moves it past the record's last write,
//! whichever connection made it.

use std::time::Duration;

use redis::{ErrorKind, FromRedisValue, ScriptInvocation, ServerErrorKind, Value};

use super::layout::Layout;
use super::{RedisLeaseStore, redis_err};
use crate::model::{StoreError, millis};

/// How long an ack mark lives (ms): it only has to be written; kept a
/// minute, so that a slot in use keeps one key rather than making one a call.
const ACK_MARK_MS: u64 = 60_000;

/// How many replicas must acknowledge each state change, and how long to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReplicaAcks {
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
}

/// A state change that fewer replicas acknowledged in time than
/// [`super::RedisLeaseStore::with_replica_acks`] asks for: it was written on
/// the master, and may be lost in a failover. The store reports it as a
/// failure ([`StoreError::Redis`], this error its source), never as success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReplicated {
    /// Replicas that acknowledged the write within the timeout.
    pub acknowledged: u32,
    /// Replicas the store asks for.
    pub wanted: u32,
    /// How long the master waited for them.
    pub timeout: Duration,
}

impl std::fmt::Display for NotReplicated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the state change was written on the master but acknowledged by {} of {} replicas \
             within {:?} (with_replica_acks): it may be lost in a failover, so it is reported \
             as a failure; retry the request",
            self.acknowledged, self.wanted, self.timeout
        )
    }
}

impl std::error::Error for NotReplicated {}

/// What a script's run answered, and whether its replicas acknowledged it.
pub(super) struct Ran<T> {
    pub(super) reply: T,
    /// An error when the script ran but its `WAIT` fell short
    /// ([`NotReplicated`]) or failed: the change is on the master, and must
    /// not be reported as done.
    pub(super) acked: Result<(), StoreError>,
}

impl<T> Ran<T> {
    /// The reply, or why it is not acknowledged.
    pub(super) fn acknowledged(self) -> Result<T, StoreError> {
        self.acked.map(|()| self.reply)
    }
}

impl RedisLeaseStore {
    /// Runs a state change's script; with replica acknowledgement on, pipelined
    /// with `WAIT` on one of the connections that carry them, the shortfall
    /// (if any) in [`Ran::acked`].
    pub(super) async fn run<T: FromRedisValue>(
        &self,
        inv: &ScriptInvocation<'_>,
        record: &str,
    ) -> Result<Ran<T>, StoreError> {
        let Some(acks) = self.acks else {
            let reply = inv
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(redis_err)?;
            return Ok(Ran {
                reply,
                acked: Ok(()),
            });
        };
        // Held until the answer is in, so the next pipeline picks another
        // connection while this one's WAIT blocks it.
        let mark = Layout::ack_beside(record).ok_or_else(|| {
            StoreError::Corrupt(format!("redis: {record:?} is not a record's name"))
        })?;
        let lane = self.lanes.for_wait().await?;
        let mut conn = lane.conn();
        let mut pipe = redis::pipe();
        // The script's error is its reply (below), not the pipeline's.
        pipe.ignore_errors();
        pipe.invoke_script(inv)
            .cmd("SET")
            .arg(&mark)
            .arg("1")
            .arg("PX")
            .arg(ACK_MARK_MS)
            .cmd("WAIT")
            .arg(acks.replicas)
            .arg(millis(acks.timeout).max(1));
        let mut loaded = false;
        loop {
            let replies: Vec<Value> = pipe.query_async(&mut conn).await.map_err(redis_err)?;
            let [script, marked, wait] = <[Value; 3]>::try_from(replies).map_err(|_| {
                StoreError::Corrupt(
                    "redis: a script, its ack mark and WAIT, not three replies".into(),
                )
            })?;
            let script = match script.extract_error() {
                // EVALSHA in a pipeline does not load a script the server
                // lacks, and did not run: load it (on every master) and resend.
                Err(e) if !loaded && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    inv.load_async(&mut conn).await.map_err(redis_err)?;
                    loaded = true;
                    continue;
                }
                Err(e) => return Err(redis_err(e)),
                Ok(v) => v,
            };
            let reply = T::from_redis_value(script).map_err(|e| redis_err(e.into()))?;
            // Without the mark's write (refused: out of memory, say) the
            // `WAIT` may not cover the record: not acknowledged.
            let acked = match marked.extract_error().and_then(|_| wait.extract_error()) {
                Ok(Value::Int(n)) => {
                    let acknowledged = u32::try_from(n).unwrap_or(0);
                    if acknowledged < acks.replicas {
                        Err(StoreError::Redis(Box::new(NotReplicated {
                            acknowledged,
                            wanted: acks.replicas,
                            timeout: acks.timeout,
                        })))
                    } else {
                        Ok(())
                    }
                }
                Ok(other) => Err(StoreError::Corrupt(format!(
                    "redis: WAIT answered {other:?}"
                ))),
                Err(e) => Err(redis_err(e)),
            };
            return Ok(Ran { reply, acked });
        }
    }

    /// Runs a renewal's script, never followed by `WAIT`, and with replica
    /// acknowledgement on, on the connection no `WAIT` blocks (`lanes`).
    ///
    /// Not waited for: a renewal only moves forward the lease of a claim that
    /// was acknowledged, and waiting would put it behind the replicas, which
    /// are what is slow or gone when `WAIT`s block. One that a failover loses
    /// leaves the promoted replica with the lease of the claim or of an
    /// earlier renewal, so a retry may take the execution over sooner than
    /// the worker counts; its completion is then refused (fenced by the token)
    /// and its downstream calls carry the same downstream key, as after any
    /// takeover (docs/redis.md, "Replica acknowledgement").
    pub(super) async fn run_renewal<T: redis::FromRedisValue>(
        &self,
        inv: &ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        // The first connection carries no WAIT when acknowledgement is off.
        let mut conn = match self.acks {
            None => self.conn.clone(),
            Some(_) => self.lanes.renewals().await?,
        };
        inv.invoke_async(&mut conn).await.map_err(redis_err)
    }
}
