//! The failure-window suite: the real `orders` example process, over real HTTP,
//! against each backend: a real PostgreSQL and a SQLite file. Each test is written
//! once, generic over [`Backend`], and stamped per backend by `e2e_suite!`; each
//! run has its own database and server(s).
//!
//! The example binary is built by `cargo test --workspace` (cargo builds examples
//! for tests); run `cargo build --example orders` first when running this file alone.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{SqliteDb, TestDb};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Command;

use common::hold::Hold;
use common::orders::Server;

/// What the suite needs of a database the example runs on.
trait Backend: Sized {
    /// A fresh database of its own, with idem's migrations applied.
    async fn create() -> Self;
    /// The `DATABASE_URL` the example is started with.
    fn url(&self) -> String;
    /// The single integer a query returns.
    async fn count(&self, sql: &str) -> i64;
    /// Runs statements.
    async fn exec(&self, sql: &str);
    /// A moment one second ago, as idem stores its timestamps.
    const A_SECOND_AGO: &'static str;
    /// The SQL literal of a key's digest, as idem stores it in `key_digest`.
    fn key(&self, raw: &str) -> String;
    /// Whether a duplicate on another process runs its handler while the first
    /// request holds the key (the key claimed at commit: PostgreSQL, MySQL), or
    /// waits in the database before it runs anything (SQLite's write lock).
    const DUPLICATES_RUN: bool;
    /// Waits until no (killed) server's transaction holds anything any more.
    async fn wait_until_no_open_transaction(&self);
    /// The status and body of the one stored outcome.
    async fn stored_outcome(&self) -> (i64, Vec<u8>);
    /// The id and amount of the one order.
    async fn the_order(&self) -> (i64, i64);
}

/// The parts of [`Backend`] that are the same SQL on both, for a helper type with
/// a `pool`, `count` and `exec`.
macro_rules! same_sql {
    () => {
        async fn count(&self, sql: &str) -> i64 {
            Self::count(self, sql).await
        }
        async fn exec(&self, sql: &str) {
            Self::exec(self, sql).await
        }
        fn key(&self, raw: &str) -> String {
            Self::key(self, raw)
        }
        async fn stored_outcome(&self) -> (i64, Vec<u8>) {
            sqlx::query_as(
                "SELECT CAST(response_status AS bigint), response_body FROM idempotency_requests",
            )
            .fetch_one(&self.pool)
            .await
            .unwrap()
        }
        async fn the_order(&self) -> (i64, i64) {
            sqlx::query_as("SELECT id, amount_cents FROM orders")
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }
    };
}

impl Backend for TestDb {
    async fn create() -> Self {
        TestDb::new().await
    }
    fn url(&self) -> String {
        self.url.clone()
    }
    same_sql!();
    const A_SECOND_AGO: &'static str = "now() - interval '1 second'";
    const DUPLICATES_RUN: bool = true;
    /// PostgreSQL rolls a dead session's transaction back once it notices.
    async fn wait_until_no_open_transaction(&self) {
        wait_for(self, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'", |n| n == 0).await;
    }
}

impl Backend for SqliteDb {
    async fn create() -> Self {
        SqliteDb::new().await
    }
    fn url(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }
    same_sql!();
    const A_SECOND_AGO: &'static str = concat!(idem_runtime::sqlite_now_ms!(), " - 1000");
    const DUPLICATES_RUN: bool = false;
    /// The write lock of a dead process is gone with it: taking it proves nobody
    /// holds it (the pool's busy timeout is the wait).
    async fn wait_until_no_open_transaction(&self) {
        sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK")
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

impl Backend for common::MySqlDb {
    async fn create() -> Self {
        common::MySqlDb::new().await
    }
    fn url(&self) -> String {
        self.url.clone()
    }
    async fn count(&self, sql: &str) -> i64 {
        Self::count(self, sql).await
    }
    async fn exec(&self, sql: &str) {
        Self::exec(self, sql).await
    }
    const A_SECOND_AGO: &'static str = concat!(idem_runtime::mysql_now_ms!(), " - 1000");
    const DUPLICATES_RUN: bool = true;
    fn key(&self, raw: &str) -> String {
        Self::key(self, raw)
    }
    /// MySQL rolls a dead connection's transaction back once it notices.
    async fn wait_until_no_open_transaction(&self) {
        let sql = format!(
            "SELECT count(*) FROM information_schema.INNODB_TRX t \
               JOIN information_schema.PROCESSLIST p ON p.id = t.trx_mysql_thread_id \
              WHERE p.db = '{}'",
            self.name
        );
        wait_for(self, &sql, |n| n == 0).await;
    }
    async fn stored_outcome(&self) -> (i64, Vec<u8>) {
        sqlx::query_as(
            "SELECT CAST(response_status AS SIGNED), response_body FROM idempotency_requests",
        )
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
    async fn the_order(&self) -> (i64, i64) {
        sqlx::query_as("SELECT id, amount_cents FROM orders")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// `D` with every server it starts sealing its answers at rest
/// (`IDEM_KEY_RING`): the same scenarios, with encryption on.
struct Sealed<D>(D);

impl<D: Backend> Backend for Sealed<D> {
    async fn create() -> Self {
        let db = D::create().await;
        common::orders::seal_answers_on(&db.url());
        Sealed(db)
    }
    fn url(&self) -> String {
        self.0.url()
    }
    async fn count(&self, sql: &str) -> i64 {
        self.0.count(sql).await
    }
    async fn exec(&self, sql: &str) {
        self.0.exec(sql).await
    }
    const A_SECOND_AGO: &'static str = D::A_SECOND_AGO;
    const DUPLICATES_RUN: bool = D::DUPLICATES_RUN;
    fn key(&self, raw: &str) -> String {
        self.0.key(raw)
    }
    async fn wait_until_no_open_transaction(&self) {
        self.0.wait_until_no_open_transaction().await
    }
    async fn stored_outcome(&self) -> (i64, Vec<u8>) {
        self.0.stored_outcome().await
    }
    async fn the_order(&self) -> (i64, i64) {
        self.0.the_order().await
    }
}

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    /// Asserts the answer's status, with `what` (the case) and the body in the
    /// message when it is not.
    #[track_caller]
    fn expect_status(&self, status: StatusCode, what: impl std::fmt::Display) {
        assert_eq!(
            self.status,
            status,
            "{what}: {}",
            String::from_utf8_lossy(&self.body)
        );
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    fn problem_type(&self) -> String {
        assert_eq!(
            self.headers
                .get("content-type")
                .map(|v| v.to_str().unwrap()),
            Some("application/problem+json"),
            "status {}",
            self.status
        );
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }
}

/// One request; the knobs default to a valid `POST /orders`.
struct Call<'a> {
    path: &'a str,
    tenant: Option<&'a str>,
    key: Option<&'a str>,
    currency: Option<&'a str>,
    body: String,
    content_type: &'a str,
    timeout: Duration,
}

impl<'a> Call<'a> {
    fn order(key: &'a str) -> Self {
        Call {
            path: "/orders",
            tenant: Some("acme"),
            key: Some(key),
            currency: Some("EUR"),
            body: json!({"sku": "A-1", "quantity": 2, "amount_cents": 1999}).to_string(),
            content_type: "application/json",
            timeout: Duration::from_secs(60),
        }
    }

    fn body(mut self, v: Value) -> Self {
        self.body = v.to_string();
        self
    }

    async fn send(&self, server: &Server) -> Result<Answer, reqwest::Error> {
        self.send_to(&server.base).await
    }

    async fn send_to(&self, base: &str) -> Result<Answer, reqwest::Error> {
        let client = reqwest::Client::new();
        let mut r = client
            .post(format!("{base}{}", self.path))
            .timeout(self.timeout)
            .header("content-type", self.content_type)
            .body(self.body.clone());
        if let Some(t) = self.tenant {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        if let Some(k) = self.key {
            r = r.header("idempotency-key", k);
        }
        if let Some(c) = self.currency {
            r = r.header("x-currency", c);
        }
        let resp = r.send().await?;
        Ok(Answer {
            status: resp.status(),
            headers: resp.headers().clone(),
            body: resp.bytes().await?.to_vec(),
        })
    }

    async fn ok(&self, server: &Server) -> Answer {
        self.send(server).await.unwrap()
    }

    /// Retries while the first request is in flight, waiting what `Retry-After` says,
    /// as a well-behaved client does.
    async fn until_settled(&self, server: &Server) -> Answer {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let a = self.ok(server).await;
            if a.status != StatusCode::CONFLICT {
                return a;
            }
            assert!(Instant::now() < deadline, "still in flight after 120 s");
            let secs: u64 = a.headers["retry-after"].to_str().unwrap().parse().unwrap();
            tokio::time::sleep(Duration::from_secs(secs)).await;
        }
    }
}

async fn get(server: &Server, path: &str, tenant: &str) -> Answer {
    let resp = reqwest::Client::new()
        .get(format!("{}{path}", server.base))
        .header("authorization", format!("Bearer {tenant}"))
        .send()
        .await
        .unwrap();
    Answer {
        status: resp.status(),
        headers: resp.headers().clone(),
        body: resp.bytes().await.unwrap().to_vec(),
    }
}

async fn orders(db: &impl Backend) -> i64 {
    db.count("SELECT count(*) FROM orders").await
}

async fn wait_for(db: &impl Backend, sql: &str, done: impl Fn(i64) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(db.count(sql).await) {
        assert!(Instant::now() < deadline, "condition never held: {sql}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// (1) N concurrent requests with one key: one order; every answer 201 (or 409
/// past the in-flight wait). The first is held inside its transaction until
/// every duplicate waits for it, so all N are in the server at once.
async fn concurrent_duplicates_create_one_order<D: Backend>() {
    let db = D::create().await;
    let hold = Hold::new();
    let server =
        Arc::new(Server::start(&db.url(), &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "5000")]).await);
    let n = 16;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let server = server.clone();
            tokio::spawn(async move { Call::order("race-1").ok(&server).await })
        })
        .collect();
    server.wait_until_executing(1).await;
    server.wait_until_waiting(n - 1).await;
    assert_eq!(
        *server.executions.borrow(),
        1,
        "a duplicate ran its handler beside the first"
    );
    hold.release();
    let mut originals = 0;
    for t in tasks {
        let a = t.await.unwrap();
        match a.status {
            StatusCode::CREATED => originals += usize::from(!a.replayed()),
            StatusCode::CONFLICT => assert!(a.headers.contains_key("retry-after")),
            s => panic!("unexpected {s}: {}", String::from_utf8_lossy(&a.body)),
        }
    }
    assert_eq!(originals, 1);
    assert_eq!(orders(&db).await, 1);
}

/// (2) Same key, different payload: 422 problem, no new order.
async fn same_key_different_payload_is_422<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    assert_eq!(
        Call::order("k").ok(&server).await.status,
        StatusCode::CREATED
    );
    let other = Call::order("k")
        .body(json!({"sku": "A-1", "quantity": 3, "amount_cents": 1999}))
        .ok(&server)
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.problem_type(),
        "urn:idem:problem:fingerprint-mismatch"
    );
    let mut usd = Call::order("k");
    usd.currency = Some("USD");
    let usd = usd.ok(&server).await;
    assert_eq!(usd.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(orders(&db).await, 1);
}

/// Sends the order of `key` and gives it up once the server executes it (the
/// request is held inside its transaction, its key claimed): the client's
/// connection closes, the server carries on. Then lets the request finish.
async fn give_up_while_held(server: &Server, hold: &Hold, key: &'static str) {
    let base = server.base.clone();
    let gone = tokio::spawn(async move { Call::order(key).send_to(&base).await });
    server.wait_until_executing(1).await;
    gone.abort();
    assert!(gone.await.is_err_and(|e| e.is_cancelled()));
    hold.release();
}

/// (3) The response is lost: the client gives up before the server commits; the
/// retry replays the committed result. The request is held inside its
/// transaction (its key claimed) until the client has gone.
async fn a_lost_response_is_replayed_on_retry<D: Backend>() {
    let db = D::create().await;
    let hold = Hold::new();
    let server = Server::start(&db.url(), &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "500")]).await;
    give_up_while_held(&server, &hold, "lost-1").await;
    let mut call = Call::order("lost-1");
    call.timeout = Duration::from_secs(60);
    let retry = call.until_settled(&server).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed(),
        "the server finished the first request; the retry replays it"
    );
    assert_eq!(orders(&db).await, 1);
}

