//! A Redis store for leased mode (feature `redis`): for a service whose effect
//! lives entirely downstream (a provider call) and that keeps no SQL database
//! of its own. One server, or a Redis Cluster.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_runtime::StoreError> {
//! use idem_runtime::redis::{Redis, RedisLeaseStore};
//!
//! let store = RedisLeaseStore::connect("redis://127.0.0.1:6379").await?;
//! // or a Redis Cluster, by some of its nodes:
//! // RedisLeaseStore::connect_cluster(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]).await?
//! let idem: idem_runtime::Idem<Redis> = store.idem();
//! // handlers: #[idempotent(operation = "create-payment", retention = "24h", lease = "30s")]
//! //           async fn pay(#[tenant] caller: Caller, lease: &mut idem_runtime::Lease<Redis>, ...) -> ...
//! # Ok(()) }
//! ```
//!
//! Every state change is one Lua script that compares the owner token (or the
//! generation) before it writes; lease expiry is counted on the server's clock.
//! A raw idempotency key is never sent to Redis: records are named by tenant,
//! operation and the key's SHA-256 digest, and hold the downstream key for the
//! reconciler. One operation's records are spread over [`SHARDS`] hash tags
//! (by the digest's first hex digit), so a cluster spreads an operation's
//! traffic over its masters, while a record and its shard's uncertain index
//! share a slot, so each script stays atomic. What Redis cannot promise (a
//! failover that loses acknowledged writes, eviction under `maxmemory`, a
//! restart without persistence) is in `docs/redis.md`;
//! [`RedisLeaseStore::with_replica_acks`] narrows the first. The constructors
//! refuse a server older than 6.2 ([`MIN_REDIS_VERSION`]) and an eviction
//! policy that may drop any key, on every node of a cluster, and warn on one
//! that may drop keys with a TTL.
//!
//! A record's generation counts its executions while it is kept, as on SQL: 1
//! for a claim that finds no record, one more at each takeover. A finished
//! record expires with its retention, and the next claim of its key starts
//! again at generation 1 (`Acquisition::New`), as a SQL store's does once its
//! sweeper has deleted the row (before that, SQL reclaims at the next
//! generation; Redis never answers `Reclaimed`). See `docs/redis.md`.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, TryFutureExt};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, IntoConnectionInfo, RedisError, Script, ScriptInvocation, Value};

use crate::config::Idem;
use crate::key::{IdempotencyKey, KeyDigest};
use crate::lease::{LeaseBackend, LeasedClaim};
use crate::model::{
    Acquisition, Fence, KeyAddress, LeaseRequest, LeasedOutcome, OperationRow, Owned, OwnerToken,
    Renewal, Renewed, StoreError, StoredResponse, millis,
};
use crate::reconcile::UncertainOutcome;

mod acks;
mod checks;
mod connection;
mod erasure;
mod lanes;
mod layout;
mod listing;
mod rekey;
mod scripts;

pub use acks::NotReplicated;
pub use checks::{
    EvictionVerdict, MIN_REDIS_VERSION, VersionVerdict, eviction_verdict, version_verdict,
};
pub use connection::RedisConnection;
pub use lanes::WAIT_CONNECTIONS;
pub use layout::SHARDS;
#[doc(hidden)]
pub use listing::RedisUncertain;

use acks::ReplicaAcks;
use lanes::{Lanes, Opener};
use layout::{Layout, member, shard_of, shards};

/// Leased mode on Redis: the type parameter of `Lease<Redis>`, `Idem<Redis>`
/// and `Reconciler<R, Redis>`. Never a value.
#[derive(Debug)]
pub enum Redis {}

/// The records of leased mode in one Redis server or a Redis Cluster, under a
/// key prefix.
///
/// Cheap to clone (a [`ConnectionManager`] multiplexes one connection and
/// reconnects by itself; a cluster connection keeps one per node). With
/// [`RedisLeaseStore::with_replica_acks`] it opens a few more, shared by its
/// clones (see there).
#[derive(Clone)]
pub struct RedisLeaseStore {
    conn: RedisConnection,
    layout: Layout,
    scripts: Arc<Scripts>,
    acks: Option<ReplicaAcks>,
    /// The connections past the first, for replica acknowledgement.
    lanes: Arc<Lanes>,
    /// What answers are sealed with (see [`RedisLeaseStore::with_key_ring`]).
    ring: Option<crate::at_rest::KeyRing>,
}

impl std::fmt::Debug for RedisLeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLeaseStore")
            .field("prefix", &self.layout.prefix)
            .field("cluster", &self.conn.is_cluster())
            .field("replica_acks", &self.replica_acks())
            .field("key_ring", &self.ring)
            .finish_non_exhaustive()
    }
}

