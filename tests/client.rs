//! idem-client end to end: the real `orders` example process on PostgreSQL, called
//! through `IdempotencyMiddleware` over real HTTP. A recording middleware placed
//! after it sees every attempt, so each test can assert which answers were
//! retried.
//!
//! The example binaries are built by `cargo test --workspace --all-features`; run
//! `cargo build --features client --example orders --example client` first when
//! running this file alone (`cargo test --features client --test client`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{SqliteDb, TestDb};
use idem_client::{
    ErrorExt, IdemOutcome, IdempotencyKey, IdempotencyMiddleware, LastAnswer, Limit, ResponseExt,
};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

use common::hold::Hold;
use common::orders::Server;

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

/// Each attempt in turn, published as it comes for a test to wait on.
type Attempts = Arc<tokio::sync::watch::Sender<Vec<Attempt>>>;

/// Placed after `IdempotencyMiddleware`, it sees each attempt.
struct Recorder(Attempts);

/// A recorder of its own, and what it has seen.
fn recorder() -> (Recorder, Attempts) {
    let attempts = Attempts::new(tokio::sync::watch::Sender::new(Vec::new()));
    (Recorder(attempts.clone()), attempts)
}

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
        self.0.send_modify(|all| all.push(seen));
        result
    }
}

fn client(middleware: IdempotencyMiddleware) -> (ClientWithMiddleware, Attempts) {
    let (recorder, attempts) = recorder();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware.backoff(Duration::from_millis(20), Duration::from_millis(500)))
        .with(recorder)
        .build();
    (client, attempts)
}

/// Waits until the attempts so far satisfy `done` (at most 60 s), woken by
/// each attempt, and returns them.
async fn until(attempts: &Attempts, done: impl Fn(&[Attempt]) -> bool) -> Vec<Attempt> {
    let mut seen = attempts.subscribe();
    match tokio::time::timeout(Duration::from_secs(60), seen.wait_for(|a| done(a))).await {
        Ok(Ok(got)) => got.clone(),
        _ => panic!("attempts never got there: {:?}", *attempts.borrow()),
    }
}

/// The status of each attempt so far.
fn seen(attempts: &Attempts) -> Vec<Option<u16>> {
    attempts
        .borrow()
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
/// fingerprints it.) The first attempt is held inside its transaction until the
/// client has given up on it.
#[tokio::test]
async fn a_response_lost_to_a_client_timeout_is_answered_by_the_replay() {
    let db = TestDb::new().await;
    let hold = Hold::new();
    let server =
        Arc::new(Server::start(&db.url, &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "200")]).await);
    let (client, attempts) = client(
        IdempotencyMiddleware::new()
            .attempt_timeout(Duration::from_millis(800))
            .max_attempts(100)
            .deadline(Duration::from_secs(120)),
    );
    let sent = tokio::spawn({
        let server = server.clone();
        async move { order(&client, &server, 2).send().await }
    });
    until(&attempts, |a| !a.is_empty()).await;
    hold.release();
    let r = sent.await.unwrap().unwrap();
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
/// waits each `Retry-After` out, and ends with the first request's answer. The
/// first request is held inside its transaction until the duplicate has its
/// first `409`.
#[tokio::test]
async fn a_duplicate_in_flight_waits_out_its_409s() {
    let db = TestDb::new().await;
    let hold = Hold::new();
    let server =
        Arc::new(Server::start(&db.url, &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "200")]).await);
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
    let dup = tokio::spawn({
        let (server, key) = (server.clone(), key.clone());
        async move { order(&client, &server, 2).with_extension(key).send().await }
    });
    // The first request is held until the duplicate has been told `409`.
    until(&attempts, |a| a.iter().any(|a| matches!(a, Some((409, _))))).await;
    hold.release();
    let dup = dup.await.unwrap().unwrap();
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
    let first_retry_after = attempts.borrow()[0].and_then(|(_, r)| r);
    let seen = seen(&attempts);
    assert_eq!(seen[0], Some(202), "{seen:?}");
    assert_eq!(seen.last(), Some(&Some(201)));
    let retry_after = Duration::from_secs(first_retry_after.expect("the 202 has Retry-After"));
    assert!(started.elapsed() >= retry_after, "Retry-After was honoured");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["id"], "ch_000001");
    assert_eq!(provider(&server).await, json!({"calls": 1, "charges": 1}));
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
    let (recorder, attempts) = recorder();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new())
        .with(recorder)
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
    let two = until(&attempts, |seen| seen.len() >= 2).await;
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