/// (4) Crash before commit: SIGKILL while the request sleeps inside its
/// transaction, restart, retry: the operation executes once.
async fn a_crash_before_commit_leaves_nothing_and_the_retry_executes<D: Backend>() {
    let db = D::create().await;
    let mut server = Server::start(&db.url(), &[("ORDERS_LATENCY_MS", "600000")]).await;
    let base = server.base.clone();
    let in_flight = tokio::spawn(async move { Call::order("crash-1").send_to(&base).await });
    server.wait_until_executing(1).await;
    server.kill().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client sees the connection die"
    );
    // The database rolls the dead server's transaction back.
    db.wait_until_no_open_transaction().await;
    assert_eq!(orders(&db).await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );

    let server = Server::start(&db.url(), &[]).await;
    let retry = Call::order("crash-1").ok(&server).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(orders(&db).await, 1);
}

/// (5) The client gives up (as on a timeout) while the request is held inside
/// its transaction, and the server completes it: the stored result is the order
/// in the database, and the retry gets exactly it.
async fn the_stored_result_matches_the_order_after_a_client_timeout<D: Backend>() {
    let db = D::create().await;
    let hold = Hold::new();
    let server = Server::start(&db.url(), &[hold.env()]).await;
    let mut call = Call::order("timeout-1");
    give_up_while_held(&server, &hold, "timeout-1").await;
    // The server carries on and commits although nobody listens any more.
    wait_for(
        &db,
        "SELECT count(*) FROM idempotency_requests WHERE state = 'completed'",
        |n| n == 1,
    )
    .await;
    let (status, body) = db.stored_outcome().await;
    assert_eq!(status, 201);
    let stored: Value = serde_json::from_slice(&body).unwrap();
    let (id, amount) = db.the_order().await;
    assert_eq!(stored["id"], id);
    assert_eq!(stored["amount_cents"], amount);
    call.timeout = Duration::from_secs(60);
    let retry = call.ok(&server).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, body);
    assert_eq!(retry.headers["location"], format!("/orders/{id}"));
    assert_eq!(orders(&db).await, 1);
}

/// (6) Expiry: once the retention has passed, a retry is a new execution (the
/// documented retention contract).
async fn after_retention_a_retry_executes_anew<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let first = Call::order("exp-1").ok(&server).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let within = Call::order("exp-1").ok(&server).await;
    assert!(within.replayed());
    db.exec(&format!(
        "UPDATE idempotency_requests SET expires_at = {}",
        D::A_SECOND_AGO
    ))
    .await;
    let after = Call::order("exp-1").ok(&server).await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert!(!after.replayed());
    assert_ne!(after.json()["id"], first.json()["id"]);
    assert_eq!(orders(&db).await, 2);
}

/// (7) Replay after the resource changed: the stored 201 is replayed unchanged.
async fn a_replay_after_delete_returns_the_stored_201<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let first = Call::order("del-1").ok(&server).await;
    let id = first.json()["id"].as_i64().unwrap();
    let deleted = reqwest::Client::new()
        .delete(format!("{}/orders/{id}", server.base))
        .header("authorization", "Bearer acme")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        get(&server, &format!("/orders/{id}"), "acme").await.status,
        StatusCode::NOT_FOUND
    );
    let retry = Call::order("del-1").ok(&server).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(
        orders(&db).await,
        0,
        "the replay did not recreate the order"
    );
}

/// (8) Two processes on two ports, one database, duplicates across both: one
/// order. Every request is held until both processes have theirs in flight:
/// where the key is claimed at commit, both first requests run their handlers
/// at once and the database lets one commit; elsewhere the second waits in the
/// database.
async fn two_servers_one_database_one_order<D: Backend>() {
    let db = D::create().await;
    let hold = Hold::new();
    let env = [hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "5000")];
    let a = Arc::new(Server::start(&db.url(), &env).await);
    let b = Arc::new(Server::start(&db.url(), &env).await);
    assert_ne!(a.base, b.base);
    let n = 12;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let server = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move { Call::order("spread-1").ok(&server).await })
        })
        .collect();
    // Each process's first request holds its flight; the rest wait behind it.
    a.wait_until_waiting(n / 2 - 1).await;
    b.wait_until_waiting(n / 2 - 1).await;
    if D::DUPLICATES_RUN {
        a.wait_until_executing(1).await;
        b.wait_until_executing(1).await;
    } else {
        // One first request runs (held); the other waits for the write lock.
        tokio::select! {
            () = a.wait_until_executing(1) => {}
            () = b.wait_until_executing(1) => {}
        }
    }
    hold.release();
    let mut originals = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            StatusCode::CREATED => originals += usize::from(!r.replayed()),
            StatusCode::CONFLICT => assert!(r.headers.contains_key("retry-after")),
            s => panic!("unexpected {s}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    assert_eq!(originals, 1);
    assert_eq!(orders(&db).await, 1);
}

