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

use axum::extract::FromRef;

#[derive(Clone)]
struct AppState {
    idem: Idem<Postgres>,
    region: &'static str,
}

impl FromRef<AppState> for Idem<Postgres> {
    fn from_ref(s: &AppState) -> Idem<Postgres> {
        s.idem.clone()
    }
}

#[idempotent(operation = "ship-order", retention = "7d")]
async fn ship(
    #[tenant] caller: Caller,
    State(state): State<AppState>,
    Path(order_id): Path<i64>,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<Json<String>, (StatusCode, String)> {
    let _ = (caller, tx, cmd);
    Ok(Json(format!("{order_id} ships from {}", state.region)))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let state = AppState { idem: idem(), region: "eu" };
    let _: Router = Router::new().route("/orders/{id}/ship", post(ship)).with_state(state);
}
