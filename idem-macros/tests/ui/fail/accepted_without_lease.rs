// `accepted` keeps working after the answer: only a lease can hold the key that long.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-export", retention = "24h", accepted)]
async fn create_export(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/exports", post(create_export)).with_state(idem());
}
