// An operation named like a path must have no empty or dot segment: a long
// operation's resource is `<operations path>/<operation>/<key>`.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "/exports", retention = "24h")]
async fn create_export(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "exports/../create", retention = "24h")]
async fn create_export_again(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new()
        .route("/exports", post(create_export))
        .route("/exports/again", post(create_export_again))
        .with_state(idem());
}
