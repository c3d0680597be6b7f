// Every body shape the attribute documents compiles and mounts: axum's own
// extractors, optional and fallible bodies, aliases, custom extractors, and
// streams with the body left out explicitly.
include!("../../idem-macros/tests/ui/prelude.rs");

use axum::Form;
use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::{RawForm, Request};
use idem_runtime::FingerprintBody;

#[idempotent(operation = "json", retention = "24h")]
async fn json(#[tenant] c: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "form", retention = "24h")]
async fn form(#[tenant] c: Caller, tx: &mut Tx<Postgres>, Form(cmd): Form<NewOrder>) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "bytes", retention = "24h")]
async fn bytes(#[tenant] c: Caller, tx: &mut Tx<Postgres>, body: Bytes) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "text", retention = "24h")]
async fn text(#[tenant] c: Caller, tx: &mut Tx<Postgres>, body: String) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "raw-form", retention = "24h")]
async fn raw_form(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    RawForm(body): RawForm,
) -> StatusCode {
    StatusCode::CREATED
}

/// `None` (no body sent) and `Some` are different requests.
#[idempotent(operation = "optional", retention = "24h", fingerprint(body.sku))]
async fn optional(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    cmd: Option<Json<NewOrder>>,
) -> StatusCode {
    StatusCode::CREATED
}

/// The rejection is answered before the claim; the handler sees `Ok`.
#[idempotent(operation = "fallible", retention = "24h")]
async fn fallible(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    cmd: Result<Json<NewOrder>, JsonRejection>,
) -> Result<StatusCode, (StatusCode, String)> {
    let Json(cmd) = cmd.map_err(|e| (e.status(), e.body_text()))?;
    Ok(StatusCode::CREATED)
}

type OrderBody = Json<NewOrder>;

/// An alias the pattern names.
#[idempotent(
    operation = "alias-pattern",
    retention = "24h",
    fingerprint(body, header = "x-currency")
)]
async fn alias_pattern(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): OrderBody,
) -> StatusCode {
    StatusCode::CREATED
}

/// An alias nothing names: its type is probed.
#[idempotent(operation = "alias", retention = "24h")]
async fn alias(#[tenant] c: Caller, tx: &mut Tx<Postgres>, cmd: OrderBody) -> StatusCode {
    StatusCode::CREATED
}

/// An alias named by `fingerprint(body)`: its type is probed too.
#[idempotent(operation = "alias-named", retention = "24h", fingerprint(body))]
async fn alias_named(#[tenant] c: Caller, tx: &mut Tx<Postgres>, cmd: OrderBody) -> StatusCode {
    StatusCode::CREATED
}

/// An alias with fields.
#[idempotent(operation = "alias-fields", retention = "24h", fingerprint(body.quantity))]
async fn alias_fields(#[tenant] c: Caller, tx: &mut Tx<Postgres>, cmd: OrderBody) -> StatusCode {
    StatusCode::CREATED
}

/// A validating extractor of the application's own, found by its name.
struct ValidJson<T>(T);
impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S>
    for ValidJson<T>
{
    type Rejection = StatusCode;
    async fn from_request(req: Request, s: &S) -> Result<Self, StatusCode> {
        let Json(v) = Json::<T>::from_request(req, s)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(ValidJson(v))
    }
}
impl<T: Serialize> FingerprintBody for ValidJson<T> {
    type Value = T;
    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

#[idempotent(operation = "valid-json", retention = "24h")]
async fn valid_json(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    ValidJson(cmd): ValidJson<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

/// Any other name, marked `#[body]`.
struct Checked<T>(T);
impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for Checked<T> {
    type Rejection = StatusCode;
    async fn from_request(req: Request, s: &S) -> Result<Self, StatusCode> {
        let Json(v) = Json::<T>::from_request(req, s)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Checked(v))
    }
}
impl<T: Serialize> FingerprintBody for Checked<T> {
    type Value = T;
    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

#[idempotent(operation = "checked", retention = "24h")]
async fn checked(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    #[body] Checked(cmd): Checked<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

/// Streams: the body left out explicitly, the request identified by a header.
#[idempotent(
    operation = "stream",
    retention = "24h",
    fingerprint(header = "x-upload-id", ignore_body)
)]
async fn stream(#[tenant] c: Caller, tx: &mut Tx<Postgres>, body: Body) -> StatusCode {
    StatusCode::CREATED
}

#[idempotent(operation = "request", retention = "24h", fingerprint(ignore_body))]
async fn request(#[tenant] c: Caller, tx: &mut Tx<Postgres>, req: Request) -> StatusCode {
    StatusCode::CREATED
}

/// A JSON body left out on purpose.
#[idempotent(
    operation = "ignored",
    retention = "24h",
    fingerprint(header = "x-currency", ignore_body)
)]
async fn ignored(
    #[tenant] c: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> StatusCode {
    StatusCode::CREATED
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/json", post(json))
        .route("/form", post(form))
        .route("/bytes", post(bytes))
        .route("/text", post(text))
        .route("/raw-form", post(raw_form))
        .route("/optional", post(optional))
        .route("/fallible", post(fallible))
        .route("/alias-pattern", post(alias_pattern))
        .route("/alias", post(alias))
        .route("/alias-named", post(alias_named))
        .route("/alias-fields", post(alias_fields))
        .route("/valid-json", post(valid_json))
        .route("/checked", post(checked))
        .route("/stream", post(stream))
        .route("/request", post(request))
        .route("/ignored", post(ignored))
        .with_state(idem());
}
