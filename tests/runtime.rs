//! The runtime API without the macro: the state machine of DESIGN.md §4 as a
//! queue consumer or a job would use it. The shared behaviour runs against
//! real PostgreSQL, a SQLite file and MySQL / MariaDB; what only one database
//! has is tested beside it.
//!
//! The shared tests are ordinary code in `runtime/suite.rs`, written against a
//! concrete database: each database's module below sets `Db`, `TestDb`, its
//! SQL and `pay`, mounts the file (the module's `#[path]` makes `runtime/` its
//! directory), and `backend_tests!` stamps the `#[tokio::test]` wrappers, so a
//! test is `postgres::<name>`, `sqlite::<name>` and `mysql::<name>`. A
//! duplicate waiting on a row lock (`runtime/lock_wait.rs`) is mounted the same
//! way in `postgres_only` and `mysql_only`, the databases with row locks.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_runtime::{
    Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, StoreError, StoredResponse, claim,
};

const HOUR: Duration = Duration::from_secs(3600);

fn req<'a>(tenant: &'a str, op: &'a str, key: &'a IdempotencyKey, amount: i64) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant,
        operation: op,
        key,
        fingerprint: FingerprintBuilder::new(tenant, op, "JOB", "payments")
            .body(&serde_json::json!({ "amount": amount }))
            .unwrap()
            .finish(),
        retention: HOUR,
        in_flight_wait: Duration::from_secs(5),
    }
}

fn created(id: i64) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), format!("/payments/{id}")),
        ],
        body: format!("{{\"id\":{id}}}").into(),
    }
}

/// Every test of `runtime/suite.rs`, stamped in the database's module.
macro_rules! backend_tests {
    () => {
        stamp!(
            suite =>
            a_zero_retention_by_hand_is_refused_and_reserves_nothing,
            first_claim_executes_and_a_retry_replays_byte_identical,
            a_different_fingerprint_is_a_mismatch_and_nothing_runs,
            tenants_and_operations_scope_the_key,
            fifty_concurrent_duplicates_make_one_payment,
            a_rolled_back_first_attempt_frees_the_key,
            an_expired_key_executes_anew_and_an_unexpired_one_does_not,
            a_stale_execution_cannot_complete,
        );
    };
}

/// Every test of `runtime/lock_wait.rs`, stamped in the module of a database
/// with row locks.
macro_rules! lock_wait_tests {
    () => {
        stamp!(
            lock_wait =>
            a_duplicate_waits_for_a_committed_first_and_replays_it,
            a_duplicate_waits_for_a_rolled_back_first_and_then_executes,
        );
    };
}

#[path = "runtime"]
mod postgres {
    use super::*;
    use sqlx::Transaction;

    type Db = sqlx::Postgres;
    type TestDb = crate::common::TestDb;
    const PAYMENTS_DDL: &str = "CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, amount bigint NOT NULL)";
    const EXPIRE_ALL_SQL: &str =
        "UPDATE idempotency_requests SET expires_at = now() - interval '1 second'";

    mod returning;
    pub(super) mod suite;
    pub(super) use returning::pay;

    backend_tests!();
}

#[path = "runtime"]
mod sqlite {
    use super::*;
    use sqlx::Transaction;
    use suite::{db, run_once};

    type Db = sqlx::Sqlite;
    type TestDb = crate::common::SqliteDb;
    const PAYMENTS_DDL: &str = "CREATE TABLE payments (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, amount INTEGER NOT NULL)";
    const EXPIRE_ALL_SQL: &str = "UPDATE idempotency_requests SET expires_at = 0";

    mod returning;
    mod suite;
    use returning::pay;

    backend_tests!();

