// A supported shape: it compiles and mounts on a router.
#![allow(unused_imports, dead_code)]
use axum::extract::{FromRequestParts, State, Path};
use axum::http::{request::Parts, StatusCode};
use axum::routing::post;
use axum::{Form, Json, Router};
use sqlx::Postgres;
use idem_runtime::{idempotent, Idem, TenantScope, Tx};
use serde::{Deserialize, Serialize};

struct Caller(String);
impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Caller("acme".into()))
    }
}
impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[derive(Deserialize, Serialize)]
struct NewOrder {
    sku: String,
    quantity: u32,
    customer: Customer,
}

#[derive(Deserialize, Serialize)]
struct Customer {
    id: String,
}

fn idem() -> Idem<Postgres> {
    Idem::new(sqlx::PgPool::connect_lazy("postgres://localhost/x").unwrap())
}

use axum::response::IntoResponse;

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> impl IntoResponse {
    sqlx::query("SELECT 1").execute(&mut **tx).await.unwrap();
    (StatusCode::CREATED, format!("{} for {}", cmd.sku, caller.0))
}

/// A Result whose Err rolls back, with `?` inside the body.
#[idempotent(operation = "create-order-2", retention = "24h")]
async fn create_order_2(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> Result<impl IntoResponse, String> {
    sqlx::query("SELECT 1").execute(&mut **tx).await.map_err(|e| e.to_string())?;
    Ok((StatusCode::CREATED, format!("{} for {}", cmd.sku, caller.0)))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _: Router = Router::new()
        .route("/a", post(create_order))
        .route("/b", post(create_order_2))
        .with_state(idem());
}
