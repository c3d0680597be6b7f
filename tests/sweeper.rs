//! The retention sweeper (DESIGN.md §7) against real databases: exactly the expired
//! finished rows go, in batches; a run is bounded and the rest is the backlog;
//! in-flight rows stay and are reported; a retry after the sweep executes anew;
//! the metrics carry the documented names. That behaviour holds on PostgreSQL,
//! SQLite and MySQL, so each test is written once, generic over [`SweepDb`] (the
//! SQL that differs between them), and `sweeper_tests!` stamps its wrappers per
//! database: `postgres::<name>`, `sqlite::<name>`, `mysql::<name>`. The stats
//! snapshot is tested the same way. What only one database has (SKIP LOCKED
//! around rows held elsewhere, sweepers sharing the work) is tested beside it.

mod common;

use std::time::Duration;

use idem_runtime::metrics::{
    OLDEST_IN_FLIGHT_SECONDS, STALE_IN_FLIGHT, SWEEPER_BACKLOG, SWEEPER_DELETED_TOTAL,
    UNCERTAIN_ROWS,
};
use idem_runtime::{
    Backend, Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, StoredResponse, SweepReport,
    Sweeper, claim,
};
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sqlx::Pool;

const HOUR: i64 = 3600;
const DAY: i64 = 24 * HOUR;

/// A claim of `key` for `create-order` with an hour's retention.
fn order_request(key: &IdempotencyKey) -> ClaimRequest<'_> {
    ClaimRequest {
        tenant: "acme",
        operation: "create-order",
        key,
        fingerprint: FingerprintBuilder::new("acme", "create-order", "POST", "/orders")
            .body(&serde_json::json!({ "sku": "A-1" }))
            .unwrap()
            .finish(),
        retention: Duration::from_secs(HOUR as u64),
        in_flight_wait: Duration::from_secs(5),
    }
}

/// What the suite needs of a database beyond idem's own API: a fresh one, and
/// the SQL that differs, to insert rows, move time and say "expired" and "not
/// expired" by that database's clock.
trait SweepDb: Sized {
    type Db: Backend;

    /// Inserts rows. Binds: $1 operation, $2 key prefix, $3 state, $4 seconds
    /// until expiry (negative: expired), $5 age in seconds, $6 number of rows.
    const INSERT_ROWS: &str;
    /// The condition of an expired finished row.
    const EXPIRED_FINISHED: &str;
    /// The condition of a row within its retention.
    const NOT_EXPIRED: &str;
    /// Moves every row past its retention.
    const EXPIRE_ALL: &str;
    /// The known data set of the stats test.
    const STATS_DATA: &str;
    /// The byte length of the stats data set's header text as the database
    /// stores it.
    const HEADER_BYTES: &str;

    /// A fresh database of its own, with idem's migrations applied.
    async fn create() -> Self;
    fn pool(&self) -> &Pool<Self::Db>;
    /// The single integer a query returns.
    async fn count(&self, sql: &str) -> i64;
    /// Runs statements.
    async fn exec(&self, sql: &str);
    /// Runs [`SweepDb::INSERT_ROWS`] with its binds.
    async fn insert_rows(
        &self,
        operation: &str,
        prefix: &str,
        n: i32,
        state: &str,
        expires_in: i64,
        age: i64,
    );
}

/// [`SweepDb::INSERT_ROWS`] with its binds, in their order, for any of the
/// databases.
#[allow(clippy::too_many_arguments, reason = "the statement's six binds")]
async fn bind_rows<DB: Backend>(
    pool: &Pool<DB>,
    sql: &'static str,
    operation: &str,
    prefix: &str,
    n: i32,
    state: &str,
    expires_in: i64,
    age: i64,
) where
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i32: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    sqlx::query(sql)
        .bind(operation)
        .bind(prefix)
        .bind(state)
        .bind(expires_in)
        .bind(age)
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
}

/// Inserts `n` rows of `operation` with keys `{prefix}-1..n` in `state`,
/// expiring `expires_in` seconds from now (negative: already expired) and
/// created `age` seconds ago, both by the database's clock. Finished rows
/// get a status (the table's CHECK wants one) and a 10-byte body.
async fn rows<T: SweepDb>(
    db: &T,
    operation: &str,
    prefix: &str,
    n: i32,
    state: &str,
    expires_in: i64,
    age: i64,
) {
    db.insert_rows(operation, prefix, n, state, expires_in, age)
        .await;
}

async fn count_where<T: SweepDb>(db: &T, condition: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM idempotency_requests WHERE {condition}"
    ))
    .await
}

/// A sweeper that never reports anything as stale unless a test says so.
fn sweeper<T: SweepDb>(db: &T) -> Sweeper<T::Db> {
    Sweeper::new(db.pool().clone()).with_stale_after(Duration::from_secs(100 * DAY as u64))
}