struct Scripts {
    claim: Script,
    store: Script,
    renew: Script,
    renew_many: Script,
    uncertain: Script,
    release: Script,
    lapse: Script,
    resolve: Script,
    prune: Script,
    abandon: Script,
    erase: Script,
    rekey: Script,
}

fn redis_err(e: redis::RedisError) -> StoreError {
    StoreError::Redis(Box::new(e))
}

fn refused(why: String) -> StoreError {
    StoreError::Redis(why.into())
}

/// How long [`RedisLeaseStore::connect_cluster`]'s client waits for a reply,
/// its resends during a failover included.
const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

impl RedisLeaseStore {
    /// Connects to `url` (`redis://host:port/db`), one server, with the prefix
    /// `idem`, and runs the start-up check (see
    /// [`RedisLeaseStore::with_connection`]).
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis cannot be reached, is older than 6.2,
    /// its eviction policy may drop any key, or it is a node of a Redis
    /// Cluster (connect with [`RedisLeaseStore::connect_cluster`]).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_prefix(url, "idem").await
    }

    /// [`RedisLeaseStore::connect`] with another key prefix.
    ///
    /// # Errors
    ///
    /// As [`RedisLeaseStore::connect`].
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(redis_err)?;
        Self::with_client(client, ConnectionManagerConfig::new(), prefix).await
    }

    /// A store on one server through `client`, its connections redis-rs
    /// `ConnectionManager`s with `config` (timeouts, reconnection), for a
    /// service that sets its client up itself (TLS, credentials); otherwise as
    /// [`RedisLeaseStore::connect_with_prefix`]. Unlike
    /// [`RedisLeaseStore::with_connection`], the store can open the
    /// connections [`RedisLeaseStore::with_replica_acks`] needs.
    ///
    /// # Errors
    ///
    /// As [`RedisLeaseStore::with_connection`].
    pub async fn with_client(
        client: redis::Client,
        config: ConnectionManagerConfig,
        prefix: &str,
    ) -> Result<Self, StoreError> {
        let open: Opener = Arc::new(move || {
            ConnectionManager::new_with_config(client.clone(), config.clone())
                .map_ok(RedisConnection::Server)
                .boxed()
        });
        Self::start_opening(open, prefix).await
    }

    /// Uses `conn`, naming every key `{prefix}:...` (give each service, or each
    /// test, its own prefix; it may not contain `{` or `}`), after checking the
    /// server's version and eviction settings: a server older than 6.2
    /// ([`MIN_REDIS_VERSION`]) is refused, and so is an `allkeys-*` policy; a
    /// `volatile-*` one with `maxmemory` set is logged as a warning, and so is a
    /// server that does not let `INFO` or `CONFIG GET` be read (as managed ones
    /// may not). A node of a Redis Cluster is refused: one connection would be
    /// answered `MOVED` for most keys.
    ///
    /// A store on a connection it is handed cannot open others, so
    /// [`RedisLeaseStore::with_replica_acks`] refuses it: use
    /// [`RedisLeaseStore::with_client`] for that.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when the version or the policy is refused, the
    /// server is a cluster node, the prefix unusable or Redis unreachable.
    pub async fn with_connection(
        conn: ConnectionManager,
        prefix: &str,
    ) -> Result<Self, StoreError> {
        Self::start(RedisConnection::Server(conn), prefix, None).await
    }

    /// Connects to a Redis Cluster through redis-rs's cluster client, with the
    /// prefix `idem`: `nodes` are some of its nodes (`redis://host:port`, or
    /// anything redis-rs's `ClusterClient::new` takes), from which the client
    /// learns the others and the slots. It waits up to 5 s for a reply, its
    /// resends while a failover promotes a replica included; for other
    /// settings (TLS, credentials, timeouts) build the client yourself and use
    /// [`RedisLeaseStore::with_cluster_client`]. The start-up check runs on
    /// every node.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when the cluster cannot be reached, or a node is
    /// older than 6.2 or has an eviction policy that may drop any key.
    pub async fn connect_cluster<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
    ) -> Result<Self, StoreError> {
        Self::connect_cluster_with_prefix(nodes, "idem").await
    }

    /// [`RedisLeaseStore::connect_cluster`] with another key prefix.
    ///
    /// # Errors
    ///
    /// As [`RedisLeaseStore::connect_cluster`].
    pub async fn connect_cluster_with_prefix<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
        prefix: &str,
    ) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClientBuilder::new(nodes)
            .response_timeout(CLUSTER_RESPONSE_TIMEOUT)
            .build()
            .map_err(redis_err)?;
        Self::with_cluster_client(client, prefix).await
    }

    /// A store on a Redis Cluster through `client` (redis-rs's
    /// `ClusterClient`, with the service's own settings: TLS, credentials,
    /// timeouts), the start-up check run on every node. Unlike
    /// [`RedisLeaseStore::with_cluster_connection`], the store can open the
    /// connections [`RedisLeaseStore::with_replica_acks`] needs.
    ///
    /// # Errors
    ///
    /// As [`RedisLeaseStore::connect_cluster`].
    pub async fn with_cluster_client(
        client: ClusterClient,
        prefix: &str,
    ) -> Result<Self, StoreError> {
        let open: Opener = Arc::new(move || {
            let client = client.clone();
            async move {
                client
                    .get_async_connection()
                    .await
                    .map(RedisConnection::Cluster)
            }
            .boxed()
        });
        Self::start_opening(open, prefix).await
    }

    /// Uses a Redis Cluster connection, as [`RedisLeaseStore::with_connection`]
    /// uses one server's, the start-up check run on every node. Like it, it
    /// cannot open more connections, so [`RedisLeaseStore::with_replica_acks`]
    /// refuses it: use [`RedisLeaseStore::with_cluster_client`] for that.
    ///
    /// # Errors
    ///
    /// As [`RedisLeaseStore::with_connection`], for any node.
    pub async fn with_cluster_connection(
        conn: ClusterConnection,
        prefix: &str,
    ) -> Result<Self, StoreError> {
        Self::start(RedisConnection::Cluster(conn), prefix, None).await
    }

    /// Opens the first connection with `open`, which the store keeps to open
    /// the others.
    async fn start_opening(open: Opener, prefix: &str) -> Result<Self, StoreError> {
        let conn = open().await.map_err(redis_err)?;
        Self::start(conn, prefix, Some(open)).await
    }

    async fn start(
        conn: RedisConnection,
        prefix: &str,
        opener: Option<Opener>,
    ) -> Result<Self, StoreError> {
        if prefix.is_empty() || prefix.contains(['{', '}']) {
            return Err(refused(format!(
                "the key prefix {prefix:?} must be non-empty and hold no `{{` or `}}`"
            )));
        }
        Self::refuse_a_cluster_node(&conn).await?;
        let store = RedisLeaseStore {
            conn,
            layout: Layout {
                prefix: prefix.into(),
            },
            scripts: Arc::new(Scripts {
                claim: Script::new(scripts::CLAIM),
                store: Script::new(scripts::STORE),
                renew: Script::new(scripts::RENEW),
                renew_many: Script::new(scripts::RENEW_MANY),
                uncertain: Script::new(scripts::UNCERTAIN),
                release: Script::new(scripts::RELEASE),
                lapse: Script::new(scripts::LAPSE),
                resolve: Script::new(scripts::RESOLVE),
                prune: Script::new(scripts::PRUNE),
                abandon: Script::new(scripts::ABANDON),
                erase: Script::new(scripts::ERASE),
                rekey: Script::new(scripts::REKEY),
            }),
            acks: None,
            lanes: Arc::new(Lanes::new(opener)),
            ring: None,
        };
        match store.check_version().await? {
            VersionVerdict::Supported(_) => {}
            VersionVerdict::Unknown(why) => tracing::warn!("idem: redis: {why}"),
            VersionVerdict::Refuse(why) => return Err(refused(why)),
        }
        match store.check_eviction().await? {
            EvictionVerdict::Safe => {}
            EvictionVerdict::Warn(why) => tracing::warn!("idem: redis: {why}"),
            EvictionVerdict::Refuse(why) => return Err(refused(why)),
        }
        Ok(store)
    }

    /// Waits, after each state change but a renewal (claim, completion, mark,
    /// release, resolution), until `replicas` replicas of the master that took
    /// it have acknowledged it, for at most `timeout` (`WAIT replicas timeout`,
    /// pipelined with the script so it reaches that very master). A change
    /// that fewer replicas acknowledged in time is reported as a failure
    /// ([`StoreError::Redis`] with a [`NotReplicated`] source), never as
    /// success: a claim's caller answers the store's failure and the client
    /// retries (the claim is given back first, so the retry need not wait out
    /// a lease nobody holds); a completion is retried by the handler, and
    /// sent again finds its own outcome.
    ///
    /// Redis blocks a connection during `WAIT`, so the store then opens
    /// connections of its own, shared by its clones, on first use: the
    /// pipelines that end in `WAIT` go over [`WAIT_CONNECTIONS`] of them (each
    /// to the one with the fewest in flight), and renewals over one more that
    /// never carries a `WAIT`, so a renewal never queues behind other
    /// requests' acknowledgements. A renewal is not waited for: it only moves
    /// forward the lease of an acknowledged claim, and must get through while
    /// the replicas are slow or gone (a failover that loses one shortens the
    /// lease to the last one the replica had; see `docs/redis.md`).
    ///
    /// What it promises: a claim or completion reported as done is on the
    /// master and on `replicas` replicas, so a failover that promotes one of
    /// them keeps it. What it cannot: replication stays asynchronous (`WAIT`
    /// makes Redis neither strongly consistent nor durable; a failover may
    /// still promote a replica that had not acknowledged, and a change
    /// reported as failed may have survived); see `docs/redis.md`. Keep
    /// `timeout` below the connection's response timeout (redis-rs's
    /// `ConnectionManager`: 500 ms by default; [`RedisLeaseStore::connect_cluster`]:
    /// 5 s): a slower acknowledgement is a client-side timeout instead, a
    /// failure all the same (a claim so timed out is given back as well).
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] for `replicas` 0 (leave the option off), a
    /// `timeout` under a millisecond (`WAIT` takes 0 as "for ever"), or a
    /// store built on a connection it was handed
    /// ([`RedisLeaseStore::with_connection`],
    /// [`RedisLeaseStore::with_cluster_connection`]), which cannot open the
    /// connections above: build it with [`RedisLeaseStore::connect`],
    /// [`RedisLeaseStore::connect_cluster`], [`RedisLeaseStore::with_client`]
    /// or [`RedisLeaseStore::with_cluster_client`].
    pub fn with_replica_acks(
        mut self,
        replicas: u32,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        if replicas == 0 {
            return Err(refused(
                "with_replica_acks(0, ..) waits for nothing: leave the option off instead".into(),
            ));
        }
        if timeout < Duration::from_millis(1) {
            return Err(refused(format!(
                "with_replica_acks(.., {timeout:?}) is refused: WAIT counts whole milliseconds, \
                 and 0 would wait for ever; give at least 1 ms"
            )));
        }
        if !self.lanes.can_open() {
            return Err(refused(
                "with_replica_acks needs connections of its own (Redis blocks a connection \
                 during WAIT, and renewals must not queue behind it), and a store built with \
                 with_connection or with_cluster_connection cannot open them: build it with \
                 connect, connect_cluster, with_client or with_cluster_client"
                    .into(),
            ));
        }
        self.acks = Some(ReplicaAcks { replicas, timeout });
        Ok(self)
    }

    /// The replicas each state change waits for, and for how long, if
    /// [`RedisLeaseStore::with_replica_acks`] set them.
    pub fn replica_acks(&self) -> Option<(u32, Duration)> {
        self.acks.map(|a| (a.replicas, a.timeout))
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.conn.is_cluster()
    }

    /// An [`Idem`] whose leased handlers (`&mut Lease<Redis>`) run on this
    /// store, with the default settings.
    ///
    /// It has the settings of leased mode and of the answers (stored headers,
    /// response limit, tenant label, waiting-room limits), and none of the SQL
    /// transaction's: the in-flight wait, the request deadline and claims at
    /// commit configure a transaction a Redis lease never has, so they are not
    /// there to be set by mistake.
    ///
    /// ```compile_fail
    /// # fn demo(store: idem_runtime::redis::RedisLeaseStore) {
    /// let idem = store.idem().with_in_flight_wait(std::time::Duration::from_secs(1));
    /// # }
    /// ```
    pub fn idem(&self) -> Idem<Redis> {
        let idem = Idem::on_store(self.clone());
        match &self.ring {
            Some(ring) => idem.with_key_ring(ring.clone()),
            None => idem,
        }
    }

    /// Seals the answers stored through this store with `ring` (see
    /// [`crate::at_rest`]): the [`Idem`] of [`RedisLeaseStore::idem`], the
    /// claims of [`RedisLeaseStore::claim`] and a [`crate::Reconciler`] on this
    /// store seal and open with it. Off by default.
    pub fn with_key_ring(mut self, ring: crate::at_rest::KeyRing) -> Self {
        self.ring = Some(ring);
        self
    }

    /// The key ring answers are sealed with, if one was set.
    pub fn key_ring(&self) -> Option<&crate::at_rest::KeyRing> {
        self.ring.as_ref()
    }

    /// Claims `req.key` in leased mode on this store (the Redis
    /// [`crate::claim_leased`]).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis fails or holds a record it cannot read;
    /// nothing is claimed then.
    pub async fn claim(&self, req: &LeaseRequest<'_>) -> Result<LeasedClaim<Redis>, StoreError> {
        crate::lease::claim_in::<Redis>(self, req, self.ring.as_ref()).await
    }

    /// The store's connection, to one server or to a cluster, for the
    /// service's own commands (and tests).
    pub fn redis_connection(&self) -> RedisConnection {
        self.conn.clone()
    }

    /// The name of the record of `key` (no raw key in it: its digest).
    pub fn record_key(&self, tenant: &str, operation: &str, key: &IdempotencyKey) -> String {
        self.layout
            .record(tenant, operation, &key.digest().to_string())
    }

    /// The names of `operation`'s indexes of uncertain records, one per shard
    /// ([`SHARDS`]), each a sorted set by the time its records became
    /// uncertain.
    pub fn uncertain_indexes(&self, operation: &str) -> Vec<String> {
        shards().map(|s| self.layout.index(operation, s)).collect()
    }

    /// The name of the index that `key`'s record enters when it becomes
    /// uncertain (its shard's, in the record's slot).
    pub fn uncertain_index_of(&self, operation: &str, key: &IdempotencyKey) -> String {
        self.layout
            .index(operation, shard_of(&key.digest().to_string()))
    }

    fn owned_name(&self, row: &Owned<'_>) -> String {
        self.layout
            .record(row.tenant, row.operation, &row.key.to_string())
    }
}

