#![allow(unused_imports, unused_variables, dead_code)]
use axum::extract::FromRequestParts;
use axum::http::{request::Parts, StatusCode};
use axum::Json;
use idem_runtime::{idempotent, TenantScope, Tx};
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
}


#[idempotent(operation = "create-payment", retention = "24h", lease_ceiling = "5m")]
async fn create_payment(#[tenant] caller: Caller, tx: &mut Tx, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {}
