// Leased mode: the handler holds a lease instead of a transaction.
#![allow(unused_imports, dead_code)]
use axum::extract::FromRequestParts;
use axum::http::{request::Parts, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use sqlx::Postgres;
use idem_runtime::{idempotent, Idem, Lease, TenantScope, Uncertain};

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
async fn create_payment(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, Json(amount): Json<i64>) -> Response {
    let _ = (caller, amount, lease.downstream_key());
    if lease.is_lost() {
        return Uncertain::new("the provider timed out").into_response();
    }
    StatusCode::CREATED.into_response()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let idem = Idem::new(sqlx::PgPool::connect_lazy("postgres://localhost/x").unwrap());
    let _: Router = Router::new().route("/payments", post(create_payment)).with_state(idem);
}
