//! The Redis lease store on a Redis Cluster (`.ci/redis-cluster`: six nodes on
//! 127.0.0.1:7000-7005, three masters with a replica each;
//! `IDEM_TEST_REDIS_CLUSTER` names others): what only a cluster shows. One
//! operation's records land on several slots and masters, the reconciler
//! finds uncertain records on every shard, a cluster node given as one server
//! is refused, a state change waits for its replica when asked to, and a
//! renewal gets through while other requests' `WAIT`s block. The leased suite
//! itself runs on the cluster too (`tests/leased_redis.rs` with
//! `IDEM_TEST_REDIS_CLUSTER`). Every test has a key prefix of its own.

#[path = "common/client_list.rs"]
mod client_list;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use idem_runtime::lease::Acquisition;
use idem_runtime::reconcile::{Reconcile, Reconciler, Resolution, UncertainOutcome};
use idem_runtime::redis::{
    NotReplicated, Redis, RedisConnection, RedisLeaseStore, SHARDS, WAIT_CONNECTIONS,
};
use idem_runtime::{
    FingerprintBuilder, IdempotencyKey, LeaseRequest, LeasedClaim, StoreError, StoredResponse,
};
use redis::AsyncCommands;
use serde_json::json;

use client_list::waiting_ids;

/// The cluster's nodes as `host:port`.
fn nodes() -> Vec<String> {
    std::env::var("IDEM_TEST_REDIS_CLUSTER")
        .unwrap_or_else(|_| "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002".to_owned())
        .split(',')
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect()
}

fn urls() -> Vec<String> {
    nodes().iter().map(|n| format!("redis://{n}")).collect()
}

fn prefix(test: &str) -> String {
    format!("idem-c{}-{test}", std::process::id())
}

/// As [`store`], on a client that waits ten minutes for a reply (the
/// cluster client's default is 5 s): for `WAIT`s that block until the test
/// ends them.
async fn patient_store(test: &str) -> RedisLeaseStore {
    let client = redis::cluster::ClusterClientBuilder::new(urls())
        .response_timeout(Duration::from_secs(600))
        .build()
        .unwrap();
    let s = RedisLeaseStore::with_cluster_client(client, &prefix(test))
        .await
        .unwrap();
    // Emptied of what an earlier run left, as `store` does.
    drop(store(test).await);
    s
}

/// A store under a prefix of this test's own, nothing under it yet.
async fn store(test: &str) -> RedisLeaseStore {
    let prefix = prefix(test);
    let s = RedisLeaseStore::connect_cluster_with_prefix(urls(), &prefix)
        .await
        .unwrap();
    assert!(s.is_cluster());
    let mut c = s.redis_connection();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut c)
        .await
        .unwrap();
    for k in keys {
        let _: () = c.del(k).await.unwrap();
    }
    s
}

const HOUR: Duration = Duration::from_secs(3600);

fn req(key: &IdempotencyKey) -> LeaseRequest<'_> {
    req_for(key, HOUR)
}

fn req_for(key: &IdempotencyKey, lease: Duration) -> LeaseRequest<'_> {
    LeaseRequest {
        tenant: "acme",
        operation: "create-payment",
        key,
        fingerprint: FingerprintBuilder::new("acme", "create-payment", "POST", "/payments")
            .body(&json!({ "amount": 100 }))
            .unwrap()
            .finish(),
        retention: HOUR,
        lease,
    }
}

/// The tests that make `WAIT`s block, or count the clients a `WAIT` blocks,
/// take turns: one's blocked clients are not another's.
static WAITS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn paid(charge: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: format!("{{\"charge\":\"{charge}\"}}").into(),
    }
}

/// The master serving each slot, from `CLUSTER SLOTS` (`host:port`).
async fn masters_by_slot(c: &mut RedisConnection) -> Vec<(i64, i64, String)> {
    let slots: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(c)
        .await
        .unwrap();
    slots
        .into_iter()
        .map(|range| {
            let redis::Value::Array(r) = range else {
                panic!("CLUSTER SLOTS: {range:?}")
            };
            let start: i64 = redis::from_redis_value(r[0].clone()).unwrap();
            let end: i64 = redis::from_redis_value(r[1].clone()).unwrap();
            let (host, port): (String, i64) = match &r[2] {
                redis::Value::Array(m) => (
                    redis::from_redis_value(m[0].clone()).unwrap(),
                    redis::from_redis_value(m[1].clone()).unwrap(),
                ),
                other => panic!("CLUSTER SLOTS master: {other:?}"),
            };
            (start, end, format!("{host}:{port}"))
        })
        .collect()
}