/// A duration as the scripts take it: at least 1 ms (a claim refuses less, so
/// a lease's own renewals and completion never send less; `PEXPIRE 0` would
/// delete the record) and at most a century, as [`millis`] gives (Lua's
/// numbers are doubles, and `string.format('%d')` of one past 2^63 is
/// undefined: the record could get a negative expiry, which deletes it).
fn script_ms(d: Duration) -> i64 {
    millis(d).max(1)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("redis record: {what}"))
}

/// A finished outcome from its stored fields, and the record's `gen` (which
/// a sealed answer is bound to).
fn stored_from(
    status: &Value,
    headers: &Value,
    body: &Value,
    generation: &Value,
) -> Result<StoredResponse, StoreError> {
    let status = int(status)
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupt("status"))?;
    let headers: Vec<(String, String)> = text(headers)
        .and_then(|h| serde_json::from_str(&h).ok())
        .ok_or_else(|| corrupt("headers"))?;
    let body = match body {
        Value::BulkString(b) => bytes::Bytes::from(b.clone()),
        _ => return Err(corrupt("body")),
    };
    let stored = StoredResponse {
        status,
        headers,
        body,
    };
    if crate::at_rest::sealed_with(&stored).is_none() {
        return Ok(stored);
    }
    let generation = int(generation).ok_or_else(|| corrupt("generation"))?;
    Ok(crate::at_rest::noted(stored, generation))
}

