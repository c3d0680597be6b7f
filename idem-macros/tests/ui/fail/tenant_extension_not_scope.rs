// `Extension<T>` identifies a tenant when `T` does; here it does not.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[derive(Clone)]
struct Session(String);

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] axum::Extension(session): axum::Extension<Session>, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
