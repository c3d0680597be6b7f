// Leased mode on SQLite: `Lease<Sqlite>` in the handler, `Idem<Sqlite>` in the state.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::response::IntoResponse;
use axum::response::Response;
use idem_runtime::Uncertain;
use sqlx::Sqlite;

#[idempotent(
    operation = "create-payment",
    retention = "24h",
    lease = "30s",
    lease_ceiling = "5m"
)]
async fn create_payment(
    #[tenant] caller: Caller,
    lease: &mut Lease<Sqlite>,
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
    let idem: Idem<Sqlite> = Idem::new(sqlx::SqlitePool::connect_lazy("sqlite::memory:").unwrap());
    let _: Router = Router::new()
        .route("/payments", post(create_payment))
        .with_state(idem);
}