/// A finished record's answer, its generation, when the record was made, and
/// one more of its fields.
struct Finished {
    field: String,
    generation: i64,
    /// `created` as stored (empty where a record lacks it): with the
    /// generation, what tells the record from a later one of the key (the
    /// token does not: the reconciler resolves every record to the same one).
    created: String,
    stored: StoredResponse,
}

impl RedisLeaseStore {
    /// The record at `name` with `field`, if it holds a finished answer.
    async fn finished(&self, name: &str, field: &str) -> Result<Option<Finished>, StoreError> {
        let r: Vec<Value> = redis::cmd("HMGET")
            .arg(name)
            .arg(&[
                "state", field, "status", "headers", "body", "gen", "created",
            ])
            .query_async(&mut self.conn.clone())
            .await
            .map_err(redis_err)?;
        let [state, value, status, headers, body, generation, created] = &r[..] else {
            return Err(corrupt("HMGET"));
        };
        if !matches!(text(state).as_deref(), Some("completed" | "failed")) {
            return Ok(None);
        }
        Ok(Some(Finished {
            field: text(value).ok_or_else(|| corrupt(field))?,
            generation: int(generation).ok_or_else(|| corrupt("generation"))?,
            created: text(created).unwrap_or_default(),
            stored: stored_from(status, headers, body, generation)?,
        }))
    }
}

