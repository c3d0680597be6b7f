//! idem-client end to end: the real `orders` example process on PostgreSQL, called
//! through `IdempotencyMiddleware` over real HTTP. A recording middleware placed
//! after it sees every attempt, so each test can assert which answers were
//! retried.
//!
//! The example binaries are built by `cargo test --workspace`; run
//! `cargo build --example orders --example client` first when running this file
//! alone.

mod common;
#[path = "common/orders.rs"]
mod orders;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::TestDb;
use idem_client::{
    ErrorExt, IdemOutcome, IdempotencyKey, IdempotencyMiddleware, LastAnswer, Limit, ResponseExt,
};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use serde_json::{Value, json};
use tokio::process::Command;

use orders::Server;

/// What the simulated provider saw.
async fn provider(server: &Server) -> Value {
    reqwest::Client::new()
        .get(format!("{}/provider", server.base))
        .bearer_auth("acme")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// What one attempt got: a status and its `Retry-After` in seconds, or `None`
/// for no answer.
type Attempt = Option<(u16, Option<u64>)>;

/// Each attempt in turn.
type Attempts = Arc<Mutex<Vec<Attempt>>>;

/// Placed after `IdempotencyMiddleware`, it sees each attempt.
struct Recorder(Attempts);

#[async_trait::async_trait]
impl Middleware for Recorder {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let result = next.run(req, extensions).await;
        let seen = result.as_ref().ok().map(|r| {
            let retry_after = r.headers().get("retry-after");
            let retry_after = retry_after.and_then(|v| v.to_str().ok()?.parse().ok());
            (r.status().as_u16(), retry_after)
        });
        self.0.lock().unwrap().push(seen);
        result
    }
}

fn client(middleware: IdempotencyMiddleware) -> (ClientWithMiddleware, Attempts) {
    let attempts = Attempts::default();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware.backoff(Duration::from_millis(20), Duration::from_millis(500)))
        .with(Recorder(attempts.clone()))
        .build();
    (client, attempts)
}

/// The status of each attempt so far.
fn seen(attempts: &Attempts) -> Vec<Option<u16>> {
    let attempts = attempts.lock().unwrap();
    attempts
        .iter()
        .map(|a| a.map(|(status, _)| status))
        .collect()
}

fn order(
    client: &ClientWithMiddleware,
    server: &Server,
    quantity: i64,
) -> reqwest_middleware::RequestBuilder {
    client
        .post(format!("{}/orders", server.base))
        .bearer_auth("acme")
        .header("x-currency", "EUR")
        .json(&json!({"sku": "A-1", "quantity": quantity, "amount_cents": 1999}))
}

fn outcome(r: &reqwest::Response) -> IdemOutcome {
    r.idem().expect("the middleware handled it").clone()
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.count(sql).await
}

/// The first attempt's response is lost to the client's timeout while the server
/// commits; the retry with the same key gets the stored answer: one order. (A
/// replay, not a `422`, also shows the retry sent the same body: the server
/// fingerprints it.)
#[tokio::test]
async fn a_response_lost_to_a_client_timeout_is_answered_by_the_replay() {
    let db = TestDb::new().await;
    let server = Server::start(
        &db.url,
        &[
            ("ORDERS_LATENCY_MS", "1500"),
            ("IDEM_IN_FLIGHT_WAIT_MS", "200"),
        ],
    )
    .await;
    let (client, attempts) = client(
        IdempotencyMiddleware::new()
            .attempt_timeout(Duration::from_millis(800))
            .max_attempts(100)
            .deadline(Duration::from_secs(120)),
    );
    let r = order(&client, &server, 2).send().await.unwrap();
    let idem = outcome(&r);
    assert_eq!(r.status(), 201);
    assert!(
        idem.replayed,
        "the server finished the first attempt; a retry replays it"
    );
    let seen = seen(&attempts);
    assert_eq!(seen[0], None, "the first attempt timed out");
    assert_eq!(seen.len() as u32, idem.attempts);
    let body: Value = r.json().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        body["id"],
        count(&db, "SELECT id FROM orders").await,
        "the replay is the one order"
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM idempotency_requests").await,
        1
    );
}

