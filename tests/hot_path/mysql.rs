//! The handler's path on MySQL and MariaDB (`idem_runtime`'s
//! `db::mysql::hot_path`), beside what `suite.rs` holds every database to: a
//! duplicate whose handler failed on the winner's row answering the winner's
//! outcome, the in-flight bound on a key another transaction holds (in both
//! forms of the insert: MariaDB's `SET STATEMENT` and MySQL 8's session variable
//! set around it, given back after), a leased row left alone, the claim-first
//! path when claims at commit are off, and no lock wait left on a pooled
//! connection.

use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::http::StatusCode;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_runtime::{Claim, ClaimRequest, FingerprintBuilder, Idem, IdempotencyKey, Tx, claim};
use serde_json::json;
use sqlx::MySql;
use tower::ServiceExt;

use crate::common::MySqlDb;
use crate::common::gate::Gate;
use suite::{Answer, app, request, router, runs};

type Db = MySql;
type TestDb = MySqlDb;

#[path = "suite.rs"]
mod suite;

stamp!(suite =>
    a_first_execution_writes_one_finished_row_and_a_retry_replays_it,
    a_retry_of_a_finished_key_replays_even_when_the_handler_would_now_fail,
    a_duplicate_that_ran_beside_the_first_rolls_back_and_answers_the_winners_outcome,
    concurrent_duplicates_on_many_processes_make_one_effect_and_one_answer,
    an_expired_key_is_executed_anew_by_the_insert,
);

const WIDGETS: &str = "CREATE TABLE widgets (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
     tenant VARCHAR(64) NOT NULL, name VARCHAR(255) NOT NULL) ENGINE = InnoDB";

/// Every finished row past its retention (`expires_at` in milliseconds).
const EXPIRE_ALL: &str = "UPDATE idempotency_requests SET expires_at = expires_at - 7200000";

/// How many processes the storm runs. InnoDB can find a deadlock among the
/// losers' inserts waiting on the winner's row: such a loser answers in flight.
const STORM: usize = 12;
const STORM_MAY_CONFLICT: bool = true;

/// Writes one widget in the claimed transaction; its id.
async fn add_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) -> i64 {
    let done = sqlx::query("INSERT INTO widgets (tenant, name) VALUES (?, ?)")
        .bind(tenant)
        .bind(name)
        .execute(&mut **tx)
        .await
        .unwrap();
    i64::try_from(done.last_insert_id()).unwrap()
}

/// The widget handler's modes only MySQL's tests use; `None` for a mode it does
/// not know (the handler then writes a widget).
async fn more_modes(tx: &mut Tx<Db>, tenant: &str, name: &str, mode: &str) -> Option<Answer> {
    let id = add_widget(tx, tenant, name).await;
    match mode {
        // A natural key of the application's, then the widget's gate for the
        // first run: a second run that runs into the first's row answers a 5xx
        // itself (its transaction rolls back).
        "natural-5xx" => {
            let inserted = sqlx::query("INSERT INTO naturals (nk) VALUES (?)")
                .bind(name)
                .execute(&mut **tx)
                .await;
            if let Err(sqlx::Error::Database(e)) = &inserted
                && e.code().as_deref() == Some("23000")
            {
                return Some(Ok((
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"duplicate": true})),
                )));
            }
            inserted.unwrap();
            let gate = Gate::named(name);
            if gate.first_visit() {
                gate.stop().await;
            }
        }
        // Every run waits at the widget's gate.
        "gated-every" => Gate::named(name).stop().await,
        _ => {}
    }
    Some(Ok((StatusCode::CREATED, Json(json!({"id": id})))))
}

/// No routes of MySQL's own.
fn more_routes(router: Router<Idem<Db>>) -> Router<Idem<Db>> {
    router
}

/// Status, whether replayed, `Retry-After`, body.
async fn send(
    router: &Router,
    req: axum::http::Request<axum::body::Body>,
) -> (StatusCode, bool, Option<String>, Bytes) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, retry_after, body)
}

