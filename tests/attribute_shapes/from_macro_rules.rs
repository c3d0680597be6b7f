// A supported shape: handlers written by a `macro_rules!` whose parameter and
// return types come from its metavariables, as a service that stamps one
// handler per resource writes them. The attribute's own names keep to the
// attribute's hygiene whatever span the user's types carry.
include!("../../idem-macros/tests/ui/prelude.rs");

macro_rules! creator {
    ($name:ident, $op:literal, $keep:expr, $currency:literal, $body:ty, $ret:ty) => {
        #[idempotent(operation = $op, retention = $keep, fingerprint(body, header = $currency))]
        async fn $name(
            #[tenant] caller: Caller,
            tx: &mut Tx<Postgres>,
            Json(cmd): Json<$body>,
        ) -> $ret {
            let _ = (&caller.0, &mut **tx, cmd.quantity);
            StatusCode::CREATED
        }
    };
}

creator!(
    create_order,
    "create-order",
    "24h",
    "x-currency",
    NewOrder,
    StatusCode
);

macro_rules! whole_body {
    ($name:ident, $op:literal, $param:ty) => {
        #[idempotent(operation = $op, retention = "24h")]
        async fn $name(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, cmd: $param) -> StatusCode {
            let _ = (&caller.0, &mut **tx, cmd);
            StatusCode::CREATED
        }
    };
}

whole_body!(create_note, "create-note", String);

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/orders", post(create_order))
        .route("/notes", post(create_note))
        .with_state(idem());
}
