// A long operation's name must have no empty or dot segment: its resource is
// `<operations path>/<operation>/<key>`.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "/exports", retention = "24h", lease = "6s", accepted)]
async fn create_export(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "exports/../create", retention = "24h", lease = "6s", accepted)]
async fn create_export_again(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new()
        .route("/exports", post(create_export))
        .route("/exports/again", post(create_export_again))
        .with_state(idem());
}