/// Waits until no expired finished row is left, failing after a minute
/// rather than hanging. A wait for a condition, not for an amount of time.
async fn until_swept<T: SweepDb>(db: &T) {
    tokio::time::timeout(Duration::from_secs(60), async {
        while count_where(db, T::EXPIRED_FINISHED).await > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the spawned sweeper never swept the expired rows");
}

async fn a_new_sweeper_takes_its_backend_from_the_pool_and_has_the_defaults<T: SweepDb>() {
    let db = T::create().await;
    // No type annotation: the backend is inferred from the pool.
    let s = Sweeper::new(db.pool().clone());
    let _: &Sweeper<T::Db> = &s;
    assert_eq!(
        (
            s.batch_size(),
            s.max_batches(),
            s.interval(),
            s.stale_after()
        ),
        (
            Sweeper::<sqlx::Postgres>::DEFAULT_BATCH_SIZE,
            Sweeper::<sqlx::Postgres>::DEFAULT_MAX_BATCHES,
            Sweeper::<sqlx::Postgres>::DEFAULT_INTERVAL,
            Sweeper::<sqlx::Postgres>::DEFAULT_STALE_AFTER
        )
    );
    assert_eq!(
        (
            Sweeper::<sqlx::Postgres>::DEFAULT_BATCH_SIZE,
            Sweeper::<sqlx::Postgres>::DEFAULT_MAX_BATCHES,
            Sweeper::<sqlx::Postgres>::DEFAULT_INTERVAL,
            Sweeper::<sqlx::Postgres>::DEFAULT_STALE_AFTER
        ),
        (
            1000,
            100,
            Duration::from_secs(60),
            Duration::from_secs(15 * 60)
        )
    );
}

async fn an_empty_table_gives_an_empty_report<T: SweepDb>() {
    let db = T::create().await;
    let empty = |r: &SweepReport| {
        (
            r.deleted,
            r.batches,
            r.backlog,
            r.stale_in_flight,
            r.oldest_in_flight,
        ) == (0, 1, 0, 0, None)
    };
    let report = sweeper(&db).sweep_once().await.unwrap();
    assert!(empty(&report), "{report:?}");
    // Finished rows only, none expired: still nothing in flight, so no age.
    rows(&db, "pay", "fresh", 3, "completed", HOUR, 60).await;
    let report = sweeper(&db)
        .with_stale_after(Duration::ZERO)
        .sweep_once()
        .await
        .unwrap();
    assert!(empty(&report), "{report:?}");
    assert_eq!(count_where(&db, "1 = 1").await, 3);
}

async fn deletes_exactly_the_expired_finished_rows_in_batches<T: SweepDb>() {
    let db = T::create().await;
    rows(&db, "pay", "done", 15, "completed", -60, HOUR).await;
    rows(&db, "pay", "refused", 10, "failed", -60, HOUR).await;
    // Expired but in flight: never deleted, however old.
    rows(&db, "pay", "running", 5, "processing", -60, HOUR).await;
    rows(&db, "pay", "unknown", 5, "uncertain", -60, HOUR).await;
    // Still within retention.
    rows(&db, "pay", "fresh", 7, "completed", HOUR, 60).await;
    rows(&db, "pay", "fresh-failed", 2, "failed", HOUR, 60).await;
    rows(&db, "pay", "fresh-running", 3, "processing", HOUR, 60).await;

    let report = sweeper(&db).with_batch_size(10).sweep_once().await.unwrap();
    assert_eq!(report.deleted, 25);
    // 10 + 10 + 5: the short third batch tells the run it is done.
    assert_eq!(report.batches, 3);
    assert_eq!(report.backlog, 0);
    assert_eq!(report.stale_in_flight, 0);
    assert!(report.oldest_in_flight.is_some());

    assert_eq!(count_where(&db, T::EXPIRED_FINISHED).await, 0);
    assert_eq!(count_where(&db, "state = 'processing'").await, 8);
    assert_eq!(count_where(&db, "state = 'uncertain'").await, 5);
    assert_eq!(count_where(&db, T::NOT_EXPIRED).await, 12);
    assert_eq!(count_where(&db, "1 = 1").await, 22);
    // The survivors are exactly the in-flight and the fresh rows: the
    // finished ones left are the 9 fresh ones.
    assert_eq!(
        count_where(&db, "state IN ('completed', 'failed')").await,
        9
    );

    // Nothing left to do: one statement that deletes nothing.
    let again = sweeper(&db).with_batch_size(10).sweep_once().await.unwrap();
    assert_eq!((again.deleted, again.batches, again.backlog), (0, 1, 0));
    assert_eq!(count_where(&db, "1 = 1").await, 22);
}

async fn max_batches_bounds_a_run_and_the_rest_is_the_backlog<T: SweepDb>() {
    let db = T::create().await;
    rows(&db, "pay", "old", 25, "completed", -60, HOUR).await;
    // Not expired: never part of the backlog.
    rows(&db, "pay", "new", 4, "completed", HOUR, 60).await;
    let s = sweeper(&db).with_batch_size(10).with_max_batches(2);
    let first = s.sweep_once().await.unwrap();
    assert_eq!((first.deleted, first.batches, first.backlog), (20, 2, 5));
    assert_eq!(count_where(&db, T::EXPIRED_FINISHED).await, 5);
    let second = s.sweep_once().await.unwrap();
    assert_eq!((second.deleted, second.batches, second.backlog), (5, 1, 0));
    assert_eq!(count_where(&db, "1 = 1").await, 4);
    assert_eq!(count_where(&db, T::NOT_EXPIRED).await, 4);
}

async fn stale_in_flight_rows_are_reported_not_deleted<T: SweepDb>() {
    let db = T::create().await;
    // In flight for two hours, and past their retention too.
    rows(&db, "pay", "stuck", 3, "processing", -60, 2 * HOUR).await;
    rows(&db, "pay", "unknown", 2, "uncertain", -60, 2 * HOUR).await;
    // In flight for a minute: not stale.
    rows(&db, "pay", "running", 1, "processing", HOUR, 60).await;

    let report = Sweeper::new(db.pool().clone())
        .with_stale_after(Duration::from_secs(HOUR as u64))
        .sweep_once()
        .await
        .unwrap();
    assert_eq!(report.deleted, 0);
    assert_eq!(report.backlog, 0);
    assert_eq!(report.stale_in_flight, 5);
    // The data set's age, not a measured duration: the margin only covers
    // a slow machine, and a wrong unit (ms for s) would overshoot it.
    let oldest = report.oldest_in_flight.expect("rows are in flight");
    assert!(
        (Duration::from_secs(2 * HOUR as u64)..Duration::from_secs(2 * HOUR as u64 + 600))
            .contains(&oldest),
        "{oldest:?}"
    );
    assert_eq!(count_where(&db, "1 = 1").await, 6);
    // An age past what the database counts is a century: nothing is stale,
    // and the run reports rather than failing after its deletes.
    let report = Sweeper::new(db.pool().clone())
        .with_stale_after(Duration::MAX)
        .sweep_once()
        .await
        .unwrap();
    assert_eq!((report.stale_in_flight, report.deleted), (0, 0));
    assert_eq!(count_where(&db, "1 = 1").await, 6);
}

async fn a_retry_after_the_sweep_executes_anew<T: SweepDb>() {
    let db = T::create().await;
    let key = IdempotencyKey::parse("order-7").unwrap();
    let req = order_request(&key);
    let first = StoredResponse {
        status: 201,
        headers: vec![],
        body: "first".into(),
    };
    let mut tx = db.pool().begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut tx, &req).await.unwrap() else {
        panic!("a new key executes")
    };
    exec.complete(&mut tx, &first).await.unwrap();
    tx.commit().await.unwrap();

    // Within retention the sweeper leaves it, and a retry replays.
    assert_eq!(sweeper(&db).sweep_once().await.unwrap().deleted, 0);
    let mut tx = db.pool().begin().await.unwrap();
    match claim(&mut tx, &req).await.unwrap() {
        Claim::Replay(stored) => assert_eq!(stored, first),
        other => panic!("expected a replay, got {other:?}"),
    }
    tx.rollback().await.unwrap();

    // Retention passes (moved by the database, not by waiting) and the
    // sweeper forgets the key.
    db.exec(T::EXPIRE_ALL).await;
    assert_eq!(sweeper(&db).sweep_once().await.unwrap().deleted, 1);
    assert_eq!(count_where(&db, "1 = 1").await, 0);

    // The documented contract: the same retry now executes as a new
    // request. A fresh row (generation 1), not a reclaimed one (which
    // would be generation 2).
    let second = StoredResponse {
        status: 201,
        headers: vec![],
        body: "second".into(),
    };
    let mut tx = db.pool().begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut tx, &req).await.unwrap() else {
        panic!("a retry after the sweep must execute anew")
    };
    assert_eq!(exec.generation(), 1);
    exec.complete(&mut tx, &second).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = db.pool().begin().await.unwrap();
    match claim(&mut tx, &req).await.unwrap() {
        Claim::Replay(stored) => assert_eq!(stored, second),
        other => panic!("expected a replay, got {other:?}"),
    }
    tx.rollback().await.unwrap();
}

