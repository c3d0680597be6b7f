//! The runtime API's consumer behaviour on every database, written once
//! against the enclosing database module's `TestDb` (a fresh database of that
//! kind), `CREDITS_DDL` (the effect's table) and `INSERT_CREDIT` (the
//! statement that adds a credit, and returns its id where the database has
//! `RETURNING`). `tests/consumer.rs` mounts this file in each database's
//! module and stamps a `#[tokio::test]` wrapper per test there.

use super::*;

/// A fresh database with the `credits` table.
async fn ledger_db() -> TestDb {
    let db = TestDb::new().await;
    db.exec(CREDITS_DDL).await;
    db
}

/// Applies one credit for the message; `fail` makes the effect fail after writing.
async fn consume(
    db: &TestDb,
    id: &str,
    payload: &[u8],
    fail: bool,
) -> Result<Delivery<i64>, ConsumeError<String>> {
    let msg = Message {
        scope: "ledger-worker",
        operation: "apply-credit",
        id,
        payload,
    };
    process_once(&db.pool, &msg, WEEK, move |tx| {
        Box::pin(async move {
            let id: Option<i64> = sqlx::query_scalar(INSERT_CREDIT)
                .fetch_optional(&mut **tx)
                .await
                .map_err(|e| e.to_string())?;
            // MySQL's INSERT returns no row: the id is the connection's last.
            let id = match id {
                Some(id) => id,
                None => sqlx::query_scalar("SELECT CAST(LAST_INSERT_ID() AS SIGNED)")
                    .fetch_one(&mut **tx)
                    .await
                    .map_err(|e| e.to_string())?,
            };
            if fail {
                return Err("downstream validation failed".to_owned());
            }
            Ok(id)
        })
    })
    .await
}

pub async fn five_deliveries_of_one_message_apply_it_once() {
    let db = Arc::new(ledger_db().await);
    let payload = br#"{"account":"a","amount":5}"#;
    let barrier = Arc::new(tokio::sync::Barrier::new(3));
    let mut tasks = Vec::new();
    // Three deliveries at once (a redelivery racing the first)...
    for _ in 0..3 {
        let (db, barrier) = (db.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            loop {
                match consume(&db, "evt-1", payload, false).await {
                    // A concurrent delivery still running: the broker would redeliver.
                    Err(ConsumeError::InFlight) => tokio::task::yield_now().await,
                    other => return other.unwrap(),
                }
            }
        }));
    }
    let mut applied = 0;
    for t in tasks {
        match t.await.unwrap() {
            Delivery::Applied(_) => applied += 1,
            Delivery::Duplicate => {}
            other => panic!("same payload: {other:?}"),
        }
    }
    // ...then two more, one after a crash before ack (same as any redelivery).
    assert_eq!(
        consume(&db, "evt-1", payload, false).await.unwrap(),
        Delivery::Duplicate
    );
    assert_eq!(
        consume(&db, "evt-1", payload, false).await.unwrap(),
        Delivery::Duplicate
    );
    assert_eq!(applied, 1);
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 1);
}

pub async fn another_payload_under_the_same_identity_is_reported_not_applied() {
    let db = ledger_db().await;
    assert!(matches!(
        consume(&db, "evt-2", b"{\"amount\":5}", false)
            .await
            .unwrap(),
        Delivery::Applied(_)
    ));
    assert_eq!(
        consume(&db, "evt-2", b"{\"amount\":6}", false)
            .await
            .unwrap(),
        Delivery::Conflict
    );
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 1);
}

pub async fn a_failed_effect_commits_nothing_and_the_redelivery_applies_it() {
    let db = ledger_db().await;
    let err = consume(&db, "evt-3", b"{}", true).await.unwrap_err();
    assert!(matches!(err, ConsumeError::Effect(_)), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    assert!(matches!(
        consume(&db, "evt-3", b"{}", false).await.unwrap(),
        Delivery::Applied(_)
    ));
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 1);
}

fn ring() -> idem_runtime::at_rest::KeyRing {
    idem_runtime::at_rest::KeyRing::new(
        "k1",
        [("k1", idem_runtime::at_rest::Zeroizing::new(vec![7_u8; 32]))],
    )
    .unwrap()
}

/// A rekey of every answer in clear (`idem rekey --seal-clear`) with `ring`.
async fn rekey_clear(
    db: &TestDb,
    ring: &idem_runtime::at_rest::KeyRing,
) -> idem_runtime::admin::RekeyReport {
    let mut options = idem_runtime::admin::RekeyOptions::default();
    options.seal_clear = true;
    idem_runtime::admin::rekey(&db.pool, ring, options, |_| {
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap()
}

/// A message applied before `idem rekey --seal-clear` sealed its record (a
/// record of 0.1.0, which had no mark) is a duplicate on
/// redelivery: the consumer never reads the record, so it needs no key ring
/// to know the message was applied (reading it, a redelivery got a store
/// error, was nacked, and came back until the broker gave up on it).
pub async fn a_record_sealed_by_a_rekey_is_still_a_duplicate() {
    let db = ledger_db().await;
    assert!(matches!(
        consume(&db, "evt-4", b"{}", false).await.unwrap(),
        Delivery::Applied(_)
    ));
    // The record as an older release wrote it: no header.
    db.exec("UPDATE idempotency_requests SET response_headers = '[]'")
        .await;
    let report = rekey_clear(&db, &ring()).await;
    assert_eq!((report.resealed, report.messages), (1, 0), "{report:?}");
    assert_eq!(
        consume(&db, "evt-4", b"{}", false).await.unwrap(),
        Delivery::Duplicate
    );
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 1);
}

/// A message's record holds no answer: a rekey that refuses answers in clear
/// (`idem rekey --refuse-clear`) leaves it in clear and counts it apart, not
/// as broken, so a table shared with a consumer can pass one. A redelivery is
/// still a duplicate.
pub async fn a_rekey_refusing_clear_answers_leaves_a_message_record_alone() {
    let db = ledger_db().await;
    assert!(matches!(
        consume(&db, "evt-5", b"{}", false).await.unwrap(),
        Delivery::Applied(_)
    ));
    let report = rekey_clear(&db, &ring().refusing_clear_answers()).await;
    assert_eq!(
        (report.resealed, report.broken, report.messages),
        (0, 0, 1),
        "{report:?}"
    );
    assert!(report.complete(), "{report:?}");
    // Left as it was, in clear, by a rekey that would seal answers too.
    assert_eq!(rekey_clear(&db, &ring()).await.messages, 1);
    assert_eq!(
        consume(&db, "evt-5", b"{}", false).await.unwrap(),
        Delivery::Duplicate
    );
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 1);
}
