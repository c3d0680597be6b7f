// A supported shape: it compiles and mounts on a router.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::extract::Path;
use axum::extract::State;

use axum::extract::FromRef;

#[derive(Clone)]
struct AppState {
    idem: Idem<Postgres>,
    region: &'static str,
}

impl FromRef<AppState> for Idem<Postgres> {
    fn from_ref(s: &AppState) -> Idem<Postgres> {
        s.idem.clone()
    }
}

#[idempotent(operation = "ship-order", retention = "7d")]
async fn ship(
    #[tenant] caller: Caller,
    State(state): State<AppState>,
    Path(order_id): Path<i64>,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<Json<String>, (StatusCode, String)> {
    let _ = (caller, tx, cmd);
    Ok(Json(format!("{order_id} ships from {}", state.region)))
}

/// Raw identifiers as bindings (a path segment named `type`, a body named
/// `ref`): the outer parameters take other names, the handler keeps its own.
#[idempotent(operation = "label-order", retention = "1d")]
async fn label(
    #[tenant] caller: Caller,
    Path(r#type): Path<String>,
    tx: &mut Tx<Postgres>,
    r#ref: Json<NewOrder>,
) -> StatusCode {
    let _ = (caller, tx, r#type, r#ref.0.sku.len());
    StatusCode::OK
}

/// `#[tracing::instrument]` above the attribute: it expands first, on the
/// handler as written (`skip(tx)`, `err` on its `Result`).
#[tracing::instrument(skip(caller, tx, state), err)]
#[idempotent(operation = "hold-order", retention = "1d")]
async fn hold(
    #[tenant] caller: Caller,
    State(state): State<AppState>,
    Path(order_id): Path<i64>,
    tx: &mut Tx<Postgres>,
) -> Result<StatusCode, String> {
    let _ = (caller.0, state.region, order_id);
    Ok(StatusCode::OK)
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let state = AppState {
        idem: idem(),
        region: "eu",
    };
    let _: Router = Router::new()
        .route("/orders/{id}/ship", post(ship))
        .route("/labels/{type}", post(label))
        .route("/orders/{id}/hold", post(hold))
        .with_state(state);
}
