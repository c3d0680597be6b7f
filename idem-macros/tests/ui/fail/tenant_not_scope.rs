// A tenant type of the user's own without `TenantScope`.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

struct Anonymous;
impl<S: Send + Sync> FromRequestParts<S> for Anonymous {
    type Rejection = StatusCode;
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Anonymous)
    }
}

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] user: Anonymous, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
