//! `cargo bench --bench idem`: what the promise costs, side by side.
//!
//! One run creates a fresh database (`idem_bench_<pid>`) and a SQLite file, starts
//! bench servers as child processes (this same binary, re-executed with
//! `IDEM_BENCH_ROLE=server`) on `127.0.0.1:0`, drives them over loopback HTTP with
//! a Rust load generator (reqwest, keep-alive, fixed concurrency, fixed duration
//! after a warm-up that is not counted), and prints one report:
//!
//! | | scenario | route |
//! | --- | --- | --- |
//! | a | bare: the business insert in one transaction, no idempotency | `POST /bare/orders` |
//! | b | `#[idempotent]`, first executions (unique keys) | `POST /idem/orders` |
//! | c | replays of completed keys | `POST /idem/orders` |
//! | d | the common middleware pattern: claim, effect, completion in three transactions (plain sqlx) | `POST /mw/orders` |
//! | e | contention: rounds of 64 clients over 16 fresh keys, exactly one effect per key | `POST /idem/orders` |
//! | f | leased mode (`lease = "30s"`), the insert outside any transaction | `POST /leased/orders` |
//! | g | the peer, `axum-idempotent`, on (a)'s handler, first executions | `POST /peer/orders` |
//! | h | the peer under (e)'s contention: its duplicate effects are counted | `POST /peer/orders` |
//! | i | replays with the replay cache on | `POST /cached/orders` |
//! | j | leased mode, replays of completed keys | `POST /leased/orders` |
//! | k | (b) beside `IDEM_BENCH_LONG_OPS` (3000) running long operations, each accepted and held, its lease renewed in batches | `POST /idem/orders`, `POST /long/exports` |
//!
//! Every PostgreSQL scenario runs at each round-trip time of `IDEM_BENCH_DB_RTTS`
//! (the server's pool reaching PostgreSQL through a proxy in the server process
//! that delays every answer); (a), (b), (c) and (e) also run on the SQLite file
//! and on MySQL; (f) and (j) also run with leased mode's records in one Redis, in
//! a Redis Cluster and in the cluster with `WAIT` after each state change (each
//! skipped with a line when it cannot be reached), the insert on PostgreSQL.
//! Then (k) on PostgreSQL (RTT 0), SQLite and MySQL, each on a fresh server: (b)
//! alone, then (b) beside the long operations, with the renewal statements the
//! server sent meanwhile. Then a memory run of (b) and a statement profile: a server whose pool talks to
//! PostgreSQL through the counting proxy, so every request's round trips,
//! prepared statements and SQL statements are counted exactly.
//!
//! Settings (environment): see `BENCHMARKS.md` or the `Settings` struct in
//! `driver.rs`. Nothing here asserts a speed; `cargo test` does not build or run
//! this bench.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_runtime::{
    FingerprintBuilder, Idem, IdempotencyKey, Lease, ReplayCache, TenantScope, Tx, idempotent,
};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgExecutor, PgPoolOptions};
use sqlx::{FromRow, PgPool, Row};

use idem_bench_proxy as proxy;

/// Selects the role of a process: unset for the driver, `server` for the child.
const ROLE_ENV: &str = "IDEM_BENCH_ROLE";
/// The line the server prints on stdout once it listens.
const LISTENING: &str = "IDEM_BENCH_LISTENING";

fn main() -> ExitCode {
    let role = std::env::var(ROLE_ENV).unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = match role.as_str() {
        "server" => rt.block_on(server::main()),
        // The gRPC scenarios' server: the grpc-orders example, as it runs.
        "grpc" => rt.block_on(grpc_orders::server::run()),
        _ => rt.block_on(driver::main()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) if v.is_empty() => Ok(default),
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name}={v:?} is not a valid value")),
    }
}

// ---------------------------------------------------------------------------------
// The business: one `orders` table, the same insert in every scenario.
// ---------------------------------------------------------------------------------

