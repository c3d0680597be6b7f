//! One decision core: every database's hand-written claim (PostgreSQL's PL/pgSQL
//! `idem_claim`, SQLite's and MySQL's statements in Rust) decides as the pure
//! function the handler paths decide with (`decide::transactional`), over every
//! state a key's row can be in: no row, or `completed`, `failed`, `processing`,
//! `uncertain`, each live or past its retention, with the request's fingerprint
//! or another. Exhaustive (17 rows a database) rather than random: the space is
//! that small.

mod common;

use std::time::Duration;

use idem_runtime::__private::decide::{self, KeySnapshot, RowState, Transactional};
use idem_runtime::{
    Claim, ClaimRequest, Fingerprint, FingerprintBuilder, IdempotencyKey, StoredResponse, claim,
};

const HOUR: Duration = Duration::from_secs(3600);
const WAIT: Duration = Duration::from_millis(200);

fn fingerprint(body: &str) -> Fingerprint {
    FingerprintBuilder::new("acme", "op", "POST", "/x")
        .body(&serde_json::json!({ "b": body }))
        .unwrap()
        .finish()
}

fn request<'a>(key: &'a IdempotencyKey, fp: Fingerprint) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant: "acme",
        operation: "op",
        key,
        fingerprint: fp,
        retention: HOUR,
        in_flight_wait: WAIT,
    }
}

fn outcome(state: RowState) -> StoredResponse {
    let status = if state == RowState::Failed { 404 } else { 201 };
    StoredResponse {
        status,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: "stored".into(),
    }
}

const STATES: [RowState; 4] = [
    RowState::Completed,
    RowState::Failed,
    RowState::Processing,
    RowState::Uncertain,
];

fn state_name(state: RowState) -> &'static str {
    match state {
        RowState::Completed => "completed",
        RowState::Failed => "failed",
        RowState::Processing => "processing",
        _ => "uncertain",
    }
}

/// Whether a database's claim said what the decision says.
fn agrees(decided: &Transactional, claimed: &Claim) -> bool {
    match (decided, claimed) {
        (Transactional::Execute { generation }, Claim::Execute(e)) => e.generation() == *generation,
        (Transactional::Answer(Claim::Replay(a)), Claim::Replay(b)) => a == b,
        (Transactional::Answer(Claim::Mismatch), Claim::Mismatch) => true,
        (Transactional::Answer(Claim::InFlight { .. }), Claim::InFlight { .. }) => true,
        _ => false,
    }
}

macro_rules! oracle_test {
    ($db:ty, $expire:expr) => {
        #[tokio::test]
        async fn the_claim_decides_as_the_decision_core_in_every_state() {
            let db = <$db>::new().await;
            let mut cases = vec![None];
            for state in STATES {
                for live in [true, false] {
                    for matches in [true, false] {
                        cases.push(Some((state, live, matches)));
                    }
                }
            }
            for (i, case) in cases.into_iter().enumerate() {
                let key = IdempotencyKey::parse(format!("k-{i}")).unwrap();
                let first = fingerprint("first");
                let mut snapshot = None;
                if let Some((state, live, matches)) = case {
                    // A finished row, through the store itself, then moved to the
                    // case's state and expiry by hand.
                    let mut tx = db.pool.begin().await.unwrap();
                    let Claim::Execute(exec) = claim(&mut tx, &request(&key, first)).await.unwrap()
                    else {
                        panic!("case {i}: a new key executes");
                    };
                    let stored = outcome(state);
                    exec.complete(&mut tx, &stored).await.unwrap();
                    tx.commit().await.unwrap();
                    db.exec(&format!(
                        "UPDATE idempotency_requests SET state = '{}'",
                        state_name(state)
                    ))
                    .await;
                    if !live {
                        db.exec($expire).await;
                    }
                    snapshot = Some(KeySnapshot {
                        fingerprint_matches: matches,
                        state,
                        generation: 1,
                        live,
                        stored: state.is_finished().then_some(stored),
                    });
                }
                let asked = match case {
                    Some((_, _, false)) => fingerprint("another"),
                    _ => first,
                };
                let decided = decide::transactional(snapshot, WAIT);
                let mut tx = db.pool.begin().await.unwrap();
                let claimed = claim(&mut tx, &request(&key, asked)).await.unwrap();
                tx.rollback().await.unwrap();
                assert!(
                    agrees(&decided, &claimed),
                    "case {i} {case:?}: the decision core says {decided:?}, the claim {claimed:?}"
                );
                db.exec("DELETE FROM idempotency_requests").await;
            }
        }
    };
}

mod postgres {
    use super::*;
    oracle_test!(
        common::TestDb,
        "UPDATE idempotency_requests SET expires_at = now() - interval '1 second'"
    );
}

mod sqlite {
    use super::*;
    oracle_test!(
        common::SqliteDb,
        "UPDATE idempotency_requests SET expires_at = 0"
    );
}

mod mysql {
    use super::*;
    oracle_test!(
        common::MySqlDb,
        "UPDATE idempotency_requests SET expires_at = 0"
    );
}
