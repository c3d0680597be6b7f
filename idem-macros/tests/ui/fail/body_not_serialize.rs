// A typed body that cannot be serialised cannot be fingerprinted.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[derive(Deserialize)]
struct Secret {
    card: String,
}

#[idempotent(operation = "create-order", retention = "24h", fingerprint(body))]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<Secret>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
