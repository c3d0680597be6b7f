// A last parameter the attribute cannot classify by name (an extractor of the
// request's parts, here `Currency`) is probed: it is not a body, so nothing is
// fingerprinted for it and `fingerprint(header = ..)` needs no `ignore_body`.
include!("../../idem-macros/tests/ui/prelude.rs");

struct Currency(String);
impl<S: Send + Sync> FromRequestParts<S> for Currency {
    type Rejection = StatusCode;
    async fn from_request_parts(p: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Currency(
            p.headers
                .get("x-currency")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("EUR")
                .into(),
        ))
    }
}

#[idempotent(
    operation = "rotate",
    retention = "15m",
    fingerprint(header = "x-currency")
)]
async fn rotate(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Currency(c): Currency,
) -> StatusCode {
    StatusCode::OK
}

#[idempotent(operation = "rotate-2", retention = "15m")]
async fn rotate_2(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Currency(c): Currency,
) -> StatusCode {
    StatusCode::OK
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new()
        .route("/rotate", post(rotate))
        .route("/rotate-2", post(rotate_2))
        .with_state(idem());
}