/// (9) Bad input reserves nothing: after each rejection the same key executes.
async fn rejected_input_reserves_nothing<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let key = "bad-1";
    let cases: Vec<(&str, Call, StatusCode)> = vec![
        (
            "malformed JSON",
            Call {
                body: "{\"sku\":".into(),
                ..Call::order(key)
            },
            StatusCode::BAD_REQUEST,
        ),
        (
            "missing auth",
            Call {
                tenant: None,
                ..Call::order(key)
            },
            StatusCode::UNAUTHORIZED,
        ),
        (
            "malformed auth",
            Call {
                tenant: Some("Not Valid"),
                ..Call::order(key)
            },
            StatusCode::UNAUTHORIZED,
        ),
        (
            "missing currency",
            Call {
                currency: None,
                ..Call::order(key)
            },
            StatusCode::BAD_REQUEST,
        ),
        (
            "bad currency",
            Call {
                currency: Some("eur"),
                ..Call::order(key)
            },
            StatusCode::BAD_REQUEST,
        ),
        (
            "unknown field",
            Call::order(key).body(json!({"sku": "A", "quantity": 1, "amount_cents": 1, "x": 1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "zero quantity",
            Call::order(key).body(json!({"sku": "A", "quantity": 0, "amount_cents": 1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "negative amount",
            Call::order(key).body(json!({"sku": "A", "quantity": 1, "amount_cents": -1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "empty sku",
            Call::order(key).body(json!({"sku": "", "quantity": 1, "amount_cents": 1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "long sku",
            Call::order(key).body(json!({"sku": "x".repeat(65), "quantity": 1, "amount_cents": 1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "wrong type",
            Call::order(key).body(json!({"sku": "A", "quantity": "1", "amount_cents": 1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            // PostgreSQL's text cannot hold it: a client error on both backends.
            "U+0000 in the note",
            Call::order(key)
                .body(json!({"sku": "A", "quantity": 1, "amount_cents": 1, "note": "a\u{0}b"})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            // serde's derived structs take an array field by field; the schema
            // says object.
            "an array for the object",
            Call::order(key).body(json!(["A", 1, 1])),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "an array for the payment",
            payment(key, 1).body(json!([2_241_691])),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "a string for the object",
            Call::order(key).body(json!("A")),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            // Well-formed JSON (serde alone called it out of range, a 400).
            "a number too large for a double",
            Call {
                body: "1e999".into(),
                ..Call::order(key)
            },
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "a malformed array",
            Call {
                body: "[\"A\", 1,".into(),
                ..Call::order(key)
            },
            StatusCode::BAD_REQUEST,
        ),
        (
            // No byte but JSON whitespace: left to the deserialiser, malformed.
            "only whitespace",
            Call {
                body: " \r\n\t".into(),
                ..Call::order(key)
            },
            StatusCode::BAD_REQUEST,
        ),
        (
            "not JSON",
            Call {
                content_type: "text/plain",
                ..Call::order(key)
            },
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
    ];
    for (what, call, status) in cases {
        let a = call.ok(&server).await;
        a.expect_status(status, what);
        a.problem_type();
    }
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    let ok = Call::order(key).ok(&server).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(
        !ok.replayed(),
        "a fresh execution, not a replay and not a 422"
    );
    assert_eq!(orders(&db).await, 1);
    // The object check looks past JSON's whitespace, not only at the first byte.
    let spaced = Call {
        body: format!(" \r\n\t{}", Call::order("bad-2").body),
        ..Call::order("bad-2")
    }
    .ok(&server)
    .await;
    spaced.expect_status(StatusCode::CREATED, "an order after leading whitespace");
    assert_eq!(orders(&db).await, 2);
}

/// (10) Tenant and operation isolation over HTTP.
async fn tenants_and_operations_are_isolated<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let alice = Call {
        tenant: Some("alice"),
        ..Call::order("shared")
    }
    .ok(&server)
    .await;
    let bob = Call {
        tenant: Some("bob"),
        ..Call::order("shared")
    }
    .ok(&server)
    .await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice.json()["id"], bob.json()["id"]);
    assert_eq!(orders(&db).await, 2);
    // Each sees only its own orders and its own replay.
    let list: Vec<Value> =
        serde_json::from_slice(&get(&server, "/orders", "alice").await.body).unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], alice.json()["id"]);
    let bob_id = bob.json()["id"].as_i64().unwrap();
    assert_eq!(
        get(&server, &format!("/orders/{bob_id}"), "alice")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    let alice_again = Call {
        tenant: Some("alice"),
        ..Call::order("shared")
    }
    .ok(&server)
    .await;
    assert_eq!(alice_again.body, alice.body);
    // The same key on another operation is another request.
    let refund = Call {
        path: "/refunds",
        tenant: Some("alice"),
        currency: None,
        ..Call::order("shared")
    }
    .body(json!({"order_id": alice.json()["id"], "amount_cents": 500}))
    .ok(&server)
    .await;
    refund.expect_status(StatusCode::CREATED, "refund");
    assert!(!refund.replayed());
    assert_eq!(refund.json()["order_id"], alice.json()["id"]);
    assert_eq!(refund.json()["amount_cents"], 500);
}

/// A refund of an order the tenant does not have is a committed 404, replayed.
async fn a_refund_of_a_missing_order_is_a_stored_404<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let call = Call {
        path: "/refunds",
        currency: None,
        ..Call::order("r-1")
    }
    .body(json!({"order_id": 424242, "amount_cents": 5}));
    let first = call.ok(&server).await;
    assert_eq!(first.status, StatusCode::NOT_FOUND);
    assert_eq!(first.problem_type(), "urn:orders:problem:not-found");
    let again = call.ok(&server).await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["content-type"], "application/problem+json");
}

/// A duplicate beyond the in-flight bound: 409 problem with Retry-After.
async fn a_duplicate_beyond_the_wait_bound_is_409<D: Backend>() {
    let db = D::create().await;
    let server = Arc::new(
        Server::start(
            &db.url(),
            &[
                ("ORDERS_LATENCY_MS", "600000"),
                ("IDEM_IN_FLIGHT_WAIT_MS", "200"),
            ],
        )
        .await,
    );
    let first = tokio::spawn({
        let server = server.clone();
        async move { Call::order("slow-1").send(&server).await }
    });
    server.wait_until_executing(1).await;
    let dup = Call::order("slow-1").ok(&server).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(dup.problem_type(), "urn:idem:problem:request-in-flight");
    assert_eq!(dup.headers["retry-after"], "1");
    first.abort();
}

/// Keys: missing and malformed are 400 problems.
async fn missing_and_malformed_keys_are_400<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let missing = Call {
        key: None,
        ..Call::order("")
    }
    .ok(&server)
    .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.problem_type(),
        "urn:idem:problem:missing-idempotency-key"
    );
    let long = "k".repeat(256);
    for bad in ["\"open", long.as_str(), "two words"] {
        let a = Call::order(bad).ok(&server).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(
            a.problem_type(),
            "urn:idem:problem:malformed-idempotency-key"
        );
    }
    // The structured-field spelling of a key is the same key as its bare spelling.
    let bare = Call::order("sf-1").ok(&server).await;
    let quoted = Call::order("\"sf-1\"").ok(&server).await;
    assert!(quoted.replayed());
    assert_eq!(quoted.body, bare.body);
    assert_eq!(orders(&db).await, 1);
}

/// The read routes: list, get, delete, and 401 problem answers.
async fn read_and_delete_routes<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let created = Call::order("c-1")
        .body(json!({"sku": "B-2", "quantity": 1, "amount_cents": 0, "note": "gift"}))
        .ok(&server)
        .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let order = created.json();
    let id = order["id"].as_i64().unwrap();
    assert_eq!(created.headers["location"], format!("/orders/{id}"));
    for field in [
        "id",
        "sku",
        "quantity",
        "amount_cents",
        "currency",
        "note",
        "created_at",
    ] {
        assert!(order.get(field).is_some(), "missing {field}");
    }
    assert_eq!(order["currency"], "EUR");
    assert_eq!(order["note"], "gift");
    let fetched = get(&server, &format!("/orders/{id}"), "acme").await;
    assert_eq!(fetched.status, StatusCode::OK);
    assert_eq!(fetched.json(), order);
    let list = get(&server, "/orders", "acme").await;
    assert_eq!(list.json(), json!([order]));
    let unauth = reqwest::get(format!("{}/orders", server.base))
        .await
        .unwrap();
    assert_eq!(unauth.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(unauth.headers()["content-type"], "application/problem+json");
    assert_eq!(unauth.headers()["www-authenticate"], "Bearer");
    let client = reqwest::Client::new();
    let del = |id: i64| {
        client
            .delete(format!("{}/orders/{id}", server.base))
            .header("authorization", "Bearer acme")
            .send()
    };
    assert_eq!(del(id).await.unwrap().status(), StatusCode::NO_CONTENT);
    assert_eq!(del(id).await.unwrap().status(), StatusCode::NOT_FOUND);
}

fn payment(key: &str, amount: i64) -> Call<'_> {
    Call {
        path: "/payments",
        currency: None,
        ..Call::order(key)
    }
    .body(json!({"amount_cents": amount}))
}

async fn provider(server: &Server) -> Value {
    get(server, "/provider", "acme").await.json()
}

/// `/payments` (leased): a provider outage is retried within the policy's bound;
/// the client's own retry after recovery charges exactly once.
async fn payments_ride_out_an_outage_within_the_retry_bound<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[("PAYMENTS_PROVIDER_OUTAGE_CALLS", "6")]).await;
    let first = payment("pay-1", 500).ok(&server).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        first.problem_type(),
        "urn:orders:problem:provider-unavailable"
    );
    assert!(
        first.headers.contains_key("retry-after"),
        "every 503 says when to retry"
    );
    assert_eq!(
        provider(&server).await["calls"],
        4,
        "four attempts, no more"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0,
        "released"
    );
    let second = payment("pay-1", 500).ok(&server).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert_eq!(second.json()["amount_cents"], 500);
    assert_eq!(provider(&server).await, json!({"calls": 7, "charges": 1}));
    let replay = payment("pay-1", 500).ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, second.body);
    assert_eq!(provider(&server).await["calls"], 7);
}

/// `/payments`: the provider charges and times out; the row is uncertain, retries
/// never charge again, the reconciler finds the charge, and the retry replays it.
async fn an_uncertain_payment_is_reconciled_not_repeated<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(
        &db.url(),
        &[
            ("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE", "1"),
            ("PAYMENTS_RECONCILE_INTERVAL_MS", "50"),
        ],
    )
    .await;
    let first = payment("pay-2", 700).ok(&server).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.problem_type(), "urn:idem:problem:outcome-uncertain");
    wait_for(
        &db,
        "SELECT count(*) FROM idempotency_requests WHERE state = 'completed'",
        |n| n == 1,
    )
    .await;
    let retry = payment("pay-2", 700).ok(&server).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "ch_000001");
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
}

/// `/payments` across a crash: the provider charges and times out, the service
/// is killed (SIGKILL) before it reconciles, and the restarted service finds the
/// charge at the provider (which keeps its charges durably, like a real one): the
/// payment completes with that charge, and the provider is not called again.
async fn an_uncertain_payment_survives_a_crash_with_exactly_one_charge<D: Backend>() {
    let db = D::create().await;
    let mut server = Server::start(
        &db.url(),
        &[
            ("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE", "1"),
            // The reconciler's first round runs at start, before the payment;
            // the next one would come after the crash.
            ("PAYMENTS_RECONCILE_INTERVAL_MS", "3600000"),
        ],
    )
    .await;
    let first = payment("crash-pay", 900).ok(&server).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.problem_type(), "urn:idem:problem:outcome-uncertain");
    server.kill().await;
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests WHERE state = 'uncertain'")
            .await,
        1
    );

    let server = Server::start(&db.url(), &[("PAYMENTS_RECONCILE_INTERVAL_MS", "50")]).await;
    wait_for(
        &db,
        "SELECT count(*) FROM idempotency_requests WHERE state = 'completed'",
        |n| n == 1,
    )
    .await;
    let retry = payment("crash-pay", 900).ok(&server).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed(),
        "the reconciler stored the charge it found"
    );
    assert_eq!(retry.json()["id"], "ch_000001");
    assert_eq!(retry.json()["amount_cents"], 900);
    assert_eq!(
        provider(&server).await,
        json!({"calls": 0, "charges": 1}),
        "one charge, made before the crash; no call since"
    );
}

/// `/payments` killed mid-call: the provider has charged but not answered when
/// the service dies (SIGKILL). The restarted service takes the dead worker's
/// lapsed lease over and calls the provider again with the same downstream key;
/// the provider answers with the charge it made before the crash: one charge.
async fn a_payment_killed_mid_call_is_charged_once_after_the_restart<D: Backend>() {
    let db = D::create().await;
    let mut server = Server::start(
        &db.url(),
        &[("PAYMENTS_PROVIDER_LATENCY_AFTER_CHARGE_MS", "600000")],
    )
    .await;
    let base = server.base.clone();
    let in_flight = tokio::spawn(async move { payment("mid-pay", 800).send_to(&base).await });
    wait_for(&db, "SELECT count(*) FROM provider_charges", |n| n == 1).await;
    server.kill().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client sees the connection die"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests WHERE state = 'processing'")
            .await,
        1
    );
    // The dead worker's lease would lapse within its 30 s; lapse it now.
    db.exec(&format!(
        "UPDATE idempotency_requests SET lease_expires_at = {}",
        D::A_SECOND_AGO
    ))
    .await;

    let server = Server::start(&db.url(), &[]).await;
    let retry = payment("mid-pay", 800).ok(&server).await;
    retry.expect_status(StatusCode::CREATED, "retry");
    assert_eq!(
        retry.json()["id"],
        "ch_000001",
        "the charge made before the crash"
    );
    assert_eq!(
        provider(&server).await,
        json!({"calls": 1, "charges": 1}),
        "called again with the same key, charged once"
    );
    let replay = payment("mid-pay", 800).ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