async fn a_spawned_sweeper_sweeps_at_once_and_again_after_each_interval<T: SweepDb>() {
    let db = T::create().await;
    rows(&db, "pay", "old", 5, "completed", -60, HOUR).await;
    rows(&db, "pay", "new", 2, "completed", HOUR, 60).await;
    let handle = sweeper(&db)
        .with_interval(Duration::from_millis(20))
        .spawn();
    until_swept(&db).await;
    // Rows that expire after the first run are taken by a later one.
    rows(&db, "pay", "later", 5, "failed", -60, HOUR).await;
    until_swept(&db).await;
    handle.abort();
    assert!(handle.await.unwrap_err().is_cancelled());
    assert_eq!(count_where(&db, "1 = 1").await, 2);
    assert_eq!(count_where(&db, T::NOT_EXPIRED).await, 2);
}

async fn stats_are_right_on_a_known_data_set<T: SweepDb>() {
    let db = T::create().await;
    let empty = idem_runtime::stats(db.pool()).await.unwrap();
    assert_eq!(empty.rows, 0);
    assert!(empty.by_operation.is_empty());
    assert_eq!(empty.stored_bytes, 0);
    assert_eq!(empty.oldest_valid_created_at, None);
    assert_eq!(empty.oldest_in_flight_seconds, None);
    assert_eq!(empty.expired_unswept, 0);

    db.exec(T::STATS_DATA).await;
    let header_bytes = db.count(T::HEADER_BYTES).await as u64;

    let s = idem_runtime::stats(db.pool()).await.unwrap();
    assert_eq!(s.rows, 5);
    assert_eq!(
        (
            s.by_state.processing,
            s.by_state.completed,
            s.by_state.failed,
            s.by_state.uncertain
        ),
        (1, 2, 1, 1)
    );
    assert_eq!(s.stored_bytes, 2 * (10 + header_bytes) + 3);
    assert_eq!(
        s.oldest_valid_created_at.as_deref(),
        Some("2000-01-02T03:04:05Z")
    );
    assert!(s.oldest_valid_age_seconds.unwrap() > 20.0 * 365.0 * DAY as f64);
    // The processing row, two hours old, is the oldest in flight (the data set's
    // age, not a measured duration: the margin covers a slow machine).
    let in_flight = s.oldest_in_flight_seconds.unwrap();
    assert!((7200.0..7200.0 + 600.0).contains(&in_flight), "{in_flight}");
    // Only the expired failed row: an expired uncertain row is not the sweeper's.
    assert_eq!(s.expired_unswept, 1);
    assert_eq!(s.taken_at.len(), "2000-01-02T03:04:05Z".len());

    let ops: Vec<_> = s
        .by_operation
        .iter()
        .map(|o| {
            (
                o.operation.as_str(),
                o.rows,
                o.by_state.processing,
                o.by_state.completed,
                o.by_state.failed,
                o.by_state.uncertain,
                o.stored_bytes,
                o.expired_unswept,
            )
        })
        .collect();
    assert_eq!(
        ops,
        [
            (
                "create-order",
                3,
                0,
                2,
                1,
                0,
                2 * (10 + header_bytes) + 3,
                1
            ),
            ("refund", 2, 1, 0, 0, 1, 0, 0),
        ]
    );

    // After a sweep the unswept count is zero and the rest is unchanged.
    sweeper(&db).sweep_once().await.unwrap();
    let after = idem_runtime::stats(db.pool()).await.unwrap();
    assert_eq!((after.rows, after.expired_unswept), (4, 0));

    let json = serde_json::to_value(&after).unwrap();
    assert_eq!(json["by_state"]["completed"], 2);
    assert_eq!(json["by_operation"][1]["operation"], "refund");
}

