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

#[derive(Deserialize, Serialize)]
struct Signup {
    email: String,
}

#[idempotent(operation = "signup", retention = "1h")]
async fn signup(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Form(s): Form<Signup>) -> StatusCode {
    let _ = (caller, tx, s.email);
    StatusCode::CREATED
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _: Router = Router::new().route("/signups", post(signup)).with_state(idem());
}
