//! A PostgreSQL failover under load, with synchronous and with asynchronous
//! replication (ARCHITECTURE.md, "Across a PostgreSQL failover").
//!
//! Each test makes a throwaway primary and streaming standby of its own
//! (`.ci/pg-pair`, Unix sockets in a directory under /tmp, removed when the test
//! ends however it ends), and a service whose pool reaches the primary through a
//! TCP proxy: the model of the address (a VIP, a DNS name) a deployment moves to
//! the new primary. Workers send idempotent requests (a payment row inserted in
//! the handler's transaction, answered with its id and the port of the server
//! that ran it), a new key at a time, each retried until it is answered. Then,
//! at fixed points, not after sleeps:
//!
//! 1. after `ANSWERED_BEFORE_CUT` answers, the next `PARKED` handlers stop inside
//!    their transactions (their payment inserted, not committed): requests in
//!    flight at the kill, whatever the timing;
//! 2. the standby stops receiving WAL (`.ci/pg-pair cut`): the failure modelled
//!    is a standby that has fallen behind, or lost the primary, when the primary
//!    dies. On one machine a streaming standby is otherwise never behind long
//!    enough for the kill to lose anything, and what it lost would be chance;
//! 3. asynchronous: `ANSWERED_AFTER_CUT` more answers, which the standby never
//!    receives. Synchronous: every other worker's commit waits for the standby
//!    (`wait_event = 'SyncRep'`), and none is answered;
//! 4. the primary is killed (`pg_ctl stop -m immediate`), the parked handlers go
//!    on against the dead connection, the standby is promoted, its state is
//!    read, and the proxy is switched to it; the workers' retries reach it and
//!    every key is answered in the end.
//!
//! Each test then retries every key once more and prints (to stderr, so that a
//! plain `cargo test` shows it) what happened to the keys: answers lost with
//! their effect (safe: the retry executes), in-flight requests lost, effects
//! without their record, records without their effect, and keys executed twice
//! against a surviving effect; and asserts what must hold: never an effect
//! without its record or a record without its effect, never a second execution
//! against a surviving effect, a lost answer executed again on retry and every
//! other key replaying the answer it got, one payment per key in the end; with
//! synchronous replication, no answered key lost.
//!
//! The service keeps a replay cache (`ReplayCache`): after an asynchronous
//! failover it still replays the answers the new primary lost, from memory; a
//! process without those entries (restarted, or another replica) executes them.
//! Both are asserted.
//!
//! Skipped, with a message on stderr, when PostgreSQL's server binaries are not
//! on the machine (`.ci/pg-pair check`); under `.ci/run`
//! (`IDEM_TEST_PG_PAIR=required`) their absence fails the test instead.

mod common;

use sqlx::Postgres;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idem_runtime::{Idem, IdempotencyKey, ReplayCache, Tx, idempotent};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;

use common::caller::Caller;
use common::state::AppState;

/// The workers sending requests concurrently, each a new key at a time until
/// the address is switched.
const WORKERS: usize = 12;
/// Answers before the standby is cut off.
const ANSWERED_BEFORE_CUT: usize = 60;
/// Handlers held inside their transactions across the kill.
const PARKED: usize = 3;
/// Asynchronous replication: answers after the cut, before the kill.
const ANSWERED_AFTER_CUT: usize = 30;
/// The ports naming the pair's sockets (`.ci/pg-pair`).
const PRIMARY_PORT: u16 = 5433;
const STANDBY_PORT: u16 = 5434;
/// The database the service uses on the pair.
const DATABASE: &str = "idem_failover";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Replication {
    Sync,
    Async,
}

impl Replication {
    fn name(self) -> &'static str {
        match self {
            Replication::Sync => "sync",
            Replication::Async => "async",
        }
    }
}

// ---------------------------------------------------------------- the pair

/// `.ci/pg-pair`, the script that makes, breaks and removes pairs.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/pg-pair")
}

