//! Leased mode on every store it runs on: a real PostgreSQL, a SQLite file, a
//! MySQL/MariaDB database and Redis: fencing, takeover, renewal, uncertain
//! outcomes and reconciliation, bounded retries through an outage. The payment
//! provider is simulated in-process with its own idempotency by key, so
//! "charged once" is checked where the money would move.
//!
//! Every test is written once in `leased/suite.rs`, against the store harness
//! of `tests/common/lease_harness.rs`. Its `#[idempotent]` handlers need a
//! concrete `Lease<Db>`, so each store's module below sets `H` and `Db`, takes
//! `leased/` as its directory with `#[path]` and mounts the suite there;
//! `leased_tests!` stamps the `#[tokio::test]` wrappers, so a test is
//! `postgres::<name>`, `redis::<name>` and so on. What only some stores have is
//! in the same directory and mounted where it applies (`sql.rs`: the
//! transactional mode on the same table; `row_lock.rs`: a held row), or written
//! in the store's module (a held row or write lock), or, for Redis, in
//! `tests/leased_redis.rs`.

#![allow(
    clippy::duplicate_mod,
    reason = "each store's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::caller::Caller;
use common::faults::{Fault, Faults};
use common::lease_harness::{
    LeaseHarness, OPERATION, Record, Stubborn, TENANT, next_instant, paid, until_lease_lapsed,
};
use http_body_util::BodyExt;
use idem_runtime::lease::{Acquisition, LeaseError};
use idem_runtime::reconcile::{Reconcile, Reconciler, Resolution, UncertainOutcome};
use idem_runtime::retry::RetryPolicy;
use idem_runtime::{
    FingerprintBuilder, Idem, IdempotencyKey, Lease, LeaseRequest, LeasedClaim, StoreError,
    StoredResponse, Uncertain, claim_leased, idempotent,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};
use tower::ServiceExt;

/// A payment provider with its own idempotency: a second charge with the same
/// idempotency key returns the first charge.
#[derive(Default)]
struct Provider {
    charges: Mutex<HashMap<String, (String, i64)>>,
    calls: AtomicUsize,
    down: AtomicBool,
    /// Charge, then time out instead of answering (once).
    timeout_after_charge: AtomicBool,
}

#[derive(Debug)]
enum ProviderError {
    Unavailable,
    TimedOut,
}

impl Provider {
    async fn charge(&self, idempotency_key: &str, amount: i64) -> Result<String, ProviderError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(ProviderError::Unavailable);
        }
        let id = {
            let mut charges = self.charges.lock().unwrap();
            let n = charges.len();
            charges
                .entry(idempotency_key.to_owned())
                .or_insert_with(|| (format!("ch_{n}"), amount))
                .0
                .clone()
        };
        if self.timeout_after_charge.swap(false, Ordering::SeqCst) {
            return Err(ProviderError::TimedOut);
        }
        Ok(id)
    }

    fn find(&self, idempotency_key: &str) -> Option<String> {
        self.charges
            .lock()
            .unwrap()
            .get(idempotency_key)
            .map(|c| c.0.clone())
    }

    fn charge_count(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
}

const HOUR: Duration = Duration::from_secs(3600);

fn lease_req<'a>(key: &'a IdempotencyKey, lease: Duration) -> LeaseRequest<'a> {
    LeaseRequest {
        tenant: "acme",
        operation: "create-payment",
        key,
        fingerprint: FingerprintBuilder::new("acme", "create-payment", "POST", "/payments")
            .body(&json!({"amount": 100}))
            .unwrap()
            .finish(),
        retention: HOUR,
        lease,
    }
}

