// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

#[idempotent(
    operation = "nightly-import",
    retention = "2d",
    single_tenant,
    in_flight_wait = "250ms"
)]
async fn import(tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    let _ = (tx, cmd);
    StatusCode::ACCEPTED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/imports", post(import))
        .with_state(idem());
}
