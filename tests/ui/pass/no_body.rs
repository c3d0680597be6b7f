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

#[idempotent(operation = "rotate-secret", retention = "15m", fingerprint(header = "x-reason"))]
async fn rotate(tx: &mut Tx<Postgres>, #[tenant] caller: Caller) -> &'static str {
    let _ = (caller, tx);
    "rotated"
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _: Router = Router::new().route("/rotate", post(rotate)).with_state(idem());
}
