// A fallible body whose error is another extractor's rejection: axum extracts
// `Result<Json<T>, E>` only with `Json`'s own rejection as `E`.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    cmd: Result<Json<NewOrder>, axum::extract::rejection::FormRejection>,
) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
