//! The `quickstart` example (`examples/quickstart.rs`) as `cargo run --example
//! quickstart` runs it: the real binary, started with no setup in an empty
//! directory of its own, over real HTTP. It keeps its data
//! in `idem-quickstart.db` in that directory, which the tests open to count the
//! orders it committed.
//!
//! The example binary is built by `cargo test --workspace`; run `cargo build
//! --example quickstart` first when running this file alone.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Connection, SqliteConnection};
use tokio::process::Command;

use common::orders::Server;

/// The example running in a directory of its own, removed at the end.
struct Quickstart {
    server: Server,
    dir: PathBuf,
}

impl Quickstart {
    async fn start() -> Quickstart {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem_quickstart_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let server = Self::spawn(&dir).await;
        Quickstart { server, dir }
    }

    /// Starts the binary in `dir` as a user starts it. [`Server::spawn`] sets
    /// `IDEM_ADDR` to a free port (so tests run in parallel) and the log's
    /// settings, and waits until it logs that it listens.
    async fn spawn(dir: &Path) -> Server {
        let mut cmd = Command::new(common::example_binary("quickstart"));
        cmd.current_dir(dir);
        Server::spawn(cmd, &[]).await
    }

    /// Kills the process (SIGKILL, a crash) and starts it again on the same file.
    async fn crash_and_restart(&mut self) {
        self.server.kill().await;
        self.server = Self::spawn(&self.dir).await;
    }

    /// `POST /orders` as `tenant` with `key` and `body`.
    async fn post(&self, tenant: &str, key: &str, body: &str) -> Answer {
        let resp = reqwest::Client::new()
            .post(format!("{}/orders", self.server.base))
            .header("authorization", format!("Bearer {tenant}"))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        Answer {
            status: resp.status(),
            replayed: header("idempotent-replayed"),
            content_type: header("content-type"),
            body: resp.text().await.unwrap(),
        }
    }

    /// The rows of the example's own table, read from its database file, as
    /// `id tenant sku xquantity`.
    async fn orders(&self) -> Vec<String> {
        let file = self.dir.join("idem-quickstart.db");
        assert!(file.exists(), "{} was not created", file.display());
        let options = SqliteConnectOptions::new().filename(&file).read_only(true);
        let mut conn = SqliteConnection::connect_with(&options).await.unwrap();
        let rows: Vec<(i64, String, String, i64)> =
            sqlx::query_as("SELECT id, tenant, sku, quantity FROM orders ORDER BY id")
                .fetch_all(&mut conn)
                .await
                .unwrap();
        conn.close().await.unwrap();
        rows.into_iter()
            .map(|(id, tenant, sku, quantity)| format!("{id} {tenant} {sku} x{quantity}"))
            .collect()
    }
}

impl Drop for Quickstart {
    fn drop(&mut self) {
        // The process first (kill_on_drop), then its files.
        let _ = self.server.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Answer {
    status: StatusCode,
    /// The `Idempotent-Replayed` header, if there was one.
    replayed: Option<String>,
    content_type: Option<String>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

const ORDER: &str = r#"{"sku":"A-1","quantity":2}"#;

#[tokio::test]
async fn a_retry_with_the_same_key_and_body_replays_the_answer_and_inserts_nothing() {
    let qs = Quickstart::start().await;

    let first = qs.post("acme", "k-1", ORDER).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.replayed, None);
    assert_eq!(first.json(), json!({"id": 1, "sku": "A-1", "quantity": 2}));
    assert_eq!(qs.orders().await, ["1 acme A-1 x2"]);

    let retry = qs.post("acme", "k-1", ORDER).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.replayed.as_deref(), Some("true"));
    assert_eq!(retry.body, first.body, "the stored body, byte for byte");
    assert_eq!(qs.orders().await.len(), 1, "the retry inserted an order");
}

/// The body is fingerprinted as its JSON value: the same fields in another order
/// and spacing are the same request.
#[tokio::test]
async fn a_retry_with_the_same_fields_in_another_order_is_the_same_request() {
    let qs = Quickstart::start().await;
    let first = qs.post("acme", "k-1", ORDER).await;
    let retry = qs
        .post("acme", "k-1", r#"{ "quantity": 2, "sku": "A-1" }"#)
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.replayed.as_deref(), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(qs.orders().await.len(), 1);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_a_422_problem_and_runs_nothing() {
    let qs = Quickstart::start().await;
    let first = qs.post("acme", "k-1", ORDER).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let other = qs
        .post("acme", "k-1", r#"{"sku":"A-1","quantity":3}"#)
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.replayed, None);
    assert_eq!(
        other.content_type.as_deref(),
        Some("application/problem+json")
    );
    assert_eq!(
        other.json()["type"],
        "urn:idem:problem:fingerprint-mismatch"
    );
    assert_eq!(qs.orders().await, ["1 acme A-1 x2"]);

    // The refusal changed nothing: the first request's retry still replays it.
    let retry = qs.post("acme", "k-1", ORDER).await;
    assert_eq!(retry.replayed.as_deref(), Some("true"));
    assert_eq!(retry.body, first.body);
}

/// Keys are scoped by tenant: another caller's same key is another request.
#[tokio::test]
async fn another_tenant_with_the_same_key_gets_an_order_of_its_own() {
    let qs = Quickstart::start().await;
    qs.post("acme", "k-1", ORDER).await;
    let other = qs.post("globex", "k-1", ORDER).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert_eq!(other.replayed, None);
    assert_eq!(other.json()["id"], 2);
    assert_eq!(qs.orders().await, ["1 acme A-1 x2", "2 globex A-1 x2"]);
}

/// The keys live in the file beside the orders, so a crash forgets neither.
#[tokio::test]
async fn after_a_crash_and_restart_a_retry_still_replays() {
    let mut qs = Quickstart::start().await;
    let first = qs.post("acme", "k-1", ORDER).await;
    assert_eq!(first.status, StatusCode::CREATED);

    qs.crash_and_restart().await;
    let retry = qs.post("acme", "k-1", ORDER).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.replayed.as_deref(), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(qs.orders().await.len(), 1);
}

/// The README promises a first example a reader can hold in one screen.
#[test]
fn the_example_is_one_file_under_120_lines() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/quickstart.rs");
    let lines = std::fs::read_to_string(&path).unwrap().lines().count();
    assert!(lines < 120, "examples/quickstart.rs has {lines} lines");
}
