// Leased mode takes a lease, not a transaction: the error names the lease type.
#![allow(unused_imports, unused_variables, dead_code)]
use axum::extract::FromRequestParts;
use axum::http::{request::Parts, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::{idempotent, Idem, Lease, TenantScope, Tx, Uncertain};

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

#[idempotent(operation = "create-payment", retention = "24h", lease = "30s", lease_ceiling = "5m")]
async fn create_payment(#[tenant] caller: Caller, tx: &mut Tx, Json(amount): Json<i64>) -> Response {
    let _ = (caller, amount);
    StatusCode::CREATED.into_response()
}

fn main() {}
