// A ceiling below the lease means the lease is never renewed.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-payment", retention = "24h", lease = "30s", lease_ceiling = "10s")]
async fn create_order(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
