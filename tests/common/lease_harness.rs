//! One harness for every store leased mode runs on: what the leased suite
//! (`tests/leased.rs`) needs of a store beyond idem's own API, implemented for
//! PostgreSQL, SQLite, MySQL (a fresh database per test) and Redis (a key prefix
//! per test). The suite is written once against [`LeaseHarness`] and stamped per
//! store; what only one store has is tested beside it.
//!
//! Every record the suite looks at belongs to tenant `acme` and operation
//! `create-payment`.

#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant};

use idem_runtime::lease::LeaseBackend;
use idem_runtime::reconcile::{Reconcile, Resolution, UncertainOutcome};
use idem_runtime::{Idem, IdempotencyKey, LeaseRequest, LeasedClaim, StoreError, StoredResponse};

pub const TENANT: &str = "acme";
pub const OPERATION: &str = "create-payment";

/// The stored answer of a payment charged as `charge`.
pub fn paid(charge: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: format!("{{\"charge\":\"{charge}\"}}").into(),
    }
}

/// A reconciler whose downstream answers "still unknown" for the keys
/// `a-stuck-1` to `a-stuck-3` and "charged" for the others: rows that never
/// resolve, beside rows that do.
pub struct Stubborn;

impl Reconcile for Stubborn {
    fn operation(&self) -> &str {
        OPERATION
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        let stuck = ["a-stuck-1", "a-stuck-2", "a-stuck-3"]
            .map(|k| IdempotencyKey::parse(k).unwrap().digest());
        if stuck.contains(&outcome.key_digest) {
            Resolution::StillUncertain
        } else {
            Resolution::Completed(paid("ch_fresh"))
        }
    }
}

/// A record as the store keeps it, read behind idem's back.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// `processing`, `completed`, `failed` or `uncertain`.
    pub state: String,
    pub generation: i64,
    /// The stored response's body, once finished.
    pub body: Option<Vec<u8>>,
    pub downstream_key: Option<String>,
    /// The lease's expiry as the store writes it (text: only compared).
    pub lease_until: Option<String>,
}

/// What the leased suite needs of a store.
pub trait LeaseHarness: Send + Sync + Sized + 'static {
    /// The store's `LeaseBackend`.
    type Db: LeaseBackend;
    /// What keeps renewals of a key from getting through while it lives.
    type Blocker: Send;

    /// A fresh, empty store of the calling test's own.
    fn new(test: &str) -> impl Future<Output = Self> + Send;

    /// The handle leases are claimed through.
    fn store(&self) -> <Self::Db as LeaseBackend>::Store;

    /// A service's configuration over the store.
    fn idem(&self) -> Idem<Self::Db>;

    /// Claims through the store's own entry point.
    fn claim(&self, req: &LeaseRequest<'_>) -> impl Future<Output = LeasedClaim<Self::Db>> + Send;

    /// Claims through the store's own entry point, its error returned.
    fn try_claim(
        &self,
        req: &LeaseRequest<'_>,
    ) -> impl Future<Output = Result<LeasedClaim<Self::Db>, StoreError>> + Send;

    /// The record of `key`, or `None`.
    fn record(&self, key: &IdempotencyKey) -> impl Future<Output = Option<Record>> + Send;

    /// How many records the store holds, in any state.
    fn records(&self) -> impl Future<Output = usize> + Send;

    /// How many uncertain executions the reconciler's listing holds (SQL: the
    /// `uncertain` rows; Redis: the entries of every shard's index).
    fn uncertain_listed(&self) -> impl Future<Output = usize> + Send;

    /// The store's clock, in milliseconds (only compared with itself).
    fn now_ms(&self) -> impl Future<Output = i64> + Send;

    /// Whether the lease of `key` has lapsed on the store's clock: a claim now
    /// takes it over (every store's claim counts a lease that ends at its now
    /// as lapsed).
    fn lease_lapsed(&self, key: &IdempotencyKey) -> impl Future<Output = bool> + Send;

    /// Keeps renewals of `key` from getting through (a held row lock, or a
    /// record that refuses every script) until [`LeaseHarness::unblock`].
    fn block_renewals(&self, key: &IdempotencyKey) -> impl Future<Output = Self::Blocker> + Send;

    /// Lets renewals through again.
    fn unblock(&self, blocker: Self::Blocker) -> impl Future<Output = ()> + Send;

    /// Deletes the record of `key` behind idem's back, as an operator's purge or
    /// a second reconciler would.
    fn delete(&self, key: &IdempotencyKey) -> impl Future<Output = ()> + Send;

    /// Forgets the downstream key of `key`'s record, as a record written by hand
    /// would lack it.
    fn forget_downstream_key(&self, key: &IdempotencyKey) -> impl Future<Output = ()> + Send;
}

