// A bare `Lease`: it names where the lease is kept, as `Tx` names its database.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-payment", retention = "24h", lease = "30s")]
async fn create_payment(#[tenant] caller: Caller, lease: &mut idem_runtime::Lease, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/payments", post(create_payment)).with_state(idem());
}
