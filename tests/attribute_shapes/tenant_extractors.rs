// Tenants from extractors of other crates that the runtime supports: a caller an
// auth middleware put in the extensions, and a tenant named by the path.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Extension;
use axum::extract::Path;

#[derive(Clone)]
struct Session(String);
impl TenantScope for Session {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[idempotent(operation = "create-order", retention = "24h")]
async fn by_extension(
    #[tenant] Extension(session): Extension<Session>,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "create-order", retention = "24h")]
async fn by_path(
    #[tenant] org: Path<String>,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/orders", post(by_extension))
        .route("/orgs/{org}/orders", post(by_path))
        .with_state(idem());
}
