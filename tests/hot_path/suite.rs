//! What the handler's path keeps on every database that claims at commit,
//! written once against the enclosing database module's `Db`, `TestDb`,
//! `WIDGETS`, `add_widget`, `more_modes`, `more_routes`, `EXPIRE_ALL` and the
//! storm's settings. `tests/hot_path.rs` mounts this file in each database's
//! module (the handlers' `Tx<Db>` picks the backend, so it must be concrete)
//! and stamps a `#[tokio::test]` wrapper per test there.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_runtime::{Idem, Tx, idempotent};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{
    Db, EXPIRE_ALL, STORM, STORM_MAY_CONFLICT, TestDb, WIDGETS, add_widget, more_modes, more_routes,
};
use crate::common::caller::Caller;
use crate::common::gate::Gate;

#[derive(Deserialize, Serialize)]
pub struct NewWidget {
    pub name: String,
    #[serde(default)]
    pub mode: Option<String>,
}

/// What a widget handler answers: its own error is a rollback.
pub type Answer = Result<(StatusCode, Json<Value>), (StatusCode, String)>;

/// Runs of each widget name, to show which requests ran a handler.
static RUNS: LazyLock<Mutex<HashMap<String, u32>>> = LazyLock::new(Default::default);

/// Counts a run of `name`'s handler; the run's number.
fn ran(name: &str) -> u32 {
    let mut runs = RUNS.lock().unwrap();
    let n = runs.entry(name.to_owned()).or_default();
    *n += 1;
    *n
}

/// How many times a handler ran for `name`.
pub fn runs(name: &str) -> u32 {
    RUNS.lock().unwrap().get(name).copied().unwrap_or(0)
}

/// Writes a widget and answers its id, unless its mode says otherwise: the
/// modes every database knows are here, the others in the database's
/// `more_modes`.
#[idempotent(operation = "create-widget", retention = "1h")]
pub async fn create_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> Answer {
    ran(&w.name);
    match w.mode.as_deref() {
        // Inserts; the first run then waits at the gate named by the widget
        // (see `Gate`), later runs pass.
        Some("gated") => {
            let id = add_widget(tx, &caller.0, &w.name).await;
            let gate = Gate::named(&w.name);
            if gate.first_visit() {
                gate.stop().await;
            }
            Ok((StatusCode::CREATED, Json(json!({"id": id}))))
        }
        // As "gated", answering a body of 2 KiB: over the limit of an `Idem`
        // that stores at most 1 KiB (`LARGE_OVER`).
        Some("gated-large") => {
            let id = add_widget(tx, &caller.0, &w.name).await;
            let gate = Gate::named(&w.name);
            if gate.first_visit() {
                gate.stop().await;
            }
            let pad = "x".repeat(2 * LARGE_OVER);
            Ok((StatusCode::CREATED, Json(json!({"id": id, "pad": pad}))))
        }
        // Every run waits until STORM runs have inserted: they all looked the
        // key up before anyone committed, and then race to claim it at commit.
        Some("storm") => {
            let id = add_widget(tx, &caller.0, &w.name).await;
            static ALL_INSERTED: LazyLock<tokio::sync::Barrier> =
                LazyLock::new(|| tokio::sync::Barrier::new(STORM));
            ALL_INSERTED.wait().await;
            Ok((StatusCode::CREATED, Json(json!({"id": id}))))
        }
        // Inserts, then leaves a nested transaction of its own open: begun and
        // forgotten, neither committed nor dropped.
        // "-then-err": and answers an error, which rolls back.
        Some(mode @ ("forget-nested" | "forget-nested-then-err")) => {
            let id = add_widget(tx, &caller.0, &w.name).await;
            let nested = sqlx::Connection::begin(&mut **tx).await.unwrap();
            std::mem::forget(nested);
            if mode == "forget-nested-then-err" {
                return Err((StatusCode::CONFLICT, "refused".into()));
            }
            Ok((StatusCode::CREATED, Json(json!({"id": id}))))
        }
        Some(mode) => match more_modes(tx, &caller.0, &w.name, mode).await {
            Some(answer) => answer,
            None => {
                let id = add_widget(tx, &caller.0, &w.name).await;
                Ok((StatusCode::CREATED, Json(json!({"id": id}))))
            }
        },
        None => {
            let id = add_widget(tx, &caller.0, &w.name).await;
            Ok((StatusCode::CREATED, Json(json!({"id": id}))))
        }
    }
}

