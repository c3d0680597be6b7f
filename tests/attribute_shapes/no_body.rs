// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

#[idempotent(
    operation = "rotate-secret",
    retention = "15m",
    fingerprint(header = "x-reason")
)]
async fn rotate(tx: &mut Tx<Postgres>, #[tenant] caller: Caller) -> &'static str {
    let _ = (caller, tx);
    "rotated"
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/rotate", post(rotate))
        .with_state(idem());
}
