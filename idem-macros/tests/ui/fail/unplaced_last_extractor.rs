// A last parameter that is an extractor only for the application's state, in a
// handler that names no state: whether it reads the body cannot be asked, and
// a body it read would be left out of the fingerprint unseen. Refused at its type.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

use axum::extract::FromRef;

#[derive(Clone)]
struct AppState {
    idem: Idem<Postgres>,
}
impl FromRef<AppState> for Idem<Postgres> {
    fn from_ref(s: &AppState) -> Idem<Postgres> {
        s.idem.clone()
    }
}

struct Signed(Vec<u8>);
impl axum::extract::FromRequest<AppState> for Signed {
    type Rejection = StatusCode;
    async fn from_request(_: axum::extract::Request, _: &AppState) -> Result<Self, StatusCode> {
        Ok(Signed(Vec::new()))
    }
}

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: Signed) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .with_state(AppState { idem: idem() });
}
