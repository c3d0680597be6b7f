//! What only the SQL stores have, mounted beside `suite.rs` in their modules
//! (they set `NOW`, the database's clock as idem writes it): the transactional
//! mode beside leased mode on one table.

use super::suite::*;
use super::*;

/// A transactional execution that re-claims an expired key a leased
/// execution finished has no downstream key: the row forgets the old one,
/// on the hand-written claim and on the handler's path alike.
pub async fn a_transactional_reclaim_forgets_the_leased_executions_downstream_key() {
    use idem_runtime::test_util::Finish;
    use idem_runtime::{Claim, ClaimRequest, claim};

    for handler_path in [false, true] {
        let h = H::new("reclaim-downstream").await;
        let db = &h.db;
        let key = IdempotencyKey::parse("dk-1").unwrap();
        acquire(&h, &key, HOUR)
            .await
            .complete(&paid("ch_1"))
            .await
            .unwrap();
        assert!(
            h.record(&key).await.unwrap().downstream_key.is_some(),
            "the leased execution recorded its downstream key"
        );
        db.exec(&format!(
            "UPDATE idempotency_requests SET expires_at = {NOW}"
        ))
        .await;
        let leased = lease_req(&key, HOUR);
        let req = ClaimRequest {
            tenant: leased.tenant,
            operation: leased.operation,
            key: &key,
            fingerprint: leased.fingerprint,
            retention: HOUR,
            in_flight_wait: Duration::from_secs(2),
        };
        if handler_path {
            let idem: Idem<Db> = Idem::new(db.pool.clone());
            let (tx, c) = <Db as idem_runtime::test_util::HandlerPath>::begin_claim(
                &idem_runtime::test_util::claim_context(&idem, req.in_flight_wait),
                &req,
            )
            .await
            .unwrap();
            let Claim::Execute(exec) = c else {
                panic!("the expired key executes anew: {c:?}")
            };
            assert!(matches!(
                <Db as idem_runtime::test_util::HandlerPath>::finish(
                    &idem_runtime::test_util::claim_context(&idem, Default::default()),
                    tx,
                    exec,
                    &paid("tx")
                )
                .await,
                Finish::Committed
            ));
        } else {
            let mut tx = db.pool.begin().await.unwrap();
            let c = claim(&mut tx, &req).await.unwrap();
            let Claim::Execute(exec) = c else {
                panic!("the expired key executes anew: {c:?}")
            };
            exec.complete(&mut tx, &paid("tx")).await.unwrap();
            tx.commit().await.unwrap();
        }
        let r = h.record(&key).await.unwrap();
        assert_eq!(
            (r.downstream_key, r.generation),
            (None, 2),
            "handler path: {handler_path}"
        );
    }
}
