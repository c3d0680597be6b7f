// A `where` clause: the handler idem writes is concrete, with nothing to bound.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode
where
    Caller: Send,
{
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