/// A duplicate arrives while the first request with its key runs: it gets `409`s,
/// waits each `Retry-After` out, and ends with the first request's answer.
#[tokio::test]
async fn a_duplicate_in_flight_waits_out_its_409s() {
    let db = TestDb::new().await;
    let server = Arc::new(
        Server::start(
            &db.url,
            &[
                ("ORDERS_LATENCY_MS", "5000"),
                ("IDEM_IN_FLIGHT_WAIT_MS", "200"),
            ],
        )
        .await,
    );
    let key = IdempotencyKey::new("dup-1").unwrap();
    let (first_client, _) = client(IdempotencyMiddleware::new().deadline(Duration::from_secs(120)));
    let first = tokio::spawn({
        let (server, key) = (server.clone(), key.clone());
        async move {
            order(&first_client, &server, 2)
                .with_extension(key)
                .send()
                .await
                .unwrap()
        }
    });
    server.wait_until_executing(1).await;
    let (client, attempts) = client(
        IdempotencyMiddleware::new()
            .max_attempts(1000)
            .deadline(Duration::from_secs(120)),
    );
    let dup = order(&client, &server, 2)
        .with_extension(key.clone())
        .send()
        .await
        .unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(!outcome(&first).replayed);
    assert_eq!(dup.status(), 201);
    let idem = outcome(&dup);
    assert!(idem.replayed);
    assert_eq!(idem.key, key);
    let seen = seen(&attempts);
    assert!(seen.len() >= 2, "{seen:?}");
    assert!(
        seen[..seen.len() - 1].iter().all(|s| *s == Some(409)),
        "{seen:?}"
    );
    assert_eq!(first.bytes().await.unwrap(), dup.bytes().await.unwrap());
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 1);
}

/// The provider charges and times out: `202` outcome-uncertain. The client asks
/// again after its `Retry-After` until it gets the reconciled payment; the
/// provider charged once.
#[tokio::test]
async fn an_uncertain_payment_is_retried_until_reconciled() {
    let db = TestDb::new().await;
    let server = Server::start(
        &db.url,
        &[
            ("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE", "1"),
            ("PAYMENTS_RECONCILE_INTERVAL_MS", "50"),
        ],
    )
    .await;
    let (client, attempts) =
        client(IdempotencyMiddleware::new().deadline(Duration::from_secs(300)));
    let started = Instant::now();
    let r = client
        .post(format!("{}/payments", server.base))
        .bearer_auth("acme")
        .json(&json!({"amount_cents": 700}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let idem = outcome(&r);
    assert!(idem.replayed);
    let first_retry_after = attempts.lock().unwrap()[0].and_then(|(_, r)| r);
    let seen = seen(&attempts);
    assert_eq!(seen[0], Some(202), "{seen:?}");
    assert_eq!(seen.last(), Some(&Some(201)));
    let retry_after = Duration::from_secs(first_retry_after.expect("the 202 has Retry-After"));
    assert!(started.elapsed() >= retry_after, "Retry-After was honoured");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["id"], "ch_000001");
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
}

/// Placed after `IdempotencyMiddleware`, it publishes each attempt's status and
/// `Retry-After` as it comes, for a test to wait on.
struct Announcer(tokio::sync::watch::Sender<Vec<Attempt>>);

#[async_trait::async_trait]
impl Middleware for Announcer {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let result = next.run(req, extensions).await;
        let seen = result.as_ref().ok().map(|r| {
            let retry_after = r.headers().get("retry-after");
            let retry_after = retry_after.and_then(|v| v.to_str().ok()?.parse().ok());
            (r.status().as_u16(), retry_after)
        });
        self.0.send_modify(|all| all.push(seen));
        result
    }
}

/// A client on the defaults waits out the `Retry-After` the service gives an
/// uncertain payment, and gets the reconciled answer. The first answer is the
/// handler's `202` (a short `Retry-After`); the retry finds the row uncertain:
/// `202` with a `Retry-After` of the operation's lease (30 s), which a deadline
/// of 30 s could never wait out. This process's reconciler is idle (one round an
/// hour), so that second `202` is certain; once the client has it, a second
/// process on the same database (another replica) reconciles the charge, and
/// the client's next attempt gets the payment.
#[tokio::test]
async fn a_client_on_the_defaults_waits_out_an_uncertain_payments_retry_after() {
    let db = TestDb::new().await;
    let server = Server::start(
        &db.url,
        &[
            ("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE", "1"),
            ("PAYMENTS_RECONCILE_INTERVAL_MS", "3600000"),
        ],
    )
    .await;
    let (announce, mut attempts) = tokio::sync::watch::channel(Vec::new());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new())
        .with(Announcer(announce))
        .build();
    let started = Instant::now();
    let payment = tokio::spawn({
        let url = format!("{}/payments", server.base);
        async move {
            client
                .post(url)
                .bearer_auth("acme")
                .json(&json!({"amount_cents": 700}))
                .send()
                .await
        }
    });
    let two = tokio::time::timeout(
        Duration::from_secs(60),
        attempts.wait_for(|seen| seen.len() >= 2),
    )
    .await
    .expect("two attempts within 60 s")
    .unwrap()
    .clone();
    assert_eq!(two[0].map(|(status, _)| status), Some(202), "{two:?}");
    assert_eq!(
        two[1],
        Some((202, Some(30))),
        "the retry of an uncertain payment waits a lease: {two:?}"
    );
    let replica = Server::start(&db.url, &[("PAYMENTS_RECONCILE_INTERVAL_MS", "50")]).await;
    let r = payment
        .await
        .unwrap()
        .expect("the defaults wait out Retry-After: 30");
    assert_eq!(r.status(), 201);
    let idem = outcome(&r);
    assert!(idem.replayed);
    assert_eq!(idem.attempts, 3, "{:?}", attempts.borrow());
    assert!(started.elapsed() >= Duration::from_secs(30));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["id"], "ch_000001");
    assert_eq!(provider(&replica).await["charges"], 1);
}

