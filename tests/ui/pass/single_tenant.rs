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

#[idempotent(operation = "nightly-import", retention = "2d", single_tenant, in_flight_wait = "250ms")]
async fn import(tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    let _ = (tx, cmd);
    StatusCode::ACCEPTED
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _: Router = Router::new().route("/imports", post(import)).with_state(idem());
}