/// `/payments`: a declined card is a stored business rejection.
async fn a_declined_payment_is_stored_and_replayed<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let first = payment("pay-3", 2_000_000).ok(&server).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(first.problem_type(), "urn:orders:problem:card-declined");
    let again = payment("pay-3", 2_000_000).ok(&server).await;
    assert!(again.replayed());
    assert_eq!(again.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(provider(&server).await["calls"], 0);
}

/// On SQLite a step waits for the database's one write lock; held elsewhere past
/// the busy timeout (5 s), the answer is a `503` with `Retry-After` and nothing
/// changes, and once the lock is free the same step goes through.
#[tokio::test]
async fn on_sqlite_a_step_behind_a_held_write_lock_is_503_then_succeeds() {
    let db = SqliteDb::new().await;
    let server = Server::start(&db.url(), &[]).await;
    let id = Call::order("busy-1").ok(&server).await.json()["id"]
        .as_i64()
        .unwrap();
    let holder = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let busy = step(&server, id, "pay").await;
    busy.expect_status(StatusCode::SERVICE_UNAVAILABLE, "busy");
    assert_eq!(busy.problem_type(), "urn:orders:problem:busy");
    assert_eq!(busy.headers["retry-after"], "1");
    // Deleting waits for it as well, and is answered the same way (it was
    // an undeclared `500`).
    let delete = || {
        reqwest::Client::new()
            .delete(format!("{}/orders/{id}", server.base))
            .header("authorization", "Bearer acme")
            .send()
    };
    let refused = delete().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "urn:orders:problem:busy");
    holder.rollback().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM order_payments").await, 0);
    let paid = step(&server, id, "pay").await;
    assert_eq!(paid.status, StatusCode::OK);
    assert_eq!(paid.json()["changed"], true);
    assert_eq!(db.count("SELECT count(*) FROM order_payments").await, 1);
    assert_eq!(delete().await.unwrap().status(), StatusCode::NO_CONTENT);
}

/// On SQLite a new key waits for the database's one write lock too; held by a
/// writer of something else past the busy timeout (5 s), the answer is idem's
/// own `503 store-busy` with `Retry-After: 1`, not a duplicate in flight, and
/// nothing is reserved: once the lock is free the same key executes, once.
#[tokio::test]
async fn on_sqlite_a_new_key_behind_another_writer_is_503_store_busy_and_reserves_nothing() {
    let db = SqliteDb::new().await;
    let server = Server::start(&db.url(), &[]).await;
    let rows = db.count("SELECT count(*) FROM idempotency_requests").await;
    let holder = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let busy = Call::order("busy-new-1").ok(&server).await;
    busy.expect_status(StatusCode::SERVICE_UNAVAILABLE, "busy");
    assert_eq!(busy.problem_type(), "urn:idem:problem:store-busy");
    assert_eq!(busy.headers["retry-after"], "1");
    assert_eq!(busy.headers["content-type"], "application/problem+json");
    holder.rollback().await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        rows,
        "nothing reserved"
    );
    let created = Call::order("busy-new-1").ok(&server).await;
    assert_eq!(created.status, StatusCode::CREATED);
    assert!(!created.replayed());
    assert_eq!(orders(&db).await, 1);
}

/// A directory of its own for one test, removed at its end.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = std::env::temp_dir().join(format!("idem_e2e_{}_{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The quickstart: with no `DATABASE_URL` the example keeps its data in an
/// embedded SQLite file in the working directory, says where, and finds it again
/// after a crash and restart.
#[tokio::test]
async fn without_database_url_the_example_uses_an_embedded_sqlite_file() {
    let dir = TempDir::new();
    let start = || {
        let mut cmd = Command::new(common::example_binary("orders"));
        cmd.env_remove("DATABASE_URL").current_dir(&dir.0);
        Server::spawn(cmd, &[])
    };
    let mut server = start().await;
    let file = dir.0.join("idem-orders.db");
    server
        .wait_for_log(&format!("using the SQLite database {}", file.display()), 1)
        .await;
    let first = Call::order("quick-1").ok(&server).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(file.exists(), "{} was not created", file.display());
    server.kill().await;

    let server = start().await;
    let retry = Call::order("quick-1").ok(&server).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the key survived the restart");
    assert_eq!(retry.body, first.body);
    let list = get(&server, "/orders", "acme").await.json();
    assert_eq!(list.as_array().map(Vec::len), Some(1));
}