/// Every test of `leased/suite.rs`, stamped in the store's module.
macro_rules! leased_tests {
    () => {
        stamp!(
            suite =>
            a_zero_lease_or_retention_by_hand_is_refused_and_reserves_nothing,
            a_lease_and_retention_of_duration_max_complete_and_replay,
            a_stale_owner_cannot_publish_and_the_provider_charges_once,
            a_batch_renewal_tells_the_taken_over_owner_it_lost,
            a_renewal_arriving_after_a_lapse_cannot_extend_it,
            an_uncertain_mark_sent_again_is_the_same_mark,
            an_outcome_stored_again_is_the_same_store,
            a_store_arriving_after_a_resolution_changes_nothing,
            a_crash_between_claim_and_effect_executes_once_after_the_lease,
            release_frees_the_key_and_a_mismatch_is_reported,
            many_running_executions_are_renewed_together_in_few_statements,
            a_running_limit_of_zero_is_refused_with_a_clear_error,
            a_full_running_limit_answers_503_reserves_nothing_and_frees_its_slot_when_the_work_ends,
            a_lost_lease_gives_back_its_slot_so_its_takeover_runs,
            a_takeover_refused_for_the_running_limit_lapses_at_once,
            a_failed_takeover_lapses_so_the_retry_is_a_takeover_again,
            a_live_worker_is_renewed_and_not_taken_over,
            a_streamed_answer_keeps_its_lease_until_it_is_read,
            a_dead_worker_is_taken_over_after_its_lease,
            a_stalled_handler_is_fenced_and_its_client_gets_the_new_owners_result,
            an_uncertain_outcome_is_never_retried_and_is_reconciled,
            an_uncertain_outcome_without_a_charge_is_released,
            an_outage_under_load_stays_within_the_retry_bound_and_recovers_exactly_once,
            a_5xx_resolution_is_never_stored,
            a_grpc_status_never_stored_is_not_stored_by_a_reconciler,
            an_unstorable_outcome_becomes_uncertain_and_is_never_repeated,
            a_resolution_that_lost_a_race_changes_nothing,
            rows_that_never_resolve_do_not_starve_newer_ones,
            a_row_that_cannot_be_reconciled_does_not_stop_the_others,
            a_lease_taken_as_lost_but_not_taken_over_still_publishes,
            a_lease_is_lost_by_its_deadline_while_renewals_hang,
            a_stale_owner_cannot_touch_the_row_the_new_owner_holds,
            of_concurrent_claims_of_one_key_exactly_one_acquires,
            a_late_resolution_never_applies_to_a_later_execution_of_the_key,
            a_handler_is_first_polled_with_its_lease_registered_for_renewal,
            a_gateway_timeout_lapses_the_lease_and_the_retry_is_a_takeover,
        );
        stamp!(two_workers suite => a_handler_blocking_its_thread_is_still_renewed);
    };
}

#[path = "leased"]
mod postgres {
    use super::*;
    use suite::acquire;

    type H = crate::common::lease_harness::Postgres;
    type Db = <H as LeaseHarness>::Db;
    /// The database's clock, as `expires_at` is written.
    const NOW: &str = "clock_timestamp()";
    const HOLD_ONE: &str = "SELECT 1 FROM idempotency_requests \
          WHERE tenant_id = 'acme' AND operation = 'create-payment' AND key_digest = $1 FOR UPDATE";
    /// Statements of this database waiting for a lock they have not been granted.
    const LOCK_WAITS: &str = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
          WHERE NOT l.granted AND a.datname = current_database()";

    mod row_lock;
    mod sql;
    mod suite;

    leased_tests!();
    stamp!(sql => a_transactional_reclaim_forgets_the_leased_executions_downstream_key);
    stamp!(
        row_lock =>
        a_held_row_does_not_hold_up_the_other_leases_renewals,
        a_held_row_is_renewed_next_by_waiting_for_it,
    );

    /// A handler's `Uncertain` whose mark fails once (a trigger refuses the
    /// first update to `uncertain`; a sequence counts, as a failed statement
    /// rolls back anything else it wrote) is marked on the next attempt: the
    /// row does not stay `processing`, to be taken over and charged again.
    #[tokio::test]
    async fn an_uncertain_mark_that_fails_once_is_tried_again() {
        let s = suite::setup("uncertain-retry", false).await;
        let db = &s.h.db;
        db.exec("CREATE SEQUENCE test_uncertain_marks").await;
        db.exec(
            "CREATE FUNCTION test_fail_first_mark() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN \
               IF NEW.state = 'uncertain' THEN \
                 IF nextval('test_uncertain_marks') = 1 THEN \
                   RAISE EXCEPTION 'the first mark fails'; \
                 END IF; \
               END IF; \
               RETURN NEW; \
             END $$",
        )
        .await;
        db.exec(
            "CREATE TRIGGER test_fail_first_mark BEFORE UPDATE ON idempotency_requests \
             FOR EACH ROW EXECUTE FUNCTION test_fail_first_mark()",
        )
        .await;
        s.provider
            .timeout_after_charge
            .store(true, Ordering::SeqCst);
        let (status, _, _) = suite::send(&s.router, suite::pay("/payments", "unc-r", 100)).await;
        assert_eq!(status, StatusCode::ACCEPTED);
        let marks: i64 = sqlx::query_scalar("SELECT last_value FROM test_uncertain_marks")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(marks, 2, "failed once, then marked");
        assert_eq!(suite::record(&s.h, "unc-r").await.state, "uncertain");
        let (status, _, _) = suite::send(&s.router, suite::pay("/payments", "unc-r", 100)).await;
        assert_eq!(status, StatusCode::ACCEPTED);
        assert_eq!(s.provider.calls.load(Ordering::SeqCst), 1);
    }

