// A supported shape: it compiles and mounts on a router.
#![allow(unused_imports, dead_code)]
include!("../prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

#[idempotent(operation = "nightly-import", retention = "2d", single_tenant, in_flight_wait = "250ms")]
async fn import(tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    let _ = (tx, cmd);
    StatusCode::ACCEPTED
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _: Router = Router::new().route("/imports", post(import)).with_state(idem());
}
