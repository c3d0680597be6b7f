// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

#[derive(Deserialize, Serialize)]
struct Signup {
    email: String,
}

#[idempotent(operation = "signup", retention = "1h")]
async fn signup(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Form(s): Form<Signup>,
) -> StatusCode {
    let _ = (caller, tx, s.email);
    StatusCode::CREATED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/signups", post(signup))
        .with_state(idem());
}
