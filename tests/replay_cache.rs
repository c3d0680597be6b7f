//! The opt-in replay cache (`Idem::with_replay_cache`) through a real router and
//! a real database: what it answers without the database, and what it must not
//! outlive. A row deleted behind the cache's back (as a purge on another replica
//! would) shows whether an answer came from the cache or from the database.
//!
//! The suite is ordinary code in `replay_cache/suite.rs`. Its handlers are
//! `#[idempotent]` and so need a concrete `Tx<Db>`: each database's module
//! below sets `Db`, `TestDb` and its SQL, mounts the file (the module's
//! `#[path]` makes `replay_cache/` its directory), and `cache_tests!` stamps
//! the `#[tokio::test]` wrappers, so a test is `postgres::<name>`,
//! `sqlite::<name>` and `mysql::<name>`.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::FromRef;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, response::IntoResponse};
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_runtime::{Idem, ReplayCache, Tx, idempotent};
use serde::Deserialize;
use tower::ServiceExt;

use common::caller::Caller;

#[derive(Deserialize, serde::Serialize)]
struct NewWidget {
    name: String,
    #[serde(default)]
    size: usize,
}

/// Every test of `replay_cache/suite.rs`, stamped in the database's module.
macro_rules! cache_tests {
    () => {
        stamp!(
            suite =>
            a_cached_replay_needs_no_row_and_is_byte_identical,
            a_cleared_cache_answers_from_the_database_again,
            erasing_the_tenant_forgets_its_cached_answers,
            an_erasure_dropped_part_way_leaves_no_cached_answer,
            a_cached_key_refuses_another_request,
            without_a_cache_every_answer_comes_from_the_database,
            an_answer_too_large_for_the_cache_is_not_kept,
            a_purge_elsewhere_is_seen_once_max_age_has_passed,
            a_cached_answer_never_outlives_its_rows_retention,
        );
    };
}

trait Expiry {
    /// A count of rows the database itself takes as expired.
    fn expired_sql() -> &'static str;
}

impl Expiry for common::TestDb {
    fn expired_sql() -> &'static str {
        "SELECT count(*) FROM idempotency_requests WHERE expires_at <= now()"
    }
}

impl Expiry for common::MySqlDb {
    fn expired_sql() -> &'static str {
        concat!(
            "SELECT count(*) FROM idempotency_requests WHERE expires_at <= ",
            idem_runtime::mysql_now_ms!()
        )
    }
}

impl Expiry for common::SqliteDb {
    fn expired_sql() -> &'static str {
        concat!(
            "SELECT count(*) FROM idempotency_requests WHERE expires_at <= ",
            idem_runtime::sqlite_now_ms!()
        )
    }
}

#[path = "replay_cache"]
mod postgres {
    use super::*;

    type Db = sqlx::Postgres;
    type TestDb = crate::common::TestDb;
    const WIDGETS_DDL: &str =
        "CREATE TABLE widgets (id bigserial PRIMARY KEY, tenant text NOT NULL, name text NOT NULL)";
    const INSERT_WIDGET: &str = "INSERT INTO widgets (tenant, name) VALUES ($1, $2)";

    mod suite;

    cache_tests!();
}

#[path = "replay_cache"]
mod sqlite {
    use super::*;

    type Db = sqlx::Sqlite;
    type TestDb = crate::common::SqliteDb;
    const WIDGETS_DDL: &str = "CREATE TABLE widgets (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, name TEXT NOT NULL)";
    const INSERT_WIDGET: &str = "INSERT INTO widgets (tenant, name) VALUES ($1, $2)";

    mod suite;

    cache_tests!();
}

#[path = "replay_cache"]
mod mysql {
    use super::*;

    type Db = sqlx::MySql;
    type TestDb = crate::common::MySqlDb;
    const WIDGETS_DDL: &str = "CREATE TABLE widgets (id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARCHAR(64) NOT NULL, name VARCHAR(255) NOT NULL) ENGINE = InnoDB";
    const INSERT_WIDGET: &str = "INSERT INTO widgets (tenant, name) VALUES (?, ?)";

    mod suite;

    cache_tests!();
}
