// The same through a type alias the attribute cannot see into: the alias's type is probed.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

type OrderBody = Json<NewOrder>;

#[idempotent(operation = "create-order", retention = "24h", fingerprint(header = "x-currency"))]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: OrderBody) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