/// A duplicate on another process whose handler ran into the first's own row
/// (the application's unique key), waited for it, and answered a 5xx itself:
/// its transaction rolls back, and since the key holds the first's outcome by
/// then, it answers that (replayed), not its 5xx.
#[tokio::test]
async fn a_duplicate_whose_handler_failed_on_the_winners_row_replays_the_winner() {
    let (db, here) = app().await;
    db.exec("CREATE TABLE naturals (nk VARCHAR(64) UNIQUE) ENGINE = InnoDB")
        .await;
    let there = router(Idem::new(db.pool.clone()));
    let body = json!({"name": "nat-m", "mode": "natural-5xx"});
    let gate = Gate::named("nat-m");
    let first = {
        let (here, body) = (here.clone(), body.clone());
        tokio::spawn(async move { send(&here, request("/widgets", "k-nat", body)).await })
    };
    gate.arrival().await;
    let second = {
        let (there, body) = (there.clone(), body.clone());
        tokio::spawn(async move { send(&there, request("/widgets", "k-nat", body)).await })
    };
    // Until the second's insert runs into the first's uncommitted row (it waits
    // there: its lookup is behind it, so its handler runs).
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let waiting = db
                .count(
                    "SELECT count(*) FROM information_schema.PROCESSLIST \
                      WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO naturals%'",
                )
                .await;
            if waiting == 1 {
                break;
            }

            // A poll interval (what is awaited is the condition above): a tight
            // loop of information_schema reads can keep the two requests' own
            // statements from their turn on this test's one thread.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the second waits on the first's row");
    gate.open(1);
    let (status, replayed, _, won) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _, answered) = second.await.unwrap();
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, true),
        "{:?}",
        String::from_utf8_lossy(&answered)
    );
    assert_eq!(answered, won);
    assert_eq!(runs("nat-m"), 2, "both ran their handler");
    assert_eq!(db.count("SELECT count(*) FROM naturals").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A key another transaction holds (a hand-written claim, not committed): the
/// lookup cannot see it, the handler runs, and its insert waits for the holder
/// up to the in-flight wait (a second), then the request answers `409` with
/// `Retry-After` and its effect is rolled back. In both forms of the insert; the
/// session's own lock wait is as it was after either.
#[tokio::test]
async fn a_key_held_by_another_transaction_is_answered_409_after_the_bound() {
    for set_statement in [true, false] {
        let db = MySqlDb::with_pool_size(1).await;
        db.exec(WIDGETS).await;
        let holder_pool = sqlx::MySqlPool::connect(&db.url).await.unwrap();
        idem_runtime::test_util::assume_set_statement(Some(set_statement));
        let r = router(Idem::new(db.pool.clone()).with_in_flight_wait(Duration::from_millis(1)));
        let before: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let key = IdempotencyKey::parse("k-held").unwrap();
        let fingerprint =
            FingerprintBuilder::new("acme", "create-widget", "POST", "/widgets").finish();
        let mut holder = holder_pool
            .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
            .await
            .unwrap();
        let held = claim(
            &mut holder,
            &ClaimRequest {
                tenant: "acme",
                operation: "create-widget",
                key: &key,
                fingerprint,
                retention: Duration::from_secs(3600),
                in_flight_wait: Duration::from_secs(1),
            },
        )
        .await
        .unwrap();
        assert!(matches!(held, Claim::Execute(_)), "{held:?}");
        let name = format!("held-{set_statement}");
        let started = Instant::now();
        let (status, _, retry_after, _) =
            send(&r, request("/widgets", "k-held", json!({"name": name}))).await;
        assert_eq!(
            status,
            StatusCode::CONFLICT,
            "SET STATEMENT: {set_statement}"
        );
        assert_eq!(retry_after.as_deref(), Some("1"));
        // innodb_lock_wait_timeout counts whole seconds: 1 ms waits one.
        assert!(started.elapsed() >= Duration::from_secs(1));
        assert_eq!(runs(&name), 1, "the handler ran");
        assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0);
        let after: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(after, before, "SET STATEMENT: {set_statement}");
        holder.rollback().await.unwrap();
        // Let go, the key is free: the retry executes.
        let (status, replayed, _, _) =
            send(&r, request("/widgets", "k-held", json!({"name": name}))).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
        assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    }
    idem_runtime::test_util::assume_set_statement(None);
}