/// The slot of a key, and the master that serves it.
async fn slot_and_master(c: &mut RedisConnection, key: &str) -> (i64, String) {
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(c)
        .await
        .unwrap();
    let master = masters_by_slot(c)
        .await
        .into_iter()
        .find(|(start, end, _)| (*start..=*end).contains(&slot))
        .map(|(_, _, m)| m)
        .expect("every slot is served");
    (slot, master)
}

/// Keys whose digests cover every shard (a digest's first hex digit), one each.
fn a_key_per_shard(name: &str) -> Vec<IdempotencyKey> {
    let mut by_shard: BTreeMap<char, IdempotencyKey> = BTreeMap::new();
    for i in 0.. {
        let key = IdempotencyKey::parse(format!("{name}-{i}")).unwrap();
        let shard = key.digest().to_string().chars().next().unwrap();
        by_shard.entry(shard).or_insert(key);
        if by_shard.len() == SHARDS {
            break;
        }
    }
    by_shard.into_values().collect()
}

/// One operation's traffic is spread: its records land on many slots, served
/// by more than one master, where a single hash tag kept them all on one.
#[tokio::test]
async fn one_operations_records_land_on_several_slots_and_masters() {
    let s = store("spread").await;
    let mut c = s.redis_connection();
    let mut slots = BTreeSet::new();
    let mut masters = BTreeSet::new();
    for key in a_key_per_shard("spread") {
        let LeasedClaim::Acquired(lease) = s.claim(&req(&key)).await.unwrap() else {
            panic!("a new key is acquired");
        };
        lease.complete(&paid("ch")).await.unwrap();
        let name = s.record_key("acme", "create-payment", &key);
        assert!(c.exists::<_, bool>(&name).await.unwrap(), "{name}");
        let (slot, master) = slot_and_master(&mut c, &name).await;
        slots.insert(slot);
        masters.insert(master);
    }
    println!(
        "one operation's records: {} slots, on masters {masters:?}",
        slots.len()
    );
    assert_eq!(slots.len(), SHARDS, "a slot per shard: {slots:?}");
    assert!(masters.len() > 1, "more than one master: {masters:?}");
}

/// Answers "charged" for every uncertain execution, and remembers which.
struct Confirm(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Reconcile for Confirm {
    fn operation(&self) -> &str {
        "create-payment"
    }
    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        self.0.lock().unwrap().push(outcome.key_digest.to_string());
        Resolution::Completed(paid("ch_reconciled"))
    }
}

/// An uncertain record in every shard, so on every master: the reconciler's
/// rounds (pages of five, merged across the shards) ask about each exactly
/// once, and every record ends resolved and every shard's index empty.
#[tokio::test]
async fn the_reconciler_finds_uncertain_records_on_every_shard() {
    let s = store("every-shard").await;
    let mut c = s.redis_connection();
    let keys = a_key_per_shard("uncertain");
    let mut masters = BTreeSet::new();
    for key in &keys {
        let LeasedClaim::Acquired(lease) = s.claim(&req(key)).await.unwrap() else {
            panic!("a new key is acquired");
        };
        lease.mark_uncertain().await.unwrap();
        let index = s.uncertain_index_of("create-payment", key);
        let n: i64 = c.zcard(&index).await.unwrap();
        assert_eq!(n, 1, "{index}");
        masters.insert(slot_and_master(&mut c, &index).await.1);
    }
    assert!(masters.len() > 1, "indexes on several masters: {masters:?}");

    let asked = std::sync::Arc::default();
    let reconciler =
        Reconciler::<_, Redis>::on_store(s.clone(), Confirm(std::sync::Arc::clone(&asked)))
            .with_batch(5);
    let mut completed = 0;
    for _ in 0..keys.len() {
        let report = reconciler.run_once().await.unwrap();
        assert_eq!(report.errors, 0, "{report:?}");
        completed += report.completed;
        if completed == keys.len() as u64 {
            break;
        }
    }
    assert_eq!(completed, keys.len() as u64);
    let mut asked = asked.lock().unwrap().clone();
    asked.sort();
    let mut expected: Vec<String> = keys.iter().map(|k| k.digest().to_string()).collect();
    expected.sort();
    assert_eq!(asked, expected, "every shard's record, each once");
    for index in s.uncertain_indexes("create-payment") {
        let n: i64 = c.zcard(&index).await.unwrap();
        assert_eq!(n, 0, "{index} is empty");
    }
    for key in &keys {
        match s.claim(&req(key)).await.unwrap() {
            LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_reconciled")),
            other => panic!("expected the reconciled outcome, got {other:?}"),
        }
    }
}