async fn stats_sort_operations_by_name_whatever_the_collation<T: SweepDb>() {
    let db = T::create().await;
    // By bytes, "Zeta" comes first; a linguistic collation would put it last.
    for op in ["refund", "Zeta", "create-order", "alpha"] {
        rows(&db, op, "k", 1, "completed", HOUR, 60).await;
    }
    let s = idem_runtime::stats(db.pool()).await.unwrap();
    let ops: Vec<&str> = s
        .by_operation
        .iter()
        .map(|o| o.operation.as_str())
        .collect();
    assert_eq!(ops, ["Zeta", "alpha", "create-order", "refund"]);
}

async fn stats_neither_wait_for_nor_see_an_uncommitted_claim<T: SweepDb>() {
    let db = T::create().await;
    rows(&db, "pay", "done", 2, "completed", HOUR, 60).await;
    // A request in the middle of its transaction: the key is claimed (on
    // SQLite that holds the database's write lock) and not committed.
    let key = IdempotencyKey::parse("order-9").unwrap();
    let req = order_request(&key);
    let mut tx = db.pool().begin().await.unwrap();
    let Claim::Execute(exec) = claim(&mut tx, &req).await.unwrap() else {
        panic!("a new key executes")
    };
    // The timeout only turns a regression (a snapshot that waits for the
    // writer) into a failure instead of a hung test.
    let during = tokio::time::timeout(Duration::from_secs(60), idem_runtime::stats(db.pool()))
        .await
        .expect("stats waited for an uncommitted writer")
        .unwrap();
    assert_eq!((during.rows, during.by_state.processing), (2, 0));
    assert_eq!(during.oldest_in_flight_seconds, None);

    exec.complete(
        &mut tx,
        &StoredResponse {
            status: 201,
            headers: vec![],
            body: "done".into(),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let after = idem_runtime::stats(db.pool()).await.unwrap();
    assert_eq!((after.rows, after.by_state.completed), (3, 3));
    let ops: Vec<_> = after
        .by_operation
        .iter()
        .map(|o| (o.operation.as_str(), o.rows, o.stored_bytes))
        .collect();
    assert_eq!(ops, [("create-order", 1, 4 + 2), ("pay", 2, 20)]);
}

/// Metrics need the recorder on the thread that records them, so this test
/// drives a current-thread runtime itself inside `with_local_recorder`.
fn the_sweeper_records_its_metrics_under_the_documented_names<T: SweepDb>() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = rt.block_on(async {
        let db = T::create().await;
        rows(&db, "pay", "old", 12, "completed", -60, HOUR).await;
        rows(&db, "pay", "stuck", 2, "processing", HOUR, 2 * HOUR).await;
        // Young, so not stale, but uncertain all the same.
        rows(&db, "pay", "unsure", 3, "uncertain", HOUR, 60).await;
        db
    });
    let s = Sweeper::new(db.pool().clone())
        .with_batch_size(5)
        .with_max_batches(2)
        .with_stale_after(Duration::from_secs(HOUR as u64));

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let report = metrics::with_local_recorder(&recorder, || rt.block_on(s.sweep_once())).unwrap();
    assert_eq!(
        (report.deleted, report.backlog, report.stale_in_flight),
        (10, 2, 2)
    );

    let snapshot = snapshotter.snapshot().into_vec();
    let value = |kind: MetricKind, name: &str| {
        let found: Vec<_> = snapshot
            .iter()
            .filter(|(k, ..)| k.kind() == kind && k.key().name() == name)
            .collect();
        assert_eq!(found.len(), 1, "{name}: {snapshot:?}");
        // No labels: sweeper metrics are table-wide, and never carry a key.
        assert_eq!(found[0].0.key().labels().count(), 0, "{name}");
        match &found[0].3 {
            DebugValue::Counter(n) => *n as f64,
            DebugValue::Gauge(g) => g.0,
            DebugValue::Histogram(_) => panic!("{name} is not a histogram"),
        }
    };
    assert_eq!(value(MetricKind::Counter, SWEEPER_DELETED_TOTAL), 10.0);
    assert_eq!(value(MetricKind::Gauge, SWEEPER_BACKLOG), 2.0);
    assert_eq!(value(MetricKind::Gauge, STALE_IN_FLIGHT), 2.0);
    assert_eq!(value(MetricKind::Gauge, UNCERTAIN_ROWS), 3.0);
    let oldest = value(MetricKind::Gauge, OLDEST_IN_FLIGHT_SECONDS);
    assert!(
        (2.0 * HOUR as f64..2.0 * HOUR as f64 + 600.0).contains(&oldest),
        "{oldest}"
    );
    // The names are the documented ones.
    assert_eq!(SWEEPER_DELETED_TOTAL, "idem_sweeper_deleted_total");
    assert_eq!(SWEEPER_BACKLOG, "idem_sweeper_backlog");
    assert_eq!(STALE_IN_FLIGHT, "idem_stale_in_flight");
    assert_eq!(UNCERTAIN_ROWS, "idem_uncertain_rows");
    assert_eq!(OLDEST_IN_FLIGHT_SECONDS, "idem_oldest_in_flight_seconds");
    // Close the pool on the runtime its connections belong to.
    rt.block_on(db.pool().close());
}

/// Stamps every test above for `$db` as a wrapper in the calling module.
/// A test written above but left out here is an unused function, which the
/// build refuses (`-D warnings`).
macro_rules! sweeper_tests {
    ($db:ty) => {
        sweeper_tests!(
            $db;
            a_new_sweeper_takes_its_backend_from_the_pool_and_has_the_defaults,
            an_empty_table_gives_an_empty_report,
            deletes_exactly_the_expired_finished_rows_in_batches,
            max_batches_bounds_a_run_and_the_rest_is_the_backlog,
            stale_in_flight_rows_are_reported_not_deleted,
            a_retry_after_the_sweep_executes_anew,
            a_spawned_sweeper_sweeps_at_once_and_again_after_each_interval,
            stats_are_right_on_a_known_data_set,
            stats_sort_operations_by_name_whatever_the_collation,
            stats_neither_wait_for_nor_see_an_uncommitted_claim,
        );

        // A plain `#[test]`: it drives a runtime of its own (see the test).
        #[test]
        fn the_sweeper_records_its_metrics_under_the_documented_names() {
            super::the_sweeper_records_its_metrics_under_the_documented_names::<$db>()
        }
    };
    ($db:ty; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $test() {
                super::$test::<$db>().await
            }
        )*
    };
}

