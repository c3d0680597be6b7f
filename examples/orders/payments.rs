//! `POST /payments`: leased mode. The effect (a charge) lives at a payment
//! provider, outside the database, so the claim commits on its own and the
//! provider is called with the lease's stable downstream key: the provider's own
//! idempotency makes a taken-over retry a no-op there.
//!
//! The provider is simulated in-process, with failure injection from the
//! environment (see the README): latency, an outage of N calls, and charges that
//! time out after they were made (uncertain outcomes, resolved by the reconciler
//! this service spawns). Like a real provider it remembers its charges when the
//! service dies: they live in its own table, `provider_charges`, written in
//! statements of their own (never in idem's transactions), so a reconciler
//! started after a crash finds a charge made before it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_runtime::Backend;
use idem_runtime::reconcile::{Reconcile, Resolution, UncertainOutcome};
use idem_runtime::retry::RetryPolicy;
use idem_runtime::{Problem, StoredResponse, Uncertain};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::input::Validate;
use crate::problems::ApiError;
use crate::routes::AppState;

/// Failure injection for the simulated provider.
#[derive(Debug, Clone, Default)]
pub struct ProviderConfig {
    /// `PAYMENTS_PROVIDER_LATENCY_MS`: every call takes this long.
    pub latency: Duration,
    /// `PAYMENTS_PROVIDER_LATENCY_AFTER_CHARGE_MS`: a charge is made, and then
    /// the answer takes this long (a service killed meanwhile has charged
    /// without knowing it).
    pub latency_after_charge: Duration,
    /// `PAYMENTS_PROVIDER_HOLD_FILE`: while this file exists, a charge is made
    /// and its answer waits (a test holds a payment's lease mid-way and lets it
    /// go by removing the file, with no timing of its own to guess).
    pub hold_after_charge: Option<std::sync::Arc<std::path::Path>>,
    /// `PAYMENTS_PROVIDER_OUTAGE_CALLS`: the first N calls fail (503).
    pub outage_calls: u64,
    /// `PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE`: the first N charges are made and
    /// then time out, so the caller cannot know they happened.
    pub timeout_after_charge: u64,
}

/// Where the simulated provider keeps its charges: the service's own database,
/// standing in for the provider's.
#[derive(Debug)]
pub enum Ledger {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
    MySql(sqlx::MySqlPool),
}

/// Runs `$body` with `$pool` bound to the ledger's pool, whichever backend it is
/// (the statements are the same SQL on PostgreSQL and SQLite; MySQL, with `?`
/// placeholders, gets `$mysql`).
macro_rules! on_ledger {
    ($ledger:expr, |$pool:ident| $body:expr, mysql: $mysql:expr) => {
        match $ledger {
            Ledger::Postgres($pool) => $body,
            Ledger::Sqlite($pool) => $body,
            Ledger::MySql($pool) => $mysql,
        }
    };
}

/// A payment provider with idempotency by key, like the real ones. Its charges
/// are durable; the failure injection counts the calls of this process.
#[derive(Debug)]
pub struct Provider {
    config: ProviderConfig,
    calls: AtomicU64,
    timeouts: AtomicU64,
    ledger: Ledger,
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

fn charge_id(seq: i64) -> String {
    format!("ch_{seq:06}")
}

impl Provider {
    pub fn new(config: ProviderConfig, ledger: Ledger) -> Self {
        Provider {
            config,
            calls: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            ledger,
        }
    }