/// Runs the example with `env` (and `IDEM_ADDR`, `NO_COLOR`) until it exits,
/// as it must within 60 s for a setting it cannot use: whether it exited
/// successfully, and what it logged.
async fn startup_failure(env: &[(&str, &str)]) -> (bool, String) {
    let mut command = Command::new(common::example_binary("orders"));
    command.env("IDEM_ADDR", "127.0.0.1:0").env("NO_COLOR", "1");
    for (name, value) in env {
        command.env(name, value);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("the example exits within 60 s")
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A key ring the example cannot use stops it at start, naming what is wrong
/// and never a key's bytes.
#[tokio::test]
async fn an_unusable_key_ring_is_a_clear_startup_error() {
    let db = SqliteDb::new().await;
    let url = format!("sqlite://{}", db.path.display());
    let (k1, k2) = (
        "k1:MTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTE=",
        "k2:MjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjI=",
    );
    let two = format!("{k1},{k2}");
    let twice = format!("{k1},{k1}");
    for (ring, active, says) in [
        ("k1:c2hvcnQ=", "", "the key \"k1\" is 5 bytes long"),
        (two.as_str(), "", "names none active"),
        (
            two.as_str(),
            "k9",
            "the active key \"k9\" is not in the key ring",
        ),
        (twice.as_str(), "k1", "the key id \"k1\" appears twice"),
        ("k1:not base64!", "", "the key \"k1\" is not base64"),
    ] {
        let (success, text) = startup_failure(&[
            ("DATABASE_URL", &url),
            ("IDEM_KEY_RING", ring),
            ("IDEM_ACTIVE_KEY", active),
        ])
        .await;
        assert!(!success, "{ring}: exited successfully");
        assert!(text.contains("cannot use IDEM_KEY_RING"), "{text}");
        assert!(text.contains(says), "expected {says:?} in\n{text}");
        assert!(
            !text.contains("MTExMTEx"),
            "a key's bytes were logged:\n{text}"
        );
    }
}

/// A background task's interval of 0 (a tight loop) stops the example at
/// start, naming the variable.
#[tokio::test]
async fn an_interval_of_zero_is_a_clear_startup_error() {
    let db = SqliteDb::new().await;
    let url = format!("sqlite://{}", db.path.display());
    for name in ["PAYMENTS_RECONCILE_INTERVAL_MS", "IDEM_SWEEP_INTERVAL_MS"] {
        let (success, text) = startup_failure(&[("DATABASE_URL", &url), (name, "0")]).await;
        assert!(!success, "{name}=0: exited successfully");
        assert!(
            text.contains(&format!(
                "{name} is 0; an interval of at least 1 ms is needed"
            )),
            "{text}"
        );
    }
}

/// A `DATABASE_URL` the example cannot use stops it at once with a clear error.
#[tokio::test]
async fn an_unusable_database_url_is_a_clear_startup_error() {
    for (url, says) in [
        (
            "redis://root@localhost/0",
            "DATABASE_URL must start with postgres://",
        ),
        // A MySQL server that answers, without the database: the reason, not the
        // URL (which may hold a password).
        (
            "mysql://root@127.0.0.1:3306/idem_no_such_database",
            "cannot connect to DATABASE_URL",
        ),
        (
            "sqlite:/nonexistent-dir/x/y.db",
            "cannot open the SQLite database",
        ),
        ("sqlite::memory:", "in-memory SQLite database"),
        ("sqlite:", "names no SQLite file"),
        (
            "sqlite://orders.db?mode=memory",
            "in-memory SQLite database",
        ),
    ] {
        let (success, text) = startup_failure(&[("DATABASE_URL", url)]).await;
        assert!(!success, "{url}: exited successfully");
        assert!(text.contains(says), "{url}: expected {says:?} in\n{text}");
        assert!(
            !text.contains("root@"),
            "{url}: the URL's credentials were logged"
        );
    }
}

/// `/metrics` serves the idem metrics in the Prometheus format.
async fn metrics_are_served_for_prometheus<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    Call::order("m-1").ok(&server).await;
    Call::order("m-1").ok(&server).await;
    let text = String::from_utf8(get(&server, "/metrics", "acme").await.body).unwrap();
    for line in [
        r#"idem_claims_total{operation="create-order",outcome="executed"} 1"#,
        r#"idem_claims_total{operation="create-order",outcome="replayed"} 1"#,
        r#"idem_completions_total{operation="create-order",outcome="stored"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
    }
    assert!(text.contains("idem_claim_seconds"));
    assert!(!text.contains("m-1"), "never the key");
}

/// The service's sweeper forgets expired keys; a retry after the sweep executes anew.
async fn the_sweeper_forgets_expired_keys<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[("IDEM_SWEEP_INTERVAL_MS", "50")]).await;
    let first = Call::order("sw-1").ok(&server).await;
    let live = Call::order("sw-2").ok(&server).await;
    assert_eq!(first.status, StatusCode::CREATED);
    db.exec(&format!(
        "UPDATE idempotency_requests SET expires_at = {} WHERE key_digest = {}",
        D::A_SECOND_AGO,
        db.key("sw-1")
    ))
    .await;
    wait_for(
        &db,
        &format!(
            "SELECT count(*) FROM idempotency_requests WHERE key_digest = {}",
            db.key("sw-1")
        ),
        |n| n == 0,
    )
    .await;
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM idempotency_requests WHERE key_digest = {}",
            db.key("sw-2")
        ))
        .await,
        1,
        "unexpired rows stay"
    );
    let again = Call::order("sw-1").ok(&server).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
    assert!(Call::order("sw-2").ok(&server).await.replayed());
    assert_eq!(live.status, StatusCode::CREATED);
    assert_eq!(orders(&db).await, 3);
}

async fn step(server: &Server, id: i64, action: &str) -> Answer {
    let resp = reqwest::Client::new()
        .post(format!("{}/orders/{id}/{action}", server.base))
        .header("authorization", "Bearer acme")
        .send()
        .await
        .unwrap();
    Answer {
        status: resp.status(),
        headers: resp.headers().clone(),
        body: resp.bytes().await.unwrap().to_vec(),
    }
}

/// Fulfilment steps: repeated `pay` is a no-op success, `ship` before `pay` is
/// rejected, concurrent `pay` calls produce one payment.
async fn fulfilment_steps_are_idempotent_transitions<D: Backend>() {
    let db = D::create().await;
    let server = Arc::new(Server::start(&db.url(), &[]).await);
    let id = Call::order("f-1").ok(&server).await.json()["id"]
        .as_i64()
        .unwrap();
    let early = step(&server, id, "ship").await;
    assert_eq!(early.status, StatusCode::CONFLICT);
    assert_eq!(
        early.problem_type(),
        "urn:orders:problem:invalid-transition"
    );
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (server, barrier) = (server.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            step(&server, id, "pay").await
        }));
    }
    let mut changed = 0;
    for t in tasks {
        let a = t.await.unwrap();
        a.expect_status(StatusCode::OK, "a concurrent pay");
        assert_eq!(a.json()["status"], "paid");
        changed += usize::from(a.json()["changed"] == true);
    }
    assert_eq!(changed, 1);
    assert_eq!(db.count("SELECT count(*) FROM order_payments").await, 1);
    assert_eq!(step(&server, id, "ship").await.json()["changed"], true);
    assert_eq!(step(&server, id, "ship").await.json()["changed"], false);
    assert_eq!(
        step(&server, id, "pay").await.status,
        StatusCode::CONFLICT,
        "paid is behind shipped"
    );
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 1);
    assert_eq!(
        step(&server, 999_999, "pay").await.status,
        StatusCode::NOT_FOUND
    );
    // The existing contract is unchanged: GET /orders/{id} has the same fields.
    let order = get(&server, &format!("/orders/{id}"), "acme").await.json();
    assert!(order.get("status").is_none());
}

// The server's edges: what reaches the example before, around
// and after its handlers.

/// `host:port` of a running server.
fn addr(server: &Server) -> String {
    server.base.trim_start_matches("http://").to_owned()
}

/// Reads until the peer closes the connection (EOF or a reset): what it sent
/// before, or `None` if it is still open after `ceiling`.
async fn until_closed(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
    ceiling: Duration,
) -> Option<Vec<u8>> {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    let mut buf = Vec::new();
    match tokio::time::timeout(ceiling, stream.read_to_end(&mut buf)).await {
        Ok(Ok(_)) => Some(buf),
        Ok(Err(e)) if matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe) => {
            Some(buf)
        }
        Ok(Err(e)) => panic!("reading from the server: {e}"),
        Err(_) => None,
    }
}

/// A configured header timeout far below the tests' ceilings: the server must
/// close within it, and the tests wait a hundred times longer before they fail.
const HEADER_TIMEOUT_MS: &str = "500";
const CLOSE_CEILING: Duration = Duration::from_secs(60);

/// Connections that never finish their request head (half a head, or nothing at
/// all) are closed after the header timeout, even when they are more than the
/// process has descriptors for: a real request gets in while they are held, and
/// every one of them is closed.
#[tokio::test]
async fn half_sent_and_silent_connections_are_closed_and_never_lock_others_out() {
    let db = SqliteDb::new().await;
    let mut cmd = Command::new(common::example_binary("orders"));
    cmd.env("DATABASE_URL", Backend::url(&db));
    // 128 descriptors: fewer than the connections below, so without a timeout
    // the held connections would leave none for the real request.
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 128,
                rlim_max: 128,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let server = Server::spawn(cmd, &[("ORDERS_HEADER_TIMEOUT_MS", HEADER_TIMEOUT_MS)]).await;
    let mut held = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(addr(&server)).await.unwrap();
        if i % 2 == 0 {
            s.write_all(b"POST /orders HTTP/1.1\r\nhost: x\r\ncontent-type: applic")
                .await
                .unwrap();
        }
        held.push(s);
    }
    let real = Call::order("held-1").ok(&server).await;
    assert_eq!(real.status, StatusCode::CREATED);
    for (i, s) in held.iter_mut().enumerate() {
        assert!(
            until_closed(s, CLOSE_CEILING).await.is_some(),
            "held connection {i} is still open after {CLOSE_CEILING:?}"
        );
    }
    assert_eq!(
        Call::order("held-2").ok(&server).await.status,
        StatusCode::CREATED
    );
}

/// A keep-alive connection that idles after its answer is closed after the
/// header timeout too.
#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed() {
    let db = SqliteDb::new().await;
    let server = Server::start(
        &db.url(),
        &[("ORDERS_HEADER_TIMEOUT_MS", HEADER_TIMEOUT_MS)],
    )
    .await;
    let mut s = TcpStream::connect(addr(&server)).await.unwrap();
    s.write_all(b"GET /provider HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acme\r\n\r\n")
        .await
        .unwrap();
    let sent = until_closed(&mut s, CLOSE_CEILING)
        .await
        .expect("the idle connection is closed");
    let text = String::from_utf8_lossy(&sent);
    assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    assert!(
        !text.contains("connection: close"),
        "kept alive, then timed out: {text}"
    );
}

/// A client that sends its requests and never reads the answers: once the
/// answers fill the socket's buffers, the server's writes stall, and after the
/// write timeout the server closes the connection (and says so) instead of
/// holding it, and its answers, for as long as the client likes. Each answer
/// here is a list of 3 MiB of orders; ten of them pipelined are far more than
/// the kernel buffers (the client's receive buffer is made small).
#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_write_timeout() {
    let db = SqliteDb::new().await;
    let server = Server::start(&db.url(), &[("ORDERS_WRITE_TIMEOUT_MS", "500")]).await;
    for i in 0..8 {
        let note = "n".repeat(400 * 1024);
        let order = Call::order(&format!("stall-{i}"))
            .body(json!({"sku": "A-1", "quantity": 1, "amount_cents": 1, "note": note}))
            .ok(&server)
            .await;
        assert_eq!(order.status, StatusCode::CREATED);
    }
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket
        .connect(addr(&server).parse().unwrap())
        .await
        .unwrap();
    let requests =
        "GET /orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acme\r\n\r\n".repeat(10);
    stalled.write_all(requests.as_bytes()).await.unwrap();
    server.wait_for_log("stopped reading its answer", 1).await;
    let sent = until_closed(&mut stalled, CLOSE_CEILING)
        .await
        .expect("the server closed the stalled connection");
    let answers = String::from_utf8_lossy(&sent)
        .matches("HTTP/1.1 200 ")
        .count();
    assert!(
        answers < 10,
        "cut off before its answers were all sent: {answers}"
    );
    assert_eq!(
        get(&server, "/provider", "acme").await.status,
        StatusCode::OK,
        "the service serves others"
    );
}

