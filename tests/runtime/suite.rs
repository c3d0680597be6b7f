//! The runtime API's behaviour every database shares, written once against
//! the enclosing database module's `Db` (its sqlx database), `TestDb` (a fresh
//! database of that kind), `PAYMENTS_DDL`, `EXPIRE_ALL_SQL` and `pay` (a
//! payment's insert, which returns its id in that database's way).
//! `tests/runtime.rs` mounts this file in each database's module and stamps a
//! `#[tokio::test]` wrapper per test there; the helpers are also what the
//! database-only tests beside it use.

use super::*;

/// A fresh database with the `payments` table.
pub async fn db() -> TestDb {
    let db = TestDb::new().await;
    db.exec(PAYMENTS_DDL).await;
    db
}

/// Claims, and on Execute pays and completes. Returns what the claim said.
pub async fn run_once(db: &TestDb, r: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
    let mut tx = db.pool.begin().await?;
    let c = claim(&mut tx, r).await?;
    match c {
        Claim::Execute(exec) => {
            let id = pay(&mut tx, r.tenant, 100).await;
            exec.complete(&mut tx, &created(id)).await?;
            tx.commit().await?;
            Ok(Claim::Replay(created(id)))
        }
        other => Ok(other),
    }
}

/// `n` claims of one new key released at once by a barrier, each paying and
/// completing if it executes: how many executed. A mismatch fails the test.
pub async fn claim_race(db: &Arc<TestDb>, n: usize) -> i64 {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let db = db.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let key = IdempotencyKey::parse("race").unwrap();
            let r = req("acme", "pay", &key, 100);
            let mut tx = db.pool.begin().await.unwrap();
            barrier.wait().await;
            match claim(&mut tx, &r).await.unwrap() {
                Claim::Execute(exec) => {
                    let id = pay(&mut tx, "acme", 100).await;
                    exec.complete(&mut tx, &created(id)).await.unwrap();
                    tx.commit().await.unwrap();
                    1_i64
                }
                Claim::Replay(_) | Claim::InFlight { .. } => 0,
                other => panic!("unexpected: {other:?}"),
            }
        }));
    }
    let mut executed = 0;
    for t in tasks {
        executed += t.await.expect("no task errors or panics");
    }
    executed
}

/// A hand-written retention under a millisecond (zero included:
/// every store counts whole milliseconds) is refused before anything
/// is written, with the error the leased claims give.
pub async fn a_zero_retention_by_hand_is_refused_and_reserves_nothing() {
    let db = db().await;
    let key = IdempotencyKey::parse("zero").unwrap();
    for (retention, named) in [
        (Duration::ZERO, "a retention of 0ns is refused"),
        (
            Duration::from_micros(999),
            "a retention of 999µs is refused",
        ),
    ] {
        let r = ClaimRequest {
            retention,
            ..req("acme", "pay", &key, 100)
        };
        let mut tx = db.pool.begin().await.unwrap();
        let e = claim(&mut tx, &r).await.expect_err("refused");
        assert!(matches!(e, StoreError::InvalidRequest(_)), "{e}");
        let message = e.to_string();
        assert!(message.starts_with("invalid request: "), "{message}");
        assert!(message.contains(named), "{message}");
        assert!(message.contains("at least 1 ms"), "{message}");
        // The transaction is still usable, and holds nothing of idem's.
        tx.commit().await.unwrap();
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0,
            "nothing reserved: {message}"
        );
    }
    let least = ClaimRequest {
        retention: Duration::from_millis(1),
        ..req("acme", "pay", &key, 100)
    };
    assert!(matches!(
        run_once(&db, &least).await.unwrap(),
        Claim::Replay(_)
    ));
}

pub async fn first_claim_executes_and_a_retry_replays_byte_identical() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    let r = req("acme", "pay", &key, 100);
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut tx, &r).await.unwrap() else {
        panic!("a new key must execute")
    };
    assert_eq!(exec.generation(), 1);
    let id = pay(&mut tx, "acme", 100).await;
    let stored = created(id);
    exec.complete(&mut tx, &stored).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    match claim(&mut tx, &r).await.unwrap() {
        Claim::Replay(replayed) => assert_eq!(replayed, stored),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
}

