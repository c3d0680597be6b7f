//! The Redis lease store's start-up check against the real server: an
//! `allkeys-*` eviction policy is refused, on the one server and on any node
//! of the Redis Cluster. A test binary of its own, because it changes a
//! server's policy for a moment (cargo runs test binaries one after another,
//! so no other test of this suite sees it; its two tests touch different
//! servers); the policy is put back even when a test fails.

use idem_runtime::StoreError;
use idem_runtime::redis::RedisLeaseStore;

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Puts the policy back when dropped.
struct Restore(redis::Client, String);

impl Drop for Restore {
    fn drop(&mut self) {
        let mut c = self.0.get_connection().expect("redis");
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(&self.1)
            .query(&mut c)
            .expect("restore the eviction policy");
    }
}

#[tokio::test]
async fn an_allkeys_eviction_policy_is_refused_at_start() {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let was: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut c)
        .await
        .unwrap();
    let _restore = Restore(client.clone(), was[1].clone());
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut c)
        .await
        .unwrap();
    let e = RedisLeaseStore::connect(&redis_url()).await.unwrap_err();
    assert!(matches!(e, StoreError::Redis(_)), "{e}");
    assert!(e.to_string().contains("allkeys-lru"), "{e}");
    // A volatile policy without maxmemory starts, with a warning (and so does
    // noeviction, without one).
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query_async(&mut c)
        .await
        .unwrap();
    let max: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory")
        .query_async(&mut c)
        .await
        .unwrap();
    if max[1] == "0" {
        RedisLeaseStore::connect(&redis_url()).await.unwrap();
    }
}

/// On a Redis Cluster every node is checked, replicas too (a failover makes
/// one a master): `allkeys-lru` on one replica alone refuses the store, and
/// the error names that node.
#[tokio::test]
async fn an_allkeys_eviction_policy_on_any_cluster_node_is_refused_at_start() {
    let nodes: Vec<String> = std::env::var("IDEM_TEST_REDIS_CLUSTER")
        .unwrap_or_else(|_| "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002".to_owned())
        .split(',')
        .map(|n| format!("redis://{}", n.trim()))
        .collect();
    // A replica: a node whose INFO replication says so.
    let client = redis::cluster::ClusterClient::new(nodes.clone()).unwrap();
    let mut c = client.get_async_connection().await.unwrap();
    let cluster_nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut c)
        .await
        .unwrap();
    let replica = cluster_nodes
        .lines()
        .find(|l| l.split(' ').nth(2).is_some_and(|f| f.contains("slave")))
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|a| a.split('@').next())
        .expect("the cluster has a replica")
        .to_owned();
    let node = redis::Client::open(format!("redis://{replica}")).unwrap();
    let mut n = node.get_multiplexed_async_connection().await.unwrap();
    let was: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut n)
        .await
        .unwrap();
    let _restore = Restore(node.clone(), was[1].clone());
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut n)
        .await
        .unwrap();
    let e = RedisLeaseStore::connect_cluster(nodes).await.unwrap_err();
    assert!(matches!(e, StoreError::Redis(_)), "{e}");
    assert!(
        e.to_string().contains("allkeys-lru") && e.to_string().contains(&replica),
        "{e}"
    );
}