/// Counts its runs; from the second on it fails the way its mode says: a 5xx,
/// a panic, or the 4xx an out-of-stock item would get.
#[idempotent(operation = "buy", retention = "1h")]
pub async fn buy(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> (StatusCode, Json<Value>) {
    let run = ran(&w.name);
    if run > 1 {
        match w.mode.as_deref() {
            Some("panic") => panic!("the second run of {} panics", w.name),
            Some("5xx") => return (StatusCode::BAD_GATEWAY, Json(json!({"run": run}))),
            _ => return (StatusCode::CONFLICT, Json(json!({"out_of_stock": true}))),
        }
    }
    add_widget(tx, &caller.0, &w.name).await;
    (
        StatusCode::CREATED,
        Json(json!({"bought": w.name, "run": run})),
    )
}

/// `POST /widgets` and `POST /buy`, and the routes of the database's own tests.
pub fn router(idem: Idem<Db>) -> Router {
    more_routes(
        Router::new()
            .route("/widgets", post(create_widget))
            .route("/buy", post(buy)),
    )
    .with_state(idem)
}

pub fn request(path: &str, key: &str, body: Value) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", key)
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// Status, whether replayed, body.
pub async fn send(router: &Router, req: Request<Body>) -> (StatusCode, bool, Bytes) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    let status = resp.status();
    (
        status,
        replayed,
        resp.into_body().collect().await.unwrap().to_bytes(),
    )
}

/// A database with the widgets table, and a router on it.
pub async fn app() -> (TestDb, Router) {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()));
    (db, r)
}

/// A widget name of this database's own: the gates and run counts are shared
/// by the binary, and both databases' tests run in it at once.
fn named(name: &str) -> String {
    format!("{name}-{}", std::any::type_name::<Db>())
}

/// A first execution writes one finished row, once; a retry replays it without
/// running the handler, and another request under the key is refused and runs
/// nothing.
pub async fn a_first_execution_writes_one_finished_row_and_a_retry_replays_it() {
    let (db, r) = app().await;
    let (first_name, other_name) = (named("first"), named("other"));
    let body = json!({"name": first_name});
    let (status, replayed, first) = send(&r, request("/widgets", "k1", body.clone())).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, again) = send(&r, request("/widgets", "k1", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first);
    assert_eq!(runs(&first_name), 1);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM idempotency_requests \
              WHERE state = 'completed' AND generation = 1 AND response_status = 201 \
                AND completed_at IS NOT NULL AND expires_at > completed_at"
        )
        .await,
        1
    );
    let (status, _, _) = send(&r, request("/widgets", "k1", json!({"name": other_name}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs(&other_name), 0);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A handler that leaves a nested transaction of its own open (begun and
/// forgotten) is not committed by idem, whose `COMMIT` would end only that
/// savepoint and answer `201` for nothing stored: nothing is stored, the
/// request gets the store's `503`. Nor is it rolled back by a `ROLLBACK` that
/// would end only the savepoint, when the handler answers an error. Either
/// way the connection is closed rather than handed on inside the handler's
/// transaction, so the next request on the pool's one connection commits as
/// ever. (PostgreSQL's session path commits the whole transaction with its
/// `COMMIT AND CHAIN`; this is the bound path.)
pub async fn a_nested_transaction_left_open_is_not_committed_and_its_connection_is_closed() {
    let db = TestDb::with_pool_size(1).await;
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()).with_session_statements(false));
    for (i, (mode, answer)) in [
        ("forget-nested", StatusCode::SERVICE_UNAVAILABLE),
        ("forget-nested-then-err", StatusCode::CONFLICT),
    ]
    .into_iter()
    .enumerate()
    {
        let (forgot, next) = (named(&format!("forgot-{i}")), named(&format!("after-{i}")));
        let body = json!({"name": forgot, "mode": mode});
        let (status, _, text) = send(&r, request("/widgets", &format!("k{i}-forgot"), body)).await;
        assert_eq!(status, answer, "{mode}: {text:?}");
        let body = json!({"name": next});
        let (status, _, _) = send(&r, request("/widgets", &format!("k{i}-next"), body)).await;
        assert_eq!(status, StatusCode::CREATED, "after {mode}");
        let committed = i64::try_from(i).unwrap() + 1;
        assert_eq!(
            db.count("SELECT count(*) FROM widgets").await,
            committed,
            "after {mode}: the next requests' widgets only"
        );
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            committed,
            "after {mode}: the next requests' rows only"
        );
    }
}

