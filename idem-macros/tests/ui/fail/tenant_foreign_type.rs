// A tenant type from another crate: the hint says what works (the orphan rule forbids implementing `TenantScope` for it).
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] headers: axum::http::HeaderMap, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
