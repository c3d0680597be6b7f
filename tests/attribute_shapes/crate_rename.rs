// The runtime under another name, and a decoy under its usual one: generated code
// must follow `crate = "..."` and never name `idem_runtime` itself.
extern crate idem_runtime as idem_rt;
#[allow(unused_imports)]
use std as idem_runtime;

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use axum::routing::post;
use axum::{Json, Router};

struct Caller(String);
impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Caller("acme".into()))
    }
}
impl idem_rt::TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[idem_rt::idempotent(crate = "idem_rt", operation = "create-order", retention = "24h")]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut idem_rt::Tx<sqlx::Postgres>,
    Json(sku): Json<String>,
) -> StatusCode {
    let _ = (caller, tx, sku);
    StatusCode::CREATED
}

// Likewise on an associated function: what the attribute emits beside the
// handler must fit in an `impl` block.
struct Orders;

impl Orders {
    #[idem_rt::idempotent(crate = "idem_rt", operation = "create-order", retention = "24h")]
    async fn create_order(
        #[tenant] caller: Caller,
        tx: &mut idem_rt::Tx<sqlx::Postgres>,
        Json(sku): Json<String>,
    ) -> StatusCode {
        let _ = (caller, tx, sku);
        StatusCode::CREATED
    }
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let idem = idem_rt::Idem::new(sqlx::PgPool::connect_lazy("postgres://localhost/x").unwrap());
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .route("/associated/orders", post(Orders::create_order))
        .with_state(idem);
}