/// The key reused for a different request: `422` at once, never retried.
#[tokio::test]
async fn a_422_is_returned_at_once() {
    let db = TestDb::new().await;
    let server = Server::start(&db.url, &[]).await;
    let (client, attempts) = client(IdempotencyMiddleware::new());
    let key = IdempotencyKey::new("reused-1").unwrap();
    let first = order(&client, &server, 2)
        .with_extension(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let other = order(&client, &server, 3)
        .with_extension(key)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(outcome(&other).attempts, 1);
    assert_eq!(seen(&attempts), [Some(201), Some(422)]);
    let problem: Value = other.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:fingerprint-mismatch");
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 1);
}

/// The provider is down longer than the client's deadline: every attempt is a
/// `503`, and the client gives up with an error that says so (and charged nothing).
#[tokio::test]
async fn an_outage_beyond_the_deadline_gives_a_clear_error() {
    let db = TestDb::new().await;
    let server = Server::start(&db.url, &[("PAYMENTS_PROVIDER_OUTAGE_CALLS", "100000")]).await;
    let deadline = Duration::from_secs(10);
    let (client, attempts) = client(
        IdempotencyMiddleware::new()
            .max_attempts(1000)
            .deadline(deadline),
    );
    let e = client
        .post(format!("{}/payments", server.base))
        .bearer_auth("acme")
        .json(&json!({"amount_cents": 700}))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.limit, Limit::Deadline(deadline));
    assert!(gave_up.attempts >= 2, "{}", gave_up.attempts);
    assert!(gave_up.elapsed <= deadline + Duration::from_secs(1));
    let seen = seen(&attempts);
    assert!(seen.iter().all(|s| *s == Some(503)), "{seen:?}");
    match &gave_up.last {
        LastAnswer::Status {
            status,
            problem_type,
            ..
        } => {
            assert_eq!(*status, 503);
            assert_eq!(
                problem_type.as_deref(),
                Some("urn:orders:problem:provider-unavailable")
            );
        }
        LastAnswer::CutOff => {} // the deadline fell inside an attempt
        other => panic!("{other:?}"),
    }
    let shown = e.to_string();
    assert!(shown.contains("deadline"), "{shown}");
    assert!(shown.contains("same Idempotency-Key"), "{shown}");
    assert_eq!(provider(&server).await["charges"], 0);
    assert_eq!(
        count(&db, "SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

/// The service is gone: connection errors until the deadline, then the error.
#[tokio::test]
async fn a_dead_service_gives_a_clear_error_at_the_deadline() {
    let db = TestDb::new().await;
    let mut server = Server::start(&db.url, &[]).await;
    server.child.kill().await.unwrap();
    let deadline = Duration::from_secs(2);
    let (client, attempts) = client(
        IdempotencyMiddleware::new()
            .max_attempts(1000)
            .deadline(deadline),
    );
    let e = order(&client, &server, 1).send().await.unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.limit, Limit::Deadline(deadline));
    assert!(gave_up.attempts >= 2);
    assert!(matches!(&gave_up.last, LastAnswer::Transport(t) if t.is_connect()));
    assert!(seen(&attempts).iter().all(Option::is_none));
}

/// `examples/client` places orders through its flaky proxy (fixed seed): some
/// requests and some responses are dropped, and each logical request still makes
/// exactly one order.
#[tokio::test]
async fn the_example_places_one_order_per_logical_request() {
    let db = TestDb::new().await;
    let server = Server::start(&db.url, &[]).await;
    let out = Command::new(common::example_binary("client"))
        .env("ORDERS_URL", &server.base)
        .env("CLIENT_ORDERS", "8")
        .env("CLIENT_SEED", "7")
        .env("CLIENT_TENANT", "client-example")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("8 orders for 8 logical requests"),
        "{stdout}"
    );
    assert!(
        stdout.contains("replayed: true"),
        "the proxy lost a response: {stdout}"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 8);
    assert_eq!(
        count(&db, "SELECT count(*) FROM idempotency_requests").await,
        8
    );
}
