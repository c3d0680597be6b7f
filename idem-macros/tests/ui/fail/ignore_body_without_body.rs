// `ignore_body` on a handler that reads no body.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h", fingerprint(header = "x-currency", ignore_body))]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