    /// A pool of one connection to the test's database file, with its own busy
    /// timeout.
    async fn one_connection(db: &TestDb, busy_timeout: Duration) -> sqlx::SqlitePool {
        use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
        SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&db.path)
                    .busy_timeout(busy_timeout),
            )
            .await
            .unwrap()
    }

    /// SQLite's in-flight bound is the connection's busy timeout, not the
    /// request's in-flight wait (the claim changes no setting of a connection it
    /// only borrows): a duplicate waits for the first writer, then reports busy
    /// (it cannot tell whose write lock it met); the first then commits and the
    /// duplicate's retry replays it.
    #[tokio::test]
    async fn the_in_flight_bound_holds_through_the_busy_timeout() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let mut r = req("acme", "pay", &key, 100);
        let mut first = db.pool.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut first, &r).await.unwrap() else {
            panic!()
        };
        let id = pay(&mut first, "acme", 100).await;

        let bound = Duration::from_millis(300);
        let impatient = one_connection(&db, bound).await;
        // Far longer than the connection's: not the bound on SQLite.
        r.in_flight_wait = Duration::from_secs(60);
        let mut dup = impatient.begin().await.unwrap();
        let started = std::time::Instant::now();
        let c = claim(&mut dup, &r).await.unwrap();
        assert!(
            matches!(c, Claim::Busy { retry_after } if retry_after == Duration::from_secs(1)),
            "{c:?}"
        );
        let waited = started.elapsed();
        assert!(waited >= bound, "gave up before the busy timeout");
        assert!(
            waited < Duration::from_secs(30),
            "waited the request's in-flight wait, not the connection's busy timeout"
        );
        // Neither connection's busy timeout was touched.
        for (tx, expected) in [(&mut first, 5000), (&mut dup, 300)] {
            let timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
                .fetch_one(&mut **tx)
                .await
                .unwrap();
            assert_eq!(timeout, expected);
        }
        drop(dup);

        exec.complete(&mut first, &created(id)).await.unwrap();
        first.commit().await.unwrap();
        let mut retry = db.pool.begin().await.unwrap();
        match claim(&mut retry, &r).await.unwrap() {
            Claim::Replay(stored) => assert_eq!(stored, created(id)),
            other => panic!("expected a replay, got {other:?}"),
        }
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
    }

    /// Says when a statement that inserts into idem's table begins to run on
    /// the connection it is set on (SQLite's statement trace).
    static INSERTING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

    unsafe extern "C" fn on_statement(
        event: std::ffi::c_uint,
        _: *mut std::ffi::c_void,
        _: *mut std::ffi::c_void,
        sql: *mut std::ffi::c_void,
    ) -> std::ffi::c_int {
        if event == libsqlite3_sys::SQLITE_TRACE_STMT {
            // SAFETY: for a statement event, SQLite passes its text, a C string.
            let sql = unsafe { std::ffi::CStr::from_ptr(sql.cast()) };
            if sql
                .to_string_lossy()
                .contains("INSERT INTO idempotency_requests")
            {
                INSERTING.add_permits(1);
            }
        }
        0
    }

    /// A hand-written claim dropped while it waits for the write lock (a
    /// caller's timeout) leaves the connection's busy timeout as the pool set
    /// it: the claim changes no setting of a connection it only borrows, so
    /// there is nothing to give back. Deterministic: the claim is dropped once
    /// the statement trace shows its insert running (whatever the claim set
    /// before it has been set then), and the holder keeps the write lock until
    /// after that, so the insert is waiting on it.
    #[tokio::test]
    async fn a_cancelled_claim_leaves_the_busy_timeout_on_the_pooled_connection() {
        let db = db().await;
        let pool = one_connection(&db, Duration::from_secs(5)).await;
        let mut holder = db.pool.acquire().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let key = IdempotencyKey::parse("k-cancelled").unwrap();
        let mut r = req("acme", "pay", &key, 100);
        r.in_flight_wait = Duration::from_secs(3);
        let mut waiting = Box::pin(async {
            let mut tx = pool.begin().await.unwrap();
            {
                let mut handle = tx.lock_handle().await.unwrap();
                // SAFETY: the handle is this connection's, locked; the
                // callback is 'static and takes no context.
                unsafe {
                    libsqlite3_sys::sqlite3_trace_v2(
                        handle.as_raw_handle().as_ptr(),
                        libsqlite3_sys::SQLITE_TRACE_STMT,
                        Some(on_statement),
                        std::ptr::null_mut(),
                    );
                }
            }
            claim(&mut tx, &r).await
        });
        tokio::select! {
            done = &mut waiting => panic!("the claim did not wait on the held write lock: {done:?}"),
            running = INSERTING.acquire() => running.unwrap().forget(),
        }
        // Box::pin, not pin!: dropping it here drops the claim mid-wait.
        drop(waiting);
        sqlx::query("ROLLBACK").execute(&mut *holder).await.unwrap();
        let next: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(
            next, 5000,
            "the pool handed out a connection with idem's wait on it"
        );
    }

    /// A trigger's `RAISE(ROLLBACK)` ends the handler's whole transaction and
    /// leaves the connection in autocommit. A handler that swallows the error
    /// and answers as if its payment were written must not have idem commit
    /// the key's answer alone (every retry would replay a payment that is
    /// not there): nothing is stored, and the key executes again.
    #[tokio::test]
    async fn a_transaction_sqlite_rolled_back_under_the_handler_stores_no_answer() {
        use idem_runtime::Idem;
        use idem_runtime::test_util::{Finish, HandlerPath};

        let db = db().await;
        db.exec(
            "CREATE TRIGGER over_the_limit BEFORE INSERT ON payments WHEN NEW.amount > 1000 \
               BEGIN SELECT RAISE(ROLLBACK, 'over the limit'); END",
        )
        .await;
        // One connection: the request after it runs on the same one.
        let idem: Idem<sqlx::Sqlite> = Idem::new(one_connection(&db, Duration::from_secs(5)).await);
        let key = IdempotencyKey::parse("k-rolled-back").unwrap();
        let r = req("acme", "pay", &key, 100);
        let context = idem_runtime::test_util::claim_context(&idem, r.in_flight_wait);
        let (mut tx, c) = sqlx::Sqlite::begin_claim(&context, &r).await.unwrap();
        let Claim::Execute(exec) = c else {
            panic!("a new key executes: {c:?}")
        };
        sqlx::query("INSERT INTO payments (tenant, amount) VALUES ('acme', 100)")
            .execute(&mut *tx)
            .await
            .unwrap();
        let swallowed = sqlx::query("INSERT INTO payments (tenant, amount) VALUES ('acme', 5000)")
            .execute(&mut *tx)
            .await;
        assert!(swallowed.is_err(), "the trigger refused it");
        match sqlx::Sqlite::finish(&context, tx, exec, &created(1)).await {
            Finish::NotStored(StoreError::TransactionEnded) => {}
            other => panic!("expected nothing stored, got {other:?}"),
        }
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0,
            "no answer for the rolled-back payment"
        );
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 0);
        // The key executes again, on the same connection, and is stored.
        let (mut tx, again) = sqlx::Sqlite::begin_claim(&context, &r).await.unwrap();
        let Claim::Execute(exec) = again else {
            panic!("the key executes again: {again:?}")
        };
        sqlx::query("INSERT INTO payments (tenant, amount) VALUES ('acme', 100)")
            .execute(&mut *tx)
            .await
            .unwrap();
        assert!(matches!(
            sqlx::Sqlite::finish(&context, tx, exec, &created(2)).await,
            Finish::Committed
        ));
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            1
        );
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
    }

    /// The handler's path (`Backend::begin_claim` / `finish`): the write lock
    /// first, nothing written by the claim, the finished row inserted once, and
    /// the connection's busy timeout left as the pool set it. Triggers count
    /// idem's writes.
    #[tokio::test]
    async fn the_handlers_path_writes_the_row_once_and_nothing_before_the_outcome() {
        use idem_runtime::Idem;
        use idem_runtime::test_util::Finish;
        use idem_runtime::test_util::HandlerPath;

        let db = db().await;
        db.exec(
            "CREATE TABLE idem_writes (what TEXT NOT NULL); \
             CREATE TRIGGER count_insert AFTER INSERT ON idempotency_requests \
               BEGIN INSERT INTO idem_writes VALUES ('insert'); END; \
             CREATE TRIGGER count_update AFTER UPDATE ON idempotency_requests \
               BEGIN INSERT INTO idem_writes VALUES ('update'); END",
        )
        .await;
        let idem: Idem<sqlx::Sqlite> = Idem::new(db.pool.clone());
        let key = IdempotencyKey::parse("k1").unwrap();
        let r = req("acme", "pay", &key, 100);
        let (mut tx, c) = sqlx::Sqlite::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, r.in_flight_wait),
            &r,
        )
        .await
        .unwrap();
        let Claim::Execute(exec) = c else {
            panic!("a new key executes: {c:?}")
        };
        let writes: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_writes")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(writes, 0, "the claim wrote before the outcome");
        let timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(timeout, 5000, "the pool's busy timeout, untouched");
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO payments (tenant, amount) VALUES ('acme', 100) RETURNING id",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert!(matches!(
            sqlx::Sqlite::finish(
                &idem_runtime::test_util::claim_context(&idem, Default::default()),
                tx,
                exec,
                &created(id)
            )
            .await,
            Finish::Committed
        ));
        let writes: Vec<String> = sqlx::query_scalar("SELECT what FROM idem_writes")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        assert_eq!(writes, ["insert"], "one insert, no update");

        // A replay is read under the lock and writes nothing; dropping its
        // transaction lets the lock go.
        let (tx, again) = sqlx::Sqlite::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, r.in_flight_wait),
            &r,
        )
        .await
        .unwrap();
        match again {
            Claim::Replay(stored) => assert_eq!(stored, created(id)),
            other => panic!("expected a replay, got {other:?}"),
        }
        drop(tx);
        assert_eq!(db.count("SELECT count(*) FROM idem_writes").await, 1);
        // An expired outcome is executed anew, one generation on, its row
        // replaced by one write.
        db.exec(EXPIRE_ALL_SQL).await;
        db.exec("DELETE FROM idem_writes").await;
        let (tx, c) = sqlx::Sqlite::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, r.in_flight_wait),
            &r,
        )
        .await
        .unwrap();
        let Claim::Execute(exec) = c else {
            panic!("{c:?}")
        };
        assert_eq!(exec.generation(), 2);
        assert!(matches!(
            sqlx::Sqlite::finish(
                &idem_runtime::test_util::claim_context(&idem, Default::default()),
                tx,
                exec,
                &created(id)
            )
            .await,
            Finish::Committed
        ));
        let writes: Vec<String> = sqlx::query_scalar("SELECT what FROM idem_writes")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        assert_eq!(writes, ["update"], "the upsert, once");
        assert_eq!(
            db.count("SELECT generation FROM idempotency_requests")
                .await,
            2
        );
    }

    /// Another writer holds the database past the connection's busy timeout:
    /// the handler's claim answers that the store is busy (nothing is known
    /// about the key, so it is not "in flight") and leaves its connection idle.
    #[tokio::test]
    async fn a_held_write_lock_past_the_busy_timeout_is_busy() {
        use idem_runtime::Idem;
        use idem_runtime::test_util::HandlerPath;
        let db = db().await;
        let impatient = one_connection(&db, Duration::from_millis(200)).await;
        let mut holder = db.pool.acquire().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let idem: Idem<sqlx::Sqlite> = Idem::new(impatient.clone());
        let key = IdempotencyKey::parse("k1").unwrap();
        let r = req("acme", "pay", &key, 100);
        let started = Instant::now();
        let (tx, c) = sqlx::Sqlite::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, r.in_flight_wait),
            &r,
        )
        .await
        .unwrap();
        assert!(matches!(c, Claim::Busy { .. }), "{c:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "gave up before the busy timeout"
        );
        drop(tx);
        sqlx::query("ROLLBACK").execute(&mut *holder).await.unwrap();
        // The connection came back usable, outside any transaction.
        let (tx, c) = sqlx::Sqlite::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, r.in_flight_wait),
            &r,
        )
        .await
        .unwrap();
        assert!(matches!(c, Claim::Execute(_)), "{c:?}");
        drop(tx);
    }

    #[tokio::test]
    async fn timestamps_come_from_sqlites_clock_in_milliseconds() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let _ = run_once(&db, &req("acme", "pay", &key, 100)).await.unwrap();
        let ok = db
            .count(concat!(
                "SELECT (completed_at >= created_at \
                        AND expires_at = completed_at + 3600000 \
                        AND abs(created_at - ",
                idem_runtime::sqlite_now_ms!(),
                ") < 600000) FROM idempotency_requests"
            ))
            .await;
        assert_eq!(ok, 1);
    }
}

