//! The store's connection: one server through redis-rs's `ConnectionManager`,
//! or a Redis Cluster through its `cluster_async::ClusterConnection`, behind one
//! type that runs redis-rs's commands on either.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
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

    /// Every key whose name matches `pattern` (`SCAN .. MATCH`, a page of about
    /// a thousand names a command, so no server is blocked as `KEYS` would
    /// block it): on one server its keys, on a cluster every master's.
    pub(super) async fn scan_matching(&self, pattern: &str) -> Result<Vec<String>, RedisError> {
        let mut found = Vec::new();
        match self {
            RedisConnection::Server(c) => {
                scan_on(pattern, &mut found, |cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<Value>(&mut c).await }
                })
                .await?;
            }
            RedisConnection::Cluster(c) => {
                let masters = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let Value::Map(replies) =
                    c.clone().route_command(redis::cmd("PING"), masters).await?
                else {
                    return Err(RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "the masters' answers to PING were not a map by address",
                    )));
                };
                for (addr, _) in replies {
                    let addr: String = redis::from_redis_value(addr)?;
                    // A master whose address cannot be read is an error, not a
                    // master skipped: its keys would be missed in silence.
                    let node = addr
                        .rsplit_once(':')
                        .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
                        .map(|(host, port)| {
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                host: host
                                    .trim_start_matches('[')
                                    .trim_end_matches(']')
                                    .to_owned(),
                                port,
                            })
                        })
                        .ok_or_else(|| {
                            RedisError::from((
                                redis::ErrorKind::UnexpectedReturnType,
                                "a master's address is not host:port",
                                addr.clone(),
                            ))
                        })?;
                    scan_on(pattern, &mut found, |cmd| {
                        let mut c = c.clone();
                        let node = node.clone();
                        async move { c.route_command(cmd, node).await }
                    })
                    .await?;
                }
            }
        }
        found.sort();
        found.dedup();
        Ok(found)
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

/// One node's `SCAN` from cursor 0 until the cursor comes back to 0, each page
/// sent by `send`; the names found are added to `found`.
async fn scan_on<F, Fut>(pattern: &str, found: &mut Vec<String>, send: F) -> Result<(), RedisError>
where
    F: Fn(Cmd) -> Fut,
    Fut: std::future::Future<Output = Result<Value, RedisError>>,
{
    let mut cursor: u64 = 0;
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, page): (u64, Vec<String>) = redis::from_redis_value(send(cmd).await?)?;
        found.extend(page);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
