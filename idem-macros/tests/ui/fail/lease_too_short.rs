// A lease renewed every third of its length cannot be shorter than a few round trips.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-payment", retention = "24h", lease = "20ms")]
async fn create_order(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