/// At `ORDERS_MAX_CONNECTIONS` the service stops accepting (and says so): a
/// further connection waits in the listen backlog, unanswered, until a
/// connection closes; then it is served.
#[tokio::test]
async fn connections_over_the_cap_wait_until_one_closes() {
    let db = SqliteDb::new().await;
    let server = Server::start(
        &db.url(),
        &[
            ("ORDERS_MAX_CONNECTIONS", "2"),
            // The held connections stay open as long as the test holds them.
            ("ORDERS_HEADER_TIMEOUT_MS", "600000"),
        ],
    )
    .await;
    let held_1 = TcpStream::connect(addr(&server)).await.unwrap();
    let _held_2 = TcpStream::connect(addr(&server)).await.unwrap();
    server.wait_for_log("connections open, the cap", 1).await;
    let mut third = tokio::spawn({
        let base = server.base.clone();
        async move {
            reqwest::Client::new()
                .get(format!("{base}/provider"))
                .header("authorization", "Bearer acme")
                .send()
                .await
                .map(|r| r.status())
        }
    });
    // A negative: nothing can answer it while two connections are open (the
    // accept loop waits for a slot), so this wait can only pass wrongly.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut third)
            .await
            .is_err(),
        "the third connection was served while the cap was reached"
    );
    drop(held_1);
    let status = tokio::time::timeout(CLOSE_CEILING, third)
        .await
        .expect("served once a connection closed")
        .unwrap()
        .unwrap();
    assert_eq!(status, StatusCode::OK);
}

/// What hyper refuses before any service code runs gets hyper's own answer: a
/// bare status with no body, and the connection closed (docs/example-service.md
/// says why it stays so, and what to put in front): an unparseable request line
/// is `400`, a head over 256 KiB `431`. Nothing is claimed.
#[tokio::test]
async fn what_hyper_refuses_before_the_service_is_a_bare_status_and_a_close() {
    let db = SqliteDb::new().await;
    let server = Server::start(&db.url(), &[]).await;
    let mut garbage = TcpStream::connect(addr(&server)).await.unwrap();
    garbage
        .write_all(b"NOT AN HTTP REQUEST LINE\r\n\r\n")
        .await
        .unwrap();
    let sent = until_closed(&mut garbage, CLOSE_CEILING)
        .await
        .expect("closed");
    let text = String::from_utf8_lossy(&sent).to_lowercase();
    assert!(text.starts_with("http/1.1 400 bad request\r\n"), "{text}");
    assert!(text.contains("content-length: 0\r\n"), "{text}");
    assert!(!text.contains("content-type"), "{text}");

    let (mut read, mut write) = TcpStream::connect(addr(&server))
        .await
        .unwrap()
        .into_split();
    let writer = tokio::spawn(async move {
        let head = format!(
            "POST /orders HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\n\r\n",
            "f".repeat(300 * 1024)
        );
        // Fails once the server has answered and closed: expected.
        let _ = write.write_all(head.as_bytes()).await;
    });
    let sent = until_closed(&mut read, CLOSE_CEILING)
        .await
        .expect("closed");
    writer.abort();
    let text = String::from_utf8_lossy(&sent).to_lowercase();
    assert!(
        text.starts_with("http/1.1 431 request header fields too large\r\n"),
        "{text}"
    );
    assert!(!text.contains("content-type"), "{text}");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

/// A request whose body stops half-way is answered `408` problem+json and closed,
/// and claims nothing.
async fn a_half_sent_body_is_408<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(
        &db.url(),
        &[
            ("ORDERS_HEADER_TIMEOUT_MS", HEADER_TIMEOUT_MS),
            ("ORDERS_BODY_TIMEOUT_MS", "500"),
        ],
    )
    .await;
    let mut s = TcpStream::connect(addr(&server)).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acme\r\n\
          content-type: application/json\r\nx-currency: EUR\r\nidempotency-key: slow-1\r\n\
          content-length: 100\r\n\r\n{\"sku\":",
    )
    .await
    .unwrap();
    let sent = until_closed(&mut s, CLOSE_CEILING)
        .await
        .expect("the connection with a half-sent body is closed");
    let text = String::from_utf8_lossy(&sent);
    assert!(text.starts_with("HTTP/1.1 408 "), "{text}");
    assert!(text.contains("application/problem+json"), "{text}");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

/// `SIGTERM` (and `SIGINT`, Ctrl-C) stop accepting, let the request in flight
/// finish, and exit 0.
#[tokio::test]
async fn sigterm_and_sigint_drain_the_request_in_flight_and_exit_0() {
    for (name, signal) in [("SIGTERM", libc::SIGTERM), ("SIGINT", libc::SIGINT)] {
        let db = SqliteDb::new().await;
        let hold = Hold::new();
        let mut server = Server::start(&db.url(), &[hold.env()]).await;
        let base = server.base.clone();
        let in_flight = tokio::spawn(async move { Call::order("drain-1").send_to(&base).await });
        server.wait_until_executing(1).await;
        let pid = i32::try_from(server.child.id().expect("running")).unwrap();
        // SAFETY: kill(2) on the child this test started and still owns.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        // The signal is taken while the request is held: the server drains.
        server.wait_for_log("orders: shutting down", 1).await;
        assert!(!in_flight.is_finished(), "{name}: answered while held");
        assert!(
            server.child.try_wait().unwrap().is_none(),
            "{name}: exited with a request in flight"
        );
        hold.release();
        let answer = in_flight
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{name}: the request in flight was cut: {e}"));
        assert_eq!(answer.status, StatusCode::CREATED, "{name}");
        let status = tokio::time::timeout(Duration::from_secs(60), server.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{name}: the server did not exit within 60 s"))
            .unwrap();
        assert!(status.success(), "{name}: exited with {status}");
        assert_eq!(orders(&db).await, 1, "{name}");
    }
}

/// `SIGTERM` also waits for work whose client has gone: idem runs claimed work
/// on, so that the client's retry finds it done; the service waits for it before
/// it exits, and the order is there.
#[tokio::test]
async fn sigterm_waits_for_work_whose_client_has_gone() {
    let db = SqliteDb::new().await;
    let hold = Hold::new();
    let mut server = Server::start(&db.url(), &[hold.env()]).await;
    let base = server.base.clone();
    let client = tokio::spawn(async move { Call::order("gone-1").send_to(&base).await });
    server.wait_until_executing(1).await;
    // The client disconnects: its connection closes, its work goes on.
    client.abort();
    assert!(client.await.is_err_and(|e| e.is_cancelled()));
    let pid = i32::try_from(server.child.id().expect("running")).unwrap();
    // SAFETY: kill(2) on the child this test started and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    // Draining, and the held work keeps it from exiting until it is let go.
    server.wait_for_log("orders: shutting down", 1).await;
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "exited while the work ran"
    );
    hold.release();
    let status = tokio::time::timeout(Duration::from_secs(60), server.child.wait())
        .await
        .expect("the server exits within 60 s")
        .unwrap();
    assert!(status.success(), "exited with {status}");
    assert_eq!(
        orders(&db).await,
        1,
        "the work was finished before the exit"
    );
}

/// A body over the limit is `413` problem+json, claims nothing and consumes no
/// id; the largest body accepted gives an answer idem can store (its limits
/// agree), so it is replayed like any other.
async fn a_body_over_the_limit_is_413_and_every_accepted_answer_is_stored<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let order = |key, note: String| {
        Call::order(key).body(json!({"sku": "A-1", "quantity": 1, "amount_cents": 1, "note": note}))
    };
    for (key, size) in [("big-1", 1100 * 1024), ("big-2", 3 * 1024 * 1024)] {
        let over = oversized_order(&server, key, size).await;
        assert!(over.starts_with("HTTP/1.1 413 "), "{size} bytes: {over}");
        assert!(over.contains("application/problem+json"), "{over}");
    }
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    let within = order("big-3", "n".repeat(500 * 1024)).ok(&server).await;
    assert_eq!(within.status, StatusCode::CREATED);
    assert_eq!(
        within.json()["id"],
        1,
        "no id was consumed by the refused bodies"
    );
    let replay = order("big-3", "n".repeat(500 * 1024)).ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, within.body);
}

/// The answer to an order whose `note` is `size` bytes long, sent over a raw
/// connection that writes the body while it reads: the server may answer a body
/// over its limit (and close) before the body is all sent, and a client that
/// reads only after writing everything would see a broken pipe, not the answer.
async fn oversized_order(server: &Server, key: &str, size: usize) -> String {
    let body = json!({"sku": "A-1", "quantity": 1, "amount_cents": 1, "note": "n".repeat(size)})
        .to_string();
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acme\r\n\
         content-type: application/json\r\nx-currency: EUR\r\nidempotency-key: {key}\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let (mut read, mut write) = TcpStream::connect(addr(server)).await.unwrap().into_split();
    let writer = tokio::spawn(async move {
        // Fails once the server has answered and closed: expected.
        let _ = write.write_all(head.as_bytes()).await;
        let _ = write.write_all(body.as_bytes()).await;
    });
    let answer = until_closed(&mut read, CLOSE_CEILING)
        .await
        .expect("the server answers and closes");
    writer.abort();
    String::from_utf8_lossy(&answer).into_owned()
}