mod postgres {
    use super::*;
    use crate::common::TestDb;

    impl SweepDb for TestDb {
        type Db = sqlx::Postgres;
        const INSERT_ROWS: &str = "INSERT INTO idempotency_requests \
               (tenant_id, operation, key_digest, fingerprint, state, response_status, \
                response_body, created_at, expires_at) \
             SELECT 'acme', $1, sha256(convert_to($2 || '-' || i, 'UTF8')), decode(repeat('00', 32), 'hex'), $3, \
                    CASE $3 WHEN 'completed' THEN 201 WHEN 'failed' THEN 404 END, \
                    CASE WHEN $3 IN ('completed', 'failed') THEN '0123456789'::bytea END, \
                    now() - $5 * interval '1 second', now() + $4 * interval '1 second' \
               FROM generate_series(1, $6) i";
        const EXPIRED_FINISHED: &str = "expires_at <= now() AND state IN ('completed', 'failed')";
        const NOT_EXPIRED: &str = "expires_at > now()";
        const EXPIRE_ALL: &str =
            "UPDATE idempotency_requests SET expires_at = now() - interval '1 second'";
        const STATS_DATA: &str = r#"INSERT INTO idempotency_requests
                 (tenant_id, operation, key_digest, fingerprint, state, response_status,
                  response_headers, response_body, created_at, expires_at)
               VALUES
                 ('acme', 'create-order', sha256('a1'::bytea), decode(repeat('00', 32), 'hex'), 'completed', 201,
                  '[["content-type", "text/plain"]]', '0123456789',
                  '2000-01-02 03:04:05+00', now() + interval '1 day'),
                 ('acme', 'create-order', sha256('a2'::bytea), decode(repeat('00', 32), 'hex'), 'completed', 201,
                  '[["content-type", "text/plain"]]', '0123456789',
                  now() - interval '1 minute', now() + interval '1 day'),
                 ('globex', 'create-order', sha256('a3'::bytea), decode(repeat('00', 32), 'hex'), 'failed', 404,
                  NULL, 'abc', now() - interval '2 days', now() - interval '1 day'),
                 ('acme', 'refund', sha256('b1'::bytea), decode(repeat('00', 32), 'hex'), 'processing', NULL,
                  NULL, NULL, now() - interval '2 hours', now() + interval '1 day'),
                 ('acme', 'refund', sha256('b2'::bytea), decode(repeat('00', 32), 'hex'), 'uncertain', NULL,
                  NULL, NULL, now() - interval '1 hour', now() - interval '1 minute')"#;
        // jsonb keeps its own text form (a space after the comma).
        const HEADER_BYTES: &str =
            r#"SELECT octet_length('[["content-type", "text/plain"]]'::jsonb::text)::bigint"#;

        async fn create() -> Self {
            TestDb::new().await
        }

        fn pool(&self) -> &Pool<Self::Db> {
            &self.pool
        }

        async fn count(&self, sql: &str) -> i64 {
            TestDb::count(self, sql).await
        }

