//! Databases with row locks, mounted beside `suite.rs` in their modules (they
//! set `HOLD_ONE`, which locks one key's row and takes the key digest as its one
//! parameter): a row another transaction holds is skipped by the renewal
//! batch, not waited for; the next renewal of a row held waits for it
//! (`LOCK_WAITS` counts the statements of the test's database waiting for a
//! row lock).

use super::suite::*;
use super::*;

/// One held row does not hold up the batch: while another transaction
/// holds one execution's row, the other execution's lease is still
/// renewed (twice), the held row is not written meanwhile, and the other
/// execution stores its outcome.
pub async fn a_held_row_does_not_hold_up_the_other_leases_renewals() {
    let mut s = setup("held-row", true).await;
    let mut tasks = Vec::new();
    for key in ["held-a", "held-b"] {
        let router = s.router.clone();
        tasks.push(tokio::spawn(async move {
            send(&router, pay("/payments", key, 100)).await
        }));
        s.entered.recv().await.unwrap();
    }
    let held_key = IdempotencyKey::parse("held-a").unwrap();
    let mut holder = s.h.db.pool.begin_with("BEGIN").await.unwrap();
    sqlx::query(HOLD_ONE)
        .bind(held_key.digest())
        .execute(&mut *holder)
        .await
        .unwrap();
    let held_at = record(&s.h, "held-a").await.lease_until;
    let mut seen = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the other lease stopped renewing behind the held row"
        );
        seen.insert(record(&s.h, "held-b").await.lease_until);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        record(&s.h, "held-a").await.lease_until,
        held_at,
        "the held row was not written"
    );
    holder.rollback().await.unwrap();
    s.release.add_permits(2);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        record(&s.h, "held-b").await.state,
        "completed",
        "the other execution kept its lease and stored its outcome"
    );
}

/// A row held at a renewal is renewed next on its own, waiting for
/// the row: a storm of duplicate claims of one key keeps its row nearly
/// always held, and a renewal that only ever skipped it would let the lease
/// lapse under a live worker. The renewal is seen waiting for the held row
/// (it never waits while only skipped), and renews it once the holder lets go.
pub async fn a_held_row_is_renewed_next_by_waiting_for_it() {
    let mut s = setup("held-wait", true).await;
    let router = s.router.clone();
    let task =
        tokio::spawn(
            async move { send(&router, pay("/payments-long-lease", "held-w", 100)).await },
        );
    s.entered.recv().await.unwrap();
    let key = IdempotencyKey::parse("held-w").unwrap();
    let mut holder = s.h.db.pool.begin_with("BEGIN").await.unwrap();
    sqlx::query(HOLD_ONE)
        .bind(key.digest())
        .execute(&mut *holder)
        .await
        .unwrap();
    let held_at = record(&s.h, "held-w").await.lease_until;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let waiting: i64 = sqlx::query_scalar(LOCK_WAITS)
            .fetch_one(&s.h.db.pool)
            .await
            .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no renewal ever waited for the held row"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        record(&s.h, "held-w").await.lease_until,
        held_at,
        "not written while held"
    );
    holder.rollback().await.unwrap();
    while record(&s.h, "held-w").await.lease_until == held_at {
        assert!(
            Instant::now() < deadline,
            "the lease was not renewed once the row was let go"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.release.add_permits(1);
    let (status, _, _) = task.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(record(&s.h, "held-w").await.state, "completed");
}
