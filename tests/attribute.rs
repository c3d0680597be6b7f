//! `#[idempotent]` through a real `axum::Router`, against a real PostgreSQL, a
//! SQLite file and MySQL / MariaDB: the same handlers and tests, written once in
//! `attribute/suite.rs`. The backend is picked by the handlers' `Tx<Db>` type,
//! so the suite is mounted in each database's module below, which sets `Db`,
//! `TestDb`, the widgets table and how a widget is written (its `#[path]` makes
//! `attribute/` its directory); `attribute_tests!` stamps the `#[tokio::test]`
//! wrappers there, so a test is `postgres::<name>`, `sqlite::<name>` or
//! `mysql::<name>`.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, response::IntoResponse};
use http_body_util::BodyExt;
use idem_runtime::{Idem, Tx, idempotent};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tower::ServiceExt;

/// Every test of `attribute/suite.rs`, as a `#[tokio::test]` wrapper in the
/// database's module. A test written in the suite but left out here is an
/// unused function, which the build refuses (`-D warnings`).
macro_rules! attribute_tests {
    () => {
        attribute_tests!(
            retry_replays_the_stored_answer,
            a_changed_body_or_header_is_a_mismatch,
            missing_and_malformed_keys_are_400_problems,
            extractor_rejections_reserve_nothing,
            tenants_and_operations_are_isolated,
            handler_err_and_5xx_roll_back_and_free_the_key,
            an_uncertain_answer_from_a_transaction_rolls_back_as_500,
            a_committed_4xx_business_rejection_is_replayed,
            a_duplicate_in_flight_gets_409_with_retry_after,
            concurrent_duplicates_through_the_router_execute_once,
            replays_carry_only_stored_headers_and_never_set_cookie,
            a_response_over_the_limit_is_rolled_back_not_lost,
            single_tenant_handlers_run_and_replay,
            the_concrete_path_and_query_are_part_of_the_request,
            a_nested_routes_full_path_is_part_of_the_request,
            a_rejected_fallible_body_is_answered_before_the_claim,
            an_optional_body_absent_and_present_are_different_requests,
            a_body_behind_an_alias_is_fingerprinted,
            a_bytes_body_is_fingerprinted_byte_for_byte,
            ignore_body_leaves_the_body_out_as_written,
            a_path_tenant_scopes_the_key,
            a_tenant_id_with_a_nul_is_refused_before_the_claim,
        );
    };
    ($($test:ident),* $(,)?) => {
        stamp!(suite => $($test),*);
    };
}

#[path = "attribute"]
mod postgres {
    use super::*;
    use suite::{AppState, WAIT, app, create_widget, request, send};

    type Db = sqlx::Postgres;
    type TestDb = crate::common::TestDb;
    const WIDGETS_DDL: &str =
        "CREATE TABLE widgets (id bigserial PRIMARY KEY, tenant text NOT NULL, name text NOT NULL)";
    /// idem's tenant column, read as text.
    const TENANT_TEXT: &str = "tenant_id";

    /// Writes one widget in the claimed transaction; its id.
    async fn add_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("INSERT INTO widgets (tenant, name) VALUES ($1, $2) RETURNING id")
            .bind(tenant)
            .bind(name)
            .fetch_one(&mut **tx)
            .await
    }

    mod suite;

    attribute_tests!();

    #[tokio::test]
    async fn a_stricter_default_isolation_level_is_overridden() {
        let a = app(None, WAIT).await;
        let db = &a.db.name;
        a.db.exec(&format!(
            "ALTER DATABASE {db} SET default_transaction_isolation = 'serializable'"
        ))
        .await;
        // New connections pick the setting up; the pool may hold old ones, so use a new pool.
        let pool = sqlx::PgPool::connect(&a.db.url).await.unwrap();
        let level: String = sqlx::query_scalar("SHOW default_transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(level, "serializable");
        let router = Router::new()
            .route("/widgets", post(create_widget))
            .with_state(AppState {
                idem: Idem::new(pool),
                gate: None,
            });
        let r = send(
            &router,
            request("/widgets", Some("acme"), Some("k1"), r#"{"name":"x"}"#),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }
}

#[path = "attribute"]
mod sqlite {
    use super::*;

    type Db = sqlx::Sqlite;
    type TestDb = crate::common::SqliteDb;
    const WIDGETS_DDL: &str = "CREATE TABLE widgets (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, name TEXT NOT NULL)";
    /// idem's tenant column, read as text.
    const TENANT_TEXT: &str = "tenant_id";

    /// Writes one widget in the claimed transaction; its id.
    async fn add_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("INSERT INTO widgets (tenant, name) VALUES ($1, $2) RETURNING id")
            .bind(tenant)
            .bind(name)
            .fetch_one(&mut **tx)
            .await
    }

    mod suite;

    attribute_tests!();
}

#[path = "attribute"]
mod mysql {
    use super::*;

    type Db = sqlx::MySql;
    type TestDb = crate::common::MySqlDb;
    const WIDGETS_DDL: &str = "CREATE TABLE widgets (id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARCHAR(64) NOT NULL, name VARCHAR(255) NOT NULL) ENGINE = InnoDB";
    /// idem's tenant column, read as text: the key columns are VARBINARY
    /// (byte-for-byte keys).
    const TENANT_TEXT: &str = "CONVERT(tenant_id USING utf8mb4)";

    /// Writes one widget in the claimed transaction; its id (MySQL has no
    /// `RETURNING`).
    async fn add_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) -> Result<i64, sqlx::Error> {
        let done = sqlx::query("INSERT INTO widgets (tenant, name) VALUES (?, ?)")
            .bind(tenant)
            .bind(name)
            .execute(&mut **tx)
            .await?;
        Ok(i64::try_from(done.last_insert_id()).unwrap())
    }

    mod suite;

    attribute_tests!();
}