        async fn exec(&self, sql: &str) {
            TestDb::exec(self, sql).await
        }

        async fn insert_rows(
            &self,
            operation: &str,
            prefix: &str,
            n: i32,
            state: &str,
            expires_in: i64,
            age: i64,
        ) {
            bind_rows(
                &self.pool,
                Self::INSERT_ROWS,
                operation,
                prefix,
                n,
                state,
                expires_in,
                age,
            )
            .await
        }
    }

    sweeper_tests!(TestDb);
}

mod sqlite {
    use super::*;
    use crate::common::SqliteDb;

    /// A row whose age is past what a `Duration` holds (a `created_at` written
    /// by hand as a REAL, which the column, not STRICT, keeps) is reported as
    /// the longest age there is, and the run goes on: the spawned sweeper
    /// would otherwise end at its first run and retention with it.
    #[tokio::test]
    async fn an_age_past_what_a_duration_holds_is_reported_as_the_longest() {
        let db = SqliteDb::create().await;
        rows(&db, "pay", "stuck", 1, "processing", HOUR, 60).await;
        rows(&db, "pay", "done", 2, "completed", -60, 60).await;
        db.exec("UPDATE idempotency_requests SET created_at = -1e300 WHERE state = 'processing'")
            .await;
        let report = Sweeper::new(db.pool().clone()).sweep_once().await.unwrap();
        assert_eq!(report.oldest_in_flight, Some(Duration::MAX));
        assert_eq!((report.stale_in_flight, report.deleted), (1, 2));
    }

