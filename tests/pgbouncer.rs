//! idem behind PgBouncer (Debian's 1.18, which `.ci/run` starts on
//! 127.0.0.1:6432 in front of the test server: session pooling for every
//! database, and the alias `idem_transaction_pool` in transaction pooling).
//!
//! Session pooling keeps everything idem needs (prepared statements, row and
//! advisory locks, `SET LOCAL` and `set_config`, the request deadline): the
//! PostgreSQL suites run through it as well (`IDEM_TEST_PGBOUNCER_PORT`, see
//! `.ci/run`). Transaction pooling in PgBouncer 1.18 runs each transaction on
//! whichever server is free and does not carry sqlx's prepared statements
//! there: idem refuses it at start, with an error that names the settings that
//! work, instead of failing under load (docs/pgbouncer.md).

mod common;

use std::time::Duration;

use idem_runtime::{Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, StoreError};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use common::TestDb;

const PGBOUNCER_PORT: u16 = 6432;

/// A pool through PgBouncer to `database` (a database, or the alias of one).
async fn through_pgbouncer(database: &str) -> PgPool {
    let opts = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(PGBOUNCER_PORT)
        .username("postgres")
        .database(database)
        .ssl_mode(PgSslMode::Disable);
    PgPoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .expect("PgBouncer must run on 127.0.0.1:6432 (.ci/run starts it; see README)")
}

fn request(key: &IdempotencyKey) -> ClaimRequest<'_> {
    ClaimRequest {
        tenant: "acme",
        operation: "pay",
        key,
        fingerprint: FingerprintBuilder::new("acme", "pay", "POST", "/pay").finish(),
        retention: Duration::from_secs(3600),
        in_flight_wait: Duration::from_secs(1),
    }
}

/// Without a pooler, and through session pooling, the check passes, migrations
/// run, and a claim executes then replays.
#[tokio::test]
async fn a_session_pool_passes_the_check_migrates_and_claims() {
    let db = TestDb::new().await;
    idem_runtime::check_pooler(&db.pool).await.unwrap();
    let pool = through_pgbouncer(&db.name).await;
    idem_runtime::check_pooler(&pool).await.unwrap();
    idem_runtime::migrate(&pool).await.unwrap();
    let key = IdempotencyKey::parse("k1").unwrap();
    for replay in [false, true] {
        let mut tx = pool.begin().await.unwrap();
        match idem_runtime::claim(&mut tx, &request(&key)).await.unwrap() {
            Claim::Execute(execution) if !replay => {
                let stored = idem_runtime::StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: "{}".into(),
                };
                execution.complete(&mut tx, &stored).await.unwrap();
                tx.commit().await.unwrap();
            }
            Claim::Replay(stored) if replay => assert_eq!(stored.status, 201),
            other => panic!("replay {replay}: {other:?}"),
        }
    }
}

/// The database behind PgBouncer's transaction-pooling alias: nothing else
/// uses it, so a table in it would be one `migrate` wrote.
const PROBE_DATABASE: &str = "idem_pgbouncer_probe";

/// Through transaction pooling without prepared-statement support, the check
/// and `migrate` refuse at start, naming the settings that work; `migrate` does
/// so before it writes anything. So they do where the pool has one server
/// (`idem_transaction_pool_one`), whose connections wait for each other's
/// transactions rather than run on another server.
#[tokio::test]
async fn a_transaction_pool_that_loses_prepared_statements_is_refused_at_start() {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(&common::admin_url())
        .await
        .unwrap();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(PROBE_DATABASE)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    if !exists {
        // Two runs may race to create it: either way it exists after.
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {PROBE_DATABASE}"
        )))
        .execute(&mut admin)
        .await;
    }
    for alias in ["idem_transaction_pool", "idem_transaction_pool_one"] {
        let pool = through_pgbouncer(alias).await;
        let err = idem_runtime::check_pooler(&pool).await.unwrap_err();
        assert!(matches!(err, StoreError::Pooler(_)), "{alias}: {err:?}");
        let message = err.to_string();
        for hint in ["pool_mode = session", "max_prepared_statements", "1.21"] {
            assert!(message.contains(hint), "{alias}: {hint:?} not in {message}");
        }
        let err = idem_runtime::migrate(&pool).await.unwrap_err();
        assert!(matches!(err, StoreError::Pooler(_)), "{alias}: {err:?}");
    }
    let url = common::admin_url();
    let url = format!("{}/{PROBE_DATABASE}", &url[..url.rfind('/').unwrap()]);
    let mut direct = sqlx::PgConnection::connect(&url).await.unwrap();
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE tablename IN ('_idem_migrations', 'idempotency_requests')",
    )
    .fetch_one(&mut direct)
    .await
    .unwrap();
    assert_eq!(tables, 0, "migrate wrote before refusing");
}