impl crate::db::leases::sealed::Sealed for Redis {}

impl LeaseBackend for Redis {
    type Store = RedisLeaseStore;

    fn store_key_ring(store: &RedisLeaseStore) -> Option<&crate::at_rest::KeyRing> {
        store.ring.as_ref()
    }
    type UncertainRow = RedisUncertain;

    async fn lease_claim(
        store: &RedisLeaseStore,
        req: &LeaseRequest<'_>,
    ) -> Result<LeasedOutcome, StoreError> {
        let name = store.record_key(req.tenant, req.operation, req.key);
        let token = OwnerToken::random();
        let digest = req.key.digest().to_string();
        let given_up = Abandon {
            record: &name,
            mark: store
                .layout
                .abandoned(req.operation, shard_of(&digest), token.as_str()),
            token: token.as_str(),
            lease: req.lease,
        };
        let downstream = crate::lease::downstream_key(req.tenant, req.operation, req.key);
        let mut inv = store.scripts.claim.key(&name);
        inv.key(&given_up.mark)
            .arg(hex::encode(req.fingerprint.as_bytes()))
            .arg(&token)
            .arg(script_ms(req.lease))
            .arg(script_ms(req.retention))
            .arg(req.tenant)
            .arg(downstream);
        let ran = match store.run::<Vec<Value>>(&inv, &name).await {
            Ok(ran) => ran,
            Err(e) => {
                if fate_unknown(&e) {
                    // The claim may have run (its reply timed out, or the
                    // connection went) and nobody will hold its lease: give it
                    // back, so the client's retry is not kept out for a lease.
                    store.abandon(&given_up, &e).await;
                }
                return Err(e);
            }
        };
        let reply = &ran.reply;
        let outcome = reply.first().and_then(text).unwrap_or_default();
        if let Err(e) = ran.acked {
            if matches!(outcome.as_str(), "acquired" | "taken_over") {
                // Reported as a failure: give the key back, so the client's
                // retry need not wait out a lease nobody holds.
                store.abandon(&given_up, &e).await;
            }
            return Err(e);
        }
        let acquired = |acquisition| -> Result<LeasedOutcome, StoreError> {
            Ok(LeasedOutcome::Acquired {
                acquisition,
                token: token.clone(),
                generation: reply
                    .get(1)
                    .and_then(int)
                    .ok_or_else(|| corrupt("generation"))?,
            })
        };
        match outcome.as_str() {
            "acquired" => acquired(Acquisition::New),
            "taken_over" => acquired(Acquisition::TakenOver),
            "replay" => match &reply[1..] {
                [status, headers, body, generation] => Ok(LeasedOutcome::Replay(stored_from(
                    status, headers, body, generation,
                )?)),
                _ => Err(corrupt("replay")),
            },
            "mismatch" => Ok(LeasedOutcome::Mismatch),
            "uncertain" => Ok(LeasedOutcome::Uncertain),
            "abandoned" => Err(refused(
                "redis: the claim found itself given up (it was sent again after its caller \
                 had stopped waiting); it wrote nothing"
                    .into(),
            )),
            "in_flight" => {
                let ms = reply.get(1).and_then(int).unwrap_or(1000);
                Ok(LeasedOutcome::InFlight {
                    retry_after: Duration::from_millis(u64::try_from(ms).unwrap_or(1000)),
                })
            }
            other => Err(corrupt(&format!("claim outcome {other:?}"))),
        }
    }

