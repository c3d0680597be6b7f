//! One decision core: every database's hand-written claim (PostgreSQL's PL/pgSQL
//! `idem_claim`, SQLite's and MySQL's statements in Rust) decides as the pure
//! function the handler paths decide with (`decide::transactional`), over every
//! state a key's row can be in: no row, or `completed`, `failed`, `processing`,
//! `uncertain`, each live or past its retention, with the request's fingerprint
//! or another. Exhaustive (17 rows a database) rather than random: the space is
//! that small.
//!
//! The leased claim likewise: PostgreSQL's `idem_claim_leased` and the claims
//! of SQLite and MySQL (which decide with `decide::leased` themselves, so there
//! the test holds their reading of the row and their writes to it) against
//! `decide::leased`, over the same states and, for `processing`, a live lease,
//! a lapsed one and none (25 rows a database). Redis's Lua `CLAIM` too (module
//! `redis_store`), over the states a Redis record can be in: a finished record
//! past its retention is gone (its expiry), and a `processing` record always has
//! a lease (the script refuses one without as corrupt).

mod common;

use std::time::Duration;

use idem_runtime::lease::Acquisition;
use idem_runtime::test_util::decide::{
    self, KeySnapshot, LeasedOutcome, LeasedStep, RowState, TransactionalStep,
};
use idem_runtime::{
    Claim, ClaimRequest, Fingerprint, FingerprintBuilder, IdempotencyKey, LeaseRequest,
    LeasedClaim, StoredResponse, claim, claim_leased,
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
fn agrees(decided: &TransactionalStep, claimed: &Claim) -> bool {
    match (decided, claimed) {
        (TransactionalStep::Execute { generation }, Claim::Execute(e)) => {
            e.generation() == *generation
        }
        (TransactionalStep::Answer(Claim::Replay(a)), Claim::Replay(b)) => a == b,
        (TransactionalStep::Answer(Claim::Mismatch), Claim::Mismatch) => true,
        (TransactionalStep::Answer(Claim::InFlight { .. }), Claim::InFlight { .. }) => true,
        _ => false,
    }
}

/// A live lease's time left in the leased cases: half a second over a whole
/// number of seconds, so that the claim's answer, read a moment later, asks
/// for the same whole seconds as the decision core.
const LEASE_LEFT_MS: i64 = 30_500;

/// `Retry-After` as a client reads it: whole seconds, rounded up, at least one.
fn seconds(wait: Duration) -> u64 {
    wait.as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0))
        .max(1)
}

/// Whether a database's leased claim said what the decision says.
fn agrees_leased<DB: idem_runtime::Backend>(
    decided: &LeasedStep,
    claimed: &LeasedClaim<DB>,
) -> bool {
    match (decided, claimed) {
        (LeasedStep::Insert, LeasedClaim::Acquired(lease)) => {
            lease.acquisition() == Acquisition::New && lease.generation() == 1
        }
        (LeasedStep::Reclaim { generation }, LeasedClaim::Acquired(lease)) => {
            lease.acquisition() == Acquisition::Reclaimed && lease.generation() == *generation
        }
        (LeasedStep::TakeOver { generation }, LeasedClaim::Acquired(lease)) => {
            lease.acquisition() == Acquisition::TakenOver && lease.generation() == *generation
        }
        (LeasedStep::Answer(LeasedOutcome::Replay(a)), LeasedClaim::Replay(b)) => a == b,
        (LeasedStep::Answer(LeasedOutcome::Mismatch), LeasedClaim::Mismatch) => true,
        (LeasedStep::Answer(LeasedOutcome::Uncertain), LeasedClaim::Uncertain) => true,
        (
            LeasedStep::Answer(LeasedOutcome::InFlight { retry_after: a }),
            LeasedClaim::InFlight { retry_after: b },
        ) => seconds(*a) == seconds(*b),
        _ => false,
    }
}

/// A leased case's row: its state, whether it is live, whether the request's
/// fingerprint matches, and the lease's milliseconds left.
type LeasedCase = (RowState, bool, bool, Option<i64>);

/// Every leased case: no row, or a state, live or expired, the request's
/// fingerprint or another, and for `processing` a lease with time left, a
/// lapsed one (-1 s) or none.
fn leased_cases() -> Vec<Option<LeasedCase>> {
    let mut cases = vec![None];
    for state in STATES {
        let leases: &[Option<i64>] = if state == RowState::Processing {
            &[None, Some(LEASE_LEFT_MS), Some(-1000)]
        } else {
            &[None]
        };
        for live in [true, false] {
            for matches in [true, false] {
                for &lease in leases {
                    cases.push(Some((state, live, matches, lease)));
                }
            }
        }
    }
    cases
}

