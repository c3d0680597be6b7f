// Option and signature errors, all reported together.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "", retention = "soon", fingerprint(header = "bad header", header = "x-ok", header = "x-ok"))]
async fn create_order(caller: Caller, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