    async fn lease_store(
        store: &RedisLeaseStore,
        row: Owned<'_>,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<u64, StoreError> {
        let headers = serde_json::to_string(&response.headers)
            .map_err(|e| StoreError::Corrupt(format!("headers: {e}")))?;
        let name = store.owned_name(&row);
        let mut inv = store.scripts.store.key(&name);
        inv.arg(row.token)
            .arg(response.state())
            .arg(response.status)
            .arg(headers)
            .arg(&response.body[..])
            .arg(script_ms(retention));
        store.run::<u64>(&inv, &name).await?.acknowledged()
    }

    async fn lease_fence(
        store: &RedisLeaseStore,
        row: Owned<'_>,
        what: Fence,
    ) -> Result<u64, StoreError> {
        let name = store.owned_name(&row);
        let index;
        let mut inv: ScriptInvocation<'_>;
        match what {
            Fence::Renew(lease) => {
                inv = store.scripts.renew.key(&name);
                inv.arg(row.token).arg(script_ms(lease));
                return store.run_renewal(&inv).await;
            }
            Fence::Uncertain => {
                let digest = row.key.to_string();
                index = store.layout.index(row.operation, shard_of(&digest));
                inv = store.scripts.uncertain.key(&name);
                inv.key(&index)
                    .arg(row.token)
                    .arg(member(row.tenant, &digest));
            }
            Fence::Release => {
                inv = store.scripts.release.key(&name);
                inv.arg(row.token);
            }
            Fence::Lapse => {
                inv = store.scripts.lapse.key(&name);
                inv.arg(row.token).arg(OwnerToken::random());
            }
        }
        store.run::<u64>(&inv, &name).await?.acknowledged()
    }