pub async fn a_different_fingerprint_is_a_mismatch_and_nothing_runs() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    assert!(matches!(
        run_once(&db, &req("acme", "pay", &key, 100)).await.unwrap(),
        Claim::Replay(_)
    ));
    let other = req("acme", "pay", &key, 101);
    assert!(matches!(
        run_once(&db, &other).await.unwrap(),
        Claim::Mismatch
    ));
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
}

pub async fn tenants_and_operations_scope_the_key() {
    let db = db().await;
    let key = IdempotencyKey::parse("shared-random-key").unwrap();
    let a = run_once(&db, &req("acme", "pay", &key, 100)).await.unwrap();
    let b = run_once(&db, &req("globex", "pay", &key, 100))
        .await
        .unwrap();
    let c = run_once(&db, &req("acme", "refund", &key, 100))
        .await
        .unwrap();
    let (Claim::Replay(a), Claim::Replay(b), Claim::Replay(c)) = (a, b, c) else {
        panic!("each scope executes")
    };
    assert_ne!(a.body, b.body);
    assert_ne!(a.body, c.body);
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 3);
    // Each one's retry sees its own result.
    let Claim::Replay(b2) = run_once(&db, &req("globex", "pay", &key, 100))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(b2, b);
}

pub async fn fifty_concurrent_duplicates_make_one_payment() {
    let db = Arc::new(TestDb::with_pool_size(60).await);
    db.exec(PAYMENTS_DDL).await;
    let executed = claim_race(&db, 50).await;
    assert_eq!(executed, 1);
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
}

pub async fn a_rolled_back_first_attempt_frees_the_key() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    let r = req("acme", "pay", &key, 100);
    // The handler fails: explicit rollback.
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Execute(_exec) = claim(&mut tx, &r).await.unwrap() else {
        panic!()
    };
    pay(&mut tx, "acme", 100).await;
    tx.rollback().await.unwrap();
    // A crash: the transaction is dropped without commit.
    {
        let mut tx = db.pool.begin().await.unwrap();
        let Claim::Execute(_exec) = claim(&mut tx, &r).await.unwrap() else {
            panic!()
        };
        pay(&mut tx, "acme", 100).await;
        drop(tx);
    }
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    // The retry executes, and exactly one payment exists.
    assert!(matches!(run_once(&db, &r).await.unwrap(), Claim::Replay(_)));
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
}

pub async fn an_expired_key_executes_anew_and_an_unexpired_one_does_not() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    let r = req("acme", "pay", &key, 100);
    assert!(matches!(run_once(&db, &r).await.unwrap(), Claim::Replay(_)));
    // Unexpired: replay, no second payment.
    let mut tx = db.pool.begin().await.unwrap();
    assert!(matches!(
        claim(&mut tx, &r).await.unwrap(),
        Claim::Replay(_)
    ));
    drop(tx);
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
    // Expired: the retention has passed, so the key is forgotten and runs again,
    // even with another fingerprint.
    db.exec(EXPIRE_ALL_SQL).await;
    let other = req("acme", "pay", &key, 250);
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut tx, &other).await.unwrap() else {
        panic!()
    };
    assert_eq!(exec.generation(), 2);
    let id = pay(&mut tx, "acme", 250).await;
    exec.complete(&mut tx, &created(id)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 2);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests WHERE generation = 2")
            .await,
        1
    );
}

pub async fn a_stale_execution_cannot_complete() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    let r = req("acme", "pay", &key, 100);
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut tx, &r).await.unwrap() else {
        panic!()
    };
    // Someone deletes the row inside the same transaction (a purge gone wrong).
    sqlx::query("DELETE FROM idempotency_requests")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = exec.complete(&mut tx, &created(1)).await.unwrap_err();
    assert!(
        matches!(err, StoreError::LostClaim { generation: 1 }),
        "{err}"
    );
}
