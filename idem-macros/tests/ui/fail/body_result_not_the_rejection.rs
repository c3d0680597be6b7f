// A fallible body whose error is not the extractor's rejection: idem answers the
// rejection before the claim, so the error type must be it.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    cmd: Result<Json<NewOrder>, String>,
) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
