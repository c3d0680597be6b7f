// A body extractor for the application's state only, in a handler that names
// that state: probed with it, found to read the body, refused at its type.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

use axum::extract::{FromRef, State};

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
async fn create_order(
    #[tenant] caller: Caller,
    State(app): State<AppState>,
    tx: &mut Tx<Postgres>,
    body: Signed,
) -> StatusCode {
    StatusCode::CREATED
}

fn main() {
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .with_state(AppState { idem: idem() });
}
