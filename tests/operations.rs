//! Long operations (`#[idempotent(.., lease = "..", accepted)]`) against real
//! stores: PostgreSQL, SQLite, MySQL / MariaDB and Redis. A request is answered
//! `202` with its operation's resource at once while its handler works on; the
//! resource (`idem_runtime::operations::router`) shows the states, is the
//! caller's tenant's only, and follows a takeover after a crash.
//!
//! The handler stops at a gate the test opens (no sleep decides a race), and
//! `Idem::executions().drained()` waits for the work that outlives its `202`.
//! The effect is a downstream system with its own idempotency by key, so "one
//! effect" is checked where the effect would happen.
//!
//! The suite is ordinary code in `operations/suite.rs`. Its handlers are
//! `#[idempotent]` and so need a concrete store type: each store's module below
//! sets `Db` and `backend`, mounts the file (the module's `#[path]` makes
//! `operations/` its directory), and `operation_tests!` stamps the
//! `#[tokio::test]` wrappers, so a test is `postgres::<name>`, `redis::<name>`
//! and so on. What only a SQL store shows is `operations/sql.rs`, mounted in
//! the three SQL stores' modules alone.

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
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::caller::Caller;
use http_body_util::BodyExt;
use idem_runtime::lease::{Acquisition, LeaseBackend};
use idem_runtime::operations::{self, Operation, Status};
use idem_runtime::reconcile::{Reconcile, Reconciler, Resolution, UncertainOutcome};
use idem_runtime::{Idem, Lease, StoredResponse, Uncertain, idempotent};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};
use tower::ServiceExt;

/// What a job does, and whether it stops at the gate first.
#[derive(Debug, Clone, Deserialize, Serialize)]
struct Job {
    kind: String,
    #[serde(default)]
    hold: bool,
}

/// A downstream system with its own idempotency: a second call with the same
/// key returns the first call's export.
#[derive(Default)]
struct Downstream {
    exports: Mutex<HashMap<String, String>>,
    calls: AtomicUsize,
}

impl Downstream {
    fn export(&self, key: &str) -> String {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut exports = self.exports.lock().unwrap();
        let n = exports.len();
        exports
            .entry(key.to_owned())
            .or_insert_with(|| format!("exp_{n}"))
            .clone()
    }

    fn find(&self, key: &str) -> Option<String> {
        self.exports.lock().unwrap().get(key).cloned()
    }

    fn count(&self) -> usize {
        self.exports.lock().unwrap().len()
    }
}

/// The stored answer of a finished export.
fn exported(id: &str) -> serde_json::Value {
    json!({ "export": id })
}

/// Every test of `operations/suite.rs`, stamped in the store's module.
macro_rules! operation_tests {
    () => {
        stamp!(
            suite =>
            a_long_operation_answers_202_at_once_and_replays_its_answer_when_done,
            the_resource_shows_running_then_succeeded_and_replays_the_result,
            a_refused_job_is_failed_and_its_4xx_is_the_result,
            an_uncertain_job_is_shown_uncertain_until_the_reconciler_resolves_it,
            another_tenant_gets_the_same_404_as_an_operation_that_never_was,
            a_job_killed_mid_work_is_taken_over_at_the_same_address_with_one_effect,
            another_request_under_the_key_is_422_while_running_and_when_done,
            concurrent_duplicates_all_see_one_operation_and_one_effect,
            concurrent_first_requests_start_one_operation,
            a_single_tenant_service_reads_its_operations,
            a_failed_job_frees_its_key_and_its_resource_is_gone,
            a_result_that_cannot_be_opened_never_says_nothing_was_stored,
        );
    };
}

/// The tests of `operations/sql.rs`, for the SQL stores.
macro_rules! sql_tests {
    () => {
        stamp!(
            sql =>
            a_finished_operation_past_its_retention_is_gone_and_runs_anew,
            a_request_whose_claim_reads_nothing_is_not_given_the_operation,
        );
    };
}

#[path = "operations"]
mod postgres {
    use super::*;

    type Db = sqlx::Postgres;
    type SqlDb = crate::common::TestDb;
    /// The database's clock, as `expires_at` is written.
    const NOW: &str = "clock_timestamp()";

    async fn backend(_test: &str) -> suite::Backend {
        let db = SqlDb::new().await;
        suite::Backend {
            idem: Idem::new(db.pool.clone()),
            store: db.pool.clone(),
            _keep: Box::new(db),
        }
    }

    mod sql;
    mod suite;

    operation_tests!();
    sql_tests!();
}

#[path = "operations"]
mod sqlite {
    use super::*;

    type Db = sqlx::Sqlite;
    type SqlDb = crate::common::SqliteDb;
    const NOW: &str = idem_runtime::sqlite_now_ms!();

    async fn backend(_test: &str) -> suite::Backend {
        let db = SqlDb::new().await;
        suite::Backend {
            idem: Idem::new(db.pool.clone()),
            store: db.pool.clone(),
            _keep: Box::new(db),
        }
    }

    mod sql;
    mod suite;

    operation_tests!();
    sql_tests!();
}

#[path = "operations"]
mod mysql {
    use super::*;

    type Db = sqlx::MySql;
    type SqlDb = crate::common::MySqlDb;
    const NOW: &str = idem_runtime::mysql_now_ms!();

    async fn backend(_test: &str) -> suite::Backend {
        let db = SqlDb::new().await;
        suite::Backend {
            idem: Idem::new(db.pool.clone()),
            store: db.pool.clone(),
            _keep: Box::new(db),
        }
    }

    mod sql;
    mod suite;

    operation_tests!();
    sql_tests!();
}

#[path = "operations"]
mod redis {
    use super::*;
    use ::redis::aio::ConnectionManager;
    use idem_runtime::redis::RedisLeaseStore;

    type Db = idem_runtime::redis::Redis;

    fn redis_url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
    }

    /// A store under a prefix of this test's own, emptied first.
    async fn backend(test: &str) -> suite::Backend {
        let prefix = format!("idem-t{}-ops-{test}", std::process::id());
        let client = ::redis::Client::open(redis_url()).unwrap();
        let mut conn = ConnectionManager::new(client).await.unwrap();
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        for k in keys {
            let _: () = ::redis::cmd("DEL")
                .arg(k)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        let store = RedisLeaseStore::with_connection(conn, &prefix)
            .await
            .unwrap();
        suite::Backend {
            idem: store.idem(),
            store,
            _keep: Box::new(()),
        }
    }

    mod suite;

    operation_tests!();
}