/// A leased execution's row that appears while the handler runs (committed by
/// another process) is left as it is: the insert reports it took nothing, the
/// request rolls back and answers in flight (`409`), or `422` when the leased
/// execution is of another request.
#[tokio::test]
async fn a_leased_row_that_appears_meanwhile_is_left_alone() {
    let (db, r) = app().await;
    let gate = Gate::named("leased-m");
    let body = json!({"name": "leased-m", "mode": "gated-every"});
    // The request's fingerprint, from a run under another key.
    let source = {
        let (r, body) = (r.clone(), body.clone());
        tokio::spawn(async move { send(&r, request("/widgets", "k-source", body)).await })
    };
    gate.arrival().await;
    gate.open(1);
    assert_eq!(source.await.unwrap().0, StatusCode::CREATED);
    for (key, fingerprint, answer) in [
        (
            "k-leased",
            format!(
                "(SELECT fingerprint FROM idempotency_requests AS s WHERE s.key_digest = {})",
                db.key("k-source")
            ),
            StatusCode::CONFLICT,
        ),
        (
            "k-leased-other",
            "UNHEX(REPEAT('00', 32))".to_owned(),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ] {
        let task = {
            let (r, body) = (r.clone(), body.clone());
            tokio::spawn(async move { send(&r, request("/widgets", key, body)).await })
        };
        gate.arrival().await;
        db.exec(&format!(
            "INSERT INTO idempotency_requests \
                (tenant_id, operation, key_digest, fingerprint, state, generation, owner_token, \
                 lease_expires_at, created_at, expires_at) \
             SELECT 'acme', 'create-widget', {}, {fingerprint}, 'processing', 7, 'owner', \
                    9999999999999, 0, 9999999999999",
            db.key(key)
        ))
        .await;
        gate.open(1);
        let (status, _, retry_after, _) = task.await.unwrap();
        assert_eq!(status, answer, "{key}");
        assert_eq!(retry_after.is_some(), answer == StatusCode::CONFLICT);
    }
    assert_eq!(runs("leased-m"), 3);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM idempotency_requests \
              WHERE state = 'processing' AND generation = 7 AND owner_token = 'owner' \
                AND response_status IS NULL"
        )
        .await,
        2
    );
}

/// With claims at commit off, the key is claimed before the handler (the
/// locking read, as a hand-written claim): one execution, replayed as ever.
#[tokio::test]
async fn with_claims_at_commit_off_a_key_executes_once_and_replays() {
    let db = MySqlDb::new().await;
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()).with_claims_at_commit(false));
    let body = json!({"name": "first-off"});
    let (status, replayed, _, first) = send(&r, request("/widgets", "k-off", body.clone())).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _, again) = send(&r, request("/widgets", "k-off", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A claim dropped while idem's lock wait is on the session (a caller's timeout
/// while the claim waits for a row another transaction holds) does not give the
/// connection back to the pool with that bound: the next checkout has the
/// server's own lock wait. Deterministic: the holder keeps the row locked until
/// the claim, waiting on it, has been dropped.
#[tokio::test]
async fn a_cancelled_leased_claim_leaves_no_lock_wait_on_a_pooled_connection() {
    let db = MySqlDb::with_pool_size(1).await;
    let key = IdempotencyKey::parse("cancelled-lease").unwrap();
    let req = idem_runtime::LeaseRequest {
        tenant: "acme",
        operation: "pay",
        key: &key,
        fingerprint: FingerprintBuilder::new("acme", "pay", "POST", "/pay").finish(),
        retention: Duration::from_secs(3600),
        lease: Duration::from_secs(30),
    };
    let server_default: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        server_default > 1,
        "the server's own lock wait is idem's bound"
    );
    // The key's row exists (a first claim) and another transaction holds it.
    let first = idem_runtime::claim_leased(&db.pool, &req).await.unwrap();
    assert!(matches!(first, idem_runtime::LeasedClaim::Acquired(_)));
    let other = sqlx::MySqlPool::connect(&db.url).await.unwrap();
    let mut holder = other.begin().await.unwrap();
    sqlx::query("SELECT generation FROM idempotency_requests WHERE key_digest = ? FOR UPDATE")
        .bind(&key.digest().as_bytes()[..])
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    // The second claim waits on the held row under idem's 1 s bound; it is
    // dropped well before that bound gives up.
    let waited = tokio::time::timeout(
        Duration::from_millis(300),
        idem_runtime::claim_leased(&db.pool, &req),
    )
    .await;
    assert!(waited.is_err(), "the claim waited on the held row");
    // Released before the bound gives up: the dropped claim's statement then
    // succeeds on the server, and the pool's check on release finds nothing
    // wrong with the connection (a statement that failed would have it closed).
    holder.rollback().await.unwrap();
    let next: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        next, server_default,
        "the pool handed out a connection with idem's lock wait on it"
    );
}