/// Puts `$key`'s row in a case's state and evaluates to the snapshot the
/// decision core is given: a finished row with its outcome, through the store
/// itself (claimed with `$first`), then moved by hand to the case's state, its
/// lease (`$lease_sql`: the column's new value) and, unless live, past its
/// retention (`$expire`).
macro_rules! seed_row {
    ($db:expr, $key:expr, $first:expr, ($state:expr, $live:expr, $matches:expr, $lease:expr), $lease_sql:expr, $expire:expr) => {{
        let (state, live, matches, lease): (RowState, bool, bool, Option<i64>) =
            ($state, $live, $matches, $lease);
        let mut tx = $db.pool.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut tx, &request(&$key, $first)).await.unwrap() else {
            panic!("{:?}: a new key executes", $key);
        };
        let stored = outcome(state);
        exec.complete(&mut tx, &stored).await.unwrap();
        tx.commit().await.unwrap();
        $db.exec(&format!(
            "UPDATE idempotency_requests SET state = '{}', lease_expires_at = {}",
            state_name(state),
            $lease_sql
        ))
        .await;
        if !live {
            $db.exec($expire).await;
        }
        KeySnapshot {
            fingerprint_matches: matches,
            state,
            generation: 1,
            live,
            stored: (state.is_finished() && live).then_some(stored),
            lease_ms_left: lease,
        }
    }};
}

macro_rules! leased_oracle_test {
    ($db:ty, $expire:expr, $lease_in:expr) => {
        #[tokio::test]
        async fn the_leased_claim_decides_as_the_decision_core_in_every_state() {
            let db = <$db>::new().await;
            for (i, case) in leased_cases().into_iter().enumerate() {
                let key = IdempotencyKey::parse(format!("l-{i}")).unwrap();
                let first = fingerprint("first");
                let mut snapshot = None;
                if let Some((state, live, matches, lease)) = case {
                    let lease_sql = match lease {
                        Some(ms) => ($lease_in)(ms),
                        None => "NULL".to_owned(),
                    };
                    snapshot = Some(seed_row!(
                        db,
                        key,
                        first,
                        (state, live, matches, lease),
                        lease_sql,
                        $expire
                    ));
                }
                let asked = match case {
                    Some((_, _, false, _)) => fingerprint("another"),
                    _ => first,
                };
                let decided = decide::leased(snapshot);
                let claimed = claim_leased(
                    &db.pool,
                    &LeaseRequest {
                        tenant: "acme",
                        operation: "op",
                        key: &key,
                        fingerprint: asked,
                        retention: HOUR,
                        lease: Duration::from_secs(30),
                    },
                )
                .await
                .unwrap();
                assert!(
                    agrees_leased(&decided, &claimed),
                    "case {i} {case:?}: the decision core says {decided:?}, the claim {claimed:?}"
                );
                // ... and the row holds the generation the lease reports (a
                // claim that takes it from the decision, as MySQL's does, is
                // held to what it wrote).
                if let LeasedClaim::Acquired(lease) = &claimed {
                    assert_eq!(
                        db.count("SELECT generation FROM idempotency_requests")
                            .await,
                        lease.generation(),
                        "case {i} {case:?}: the row's generation"
                    );
                }
                db.exec("DELETE FROM idempotency_requests").await;
            }
        }
    };
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
                    snapshot = Some(seed_row!(
                        db,
                        key,
                        first,
                        (state, live, matches, None),
                        "NULL".to_owned(),
                        $expire
                    ));
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
    leased_oracle_test!(
        common::TestDb,
        "UPDATE idempotency_requests SET expires_at = now() - interval '1 second'",
        |ms: i64| format!("clock_timestamp() + {ms} * interval '1 millisecond'")
    );
}

mod sqlite {
    use super::*;
    oracle_test!(
        common::SqliteDb,
        "UPDATE idempotency_requests SET expires_at = 0"
    );
    leased_oracle_test!(
        common::SqliteDb,
        "UPDATE idempotency_requests SET expires_at = 0",
        |ms: i64| format!("{} + {ms}", idem_runtime::sqlite_now_ms!())
    );
}

mod mysql {
    use super::*;
    oracle_test!(
        common::MySqlDb,
        "UPDATE idempotency_requests SET expires_at = 0"
    );
    leased_oracle_test!(
        common::MySqlDb,
        "UPDATE idempotency_requests SET expires_at = 0",
        |ms: i64| format!("{} + {ms}", idem_runtime::mysql_now_ms!())
    );
}

