//! The handler's path on MySQL and MariaDB (`idem_runtime`'s
//! `db::mysql::hot_path`), beside what `suite.rs` holds every database to: a
//! duplicate whose handler failed on the winner's row answering the winner's
//! outcome, the in-flight bound on a key another transaction holds (in both
//! forms of the insert: MariaDB's `SET STATEMENT` and MySQL 8's session variable
//! set around it, given back after), a leased row left alone, the claim-first
//! path when claims at commit are off, and no lock wait or transaction left on
//! a pooled connection (a claim dropped half-way, a lock wait that could not
//! be given back, a `BEGIN` whose answer came after the request's deadline).

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
    a_duplicate_whose_answer_cannot_be_stored_answers_the_winners_outcome,
    concurrent_duplicates_on_many_processes_make_one_effect_and_one_answer,
    an_expired_key_is_executed_anew_by_the_insert,
    a_nested_transaction_left_open_is_not_committed_and_its_connection_is_closed,
    a_duplicate_that_lost_at_commit_and_cannot_read_the_winner_answers_503_unknown,
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
        // idem's savepoint released under it (which the docs forbid): the
        // session is still in a transaction, but not with `idem_tx`, as
        // MariaDB before MDEV-36959's fix leaves a swallowed deadlock's.
        "releases-savepoint" => {
            sqlx::raw_sql("RELEASE SAVEPOINT idem_tx")
                .execute(&mut **tx)
                .await
                .unwrap();
        }
        // The first run holds pair 1 and waits at the gate, where the test's
        // heavier transaction takes pair 2 and waits for pair 1; asking for
        // pair 2 then closes a deadlock, and InnoDB rolls this (lighter)
        // transaction back whole. The handler swallows the error and answers
        // as if its widget were written.
        "swallowed-deadlock" => {
            sqlx::query("UPDATE pairs SET v = v + 1 WHERE id = 1")
                .execute(&mut **tx)
                .await
                .unwrap();
            let gate = Gate::named(name);
            if gate.first_visit() {
                gate.stop().await;
                let swallowed = sqlx::query("UPDATE pairs SET v = v + 1 WHERE id = 2")
                    .execute(&mut **tx)
                    .await;
                let deadlock = matches!(&swallowed, Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some("40001"));
                if !deadlock {
                    // Not the case the test is about: say so.
                    return Some(Ok((
                        StatusCode::IM_A_TEAPOT,
                        Json(json!({"not a deadlock": format!("{swallowed:?}")})),
                    )));
                }
            }
        }
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
        let _form = insert_form(set_statement).await;
        let r = router(Idem::new(db.pool.clone()).with_in_flight_wait(Duration::from_millis(1)));
        let before: u64 = lock_wait(&db.pool).await;
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
        let after: u64 = lock_wait(&db.pool).await;
        assert_eq!(after, before, "SET STATEMENT: {set_statement}");
        holder.rollback().await.unwrap();
        // Let go, the key is free: the retry executes.
        let (status, replayed, _, _) =
            send(&r, request("/widgets", "k-held", json!({"name": name}))).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
        assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    }
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

/// A handler that swallows InnoDB's deadlock error (1213) answers as if its
/// effect were written, but the server has rolled its whole transaction back
/// and the session runs in autocommit: idem's insert must not then commit the
/// key's answer alone, which every retry would replay for an effect that is
/// not there. On MariaDB the insert finds no transaction and writes nothing:
/// the request is answered `503` (nothing stored) and the retry runs anew.
/// Deterministic: the handler waits at its gate while the test's heavier
/// transaction (InnoDB's victim is the lighter one) takes pair 2 and queues
/// for pair 1.
#[tokio::test]
async fn a_deadlock_the_handler_swallows_stores_no_answer() {
    let Some((form, db, r)) = on_mariadb_guarded().await else {
        return;
    };
    swallowed_deadlock_stores_no_answer(form, db, r, "dl-m").await;
}

/// A transaction that `@@in_transaction` reports but that lacks the savepoint
/// `idem_tx` stores no answer in MariaDB's form: the commit's message releases
/// the savepoint first, which fails, and nothing commits, the handler's widget
/// included. That is the state MariaDB releases before MDEV-36959's fix leave
/// after a swallowed deadlock (its rollback kept `BEGIN`, and the next
/// statement opened a new transaction); here the handler releases the
/// savepoint itself to make it.
#[tokio::test]
async fn a_transaction_without_idem_tx_commits_nothing_in_mariadbs_form() {
    let Some((_form, db, r)) = on_mariadb_guarded().await else {
        return;
    };
    let body = json!({"name": "sp", "mode": "releases-savepoint"});
    assert_nothing_stored(&send(&r, request("/widgets", "k-sp", body)).await);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0);
}

