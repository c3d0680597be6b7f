// A misspelled `accepted` is named.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[idempotent(operation = "create-export", retention = "24h", lease = "30s", accept)]
async fn create_export(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/exports", post(create_export)).with_state(idem());
}