#[path = "runtime"]
mod mysql {
    use super::*;
    use sqlx::Transaction;

    type Db = sqlx::MySql;
    type TestDb = crate::common::MySqlDb;
    const PAYMENTS_DDL: &str = "CREATE TABLE payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB";
    const EXPIRE_ALL_SQL: &str = "UPDATE idempotency_requests SET expires_at = 0";

    pub(super) mod suite;

    /// `?` placeholders and no `RETURNING`: the id is the insert's own.
    pub(super) async fn pay(tx: &mut Transaction<'static, Db>, tenant: &str, amount: i64) -> i64 {
        let done = sqlx::query("INSERT INTO payments (tenant, amount) VALUES (?, ?)")
            .bind(tenant)
            .bind(amount)
            .execute(&mut **tx)
            .await
            .unwrap();
        i64::try_from(done.last_insert_id()).unwrap()
    }

    backend_tests!();
}

/// What differs on MySQL and MariaDB: InnoDB's row, gap and next-key locks, the
/// lock wait in whole seconds, deadlocks, the database clock.
#[path = "runtime"]
mod mysql_only {
    use super::mysql::pay;
    use super::mysql::suite::{claim_race, db, run_once};
    use super::*;
    use crate::common::MySqlDb;

    mod lock_wait;

