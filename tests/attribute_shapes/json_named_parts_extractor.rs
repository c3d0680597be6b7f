// A supported shape: an extractor of the request's parts whose name ends in
// `Json` (a guard of the `Accept` header) is no second body, before the body
// or in its own pattern.
include!("../../idem-macros/tests/ui/prelude.rs");

struct AcceptJson(&'static str);
impl<S: Send + Sync> FromRequestParts<S> for AcceptJson {
    type Rejection = StatusCode;
    async fn from_request_parts(p: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        match p.headers.get("accept").and_then(|v| v.to_str().ok()) {
            None | Some("*/*") => Ok(AcceptJson("any")),
            Some("application/json") => Ok(AcceptJson("json")),
            Some(_) => Err(StatusCode::NOT_ACCEPTABLE),
        }
    }
}

#[idempotent(operation = "create-widget", retention = "15m")]
async fn create(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    _: AcceptJson,
    Json(cmd): Json<serde_json::Value>,
) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "touch-widget", retention = "15m")]
async fn touch(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    AcceptJson(kind): AcceptJson,
) -> StatusCode {
    StatusCode::OK
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/widgets", post(create))
        .route("/widgets/touch", post(touch))
        .with_state(idem());
}
