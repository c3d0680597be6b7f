//! Bounded waits (PostgreSQL). A stalled request is abandoned at its deadline
//! with `503` and its key freed; and a hot key does not starve everyone else:
//! duplicates of a key whose
//! first request is still running wait in the process, without a pooled
//! connection, so another tenant's request is served while dozens of retries of
//! the hot key wait; past the waiter bound a duplicate is answered `409` at once.
//!
//! The bound this shows is logical rather than timed: the other tenant's request
//! completes while the hot key's first request is still held open. Before the
//! waiting room, every duplicate waited for the row lock inside PostgreSQL
//! holding one of the pool's four connections, and the other tenant's request
//! timed out waiting for a connection (`503`).

mod common;

use sqlx::Postgres;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, response::IntoResponse};
use http_body_util::BodyExt;
use idem_runtime::{Idem, Tx, idempotent};
use serde::Deserialize;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

use common::TestDb;
use common::caller::Caller;
use common::gate::Gate;

#[derive(Clone)]
struct AppState {
    idem: Idem<Postgres>,
    /// Where a held request waits inside its transaction.
    gate: Arc<Gate>,
    /// Whether the next request holds its transaction open (not part of the
    /// request, so a retry is the same request).
    hold_next: Arc<AtomicBool>,
}

impl FromRef<AppState> for Idem<Postgres> {
    fn from_ref(s: &AppState) -> Idem<Postgres> {
        s.idem.clone()
    }
}

#[derive(Deserialize, serde::Serialize)]
struct NewWidget {
    name: String,
    #[serde(default)]
    hold: bool,
}

/// Writes a widget in the claimed transaction; holds it open when asked to.
#[idempotent(operation = "create-widget", retention = "1h", in_flight_wait = "30s")]
async fn create_widget(
    #[tenant] caller: Caller,
    State(state): State<AppState>,
    tx: &mut Tx<Postgres>,
    Json(w): Json<NewWidget>,
) -> impl IntoResponse {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO widgets (tenant, name) VALUES ($1, $2) RETURNING id")
            .bind(&caller.0)
            .bind(&w.name)
            .fetch_one(&mut **tx)
            .await
            .unwrap();
    // The server's bound on the transaction's statements, in milliseconds
    // (set at `BEGIN`), read before a hold, whose connection a test may end.
    let statement_timeout: String =
        sqlx::query_scalar("SELECT setting FROM pg_settings WHERE name = 'statement_timeout'")
            .fetch_one(&mut **tx)
            .await
            .unwrap();
    if w.hold || state.hold_next.swap(false, Ordering::SeqCst) {
        state.gate.stop().await;
    }
    (
        StatusCode::CREATED,
        Json(json!({
            "id": id,
            "name": w.name,
            "tenant": caller.0,
            "statement_timeout": statement_timeout.parse::<u64>().unwrap(),
        })),
    )
}

struct App {
    db: TestDb,
    idem: Idem<Postgres>,
    router: Router,
    gate: Arc<Gate>,
    hold_next: Arc<AtomicBool>,
}

/// A router on a pool of four connections that gives up on a connection after
/// three seconds, with `per_key` and `total` waiters at most.
async fn app(per_key: usize, total: usize) -> App {
    app_with(|idem| idem.with_waiter_limits(per_key, total)).await
}

/// As [`app`], with `configure`d settings.
async fn app_with(configure: impl FnOnce(Idem<Postgres>) -> Idem<Postgres>) -> App {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE widgets (id bigserial PRIMARY KEY, tenant text NOT NULL, name text NOT NULL)",
    )
    .await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&db.url)
        .await
        .unwrap();
    let idem = configure(Idem::new(pool));
    let hold_next = Arc::new(AtomicBool::new(false));
    let gate = Gate::new();
    let state = AppState {
        idem: idem.clone(),
        gate: gate.clone(),
        hold_next: hold_next.clone(),
    };
    let router = Router::new()
        .route("/widgets", post(create_widget))
        .with_state(state);
    App {
        db,
        idem,
        router,
        gate,
        hold_next,
    }
}

