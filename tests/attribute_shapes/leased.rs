// Leased mode: the handler holds a lease instead of a transaction.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::response::IntoResponse;
use axum::response::Response;
use idem_runtime::Uncertain;

#[idempotent(
    operation = "create-payment",
    retention = "24h",
    lease = "30s",
    lease_ceiling = "5m"
)]
async fn create_payment(
    #[tenant] caller: Caller,
    lease: &mut Lease<Postgres>,
    Json(amount): Json<i64>,
) -> Response {
    let _ = (caller, amount, lease.downstream_key());
    if lease.is_lost() {
        return Uncertain::new("the provider timed out").into_response();
    }
    StatusCode::CREATED.into_response()
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let idem = idem();
    let _: Router = Router::new()
        .route("/payments", post(create_payment))
        .with_state(idem);
}