/// Whether the pair can be made here; when it cannot, says so on stderr
/// (uncaptured: a skip is never silent) or, under `.ci/run`, fails.
fn pair_available(test: &str) -> bool {
    let out = std::process::Command::new(script())
        .arg("check")
        .output()
        .expect("running .ci/pg-pair check");
    if out.status.success() {
        return true;
    }
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(
        std::env::var("IDEM_TEST_PG_PAIR").as_deref() != Ok("required"),
        "{test}: a PostgreSQL pair is required here (IDEM_TEST_PG_PAIR=required) but cannot be made: {why}"
    );
    // Written to stderr itself, not through eprintln!, which the test harness
    // captures and shows only for failed tests.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: no PostgreSQL pair can be made on this machine: {}",
        why.trim()
    );
    false
}

/// A primary and its standby, stopped and removed on drop.
struct Pair {
    dir: PathBuf,
}

impl Pair {
    /// Makes a pair replicating in `mode`, in a directory of its own (`name`,
    /// one per test), named so that `.ci/pg-pair sweep` removes it if this
    /// process dies first.
    async fn start(name: &str, mode: Replication) -> Pair {
        let dir = PathBuf::from(format!("/tmp/idem-pg-pair.{}.{name}", std::process::id()));
        let pair = Pair { dir };
        pair.run(&["start", mode.name()]).await;
        pair
    }

    /// Runs `.ci/pg-pair <action> DIR [args]`, which must succeed.
    async fn run(&self, action_and_args: &[&str]) {
        let (action, args) = action_and_args.split_first().unwrap();
        let out = tokio::process::Command::new(script())
            .arg(action)
            .arg(&self.dir)
            .args(args)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            ".ci/pg-pair {action} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The socket file of the server on `port`.
    fn socket(&self, port: u16) -> PathBuf {
        self.dir.join(format!(".s.PGSQL.{port}"))
    }

    /// Connection options for `database` on the server on `port`, directly.
    fn options(&self, port: u16, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(&self.dir)
            .port(port)
            .username("postgres")
            .database(database)
    }

    /// Creates the service's database on the primary (idem's migrations and
    /// the payments table) and waits until the standby has replayed it; returns
    /// a connection to the primary's `postgres` database.
    async fn prepare(&self) -> PgConnection {
        let mut admin = self.connect(PRIMARY_PORT, "postgres").await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let direct = PgPool::connect_with(self.options(PRIMARY_PORT, DATABASE))
            .await
            .unwrap();
        idem_runtime::migrate(&direct).await.unwrap();
        sqlx::raw_sql("CREATE TABLE payments (id bigserial PRIMARY KEY, item text NOT NULL)")
            .execute(&direct)
            .await
            .unwrap();
        direct.close().await;
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut admin)
            .await
            .unwrap();
        let mut standby = self.connect(STANDBY_PORT, "postgres").await;
        poll(
            &mut standby,
            "the standby to replay the schema",
            "SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn",
            &lsn,
        )
        .await;
        standby.close().await.unwrap();
        admin
    }