fn request(tenant: &str, key: &str, body: &str) -> Request<Body> {
    Request::post("/widgets")
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

struct Answer {
    status: StatusCode,
    problem_type: Option<String>,
    replayed: bool,
    retry_after: Option<String>,
    body: bytes::Bytes,
}

async fn send(router: &Router, req: Request<Body>) -> Answer {
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let problem_type = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned));
    Answer {
        status,
        problem_type,
        replayed,
        retry_after,
        body,
    }
}

/// Waits until `n` duplicates wait in the process. A condition, not a guess: the
/// deadline is only there so that a bug fails the test instead of hanging it.
async fn until_waiting(idem: &Idem<Postgres>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while idem.waiting_duplicates() != n {
        assert!(
            Instant::now() < deadline,
            "{} duplicates waiting, expected {n}",
            idem.waiting_duplicates()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const HOT: &str = r#"{"name":"hot","hold":true}"#;

#[tokio::test]
async fn a_hot_key_does_not_take_the_pool_from_other_tenants() {
    let a = app(64, 1024).await;
    let router = a.router.clone();
    let first = tokio::spawn(async move { send(&router, request("hot", "k", HOT)).await });
    // The first request holds the key inside its open transaction now.
    a.gate.arrival().await;
    let duplicates: Vec<_> = (0..40)
        .map(|_| {
            let router = a.router.clone();
            tokio::spawn(async move { send(&router, request("hot", "k", HOT)).await })
        })
        .collect();
    until_waiting(&a.idem, 40).await;

    // Four connections: the held request has one; forty duplicates have none.
    let other = send(&a.router, request("other", "o1", r#"{"name":"cold"}"#)).await;
    assert_eq!(other.status, StatusCode::CREATED, "{:?}", other.body);
    assert!(
        !first.is_finished(),
        "the other tenant was served while the hot key was still held"
    );

    a.gate.open(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    for d in duplicates {
        let d = d.await.unwrap();
        assert_eq!(d.status, StatusCode::CREATED);
        assert!(d.replayed, "a duplicate replays the first request's answer");
        assert_eq!(d.body, first.body);
    }
    assert_eq!(a.idem.waiting_duplicates(), 0);
    assert_eq!(
        a.db.count("SELECT count(*) FROM widgets WHERE tenant = 'hot'")
            .await,
        1
    );
}

#[tokio::test]
async fn past_the_waiter_bound_a_duplicate_is_answered_409_at_once() {
    let a = app(2, 1024).await;
    let router = a.router.clone();
    let first = tokio::spawn(async move { send(&router, request("hot", "k", HOT)).await });
    a.gate.arrival().await;
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let router = a.router.clone();
            tokio::spawn(async move { send(&router, request("hot", "k", HOT)).await })
        })
        .collect();
    until_waiting(&a.idem, 2).await;

    let started = Instant::now();
    let refused = send(&a.router, request("hot", "k", HOT)).await;
    // Far less than the operation's 30 s in-flight wait: it did not wait.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "answered after {:?}",
        started.elapsed()
    );
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(refused.retry_after.as_deref(), Some("30"));
    assert!(!first.is_finished());
    assert_eq!(
        a.idem.waiting_duplicates(),
        2,
        "the refused one never waited"
    );

    a.gate.open(1);
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    for w in waiting {
        let w = w.await.unwrap();
        assert_eq!(w.status, StatusCode::CREATED);
        assert!(w.replayed);
    }
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A duplicate waiting in the process whose first request rolls back claims the
/// key itself and executes: the waiting room decides nothing.
#[tokio::test]
async fn when_the_first_request_rolls_back_a_waiting_duplicate_executes() {
    let a = app(64, 1024).await;
    let router = a.router.clone();
    let first = tokio::spawn(async move { send(&router, request("hot", "k", HOT)).await });
    a.gate.arrival().await;
    let router = a.router.clone();
    let dup = tokio::spawn(async move { send(&router, request("hot", "k", HOT)).await });
    until_waiting(&a.idem, 1).await;
    // The held transaction never commits: its backend is terminated (the only
    // connection idle in a transaction; the duplicate holds none).
    a.db.exec(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
          WHERE datname = current_database() AND state = 'idle in transaction'",
    )
    .await;
    a.gate.open(2);
    let first = first.await.unwrap();
    assert_ne!(first.status, StatusCode::CREATED, "its transaction was cut");
    let dup = dup.await.unwrap();
    assert_eq!(dup.status, StatusCode::CREATED);
    assert!(!dup.replayed, "the duplicate executed the request itself");
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// The server's bound on a transaction (`statement_timeout` and
/// `idle_in_transaction_session_timeout`) is what is left of the request's
/// deadline when the transaction begins, a second longer: a duplicate that
/// waited in the waiting room, then executed, gets less than the whole
/// deadline, so its statements cannot outlive the request by the time it
/// waited.
#[tokio::test]
async fn a_duplicate_that_waited_begins_with_what_is_left_of_its_deadline() {
    let deadline = Duration::from_secs(60);
    let a = app_with(|idem| idem.with_request_deadline(deadline)).await;
    a.hold_next.store(true, Ordering::SeqCst);
    let router = a.router.clone();
    let first = tokio::spawn(async move { send(&router, request("hot", "k", COLD)).await });
    a.gate.arrival().await;
    let router = a.router.clone();
    let dup = tokio::spawn(async move { send(&router, request("hot", "k", COLD)).await });
    until_waiting(&a.idem, 1).await;
    // The duplicate's deadline runs while it waits, as long as this at least.
    let waited = Duration::from_secs(2);
    tokio::time::sleep(waited).await;
    // The first's transaction never commits (as above), and the duplicate
    // executes.
    a.db.exec(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
          WHERE datname = current_database() AND state = 'idle in transaction'",
    )
    .await;
    a.gate.open(1);
    assert_ne!(first.await.unwrap().status, StatusCode::CREATED);
    let dup = dup.await.unwrap();
    assert_eq!((dup.status, dup.replayed), (StatusCode::CREATED, false));
    let body: serde_json::Value = serde_json::from_slice(&dup.body).unwrap();
    let bound = body["statement_timeout"].as_u64().unwrap();
    let whole = u64::try_from((deadline + Duration::from_secs(1)).as_millis()).unwrap();
    let at_most = whole - u64::try_from(waited.as_millis()).unwrap();
    assert!(
        bound <= at_most && bound > 0,
        "statement_timeout {bound} ms, at most {at_most} (the whole deadline's {whole})"
    );
}

const COLD: &str = r#"{"name":"cold"}"#;

/// A handler that never finishes is abandoned at the deadline: `503` with
/// `Retry-After`, its insert rolled back, and the key free, so the retry (the same
/// request) executes.
#[tokio::test]
async fn a_stuck_handler_is_abandoned_at_the_deadline_and_its_key_freed() {
    let a = app_with(|idem| idem.with_request_deadline(Duration::from_secs(3))).await;
    a.hold_next.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let stuck = send(&a.router, request("acme", "k", COLD)).await;
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "abandoned after {:?}, before the deadline",
        started.elapsed()
    );
    assert_eq!(stuck.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(stuck.retry_after.as_deref(), Some("1"));
    assert_eq!(
        stuck.problem_type.as_deref(),
        Some("urn:idem:problem:store-unavailable")
    );
    let retry = send(&a.router, request("acme", "k", COLD)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        !retry.replayed,
        "nothing was stored for the abandoned request"
    );
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A statement stalled inside the database (a lock held elsewhere) is bounded
/// too, and the server lets the key go: once the lock is released, the retry
/// executes.
#[tokio::test]
async fn a_statement_stalled_on_a_held_lock_is_bounded() {
    let a = app_with(|idem| idem.with_request_deadline(Duration::from_secs(3))).await;
    let mut holder = a.db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE widgets IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let stalled = send(&a.router, request("acme", "k", COLD)).await;
    assert_eq!(stalled.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(stalled.retry_after.as_deref(), Some("1"));
    holder.rollback().await.unwrap();
    let retry = send(&a.router, request("acme", "k", COLD)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// Reads the bounds the claim's transaction carries, in that transaction.
#[idempotent(operation = "show-bounds", retention = "1h")]
async fn show_bounds(#[tenant] _caller: Caller, tx: &mut Tx<Postgres>) -> impl IntoResponse {
    let (statement, idle): (String, String) = sqlx::query_as(
        "SELECT current_setting('statement_timeout'), \
                current_setting('idle_in_transaction_session_timeout')",
    )
    .fetch_one(&mut **tx)
    .await
    .unwrap();
    let ms = |setting: String| -> u64 {
        // `SHOW`'s units: whole seconds as `8s`, else milliseconds.
        match setting.strip_suffix("ms") {
            Some(ms) => ms.parse().unwrap(),
            None => setting.strip_suffix('s').unwrap().parse::<u64>().unwrap() * 1000,
        }
    };
    Json(json!({"statement": ms(statement), "idle": ms(idle)}))
}

/// On PostgreSQL the deadline travels with the transaction, so that the server
/// ends a session whose client stalled or vanished and frees its key, whether
/// the key is claimed at commit or before the handler.
#[tokio::test]
async fn the_claims_transaction_carries_the_deadline_to_the_server() {
    for at_commit in [true, false] {
        let a = app_with(|idem| {
            idem.with_request_deadline(Duration::from_secs(7))
                .with_claims_at_commit(at_commit)
        })
        .await;
        let router = Router::new()
            .route("/bounds", post(show_bounds))
            .with_state(a.idem.clone());
        let req = Request::post("/bounds")
            .header("authorization", "Bearer acme")
            .header("idempotency-key", "b1")
            .body(Body::empty())
            .unwrap();
        let answer = send(&router, req).await;
        assert_eq!(answer.status, StatusCode::OK);
        let bounds: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        // What is left of the deadline (7 s) when the transaction begins (the
        // claim took a little of it), and a second: the server's bound is the
        // backstop, never ahead of the client's own abandonment.
        for bound in ["statement", "idle"] {
            let ms = bounds[bound].as_u64().unwrap();
            assert!(
                (4_000..=8_000).contains(&ms),
                "claims at commit: {at_commit}: {bound} {ms} ms"
            );
        }
        assert_eq!(bounds["statement"], bounds["idle"]);
    }
}

/// A shutdown can wait for the work of a request whose client is gone: the work
/// runs on (idem does not cancel half-done work), is counted among the
/// executions, and `drained()` resolves once it has committed.
#[tokio::test]
async fn a_shutdown_can_wait_for_work_whose_client_is_gone() {
    use futures_util::FutureExt;

    let a = app(64, 1024).await;
    let router = a.router.clone();
    let client = tokio::spawn(async move { send(&router, request("acme", "k", HOT)).await });
    a.gate.arrival().await;
    // The client disconnects.
    client.abort();
    assert!(client.await.is_err_and(|e| e.is_cancelled()));
    let executions = a.idem.executions();
    assert_eq!(executions.running(), 1);
    let drained = executions.drained();
    let mut drained = std::pin::pin!(drained);
    assert!(
        drained.as_mut().now_or_never().is_none(),
        "the work still runs"
    );
    a.gate.open(1);
    tokio::time::timeout(Duration::from_secs(60), drained)
        .await
        .expect("drained once the work finished");
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        1,
        "its outcome was stored for the client's retry"
    );
}

/// A deadline longer than PostgreSQL's timeouts can hold (or the clock can add)
/// is capped at PostgreSQL's largest, not refused: the request still runs.
#[tokio::test]
async fn a_deadline_past_the_servers_range_is_capped_not_an_error() {
    let a = app_with(|idem| {
        idem.with_request_deadline(Duration::MAX)
            .with_in_flight_wait(Duration::MAX)
    })
    .await;
    let router = Router::new()
        .route("/bounds", post(show_bounds))
        .with_state(a.idem.clone());
    let req = Request::post("/bounds")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", "b-max")
        .body(Body::empty())
        .unwrap();
    let answer = send(&router, req).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    let bounds: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(
        bounds,
        json!({"statement": 2_147_483_647, "idle": 2_147_483_647})
    );
}
