// Last parameters that are extractors for the application's state only. The
// attribute probes them with the state the handler names (`State<AppState>`):
// a parts extractor (`Region`) is not a body; a body extractor idem can
// fingerprint (`Signed`, with `FingerprintBody`) is the body, whole, with or
// without a `State` parameter (see the trybuild cases `unplaced_last_extractor`
// and `state_body_not_fingerprintable` for the shapes that are refused).
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::extract::{FromRef, FromRequest, Request, State};
use idem_runtime::FingerprintBody;

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

struct Region(&'static str);
impl FromRequestParts<AppState> for Region {
    type Rejection = StatusCode;
    async fn from_request_parts(_: &mut Parts, s: &AppState) -> Result<Self, StatusCode> {
        Ok(Region(s.region))
    }
}

struct Signed(NewOrder);
impl FromRequest<AppState> for Signed {
    type Rejection = StatusCode;
    async fn from_request(req: Request, s: &AppState) -> Result<Self, StatusCode> {
        let Json(v) = Json::<NewOrder>::from_request(req, s)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Signed(v))
    }
}
impl FingerprintBody for Signed {
    type Value = NewOrder;
    fn fingerprint_value(&self) -> &NewOrder {
        &self.0
    }
}

#[idempotent(
    operation = "ship",
    retention = "24h",
    fingerprint(header = "x-currency")
)]
async fn ship(
    #[tenant] caller: Caller,
    State(app): State<AppState>,
    tx: &mut Tx<Postgres>,
    region: Region,
) -> StatusCode {
    StatusCode::OK
}

/// A sub-state, named before the router's own state: the probe asks with
/// the last `State<..>`.
#[derive(Clone)]
struct Pool;
impl FromRef<AppState> for Pool {
    fn from_ref(_: &AppState) -> Pool {
        Pool
    }
}

#[idempotent(operation = "ship-from-pool", retention = "24h")]
async fn ship_from_pool(
    #[tenant] caller: Caller,
    State(pool): State<Pool>,
    State(app): State<AppState>,
    tx: &mut Tx<Postgres>,
    region: Region,
) -> StatusCode {
    StatusCode::OK
}

#[idempotent(operation = "sign", retention = "24h")]
async fn sign(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: Signed) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "sign-in-region", retention = "24h")]
async fn sign_in_region(
    #[tenant] caller: Caller,
    State(app): State<AppState>,
    tx: &mut Tx<Postgres>,
    body: Signed,
) -> StatusCode {
    StatusCode::CREATED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let state = AppState {
        idem: idem(),
        region: "eu",
    };
    let _: Router = Router::new()
        .route("/ship", post(ship))
        .route("/ship-from-pool", post(ship_from_pool))
        .route("/sign", post(sign))
        .route("/sign-in-region", post(sign_in_region))
        .with_state(state);
}
