// A long operation: `202 Accepted` at once, its resource served by `operations::router`.
include!("../../idem-macros/tests/ui/prelude.rs");

use idem_runtime::SingleTenant;
use idem_runtime::operations;

#[idempotent(operation = "create-export", retention = "24h", lease = "6s", accepted)]
async fn create_export(
    #[tenant] caller: Caller,
    lease: &mut Lease<Postgres>,
    Json(format): Json<String>,
) -> (StatusCode, String) {
    let _ = (caller, lease.downstream_key());
    (StatusCode::CREATED, format)
}

#[idempotent(
    operation = "rebuild-index",
    retention = "1h",
    lease = "30s",
    lease_ceiling = "1h",
    accepted,
    single_tenant
)]
async fn rebuild_index(lease: &mut Lease<Postgres>) -> StatusCode {
    StatusCode::NO_CONTENT
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let idem = idem();
    let _: Router = Router::new()
        .route("/exports", post(create_export))
        .route("/index", post(rebuild_index))
        .nest(
            idem.operations_path(),
            operations::router::<Caller, sqlx::Postgres, Idem<Postgres>>(),
        )
        .nest(
            "/admin/operations",
            operations::router::<SingleTenant, sqlx::Postgres, Idem<Postgres>>(),
        )
        .with_state(idem);
}
