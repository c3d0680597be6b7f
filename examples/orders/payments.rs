//! `POST /payments`: leased mode. The effect (a charge) lives at a payment
//! provider, outside the database, so the claim commits on its own and the
//! provider is called with the lease's stable downstream key: the provider's own
//! idempotency makes a taken-over retry a no-op there.
//!
//! The provider is simulated in-process, with failure injection from the
//! environment (see the README): latency, an outage of N calls, and charges that
//! time out after they were made (uncertain outcomes, resolved by the reconciler
//! this service spawns).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_runtime::reconcile::{Reconcile, Resolution, UncertainOutcome};
use idem_runtime::retry::{RetryPolicy, Retryable};
use idem_runtime::Backend;
use idem_runtime::{Problem, StoredResponse, Uncertain};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::input::Validate;
use crate::routes::AppState;

/// Failure injection for the simulated provider.
#[derive(Debug, Clone, Default)]
pub struct ProviderConfig {
    /// `PAYMENTS_PROVIDER_LATENCY_MS`: every call takes this long.
    pub latency: Duration,
    /// `PAYMENTS_PROVIDER_OUTAGE_CALLS`: the first N calls fail (503).
    pub outage_calls: u64,
    /// `PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE`: the first N charges are made and
    /// then time out, so the caller cannot know they happened.
    pub timeout_after_charge: u64,
}

/// A payment provider with idempotency by key, like the real ones.
#[derive(Debug, Default)]
pub struct Provider {
    config: ProviderConfig,
    calls: AtomicU64,
    timeouts: AtomicU64,
    charges: Mutex<HashMap<String, Charge>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Charge {
    pub id: String,
    pub amount_cents: i64,
}

#[derive(Debug)]
pub enum ProviderError {
    Unavailable,
    TimedOut,
}

impl Provider {
    pub fn new(config: ProviderConfig) -> Self {
        Provider {
            config,
            ..Default::default()
        }
    }

    /// Charges once per idempotency key; a repeated key returns the first charge.
    pub async fn charge(
        &self,
        idempotency_key: &str,
        amount_cents: i64,
    ) -> Result<Charge, ProviderError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        if !self.config.latency.is_zero() {
            tokio::time::sleep(self.config.latency).await;
        }
        if call < self.config.outage_calls {
            return Err(ProviderError::Unavailable);
        }
        let charge = {
            let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
            let n = charges.len();
            charges
                .entry(idempotency_key.to_owned())
                .or_insert_with(|| Charge {
                    id: format!("ch_{:06}", n + 1),
                    amount_cents,
                })
                .clone()
        };
        if self.timeouts.fetch_add(1, Ordering::SeqCst) < self.config.timeout_after_charge {
            return Err(ProviderError::TimedOut);
        }
        Ok(charge)
    }

    pub fn find(&self, idempotency_key: &str) -> Option<Charge> {
        self.charges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(idempotency_key)
            .cloned()
    }

    /// What the provider has seen, for `GET /provider`.
    pub fn summary(&self) -> serde_json::Value {
        json!({
            "calls": self.calls.load(Ordering::SeqCst),
            "charges": self.charges.lock().unwrap_or_else(|e| e.into_inner()).len(),
        })
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewPayment {
    amount_cents: i64,
    #[serde(default)]
    description: Option<String>,
}

impl Validate for NewPayment {
    fn validate(&self) -> Result<(), String> {
        if self.amount_cents < 1 {
            return Err("amount_cents must be at least 1".into());
        }
        Ok(())
    }
}

/// The provider calls of one request: a few quick retries with full jitter.
fn retry_policy() -> RetryPolicy {
    RetryPolicy::new()
        .with_max_attempts(4)
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_millis(400))
        .with_max_total_delay(Duration::from_secs(1))
}

/// The largest amount the simulated provider accepts; above it the card is
/// declined, a business rejection that is stored and replayed.
const DECLINE_ABOVE_CENTS: i64 = 1_000_000;

fn payment_body(charge: &Charge) -> serde_json::Value {
    json!({"id": charge.id, "amount_cents": charge.amount_cents, "status": "succeeded"})
}

/// Charges a card on behalf of `POST /payments` (stamped per backend in
/// `routes`): the handler holds the lease, this calls the provider with its
/// downstream key.
pub async fn charge(provider: &Arc<Provider>, downstream_key: String, cmd: NewPayment) -> Response {
    if cmd.amount_cents > DECLINE_ABOVE_CENTS {
        return Problem::new(
            "urn:orders:problem:card-declined",
            StatusCode::PAYMENT_REQUIRED,
            "Card declined",
        )
        .into_response();
    }
    let call = || {
        let provider = provider.clone();
        let key = downstream_key.clone();
        async move { provider.charge(&key, cmd.amount_cents).await }
    };
    match call
        .retry(retry_policy())
        .when(|e| matches!(e, ProviderError::Unavailable))
        .await
    {
        Ok(charge) => (StatusCode::CREATED, Json(payment_body(&charge))).into_response(),
        Err(ProviderError::TimedOut) => {
            Uncertain::new("the payment provider timed out; the charge is being confirmed")
                .into_response()
        }
        Err(ProviderError::Unavailable) => Problem::new(
            "urn:orders:problem:provider-unavailable",
            StatusCode::SERVICE_UNAVAILABLE,
            "Payment provider unavailable",
        )
        .with_detail("nothing was charged; retry later with the same key")
        .into_response(),
    }
}

/// `GET /provider`: what the simulated provider saw (a demo aid).
pub async fn provider_summary<DB: Backend>(
    State(app): State<AppState<DB>>,
) -> Json<serde_json::Value> {
    Json(app.provider.summary())
}

/// Resolves uncertain payments by asking the provider about the stable key.
pub struct AskProvider(pub Arc<Provider>);

impl Reconcile for AskProvider {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        match self.0.find(&outcome.downstream_key) {
            Some(charge) => Resolution::Completed(StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: serde_json::to_vec(&payment_body(&charge))
                    .unwrap_or_default()
                    .into(),
            }),
            None => Resolution::Released,
        }
    }
}