// --- Following a long operation: `POST /exports` with `follow_accepted` -------

/// One exchange a [`Tracer`] saw: a send or a poll, and what came back.
#[derive(Debug, Clone)]
struct Exchange {
    method: String,
    path: String,
    sent: Instant,
    received: Instant,
    /// `None`: no answer.
    status: Option<u16>,
    retry_after: Option<u64>,
    /// An operation document's `status`.
    state: Option<String>,
}

/// Placed after `IdempotencyMiddleware`, it publishes every exchange as it
/// ends, the operation documents' states read from their bodies.
struct Tracer(tokio::sync::watch::Sender<Vec<Exchange>>);

#[async_trait::async_trait]
impl Middleware for Tracer {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let (method, path) = (req.method().to_string(), req.url().path().to_owned());
        let sent = Instant::now();
        let result = next.run(req, extensions).await;
        let received = Instant::now();
        let mut exchange = Exchange {
            method,
            path,
            sent,
            received,
            status: None,
            retry_after: None,
            state: None,
        };
        let result = match result {
            Ok(r) => {
                use reqwest::ResponseBuilderExt;
                let status = r.status();
                let (url, version, headers) = (r.url().clone(), r.version(), r.headers().clone());
                exchange.status = Some(status.as_u16());
                exchange.retry_after = headers
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                // The body read here, handed on whole. A body cut off here
                // (the service killed mid-answer) goes on as a 503, which the
                // middleware asks again as it would the lost answer.
                let (status, body) = match r.bytes().await {
                    Ok(body) => (status, body),
                    Err(_) => (reqwest::StatusCode::SERVICE_UNAVAILABLE, Default::default()),
                };
                exchange.state = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|doc| Some(doc.get("status")?.as_str()?.to_owned()));
                let mut rebuilt = http::Response::builder()
                    .status(status)
                    .version(version)
                    .url(url)
                    .body(body)
                    .unwrap();
                *rebuilt.headers_mut() = headers;
                Ok(reqwest::Response::from(rebuilt))
            }
            Err(e) => Err(e),
        };
        self.0.send_modify(|all| all.push(exchange));
        result
    }
}

type Trace = tokio::sync::watch::Receiver<Vec<Exchange>>;

/// A client that follows long operations, with a tracer behind it.
fn following(deadline: Duration) -> (ClientWithMiddleware, Trace) {
    let (tx, trace) = tokio::sync::watch::channel(Vec::new());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyMiddleware::new()
                .follow_accepted(true)
                .deadline(deadline)
                .attempt_timeout(Duration::from_secs(10))
                .backoff(Duration::from_millis(20), Duration::from_millis(500)),
        )
        .with(Tracer(tx))
        .build();
    (client, trace)
}

fn export(client: &ClientWithMiddleware, base: &str) -> reqwest_middleware::RequestBuilder {
    client
        .post(format!("{base}/exports"))
        .bearer_auth("acme")
        .json(&json!({"format": "csv"}))
}

/// Every wait the client chose waited out the `Retry-After` before it: each
/// exchange but a result's (read at once when the operation says done) began
/// no sooner than that after the previous answer arrived.
fn assert_retry_after_honoured(trace: &[Exchange]) {
    for pair in trace.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        if after.path.ends_with("/result") {
            continue;
        }
        let waited = after.sent.duration_since(before.received);
        let asked = Duration::from_secs(before.retry_after.unwrap_or(0));
        assert!(waited >= asked, "{waited:?} < {asked:?}: {trace:#?}");
    }
}

