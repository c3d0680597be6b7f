// A supported shape: a SQLite-backed handler (Tx<Sqlite>, Idem<Sqlite>) mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;
use sqlx::Sqlite;

fn sqlite_idem() -> Idem<Sqlite> {
    Idem::new(sqlx::SqlitePool::connect_lazy("sqlite::memory:").unwrap())
}

#[idempotent(
    operation = "create-order",
    retention = "24h",
    fingerprint(body, header = "x-currency")
)]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Sqlite>,
    Json(cmd): Json<NewOrder>,
) -> Result<(StatusCode, Json<String>), StatusCode> {
    let _ = (&caller.0, &mut **tx, cmd.quantity);
    Ok((StatusCode::CREATED, Json(cmd.sku)))
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .with_state(sqlite_idem());
}
