//! `quickstart`: the smallest idem service, one idempotent `POST /orders` on SQLite.
//!
//! `cargo run --example quickstart` needs no setup: it keeps its data in the file
//! `idem-quickstart.db` in the working directory (created on the first run, so a
//! restart still knows every key) and listens on `127.0.0.1:3000` (`IDEM_ADDR`
//! sets another address; `127.0.0.1:0` picks a free port). In another terminal:
//!
//! ```sh
//! H=(-H 'authorization: Bearer acme' -H 'content-type: application/json' -H 'idempotency-key: k-1')
//! curl -i localhost:3000/orders "${H[@]}" -d '{"sku":"A-1","quantity":2}'  # 201 Created
//! curl -i localhost:3000/orders "${H[@]}" -d '{"sku":"A-1","quantity":2}'  # the same 201, replayed
//! curl -i localhost:3000/orders "${H[@]}" -d '{"sku":"A-1","quantity":3}'  # 422: the key was used for another body
//! ```
//!
//! `orders` (docs/example-service.md) is the same idea grown into a full service.

use axum::http::{StatusCode, header::AUTHORIZATION, request::Parts};
use axum::{Json, Router, extract::FromRequestParts, routing::post};
use idem_runtime::{Idem, Sweeper, TenantScope, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// The caller, from `Authorization: Bearer <tenant>` (a stand-in for your auth). idem
/// scopes keys by tenant: two callers who pick the same key never see each other's answers.
struct Caller(String);

impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let auth = parts.headers.get(AUTHORIZATION);
        match auth.and_then(|v| v.to_str().ok()?.strip_prefix("Bearer ")) {
            Some(tenant) if !tenant.is_empty() => Ok(Caller(tenant.to_owned())),
            _ => Err(StatusCode::UNAUTHORIZED),
        }
    }
}

/// The body. `Serialize` too: idem fingerprints the typed value, so a retry with
/// the same fields in another order or spacing is still the same request. (Like
/// any serde struct it also takes the fields as an array, `["A-1", 2]`; a service
/// whose API says "object" checks for one first, as `examples/orders` does.)
#[derive(Deserialize, Serialize)]
struct NewOrder {
    sku: String,
    quantity: u32,
}

#[derive(Serialize)]
struct Order {
    id: i64,
    #[serde(flatten)]
    order: NewOrder,
}

/// Runs at most once per tenant and key for 24 hours; every retry gets this
/// answer back. The insert goes through `tx`, the transaction that holds the
/// key, so the order and idem's record of it commit together or not at all.
#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Sqlite>,
    Json(cmd): Json<NewOrder>,
) -> Result<(StatusCode, Json<Order>), StatusCode> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO orders (tenant, sku, quantity) VALUES (?, ?, ?) RETURNING id",
    )
    .bind(&caller.0)
    .bind(&cmd.sku)
    .bind(cmd.quantity)
    .fetch_one(&mut **tx)
    .await
    // An `Err` rolls back and stores nothing: the key stays free for a retry.
    .map_err(|e| {
        tracing::error!("cannot insert the order: {e}");
        StatusCode::INTERNAL_SERVER_ERROR
    })?;
    Ok((StatusCode::CREATED, Json(Order { id, order: cmd })))
}

const ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS orders \
    (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL)";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,sqlx=warn".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    // WAL lets readers run beside the one writer; the busy timeout makes a
    // writer wait for another instead of failing at once.
    let options = SqliteConnectOptions::new()
        .filename("idem-quickstart.db")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(5));
    let pool = SqlitePoolOptions::new().connect_with(options).await?;
    idem_runtime::migrate(&pool).await?; // idem's own table
    sqlx::query(ORDERS_TABLE).execute(&pool).await?; // the service's own table
    // Without it idem's table only grows: it deletes keys past their retention.
    Sweeper::new(pool.clone()).spawn();

    // The handler takes its transaction from the `Idem` in the router's state.
    let app = Router::new()
        .route("/orders", post(create_order))
        .with_state(Idem::new(pool));
    let addr = std::env::var("IDEM_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("quickstart listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