/// A retry of a finished key answers the stored outcome and nothing else: the
/// handler does not run again, so what it would answer now (a 5xx, a panic, an
/// item out of stock) never reaches the client.
pub async fn a_retry_of_a_finished_key_replays_even_when_the_handler_would_now_fail() {
    let (db, r) = app().await;
    for mode in ["5xx", "panic", "out-of-stock"] {
        let name = named(&format!("buy-{mode}"));
        let body = json!({"name": name, "mode": mode});
        let (status, replayed, first) = send(&r, request("/buy", &name, body.clone())).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false), "{mode}");
        for _ in 0..2 {
            let (status, replayed, again) = send(&r, request("/buy", &name, body.clone())).await;
            assert_eq!((status, replayed), (StatusCode::CREATED, true), "{mode}");
            assert_eq!(again, first, "{mode}");
        }
        assert_eq!(runs(&name), 1, "{mode}");
    }
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 3);
    // The handler's second run does fail: a new key shows it.
    let body = json!({"name": named("buy-5xx"), "mode": "5xx"});
    let (status, _, _) = send(&r, request("/buy", "other", body)).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
}

/// Two processes (two `Idem`s, two waiting rooms) get the same key at once. The
/// first runs its handler and stops at a gate; the second runs its handler to
/// the end and commits. Let go, the first finds the key taken by its insert: its
/// transaction rolls back, effect included, and it answers the second's stored
/// outcome. Both ran their handler; one widget.
pub async fn a_duplicate_that_ran_beside_the_first_rolls_back_and_answers_the_winners_outcome() {
    let (db, here) = app().await;
    let there = router(Idem::new(db.pool.clone()));
    let name = named("race");
    let gate = Gate::named(&name);
    let body = json!({"name": name, "mode": "gated"});
    let first = {
        let (here, body) = (here.clone(), body.clone());
        tokio::spawn(async move { send(&here, request("/widgets", "k-race", body)).await })
    };
    gate.arrival().await;
    // The second arrives while the first is inside its handler; its own run
    // passes the gate.
    let (status, replayed, won) = send(&there, request("/widgets", "k-race", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    gate.open(1);
    let (status, replayed, lost) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(lost, won, "the first answers what the second stored");
    assert_eq!(runs(&name), 2, "both ran their handler");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        1
    );
}

/// The response limit of the `Idem` that cannot store mode "gated-large"'s
/// answer.
const LARGE_OVER: usize = 1024;

/// As the race above, but the first's answer is over its `Idem`'s response
/// limit: it cannot be stored, the transaction rolls back, and the answer is
/// still the key's outcome, the second's (not a `500` saying the operation
/// was rolled back, while the key holds the second's effect).
pub async fn a_duplicate_whose_answer_cannot_be_stored_answers_the_winners_outcome() {
    let (db, there) = app().await;
    let here = router(Idem::new(db.pool.clone()).with_max_response_bytes(LARGE_OVER));
    let name = named("race-large");
    let gate = Gate::named(&name);
    let body = json!({"name": name, "mode": "gated-large"});
    let first = {
        let (here, body) = (here.clone(), body.clone());
        tokio::spawn(async move { send(&here, request("/widgets", "k-large", body)).await })
    };
    gate.arrival().await;
    let (status, replayed, won) = send(&there, request("/widgets", "k-large", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    gate.open(1);
    let (status, replayed, lost) = first.await.unwrap();
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, true),
        "{}",
        String::from_utf8_lossy(&lost)
    );
    assert_eq!(lost, won, "the first answers what the second stored");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A pool that refuses every checkout while `refusing` is set (a checkout that
/// finds no idle connection opens one, hence both hooks).
pub fn refusing_checkouts(refusing: &'static AtomicBool) -> sqlx::pool::PoolOptions<Db> {
    let allowed = move || {
        if refusing.load(Ordering::SeqCst) {
            Err(sqlx::Error::Protocol(
                "checkouts refused by the test".into(),
            ))
        } else {
            Ok(())
        }
    };
    sqlx::pool::PoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_millis(500))
        .before_acquire(move |_, _| Box::pin(async move { allowed().map(|()| true) }))
        .after_connect(move |_, _| Box::pin(async move { allowed() }))
}

/// `answered` (status, replayed, body) is `503` saying the key's outcome is
/// unknown and asking for the same key; `what` names the case.
pub fn assert_outcome_unknown(answered: &(StatusCode, bool, Bytes), what: &str) {
    let (status, replayed, body) = answered;
    assert_eq!(
        (*status, *replayed),
        (StatusCode::SERVICE_UNAVAILABLE, false),
        "{what}: {}",
        String::from_utf8_lossy(body)
    );
    let problem: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(
        problem["detail"], "the outcome is unknown; retry with the same key: it is safe",
        "{what}"
    );
}

/// A duplicate on another process whose commit found the key finished by the
/// first (it ran beside it), and which then cannot read what the key holds
/// (its pool refuses checkouts): it rolls back and answers that the outcome is
/// unknown (`503`, the same key asked for), never its own answer nor "nothing
/// was stored", and the retry replays the winner.
pub async fn a_duplicate_that_lost_at_commit_and_cannot_read_the_winner_answers_503_unknown() {
    static REFUSING: AtomicBool = AtomicBool::new(false);
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let pool = refusing_checkouts(&REFUSING)
        .connect(&db.url)
        .await
        .unwrap();
    let (here, there) = (router(Idem::new(pool.clone())), router(Idem::new(pool)));
    let name = named("lost-unread");
    let gate = Gate::named(&name);
    let body = json!({"name": name, "mode": "gated"});
    let first = {
        let (here, body) = (here.clone(), body.clone());
        tokio::spawn(async move { send(&here, request("/widgets", "k-unread", body)).await })
    };
    gate.arrival().await;
    let (status, replayed, won) = send(&there, request("/widgets", "k-unread", body.clone())).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    REFUSING.store(true, Ordering::SeqCst);
    gate.open(1);
    let answered = first.await.unwrap();
    REFUSING.store(false, Ordering::SeqCst);
    assert_outcome_unknown(&answered, "the loser");
    let (status, replayed, again) = send(&here, request("/widgets", "k-unread", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, won);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// STORM processes (STORM `Idem`s, no shared waiting room) send one new key at
/// once. Every handler runs and inserts before any commits (each waits until
/// all have inserted, so all looked the key up before anyone committed), their
/// claims meet on the key at commit, and exactly one commits: every answer is
/// that one's (the same row id), one widget exists, the others rolled back and
/// replay. Where the losers' inserts can deadlock (`STORM_MAY_CONFLICT`), such a
/// loser answers in flight (409), never with a second effect.
pub async fn concurrent_duplicates_on_many_processes_make_one_effect_and_one_answer() {
    let db = TestDb::with_pool_size(STORM as u32 + 2).await;
    db.exec(WIDGETS).await;
    let name = named("storm");
    let barrier = Arc::new(tokio::sync::Barrier::new(STORM));
    let mut tasks = Vec::new();
    for _ in 0..STORM {
        // A long in-flight wait: the losers wait for the winner's commit.
        let idem =
            Idem::new(db.pool.clone()).with_in_flight_wait(std::time::Duration::from_secs(30));
        let r = router(idem);
        let (barrier, body) = (barrier.clone(), json!({"name": name, "mode": "storm"}));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&r, request("/widgets", "k-storm", body)).await
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let created: Vec<_> = answers
        .iter()
        .filter(|a| a.0 == StatusCode::CREATED)
        .collect();
    assert!(
        answers
            .iter()
            .all(|a| a.0 == StatusCode::CREATED
                || (STORM_MAY_CONFLICT && a.0 == StatusCode::CONFLICT)),
        "{answers:?}"
    );
    assert!(
        created.iter().all(|a| a.2 == created[0].2),
        "one answer for all: {answers:?}"
    );
    assert_eq!(created.iter().filter(|a| !a.1).count(), 1, "{answers:?}");
    assert_eq!(runs(&name), STORM as u32, "every handler ran");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    let id: Value = serde_json::from_slice(&created[0].2).unwrap();
    assert_eq!(
        db.count("SELECT id FROM widgets").await,
        id["id"].as_i64().unwrap()
    );
}

/// A finished key past its retention is executed anew: the insert takes the
/// expired row over, as the key's second generation, kept for its retention.
pub async fn an_expired_key_is_executed_anew_by_the_insert() {
    let (db, r) = app().await;
    let body = json!({"name": named("exp-a")});
    let (status, _, _) = send(&r, request("/widgets", "k-exp", body)).await;
    assert_eq!(status, StatusCode::CREATED);
    db.exec(EXPIRE_ALL).await;
    let body = json!({"name": named("exp-b")});
    let (status, replayed, _) = send(&r, request("/widgets", "k-exp", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2
    );
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests WHERE expires_at > completed_at")
            .await,
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
}
