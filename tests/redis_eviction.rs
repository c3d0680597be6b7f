//! The Redis lease store's start-up check against the real server: an
//! `allkeys-*` eviction policy is refused. A test binary of its own with one
//! test, because it changes the server's policy for a moment (cargo runs test
//! binaries one after another, so no other test of this suite sees it); the
//! policy is put back even when the test fails.

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
    // A volatile policy without maxmemory starts (and so does noeviction).
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