/// Waits until the lease of `key` has lapsed on the store's clock.
pub async fn until_lease_lapsed<H: LeaseHarness>(h: &H, key: &IdempotencyKey) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !h.lease_lapsed(key).await {
        assert!(Instant::now() < deadline, "the lease never lapsed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the store's clock has moved past the millisecond it reads now,
/// so that what is written next is ordered after what was written before.
pub async fn next_instant<H: LeaseHarness>(h: &H) {
    let now = h.now_ms().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.now_ms().await <= now {
        assert!(Instant::now() < deadline, "the store's clock stood still");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The SQL stores: each a database of the test's own (`common::TestDb`,
/// `SqliteDb`, `MySqlDb`), read with the database's own spelling.
macro_rules! sql_harness {
    (
        $name:ident, $db:ty, $test_db:ty,
        // the database clock in milliseconds, as a select expression
        now_ms: $now_ms:expr,
        // the database clock as idem writes timestamps
        now: $now:expr,
        // a placeholder's spelling
        p: $p:expr,
        // a timestamp read as text
        as_text: $as_text:expr,
        // how a transaction holds a key's row against every writer
        hold: ($begin:expr, $hold:expr)
    ) => {
        /// A SQL store for the leased suite.
        pub struct $name {
            pub db: $test_db,
        }

        impl $crate::common::lease_harness::LeaseHarness for $name {
            type Db = $db;
            type Blocker = sqlx::Transaction<'static, $db>;

            async fn new(_test: &str) -> Self {
                $name {
                    db: <$test_db>::new().await,
                }
            }

            fn store(&self) -> sqlx::Pool<$db> {
                self.db.pool.clone()
            }

            fn idem(&self) -> Idem<$db> {
                Idem::new(self.db.pool.clone())
            }

            async fn claim(&self, req: &LeaseRequest<'_>) -> LeasedClaim<$db> {
                self.try_claim(req).await.unwrap()
            }

            async fn try_claim(
                &self,
                req: &LeaseRequest<'_>,
            ) -> Result<LeasedClaim<$db>, idem_runtime::StoreError> {
                idem_runtime::claim_leased(&self.db.pool, req).await
            }

            async fn record(
                &self,
                key: &IdempotencyKey,
            ) -> Option<$crate::common::lease_harness::Record> {
                use sqlx::Row;
                let sql = format!(
                    "SELECT state, generation, response_body, downstream_key, \
                            {} AS lease_until \
                       FROM idempotency_requests WHERE key_digest = {}",
                    $as_text, $p
                );
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(key.digest())
                    .fetch_optional(&self.db.pool)
                    .await
                    .unwrap()?;
                Some($crate::common::lease_harness::Record {
                    state: row.get("state"),
                    generation: row.get("generation"),
                    body: row.get("response_body"),
                    downstream_key: row.get("downstream_key"),
                    lease_until: row.get("lease_until"),
                })
            }

            async fn records(&self) -> usize {
                self.db
                    .count("SELECT count(*) FROM idempotency_requests")
                    .await as usize
            }

            async fn uncertain_listed(&self) -> usize {
                self.db
                    .count("SELECT count(*) FROM idempotency_requests WHERE state = 'uncertain'")
                    .await as usize
            }

            async fn now_ms(&self) -> i64 {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT {}", $now_ms)))
                    .fetch_one(&self.db.pool)
                    .await
                    .unwrap()
            }

            async fn lease_lapsed(&self, key: &IdempotencyKey) -> bool {
                let sql = format!(
                    "SELECT count(*) FROM idempotency_requests \
                      WHERE key_digest = {} AND lease_expires_at <= {}",
                    $p, $now
                );
                let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .bind(key.digest())
                    .fetch_one(&self.db.pool)
                    .await
                    .unwrap();
                n > 0
            }

            async fn block_renewals(&self, _key: &IdempotencyKey) -> Self::Blocker {
                let mut holder = self.db.pool.begin_with($begin).await.unwrap();
                sqlx::query($hold).execute(&mut *holder).await.unwrap();
                holder
            }

            async fn unblock(&self, blocker: Self::Blocker) {
                blocker.rollback().await.unwrap();
            }

            async fn delete(&self, key: &IdempotencyKey) {
                let sql = format!("DELETE FROM idempotency_requests WHERE key_digest = {}", $p);
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(key.digest())
                    .execute(&self.db.pool)
                    .await
                    .unwrap();
            }

            async fn forget_downstream_key(&self, key: &IdempotencyKey) {
                let sql = format!(
                    "UPDATE idempotency_requests SET downstream_key = NULL WHERE key_digest = {}",
                    $p
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(key.digest())
                    .execute(&self.db.pool)
                    .await
                    .unwrap();
            }
        }
    };
}

sql_harness!(
    Postgres, sqlx::Postgres, crate::common::TestDb,
    now_ms: "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
    now: "clock_timestamp()",
    p: "$1",
    as_text: "CAST(lease_expires_at AS text)",
    hold: ("BEGIN", "SELECT 1 FROM idempotency_requests FOR UPDATE")
);

sql_harness!(
    Sqlite, sqlx::Sqlite, crate::common::SqliteDb,
    now_ms: idem_runtime::sqlite_now_ms!(),
    now: idem_runtime::sqlite_now_ms!(),
    p: "$1",
    as_text: "CAST(lease_expires_at AS text)",
    // SQLite's one write lock holds every row.
    hold: ("BEGIN IMMEDIATE", "SELECT 1")
);

sql_harness!(
    MySql, sqlx::MySql, crate::common::MySqlDb,
    now_ms: idem_runtime::mysql_now_ms!(),
    now: idem_runtime::mysql_now_ms!(),
    p: "?",
    as_text: "CAST(lease_expires_at AS CHAR)",
    hold: ("BEGIN", "SELECT 1 FROM idempotency_requests FOR UPDATE")
);

/// The Redis store: one server (`IDEM_TEST_REDIS_URL`, else 127.0.0.1:6379) or,
/// with `IDEM_TEST_REDIS_CLUSTER` (`host:port,...`, as `.ci/run` sets it for its
/// second run), a Redis Cluster; under a key prefix of the test's own, emptied
/// first.
pub mod redis_store {
    use super::*;
    use idem_runtime::redis::{Redis as RedisDb, RedisConnection, RedisLeaseStore};
    use redis::AsyncCommands;
    use redis::aio::ConnectionManager;

    pub fn redis_url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
    }

    /// The cluster's nodes, when the suite runs on one.
    pub fn cluster_nodes() -> Option<Vec<String>> {
        let nodes = std::env::var("IDEM_TEST_REDIS_CLUSTER").ok()?;
        let nodes: Vec<String> = nodes
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| format!("redis://{n}"))
            .collect();
        (!nodes.is_empty()).then_some(nodes)
    }

    /// A connection to the test server, or to the cluster.
    pub async fn conn() -> RedisConnection {
        match cluster_nodes() {
            Some(nodes) => RedisConnection::Cluster(
                redis::cluster::ClusterClient::new(nodes)
                    .unwrap()
                    .get_async_connection()
                    .await
                    .unwrap(),
            ),
            None => {
                let client = redis::Client::open(redis_url()).unwrap();
                RedisConnection::Server(ConnectionManager::new(client).await.unwrap())
            }
        }
    }

    /// A prefix of this process and test's own.
    pub fn prefix(test: &str) -> String {
        format!("idem-t{}-{test}", std::process::id())
    }

    /// Every key under `prefix`: on one server by `SCAN`, on a cluster by
    /// `KEYS` on every master (redis-rs sends it to each and joins the answers).
    pub async fn keys_under(c: &mut RedisConnection, prefix: &str) -> Vec<String> {
        let pattern = format!("{prefix}:*");
        if c.is_cluster() {
            return redis::cmd("KEYS")
                .arg(&pattern)
                .query_async(c)
                .await
                .unwrap();
        }
        let mut out = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(c)
                .await
                .unwrap();
            out.extend(batch);
            if next == 0 {
                return out;
            }
            cursor = next;
        }
    }

    /// A store on `c` (one server, or the cluster) under `prefix`.
    pub async fn store_on(
        c: RedisConnection,
        prefix: &str,
    ) -> Result<RedisLeaseStore, idem_runtime::StoreError> {
        match c {
            RedisConnection::Server(c) => RedisLeaseStore::with_connection(c, prefix).await,
            RedisConnection::Cluster(c) => {
                RedisLeaseStore::with_cluster_connection(c, prefix).await
            }
            other => panic!("{other:?}"),
        }
    }

    /// A store built from a client, to the test server or the cluster, so it
    /// opens connections of its own (what `with_replica_acks` needs), whose
    /// replies time out after `response_timeout`.
    pub async fn store_from_client(
        prefix: &str,
        response_timeout: Duration,
    ) -> Result<RedisLeaseStore, StoreError> {
        match cluster_nodes() {
            Some(nodes) => {
                let client = redis::cluster::ClusterClientBuilder::new(nodes)
                    .response_timeout(response_timeout)
                    .build()
                    .unwrap();
                RedisLeaseStore::with_cluster_client(client, prefix).await
            }
            None => {
                let client = redis::Client::open(redis_url()).unwrap();
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(response_timeout));
                RedisLeaseStore::with_client(client, config, prefix).await
            }
        }
    }

    /// How many clients a `WAIT` blocks now, on every node (the one server,
    /// or each node of the cluster), by `CLIENT LIST`.
    pub async fn blocked_in_wait(c: &RedisConnection) -> usize {
        let lists = c
            .on_every_node(redis::cmd("CLIENT").arg("LIST"))
            .await
            .unwrap();
        lists
            .into_iter()
            .map(|(_, list)| {
                let list: String = redis::from_redis_value(list).unwrap();
                crate::common::client_list::waiting_ids(&list).len()
            })
            .sum()
    }

    /// Ends every `WAIT` that blocks a client now, on every node, as its
    /// timeout would (`CLIENT UNBLOCK .. TIMEOUT`: the `WAIT` answers the
    /// acknowledgements it has). For tests whose `WAIT`s are made to block
    /// until the test has seen what it came for, instead of racing a timeout.
    /// How many it ended.
    pub async fn unblock_waits(c: &RedisConnection) -> usize {
        let lists = c
            .on_every_node(redis::cmd("CLIENT").arg("LIST"))
            .await
            .unwrap();
        let mut ended = 0;
        for (node, list) in lists {
            let list: String = redis::from_redis_value(list).unwrap();
            let url = if node.is_empty() {
                redis_url()
            } else {
                format!("redis://{node}")
            };
            let mut direct = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            for id in crate::common::client_list::waiting_ids(&list) {
                let n: i64 = redis::cmd("CLIENT")
                    .arg("UNBLOCK")
                    .arg(id)
                    .arg("TIMEOUT")
                    .query_async(&mut direct)
                    .await
                    .unwrap();
                ended += n as usize;
            }
        }
        ended
    }

    /// Deletes every key under `prefix`.
    pub async fn delete_prefix(c: &mut RedisConnection, prefix: &str) {
        for k in keys_under(c, prefix).await {
            let _: () = c.del(k).await.unwrap();
        }
    }

    /// The clock of the server that holds `key` (on a cluster, its slot's
    /// master: the clock its scripts read), in milliseconds.
    pub async fn server_ms(c: &mut RedisConnection, key: &str) -> i64 {
        // `TIME` has no key; a script with one runs where the key lives.
        let (secs, micros): (i64, i64) = redis::Script::new(
            "local t = redis.call('TIME') return {tonumber(t[1]), tonumber(t[2])}",
        )
        .key(key)
        .invoke_async(c)
        .await
        .unwrap();
        secs * 1000 + micros / 1000
    }

    /// A record's fields as `HMGET` reads them: state, gen, body, dkey,
    /// lease_until.
    type RecordFields = (
        Option<String>,
        Option<i64>,
        Option<Vec<u8>>,
        Option<String>,
        Option<String>,
    );

    /// The Redis store for the leased suite.
    pub struct Redis {
        pub store: RedisLeaseStore,
        pub prefix: String,
    }

    impl Redis {
        fn name(&self, key: &IdempotencyKey) -> String {
            self.store.record_key(TENANT, OPERATION, key)
        }
    }

    /// A key whose record refuses every script until it is put back.
    pub struct Refusing(String);

    impl LeaseHarness for Redis {
        type Db = RedisDb;
        type Blocker = Refusing;

        async fn new(test: &str) -> Self {
            let prefix = prefix(test);
            let mut c = conn().await;
            delete_prefix(&mut c, &prefix).await;
            Redis {
                store: store_on(c, &prefix).await.unwrap(),
                prefix,
            }
        }

        fn store(&self) -> RedisLeaseStore {
            self.store.clone()
        }

        fn idem(&self) -> Idem<RedisDb> {
            self.store.idem()
        }

        async fn claim(&self, req: &LeaseRequest<'_>) -> LeasedClaim<RedisDb> {
            self.try_claim(req).await.unwrap()
        }

        async fn try_claim(
            &self,
            req: &LeaseRequest<'_>,
        ) -> Result<LeasedClaim<RedisDb>, StoreError> {
            self.store.claim(req).await
        }

        async fn record(&self, key: &IdempotencyKey) -> Option<Record> {
            let mut c = self.store.redis_connection();
            let fields: RecordFields = redis::cmd("HMGET")
                .arg(self.name(key))
                .arg(&["state", "gen", "body", "dkey", "lease_until"])
                .query_async(&mut c)
                .await
                .unwrap();
            let (state, generation, body, downstream_key, lease_until) = fields;
            Some(Record {
                state: state?,
                generation: generation.unwrap(),
                body,
                downstream_key,
                lease_until,
            })
        }

        async fn records(&self) -> usize {
            let mut c = self.store.redis_connection();
            let mut n = 0;
            for k in keys_under(&mut c, &self.prefix).await {
                let kind: String = redis::cmd("TYPE")
                    .arg(&k)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                n += usize::from(kind == "hash");
            }
            n
        }

        async fn uncertain_listed(&self) -> usize {
            let mut c = self.store.redis_connection();
            let mut n = 0;
            for index in self.store.uncertain_indexes(OPERATION) {
                n += c.zcard::<_, usize>(index).await.unwrap();
            }
            n
        }

        async fn now_ms(&self) -> i64 {
            // The clock of the server a record of this test's lives on.
            let name = self.name(&IdempotencyKey::parse("clock").unwrap());
            server_ms(&mut self.store.redis_connection(), &name).await
        }

        async fn lease_lapsed(&self, key: &IdempotencyKey) -> bool {
            let mut c = self.store.redis_connection();
            let name = self.name(key);
            let until: Option<i64> = c.hget(&name, "lease_until").await.unwrap();
            let now = server_ms(&mut c, &name).await;
            until.is_some_and(|until| until <= now)
        }

        async fn block_renewals(&self, key: &IdempotencyKey) -> Refusing {
            // Redis has no lock to hold (a script runs alone and at once): the
            // record refuses every script instead, as one of another format
            // would, and each renewal fails without writing.
            let name = self.name(key);
            let _: () = self
                .store
                .redis_connection()
                .hset(&name, "v", "refuse")
                .await
                .unwrap();
            Refusing(name)
        }

        async fn unblock(&self, blocker: Refusing) {
            let _: () = self
                .store
                .redis_connection()
                .hset(&blocker.0, "v", "1")
                .await
                .unwrap();
        }

        async fn delete(&self, key: &IdempotencyKey) {
            let _: () = self
                .store
                .redis_connection()
                .del(self.name(key))
                .await
                .unwrap();
        }

        async fn forget_downstream_key(&self, key: &IdempotencyKey) {
            let _: () = self
                .store
                .redis_connection()
                .hdel(self.name(key), "dkey")
                .await
                .unwrap();
        }
    }
}