    async fn connect(&self, port: u16, database: &str) -> PgConnection {
        PgConnection::connect_with(&self.options(port, database))
            .await
            .unwrap()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // Blocking, and that is fine: the test is over, and nothing else runs.
        let _ = std::process::Command::new(script())
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

// ---------------------------------------------------------------- the address

/// The address the service connects to: a TCP proxy to the current primary's
/// socket, switched to the new one after the failover (as a VIP or a DNS name
/// would be). A connection it cannot pass on is closed at once.
struct Address {
    addr: SocketAddr,
    target: Arc<Mutex<PathBuf>>,
}

impl Address {
    async fn to(target: PathBuf) -> Address {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = Arc::new(Mutex::new(target));
        let current = target.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = current.lock().unwrap().clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = UnixStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Address { addr, target }
    }

    fn switch(&self, to: PathBuf) {
        *self.target.lock().unwrap() = to;
    }
}

// ---------------------------------------------------------------- the service

#[derive(Deserialize, Serialize)]
struct Payment {
    item: String,
}

/// Handlers held inside their transactions, one hold per test (by tenant).
struct Hold {
    armed: AtomicBool,
    /// Handlers that reached the hold since it was armed.
    entered: AtomicUsize,
    /// A permit per parked handler.
    parked: Semaphore,
    released: watch::Sender<bool>,
}

impl Hold {
    fn of(tenant: &str) -> Arc<Hold> {
        static HOLDS: LazyLock<Mutex<HashMap<String, Arc<Hold>>>> = LazyLock::new(Default::default);
        HOLDS
            .lock()
            .unwrap()
            .entry(tenant.to_owned())
            .or_insert_with(|| {
                Arc::new(Hold {
                    armed: AtomicBool::new(false),
                    entered: AtomicUsize::new(0),
                    parked: Semaphore::new(0),
                    released: watch::channel(false).0,
                })
            })
            .clone()
    }

    /// Parks the first `PARKED` handlers that come once armed, until released.
    async fn pass(&self) {
        if !self.armed.load(Ordering::SeqCst)
            || self.entered.fetch_add(1, Ordering::SeqCst) >= PARKED
        {
            return;
        }
        let mut released = self.released.subscribe();
        self.parked.add_permits(1);
        let _ = released.wait_for(|r| *r).await;
    }
}

/// Inserts the payment in the request's transaction, and answers its id and
/// the port of the server that ran it (5433: the first primary; 5434: the
/// promoted standby). A database error rolls back and answers 503.
#[idempotent(operation = "pay", retention = "1h")]
async fn pay(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(p): Json<Payment>,
) -> Result<(StatusCode, Json<serde_json::Value>), (StatusCode, String)> {
    let unavailable = |e: sqlx::Error| (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
    let (id, port): (i64, i32) = sqlx::query_as(
        "INSERT INTO payments (item) VALUES ($1) RETURNING id, current_setting('port')::int",
    )
    .bind(&p.item)
    .fetch_one(&mut **tx)
    .await
    .map_err(unavailable)?;
    Hold::of(&caller.0).pass().await;
    Ok((
        StatusCode::CREATED,
        Json(json!({"payment": id, "port": port})),
    ))
}

fn router(idem: Idem<Postgres>) -> Router {
    Router::new()
        .route("/pay", post(pay))
        .with_state(AppState { idem })
}

/// An answer: its status, whether it was replayed, and its body.
#[derive(Clone, Debug, PartialEq)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: serde_json::Value,
}

impl Answer {
    fn port(&self) -> u16 {
        u16::try_from(self.body["port"].as_u64().unwrap()).unwrap()
    }

    fn payment(&self) -> i64 {
        self.body["payment"].as_i64().unwrap()
    }
}

async fn send(router: &Router, tenant: &str, key: &str) -> Answer {
    let req = Request::post("/pay")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", key)
        .body(Body::from(json!({ "item": key }).to_string()))
        .unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Answer {
        status,
        replayed,
        body,
    }
}

// ---------------------------------------------------------------- the load

/// What the workers share: the keys taken, the answers, and how many requests
/// are out.
struct Load {
    tenant: &'static str,
    /// The number of the next key to send (`key(tenant, n)`).
    next: AtomicUsize,
    /// Set when no new key is to be taken.
    stop: AtomicBool,
    answers: Mutex<HashMap<String, Answer>>,
    /// Keys answered before the address was switched: by the first primary,
    /// the only server the service could reach.
    answered_by_old_primary: Mutex<HashSet<String>>,
    /// Set when the address is switched to the new primary.
    switched: AtomicBool,
    answered: watch::Sender<usize>,
    in_flight: AtomicUsize,
}

/// The `n`th key of `tenant`.
fn key(tenant: &str, n: usize) -> String {
    format!("{tenant}-{n:05}")
}

/// Sends new keys until stopped, each retried until it is answered `201`.
/// What may come before: `503` (the store unreachable, or the outcome unknown)
/// and `409` (in flight); anything else fails the test.
async fn worker(router: Router, load: Arc<Load>) {
    loop {
        if load.stop.load(Ordering::SeqCst) {
            return;
        }
        let key = key(load.tenant, load.next.fetch_add(1, Ordering::SeqCst));
        loop {
            load.in_flight.fetch_add(1, Ordering::SeqCst);
            let answer = send(&router, load.tenant, &key).await;
            load.in_flight.fetch_sub(1, Ordering::SeqCst);
            match answer.status {
                StatusCode::CREATED => {
                    // Read after the answer came: if the address had not been
                    // switched by then, the first primary gave it.
                    if !load.switched.load(Ordering::SeqCst) {
                        load.answered_by_old_primary
                            .lock()
                            .unwrap()
                            .insert(key.clone());
                    }
                    load.answers.lock().unwrap().insert(key, answer);
                    load.answered.send_modify(|n| *n += 1);
                    break;
                }
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {
                    // A retry's pause; nothing waits on its length.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!("{key}: unexpected {other}: {:?}", answer.body),
            }
        }
    }
}

// ---------------------------------------------------------------- the state

/// What a database holds for one key.
#[derive(Default, Clone, Debug)]
struct Held {
    /// The ids of the key's payments.
    payments: Vec<i64>,
    /// The key's record: its state and stored body.
    record: Option<(String, serde_json::Value)>,
}

/// What `conn`'s database holds for each of `keys` under `tenant`.
async fn holdings(conn: &mut PgConnection, tenant: &str, keys: &[String]) -> HashMap<String, Held> {
    let mut held: HashMap<String, Held> =
        keys.iter().map(|k| (k.clone(), Held::default())).collect();
    let payments: Vec<(i64, String)> = sqlx::query_as("SELECT id, item FROM payments ORDER BY id")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    for (id, item) in payments {
        held.get_mut(&item).unwrap().payments.push(id);
    }
    let by_digest: HashMap<String, &String> = keys
        .iter()
        .map(|k| (IdempotencyKey::parse(k).unwrap().digest().to_string(), k))
        .collect();
    let records: Vec<(String, String, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT encode(key_digest, 'hex'), state, response_body
           FROM idempotency_requests WHERE tenant_id = $1 AND operation = 'pay'",
    )
    .bind(tenant)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    for (digest, state, body) in records {
        let key = by_digest[&digest];
        let body = body
            .map(|b| serde_json::from_slice(&b).unwrap())
            .unwrap_or_default();
        held.get_mut(key).unwrap().record = Some((state, body));
    }
    held
}

// ---------------------------------------------------------------- the test

/// What a failover did to the keys.
#[derive(Debug, Default)]
struct Report {
    /// Keys sent in all.
    keys: usize,
    /// Answers before the kill.
    answered_before: usize,
    /// Requests out when the primary was killed.
    in_flight_at_kill: usize,
    /// Keys the first primary answered that the new primary holds.
    answer_survived: usize,
    /// Keys the first primary answered whose record and effect the new primary
    /// does not hold: their retry executes.
    answer_lost_with_effect: Vec<String>,
    /// Keys sent before the kill, unanswered, that the new primary holds
    /// (their retry replays).
    in_flight_survived: usize,
    /// Keys sent before the kill, unanswered, that the new primary does not
    /// hold (never committed, or committed but not replicated).
    in_flight_lost: usize,
    /// Keys first sent after the kill.
    sent_after: usize,
    /// Keys whose effect the new primary holds without their record.
    effect_without_record: Vec<String>,
    /// Keys whose record the new primary holds without their effect.
    record_without_effect: Vec<String>,
    /// Keys with more than one payment: executed twice against a surviving
    /// effect.
    executed_twice: Vec<String>,
    /// Lost keys the replay cache still answered after the failover.
    replayed_from_cache: usize,
}

impl Report {
    fn print(&self, mode: Replication) {
        let report = format!(
            "pg_failover, {} replication: {} keys, {WORKERS} workers; the kill began after {} answers, with {} requests in flight\n\
             \x20 answered by the old primary, survived:                      {}\n\
             \x20 answered by the old primary, lost with their effect:        {} (safe: the retry executed)\n\
             \x20   of which the replay cache still answered from memory:      {}\n\
             \x20 sent before the kill, unanswered, survived:                 {} (the retry replayed)\n\
             \x20 sent before the kill, unanswered, lost:                     {} (the retry executed)\n\
             \x20 first sent after the kill:                                  {}\n\
             \x20 effect without its record:                                  {} (must be 0)\n\
             \x20 record without its effect:                                  {} (must be 0)\n\
             \x20 executed twice against a surviving effect:                  {} (must be 0)\n",
            mode.name(),
            self.keys,
            self.answered_before,
            self.in_flight_at_kill,
            self.answer_survived,
            self.answer_lost_with_effect.len(),
            self.replayed_from_cache,
            self.in_flight_survived,
            self.in_flight_lost,
            self.sent_after,
            self.effect_without_record.len(),
            self.record_without_effect.len(),
            self.executed_twice.len(),
        );
        // One write, so that the two tests' reports do not interleave; to
        // stderr itself, so that `cargo test` shows it without --nocapture.
        let _ = std::io::stderr().write_all(report.as_bytes());
    }
}

async fn failover(mode: Replication) -> Report {
    let tenant = mode.name();
    let pair = Pair::start(mode.name(), mode).await;

    let mut admin = pair.prepare().await;

    // The service: its pool through the address, which tests idle connections
    // before handing them out (sqlx's default), so that the ones the kill broke
    // are replaced.
    let address = Address::to(pair.socket(PRIMARY_PORT)).await;
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(WORKERS).unwrap() + 4)
        .test_before_acquire(true)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(
            PgConnectOptions::new()
                .host("127.0.0.1")
                .port(address.addr.port())
                .username("postgres")
                .database(DATABASE),
        )
        .await
        .unwrap();
    let service = router(
        Idem::new(pool.clone())
            .with_replay_cache(ReplayCache::new(16 * 1024 * 1024, Duration::from_secs(600))),
    );

    let load = Arc::new(Load {
        tenant,
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        answers: Mutex::new(HashMap::new()),
        answered_by_old_primary: Mutex::new(HashSet::new()),
        switched: AtomicBool::new(false),
        answered: watch::channel(0).0,
        in_flight: AtomicUsize::new(0),
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(worker(service.clone(), load.clone())))
        .collect();
    let mut answered = load.answered.subscribe();
    let hold = Hold::of(tenant);

    // 1. Requests held in flight.
    answered
        .wait_for(|n| *n >= ANSWERED_BEFORE_CUT)
        .await
        .unwrap();
    hold.armed.store(true, Ordering::SeqCst);
    let parked = hold
        .parked
        .acquire_many(u32::try_from(PARKED).unwrap())
        .await
        .unwrap();
    parked.forget();

    // 2. The standby cut off.
    pair.run(&["cut"]).await;

    // 3. Answers the standby never receives, or commits that wait for it.
    match mode {
        Replication::Async => {
            let at_cut = *answered.borrow();
            answered
                .wait_for(|n| *n >= at_cut + ANSWERED_AFTER_CUT)
                .await
                .unwrap();
        }
        Replication::Sync => {
            poll(
                &mut admin,
                "every running worker's commit to wait for the standby",
                "SELECT count(*) >= $1::bigint FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
                &(WORKERS - PARKED).to_string(),
            )
            .await;
        }
    }

    // 4. The kill, the promotion, the switch.
    drop(admin);
    let answered_before = *answered.borrow();
    let in_flight_at_kill = load.in_flight.load(Ordering::SeqCst);
    pair.run(&["kill"]).await;
    // Keys no worker had taken by then never reached the first primary.
    let taken_at_kill = load.next.load(Ordering::SeqCst);
    hold.released.send_replace(true);
    pair.run(&["promote"]).await;
    let mut new_primary = pair.connect(STANDBY_PORT, DATABASE).await;
    let taken: Vec<String> = (0..load.next.load(Ordering::SeqCst))
        .map(|n| key(tenant, n))
        .collect();
    let survived = holdings(&mut new_primary, tenant, &taken).await;
    load.switched.store(true, Ordering::SeqCst);
    address.switch(pair.socket(STANDBY_PORT));
    // The workers finish the keys they hold, on the new primary.
    load.stop.store(true, Ordering::SeqCst);

    for w in workers {
        w.await.unwrap();
    }
    let answers = load.answers.lock().unwrap().clone();
    let old_primary_answered = load.answered_by_old_primary.lock().unwrap().clone();
    let keys: Vec<String> = (0..load.next.load(Ordering::SeqCst))
        .map(|n| key(tenant, n))
        .collect();
    assert_eq!(answers.len(), keys.len(), "every key answered in the end");

    let mut report = Report {
        keys: keys.len(),
        answered_before,
        in_flight_at_kill,
        ..Report::default()
    };
    for (n, key) in keys.iter().enumerate() {
        // Keys taken after the snapshot have nothing in it.
        let held = survived.get(key).cloned().unwrap_or_default();
        let answer = &answers[key];
        if held.payments.len() > 1 {
            report.executed_twice.push(key.clone());
            continue;
        }
        // Answered by the first primary: before the switch, or executed there
        // and not replayed (a replay's body is the stored one, whoever sent it).
        let by_old_primary = old_primary_answered.contains(key)
            || (answer.port() == PRIMARY_PORT && !answer.replayed);
        match (held.payments.is_empty(), &held.record) {
            (true, None) if by_old_primary => report.answer_lost_with_effect.push(key.clone()),
            (true, None) if n >= taken_at_kill => report.sent_after += 1,
            (true, None) => report.in_flight_lost += 1,
            (false, None) => report.effect_without_record.push(key.clone()),
            (true, Some(_)) => report.record_without_effect.push(key.clone()),
            (false, Some((state, body))) => {
                // What survived is one execution, answered as it was stored.
                assert_eq!(state, "completed", "{key}");
                assert_eq!(body["payment"].as_i64(), Some(held.payments[0]), "{key}");
                assert_eq!(body, &answer.body, "{key}: the answer is the stored one");
                if by_old_primary {
                    report.answer_survived += 1;
                } else {
                    report.in_flight_survived += 1;
                }
            }
        }
    }

    // The replay cache still answers, from memory, what the new primary lost.
    for key in &report.answer_lost_with_effect {
        let again = send(&service, tenant, key).await;
        assert_eq!(again.status, StatusCode::CREATED, "{key}");
        if again.replayed && again.body == answers[key].body {
            report.replayed_from_cache += 1;
        }
    }

    // Every key retried once more, by a process without that memory (a
    // restarted service, another replica): it executes a key whose answer was
    // lost, and replays every other one.
    let fresh = router(Idem::new(pool.clone()));
    let mut finals = HashMap::new();
    for key in &keys {
        let again = send(&fresh, tenant, key).await;
        assert_eq!(again.status, StatusCode::CREATED, "{key}: {:?}", again.body);
        if report.answer_lost_with_effect.contains(key) {
            assert!(
                !again.replayed,
                "{key}: its answer was lost, the retry executes"
            );
            assert_eq!(again.port(), STANDBY_PORT, "{key}");
        } else {
            assert!(again.replayed, "{key}: {:?}", again.body);
            assert_eq!(again.body, answers[key].body, "{key}: the answer it got");
        }
        finals.insert(key.clone(), again);
    }

    // In the end, one payment and one record per key, the record answering
    // that payment; a payment that survived the failover is that one.
    let end = holdings(&mut new_primary, tenant, &keys).await;
    for key in &keys {
        let held = &end[key];
        if held.payments.len() > 1 {
            report.executed_twice.push(key.clone());
            continue;
        }
        assert_eq!(held.payments.len(), 1, "{key}: no payment");
        let (state, body) = held.record.as_ref().expect("a record");
        assert_eq!(state, "completed", "{key}");
        assert_eq!(body["payment"].as_i64(), Some(held.payments[0]), "{key}");
        assert_eq!(finals[key].payment(), held.payments[0], "{key}");
        if let Some(&before) = survived.get(key).and_then(|h| h.payments.first()) {
            assert_eq!(held.payments[0], before, "{key}: its surviving payment");
        }
    }
    new_primary.close().await.unwrap();
    pool.close().await;
    report.print(mode);
    drop(pair);
    report
}

/// Polls `query` (a boolean, of one text parameter `arg`) on `conn` every
/// 10 ms until it holds (30 s at most).
async fn poll(conn: &mut PgConnection, what: &str, query: &'static str, arg: &str) {
    for _ in 0..3000 {
        let ready: bool = sqlx::query_scalar(query)
            .bind(arg)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        if ready {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The payments `conn`'s database holds.
async fn payments(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The musts of both modes.
fn assert_never_broken(report: &Report) {
    assert!(
        report.effect_without_record.is_empty(),
        "effects without their record: {:?}",
        report.effect_without_record
    );
    assert!(
        report.record_without_effect.is_empty(),
        "records without their effect: {:?}",
        report.record_without_effect
    );
    assert!(
        report.executed_twice.is_empty(),
        "executed twice against a surviving effect: {:?}",
        report.executed_twice
    );
    // The parked handlers' transactions never committed.
    assert!(report.in_flight_lost >= PARKED, "{report:?}");
    assert_eq!(
        report.replayed_from_cache,
        report.answer_lost_with_effect.len(),
        "the replay cache answers every lost key it completed: {report:?}"
    );
}

/// The whole scenario, bounded: a failover that hangs fails the test.
async fn run(mode: Replication) -> Option<Report> {
    let test = format!("pg_failover ({} replication)", mode.name());
    if !pair_available(&test) {
        return None;
    }
    let report = tokio::time::timeout(Duration::from_secs(180), failover(mode))
        .await
        .unwrap_or_else(|_| panic!("{test} did not end within 180 s"));
    Some(report)
}

/// Synchronous replication (`synchronous_standby_names`, `synchronous_commit
/// = on`): no commit is answered before the standby has it, so every answered
/// key survives the failover; commits that were waiting for the standby are
/// lost unanswered, and their retries execute on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_replication_keeps_every_answered_key() {
    let Some(report) = run(Replication::Sync).await else {
        return;
    };
    assert_never_broken(&report);
    assert!(
        report.answer_lost_with_effect.is_empty(),
        "answered keys lost under synchronous replication: {:?}",
        report.answer_lost_with_effect
    );
    // Each worker's request was held or waiting for the standby when the
    // primary died, unanswered. (A commit the standby flushed just before the
    // cut, whose confirmation the primary never got, survives unanswered: its
    // retry replays.)
    assert_eq!(
        report.in_flight_lost + report.in_flight_survived,
        WORKERS,
        "{report:?}"
    );
}

/// Asynchronous replication: answers the standby never received are lost, each
/// with its effect (the claim and the effect commit together), and their
/// retries execute again on the new primary: still at most once against the
/// database that survived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_replication_loses_answered_keys_only_with_their_effects() {
    let Some(report) = run(Replication::Async).await else {
        return;
    };
    assert_never_broken(&report);
    // Of the answers after the cut, at most one per running worker committed
    // before it.
    assert!(
        report.answer_lost_with_effect.len() >= ANSWERED_AFTER_CUT - (WORKERS - PARKED),
        "{report:?}"
    );
}

/// Synchronous replication with the standby away, and no failover: a commit
/// that waits for the standby is not visible, nor rolled back. Past the request
/// deadline the request answers `503` (its connection closed, which does not
/// end the wait); a retry runs its handler and then waits for the pending
/// commit's key, answering `409` in flight (its own payment rolled back); once
/// the standby is back, the pending commit completes and the retry replays it.
/// One payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_waiting_for_the_standby_keeps_its_key_in_flight_until_it_returns() {
    let test = "pg_failover (a commit waiting for the standby)";
    if !pair_available(test) {
        return;
    }
    let run = async {
        let pair = Pair::start("away", Replication::Sync).await;
        let mut admin = pair.prepare().await;
        let pool = PgPool::connect_with(pair.options(PRIMARY_PORT, DATABASE))
            .await
            .unwrap();
        let service = router(
            Idem::new(pool.clone())
                .with_in_flight_wait(Duration::from_millis(200))
                .with_request_deadline(Duration::from_secs(1)),
        );
        let tenant = "standby-away";
        pair.run(&["cut"]).await;

        let first = send(&service, tenant, "k1").await;
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
        // The commit still waits, and shows nothing yet.
        poll(
            &mut admin,
            "the abandoned commit to wait for the standby",
            "SELECT count(*) = $1::bigint FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
            "1",
        )
        .await;
        let mut primary = pair.connect(PRIMARY_PORT, DATABASE).await;
        assert_eq!(payments(&mut primary).await, 0);

        let retry = send(&service, tenant, "k1").await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
        assert_eq!(
            retry.body["type"],
            idem_runtime::problem::IN_FLIGHT,
            "{retry:?}"
        );

        pair.run(&["rejoin"]).await;
        poll(
            &mut admin,
            "the pending commit to complete",
            "SELECT count(*) = $1::bigint FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
            "0",
        )
        .await;
        let replay = send(&service, tenant, "k1").await;
        assert_eq!(
            (replay.status, replay.replayed),
            (StatusCode::CREATED, true),
            "{replay:?}"
        );
        assert_eq!(replay.port(), PRIMARY_PORT);
        let (only,): (i64,) = sqlx::query_as("SELECT id FROM payments")
            .fetch_one(&mut primary)
            .await
            .unwrap();
        assert_eq!(replay.payment(), only);
        assert_eq!(payments(&mut primary).await, 1);
        primary.close().await.unwrap();
        pool.close().await;
    };
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| panic!("{test} did not end within 120 s"));
}