    /// Waits until the duplicate's claim, its locking read of the key's row,
    /// runs in this database: it waits there for the first's row lock. From
    /// the process list, which is read live and names this test's database,
    /// where `INNODB_TRX` is a server-wide cache.
    async fn wait_for_lock_waiter(db: &MySqlDb) {
        db.until_running(&db.pool, "%FROM idempotency_requests%FOR UPDATE%")
            .await;
    }

    #[tokio::test]
    async fn a_claim_of_one_key_does_not_block_the_neighbouring_keys() {
        let db = db().await;
        // Keys on both sides of the held one, and a key in an empty table's
        // last gap: with gap or next-key locks any of them would wait.
        let held = IdempotencyKey::parse("k5").unwrap();
        let mut first = db.pool.begin().await.unwrap();
        let Claim::Execute(_exec) = claim(&mut first, &req("acme", "pay", &held, 100))
            .await
            .unwrap()
        else {
            panic!()
        };
        for other in ["k4", "k6", "k50", "a", "z"] {
            let key = IdempotencyKey::parse(other).unwrap();
            let mut r = req("acme", "pay", &key, 100);
            r.in_flight_wait = Duration::from_secs(1);
            // Waiting for the held key would end in `InFlight` after the
            // second `in_flight_wait` gives it, not in `Execute`.
            let mut tx = db.pool.begin().await.unwrap();
            let c = claim(&mut tx, &r).await.unwrap();
            assert!(matches!(c, Claim::Execute(_)), "{other}: {c:?}");
            let id = pay(&mut tx, "acme", 100).await;
            let Claim::Execute(exec) = c else {
                unreachable!()
            };
            exec.complete(&mut tx, &created(id)).await.unwrap();
            tx.commit().await.unwrap();
        }
        // A finished key next to the held one replays (the claim itself, not
        // `run_once`, which would answer `Replay` after paying again), and
        // nothing was paid for it twice.
        let k4 = IdempotencyKey::parse("k4").unwrap();
        let mut r = req("acme", "pay", &k4, 100);
        r.in_flight_wait = Duration::from_secs(1);
        let mut tx = db.pool.begin().await.unwrap();
        let c = claim(&mut tx, &r).await.unwrap();
        assert!(matches!(c, Claim::Replay(_)), "k4: {c:?}");
        tx.rollback().await.unwrap();
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 5);
        drop(first);
    }

    lock_wait_tests!();

    /// `innodb_lock_wait_timeout` counts whole seconds: a 300 ms bound waits 1 s,
    /// 1.5 s waits 2 s; never less than configured, never a second more. The
    /// session gets its own lock wait back after the claim.
    #[tokio::test]
    async fn the_in_flight_bound_rounds_up_to_whole_seconds() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let mut r = req("acme", "pay", &key, 100);
        let mut first = db.pool.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut first, &r).await.unwrap() else {
            panic!()
        };
        let id = pay(&mut first, "acme", 100).await;
        for (bound, whole) in [(300, 1000), (1500, 2000)] {
            r.in_flight_wait = Duration::from_millis(bound);
            let mut dup = db.pool.begin().await.unwrap();
            let started = Instant::now();
            let c = claim(&mut dup, &r).await.unwrap();
            let waited = started.elapsed();
            assert!(matches!(c, Claim::InFlight { .. }), "{c:?}");
            assert!(
                waited >= Duration::from_millis(whole),
                "{bound} ms: waited {waited:?}"
            );
            assert!(
                waited < Duration::from_millis(whole + 900),
                "{bound} ms: waited {waited:?}"
            );
            let lock_wait: i64 =
                sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
                    .fetch_one(&mut *dup)
                    .await
                    .unwrap();
            assert_eq!(lock_wait, 50, "the session's own lock wait is back");
            // The timeout rolled back the statement only: the transaction goes on.
            let one: i64 = sqlx::query_scalar("SELECT 1")
                .fetch_one(&mut *dup)
                .await
                .unwrap();
            assert_eq!(one, 1);
        }
        exec.complete(&mut first, &created(id)).await.unwrap();
        first.commit().await.unwrap();
        assert!(matches!(run_once(&db, &r).await.unwrap(), Claim::Replay(_)));
    }

    /// A hand-written claim dropped while it waits for a row another transaction
    /// holds (a caller's timeout) leaves the session's lock wait as it was on
    /// the pooled connection: on the caller's connection the claim bounds its
    /// statements, not the session. Deterministic: the holder keeps the row
    /// locked until the claim, waiting on it, has been dropped.
    #[tokio::test]
    async fn a_cancelled_claim_leaves_no_lock_wait_on_the_pooled_connection() {
        let db = MySqlDb::with_pool_size(1).await;
        // The pool has one connection: every read is of the same session.
        const LOCK_WAIT: &str = "SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)";
        let server_default = db.count(LOCK_WAIT).await;
        assert!(
            server_default > 3,
            "the server's own lock wait is the claim's"
        );
        let key = IdempotencyKey::parse("k-cancelled").unwrap();
        let mut r = req("acme", "pay", &key, 100);
        r.in_flight_wait = Duration::from_secs(3);
        let holder_pool = sqlx::MySqlPool::connect(&db.url).await.unwrap();
        let mut holder = holder_pool
            .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
            .await
            .unwrap();
        assert!(matches!(
            claim(&mut holder, &r).await.unwrap(),
            Claim::Execute(_)
        ));
        // Dropped once the server shows the claim's statement waiting on the row.
        // Boxed, so that dropping it drops the claim (`pin!` would keep it
        // alive to the end of the scope, its connection held).
        let mut waiting = Box::pin(async {
            let mut tx = db.pool.begin().await.unwrap();
            claim(&mut tx, &r).await
        });
        tokio::select! {
            done = &mut waiting => panic!("the claim did not wait on the held row: {done:?}"),
            () = db.until_running(&holder_pool, "%FROM idempotency_requests%FOR UPDATE%") => {}
        }
        drop(waiting);
        holder.rollback().await.unwrap();
        let next = db.count(LOCK_WAIT).await;
        assert_eq!(
            next, server_default,
            "the pool handed out a connection with idem's lock wait on it"
        );
    }

    /// InnoDB's default isolation, REPEATABLE READ, takes gap locks on a
    /// locking read that finds no row: concurrent claims of a new key deadlock
    /// (error 1213) and the victims are answered in flight, never a second
    /// execution.
    #[tokio::test]
    async fn deadlocks_under_repeatable_read_are_answered_in_flight() {
        let db = Arc::new(MySqlDb::with_isolation(40, None).await);
        db.exec("CREATE TABLE payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB").await;
        let executed = claim_race(&db, 30).await;
        // Each victim of a deadlock is answered in flight (or, after the
        // winner committed, replayed); the winner executed, once.
        assert_eq!(executed, 1, "{executed} executions");
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
        // A retry now replays (the claim itself: `run_once` would answer
        // `Replay` after paying again).
        let key = IdempotencyKey::parse("race").unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        let retry = claim(&mut tx, &req("acme", "pay", &key, 100))
            .await
            .unwrap();
        assert!(matches!(retry, Claim::Replay(_)), "{retry:?}");
        tx.rollback().await.unwrap();
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 1);
    }

    #[tokio::test]
    async fn timestamps_come_from_the_database_clock_in_milliseconds() {
        use sqlx::Executor as _;
        let db = db().await;
        // The session's clock set to a moment no application clock reads
        // (2001-09-09 01:46:40 UTC): what idem writes can only be the
        // database's.
        let pinned = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET @@timestamp = 1000000000").await?;
                    Ok(())
                })
            })
            .connect(&db.url)
            .await
            .unwrap();
        let key = IdempotencyKey::parse("k1").unwrap();
        let r = req("acme", "pay", &key, 100);
        let mut tx = pinned.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut tx, &r).await.unwrap() else {
            panic!("a new key executes")
        };
        let id = pay(&mut tx, "acme", 100).await;
        exec.complete(&mut tx, &created(id)).await.unwrap();
        tx.commit().await.unwrap();
        let at: (i64, i64, i64) =
            sqlx::query_as("SELECT created_at, completed_at, expires_at FROM idempotency_requests")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let second = 1_000_000_000_000;
        assert_eq!(at, (second, second, second + 3_600_000));
    }

    /// One statement carries the whole outcome, so the server's
    /// `max_allowed_packet` (MariaDB: 16 MiB) is the ceiling of a stored body:
    /// past it the completion fails, nothing is stored or committed, and the key
    /// is free again.
    #[tokio::test]
    async fn a_body_past_max_allowed_packet_is_refused_and_nothing_is_kept() {
        let db = db().await;
        let packet: i64 = db
            .count("SELECT CAST(@@max_allowed_packet AS SIGNED)")
            .await;
        let key = IdempotencyKey::parse("big").unwrap();
        let r = req("acme", "pay", &key, 100);
        let mut tx = db.pool.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut tx, &r).await.unwrap() else {
            panic!()
        };
        pay(&mut tx, "acme", 100).await;
        let huge = StoredResponse {
            status: 201,
            headers: vec![],
            body: vec![b'x'; usize::try_from(packet).unwrap() + 1].into(),
        };
        assert!(exec.complete(&mut tx, &huge).await.is_err());
        drop(tx);
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0
        );
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 0);
        // A body well within it (1 MiB, idem's default limit) round-trips exactly.
        let mut tx = db.pool.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut tx, &r).await.unwrap() else {
            panic!()
        };
        let body: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        let big = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/octet-stream".into())],
            body: body.into(),
        };
        exec.complete(&mut tx, &big).await.unwrap();
        tx.commit().await.unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        match claim(&mut tx, &r).await.unwrap() {
            Claim::Replay(stored) => assert_eq!(stored, big),
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    /// Tenant ids, operations and keys are VARBINARY(255): a longer tenant id is
    /// refused by the database (strict mode), never truncated into another's.
    #[tokio::test]
    async fn a_tenant_id_past_255_bytes_is_refused_not_truncated() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let long = "t".repeat(256);
        let mut tx = db.pool.begin().await.unwrap();
        assert!(claim(&mut tx, &req(&long, "pay", &key, 100)).await.is_err());
        drop(tx);
        let fits = "t".repeat(255);
        assert!(matches!(
            run_once(&db, &req(&fits, "pay", &key, 100)).await.unwrap(),
            Claim::Replay(_)
        ));
    }

    #[tokio::test]
    async fn tenants_and_keys_compare_byte_for_byte() {
        // No collation: case and trailing spaces make other tenants (keys are
        // trimmed by their parser, so the tenant shows it).
        let db = db().await;
        let key = IdempotencyKey::parse("key").unwrap();
        for tenant in ["acme", "ACME", "acme "] {
            assert!(matches!(
                run_once(&db, &req(tenant, "pay", &key, 100)).await.unwrap(),
                Claim::Replay(_)
            ));
        }
        let upper = IdempotencyKey::parse("KEY").unwrap();
        assert!(matches!(
            run_once(&db, &req("acme", "pay", &upper, 100))
                .await
                .unwrap(),
            Claim::Replay(_)
        ));
        assert_eq!(db.count("SELECT count(*) FROM payments").await, 4);
    }
}

