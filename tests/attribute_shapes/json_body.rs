// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

#[idempotent(
    operation = "create-order",
    retention = "24h",
    fingerprint(body, header = "x-currency")
)]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<(StatusCode, Json<String>), StatusCode> {
    let _ = (&caller.0, &mut **tx, cmd.quantity);
    Ok((StatusCode::CREATED, Json(cmd.sku)))
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .with_state(idem());
}