    /// The service's `Idem` on a pool of its own through `faults`, for the
    /// test database `idem` is on.
    fn through(faults: &Faults, idem: &Idem<Db>) -> Idem<Db> {
        let name = idem
            .pool()
            .connect_options()
            .get_database()
            .unwrap()
            .to_owned();
        Idem::new(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect_lazy_with(faults.options(&name)),
        )
    }

    /// What only the leased store's statement holds.
    const STORE_MARK: &str = "response_body = $4";

    /// A leased store that committed but whose answer was lost, then two more
    /// stores that never reached the server (the connection cut as each was
    /// sent): the mark after them finds the row finished, not this execution's
    /// to mark, as a stale owner's would be. The store sent once more finds the
    /// row finished under this execution's token, so the client gets the
    /// handler's own answer, not a replay, and the key was charged once.
    #[tokio::test]
    async fn a_store_whose_answer_was_lost_then_failing_twice_answers_its_own_outcome() {
        let faults = Faults::start().await;
        let s = suite::setup_with("store-lost", false, |idem| through(&faults, &idem)).await;
        faults.on(
            STORE_MARK,
            [Fault::AnswerLost, Fault::NeverSent, Fault::NeverSent],
        );
        let (status, headers, body) =
            suite::send(&s.router, suite::pay("/payments", "lost-1", 100)).await;
        assert_eq!(faults.left(), 0, "every store met its fault");
        assert_eq!(status, StatusCode::CREATED);
        assert!(
            headers.get(idem_runtime::REPLAYED_HEADER).is_none(),
            "the handler's own answer, not a replay: {headers:?}"
        );
        let record = suite::record(&s.h, "lost-1").await;
        assert_eq!(record.state, "completed");
        assert_eq!(record.body.as_deref(), Some(&body[..]));
        let (status, headers, again) =
            suite::send(&s.router, suite::pay("/payments", "lost-1", 100)).await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(headers.get(idem_runtime::REPLAYED_HEADER).is_some());
        assert_eq!(again, body);
        assert_eq!(s.provider.calls.load(Ordering::SeqCst), 1);
    }

    /// Three leased stores that never reach the server: the effect happened and
    /// is not recorded, so the row is marked `uncertain` and the client told
    /// `202`, as every retry is; the provider is never called again.
    #[tokio::test]
    async fn an_outcome_no_store_reaches_is_marked_uncertain_and_never_repeated() {
        let faults = Faults::start().await;
        let s = suite::setup_with("store-never", false, |idem| through(&faults, &idem)).await;
        faults.on(STORE_MARK, [Fault::NeverSent; 3]);
        let (status, _, body) =
            suite::send(&s.router, suite::pay("/payments", "never-1", 100)).await;
        assert_eq!(faults.left(), 0, "every store met its fault");
        assert_eq!(status, StatusCode::ACCEPTED);
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["type"], "urn:idem:problem:outcome-uncertain");
        assert_eq!(suite::record(&s.h, "never-1").await.state, "uncertain");
        let (status, _, _) = suite::send(&s.router, suite::pay("/payments", "never-1", 100)).await;
        assert_eq!(status, StatusCode::ACCEPTED);
        assert_eq!(s.provider.calls.load(Ordering::SeqCst), 1);
    }

    /// A claim waits a moment at most for the key's row lock: held elsewhere (a
    /// slow statement, an operator), the answer is "contended" (retry; nothing
    /// of the row was read), not a parked connection.
    #[tokio::test]
    async fn a_claim_behind_a_held_row_lock_answers_contended() {
        let h = H::new("locked").await;
        let db = &h.db;
        let key = IdempotencyKey::parse("locked-1").unwrap();
        // An expired outcome: a claim would take it anew at once...
        acquire(&h, &key, HOUR)
            .await
            .complete(&paid("ch_old"))
            .await
            .unwrap();
        db.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second'")
            .await;
        // ...but not while someone else holds its row.
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_requests FOR UPDATE")
            .execute(&mut *holder)
            .await
            .unwrap();
        match claim_leased(&db.pool, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Contended { retry_after } => {
                assert_eq!(retry_after, Duration::from_secs(1))
            }
            other => panic!("expected contended, got {other:?}"),
        }
        holder.rollback().await.unwrap();
        match claim_leased(&db.pool, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Acquired(lease) => {
                assert_eq!(lease.acquisition(), Acquisition::Reclaimed)
            }
            other => panic!("expected to reclaim, got {other:?}"),
        }
    }
}