/// What only PostgreSQL has: waits on row locks, isolation levels, functions.
#[path = "runtime"]
mod postgres_only {
    use super::postgres::pay;
    use super::postgres::suite::db;
    use super::*;
    use crate::common::TestDb;

    mod lock_wait;

    lock_wait_tests!();

    /// Waits until some session of this database waits on a lock: the deterministic
    /// way to know a duplicate is blocked behind the first transaction.
    async fn wait_for_lock_waiter(db: &TestDb) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no session ever blocked on the key"
            );
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn the_in_flight_bound_is_kept_and_the_transaction_stays_usable() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let mut r = req("acme", "pay", &key, 100);
        let mut first = db.pool.begin().await.unwrap();
        let Claim::Execute(_exec) = claim(&mut first, &r).await.unwrap() else {
            panic!()
        };

        let bound = Duration::from_millis(400);
        r.in_flight_wait = bound;
        let mut dup = db.pool.begin().await.unwrap();
        let started = Instant::now();
        let c = claim(&mut dup, &r).await.unwrap();
        let waited = started.elapsed();
        let Claim::InFlight { retry_after } = c else {
            panic!("expected in flight, got {c:?}")
        };
        assert!(retry_after >= Duration::from_secs(1));
        assert!(
            waited >= bound,
            "gave up after {waited:?}, before the bound"
        );
        // Slack for a loaded machine; the point is that it did not wait for the first.
        assert!(
            waited < bound + Duration::from_secs(10),
            "waited {waited:?}"
        );
        // The duplicate's transaction is still usable, and its lock_timeout is back.
        let lock_timeout: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&mut *dup)
            .await
            .unwrap();
        assert_eq!(lock_timeout, "0");
        drop(first);
    }

    /// `lock_timeout` takes at most `i32::MAX` ms: a longer in-flight wait in a
    /// hand-written request (no `Idem` setting caps it) is that ceiling, not a
    /// claim that always fails.
    #[tokio::test]
    async fn an_in_flight_wait_past_the_lock_timeout_ceiling_still_claims() {
        let db = db().await;
        let key = IdempotencyKey::parse("k-long-wait").unwrap();
        let mut r = req("acme", "pay", &key, 100);
        r.in_flight_wait = Duration::from_secs(30 * 24 * 3600);
        let mut tx = db.pool.begin().await.unwrap();
        let c = claim(&mut tx, &r).await.unwrap();
        assert!(matches!(c, Claim::Execute(_)), "{c:?}");
    }

    #[tokio::test]
    async fn other_isolation_levels_are_refused_clearly() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .unwrap();
        let err = claim(&mut tx, &req("acme", "pay", &key, 1))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Isolation), "{err}");
        assert!(err.to_string().contains("READ COMMITTED"));
    }

    #[tokio::test]
    async fn timestamps_come_from_the_database_clock() {
        let db = db().await;
        let key = IdempotencyKey::parse("k1").unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        let Claim::Execute(exec) = claim(&mut tx, &req("acme", "pay", &key, 100))
            .await
            .unwrap()
        else {
            panic!("a new key executes")
        };
        let id = pay(&mut tx, "acme", 100).await;
        exec.complete(&mut tx, &created(id)).await.unwrap();
        // Read in the same transaction: `now()` is its start, to the
        // microsecond, which no application clock would have written; the
        // completion is the statement's own time, after it.
        let ok: bool = sqlx::query_scalar(
            "SELECT created_at = now() AND completed_at >= created_at \
                    AND completed_at <= clock_timestamp() \
                    AND expires_at = completed_at + interval '1 hour' FROM idempotency_requests",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert!(ok);
        tx.commit().await.unwrap();
    }

    /// A migration that fails (here the last one, its `VALIDATE` behind a
    /// lock another transaction holds, past a statement timeout) gives back
    /// the migrator's advisory lock, which sqlx's migrator answers an error
    /// without releasing: its connection is closed, not pooled holding it, so
    /// the next run (another process, a pool of its own) does not wait for it
    /// forever. The bound only ends a hang.
    #[tokio::test]
    async fn a_failed_migration_leaves_no_lock_for_the_next_run() {
        use sqlx::Executor as _;
        let db = TestDb::migrated_before(20261205000003).await;
        let impatient = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET statement_timeout = '300ms'").await?;
                    Ok(())
                })
            })
            .connect(&db.url)
            .await
            .unwrap();
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE idempotency_requests IN SHARE UPDATE EXCLUSIVE MODE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let failed = idem_runtime::migrate(&impatient).await.unwrap_err();
        assert!(failed.to_string().contains("statement timeout"), "{failed}");
        holder.rollback().await.unwrap();

        let other = sqlx::PgPool::connect(&db.url).await.unwrap();
        tokio::time::timeout(Duration::from_secs(60), idem_runtime::migrate(&other))
            .await
            .expect("the migrator's lock was left held by the failed run")
            .unwrap();
        let embedded = idem_runtime::migrator::<sqlx::Postgres>().iter().count() as i64;
        assert_eq!(
            db.count("SELECT count(*) FROM _idem_migrations").await,
            embedded
        );
    }

    #[tokio::test]
    async fn migrations_are_idempotent_and_kept_apart() {
        let db = db().await;
        idem_runtime::migrate(&db.pool).await.unwrap();
        let embedded = idem_runtime::migrator::<sqlx::Postgres>().iter().count() as i64;
        assert_eq!(
            db.count("SELECT count(*) FROM _idem_migrations").await,
            embedded
        );
        let app_table: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(
            app_table, None,
            "idem must not touch the application's migration table"
        );
    }
}
