//! A Redis Cluster master killed under load, with and without
//! `with_replica_acks`.
//!
//! The test starts a cluster of its own (six `redis-server` children on free
//! local ports, three masters with one replica each, in a temporary
//! directory; all killed and removed at the end, a failed test included), then
//! twice, each time on a prefix of its own: concurrent workers claim keys of
//! one operation, run an effect (a counter per key) and complete it, retrying
//! a key until its outcome replays; after a fixed number of acknowledged
//! claims (not after a sleep) the master serving the operation's first shard
//! is sent SIGKILL; the test waits until the cluster has promoted its
//! replica, restarts the killed node (it rejoins as the new master's replica,
//! empty: nothing persisted), and lets the workers finish. Then every key is
//! claimed once more, and the run is reported:
//!
//! * claims lost: keys acquired as new twice, the store having forgotten an
//!   acknowledged claim;
//! * completions lost: keys whose acknowledged completion did not replay;
//! * keys executed twice: keys whose effect ran twice, for either reason or
//!   after a takeover (a completion that failed in the failover leaves the
//!   record in flight; its lease lapses and a retry takes it over, as leased
//!   mode does for any worker that could not record its outcome, with the
//!   same downstream key).
//!
//! What is asserted is what is promised: with acknowledgement from the only
//! replica, no acknowledged claim or completion is lost (the replica that
//! acknowledged it is the one promoted). Without, Redis replicates
//! asynchronously and a write acknowledged in the last moments before the
//! kill may be lost: that run is only reported.

use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::lease::Acquisition;
use idem_runtime::redis::RedisLeaseStore;
use idem_runtime::{FingerprintBuilder, IdempotencyKey, LeaseRequest, LeasedClaim, StoredResponse};
use serde_json::json;
use tokio::sync::Notify;

/// The cluster's nodes: six ports, the first three masters.
const NODES: usize = 6;
/// Milliseconds before a silent master is failed over: short, for a quick test,
/// and long enough that a busy machine does not fail one over by itself.
const NODE_TIMEOUT_MS: u32 = 2000;

