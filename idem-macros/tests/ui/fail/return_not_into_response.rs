// The handler's output must be a response.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

struct NotAResponse;

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> NotAResponse {
    NotAResponse
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
