// `fingerprint(body)` where the last parameter is an extractor of the parts.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

struct Region(String);
impl<S: Send + Sync> FromRequestParts<S> for Region {
    type Rejection = StatusCode;
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Region("eu".into()))
    }
}

#[idempotent(operation = "create-order", retention = "24h", fingerprint(body))]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, region: Region) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