/// `Content-Type` is parsed as a media type: its type and subtype are
/// case-insensitive and may carry parameters; another subtype is `415`.
async fn the_content_type_is_parsed_as_a_media_type<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    for (i, ct) in [
        "APPLICATION/JSON",
        "application/json; charset=utf-8",
        "Application/Json ;charset=\"UTF-8\"",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("mt-{i}");
        let a = Call {
            content_type: ct,
            ..Call::order(&key)
        }
        .ok(&server)
        .await;
        a.expect_status(StatusCode::CREATED, ct);
    }
    for ct in [
        "application/jsonfoo",
        "application/json-seq",
        "text/json",
        "application/jsonx; charset=utf-8",
    ] {
        let a = Call {
            content_type: ct,
            ..Call::order("mt-bad")
        }
        .ok(&server)
        .await;
        assert_eq!(a.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct}");
        a.problem_type();
    }
    assert_eq!(orders(&db).await, 3);
}

/// What the HTTP layer refuses is problem+json too: a header block over the
/// service's limits (`431`), a path parameter that does not parse (`400`), an
/// unknown route (`404`) and a method a route does not have (`405`, its `Allow`
/// kept).
async fn http_layer_errors_are_problem_json<D: Backend>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let client = reqwest::Client::new();
    let answer = |r: reqwest::Response| async move {
        Answer {
            status: r.status(),
            headers: r.headers().clone(),
            body: r.bytes().await.unwrap().to_vec(),
        }
    };
    let big = client
        .get(format!("{}/orders", server.base))
        .header("authorization", "Bearer acme")
        .header("x-filler", "f".repeat(40 * 1024))
        .send()
        .await
        .unwrap();
    let big = answer(big).await;
    assert_eq!(big.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    big.problem_type();
    let mut many = client
        .get(format!("{}/orders", server.base))
        .header("authorization", "Bearer acme");
    for i in 0..150 {
        many = many.header(format!("x-h{i}"), "v");
    }
    let many = answer(many.send().await.unwrap()).await;
    assert_eq!(many.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    many.problem_type();

    let bad_id = get(&server, "/orders/abc", "acme").await;
    assert_eq!(bad_id.status, StatusCode::BAD_REQUEST);
    bad_id.problem_type();
    let unknown = get(&server, "/nowhere", "acme").await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    unknown.problem_type();
    let put = client
        .put(format!("{}/orders", server.base))
        .header("authorization", "Bearer acme")
        .send()
        .await
        .unwrap();
    let put = answer(put).await;
    assert_eq!(put.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(put.headers.contains_key("allow"));
    put.problem_type();
    // The service's own answers are untouched.
    assert_eq!(get(&server, "/orders", "acme").await.status, StatusCode::OK);
    assert_eq!(orders(&db).await, 0);
}

/// A TCP proxy in front of PostgreSQL that the test can cut: every connection
/// through it is dropped, and new ones are closed as soon as they arrive, until
/// it is mended.
struct CuttableProxy {
    addr: std::net::SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
}

impl CuttableProxy {
    async fn to(upstream: String) -> CuttableProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if *cut_rx.borrow() {
                    continue; // dropped: closed at once
                }
                let upstream = upstream.clone();
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_rx.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        CuttableProxy { addr, cut }
    }
}

/// During a database outage every route answers `503` problem+json with
/// `Retry-After`: a handler's own query (`GET`, a transition) as idem's store
/// failure (`POST` with a key) does; once the database is back, requests succeed.
#[tokio::test]
async fn on_postgres_a_database_outage_is_503_with_retry_after() {
    let db = TestDb::new().await;
    // postgres://user@host:port/db?params: route host:port through the proxy.
    let url = Backend::url(&db);
    let after_scheme = url.find("://").unwrap() + 3;
    let authority_end = url[after_scheme..]
        .find('/')
        .map_or(url.len(), |i| after_scheme + i);
    let host_start = url[after_scheme..authority_end]
        .rfind('@')
        .map_or(after_scheme, |i| after_scheme + i + 1);
    let mut upstream = url[host_start..authority_end].to_owned();
    if !upstream.contains(':') {
        upstream.push_str(":5432");
    }
    let proxy = CuttableProxy::to(upstream).await;
    let through = format!(
        "{}{}{}",
        &url[..host_start],
        proxy.addr,
        &url[authority_end..]
    );
    let mut cmd = Command::new(common::example_binary("orders"));
    cmd.env("DATABASE_URL", through);
    let server = Server::spawn(cmd, &[]).await;
    let id = Call::order("before").ok(&server).await.json()["id"]
        .as_i64()
        .unwrap();

    proxy.cut.send_replace(true);
    let unavailable = |a: &Answer, what: &str| {
        a.expect_status(StatusCode::SERVICE_UNAVAILABLE, what);
        assert!(
            a.headers.contains_key("retry-after"),
            "{what}: no Retry-After"
        );
        assert_eq!(
            a.problem_type(),
            "urn:idem:problem:store-unavailable",
            "{what}"
        );
    };
    unavailable(&get(&server, "/orders", "acme").await, "GET /orders");
    unavailable(&step(&server, id, "pay").await, "POST /orders/{id}/pay");
    unavailable(&Call::order("during").ok(&server).await, "POST /orders");

    proxy.cut.send_replace(false);
    let after = Call::order("during").ok(&server).await;
    assert_eq!(
        after.status,
        StatusCode::CREATED,
        "the same key executes once the database is back"
    );
    assert_eq!(orders(&db).await, 2);
}

/// A `POST /exports` with `key`: a long operation.
fn export(key: &str) -> Call<'_> {
    Call {
        path: "/exports",
        currency: None,
        ..Call::order(key)
    }
    .body(json!({"format": "csv"}))
}

