//! The Redis scenarios' targets: one server, the Redis Cluster, the cluster
//! with `WAIT`; each skipped with a line saying why when it cannot be reached.
//! Their servers' pids (for the CPU column) and the run's keys, removed at the
//! end.

use redis::AsyncCommands;

use super::*;

/// A Redis target the run reaches: where, how the bench server is told, and
/// the redis-server processes whose CPU counts.
pub struct RedisRun {
    pub at: RedisAt,
    pub env: Vec<(&'static str, String)>,
    pub pids: Vec<u32>,
}

/// The prefix of every key the run writes in Redis.
pub fn prefix() -> String {
    format!("idem-bench-{}", std::process::id())
}

fn cluster_urls(s: &Settings) -> Vec<String> {
    s.redis_cluster
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| format!("redis://{n}"))
        .collect()
}

/// `process_id` of `INFO server`.
fn pid_of(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("process_id:"))
        .and_then(|p| p.parse().ok())
}

/// The one server: reachable, and its pid.
async fn server(s: &Settings) -> Result<u32, String> {
    let client = redis::Client::open(s.redis_url.as_str()).map_err(|e| e.to_string())?;
    let mut c = tokio::time::timeout(
        Duration::from_secs(3),
        client.get_multiplexed_async_connection(),
    )
    .await
    .map_err(|_| "no answer within 3 s".to_owned())?
    .map_err(|e| e.to_string())?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut c)
        .await
        .map_err(|e| e.to_string())?;
    pid_of(&info).ok_or_else(|| "INFO server has no process_id".to_owned())
}

/// The cluster: reachable and ok, and every node's pid (replicas too: they
/// replicate every write).
async fn cluster(s: &Settings) -> Result<Vec<u32>, String> {
    let urls = cluster_urls(s);
    if urls.is_empty() {
        return Err("IDEM_BENCH_REDIS_CLUSTER is empty".to_owned());
    }
    let client = redis::cluster::ClusterClient::new(urls).map_err(|e| e.to_string())?;
    let c = tokio::time::timeout(Duration::from_secs(3), client.get_async_connection())
        .await
        .map_err(|_| "no answer within 3 s".to_owned())?
        .map_err(|e| e.to_string())?;
    let c = idem_runtime::redis::RedisConnection::Cluster(c);
    let nodes = c
        .on_every_node(redis::cmd("INFO").arg("server"))
        .await
        .map_err(|e| e.to_string())?;
    let mut pids = Vec::new();
    for (node, info) in nodes {
        let info: String = redis::from_redis_value(info).map_err(|e| e.to_string())?;
        pids.push(pid_of(&info).ok_or_else(|| format!("{node}: no process_id"))?);
    }
    Ok(pids)
}

/// The targets this run reaches, and a line for each it skips.
pub async fn targets(s: &Settings) -> (Vec<RedisRun>, Vec<String>) {
    let mut runs = Vec::new();
    let mut skipped = Vec::new();
    if s.redis_scenarios.is_empty() {
        return (runs, skipped);
    }
    // Every variable the server reads, set (empty for none): the child
    // inherits the driver's environment, where the same names mean more.
    let base = |extra: Vec<(&'static str, String)>| {
        let mut env = vec![
            ("IDEM_BENCH_BACKEND", "redis".to_owned()),
            ("IDEM_BENCH_REDIS_PREFIX", prefix()),
            ("IDEM_BENCH_REDIS_URL", s.redis_url.clone()),
            ("IDEM_BENCH_REDIS_CLUSTER", String::new()),
            ("IDEM_BENCH_REDIS_ACKS", String::new()),
        ];
        for (k, v) in extra {
            env.retain(|(name, _)| *name != k);
            env.push((k, v));
        }
        env
    };
    match server(s).await {
        Ok(pid) => runs.push(RedisRun {
            at: RedisAt::Server,
            env: base(Vec::new()),
            pids: vec![pid],
        }),
        Err(e) => skipped.push(format!(
            "Redis at {} is not reachable ({e}): its scenarios are skipped",
            s.redis_url
        )),
    }
    match cluster(s).await {
        Ok(pids) => {
            runs.push(RedisRun {
                at: RedisAt::Cluster,
                env: base(vec![("IDEM_BENCH_REDIS_CLUSTER", s.redis_cluster.clone())]),
                pids: pids.clone(),
            });
            if s.redis_acks.is_empty() {
                skipped.push(
                    "IDEM_BENCH_REDIS_ACKS is empty: the cluster with WAIT is skipped".to_owned(),
                );
            } else {
                runs.push(RedisRun {
                    at: RedisAt::ClusterAcks,
                    env: base(vec![
                        ("IDEM_BENCH_REDIS_CLUSTER", s.redis_cluster.clone()),
                        ("IDEM_BENCH_REDIS_ACKS", s.redis_acks.clone()),
                    ]),
                    pids,
                });
            }
        }
        Err(e) => skipped.push(format!(
            "the Redis Cluster at {} is not reachable ({e}): its scenarios (with and without \
             WAIT) are skipped; .ci/redis-cluster 7000 /tmp/idem-redis-cluster starts one",
            s.redis_cluster
        )),
    }
    for line in &skipped {
        eprintln!("idem bench: {line}");
    }
    (runs, skipped)
}

/// Removes the run's keys from the server and the cluster (what was
/// reachable).
pub async fn cleanup(s: &Settings, runs: &[RedisRun]) {
    let pattern = format!("{}:*", prefix());
    for run in runs {
        let conn = match run.at {
            RedisAt::Server => match redis::Client::open(s.redis_url.as_str()) {
                Ok(client) => match redis::aio::ConnectionManager::new(client).await {
                    Ok(c) => idem_runtime::redis::RedisConnection::Server(c),
                    Err(_) => continue,
                },
                Err(_) => continue,
            },
            RedisAt::Cluster => {
                let Ok(client) = redis::cluster::ClusterClient::new(cluster_urls(s)) else {
                    continue;
                };
                match client.get_async_connection().await {
                    Ok(c) => idem_runtime::redis::RedisConnection::Cluster(c),
                    Err(_) => continue,
                }
            }
            // The same cluster as the run without WAIT.
            RedisAt::ClusterAcks => continue,
        };
        let mut c = conn;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut c)
            .await
            .unwrap_or_default();
        for k in keys {
            let _: Result<(), _> = c.del(k).await;
        }
    }
}
