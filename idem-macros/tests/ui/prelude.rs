// Shared by the trybuild cases (`include!`d): an auth extractor that identifies a
// tenant, a body type, and the router state. Each case mounts its handler with
// `Router::new().route(.., post(handler)).with_state(idem())`, as a real service
// does, so that a case fails only with the attribute's own errors.
use axum::extract::FromRequestParts;
use axum::http::{request::Parts, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::{idempotent, Idem, Lease, TenantScope, Tx};
use sqlx::Postgres;
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
}

fn idem() -> Idem<Postgres> {
    Idem::new(sqlx::PgPool::connect_lazy("postgres://localhost/x").unwrap())
}