#[path = "leased"]
mod sqlite {
    use super::*;

    type H = crate::common::lease_harness::Sqlite;
    type Db = <H as LeaseHarness>::Db;
    const NOW: &str = idem_runtime::sqlite_now_ms!();

    mod sql;
    mod suite;

    leased_tests!();
    stamp!(sql => a_transactional_reclaim_forgets_the_leased_executions_downstream_key);

    /// SQLite has one write lock: a claim waits for it through the connection's
    /// busy timeout, then answers "busy" (whoever holds it: nothing says it is
    /// this key), reserving nothing; once the lock is free it acquires.
    #[tokio::test]
    async fn a_claim_behind_a_held_write_lock_answers_busy() {
        use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

        let h = H::new("locked").await;
        let db = &h.db;
        let impatient = SqlitePoolOptions::new()
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&db.path)
                    .busy_timeout(Duration::from_millis(50)),
            )
            .await
            .unwrap();
        let key = IdempotencyKey::parse("locked-1").unwrap();
        let holder = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        match claim_leased(&impatient, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Busy { retry_after } => {
                assert_eq!(retry_after, Duration::from_secs(1))
            }
            other => panic!("expected busy, got {other:?}"),
        }
        holder.rollback().await.unwrap();
        match claim_leased(&impatient, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Acquired(lease) => assert_eq!(lease.acquisition(), Acquisition::New),
            other => panic!("expected to acquire, got {other:?}"),
        }
    }
}

#[path = "leased"]
mod mysql {
    use super::*;
    use suite::acquire;

    type H = crate::common::lease_harness::MySql;
    type Db = <H as LeaseHarness>::Db;
    const NOW: &str = idem_runtime::mysql_now_ms!();
    // The whole primary key: InnoDB then locks that one record.
    const HOLD_ONE: &str = "SELECT 1 FROM idempotency_requests \
          WHERE tenant_id = 'acme' AND operation = 'create-payment' AND key_digest = ? FOR UPDATE";
    /// Statements of this database running the renewal that waits for a row
    /// (the batch's `UPDATE` reaches only rows it has locked, so it never
    /// waits). Read from the process list: MariaDB's `INNODB_TRX` does not
    /// always list a statement waiting for a row found by its whole primary
    /// key as waiting.
    const LOCK_WAITS: &str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
          WHERE DB = DATABASE() AND ID <> CONNECTION_ID() \
            AND INFO LIKE 'UPDATE idempotency_requests SET lease_expires_at%'";

    mod row_lock;
    mod sql;
    mod suite;

    leased_tests!();
    stamp!(sql => a_transactional_reclaim_forgets_the_leased_executions_downstream_key);
    stamp!(
        row_lock =>
        a_held_row_does_not_hold_up_the_other_leases_renewals,
        a_held_row_is_renewed_next_by_waiting_for_it,
    );