    /// One script per slot renews that slot's leases of the batch (a record's
    /// slot is its operation's shard, so a cluster takes them too), the
    /// scripts sent at once and pipelined by the connections; each record's
    /// reply says kept or lost. A script that failed leaves its leases
    /// `Unknown` (renewed again soon); the batch fails only when every one did.
    async fn lease_renew_many(
        store: &RedisLeaseStore,
        rows: &[Renewal<'_>],
    ) -> Result<Vec<Renewed>, StoreError> {
        // Bounds the time one script holds the server (it runs alone there).
        const PER_SCRIPT: usize = 256;
        let mut slots: Vec<((&str, char), Vec<usize>)> = Vec::new();
        let digests: Vec<String> = rows.iter().map(|r| r.row.key.to_string()).collect();
        for (i, r) in rows.iter().enumerate() {
            let slot = (r.row.operation, shard_of(&digests[i]));
            match slots
                .iter_mut()
                .find(|(s, members)| *s == slot && members.len() < PER_SCRIPT)
            {
                Some((_, members)) => members.push(i),
                None => slots.push((slot, vec![i])),
            }
        }
        let done = futures_util::future::join_all(slots.iter().map(|(_, members)| {
            let mut inv = store.scripts.renew_many.prepare_invoke();
            for &i in members {
                let r = &rows[i];
                inv.key(
                    store
                        .layout
                        .record(r.row.tenant, r.row.operation, &digests[i]),
                );
                inv.arg(r.row.token).arg(script_ms(r.lease));
            }
            async move { store.run_renewal::<Vec<i64>>(&inv).await }
        }))
        .await;
        // Every script failed: the batch did, with the first one's error.
        if !done.is_empty() && done.iter().all(Result::is_err) {
            return Err(done
                .into_iter()
                .find_map(Result::err)
                .expect("every result is an error"));
        }
        let mut renewed = vec![Renewed::Unknown; rows.len()];
        for ((_, members), replies) in slots.iter().zip(done) {
            let Ok(replies) = replies else { continue };
            if replies.len() != members.len() {
                return Err(corrupt("renewal replies"));
            }
            for (&i, reply) in members.iter().zip(replies) {
                renewed[i] = match reply {
                    1 => Renewed::Kept,
                    0 => Renewed::Lost,
                    _ => Renewed::Unknown,
                };
            }
        }
        Ok(renewed)
    }

    async fn lease_current(
        store: &RedisLeaseStore,
        tenant: &str,
        operation: &str,
        key: &KeyDigest,
    ) -> Result<Option<(Vec<u8>, StoredResponse)>, StoreError> {
        let name = store.layout.record(tenant, operation, &key.to_string());
        let Some(found) = store.finished(&name, "fp").await? else {
            return Ok(None);
        };
        let fp = hex::decode(&found.field).map_err(|_| corrupt("fingerprint"))?;
        Ok(Some((fp, found.stored)))
    }

    // A long operation's resource (`crate::operations`): one read-only script,
    // so that the lease is judged on the server's clock and the record and the
    // clock are read at one instant. A finished record expires with its
    // retention, so whatever is found still answers.
    async fn lease_operation(
        store: &RedisLeaseStore,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> Result<Option<OperationRow>, StoreError> {
        static READ: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
            Script::new(
                r"
local r = redis.call('HMGET', KEYS[1], 'state', 'lease_until', 'status', 'headers', ARGV[1], 'gen')
if not r[1] then return {} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = 0
if r[2] and tonumber(r[2]) and tonumber(r[2]) > now then live = 1 end
return {r[1], live, r[3] or false, r[4] or false, r[5] or false, r[6] or false}
",
            )
        });
        let name = store
            .layout
            .record(key.tenant, key.operation, &key.digest.to_string());
        // Without the body, the field asked for is one no record has.
        let body = if with_body { "body" } else { "-" };
        let reply: Vec<Value> = READ
            .key(&name)
            .arg(body)
            .invoke_async(&mut store.conn.clone())
            .await
            .map_err(redis_err)?;
        let [state, live, status, headers, body, generation] = &reply[..] else {
            return if reply.is_empty() {
                Ok(None)
            } else {
                Err(corrupt("operation"))
            };
        };
        let state: crate::decide::RowState =
            text(state).ok_or_else(|| corrupt("state"))?.parse()?;
        let empty = Value::BulkString(Vec::new());
        let body = if with_body { body } else { &empty };
        let outcome = if state.is_finished() {
            Some(stored_from(status, headers, body, generation)?)
        } else {
            None
        };
        Ok(Some(OperationRow {
            state,
            lease_live: int(live) == Some(1),
            outcome,
        }))
    }

