// The body extractor must be last.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, Json(cmd): Json<NewOrder>, tx: &mut Tx<Postgres>, axum::extract::State(s): axum::extract::State<Idem<Postgres>>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