/// Waits until the operation at `location` says `status`.
async fn until_operation(server: &Server, location: &str, status: &str) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let a = get(server, location, "acme").await;
        a.expect_status(StatusCode::OK, location);
        if a.json()["status"] == status {
            return a;
        }
        assert!(Instant::now() < deadline, "never {status}: {}", a.json());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/exports`, a long operation: `202` at once with the operation's resource,
/// the same `202` to a retry, another tenant's `404`; the process killed
/// mid-export, the resource says `stalled` after the lease, a retry on the
/// restarted service takes the export over at the same address, and once done
/// the resource and every retry give its one stored `201`.
async fn a_long_export_answers_202_and_is_taken_over_after_a_kill<D: Backend>() {
    let db = D::create().await;
    let mut server = Server::start(&db.url(), &[("EXPORTS_DURATION_MS", "600000")]).await;
    let first = export("exp-1").ok(&server).await;
    first.expect_status(StatusCode::ACCEPTED, "first");
    let location = first.headers["location"].to_str().unwrap().to_owned();
    assert!(
        location.starts_with("/operations/create-export/"),
        "{location}"
    );
    assert!(!location.contains("exp-1"));
    assert_eq!(first.headers["retry-after"], "2");
    assert_eq!(first.json()["status"], "running");
    let again = export("exp-1").ok(&server).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::ACCEPTED, &first.body)
    );
    until_operation(&server, &location, "running").await;
    let theirs = get(&server, &location, "globex").await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    assert_eq!(
        theirs.problem_type(),
        "urn:idem:problem:operation-not-found"
    );
    let mismatch = export("exp-1")
        .body(json!({"format": "json"}))
        .ok(&server)
        .await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);

    server.kill().await;
    // The dead worker's lease would lapse within its 6 s; lapse it now.
    db.exec(&format!(
        "UPDATE idempotency_requests SET lease_expires_at = {}",
        D::A_SECOND_AGO
    ))
    .await;
    let server = Server::start(&db.url(), &[("EXPORTS_DURATION_MS", "0")]).await;
    until_operation(&server, &location, "stalled").await;
    let retry = export("exp-1").ok(&server).await;
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    assert_eq!(
        retry.headers["location"],
        location.as_str(),
        "the same address"
    );
    let done = until_operation(&server, &location, "succeeded").await;
    assert_eq!(done.json()["response_status"], 201);
    let result = get(&server, done.json()["result"].as_str().unwrap(), "acme").await;
    assert_eq!(result.status, StatusCode::CREATED);
    assert!(result.replayed());
    assert_eq!(result.json()["format"], "csv");
    let replay = export("exp-1").ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, result.body);
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2,
        "taken over once"
    );
}

/// Stamps each shared test once per backend: `postgres::<name>` and `sqlite::<name>`.
macro_rules! e2e_suite {
    ($($test:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<crate::common::TestDb>().await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<crate::common::SqliteDb>().await
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<crate::common::MySqlDb>().await
                }
            )*
        }
    };
}

e2e_suite!(
    concurrent_duplicates_create_one_order,
    same_key_different_payload_is_422,
    a_lost_response_is_replayed_on_retry,
    a_crash_before_commit_leaves_nothing_and_the_retry_executes,
    the_stored_result_matches_the_order_after_a_client_timeout,
    after_retention_a_retry_executes_anew,
    a_replay_after_delete_returns_the_stored_201,
    two_servers_one_database_one_order,
    rejected_input_reserves_nothing,
    tenants_and_operations_are_isolated,
    a_refund_of_a_missing_order_is_a_stored_404,
    a_duplicate_beyond_the_wait_bound_is_409,
    missing_and_malformed_keys_are_400,
    read_and_delete_routes,
    metrics_are_served_for_prometheus,
    the_sweeper_forgets_expired_keys,
    fulfilment_steps_are_idempotent_transitions,
    a_half_sent_body_is_408,
    a_body_over_the_limit_is_413_and_every_accepted_answer_is_stored,
    the_content_type_is_parsed_as_a_media_type,
    http_layer_errors_are_problem_json,
    payments_ride_out_an_outage_within_the_retry_bound,
    an_uncertain_payment_is_reconciled_not_repeated,
    an_uncertain_payment_survives_a_crash_with_exactly_one_charge,
    a_payment_killed_mid_call_is_charged_once_after_the_restart,
    a_declined_payment_is_stored_and_replayed,
    a_long_export_answers_202_and_is_taken_over_after_a_kill,
);

/// The example with `IDEM_KEY_RING` set: the stored answer holds none of the
/// order, and the retry gets the order byte for byte.
async fn answers_are_sealed_at_rest<D: Backend>() {
    let db = Sealed::<D>::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let first = Call::order("sealed-1").ok(&server).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let (status, body) = db.stored_outcome().await;
    assert_eq!(status, 201);
    assert!(
        !body.windows(12).any(|w| w == b"amount_cents"),
        "the stored body is the order in clear"
    );
    let retry = Call::order("sealed-1").ok(&server).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert_eq!(orders(&db).await, 1);
}

/// The scenarios whose behaviour encryption must not change, with every answer
/// sealed at rest (`IDEM_KEY_RING`), on SQLite and PostgreSQL.
macro_rules! sealed_suite {
    ($($test:ident),* $(,)?) => {
        mod sealed_postgres {
            #[tokio::test]
            async fn answers_are_sealed_at_rest() {
                super::answers_are_sealed_at_rest::<crate::common::TestDb>().await
            }
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<super::Sealed<crate::common::TestDb>>().await
                }
            )*
        }
        mod sealed_sqlite {
            #[tokio::test]
            async fn answers_are_sealed_at_rest() {
                super::answers_are_sealed_at_rest::<crate::common::SqliteDb>().await
            }
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<super::Sealed<crate::common::SqliteDb>>().await
                }
            )*
        }
    };
}

sealed_suite!(
    concurrent_duplicates_create_one_order,
    same_key_different_payload_is_422,
    a_lost_response_is_replayed_on_retry,
    a_crash_before_commit_leaves_nothing_and_the_retry_executes,
    after_retention_a_retry_executes_anew,
    a_replay_after_delete_returns_the_stored_201,
    two_servers_one_database_one_order,
    an_uncertain_payment_is_reconciled_not_repeated,
    a_declined_payment_is_stored_and_replayed,
    a_long_export_answers_202_and_is_taken_over_after_a_kill,
);

// --- `POST /payments` with its leases on Redis (`IDEM_LEASE_STORE`) ------------

/// The example on a fresh PostgreSQL database, its `/payments` leases on Redis
/// under a prefix of the test's own.
struct OnRedis {
    db: TestDb,
    prefix: String,
}

impl OnRedis {
    async fn new(test: &str) -> Self {
        let prefix = format!("idem-e2e{}-{test}", std::process::id());
        // What an earlier run with the same process id left.
        let mut c = redis::Client::open(Self::url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let old: Vec<String> = redis::AsyncCommands::keys(&mut c, format!("{prefix}:*"))
            .await
            .unwrap();
        for k in old {
            let _: () = redis::AsyncCommands::del(&mut c, k).await.unwrap();
        }
        OnRedis {
            db: TestDb::new().await,
            prefix,
        }
    }

    fn url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    async fn start(&self, env: &[(&str, &str)]) -> Server {
        let url = Self::url();
        let mut all = vec![
            ("IDEM_LEASE_STORE", url.as_str()),
            ("IDEM_LEASE_STORE_PREFIX", self.prefix.as_str()),
        ];
        all.extend_from_slice(env);
        Server::start(&self.db.url, &all).await
    }

    async fn store(&self) -> idem_runtime::redis::RedisLeaseStore {
        // (the example's own store under the same prefix)
        idem_runtime::redis::RedisLeaseStore::connect_with_prefix(&Self::url(), &self.prefix)
            .await
            .unwrap()
    }

    /// idem's SQL table stays empty: the leases are in Redis.
    async fn sql_rows(&self) -> i64 {
        self.db
            .count("SELECT count(*) FROM idempotency_requests")
            .await
    }
}

#[tokio::test]
async fn on_redis_a_duplicate_in_flight_is_409_and_a_paid_payment_replays() {
    let env = OnRedis::new("flight").await;
    // The charge is made, then the provider's answer is held: the lease is
    // held all along, until the duplicate has been refused.
    let hold = Hold::new();
    let server = env
        .start(&[hold.env_as("PAYMENTS_PROVIDER_HOLD_FILE")])
        .await;
    let base = server.base.clone();
    let first = tokio::spawn(async move { payment("r-pay-1", 500).send_to(&base).await });
    wait_for(&env.db, "SELECT count(*) FROM provider_charges", |n| n == 1).await;
    let dup = payment("r-pay-1", 500).ok(&server).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert!(dup.headers.contains_key("retry-after"));
    hold.release();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = payment("r-pay-1", 500).ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
    assert_eq!(env.sql_rows().await, 0, "the lease lived in Redis");
}

/// The same on a Redis Cluster (`.ci/redis-cluster`; `IDEM_TEST_REDIS_CLUSTER`
/// names other nodes): `IDEM_LEASE_STORE` with the nodes' URLs separated by
/// commas. A duplicate in flight is `409`, the payment replays, one charge,
/// and the lease lived in the cluster, not in the database.
#[tokio::test]
async fn on_a_redis_cluster_a_duplicate_in_flight_is_409_and_a_paid_payment_replays() {
    let nodes: Vec<String> = std::env::var("IDEM_TEST_REDIS_CLUSTER")
        .unwrap_or_else(|_| "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002".to_owned())
        .split(',')
        .map(|n| format!("redis://{}", n.trim()))
        .collect();
    let urls = nodes.join(",");
    let db = TestDb::new().await;
    let prefix = format!("idem-e2ec{}", std::process::id());
    let hold = Hold::new();
    let server = Server::start(
        &db.url,
        &[
            ("IDEM_LEASE_STORE", urls.as_str()),
            ("IDEM_LEASE_STORE_PREFIX", prefix.as_str()),
            hold.env_as("PAYMENTS_PROVIDER_HOLD_FILE"),
        ],
    )
    .await;
    let base = server.base.clone();
    let first = tokio::spawn(async move { payment("c-pay-1", 500).send_to(&base).await });
    wait_for(&db, "SELECT count(*) FROM provider_charges", |n| n == 1).await;
    let dup = payment("c-pay-1", 500).ok(&server).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    hold.release();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = payment("c-pay-1", 500).ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0,
        "the lease lived in the cluster"
    );
}

#[tokio::test]
async fn on_redis_a_payment_killed_mid_call_is_charged_once_after_the_restart() {
    let env = OnRedis::new("killed").await;
    let mut server = env
        .start(&[("PAYMENTS_PROVIDER_LATENCY_AFTER_CHARGE_MS", "600000")])
        .await;
    let base = server.base.clone();
    let in_flight = tokio::spawn(async move { payment("r-mid-pay", 800).send_to(&base).await });
    wait_for(&env.db, "SELECT count(*) FROM provider_charges", |n| n == 1).await;
    server.kill().await;
    assert!(in_flight.await.unwrap().is_err());
    // The dead worker's lease would lapse within its 30 s; lapse it now.
    let store = env.store().await;
    let mut c = store.redis_connection();
    // Its one record (named by the key's digest: found by its prefix).
    let records: Vec<String> = redis::AsyncCommands::keys(&mut c, format!("{}:*:r:*", env.prefix))
        .await
        .unwrap();
    let [record] = &records[..] else {
        panic!("one record expected: {records:?}")
    };
    let state: String = redis::AsyncCommands::hget(&mut c, record, "state")
        .await
        .unwrap();
    assert_eq!(state, "processing");
    let _: () = redis::AsyncCommands::hset(&mut c, record, "lease_until", 0)
        .await
        .unwrap();

    let server = env.start(&[]).await;
    let retry = payment("r-mid-pay", 800).ok(&server).await;
    retry.expect_status(StatusCode::CREATED, "retry");
    assert_eq!(
        retry.json()["id"],
        "ch_000001",
        "the charge made before the crash"
    );
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
    let replay = payment("r-mid-pay", 800).ok(&server).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

#[tokio::test]
async fn on_redis_an_uncertain_payment_is_reconciled_not_repeated() {
    let env = OnRedis::new("uncertain").await;
    let server = env
        .start(&[
            ("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE", "1"),
            ("PAYMENTS_RECONCILE_INTERVAL_MS", "50"),
        ])
        .await;
    let first = payment("r-pay-2", 700).ok(&server).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.problem_type(), "urn:idem:problem:outcome-uncertain");
    // Until the Redis reconciler resolves it, retries answer 202 and charge nothing.
    let deadline = Instant::now() + Duration::from_secs(60);
    let retry = loop {
        let a = payment("r-pay-2", 700).ok(&server).await;
        if a.status != StatusCode::ACCEPTED {
            break a;
        }
        assert!(Instant::now() < deadline, "never reconciled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "ch_000001");
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
}