    async fn lease_uncertain(
        store: &RedisLeaseStore,
        operation: &str,
        after: Option<&RedisUncertain>,
        limit: i64,
    ) -> Result<Vec<RedisUncertain>, StoreError> {
        let limit = usize::try_from(limit.max(1)).unwrap_or(1);
        store.list_uncertain(operation, after, limit).await
    }

    fn lease_describe(
        operation: &str,
        row: &RedisUncertain,
    ) -> Result<UncertainOutcome, StoreError> {
        if let Some(why) = &row.broken {
            return Err(corrupt(why));
        }
        Ok(UncertainOutcome {
            tenant: row.tenant.clone(),
            operation: operation.to_owned(),
            key_digest: KeyDigest::from_hex(&row.digest)
                .map_err(|e| StoreError::Corrupt(format!("uncertain index entry: {e}")))?,
            downstream_key: row.downstream_key.clone(),
            generation: row.generation,
        })
    }

    async fn lease_resolve(
        store: &RedisLeaseStore,
        operation: &str,
        row: &RedisUncertain,
        outcome: Option<&StoredResponse>,
    ) -> Result<u64, StoreError> {
        let name = store.layout.record(&row.tenant, operation, &row.digest);
        let index = store.layout.index(operation, shard_of(&row.digest));
        let mut inv = store.scripts.resolve.key(&name);
        inv.key(&index)
            .arg(&row.member)
            .arg(row.generation)
            .arg(&row.token);
        match outcome {
            Some(stored) => {
                let headers = serde_json::to_string(&stored.headers)
                    .map_err(|e| StoreError::Corrupt(format!("headers: {e}")))?;
                inv.arg("1")
                    .arg(stored.state())
                    .arg(stored.status)
                    .arg(headers)
                    .arg(&stored.body[..]);
            }
            None => {
                inv.arg("0");
            }
        }
        store.run::<u64>(&inv, &name).await?.acknowledged()
    }
}

/// A claim to give back ([`RedisLeaseStore::abandon`]).
struct Abandon<'a> {
    record: &'a str,
    /// Its give-up mark (`Layout::abandoned`).
    mark: String,
    token: &'a str,
    lease: Duration,
}

/// How long a give-up mark is kept: while the claim it stops may still arrive
/// (queued on its connection behind `WAIT`s, or resent by a cluster client).
/// The claim's lease, and at least a minute: a claim later than that would
/// take many queued acknowledgements, and holds its key for one lease, as
/// any claim whose caller is gone.
fn mark_ms(lease: Duration) -> i64 {
    script_ms(lease.max(Duration::from_secs(60)))
}

/// Whether a claim that failed with `e` may have run: anything but an answer
/// from the server to the claim itself (every script checks before it writes,
/// so its error means nothing was written). redis-rs reads an error code it
/// does not know (the scripts' own `idem: ..` refusals) as
/// `ErrorKind::Extension`: the server's answer all the same. A redirection or
/// a cluster that is down counts as unknown: the cluster client resends after
/// such answers, and an earlier send may have run.
fn fate_unknown(e: &StoreError) -> bool {
    let StoreError::Redis(source) = e else {
        return false;
    };
    source.downcast_ref::<RedisError>().is_some_and(|e| {
        !matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) || e.is_cluster_error()
    })
}

impl RedisLeaseStore {
    /// Gives back a claim its caller will not use (its answer never came, or
    /// its replicas did not acknowledge it), fenced by its token (ABANDON):
    /// a record it created is deleted, one it took over lapses now, and a
    /// claim still on its way finds the mark and writes nothing. Sent on the
    /// connection no `WAIT` blocks, so it is not held up behind the very
    /// acknowledgements that failed the claim, and not waited for by the
    /// replicas (best effort: a failure is logged, and the key is then taken
    /// over after its lease, as before).
    async fn abandon(&self, claim: &Abandon<'_>, why: &StoreError) {
        let mut inv = self.scripts.abandon.key(claim.record);
        inv.key(&claim.mark)
            .arg(claim.token)
            .arg(mark_ms(claim.lease));
        let conn = match self.acks {
            None => Some(self.conn.clone()),
            Some(_) => self.lanes.renewals_if_open(),
        };
        // With acknowledgement on and no lane open, the claim never went out
        // (opening them failed): there is nothing to give back.
        let Some(mut conn) = conn else { return };
        match inv.invoke_async::<u64>(&mut conn).await {
            Ok(n) => {
                tracing::warn!(error = %why, undone = n == 1, "idem: redis: a claim failed and was given back; the client's retry may claim the key at once")
            }
            Err(e) => {
                tracing::warn!(error = %e, claim_error = %why, "idem: redis: giving back a claim that failed did not work; the key is taken over after its lease")
            }
        }
    }
}
