// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

#[derive(Deserialize, Serialize)]
struct CustomerOrder {
    sku: String,
    quantity: u32,
    customer: Customer,
}

#[derive(Deserialize, Serialize)]
struct Customer {
    id: String,
}

#[idempotent(operation = "create-order", retention = "24h", fingerprint(body.sku, body.customer.id, header = "x-currency", header = "X-Channel"))]
async fn create_order(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<CustomerOrder>,
) -> StatusCode {
    let _ = (caller, tx, cmd);
    StatusCode::CREATED
}

/// A field whose name is a keyword, written as a raw identifier.
#[derive(Deserialize, Serialize)]
struct Transfer {
    r#type: String,
    amount: u64,
}

#[idempotent(operation = "transfer", retention = "24h", fingerprint(body.r#type, body.amount))]
async fn transfer(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<Transfer>,
) -> StatusCode {
    StatusCode::CREATED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .route("/transfers", post(transfer))
        .with_state(idem());
}
