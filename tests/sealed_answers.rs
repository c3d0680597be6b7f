//! Stored answers sealed at rest (`Idem::with_key_ring`, `idem_runtime::at_rest`)
//! through a real router and a real database: what the row holds, what a retry
//! gets, and what is refused (a changed byte, an answer moved to another row, a
//! key the ring lacks), never replayed and never run again.
//!
//! The suite is ordinary code in `sealed_answers/suite.rs`. Its handlers are
//! `#[idempotent]` and so need a concrete `Tx<Db>` and `Lease<Db>`: each
//! database's module below sets `Db`, `TestDb` and its SQL, mounts the file,
//! and `sealed_tests!` stamps the `#[tokio::test]` wrappers, so a test is
//! `postgres::<name>`, `sqlite::<name>` and `mysql::<name>`.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_runtime::at_rest::{KeyRing, Zeroizing};
use idem_runtime::{
    Backend, Claim, ClaimRequest, FingerprintBuilder, Idem, IdempotencyKey, Lease, StoreError,
    StoredResponse, Tx, claim, claim_with_key_ring, idempotent,
};
use serde::{Deserialize, Serialize};
use tower::ServiceExt;

use common::caller::Caller;

#[derive(Deserialize, Serialize)]
struct NewWidget {
    name: String,
}

/// A ring of `ids` (each key 32 bytes of its id's last byte, so one id is one
/// key in every ring), `active` the one that seals.
fn ring(active: &str, ids: &[&str]) -> KeyRing {
    KeyRing::new(
        active,
        ids.iter().map(|id| {
            (
                *id,
                Zeroizing::new(vec![*id.as_bytes().last().unwrap(); 32]),
            )
        }),
    )
    .unwrap()
}

/// Every test of `sealed_answers/suite.rs`, stamped in the database's module.
macro_rules! sealed_tests {
    () => {
        stamp!(
            suite =>
            a_sealed_answer_replays_byte_for_byte_and_its_row_holds_no_plaintext,
            a_changed_byte_is_refused_and_nothing_runs_again,
            an_answer_moved_to_another_row_does_not_open,
            a_key_the_ring_lacks_is_refused_and_a_mismatch_is_still_422,
            rotation_opens_old_answers_and_seals_new_ones_with_the_active_key,
            clear_answers_stay_readable_and_sealed_ones_need_the_ring,
            a_ring_refusing_clear_answers_replays_and_seals_none_of_them,
            claims_made_before_the_handler_seal_too,
            an_expired_key_runs_anew_and_its_new_answer_opens,
            a_leased_answer_is_sealed_and_replayed,
            a_reconciler_from_the_service_seals_what_it_resolves,
            hand_written_claims_seal_with_the_ring_and_refuse_without,
            rekey_moves_answers_to_the_active_key_and_a_stopped_run_resumes,
            two_rekeys_beside_live_replays_move_every_answer_once,
            a_rekey_reaches_every_tenant_whatever_its_case,
            a_spoiled_row_is_counted_broken_and_the_rekey_goes_on,
        );
    };
}

#[path = "sealed_answers"]
mod postgres {
    use super::*;

    type Db = sqlx::Postgres;
    type TestDb = crate::common::TestDb;
    const WIDGETS_DDL: &str =
        "CREATE TABLE widgets (id bigserial PRIMARY KEY, tenant text NOT NULL, name text NOT NULL)";
    const INSERT_WIDGET: &str = "INSERT INTO widgets (tenant, name) VALUES ($1, $2)";
    const HEADERS_TEXT: &str = "response_headers::text";
    /// The headers column is `jsonb`: it holds JSON only.
    const TEXT_HEADERS: bool = false;
    const SET_ANSWER: &str = "UPDATE idempotency_requests \
        SET response_body = $1, response_headers = $2::jsonb WHERE key_digest = $3";

    /// The rekey's write, waiting for a row lock.
    const RESEAL_WAITING: &str = "SELECT count(*) FROM pg_stat_activity \
        WHERE datname = current_database() AND wait_event_type = 'Lock' \
          AND query LIKE 'UPDATE idempotency_requests SET response_headers%'";
    /// The held row made a later run's: another time, other headers.
    const LATER_RUN: &str = "UPDATE idempotency_requests \
        SET created_at = created_at + interval '1 second', response_headers = $1::jsonb";

    mod suite;

    sealed_tests!();

