// Tenants from extractors of other crates that the runtime supports: a caller an
// auth middleware put in the extensions, and a tenant named by the path.
#![allow(unused_imports, dead_code)]
include!("../prelude.rs");

use axum::extract::Path;
use axum::Extension;

#[derive(Clone)]
struct Session(String);
impl TenantScope for Session {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[idempotent(operation = "create-order", retention = "24h")]
async fn by_extension(#[tenant] Extension(session): Extension<Session>, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "create-order", retention = "24h")]
async fn by_path(#[tenant] org: Path<String>, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _: Router = Router::new()
        .route("/orders", post(by_extension))
        .route("/orgs/{org}/orders", post(by_path))
        .with_state(idem());
}
