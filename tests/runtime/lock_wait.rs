//! A duplicate that waits for the first transaction's row lock, on the
//! databases with row locks: it replays a committed first and executes after a
//! rolled-back one. Mounted in those databases' modules of `tests/runtime.rs`
//! (`postgres_only`, `mysql_only`), which set `db`, `pay` and
//! `wait_for_lock_waiter` (the sign, read from the server, that the duplicate is
//! blocked); `lock_wait_tests!` stamps the wrappers there.

use super::*;

pub async fn a_duplicate_waits_for_a_committed_first_and_replays_it() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    let r = req("acme", "pay", &key, 100);
    let mut first = db.pool.begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut first, &r).await.unwrap() else {
        panic!()
    };
    let id = pay(&mut first, "acme", 100).await;
    let pool = db.pool.clone();
    let dup = tokio::spawn(async move {
        let key = IdempotencyKey::parse("k1").unwrap();
        let mut tx = pool.begin().await.unwrap();
        claim(&mut tx, &req("acme", "pay", &key, 100))
            .await
            .unwrap()
    });
    wait_for_lock_waiter(&db).await;
    exec.complete(&mut first, &created(id)).await.unwrap();
    first.commit().await.unwrap();
    match dup.await.unwrap() {
        Claim::Replay(stored) => assert_eq!(stored, created(id)),
        other => panic!("the duplicate must see the committed row, got {other:?}"),
    }
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
}

pub async fn a_duplicate_waits_for_a_rolled_back_first_and_then_executes() {
    let db = db().await;
    let key = IdempotencyKey::parse("k1").unwrap();
    let r = req("acme", "pay", &key, 100);
    let mut first = db.pool.begin().await.unwrap();
    let Claim::Execute(_exec) = claim(&mut first, &r).await.unwrap() else {
        panic!()
    };
    pay(&mut first, "acme", 100).await;
    let pool = db.pool.clone();
    let dup = tokio::spawn(async move {
        let key = IdempotencyKey::parse("k1").unwrap();
        let r = req("acme", "pay", &key, 100);
        let mut tx = pool.begin().await.unwrap();
        let c = claim(&mut tx, &r).await.unwrap();
        let Claim::Execute(exec) = c else {
            return false;
        };
        let id = pay(&mut tx, "acme", 100).await;
        exec.complete(&mut tx, &created(id)).await.unwrap();
        tx.commit().await.unwrap();
        true
    });
    wait_for_lock_waiter(&db).await;
    first.rollback().await.unwrap();
    assert!(
        dup.await.unwrap(),
        "the duplicate executes once the first rolled back"
    );
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
}