/// As [`a_deadlock_the_handler_swallows_stores_no_answer`], with MySQL 8's form
/// of the insert (no `@@in_transaction` to read): the `RELEASE` of the savepoint
/// the transaction began with fails, and the insert is not sent.
#[tokio::test]
async fn a_deadlock_the_handler_swallows_stores_no_answer_in_mysql_8s_form() {
    let form = insert_form(false).await;
    let (db, r) = app().await;
    swallowed_deadlock_stores_no_answer(form, db, r, "dl-8").await;
}

/// Likewise with MariaDB's `SET STATEMENT` form without its guard (a server
/// without `@@in_transaction`): the savepoint's `RELEASE` is sent before it.
#[tokio::test]
async fn a_deadlock_the_handler_swallows_stores_no_answer_in_the_unguarded_form() {
    let (db, r) = app().await;
    if !is_mariadb(&db).await {
        eprintln!("skipped: MariaDB's form of the insert");
        return;
    }
    let form = insert_form_guarded(true, false).await;
    swallowed_deadlock_stores_no_answer(form, db, r, "dl-u").await;
}

/// The deadlock's case, in the insert's `form` (held to the end).
async fn swallowed_deadlock_stores_no_answer(
    form: InsertForm,
    db: TestDb,
    r: Router,
    name: &'static str,
) {
    let _form = form;
    let detects: i64 = sqlx::query_scalar("SELECT @@innodb_deadlock_detect + 0")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if detects == 0 {
        eprintln!("skipped: innodb_deadlock_detect is off, so no deadlock is reported");
        return;
    }
    db.exec("CREATE TABLE pairs (id INT PRIMARY KEY, v INT NOT NULL) ENGINE = InnoDB")
        .await;
    db.exec("INSERT INTO pairs VALUES (1, 0), (2, 0)").await;
    db.exec("CREATE TABLE ballast (id INT PRIMARY KEY) ENGINE = InnoDB")
        .await;
    let body = json!({"name": name, "mode": "swallowed-deadlock"});
    let gate = Gate::named(name);
    let first = {
        let (r, body) = (r.clone(), body.clone());
        tokio::spawn(async move { send(&r, request("/widgets", &format!("k-{name}"), body)).await })
    };
    gate.arrival().await;
    let mut other = db.pool.begin().await.unwrap();
    let rows: Vec<String> = (1..=200).map(|i| format!("({i})")).collect();
    let ballast = format!("INSERT INTO ballast VALUES {}", rows.join(", "));
    sqlx::query(sqlx::AssertSqlSafe(ballast))
        .execute(&mut *other)
        .await
        .unwrap();
    sqlx::query("UPDATE pairs SET v = v + 10 WHERE id = 2")
        .execute(&mut *other)
        .await
        .unwrap();
    let waiter = tokio::spawn(async move {
        sqlx::query("UPDATE pairs SET v = v + 10 WHERE id = 1")
            .execute(&mut *other)
            .await
            .expect("the heavier transaction is not the deadlock's victim");
        other.commit().await.unwrap();
    });
    tokio::time::timeout(Duration::from_secs(60), async {
        while db
            .count(
                "SELECT count(*) FROM information_schema.PROCESSLIST \
                  WHERE DB = DATABASE() AND INFO LIKE 'UPDATE pairs SET v = v + 10 WHERE id = 1%'",
            )
            .await
            != 1
        {
            // A poll interval: what is awaited is the condition above.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the other transaction waits for pair 1");
    gate.open(1);
    assert_nothing_stored(&first.await.unwrap());
    waiter.await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0,
        "no answer stored for the rolled-back effect"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0);
    assert_eq!(db.count("SELECT v FROM pairs WHERE id = 1").await, 10);
    // The retry runs the handler again (no gate, no deadlock) and is stored.
    let (status, replayed, _, _) =
        send(&r, request("/widgets", &format!("k-{name}"), body.clone())).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _, _) = send(&r, request("/widgets", &format!("k-{name}"), body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// MariaDB's `SET STATEMENT` form without its `@@in_transaction` guard (what
/// a server that takes `SET STATEMENT` but lacks the variable is sent, after
/// it answers 1193) claims, stores and replays as the guarded form does.
#[tokio::test]
async fn the_set_statement_form_without_its_guard_executes_once_and_replays() {
    // One connection: its session's statement counters are the requests'.
    let db = MySqlDb::with_pool_size(1).await;
    if !is_mariadb(&db).await {
        eprintln!("skipped: MariaDB's forms of the insert");
        return;
    }
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()));
    let inserts_from_select = || {
        db.count(
            "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.SESSION_STATUS \
              WHERE VARIABLE_NAME = 'COM_INSERT_SELECT'",
        )
    };
    let form = insert_form_guarded(true, false).await;
    let before = inserts_from_select().await;
    let body = json!({"name": "unguarded"});
    let (status, replayed, _, first) = send(&r, request("/widgets", "k-ung", body.clone())).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _, again) = send(&r, request("/widgets", "k-ung", body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    assert_eq!(
        inserts_from_select().await,
        before,
        "sent unguarded (VALUES)"
    );
    drop(form);
    // Guarded, the same insert is an `INSERT .. SELECT` (MariaDB).
    let _form = insert_form(true).await;
    let body = json!({"name": "guarded"});
    let (status, _, _, _) = send(&r, request("/widgets", "k-gua", body)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(inserts_from_select().await, before + 1, "sent guarded");
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
    let server_default: u64 = lock_wait(&db.pool).await;
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
    // dropped once the server shows its statement waiting there.
    // Boxed, so that dropping it drops the claim (`pin!` would keep it alive
    // to the end of the scope, its connection held).
    let mut waiting = Box::pin(idem_runtime::claim_leased(&db.pool, &req));
    tokio::select! {
        done = &mut waiting => panic!("the claim did not wait on the held row: {done:?}"),
        () = db.until_running(&other, "%FROM idempotency_requests%FOR UPDATE%") => {}
    }
    drop(waiting);
    // Released before the bound gives up: the dropped claim's statement then
    // succeeds on the server, and the pool's check on release finds nothing
    // wrong with the connection (a statement that failed would have it closed).
    holder.rollback().await.unwrap();
    let next: u64 = lock_wait(&db.pool).await;
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
        let _form = insert_form(set_statement).await;
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
        let _form = insert_form(set_statement).await;
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
        // The holder keeps the key until it rolls back: once the insert is
        // seen waiting, wall time passes the retention while it waits (it
        // cannot have finished).
        db.until_running(&holder_pool, "%INSERT INTO idempotency_requests%")
            .await;
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
}

/// A claim whose request deadline strikes while its `BEGIN` is on the way
/// back does not give the pool a connection the server holds a transaction
/// on: sqlx counts a MySQL transaction only once the server's answer is in, so
/// a connection dropped before then would go back with nothing queued to end
/// it, and the next autocommit write on it would never commit. The relay holds
/// the server's answers until the deadline has struck; that the server had
/// answered the `BEGIN` by then (the session in a transaction) is checked.
#[tokio::test]
async fn a_claim_dropped_while_its_begin_is_answered_leaves_no_transaction_on_a_pooled_connection()
{
    let db = MySqlDb::new().await;
    db.exec(WIDGETS).await;
    let relay = Relay::to(&db.url).await;
    // No acquire ping: the claim's first message is its `BEGIN`.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(relay.options.clone())
        .await
        .unwrap();
    let r = router(
        Idem::new(pool.clone())
            .with_claims_at_commit(false)
            .with_in_flight_wait(Duration::from_millis(100))
            .with_request_deadline(Duration::from_secs(1)),
    );
    let (status, _, _, _) = send(&r, request("/widgets", "k0", json!({"name": "warm"}))).await;
    assert_eq!(status, StatusCode::CREATED);
    relay
        .until("the connection is idle in the pool", || {
            pool.num_idle() == 1
        })
        .await;

    relay.hold.send_replace(true);
    let (status, _, _, body) = send(&r, request("/widgets", "k1", json!({"name": "cut"}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    assert!(
        ends_in_transaction(&relay.held.lock().unwrap()),
        "the server had begun the claim's transaction when its deadline struck"
    );
    relay.hold.send_replace(false);

    sqlx::query("INSERT INTO widgets (tenant, name) VALUES ('acme', 'after')")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM widgets WHERE name = 'after'")
            .await,
        1,
        "the pool handed out a connection inside the dropped claim's transaction"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
}

/// MySQL 8's form of the insert: where giving the session's lock wait back
/// after the insert fails with an error the server answered, the connection is
/// closed, not pooled with idem's bound on it, and nothing commits.
/// Deterministic: a trigger of the test's overwrites the saved setting during
/// the insert with a text, which the server refuses to give the session.
#[tokio::test]
async fn a_lock_wait_that_could_not_be_given_back_leaves_with_its_connection() {
    let db = MySqlDb::with_pool_size(1).await;
    db.exec(WIDGETS).await;
    db.exec(
        "CREATE TRIGGER lose_the_saved_wait BEFORE INSERT ON idempotency_requests \
         FOR EACH ROW SET @idem_saved_lock_wait = 'not a number'",
    )
    .await;
    let server_default: u64 = lock_wait(&db.pool).await;
    assert!(
        server_default > 1,
        "the server's own lock wait is idem's bound"
    );
    let _form = insert_form(false).await;
    let r = router(Idem::new(db.pool.clone()));
    let (status, _, _, body) = send(&r, request("/widgets", "k-lost", json!({"name": "x"}))).await;
    // Nothing stored: answered as a store that failed, or as a key still in
    // flight (what the key holds once this execution rolled back).
    assert!(
        status.is_server_error() || status == StatusCode::CONFLICT,
        "{status}: {body:?}"
    );
    let next: u64 = lock_wait(&db.pool).await;
    assert_eq!(
        next, server_default,
        "the pool handed out a connection with idem's lock wait on it"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

/// Whether the test's server is MariaDB (not MySQL 8).
async fn is_mariadb(db: &MySqlDb) -> bool {
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    version.contains("MariaDB")
}

/// The lock wait of the session `pool` hands out next.
async fn lock_wait(pool: &sqlx::MySqlPool) -> u64 {
    sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The widget app with MariaDB's guarded form of the insert held, whatever
/// another test has chosen; `None` (the test skipped, and said so) elsewhere.
async fn on_mariadb_guarded() -> Option<(InsertForm, TestDb, Router)> {
    let form = insert_form(true).await;
    let (db, r) = app().await;
    if !is_mariadb(&db).await {
        eprintln!("skipped: MariaDB's form of the insert");
        return None;
    }
    Some((form, db, r))
}

/// An answer of `send` that stored nothing: `503`, not a replay, with
/// `Retry-After` (the retry runs the handler again).
fn assert_nothing_stored(
    (status, replayed, retry_after, answer): &(StatusCode, bool, Option<String>, Bytes),
) {
    assert_eq!(
        (*status, *replayed),
        (StatusCode::SERVICE_UNAVAILABLE, false),
        "{}",
        String::from_utf8_lossy(answer)
    );
    assert!(retry_after.is_some(), "nothing stored: retry");
}

/// Sends the insert in MySQL 8's form (`false`: the session's lock wait set
/// around it) or MariaDB's (`true`: `SET STATEMENT`) while the guard is held,
/// for this test's requests only (the choice is its thread's); the other
/// tests learn the server's form and keep to a choice once made.
async fn insert_form(set_statement: bool) -> InsertForm {
    insert_form_guarded(set_statement, true).await
}

/// As [`insert_form`]; `guarded: false` sends MariaDB's form without its
/// `@@in_transaction` guard, as on a server that takes `SET STATEMENT` but
/// lacks the variable.
async fn insert_form_guarded(set_statement: bool, guarded: bool) -> InsertForm {
    idem_runtime::test_util::assume_set_statement(Some(set_statement));
    idem_runtime::test_util::assume_in_transaction(Some(guarded));
    InsertForm(std::marker::PhantomData)
}

/// See [`insert_form`]; dropped, the thread goes back to the form the process
/// learned. Not `Send`: the choice is the test's thread's (a current-thread
/// runtime's, where every request of the test runs), and the tests beside it,
/// on threads of their own, keep theirs.
struct InsertForm(std::marker::PhantomData<*const ()>);

impl Drop for InsertForm {
    fn drop(&mut self) {
        idem_runtime::test_util::assume_set_statement(None);
        idem_runtime::test_util::assume_in_transaction(None);
    }
}

/// The claim's `BEGIN` message (`SET TRANSACTION ..; START TRANSACTION;
/// SAVEPOINT idem_tx`) failing after its `START TRANSACTION` leaves a
/// transaction the driver did not count: the connection is closed, not given
/// back to the pool inside it, where the next claim on it would fail (`SET
/// TRANSACTION` inside a transaction) and so would every one after.
#[tokio::test]
async fn a_begin_that_fails_after_its_start_transaction_closes_the_connection() {
    let db = MySqlDb::new().await;
    db.exec(WIDGETS).await;
    let relay = Relay::to(&db.url).await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(
            relay
                .options
                .clone()
                .ssl_mode(sqlx::mysql::MySqlSslMode::Disabled),
        )
        .await
        .unwrap();
    let r = router(Idem::new(pool.clone()));
    relay
        .spoil_savepoint
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, _, _, body) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    assert!(
        !relay
            .spoil_savepoint
            .load(std::sync::atomic::Ordering::SeqCst),
        "the BEGIN message was spoiled"
    );
    for key in ["k1", "k2"] {
        let (status, _, _, body) = send(&r, request("/widgets", key, json!({"name": "a"}))).await;
        assert_eq!(status, StatusCode::CREATED, "{key}: {body:?}");
    }
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
}

/// A TCP relay in front of the test's MySQL server whose answers to the client
/// can be held back (kept in [`Relay::held`]) and then let through.
struct Relay {
    /// The test database's options, through the relay.
    options: sqlx::mysql::MySqlConnectOptions,
    /// While true, what the server says is held back.
    hold: tokio::sync::watch::Sender<bool>,
    /// What the server said while held, not yet passed on.
    held: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    /// Once set, the next client write holding `SAVEPOINT idem_tx` goes to
    /// the server as `SAVEPOINX idem_tx` (a syntax error after the message's
    /// `START TRANSACTION`), and this is cleared.
    spoil_savepoint: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    async fn to(url: &str) -> Relay {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let direct: sqlx::mysql::MySqlConnectOptions = url.parse().unwrap();
        let server = format!("{}:{}", direct.get_host(), direct.get_port());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let options = direct
            .host("127.0.0.1")
            .port(listener.local_addr().unwrap().port());
        let (hold, _) = tokio::sync::watch::channel(false);
        let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (watch, kept) = (hold.clone(), held.clone());
        let spoil_savepoint = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spoiling = spoil_savepoint.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = tokio::net::TcpStream::connect(&server).await.unwrap();
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = upstream.into_split();
                let spoiling = spoiling.clone();
                tokio::spawn(async move {
                    const SAVEPOINT: &[u8] = b"SAVEPOINT idem_tx";
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match client_rx.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if let Some(at) = buf[..n]
                            .windows(SAVEPOINT.len())
                            .position(|w| w == SAVEPOINT)
                            && spoiling
                                .compare_exchange(
                                    true,
                                    false,
                                    std::sync::atomic::Ordering::SeqCst,
                                    std::sync::atomic::Ordering::SeqCst,
                                )
                                .is_ok()
                        {
                            buf[at + "SAVEPOIN".len()] = b'X';
                        }
                        if server_tx.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = server_tx.shutdown().await;
                });
                let (mut hold, kept) = (watch.subscribe(), kept.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        tokio::select! {
                            read = server_rx.read(&mut buf) => {
                                let n = match read {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                if *hold.borrow() {
                                    kept.lock().unwrap().extend_from_slice(&buf[..n]);
                                } else if client_tx.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                            changed = hold.changed() => {
                                if changed.is_err() {
                                    return;
                                }
                                if !*hold.borrow_and_update() {
                                    let out = std::mem::take(&mut *kept.lock().unwrap());
                                    if client_tx.write_all(&out).await.is_err() {
                                        return;
                                    }
                                }
                            }
                        }
                    }
                });
            }
        });
        Relay {
            options,
            hold,
            held,
            spoil_savepoint,
        }
    }

    /// Waits until `holds` (what happens on the relay's tasks or the pool's,
    /// which announce nothing); after 10 s the test fails with `what`.
    async fn until(&self, what: &str, mut holds: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if holds() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("never: {what}");
    }
}

/// Whether `bytes`, the server's packets from a packet's start, hold an OK
/// packet that ends a message (no more results to come) with the session in a
/// transaction (`SERVER_STATUS_IN_TRANS`).
fn ends_in_transaction(bytes: &[u8]) -> bool {
    const IN_TRANS: u16 = 0x0001;
    const MORE_RESULTS: u16 = 0x0008;
    /// The length of a length-encoded integer, from its first byte.
    fn int_len(first: u8) -> usize {
        match first {
            0xfc => 3,
            0xfd => 4,
            0xfe => 9,
            _ => 1,
        }
    }
    let mut rest = bytes;
    while rest.len() >= 4 {
        let len = usize::from(rest[0]) | usize::from(rest[1]) << 8 | usize::from(rest[2]) << 16;
        let Some(payload) = rest.get(4..4 + len) else {
            return false;
        };
        if payload.first() == Some(&0) {
            // Affected rows and last insert id, then the status flags.
            let mut at = 1;
            for _ in 0..2 {
                match payload.get(at) {
                    Some(&first) => at += int_len(first),
                    None => return false,
                }
            }
            if let Some(flags) = payload.get(at..at + 2) {
                let flags = u16::from_le_bytes([flags[0], flags[1]]);
                if flags & IN_TRANS != 0 && flags & MORE_RESULTS == 0 {
                    return true;
                }
            }
        }
        rest = &rest[4 + len..];
    }
    false
}
