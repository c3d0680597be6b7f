//! Replication acknowledgement ([`super::RedisLeaseStore::with_replica_acks`]):
//! each state change's script pipelined with `WAIT n timeout`, so the `WAIT`
//! runs on the very connection, and so the very node, that ran the script.
//!
//! On a cluster redis-rs sends a pipeline to the slot of its first keyed
//! command (the script's record), and a `WAIT` has no key, so it follows; a
//! `MOVED` answer to the script resends the whole pipeline to the new master.

use std::time::Duration;

use redis::{ErrorKind, FromRedisValue, ScriptInvocation, ServerErrorKind, Value};

use super::{RedisLeaseStore, redis_err};
use crate::model::{StoreError, millis};

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
    /// `Some` when fewer replicas acknowledged than asked for.
    pub(super) short: Option<NotReplicated>,
}

impl<T> Ran<T> {
    /// The reply, or the shortfall as the store's error.
    pub(super) fn acknowledged(self) -> Result<T, StoreError> {
        match self.short {
            None => Ok(self.reply),
            Some(short) => Err(StoreError::Redis(Box::new(short))),
        }
    }
}

impl RedisLeaseStore {
    /// Runs a state change's script; with replica acknowledgement on, pipelined
    /// with `WAIT`, the shortfall (if any) in [`Ran::short`].
    pub(super) async fn run<T: FromRedisValue>(
        &self,
        inv: &ScriptInvocation<'_>,
    ) -> Result<Ran<T>, StoreError> {
        let mut conn = self.conn.clone();
        let Some(acks) = self.acks else {
            let reply = inv.invoke_async(&mut conn).await.map_err(redis_err)?;
            return Ok(Ran { reply, short: None });
        };
        let mut pipe = redis::pipe();
        // The script's error is its reply (below), not the pipeline's.
        pipe.ignore_errors();
        pipe.invoke_script(inv)
            .cmd("WAIT")
            .arg(acks.replicas)
            .arg(millis(acks.timeout).max(1));
        let mut loaded = false;
        loop {
            let replies: Vec<Value> = pipe.query_async(&mut conn).await.map_err(redis_err)?;
            let [script, wait] = <[Value; 2]>::try_from(replies).map_err(|_| {
                StoreError::Corrupt("redis: a script and WAIT, not two replies".into())
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
            let acknowledged = match wait.extract_error() {
                Ok(Value::Int(n)) => u32::try_from(n).unwrap_or(0),
                Ok(other) => {
                    return Err(StoreError::Corrupt(format!(
                        "redis: WAIT answered {other:?}"
                    )));
                }
                Err(e) => return Err(redis_err(e)),
            };
            let short = (acknowledged < acks.replicas).then_some(NotReplicated {
                acknowledged,
                wanted: acks.replicas,
                timeout: acks.timeout,
            });
            return Ok(Ran { reply, short });
        }
    }
}
