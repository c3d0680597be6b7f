// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

use axum::response::IntoResponse;

#[idempotent(operation = "create-order", retention = "24h")]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> impl IntoResponse {
    sqlx::query("SELECT 1").execute(&mut **tx).await.unwrap();
    (StatusCode::CREATED, format!("{} for {}", cmd.sku, caller.0))
}

/// A Result whose Err rolls back, with `?` inside the body.
#[idempotent(operation = "create-order-2", retention = "24h")]
async fn create_order_2(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<impl IntoResponse, String> {
    sqlx::query("SELECT 1")
        .execute(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok((StatusCode::CREATED, format!("{} for {}", cmd.sku, caller.0)))
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/a", post(create_order))
        .route("/b", post(create_order_2))
        .with_state(idem());
}