/// `POST /exports` through a client that follows: one `send` ends with the
/// export's `201`, read from the operation's `result` (replayed), after the
/// `202` and at least one poll of the resource, each no sooner than its
/// `Retry-After` (2 s). A retry of the request with the key gets the same bytes.
#[tokio::test]
async fn a_followed_export_ends_with_its_stored_201() {
    let db = TestDb::new().await;
    let server = Server::start(&db.url, &[("EXPORTS_DURATION_MS", "3000")]).await;
    let (follower, trace) = following(Duration::from_secs(120));
    let key = IdempotencyKey::new("export-followed").unwrap();
    let r = export(&follower, &server.base)
        .with_extension(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let idem = outcome(&r);
    assert_eq!(idem.attempts, 1);
    assert!(idem.replayed, "the stored answer");
    assert!(idem.polls >= 2, "a document and the result: {}", idem.polls);
    let operation = idem.operation.clone().expect("followed");
    let trace = trace.borrow().clone();
    let first = &trace[0];
    assert_eq!(
        (first.method.as_str(), first.status, first.retry_after),
        ("POST", Some(202), Some(2))
    );
    assert_eq!(trace.len() as u32, idem.attempts + idem.polls, "{trace:#?}");
    assert!(trace[1..].iter().all(|e| e.method == "GET"), "{trace:#?}");
    assert!(
        trace[1..trace.len() - 1]
            .iter()
            .all(|e| e.path == operation.path() && e.status == Some(200)),
        "{trace:#?}"
    );
    let result = trace.last().unwrap();
    assert_eq!(result.path, format!("{}/result", operation.path()));
    assert_eq!(result.status, Some(201));
    assert_eq!(r.url().path(), result.path);
    assert_retry_after_honoured(&trace);

    let body = r.bytes().await.unwrap();
    let exported: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (&exported["format"], &exported["orders"]),
        (&json!("csv"), &json!(0))
    );
    // The request again, with its key: the same stored answer, at once.
    let again = export_again(&follower, &server.base, key).await;
    assert_eq!(again.status(), 201);
    assert_eq!(outcome(&again).polls, 0);
    assert_eq!(again.bytes().await.unwrap(), body);
    server.wait_until_executing(1).await;
    assert_eq!(*server.executions.borrow(), 1, "one export ran");
    assert_eq!(
        count(&db, "SELECT count(*) FROM idempotency_requests").await,
        1
    );
}

async fn export_again(
    client: &ClientWithMiddleware,
    base: &str,
    key: IdempotencyKey,
) -> reqwest::Response {
    export(client, base)
        .with_extension(key)
        .send()
        .await
        .unwrap()
}

/// An export longer than the client's deadline: the following stops before the
/// deadline with `GaveUp`, which names the operation's resource and its last
/// state; the export goes on, and both the resource and the request sent again
/// with the key say so.
#[tokio::test]
async fn the_deadline_stops_following_a_long_export() {
    let db = TestDb::new().await;
    let server = Server::start(&db.url, &[("EXPORTS_DURATION_MS", "600000")]).await;
    let deadline = Duration::from_secs(10);
    let (follower, trace) = following(deadline);
    let e = export(&follower, &server.base).send().await.unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.limit, Limit::Deadline(deadline));
    assert_eq!(gave_up.attempts, 1);
    assert!(gave_up.polls >= 1, "{:#?}", trace.borrow());
    assert!(gave_up.elapsed <= deadline + Duration::from_secs(1));
    match &gave_up.last {
        LastAnswer::Operation { state, retry_after } => {
            assert_eq!(state, "running");
            assert_eq!(*retry_after, Some(Duration::from_secs(2)));
        }
        // The deadline fell inside a poll.
        LastAnswer::CutOff => {}
        other => panic!("{other:?}"),
    }
    let shown = e.to_string();
    assert!(shown.contains("deadline"), "{shown}");
    assert!(shown.contains("same Idempotency-Key"), "{shown}");
    let trace = trace.borrow().clone();
    assert!(
        trace[1..]
            .iter()
            .all(|x| x.method == "GET" && x.state.as_deref() == Some("running")),
        "{trace:#?}"
    );
    assert_retry_after_honoured(&trace);

    // What GaveUp names is how to go on.
    let operation = gave_up.operation.clone().expect("the resource");
    assert!(
        operation.path().starts_with("/operations/create-export/"),
        "{operation}"
    );
    let doc: Value = reqwest::Client::new()
        .get(operation.clone())
        .bearer_auth("acme")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(doc["status"], "running");
    let (plain, _) = client(IdempotencyMiddleware::new());
    let again = export(&plain, &server.base)
        .with_extension(gave_up.key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["location"], operation.path());
    server.wait_until_executing(1).await;
    assert_eq!(*server.executions.borrow(), 1);
}

/// A TCP proxy in front of the service, so that a service restarted on another
/// port is at the client's same address. While nothing listens upstream, a
/// connection closes unanswered: a lost response.
struct Proxy {
    base: String,
    upstream: Arc<Mutex<String>>,
}

impl Proxy {
    async fn start(server: &Server) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let upstream = Arc::new(Mutex::new(String::new()));
        let to = upstream.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = to.lock().unwrap().clone();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        let proxy = Proxy { base, upstream };
        proxy.point_to(server);
        proxy
    }

    fn point_to(&self, server: &Server) {
        *self.upstream.lock().unwrap() = server.base.trim_start_matches("http://").to_owned();
    }
}