    /// Records a charge for the key unless one exists, and returns the key's charge.
    async fn record(&self, key: &str, amount_cents: i64) -> Result<Charge, sqlx::Error> {
        let (seq, amount_cents): (i64, i64) = on_ledger!(&self.ledger, |pool| {
            sqlx::query(
                "INSERT INTO provider_charges (idempotency_key, amount_cents) VALUES ($1, $2) \
                 ON CONFLICT (idempotency_key) DO NOTHING",
            )
            .bind(key)
            .bind(amount_cents)
            .execute(pool)
            .await?;
            sqlx::query_as(
                "SELECT id, amount_cents FROM provider_charges WHERE idempotency_key = $1",
            )
            .bind(key)
            .fetch_one(pool)
            .await?
        }, mysql: {
            // ON DUPLICATE KEY UPDATE with a no-op: the key's first charge stays.
            sqlx::query(
                "INSERT INTO provider_charges (idempotency_key, amount_cents) VALUES (?, ?) \
                 ON DUPLICATE KEY UPDATE id = id",
            )
            .bind(key)
            .bind(amount_cents)
            .execute(pool)
            .await?;
            sqlx::query_as("SELECT id, amount_cents FROM provider_charges WHERE idempotency_key = ?")
                .bind(key)
                .fetch_one(pool)
                .await?
        });
        Ok(Charge {
            id: charge_id(seq),
            amount_cents,
        })
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
        let charge = match self.record(idempotency_key, amount_cents).await {
            Ok(charge) => charge,
            // The ledger failed: whether the charge was written (a connection cut
            // after the commit) cannot be told, as with a real provider's
            // timeout; the reconciler finds out.
            Err(e) => {
                tracing::warn!(error = %e, "payments: the provider's ledger failed");
                return Err(ProviderError::TimedOut);
            }
        };
        if !self.config.latency_after_charge.is_zero() {
            tokio::time::sleep(self.config.latency_after_charge).await;
        }
        if let Some(path) = &self.config.hold_after_charge {
            while path.exists() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        if self.timeouts.fetch_add(1, Ordering::SeqCst) < self.config.timeout_after_charge {
            return Err(ProviderError::TimedOut);
        }
        Ok(charge)
    }

    /// The charge made for a key, if any.
    pub async fn find(&self, idempotency_key: &str) -> Result<Option<Charge>, sqlx::Error> {
        let row: Option<(i64, i64)> = on_ledger!(&self.ledger, |pool| {
            sqlx::query_as(
                "SELECT id, amount_cents FROM provider_charges WHERE idempotency_key = $1",
            )
            .bind(idempotency_key)
            .fetch_optional(pool)
            .await?
        }, mysql: {
            sqlx::query_as("SELECT id, amount_cents FROM provider_charges WHERE idempotency_key = ?")
                .bind(idempotency_key)
                .fetch_optional(pool)
                .await?
        });
        Ok(row.map(|(seq, amount_cents)| Charge {
            id: charge_id(seq),
            amount_cents,
        }))
    }

    /// What the provider has seen, for `GET /provider`: this process's calls, and
    /// every charge it ever made.
    pub async fn summary(&self) -> Result<serde_json::Value, sqlx::Error> {
        let charges: i64 = on_ledger!(&self.ledger, |pool| {
            sqlx::query_scalar("SELECT count(*) FROM provider_charges")
                .fetch_one(pool)
                .await?
        }, mysql: {
            sqlx::query_scalar("SELECT count(*) FROM provider_charges")
                .fetch_one(pool)
                .await?
        });
        Ok(json!({
            "calls": self.calls.load(Ordering::SeqCst),
            "charges": charges,
        }))
    }
}

#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewPayment {
    #[serde(deserialize_with = "crate::input::whole")]
    #[schema(minimum = 1)]
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

/// A charge, as `POST /payments` answers it (`201`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Payment {
    /// The provider's charge id.
    id: String,
    amount_cents: i64,
    /// Always `succeeded`: a charge that did not succeed is not answered `201`.
    #[schema(schema_with = succeeded)]
    status: &'static str,
}

/// `status` of a [`Payment`]: the one value it has.
fn succeeded() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::Type::String)
        .enum_values(Some(["succeeded"]))
        .build()
}

fn payment_body(charge: &Charge) -> serde_json::Value {
    // A map, as `json!` made it before the type above described it: the same
    // bytes on the wire.
    serde_json::to_value(Payment {
        id: charge.id.clone(),
        amount_cents: charge.amount_cents,
        status: "succeeded",
    })
    .unwrap_or_default()
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
    match retry_policy()
        .run(call, |e| matches!(e, ProviderError::Unavailable))
        .await
    {
        Ok(charge) => (StatusCode::CREATED, Json(payment_body(&charge))).into_response(),
        Err(ProviderError::TimedOut) => {
            Uncertain::new("the payment provider timed out; the charge is being confirmed")
                .into_response()
        }
        Err(ProviderError::Unavailable) => {
            let mut p = Problem::new(
                "urn:orders:problem:provider-unavailable",
                StatusCode::SERVICE_UNAVAILABLE,
                "Payment provider unavailable",
            )
            .with_detail("this request charged nothing; retry later with the same key, which the provider charges at most once");
            p.retry_after = Some(crate::server::RETRY_AFTER_SECS);
            p.into_response()
        }
    }
}

/// `GET /provider`: what the simulated provider saw (a demo aid).
pub async fn provider_summary<DB: Backend>(
    State(app): State<AppState<DB>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(app.provider.summary().await?))
}

/// Resolves uncertain payments by asking the provider about the stable key.
pub struct AskProvider(pub Arc<Provider>);

impl Reconcile for AskProvider {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        match self.0.find(&outcome.downstream_key).await {
            Ok(Some(charge)) => Resolution::Completed(StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: serde_json::to_vec(&payment_body(&charge))
                    .unwrap_or_default()
                    .into(),
            }),
            Ok(None) => Resolution::Released,
            // Cannot ask: the row stays uncertain until a later round can.
            Err(e) => {
                tracing::warn!(error = %e, "payments: cannot ask the provider's ledger");
                Resolution::StillUncertain
            }
        }
    }
}