    impl SweepDb for SqliteDb {
        type Db = sqlx::Sqlite;
        // Timestamps are Unix milliseconds from SQLite's clock, as the store
        // writes them; a recursive CTE stands in for generate_series.
        const INSERT_ROWS: &str = concat!(
            "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < $6) \
             INSERT INTO idempotency_requests \
               (tenant_id, operation, key_digest, fingerprint, state, response_status, \
                response_body, created_at, expires_at) \
             SELECT 'acme', $1, CAST(printf('%-32.32s', $2 || '-' || i) AS BLOB), zeroblob(32), $3, \
                    CASE $3 WHEN 'completed' THEN 201 WHEN 'failed' THEN 404 END, \
                    CASE WHEN $3 IN ('completed', 'failed') THEN CAST('0123456789' AS BLOB) END, ",
            idem_runtime::sqlite_now_ms!(),
            " - $5 * 1000, ",
            idem_runtime::sqlite_now_ms!(),
            " + $4 * 1000 \
               FROM seq"
        );
        const EXPIRED_FINISHED: &str = concat!(
            "expires_at <= ",
            idem_runtime::sqlite_now_ms!(),
            " AND state IN ('completed', 'failed')"
        );
        const NOT_EXPIRED: &str = concat!("expires_at > ", idem_runtime::sqlite_now_ms!());
        const EXPIRE_ALL: &str = concat!(
            "UPDATE idempotency_requests SET expires_at = ",
            idem_runtime::sqlite_now_ms!(),
            " - 1000"
        );
        // The headers as the store writes them (compact JSON text), the bodies as
        // BLOBs.
        const STATS_DATA: &str = concat!(
            r#"INSERT INTO idempotency_requests
                 (tenant_id, operation, key_digest, fingerprint, state, response_status,
                  response_headers, response_body, created_at, expires_at)
               VALUES
                 ('acme', 'create-order', CAST(printf('%-32s', 'a1') AS BLOB), zeroblob(32), 'completed', 201,
                  '[["content-type","text/plain"]]', CAST('0123456789' AS BLOB),
                  unixepoch('2000-01-02 03:04:05') * 1000, "#,
            idem_runtime::sqlite_now_ms!(),
            r#" + 86400000),
                 ('acme', 'create-order', CAST(printf('%-32s', 'a2') AS BLOB), zeroblob(32), 'completed', 201,
                  '[["content-type","text/plain"]]', CAST('0123456789' AS BLOB),
                  "#,
            idem_runtime::sqlite_now_ms!(),
            r#" - 60000, "#,
            idem_runtime::sqlite_now_ms!(),
            r#" + 86400000),
                 ('globex', 'create-order', CAST(printf('%-32s', 'a3') AS BLOB), zeroblob(32), 'failed', 404,
                  NULL, CAST('abc' AS BLOB), "#,
            idem_runtime::sqlite_now_ms!(),
            r#" - 2 * 86400000,
                  "#,
            idem_runtime::sqlite_now_ms!(),
            r#" - 86400000),
                 ('acme', 'refund', CAST(printf('%-32s', 'b1') AS BLOB), zeroblob(32), 'processing', NULL,
                  NULL, NULL, "#,
            idem_runtime::sqlite_now_ms!(),
            r#" - 7200000, "#,
            idem_runtime::sqlite_now_ms!(),
            r#" + 86400000),
                 ('acme', 'refund', CAST(printf('%-32s', 'b2') AS BLOB), zeroblob(32), 'uncertain', NULL,
                  NULL, NULL, "#,
            idem_runtime::sqlite_now_ms!(),
            r#" - 3600000, "#,
            idem_runtime::sqlite_now_ms!(),
            r#" - 60000)"#
        );
        const HEADER_BYTES: &str =
            r#"SELECT length(CAST('[["content-type","text/plain"]]' AS BLOB))"#;

        async fn create() -> Self {
            SqliteDb::new().await
        }

        fn pool(&self) -> &Pool<Self::Db> {
            &self.pool
        }

        async fn count(&self, sql: &str) -> i64 {
            SqliteDb::count(self, sql).await
        }

        async fn exec(&self, sql: &str) {
            SqliteDb::exec(self, sql).await
        }

        async fn insert_rows(
            &self,
            operation: &str,
            prefix: &str,
            n: i32,
            state: &str,
            expires_in: i64,
            age: i64,
        ) {
            bind_rows(
                &self.pool,
                Self::INSERT_ROWS,
                operation,
                prefix,
                n,
                state,
                expires_in,
                age,
            )
            .await
        }
    }

    sweeper_tests!(SqliteDb);
}

mod mysql {
    use super::*;
    use crate::common::MySqlDb;

    impl SweepDb for MySqlDb {
        type Db = sqlx::MySql;
        // `?` binds in order of appearance: the parameters are read once, into
        // a CTE, and a recursive CTE stands in for generate_series (MySQL 8
        // allows 1000 levels by default, MariaDB many more). Timestamps are Unix
        // milliseconds from the database's clock, as the store writes them.
        const INSERT_ROWS: &str = concat!(
            "INSERT INTO idempotency_requests \
               (tenant_id, operation, key_digest, fingerprint, state, response_status, \
                response_body, created_at, expires_at) \
             SELECT 'acme', x.op, UNHEX(SHA2(CONCAT(x.prefix, '-', x.i), 256)), UNHEX(REPEAT('00', 32)), x.st, \
                    CASE x.st WHEN 'completed' THEN 201 WHEN 'failed' THEN 404 END, \
                    CASE WHEN x.st IN ('completed', 'failed') THEN '0123456789' END, ",
            idem_runtime::mysql_now_ms!(),
            " - x.age * 1000, ",
            idem_runtime::mysql_now_ms!(),
            " + x.expires_in * 1000 \
               FROM (WITH RECURSIVE \
                       p AS (SELECT ? AS op, ? AS prefix, ? AS st, ? AS expires_in, ? AS age, ? AS n), \
                       seq (i) AS (SELECT 1 UNION ALL SELECT seq.i + 1 FROM seq JOIN p WHERE seq.i < p.n) \
                     SELECT p.op, p.prefix, p.st, p.expires_in, p.age, seq.i FROM seq JOIN p) x"
        );
        const EXPIRED_FINISHED: &str = concat!(
            "expires_at <= ",
            idem_runtime::mysql_now_ms!(),
            " AND state IN ('completed', 'failed')"
        );
        const NOT_EXPIRED: &str = concat!("expires_at > ", idem_runtime::mysql_now_ms!());
        const EXPIRE_ALL: &str = concat!(
            "UPDATE idempotency_requests SET expires_at = ",
            idem_runtime::mysql_now_ms!(),
            " - 1000"
        );
        // The headers as the store writes them (compact JSON text).
        const STATS_DATA: &str = concat!(
            r#"INSERT INTO idempotency_requests
                 (tenant_id, operation, key_digest, fingerprint, state, response_status,
                  response_headers, response_body, created_at, expires_at)
               VALUES
                 ('acme', 'create-order', UNHEX(SHA2('a1', 256)), UNHEX(REPEAT('00', 32)), 'completed', 201,
                  '[["content-type","text/plain"]]', '0123456789',
                  946782245000, "#,
            idem_runtime::mysql_now_ms!(),
            r#" + 86400000),
                 ('acme', 'create-order', UNHEX(SHA2('a2', 256)), UNHEX(REPEAT('00', 32)), 'completed', 201,
                  '[["content-type","text/plain"]]', '0123456789',
                  "#,
            idem_runtime::mysql_now_ms!(),
            r#" - 60000, "#,
            idem_runtime::mysql_now_ms!(),
            r#" + 86400000),
                 ('globex', 'create-order', UNHEX(SHA2('a3', 256)), UNHEX(REPEAT('00', 32)), 'failed', 404,
                  NULL, 'abc', "#,
            idem_runtime::mysql_now_ms!(),
            r#" - 2 * 86400000,
                  "#,
            idem_runtime::mysql_now_ms!(),
            r#" - 86400000),
                 ('acme', 'refund', UNHEX(SHA2('b1', 256)), UNHEX(REPEAT('00', 32)), 'processing', NULL,
                  NULL, NULL, "#,
            idem_runtime::mysql_now_ms!(),
            r#" - 7200000, "#,
            idem_runtime::mysql_now_ms!(),
            r#" + 86400000),
                 ('acme', 'refund', UNHEX(SHA2('b2', 256)), UNHEX(REPEAT('00', 32)), 'uncertain', NULL,
                  NULL, NULL, "#,
            idem_runtime::mysql_now_ms!(),
            r#" - 3600000, "#,
            idem_runtime::mysql_now_ms!(),
            r#" - 60000)"#
        );
        const HEADER_BYTES: &str =
            r#"SELECT CAST(length('[["content-type","text/plain"]]') AS SIGNED)"#;

        async fn create() -> Self {
            MySqlDb::new().await
        }

        fn pool(&self) -> &Pool<Self::Db> {
            &self.pool
        }

        async fn count(&self, sql: &str) -> i64 {
            MySqlDb::count(self, sql).await
        }

        async fn exec(&self, sql: &str) {
            MySqlDb::exec(self, sql).await
        }

        async fn insert_rows(
            &self,
            operation: &str,
            prefix: &str,
            n: i32,
            state: &str,
            expires_in: i64,
            age: i64,
        ) {
            bind_rows(
                &self.pool,
                Self::INSERT_ROWS,
                operation,
                prefix,
                n,
                state,
                expires_in,
                age,
            )
            .await
        }
    }

    sweeper_tests!(MySqlDb);

    /// A batch of more keys than one statement can name (65,535 placeholders,
    /// three a key: 21,845) is deleted whole, in one transaction: raised past
    /// that, the batch once failed every run and retention stopped.
    #[tokio::test]
    async fn a_batch_over_one_statements_placeholders_is_deleted_whole() {
        let db = MySqlDb::create().await;
        // In parts: MySQL 8's recursive CTEs stop at 1,000 levels.
        for part in 0..22 {
            rows(
                &db,
                "pay",
                &format!("old-{part}"),
                1000,
                "completed",
                -60,
                HOUR,
            )
            .await;
        }
        rows(&db, "pay", "new", 3, "completed", HOUR, 60).await;
        let report = sweeper(&db)
            .with_batch_size(25_000)
            .sweep_once()
            .await
            .unwrap();
        assert_eq!((report.deleted, report.batches), (22_000, 1));
        assert_eq!(count_where(&db, "1 = 1").await, 3);
        assert_eq!(count_where(&db, MySqlDb::NOT_EXPIRED).await, 3);
    }

    /// A sweep skips the rows a claim holds (`FOR UPDATE SKIP LOCKED`) instead of
    /// waiting for them, and deletes the others.
    #[tokio::test]
    async fn a_sweep_skips_a_row_a_transaction_holds() {
        let db = MySqlDb::new().await;
        rows(&db, "pay", "old", 5, "completed", -60, HOUR).await;
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_requests WHERE tenant_id = 'acme' AND operation = 'pay' AND key_digest = UNHEX(SHA2('old-3', 256)) FOR UPDATE")
            .execute(&mut *holder)
            .await
            .unwrap();
        // The timeout only turns a regression (waiting on the held row, until
        // InnoDB's lock wait ends it in an error) into a failure instead of a
        // long wait; nothing here measures time.
        let report = tokio::time::timeout(Duration::from_secs(120), sweeper(&db).sweep_once())
            .await
            .expect("the sweep waited on the held row")
            .unwrap();
        assert_eq!(report.deleted, 4);
        holder.rollback().await.unwrap();
        let report = sweeper(&db).sweep_once().await.unwrap();
        assert_eq!(report.deleted, 1);
    }
}

/// What only PostgreSQL has: row locks to skip, sweepers sharing the work.
mod postgres_only {
    use std::sync::Arc;

    use super::*;
    use crate::common::TestDb;

    #[tokio::test]
    async fn rows_locked_elsewhere_are_skipped_and_two_sweepers_share_the_rest() {
        let db = TestDb::new().await;
        rows(&db, "pay", "old", 30, "completed", -60, HOUR).await;

        // A third transaction holds five of the rows, as a claim re-using an expired
        // key would. SKIP LOCKED must pass them by instead of waiting.
        let mut holder = db.pool.begin().await.unwrap();
        let held: Vec<Vec<u8>> = sqlx::query_scalar(
            "SELECT key_digest FROM idempotency_requests \
              WHERE key_digest IN (SELECT sha256(convert_to('old-' || i, 'UTF8')) \
                                     FROM generate_series(1, 5) i) FOR UPDATE",
        )
        .fetch_all(&mut *holder)
        .await
        .unwrap();
        assert_eq!(held.len(), 5);

        let a = sweeper(&db).with_batch_size(4);
        let b = sweeper(&db).with_batch_size(4);
        // The timeout only turns a regression (waiting on the held rows) into a
        // failure instead of a hung test; nothing here measures time.
        let (ra, rb) = tokio::time::timeout(Duration::from_secs(120), async {
            tokio::join!(a.sweep_once(), b.sweep_once())
        })
        .await
        .expect("a sweeper waited on rows another transaction holds");
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_eq!(ra.deleted + rb.deleted, 25, "{ra:?} {rb:?}");
        // Held rows are still expired and still there: both see them as backlog.
        assert!(ra.backlog >= 5 && rb.backlog >= 5, "{ra:?} {rb:?}");
        let mut left: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT key_digest FROM idempotency_requests")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        left.sort();
        let mut expected: Vec<Vec<u8>> = (1..=5)
            .map(|i| {
                let key = IdempotencyKey::parse(format!("old-{i}")).unwrap();
                key.digest().as_bytes().to_vec()
            })
            .collect();
        expected.sort();
        assert_eq!(left, expected);

        holder.rollback().await.unwrap();
        let last = sweeper(&db).sweep_once().await.unwrap();
        assert_eq!((last.deleted, last.backlog), (5, 0));
    }

    #[tokio::test]
    async fn four_sweepers_at_once_delete_each_row_once_and_none_fails() {
        let db = TestDb::new().await;
        rows(&db, "pay", "old", 500, "completed", -60, HOUR).await;
        rows(&db, "pay", "new", 20, "completed", HOUR, 60).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let s = sweeper(&db).with_batch_size(7);
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    s.sweep_once().await
                })
            })
            .collect();
        let mut deleted = 0;
        for t in tasks {
            let report = t.await.unwrap().expect("no sweeper may fail");
            deleted += report.deleted;
        }
        assert_eq!(deleted, 500);
        assert_eq!(count_where(&db, "true").await, 20);
        assert_eq!(count_where(&db, TestDb::NOT_EXPIRED).await, 20);
    }
}