/// The business table and the middleware baseline's own idempotency table, which
/// has exactly the shape (columns, constraints, indexes) of idem's.
const SCHEMA: &str = "
CREATE TABLE orders (
    id           bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    sku          text        NOT NULL,
    quantity     integer     NOT NULL CHECK (quantity >= 1),
    amount_cents bigint      NOT NULL CHECK (amount_cents >= 0),
    currency     text        NOT NULL,
    note         text,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX orders_tenant_idx ON orders (tenant_id, id);
CREATE TABLE mw_idempotency_requests (LIKE idempotency_requests INCLUDING ALL);
";

#[derive(Debug, Deserialize, Serialize)]
struct NewOrder {
    sku: String,
    quantity: i32,
    amount_cents: i64,
    currency: String,
    #[serde(default)]
    note: Option<String>,
}

#[derive(Debug, Serialize, FromRow)]
struct Order {
    id: i64,
    sku: String,
    quantity: i32,
    amount_cents: i64,
    currency: String,
    note: Option<String>,
    created_at: String,
}

const INSERT_ORDER: &str = "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) \
     VALUES ($1, $2, $3, $4, $5, $6) \
     RETURNING id, sku, quantity, amount_cents, currency, note, created_at::text AS created_at";

async fn insert_order<'e>(
    exec: impl PgExecutor<'e>,
    tenant: &str,
    cmd: &NewOrder,
) -> Result<Order, sqlx::Error> {
    sqlx::query_as(INSERT_ORDER)
        .bind(tenant)
        .bind(&cmd.sku)
        .bind(cmd.quantity)
        .bind(cmd.amount_cents)
        .bind(&cmd.currency)
        .bind(&cmd.note)
        .fetch_one(exec)
        .await
}

/// The same business table on the SQLite file (`created_at` as text, from
/// SQLite's clock).
const SQLITE_SCHEMA: &str = "
CREATE TABLE orders (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id    TEXT    NOT NULL,
    sku          TEXT    NOT NULL,
    quantity     INTEGER NOT NULL CHECK (quantity >= 1),
    amount_cents INTEGER NOT NULL CHECK (amount_cents >= 0),
    currency     TEXT    NOT NULL,
    note         TEXT,
    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX orders_tenant_idx ON orders (tenant_id, id);
";

const INSERT_ORDER_SQLITE: &str = "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) \
     VALUES ($1, $2, $3, $4, $5, $6) \
     RETURNING id, sku, quantity, amount_cents, currency, note, created_at";

async fn insert_order_sqlite<'e>(
    exec: impl sqlx::SqliteExecutor<'e>,
    tenant: &str,
    cmd: &NewOrder,
) -> Result<Order, sqlx::Error> {
    sqlx::query_as(INSERT_ORDER_SQLITE)
        .bind(tenant)
        .bind(&cmd.sku)
        .bind(cmd.quantity)
        .bind(cmd.amount_cents)
        .bind(&cmd.currency)
        .bind(&cmd.note)
        .fetch_one(exec)
        .await
}

/// The same business table on MySQL / MariaDB (InnoDB; `created_at` from the
/// database's clock, answered as text).
const MYSQL_SCHEMA: &str = "
CREATE TABLE orders (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant_id    VARCHAR(255) NOT NULL,
    sku          VARCHAR(255) NOT NULL,
    quantity     INT NOT NULL CHECK (quantity >= 1),
    amount_cents BIGINT NOT NULL CHECK (amount_cents >= 0),
    currency     CHAR(3) NOT NULL,
    note         TEXT,
    created_at   DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    KEY orders_tenant_idx (tenant_id, id)
) ENGINE = InnoDB;
";

// MySQL has no RETURNING: the insert, then the row by the connection's last id
// (two round trips where PostgreSQL and SQLite take one).
const INSERT_ORDER_MYSQL: &str = "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) \
     VALUES (?, ?, ?, ?, ?, ?)";
const SELECT_ORDER_MYSQL: &str = "SELECT id, sku, quantity, amount_cents, currency, note, \
            DATE_FORMAT(created_at, '%Y-%m-%d %H:%i:%s.%f') AS created_at \
       FROM orders WHERE id = LAST_INSERT_ID()";

async fn insert_order_mysql(
    conn: &mut sqlx::MySqlConnection,
    tenant: &str,
    cmd: &NewOrder,
) -> Result<Order, sqlx::Error> {
    sqlx::query(INSERT_ORDER_MYSQL)
        .bind(tenant)
        .bind(&cmd.sku)
        .bind(cmd.quantity)
        .bind(cmd.amount_cents)
        .bind(&cmd.currency)
        .bind(&cmd.note)
        .execute(&mut *conn)
        .await?;
    sqlx::query_as(SELECT_ORDER_MYSQL).fetch_one(conn).await
}

/// What every scenario answers: `201`, `Location`, the order as JSON.
fn created(order: Order) -> Response {
    let location = format!("/orders/{}", order.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    )
        .into_response()
}

mod driver;
mod server;
