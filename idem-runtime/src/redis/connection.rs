//! The store's connection: one server through redis-rs's `ConnectionManager`,
//! or a Redis Cluster through its `cluster_async::ClusterConnection`, behind one
//! type that runs redis-rs's commands on either.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};

/// A connection to one Redis server or to a Redis Cluster: what
/// [`super::RedisLeaseStore::redis_connection`] answers, for the service's own
/// commands (redis-rs's `AsyncCommands` run on it).
///
/// On a cluster, a command goes where redis-rs routes it (a key's command to
/// the master of its slot); a pipeline goes to the slot of its first key, so
/// all its keys must share a slot.
#[derive(Clone)]
#[non_exhaustive]
pub enum RedisConnection {
    /// One server (multiplexed, reconnecting by itself).
    Server(ConnectionManager),
    /// A Redis Cluster (a connection per node, commands routed by slot,
    /// redirections and failovers followed).
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConnection::Server(_) => "RedisConnection::Server",
            RedisConnection::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Server(c) => c.req_packed_command(cmd),
            RedisConnection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Server(c) => c.req_packed_commands(cmd, offset, count),
            RedisConnection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Server(c) => c.get_db(),
            RedisConnection::Cluster(c) => c.get_db(),
        }
    }
}

impl RedisConnection {
    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConnection::Cluster(_))
    }

    /// Runs `cmd` on every node (on one server, on it alone) and answers each
    /// node's reply by its address (`""` for the one server).
    ///
    /// # Errors
    ///
    /// The first node's error, if any node fails.
    pub async fn on_every_node(&self, cmd: &Cmd) -> Result<Vec<(String, Value)>, RedisError> {
        match self {
            RedisConnection::Server(c) => {
                let v = cmd.query_async(&mut c.clone()).await?;
                Ok(vec![(String::new(), v)])
            }
            RedisConnection::Cluster(c) => {
                let every = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None));
                let v = c.clone().route_command(cmd.clone(), every).await?;
                let Value::Map(replies) = v else {
                    return Ok(vec![(String::new(), v)]);
                };
                let mut out: Vec<(String, Value)> = replies
                    .into_iter()
                    .map(|(addr, v)| {
                        let addr = match addr {
                            Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                            Value::SimpleString(s) => s,
                            other => format!("{other:?}"),
                        };
                        (addr, v)
                    })
                    .collect();
                out.sort_by(|a, b| a.0.cmp(&b.0));
                Ok(out)
            }
        }
    }

    /// Runs groups of commands, each group's keys in one slot, and answers each
    /// group's replies (a command's error as its reply, `Value::ServerError`).
    /// On one server all groups go in one pipeline, a single round trip; on a
    /// cluster each group is a pipeline to its slot's master, all at once.
    pub(super) async fn run_groups(
        &self,
        groups: Vec<Pipeline>,
    ) -> Result<Vec<Vec<Value>>, RedisError> {
        if groups.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            RedisConnection::Server(c) => {
                let mut all = redis::pipe();
                all.ignore_errors();
                let mut lens = Vec::with_capacity(groups.len());
                for g in &groups {
                    let mut n = 0;
                    for cmd in g.cmd_iter() {
                        all.add_command(cmd.clone());
                        n += 1;
                    }
                    lens.push(n);
                }
                let mut replies: Vec<Value> = all.query_async(&mut c.clone()).await?;
                let mut out = Vec::with_capacity(lens.len());
                for n in lens.into_iter().rev() {
                    let tail = replies.split_off(replies.len().saturating_sub(n));
                    out.push(tail);
                }
                out.reverse();
                Ok(out)
            }
            RedisConnection::Cluster(c) => {
                let runs = groups.into_iter().map(|mut g| {
                    let mut c = c.clone();
                    async move {
                        g.ignore_errors();
                        g.query_async::<Vec<Value>>(&mut c).await
                    }
                });
                futures_util::future::try_join_all(runs).await
            }
        }
    }
}
