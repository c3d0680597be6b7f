// `impl Trait` inside a parameter's type is a generic too: refused at the
// `impl`, not with rustc's "not allowed in paths" inside the expansion.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<impl serde::de::DeserializeOwned + serde::Serialize>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
