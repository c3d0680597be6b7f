// The edges of the accepted ranges: 1ms and 100 years of retention, a 100ms lease
// with a ceiling of one lease, no in-flight wait.
include!("../../idem-macros/tests/ui/prelude.rs");

#[idempotent(operation = "short", retention = "1ms", in_flight_wait = "0s")]
async fn short(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "long", retention = "100years")]
async fn long(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(
    operation = "leased",
    retention = "24h",
    lease = "100ms",
    lease_ceiling = "100ms"
)]
async fn leased(
    #[tenant] caller: Caller,
    lease: &mut Lease<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/short", post(short))
        .route("/long", post(long))
        .route("/leased", post(leased))
        .with_state(idem());
}