/// The test's own cluster: its nodes' children and directory, removed when
/// dropped.
struct Cluster {
    dir: PathBuf,
    ports: Vec<u16>,
    children: Vec<Option<Child>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Six consecutive ports that are free, with their cluster bus ports (+10000).
fn free_ports() -> Vec<u16> {
    let start = 20000 + (std::process::id() % 1500) as u16 * 6;
    let mut base = start;
    loop {
        let ports: Vec<u16> = (base..base + NODES as u16).collect();
        let free = ports.iter().all(|&p| {
            TcpListener::bind(("127.0.0.1", p)).is_ok()
                && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok()
        });
        if free {
            return ports;
        }
        base += NODES as u16;
        if base > 29990 {
            base = 20000;
        }
        assert_ne!(base, start, "no six free ports between 20000 and 30000");
    }
}

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Waits (polling, within a bound) until `ready` holds.
async fn until(what: &str, bound: Duration, mut ready: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + bound;
    while !ready().await {
        assert!(Instant::now() < deadline, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One node's reply to a command, if it answers.
async fn ask<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Option<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut c = client.get_multiplexed_async_connection().await.ok()?;
    cmd.query_async(&mut c).await.ok()
}

/// `INFO replication`, or `CLUSTER INFO` for "cluster", of one node.
async fn info(port: u16, section: &str) -> String {
    let cmd = match section {
        "cluster" => redis::cmd("CLUSTER").arg("INFO").clone(),
        _ => redis::cmd("INFO").arg(section).clone(),
    };
    ask(port, &cmd).await.unwrap_or_default()
}

impl Cluster {
    async fn start() -> Cluster {
        let dir = std::env::temp_dir().join(format!("idem-failover-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut cluster = Cluster {
            dir,
            ports: free_ports(),
            children: Vec::new(),
        };
        for i in 0..NODES {
            let child = cluster.spawn(i);
            cluster.children.push(Some(child));
        }
        for &p in &cluster.ports {
            until("a node listens", Duration::from_secs(30), async || {
                port_open(p)
            })
            .await;
        }
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli (Debian's redis-tools) runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        cluster.until_up().await;
        cluster
    }

    /// Starts node `i` (again: it finds its cluster in its nodes.conf).
    fn spawn(&self, i: usize) -> Child {
        let port = self.ports[i];
        let dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            // A replica's (re)sync starts at once, not after 5 s.
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(self.dir.join(format!("{port}.log")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs")
    }

    /// Every node sees the cluster ok, and every master has its replica
    /// linked.
    async fn until_up(&self) {
        for &p in &self.ports {
            until(
                "the cluster is ok, replicas linked",
                Duration::from_secs(60),
                async || {
                    info(p, "cluster").await.contains("cluster_state:ok")
                        && info(p, "replication").await.lines().any(|l| {
                            l.trim() == "master_link_status:up"
                                || l.trim()
                                    .strip_prefix("connected_slaves:")
                                    .is_some_and(|n| n != "0")
                        })
                },
            )
            .await;
        }
    }

    fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The port of the master serving `key`'s slot, asked of a live node.
    async fn master_of(&self, key: &str) -> u16 {
        for &p in &self.ports {
            let Some(slot) = ask::<i64>(p, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).await
            else {
                continue;
            };
            let Some(slots) = ask::<Vec<redis::Value>>(p, redis::cmd("CLUSTER").arg("SLOTS")).await
            else {
                continue;
            };
            for range in slots {
                let redis::Value::Array(r) = range else {
                    continue;
                };
                let start: i64 = redis::from_redis_value(r[0].clone()).unwrap();
                let end: i64 = redis::from_redis_value(r[1].clone()).unwrap();
                if (start..=end).contains(&slot)
                    && let redis::Value::Array(m) = &r[2]
                {
                    return redis::from_redis_value::<i64>(m[1].clone()).unwrap() as u16;
                }
            }
        }
        panic!("no node says which master serves {key}");
    }

    /// SIGKILL to the node on `port`.
    fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|&p| p == port).unwrap();
        let mut child = self.children[i].take().expect("the node runs");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Waits until another node serves what the killed `port` served, then
    /// restarts it and waits until it is that node's replica.
    async fn fail_over_and_restart(&mut self, port: u16, key: &str) -> Duration {
        let started = Instant::now();
        let live = *self.ports.iter().find(|&&p| p != port).unwrap();
        until(
            "the replica is promoted",
            Duration::from_secs(60),
            async || {
                info(live, "cluster").await.contains("cluster_state:ok")
                    && self.master_of(key).await != port
            },
        )
        .await;
        let promoted = started.elapsed();
        let i = self.ports.iter().position(|&p| p == port).unwrap();
        self.children[i] = Some(self.spawn(i));
        until(
            "the killed node rejoins as a replica",
            Duration::from_secs(60),
            async || {
                let r = info(port, "replication").await;
                r.contains("role:slave") && r.contains("master_link_status:up")
            },
        )
        .await;
        self.until_up().await;
        promoted
    }
}

const OPERATION: &str = "create-payment";

fn req(key: &IdempotencyKey) -> LeaseRequest<'_> {
    LeaseRequest {
        tenant: "acme",
        operation: OPERATION,
        key,
        fingerprint: FingerprintBuilder::new("acme", OPERATION, "POST", "/payments")
            .body(&json!({ "amount": 100 }))
            .unwrap()
            .finish(),
        retention: Duration::from_secs(3600),
        // Short, so a record whose completion the failover swallowed is taken
        // over soon.
        lease: Duration::from_secs(2),
    }
}

fn paid(key: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: format!("{{\"charge\":\"{key}\"}}").into(),
    }
}

/// What a run saw, per key.
#[derive(Default)]
struct Seen {
    /// Claims answered `Acquired`: the acknowledged ones.
    acknowledged: usize,
    /// Acquisitions as new, by key.
    new: HashMap<String, u32>,
    /// Effects run, by key.
    effects: HashMap<String, u32>,
    /// Acquisitions that took over an execution.
    taken_over: usize,
    /// Keys whose completion was acknowledged.
    completed: HashSet<String>,
    /// Errors answered by the store (the failover), retried.
    errors: usize,
}

/// A key until its outcome replays.
async fn work(store: &RedisLeaseStore, raw: &str, seen: &Mutex<Seen>, acked: &AtomicUsize) {
    let key = IdempotencyKey::parse(raw).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        assert!(Instant::now() < deadline, "{raw}: no outcome within 120 s");
        match store.claim(&req(&key)).await {
            Ok(LeasedClaim::Acquired(lease)) => {
                {
                    let mut s = seen.lock().unwrap();
                    s.acknowledged += 1;
                    match lease.acquisition() {
                        Acquisition::New => *s.new.entry(raw.to_owned()).or_default() += 1,
                        _ => s.taken_over += 1,
                    }
                    *s.effects.entry(raw.to_owned()).or_default() += 1;
                }
                acked.fetch_add(1, Ordering::SeqCst);
                if lease.complete(&paid(raw)).await.is_ok() {
                    seen.lock().unwrap().completed.insert(raw.to_owned());
                    return;
                }
                // Not recorded: claim again (a replay if it was stored after
                // all, in flight until the lease lapses otherwise).
            }
            Ok(LeasedClaim::Replay(_)) => return,
            Ok(LeasedClaim::InFlight { retry_after }) => {
                tokio::time::sleep(retry_after.min(Duration::from_millis(100))).await;
            }
            Ok(other) => panic!("{raw}: {other:?}"),
            Err(_) => {
                seen.lock().unwrap().errors += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One run: load, a master killed after `kill_after` acknowledged claims,
/// its replica promoted, the node restarted, the keys finished and checked.
async fn run(cluster: &mut Cluster, acks: bool) -> Report {
    const KEYS: usize = 600;
    const WORKERS: usize = 16;
    const KILL_AFTER: usize = 200;
    let prefix = format!(
        "idem-f{}-{}",
        std::process::id(),
        if acks { "acks" } else { "none" }
    );
    let mut store = RedisLeaseStore::connect_cluster_with_prefix(cluster.urls(), &prefix)
        .await
        .unwrap();
    if acks {
        store = store
            .with_replica_acks(1, Duration::from_millis(500))
            .unwrap();
    }
    // The master of the operation's first shard (a third of the keys, or so).
    let tag = format!("{{{OPERATION}:0}}");
    let victim = cluster.master_of(&tag).await;

    let keys: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(
        (0..KEYS).rev().map(|i| format!("{prefix}-k{i}")).collect(),
    ));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let acked = Arc::new(AtomicUsize::new(0));
    let kill_now = Arc::new(Notify::new());
    let told = Arc::new(AtomicBool::new(false));
    // Workers in the middle of a key.
    let busy = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..WORKERS {
        let (store, keys, seen, acked, kill_now, told, busy) = (
            store.clone(),
            keys.clone(),
            seen.clone(),
            acked.clone(),
            kill_now.clone(),
            told.clone(),
            busy.clone(),
        );
        workers.spawn(async move {
            loop {
                let Some(key) = keys.lock().unwrap().pop() else {
                    return;
                };
                busy.fetch_add(1, Ordering::SeqCst);
                work(&store, &key, &seen, &acked).await;
                busy.fetch_sub(1, Ordering::SeqCst);
                if acked.load(Ordering::SeqCst) >= KILL_AFTER && !told.swap(true, Ordering::SeqCst)
                {
                    kill_now.notify_one();
                }
            }
        });
    }
    kill_now.notified().await;
    let in_flight_at_kill = busy.load(Ordering::SeqCst);
    cluster.kill(victim);
    let acked_at_kill = acked.load(Ordering::SeqCst);
    let promoted = cluster.fail_over_and_restart(victim, &tag).await;
    while let Some(done) = workers.join_next().await {
        done.unwrap();
    }

    // Every key once more: its outcome must replay.
    let mut seen = std::mem::take(&mut *seen.lock().unwrap());
    let mut completions_lost = 0;
    for i in 0..KEYS {
        let raw = format!("{prefix}-k{i}");
        let key = IdempotencyKey::parse(&raw).unwrap();
        let answer = loop {
            match store.claim(&req(&key)).await {
                Ok(a) => break a,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        match answer {
            LeasedClaim::Replay(_) => {}
            LeasedClaim::Acquired(lease) => {
                if seen.completed.contains(&raw) {
                    completions_lost += 1;
                }
                *seen.new.entry(raw.clone()).or_default() += 1;
                let _ = lease.release().await;
            }
            other => panic!("{raw} after the run: {other:?}"),
        }
    }
    Report {
        acks,
        victim,
        acked_at_kill,
        in_flight_at_kill,
        promoted,
        acknowledged: seen.acknowledged,
        claims_lost: seen.new.values().filter(|&&n| n > 1).count(),
        completions_lost,
        executed_twice: seen.effects.values().filter(|&&n| n > 1).count(),
        taken_over: seen.taken_over,
        errors: seen.errors,
    }
}

struct Report {
    acks: bool,
    victim: u16,
    acked_at_kill: usize,
    in_flight_at_kill: usize,
    promoted: Duration,
    acknowledged: usize,
    claims_lost: usize,
    completions_lost: usize,
    executed_twice: usize,
    taken_over: usize,
    errors: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: master 127.0.0.1:{} killed after {} acknowledged claims ({} workers in flight), \
             its replica serving after {:.1} s; {} claims acknowledged in all, {} store errors \
             retried; claims lost: {}, completions lost: {}, keys executed twice: {} ({} \
             takeovers of a record whose completion failed)",
            if self.acks {
                "with_replica_acks(1, 500 ms)"
            } else {
                "without replica acknowledgement"
            },
            self.victim,
            self.acked_at_kill,
            self.in_flight_at_kill,
            self.promoted.as_secs_f64(),
            self.acknowledged,
            self.errors,
            self.claims_lost,
            self.completions_lost,
            self.executed_twice,
            self.taken_over,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_under_load_loses_no_acknowledged_claim_with_replica_acks() {
    let mut cluster = Cluster::start().await;
    let without = run(&mut cluster, false).await;
    println!("{without}");
    let with = run(&mut cluster, true).await;
    println!("{with}");
    assert_eq!(
        (with.claims_lost, with.completions_lost),
        (0, 0),
        "with acknowledgement from the only replica, nothing acknowledged is lost: {with}"
    );
    // Each run had its failover mid-load: claims were acknowledged after it.
    for r in [&without, &with] {
        assert!(r.acknowledged > r.acked_at_kill, "{r}");
    }
}