    /// The session's lock wait is restored after the claim has committed: a
    /// failing restore (here a trigger clears the saved value, so the restore
    /// sets NULL and fails) must not lose the acquired claim, whose row would
    /// otherwise wait out its whole lease with nobody holding its token.
    #[tokio::test]
    async fn a_failed_restore_of_the_lock_wait_keeps_the_acquired_claim() {
        let h = H::new("restore").await;
        let db = &h.db;
        db.exec(
            "CREATE TRIGGER test_clear_saved AFTER INSERT ON idempotency_requests \
             FOR EACH ROW SET @idem_saved_lock_wait = NULL",
        )
        .await;
        let key = IdempotencyKey::parse("restore-1").unwrap();
        let lease = match claim_leased(&db.pool, &lease_req(&key, HOUR))
            .await
            .expect("the claim comes back whatever the restore does")
        {
            LeasedClaim::Acquired(lease) => lease,
            other => panic!("expected to acquire, got {other:?}"),
        };
        lease.complete(&paid("ch_1")).await.unwrap();
        match claim_leased(&db.pool, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_1")),
            other => panic!("expected the stored outcome, got {other:?}"),
        }
    }

    /// A claim waits for the key's row lock at most 1 s (the smallest
    /// `innodb_lock_wait_timeout`), then answers "contended" (retry; nothing of
    /// the row was read).
    #[tokio::test]
    async fn a_claim_behind_a_held_row_lock_answers_contended() {
        let h = H::new("locked").await;
        let db = &h.db;
        let key = IdempotencyKey::parse("locked-1").unwrap();
        acquire(&h, &key, HOUR)
            .await
            .complete(&paid("ch_old"))
            .await
            .unwrap();
        db.exec("UPDATE idempotency_requests SET expires_at = 0")
            .await;
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_requests FOR UPDATE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let started = Instant::now();
        match claim_leased(&db.pool, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Contended { retry_after } => {
                assert_eq!(retry_after, Duration::from_secs(1))
            }
            other => panic!("expected contended, got {other:?}"),
        }
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
        holder.rollback().await.unwrap();
        match claim_leased(&db.pool, &lease_req(&key, HOUR))
            .await
            .unwrap()
        {
            LeasedClaim::Acquired(lease) => {
                assert_eq!(lease.acquisition(), Acquisition::Reclaimed)
            }
            other => panic!("expected to reclaim, got {other:?}"),
        }
    }

    /// Each round of the reconciler reads about its own page of uncertain rows,
    /// wherever it resumes: as a row comparison, MariaDB read every uncertain
    /// row before the page (no index for a row comparison), about n²/2 over a
    /// pass of n. Counted by the server's handler reads on the one connection
    /// the reconciler runs on; the rows stay uncertain, so the rounds page
    /// through all of them.
    #[tokio::test]
    async fn a_reconciler_round_reads_its_page_not_the_rows_before_it() {
        struct Unknown;
        impl Reconcile for Unknown {
            fn operation(&self) -> &str {
                "create-payment"
            }
            async fn reconcile(&self, _: &UncertainOutcome) -> Resolution {
                Resolution::StillUncertain
            }
        }
        const ROWS: usize = 2000;
        const BATCH: usize = 50;
        let h = H::new("uncertain-pages").await;
        let values: Vec<String> = (0..ROWS)
            .map(|i| {
                format!(
                    "('acme', 'create-payment', UNHEX(SHA2('f{i}', 256)), 'uncertain', \
                      'a{i:031}', 'd{i:031}', 1, {i}, 9999999999999, UNHEX(SHA2('k{i}', 256)))"
                )
            })
            .collect();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_requests (tenant_id, operation, fingerprint, state, \
               owner_token, downstream_key, generation, created_at, expires_at, key_digest) \
             VALUES {}",
            values.join(", ")
        )))
        .execute(&h.db.pool)
        .await
        .unwrap();
        let one = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&h.db.url)
            .await
            .unwrap();
        let reads = || crate::common::MySqlDb::rows_read(&one);
        let reconciler =
            Reconciler::<_, Db>::on_store(one.clone(), Unknown).with_batch(BATCH as i64);
        let before = reads().await;
        let mut asked = 0;
        for _ in 0..ROWS / BATCH {
            asked += reconciler.run_once().await.unwrap().still_uncertain;
        }
        assert_eq!(asked, ROWS as u64, "every row asked about once");
        let read = reads().await - before;
        assert!(
            read < 3 * ROWS as u64,
            "{read} rows read for {ROWS} uncertain rows in rounds of {BATCH} \
             (from the start each time: about {})",
            ROWS * ROWS / (2 * BATCH)
        );
    }
}

#[path = "leased"]
mod redis {
    use super::*;

    type H = crate::common::lease_harness::redis_store::Redis;
    type Db = <H as LeaseHarness>::Db;

    mod suite;

    leased_tests!();
}