/// A node of the cluster given as one server's URL is refused at start, with
/// an error that names the cluster constructor, rather than answer `MOVED`
/// for most keys later.
#[tokio::test]
async fn a_cluster_node_given_as_one_server_is_refused_naming_connect_cluster() {
    for url in urls() {
        let e = RedisLeaseStore::connect_with_prefix(&url, &prefix("one-node"))
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Redis(_)), "{e}");
        assert!(
            e.to_string().contains("Redis Cluster") && e.to_string().contains("connect_cluster"),
            "{e}"
        );
    }
}

/// With replica acknowledgement, a state change returns once the master's
/// replica has it: a whole execution (claim, completion, replay) runs, and
/// the completed record is on the replica when the completion returns. Asked
/// for more replicas than a master has, every change is a failure instead,
/// and a claim so reported leaves the key free.
#[tokio::test]
async fn a_state_change_waits_for_its_replica_and_fails_when_too_few_acknowledge() {
    let _turn = WAITS.lock().await;
    let s = store("acks")
        .await
        .with_replica_acks(1, Duration::from_secs(2))
        .unwrap();
    assert_eq!(s.replica_acks(), Some((1, Duration::from_secs(2))));
    let key = IdempotencyKey::parse("acked-1").unwrap();
    let LeasedClaim::Acquired(lease) = s.claim(&req(&key)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    lease.complete(&paid("ch_acked")).await.unwrap();
    // The replica of the record's master has the completed record now.
    let name = s.record_key("acme", "create-payment", &key);
    let mut c = s.redis_connection();
    let (_, master) = slot_and_master(&mut c, &name).await;
    let replica = replica_of(&mut c, &master).await;
    let mut on_replica = redis::Client::open(format!("redis://{replica}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("READONLY")
        .query_async(&mut on_replica)
        .await
        .unwrap();
    let state: Option<String> = on_replica.hget(&name, "state").await.unwrap();
    assert_eq!(state.as_deref(), Some("completed"), "on {replica}");
    assert!(matches!(
        s.claim(&req(&key)).await.unwrap(),
        LeasedClaim::Replay(_)
    ));

    // Two replicas asked for, one there: never a success.
    let too_many = s
        .clone()
        .with_replica_acks(2, Duration::from_millis(50))
        .unwrap();
    let other = IdempotencyKey::parse("acked-2").unwrap();
    let e = too_many.claim(&req(&other)).await.unwrap_err();
    let StoreError::Redis(source) = &e else {
        panic!("{e}")
    };
    let short = source
        .downcast_ref::<NotReplicated>()
        .unwrap_or_else(|| panic!("{e}"));
    assert_eq!((short.acknowledged, short.wanted), (1, 2), "{e}");
    assert!(
        !c.exists::<_, bool>(s.record_key("acme", "create-payment", &other))
            .await
            .unwrap(),
        "the claim reported as failed was released"
    );
    assert!(matches!(
        s.claim(&req(&other)).await.unwrap(),
        LeasedClaim::Acquired(_)
    ));
}

/// A replica stopped (`SIGSTOP`) while the master keeps it as online: it
/// acknowledges nothing until the guard lets it go on (`SIGCONT`, also when
/// the test fails).
struct Stopped(String);

impl Stopped {
    async fn replica(node: &str) -> Stopped {
        let mut c = redis::Client::open(format!("redis://{node}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut c)
            .await
            .unwrap();
        let pid = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .expect("INFO server names the process")
            .trim()
            .to_owned();
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap();
        assert!(stopped.success(), "kill -STOP {pid}");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0])
            .status();
    }
}

/// A claim answered from the record (a replay) writes nothing. Its `WAIT`
/// still waits for every write the master made before it, the record's last
/// state included: the pipeline writes the slot's ack mark before it (from
/// Redis 7.2 a `WAIT` covers only its own connection's writes; up to 7.0 a
/// read moved that point too). So a completion reported as not
/// replicated (its replica stopped) does not come back as an acknowledged
/// replay from the next claim, which a failover would lose, although each
/// state change takes the next of the store's connections that carry `WAIT`
/// (the replay's never wrote). Once the replica runs again, the replay is
/// acknowledged.
#[tokio::test]
async fn a_replay_is_acknowledged_only_once_the_replica_has_the_record() {
    let _turn = WAITS.lock().await;
    let s = store("acked-replay")
        .await
        .with_replica_acks(1, Duration::from_millis(300))
        .unwrap();
    let key = IdempotencyKey::parse("acked-replay-1").unwrap();
    let LeasedClaim::Acquired(lease) = s.claim(&req(&key)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    let name = s.record_key("acme", "create-payment", &key);
    let mut c = s.redis_connection();
    let (_, master) = slot_and_master(&mut c, &name).await;
    let replica = replica_of(&mut c, &master).await;
    let stopped = Stopped::replica(&replica).await;
    let e = lease.complete(&paid("ch_acked")).await.unwrap_err();
    assert!(
        e.to_string().contains("acknowledged by 0 of 1 replicas"),
        "{e}"
    );
    match s.claim(&req(&key)).await {
        Err(StoreError::Redis(source)) => {
            let short = source
                .downcast_ref::<NotReplicated>()
                .unwrap_or_else(|| panic!("{source}"));
            assert_eq!((short.acknowledged, short.wanted), (0, 1));
        }
        other => panic!("a replay the replica lacks is not acknowledged: {other:?}"),
    }
    drop(stopped);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match s.claim(&req(&key)).await {
            Ok(LeasedClaim::Replay(stored)) => {
                assert_eq!(stored, paid("ch_acked"));
                break;
            }
            Err(e) if Instant::now() < deadline => {
                assert!(e.to_string().contains("replicas"), "{e}");
            }
            other => panic!("the replay, once replicated: {other:?}"),
        }
    }
}

/// The replica of a master, from `CLUSTER NODES` (`host:port`).
async fn replica_of(c: &mut RedisConnection, master: &str) -> String {
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(c)
        .await
        .unwrap();
    let id_of = |addr: &str| {
        nodes
            .lines()
            .find(|l| {
                l.split(' ')
                    .nth(1)
                    .is_some_and(|a| a.starts_with(&format!("{addr}@")))
            })
            .and_then(|l| l.split(' ').next())
            .map(str::to_owned)
    };
    let master_id = id_of(master).expect("the master is a node");
    nodes
        .lines()
        .find(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            f.get(2).is_some_and(|flags| flags.contains("slave"))
                && f.get(3) == Some(&master_id.as_str())
        })
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|a| a.split('@').next())
        .map(str::to_owned)
        .expect("the master has a replica")
}

/// `n` keys whose records share `key`'s shard, and so its slot and master.
fn keys_beside(key: &IdempotencyKey, name: &str, n: usize) -> Vec<IdempotencyKey> {
    let shard = key.digest().to_string().chars().next().unwrap();
    (0..)
        .map(|i| IdempotencyKey::parse(format!("{name}-{i}")).unwrap())
        .filter(|k| k.digest().to_string().starts_with(shard))
        .take(n)
        .collect()
}

/// Ends every `WAIT` that blocks a client of `node` (`host:port`) now, as its
/// timeout would (`CLIENT UNBLOCK .. TIMEOUT`): how many it ended.
async fn unblock_waits(node: &str) -> usize {
    let (mut c, waiting) = waiting_on(node).await;
    let mut ended = 0;
    for id in waiting {
        let n: i64 = redis::cmd("CLIENT")
            .arg("UNBLOCK")
            .arg(id)
            .arg("TIMEOUT")
            .query_async(&mut c)
            .await
            .unwrap();
        ended += n as usize;
    }
    ended
}

/// How many clients of `node` (`host:port`) a `WAIT` blocks now, by
/// `CLIENT LIST` (`flags` with `b`, the command `wait`).
async fn blocked_in_wait(node: &str) -> usize {
    waiting_on(node).await.1.len()
}

/// A connection to `node`, and the ids of its clients a `WAIT` blocks now.
async fn waiting_on(node: &str) -> (redis::aio::MultiplexedConnection, Vec<u64>) {
    let mut c = redis::Client::open(format!("redis://{node}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut c)
        .await
        .unwrap();
    let waiting = waiting_ids(&clients);
    (c, waiting)
}

/// A renewal never queues behind other requests' acknowledgements. A live lease's master has one replica; other requests on the same
/// master ask for two, so each of their `WAIT`s blocks its connection, as
/// every `WAIT` does while the replica is gone (here for ten minutes, on a
/// client that waits as long: until the test ends them), and the server is
/// seen to hold one on every connection that carries them. The renewal, sent
/// then, comes back renewed within a third of the lease (the background
/// renewer's window) while every one of those requests is still waiting; once
/// the test ends their `WAIT`s (`CLIENT UNBLOCK`), they end as failures (too
/// few replicas) that give their keys back. On one shared connection the
/// renewal waited behind them.
#[tokio::test]
async fn a_renewal_gets_through_while_other_requests_waits_block() {
    let _turn = WAITS.lock().await;
    let s = patient_store("renew-unblocked").await;
    let acked = s
        .clone()
        .with_replica_acks(1, Duration::from_secs(2))
        .unwrap();
    // Clones share the store's connections: these WAITs block the very
    // connections the acknowledged lease's state changes use.
    let stuck = s
        .clone()
        .with_replica_acks(2, Duration::from_secs(600))
        .unwrap();

    let key = IdempotencyKey::parse("renewed-1").unwrap();
    let lease_len = Duration::from_secs(30);
    let LeasedClaim::Acquired(lease) = acked.claim(&req_for(&key, lease_len)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    let name = s.record_key("acme", "create-payment", &key);
    let mut c = s.redis_connection();
    let (_, master) = slot_and_master(&mut c, &name).await;
    let before: i64 = c.hget(&name, "lease_until").await.unwrap();

    let others = keys_beside(&key, "blocked", WAIT_CONNECTIONS);
    let waiting: Vec<_> = others
        .iter()
        .map(|k| {
            let (stuck, k) = (stuck.clone(), k.clone());
            tokio::spawn(async move { stuck.claim(&req(&k)).await.map(|_| ()) })
        })
        .collect();
    // Every connection that carries WAITs is blocked on the master (polled;
    // the bound only bounds a failure).
    let seen = Instant::now();
    while blocked_in_wait(&master).await < WAIT_CONNECTIONS {
        assert!(
            seen.elapsed() < Duration::from_secs(30),
            "the WAITs never blocked: {} of {WAIT_CONNECTIONS}",
            blocked_in_wait(&master).await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let sent = Instant::now();
    let renewed = tokio::time::timeout(lease_len / 3, lease.renew()).await;
    let took = sent.elapsed();
    assert!(
        matches!(renewed, Ok(Ok(()))),
        "the renewal got through in time: {renewed:?} after {took:?}"
    );
    assert!(
        waiting.iter().all(|w| !w.is_finished()),
        "the renewal came back while the other requests still waited"
    );
    assert!(!lease.is_lost());
    let after: i64 = c.hget(&name, "lease_until").await.unwrap();
    assert!(
        after > before,
        "the lease moved on the master: {after} > {before}"
    );
    println!("renewed in {took:?} while {WAIT_CONNECTIONS} WAITs blocked");

    assert_eq!(unblock_waits(&master).await, WAIT_CONNECTIONS);
    for w in waiting {
        let e = w.await.unwrap().unwrap_err();
        let StoreError::Redis(source) = &e else {
            panic!("{e}")
        };
        let short = source
            .downcast_ref::<NotReplicated>()
            .unwrap_or_else(|| panic!("{e}"));
        assert_eq!((short.acknowledged, short.wanted), (1, 2), "{e}");
    }
    for k in &others {
        let LeasedClaim::Acquired(l) = acked.claim(&req(k)).await.unwrap() else {
            panic!("a claim reported as failed gave its key back");
        };
        assert_eq!(l.acquisition(), Acquisition::New);
        l.release().await.unwrap();
    }
    lease.complete(&paid("ch_renewed")).await.unwrap();
}
