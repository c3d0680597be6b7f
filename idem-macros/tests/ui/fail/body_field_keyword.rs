// A `body.field` named by a keyword: a Rust field named `type` is `r#type`.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h", fingerprint(body.type))]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
