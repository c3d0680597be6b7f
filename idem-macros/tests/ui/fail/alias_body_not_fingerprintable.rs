// A body extractor behind an alias, without `FingerprintBody`: probed, and refused at its type.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

struct Upload(Vec<u8>);
impl<S: Send + Sync> axum::extract::FromRequest<S> for Upload {
    type Rejection = StatusCode;
    async fn from_request(_: axum::extract::Request, _: &S) -> Result<Self, StatusCode> {
        Ok(Upload(Vec::new()))
    }
}
type Payload = Upload;

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, payload: Payload) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new().route("/orders", post(create_order)).with_state(idem());
}
