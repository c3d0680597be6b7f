// A `crate` path that does not resolve is reported at the path, once, not once per
// use; the handler is then missing where it is mounted (nothing is emitted beside it,
// so that the attribute fits an associated function too).
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h", crate = "idem_rt")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