mod redis_store {
    //! The Lua claim against `decide::leased`. Records are put in each state
    //! through the store (claim, complete, mark uncertain), then their lease
    //! moved on the server's clock by hand.

    use super::*;
    use idem_runtime::redis::{Redis, RedisLeaseStore};
    use redis::AsyncCommands;
    use redis::aio::ConnectionManager;

    async fn server_ms(c: &mut ConnectionManager) -> i64 {
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(c).await.unwrap();
        secs * 1000 + micros / 1000
    }

    fn agrees(decided: &LeasedStep, claimed: &LeasedClaim<Redis>) -> bool {
        match (decided, claimed) {
            (LeasedStep::Insert, LeasedClaim::Acquired(lease)) => {
                lease.acquisition() == Acquisition::New && lease.generation() == 1
            }
            (LeasedStep::TakeOver { generation }, LeasedClaim::Acquired(lease)) => {
                lease.acquisition() == Acquisition::TakenOver && lease.generation() == *generation
            }
            (LeasedStep::Answer(LeasedOutcome::Replay(a)), LeasedClaim::Replay(b)) => a == b,
            (LeasedStep::Answer(LeasedOutcome::Mismatch), LeasedClaim::Mismatch) => true,
            (LeasedStep::Answer(LeasedOutcome::Uncertain), LeasedClaim::Uncertain) => true,
            (
                LeasedStep::Answer(LeasedOutcome::InFlight { retry_after: a }),
                LeasedClaim::InFlight { retry_after: b },
            ) => seconds(*a) == seconds(*b),
            _ => false,
        }
    }

    #[tokio::test]
    async fn the_lua_claim_decides_as_the_decision_core_in_every_state() {
        let url = std::env::var("IDEM_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let conn = ConnectionManager::new(redis::Client::open(url).unwrap())
            .await
            .unwrap();
        let prefix = format!("idem-t{}-oracle", std::process::id());
        let store = RedisLeaseStore::with_connection(conn.clone(), &prefix)
            .await
            .unwrap();
        let mut c = conn;
        // What a killed run under the same pid left.
        clear(&mut c, &prefix).await;
        let cases = leased_cases().into_iter().filter(|case| match case {
            None => true,
            // Gone with its expiry on Redis: the same as no record.
            Some((state, false, _, _)) if state.is_finished() => false,
            // A processing record always has a lease and is never "expired"
            // apart from it.
            Some((RowState::Processing, live, _, lease)) => *live && lease.is_some(),
            Some(_) => true,
        });
        for (i, case) in cases.enumerate() {
            let key = IdempotencyKey::parse(format!("r-{i}")).unwrap();
            let first = fingerprint("first");
            let req = |fp| LeaseRequest {
                tenant: "acme",
                operation: "op",
                key: &key,
                fingerprint: fp,
                retention: HOUR,
                lease: Duration::from_secs(30),
            };
            let mut snapshot = None;
            if let Some((state, live, matches, lease)) = case {
                let LeasedClaim::Acquired(held) = store.claim(&req(first)).await.unwrap() else {
                    panic!("case {i}: a new key is acquired");
                };
                let stored = outcome(state);
                let record = store.record_key("acme", "op", &key);
                match state {
                    RowState::Completed | RowState::Failed => {
                        held.complete(&stored).await.unwrap();
                    }
                    RowState::Uncertain => held.mark_uncertain().await.unwrap(),
                    RowState::Processing => {
                        let ms = lease.unwrap();
                        let until = server_ms(&mut c).await + ms;
                        let _: () = c.hset(&record, "lease_until", until).await.unwrap();
                        std::mem::forget(held); // no renewal, no release: a dead worker
                    }
                }
                snapshot = Some(KeySnapshot {
                    fingerprint_matches: matches,
                    state,
                    generation: 1,
                    live,
                    stored: state.is_finished().then_some(stored),
                    lease_ms_left: lease,
                });
            }
            let asked = match case {
                Some((_, _, false, _)) => fingerprint("another"),
                _ => first,
            };
            let decided = decide::leased(snapshot);
            let claimed = store.claim(&req(asked)).await.unwrap();
            assert!(
                agrees(&decided, &claimed),
                "case {i} {case:?}: the decision core says {decided:?}, the Lua claim {claimed:?}"
            );
        }
        clear(&mut c, &prefix).await;
    }

    /// Deletes this test's records (a few dozen keys: `KEYS` is fine).
    async fn clear(c: &mut ConnectionManager, prefix: &str) {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(c)
            .await
            .unwrap();
        for k in keys {
            let _: () = c.del(k).await.unwrap();
        }
    }
}
