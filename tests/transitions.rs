//! Idempotent state transitions with optimistic locking, against PostgreSQL, MySQL and a
//! SQLite file. The shared behaviour is ordinary code in `transitions/suite.rs`:
//! each database's module below sets `Db` and `TestDb`, mounts the file (the
//! module's `#[path]` makes `transitions/` its directory), and
//! `transition_tests!` stamps the `#[tokio::test]` wrappers, so a test is
//! `postgres::<name>`, `sqlite::<name>` and `mysql::<name>`. How a concurrent
//! transition is held off is tested per database beside it (a row lock on
//! PostgreSQL and MySQL, the write lock on SQLite).

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

use idem_runtime::transition::{Resource, States, TransitionError, Transitioned, transition};
use sqlx::Transaction;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Created,
    Paid,
    Shipped,
}

impl States for Step {
    const ALL: &'static [Self] = &[Self::Created, Self::Paid, Self::Shipped];
    const TRANSITIONS: &'static [(Self, Self)] =
        &[(Self::Created, Self::Paid), (Self::Paid, Self::Shipped)];
    fn name(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Paid => "paid",
            Self::Shipped => "shipped",
        }
    }
}

const ORDERS: Resource = Resource {
    table: "orders",
    id_column: "id",
    state_column: "status",
    version_column: "version",
    scope_column: Some("tenant_id"),
};

const DDL: &str = "CREATE TABLE orders (id bigint PRIMARY KEY, tenant_id text NOT NULL, status text NOT NULL, version bigint NOT NULL);
     CREATE TABLE payments (order_id bigint NOT NULL);
     INSERT INTO orders VALUES (1, 'acme', 'created', 1);";

type Outcome = Result<Transitioned<()>, TransitionError<Step, sqlx::Error>>;

/// Every test of `transitions/suite.rs`, stamped in the database's module.
macro_rules! transition_tests {
    () => {
        stamp!(
            suite =>
            a_repeated_transition_is_a_no_op_success,
            an_invalid_transition_is_a_typed_error,
            an_unscoped_resource_is_found_by_id_alone,
            a_scope_that_does_not_fit_the_resource_is_an_error_not_a_miss,
            a_writer_that_bypasses_the_lock_is_fenced_by_the_version,
        );
    };
}

#[path = "transitions"]
mod postgres {
    use super::*;
    use suite::{db, go};

    type Db = sqlx::Postgres;
    type TestDb = crate::common::TestDb;

    mod suite;

    transition_tests!();

    #[tokio::test]
    async fn of_two_concurrent_transitions_one_runs_and_the_other_is_a_no_op() {
        let db = db().await;
        let mut a = db.pool.begin().await.unwrap();
        let mut b = db.pool.begin().await.unwrap();
        let a_result = go(&mut a, Step::Paid).await.unwrap();
        assert!(matches!(a_result, Transitioned::Applied { version: 2, .. }));
        // B blocks on A's row lock before its action could run...
        let b_task = tokio::spawn(async move {
            let r = go(&mut b, Step::Paid).await;
            (r, b)
        });
        wait_for_lock_waiter(&db).await;
        a.commit().await.unwrap();
        // ...and then sees A's state: nothing to do, its action never ran.
        let (b_result, b) = b_task.await.unwrap();
        assert!(
            matches!(b_result, Ok(Transitioned::AlreadyThere { version: 2 })),
            "{b_result:?}"
        );
        b.commit().await.unwrap();
        assert_eq!(
            db.count("SELECT count(*) FROM payments").await,
            1,
            "one payment"
        );
    }

    async fn wait_for_lock_waiter(db: &TestDb) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while db
            .count("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")
            .await
            == 0
        {
            assert!(std::time::Instant::now() < deadline, "B never blocked on A");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}

#[path = "transitions"]
mod sqlite {
    use super::*;
    use suite::{db, go};

    type Db = sqlx::Sqlite;
    type TestDb = crate::common::SqliteDb;

    mod suite;

    transition_tests!();

    /// SQLite has no row locks: the transition takes the database's write lock
    /// before it reads. While A holds it, B cannot even read its state (past its
    /// busy timeout it fails, its action unrun); after A commits, B is a no-op.
    #[tokio::test]
    async fn a_concurrent_transition_cannot_run_while_the_first_holds_the_lock() {
        use sqlx::Connection;

        let db = db().await;
        let mut a = db.pool.begin().await.unwrap();
        assert!(matches!(
            go(&mut a, Step::Paid).await.unwrap(),
            Transitioned::Applied { version: 2, .. }
        ));
        let mut b_conn = db.pool.acquire().await.unwrap();
        sqlx::query("PRAGMA busy_timeout = 50")
            .execute(&mut *b_conn)
            .await
            .unwrap();
        let mut b = b_conn.begin().await.unwrap();
        match go(&mut b, Step::Paid).await {
            Err(TransitionError::Database(sqlx::Error::Database(e)))
                if e.message().contains("locked") => {}
            other => panic!("expected SQLITE_BUSY while A holds the lock, got {other:?}"),
        }
        drop(b);
        a.commit().await.unwrap();
        let mut b = b_conn.begin().await.unwrap();
        assert_eq!(
            go(&mut b, Step::Paid).await.unwrap(),
            Transitioned::AlreadyThere { version: 2 }
        );
        b.commit().await.unwrap();
        assert_eq!(
            db.count("SELECT count(*) FROM payments").await,
            1,
            "one payment"
        );
    }
}

#[path = "transitions"]
mod mysql {
    use super::*;
    use suite::{db, go};

    type Db = sqlx::MySql;
    type TestDb = crate::common::MySqlDb;

    mod suite;

    transition_tests!();

    /// InnoDB's row lock, as on PostgreSQL: B's locking read waits for A, then
    /// reads A's committed state (a locking read reads the latest committed
    /// version at any isolation level) and is a no-op.
    #[tokio::test]
    async fn of_two_concurrent_transitions_one_runs_and_the_other_is_a_no_op() {
        let db = db().await;
        let mut a = db.pool.begin().await.unwrap();
        let mut b = db.pool.begin().await.unwrap();
        let a_result = go(&mut a, Step::Paid).await.unwrap();
        assert!(matches!(a_result, Transitioned::Applied { version: 2, .. }));
        let b_task = tokio::spawn(async move {
            let r = go(&mut b, Step::Paid).await;
            (r, b)
        });
        // B's locking read, seen in the process list while it waits for A
        // (A is idle: its statement has returned).
        db.until_running(&db.pool, "%FOR UPDATE%").await;
        a.commit().await.unwrap();
        let (b_result, b) = b_task.await.unwrap();
        assert!(
            matches!(b_result, Ok(Transitioned::AlreadyThere { version: 2 })),
            "{b_result:?}"
        );
        b.commit().await.unwrap();
        assert_eq!(
            db.count("SELECT count(*) FROM payments").await,
            1,
            "one payment"
        );
    }
}
