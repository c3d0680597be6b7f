// The leased handler README.md and docs/leased-mode.md show, as they show it
// (tests/docs.rs holds the three texts equal): a provider whose `charge` takes
// its idempotency key as `&str`, called through `RetryPolicy::run`.
include!("../../idem-macros/tests/ui/prelude.rs");

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use idem_runtime::Uncertain;
use idem_runtime::retry::RetryPolicy;

#[derive(Clone)]
struct App {
    idem: Idem<Postgres>,
    provider: Arc<Provider>,
}

impl axum::extract::FromRef<App> for Idem<Postgres> {
    fn from_ref(app: &App) -> Self {
        app.idem.clone()
    }
}

struct Provider;

#[derive(Serialize)]
struct Charge {
    id: String,
}

enum ProviderError {
    Unavailable,
    TimedOut,
    Declined,
}

impl ProviderError {
    fn is_transient(&self) -> bool {
        matches!(self, ProviderError::Unavailable)
    }

    fn is_timeout(&self) -> bool {
        matches!(self, ProviderError::TimedOut)
    }
}

impl Provider {
    async fn charge(
        &self,
        idempotency_key: &str,
        amount_cents: i64,
    ) -> Result<Charge, ProviderError> {
        if amount_cents > 1_000_000 {
            return Err(ProviderError::Declined);
        }
        Ok(Charge {
            id: format!("ch_{idempotency_key}"),
        })
    }
}

#[derive(Deserialize, Serialize)]
struct NewPayment {
    amount_cents: i64,
}

// rustfmt would rewrap the docs' lines.
#[rustfmt::skip]
// README: begin
#[idempotent(operation = "create-payment", retention = "24h", lease = "30s")]
async fn create_payment(#[tenant] caller: Caller, State(app): State<App>, lease: &mut Lease<Postgres>,
                        Json(p): Json<NewPayment>) -> Response {
    let (provider, key) = (&app.provider, &lease.downstream_key());
    match RetryPolicy::new().run(|| provider.charge(key, p.amount_cents), |e| e.is_transient()).await {
        Ok(c) => (StatusCode::CREATED, Json(c)).into_response(),
        Err(e) if e.is_timeout() => Uncertain::new("the provider timed out").into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}
// README: end

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let app = App {
        idem: idem(),
        provider: Arc::new(Provider),
    };
    let _: Router = Router::new()
        .route("/payments", post(create_payment))
        .with_state(app);
}