    stamp!(
        suite =>
        the_bound_path_seals_as_the_session_path_does,
        a_row_swept_under_a_takeover_gets_the_executions_generation,
        a_rekey_does_not_write_over_a_later_run_of_the_key,
    );
}

#[path = "sealed_answers"]
mod sqlite {
    use super::*;

    type Db = sqlx::Sqlite;
    type TestDb = crate::common::SqliteDb;
    const WIDGETS_DDL: &str = "CREATE TABLE widgets (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, name TEXT NOT NULL)";
    const INSERT_WIDGET: &str = "INSERT INTO widgets (tenant, name) VALUES ($1, $2)";
    const HEADERS_TEXT: &str = "response_headers";
    /// The headers column is text: it can hold what is not JSON.
    const TEXT_HEADERS: bool = true;
    const SET_ANSWER: &str = "UPDATE idempotency_requests \
        SET response_body = $1, response_headers = $2 WHERE key_digest = $3";
    /// Unused here: SQLite shows no statement waiting for a row.
    const RESEAL_WAITING: &str = "";
    const LATER_RUN: &str = "";

    mod suite;

    sealed_tests!();
}

#[path = "sealed_answers"]
mod mysql {
    use super::*;

    type Db = sqlx::MySql;
    type TestDb = crate::common::MySqlDb;
    const WIDGETS_DDL: &str = "CREATE TABLE widgets (id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARCHAR(64) NOT NULL, name VARCHAR(255) NOT NULL) ENGINE = InnoDB";
    const INSERT_WIDGET: &str = "INSERT INTO widgets (tenant, name) VALUES (?, ?)";
    const HEADERS_TEXT: &str = "response_headers";
    /// The headers column is text: it can hold what is not JSON.
    const TEXT_HEADERS: bool = true;
    const SET_ANSWER: &str = "UPDATE idempotency_requests \
        SET response_body = ?, response_headers = ? WHERE key_digest = ?";
    /// The rekey's write, waiting for a row lock.
    const RESEAL_WAITING: &str = "SELECT count(*) FROM information_schema.PROCESSLIST \
        WHERE DB = DATABASE() AND INFO LIKE 'UPDATE idempotency_requests SET response_headers%'";
    /// The held row made a later run's: another time, other headers.
    const LATER_RUN: &str = "UPDATE idempotency_requests \
        SET created_at = created_at + 1000, response_headers = ?";

    mod suite;

    sealed_tests!();

    stamp!(
        suite =>
        a_row_swept_under_a_takeover_gets_the_executions_generation,
        a_rekey_does_not_write_over_a_later_run_of_the_key,
    );

    /// Each page of a rekey reads about its own rows, wherever it resumes:
    /// the resume point is written so that the primary key's range serves it.
    /// As a row comparison, MariaDB read the table from its start for every
    /// page (no index for a row comparison), about n²/2 rows for a run over n,
    /// so a run over a large table never ended. Counted by the server's
    /// handler reads on the one connection the rekey runs on.
    #[tokio::test]
    async fn a_rekey_reads_each_row_about_once_not_the_table_before_each_page() {
        use idem_runtime::admin::{self, RekeyOptions};
        use sqlx::mysql::MySqlPoolOptions;

        const ROWS: usize = 2000;
        let db = TestDb::new().await;
        let values: Vec<String> = (0..ROWS)
            .map(|i| {
                format!(
                    "('acme', 'op', UNHEX(SHA2('f{i}', 256)), 'completed', 200, '[]', 'x', {i}, \
                      9999999999999, UNHEX(SHA2('k{i}', 256)))"
                )
            })
            .collect();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_requests (tenant_id, operation, fingerprint, state, \
               response_status, response_headers, response_body, created_at, expires_at, \
               key_digest) VALUES {}",
            values.join(", ")
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let one = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&db.url)
            .await
            .unwrap();
        let reads = || crate::common::MySqlDb::rows_read(&one);
        let before = reads().await;
        let mut pages = RekeyOptions::default();
        pages.batch = 50;
        pages.seal_clear = true;
        let report = admin::rekey(&one, &ring("k1", &["k1"]), pages, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap();
        assert_eq!(report.resealed, ROWS as u64, "{report:?}");
        let read = reads().await - before;
        assert!(
            read < 3 * ROWS as u64,
            "{read} rows read for {ROWS} rows in pages of 50 (from the start each time: about {})",
            ROWS * ROWS / 100
        );
    }
}