/// The database a kill test runs on.
enum Db {
    Postgres(TestDb),
    Sqlite(SqliteDb),
}

impl Db {
    fn url(&self) -> String {
        match self {
            Db::Postgres(db) => db.url.clone(),
            Db::Sqlite(db) => format!("sqlite://{}", db.path.display()),
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        match self {
            Db::Postgres(db) => db.count(sql).await,
            Db::Sqlite(db) => db.count(sql).await,
        }
    }
}

/// The service is killed (SIGKILL) while the client follows an export, and
/// started again on the same database once a poll has gone unanswered. The
/// client rides out the outage, sees the operation `stalled` once the dead worker's
/// 6 s lease has lapsed, sends the original request again with the same key
/// (which takes the export over, at the same address), follows the new `202`,
/// and ends with the export's `201`. One stored export, taken over once.
async fn a_followed_export_survives_a_kill_of_the_service(db: Db) {
    let mut first = Server::start(&db.url(), &[("EXPORTS_DURATION_MS", "600000")]).await;
    let proxy = Proxy::start(&first).await;
    let (follower, mut trace) = following(Duration::from_secs(300));
    let base = proxy.base.clone();
    let key = IdempotencyKey::new("export-through-a-kill").unwrap();
    let following = tokio::spawn({
        let key = key.clone();
        async move { export(&follower, &base).with_extension(key).send().await }
    });
    // The client follows: a poll of the resource said `running`.
    tokio::time::timeout(
        Duration::from_secs(60),
        trace.wait_for(|t| {
            t.iter()
                .any(|e| e.method == "GET" && e.state.as_deref() == Some("running"))
        }),
    )
    .await
    .expect("a poll within 60 s")
    .unwrap();
    first.kill().await;
    // The service stays down until a poll has gone unanswered.
    tokio::time::timeout(
        Duration::from_secs(60),
        trace.wait_for(|t| t.last().is_some_and(|e| e.status.is_none())),
    )
    .await
    .expect("a poll within 60 s")
    .unwrap();
    let second = Server::start(&db.url(), &[("EXPORTS_DURATION_MS", "500")]).await;
    proxy.point_to(&second);

    let r = following
        .await
        .unwrap()
        .expect("the client follows through the kill");
    assert_eq!(r.status(), 201);
    let idem = outcome(&r);
    assert_eq!(idem.attempts, 2, "the request, and its resend on `stalled`");
    assert!(idem.replayed);
    let trace = trace.borrow().clone();
    let stalled = trace
        .iter()
        .position(|e| e.state.as_deref() == Some("stalled"))
        .unwrap_or_else(|| panic!("never stalled: {trace:#?}"));
    let resend = &trace[stalled + 1];
    assert_eq!(
        (resend.method.as_str(), resend.status),
        ("POST", Some(202)),
        "{trace:#?}"
    );
    assert!(
        trace[..stalled]
            .iter()
            .any(|e| e.method == "GET" && e.status.is_none()),
        "polls went unanswered while the service was down: {trace:#?}"
    );
    assert!(
        trace[stalled..]
            .iter()
            .any(|e| e.state.as_deref() == Some("succeeded")),
        "{trace:#?}"
    );
    assert_eq!(trace.last().unwrap().status, Some(201));
    assert_retry_after_honoured(&trace);
    let body = r.bytes().await.unwrap();
    let export_doc: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(export_doc["format"], "csv");

    // One export: one record, taken over once, run to its end by the second
    // process only once; the request again replays it.
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        1
    );
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2
    );
    second.wait_until_executing(1).await;
    assert_eq!(*second.executions.borrow(), 1);
    assert!(
        second
            .log
            .borrow()
            .iter()
            .any(|l| l.contains("idem: execute") && l.contains("taken_over")),
        "{:#?}",
        second.log.borrow()
    );
    let (plain, _) = client(IdempotencyMiddleware::new());
    let again = export_again(&plain, &proxy.base, key).await;
    assert_eq!(again.status(), 201);
    assert_eq!(again.bytes().await.unwrap(), body);
}

#[tokio::test]
async fn a_followed_export_survives_a_kill_of_the_service_on_postgres() {
    a_followed_export_survives_a_kill_of_the_service(Db::Postgres(TestDb::new().await)).await;
}

#[tokio::test]
async fn a_followed_export_survives_a_kill_of_the_service_on_sqlite() {
    a_followed_export_survives_a_kill_of_the_service(Db::Sqlite(SqliteDb::new().await)).await;
}