/// A takeover writes the generation its execution decided on, bound, in both
/// insert forms (here with clear answers; tests/sealed_answers swaps in sealed
/// ones): an expired row swept between the lookup and the insert leaves a new
/// row at that generation (2, not 1).
#[tokio::test]
async fn a_takeover_of_a_row_swept_meanwhile_writes_its_executions_generation() {
    use idem_runtime::test_util::{Finish, HandlerPath};
    for set_statement in [true, false] {
        let case = format!("SET STATEMENT {set_statement}");
        let db = MySqlDb::new().await;
        idem_runtime::test_util::assume_set_statement(Some(set_statement));
        let idem: Idem<MySql> = Idem::new(db.pool.clone());
        let wait = Duration::from_secs(1);
        let key = IdempotencyKey::parse("generation").unwrap();
        let req = ClaimRequest {
            tenant: "acme",
            operation: "op",
            key: &key,
            fingerprint: FingerprintBuilder::new("acme", "op", "POST", "/x").finish(),
            retention: Duration::from_secs(3600),
            in_flight_wait: wait,
        };
        let ctx = idem_runtime::test_util::claim_context(&idem, wait);
        let stored = |body: &'static [u8]| idem_runtime::StoredResponse {
            status: 201,
            headers: vec![],
            body: Bytes::from_static(body),
        };
        let (tx, claimed) = MySql::begin_claim(&ctx, &req).await.unwrap();
        let Claim::Execute(first) = claimed else {
            panic!("{case}: {claimed:?}")
        };
        let done = MySql::finish(&ctx, tx, first, &stored(b"old")).await;
        assert!(matches!(done, Finish::Committed), "{case}: {done:?}");
        db.exec("UPDATE idempotency_requests SET expires_at = 0")
            .await;
        let (tx, claimed) = MySql::begin_claim(&ctx, &req).await.unwrap();
        let Claim::Execute(anew) = claimed else {
            panic!("{case}: {claimed:?}")
        };
        db.exec("DELETE FROM idempotency_requests").await;
        let done = MySql::finish(&ctx, tx, anew, &stored(b"new")).await;
        assert!(matches!(done, Finish::Committed), "{case}: {done:?}");
        let (generation, body): (i64, Vec<u8>) =
            sqlx::query_as("SELECT generation, response_body FROM idempotency_requests")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!((generation, &body[..]), (2, &b"new"[..]), "{case}");
    }
    idem_runtime::test_util::assume_set_statement(None);
}

/// A finished row whose insert waited for another holder of the key longer
/// than its retention still commits with its retention left, in both insert
/// forms (docs/decisions.md, "Retention"). Deterministic: the holder's claim
/// keeps the insert waiting for longer than the retention (it has not finished
/// then), then rolls back.
#[tokio::test]
async fn a_row_that_waited_longer_than_its_retention_commits_live() {
    use idem_runtime::test_util::{Finish, HandlerPath};
    for set_statement in [true, false] {
        let db = MySqlDb::new().await;
        idem_runtime::test_util::assume_set_statement(Some(set_statement));
        let idem: Idem<MySql> = Idem::new(db.pool.clone());
        let wait = Duration::from_secs(3);
        let key = IdempotencyKey::parse("short-retention").unwrap();
        let req = ClaimRequest {
            tenant: "acme",
            operation: "op",
            key: &key,
            fingerprint: FingerprintBuilder::new("acme", "op", "POST", "/x").finish(),
            retention: Duration::from_millis(300),
            in_flight_wait: wait,
        };
        let (tx, claimed) =
            MySql::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                .await
                .unwrap();
        let Claim::Execute(execution) = claimed else {
            panic!("{claimed:?}")
        };
        let holder_pool = sqlx::MySqlPool::connect(&db.url).await.unwrap();
        let mut holder = holder_pool
            .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
            .await
            .unwrap();
        let held = claim(
            &mut holder,
            &ClaimRequest {
                tenant: "acme",
                operation: "op",
                key: &key,
                fingerprint: req.fingerprint,
                retention: Duration::from_secs(3600),
                in_flight_wait: wait,
            },
        )
        .await
        .unwrap();
        assert!(matches!(held, Claim::Execute(_)), "{held:?}");
        let stored = idem_runtime::StoredResponse {
            status: 201,
            headers: vec![],
            body: Bytes::from_static(b"ok"),
        };
        let finishing = {
            let idem = idem.clone();
            tokio::spawn(async move {
                MySql::finish(
                    &idem_runtime::test_util::claim_context(&idem, wait),
                    tx,
                    execution,
                    &stored,
                )
                .await
            })
        };
        // The holder keeps the key until it rolls back: wall time passes the
        // retention while the insert waits (it cannot have finished).
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!finishing.is_finished(), "the insert waits for the holder");
        holder.rollback().await.unwrap();
        let finished = finishing.await.unwrap();
        assert!(
            matches!(finished, Finish::Committed),
            "SET STATEMENT {set_statement}: {finished:?}"
        );
        let live: i64 = sqlx::query_scalar(concat!(
            "SELECT count(*) FROM idempotency_requests WHERE expires_at > ",
            idem_runtime::mysql_now_ms!()
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            live, 1,
            "SET STATEMENT {set_statement}: the row committed already expired"
        );
        let (_, again) =
            MySql::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                .await
                .unwrap();
        assert!(
            matches!(again, Claim::Replay(_)),
            "SET STATEMENT {set_statement}: a retry replays: {again:?}"
        );
    }
    idem_runtime::test_util::assume_set_statement(None);
}
