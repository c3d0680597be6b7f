//! The HTTP routes. The two `POST`s are idempotent; `GET` and `DELETE` are
//! idempotent by nature and need no key.

use std::time::Duration;

use axum::extract::{FromRef, Path, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_runtime::{Idem, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{FromRow, PgPool};

use crate::auth::Caller;
use crate::input::{Currency, ValidJson, Validate};
use crate::problems::ApiError;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub idem: Idem,
    pub pool: PgPool,
    /// `ORDERS_LATENCY_MS`: slow work inside the transaction, after the claim.
    pub latency: Duration,
    /// The simulated payment provider of `POST /payments`.
    pub provider: std::sync::Arc<crate::payments::Provider>,
}

impl FromRef<AppState> for Idem {
    fn from_ref(s: &AppState) -> Idem {
        s.idem.clone()
    }
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .route("/orders/{id}", get(get_order).delete(delete_order))
        .route("/orders/{id}/pay", post(crate::fulfilment::pay))
        .route("/orders/{id}/ship", post(crate::fulfilment::ship))
        .route("/refunds", post(create_refund))
        .route("/payments", post(crate::payments::create_payment))
        .route("/provider", get(crate::payments::provider_summary))
        .with_state(state)
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewOrder {
    sku: String,
    quantity: i32,
    amount_cents: i64,
    #[serde(default)]
    note: Option<String>,
}

impl Validate for NewOrder {
    fn validate(&self) -> Result<(), String> {
        if self.sku.is_empty() || self.sku.chars().count() > 64 {
            return Err("sku must be 1 to 64 characters".into());
        }
        if self.quantity < 1 {
            return Err("quantity must be at least 1".into());
        }
        if self.amount_cents < 0 {
            return Err("amount_cents must not be negative".into());
        }
        Ok(())
    }
}

#[derive(Debug, Serialize, FromRow)]
pub struct Order {
    id: i64,
    sku: String,
    quantity: i32,
    amount_cents: i64,
    currency: String,
    note: Option<String>,
    created_at: String,
}

const ORDER_COLUMNS: &str = "id, sku, quantity, amount_cents, currency::text AS currency, note, \
     to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS created_at";

/// Creates an order. A retry with the same key gets the same 201 back.
#[idempotent(
    operation = "create-order",
    retention = "24h",
    fingerprint(body, header = "x-currency")
)]
async fn create_order(
    #[tenant] caller: Caller,
    Currency(currency): Currency,
    State(app): State<AppState>,
    tx: &mut Tx,
    ValidJson(cmd): ValidJson<NewOrder>,
) -> Result<impl IntoResponse, ApiError> {
    let order: Order = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING {ORDER_COLUMNS}"
    )))
    .bind(&caller.tenant)
    .bind(&cmd.sku)
    .bind(cmd.quantity)
    .bind(cmd.amount_cents)
    .bind(&currency)
    .bind(&cmd.note)
    .fetch_one(&mut **tx)
    .await?;
    slow_work(&app).await;
    let location = format!("/orders/{}", order.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    ))
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewRefund {
    order_id: i64,
    amount_cents: i64,
}

impl Validate for NewRefund {
    fn validate(&self) -> Result<(), String> {
        if self.amount_cents < 0 {
            return Err("amount_cents must not be negative".into());
        }
        Ok(())
    }
}

#[derive(Debug, Serialize, FromRow)]
pub struct Refund {
    id: i64,
    order_id: i64,
    amount_cents: i64,
}

/// Refunds an order. An order this tenant does not have is a committed business
/// rejection: the 404 is stored and replayed like a success.
#[idempotent(operation = "create-refund", retention = "24h")]
async fn create_refund(
    #[tenant] caller: Caller,
    State(app): State<AppState>,
    tx: &mut Tx,
    ValidJson(cmd): ValidJson<NewRefund>,
) -> Result<axum::response::Response, ApiError> {
    let refund: Option<Refund> = sqlx::query_as(
        "INSERT INTO refunds (tenant_id, order_id, amount_cents) \
         SELECT $1, o.id, $3 FROM orders o WHERE o.tenant_id = $1 AND o.id = $2 \
         RETURNING id, order_id, amount_cents",
    )
    .bind(&caller.tenant)
    .bind(cmd.order_id)
    .bind(cmd.amount_cents)
    .fetch_optional(&mut **tx)
    .await?;
    slow_work(&app).await;
    Ok(match refund {
        Some(r) => (StatusCode::CREATED, Json(r)).into_response(),
        // Ok, not Err: the rejection is the operation's result, and is kept.
        None => ApiError::not_found("order").into_response(),
    })
}

async fn slow_work(app: &AppState) {
    if !app.latency.is_zero() {
        tokio::time::sleep(app.latency).await;
    }
}

async fn list_orders(
    caller: Caller,
    State(app): State<AppState>,
) -> Result<Json<Vec<Order>>, ApiError> {
    let orders = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ORDER_COLUMNS} FROM orders WHERE tenant_id = $1 ORDER BY id"
    )))
    .bind(&caller.tenant)
    .fetch_all(&app.pool)
    .await?;
    Ok(Json(orders))
}

async fn get_order(
    caller: Caller,
    State(app): State<AppState>,
    Path(id): Path<i64>,
) -> Result<Json<Order>, ApiError> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ORDER_COLUMNS} FROM orders WHERE tenant_id = $1 AND id = $2"
    )))
    .bind(&caller.tenant)
    .bind(id)
    .fetch_optional(&app.pool)
    .await?
    .map(Json)
    .ok_or_else(|| ApiError::not_found("order"))
}

async fn delete_order(
    caller: Caller,
    State(app): State<AppState>,
    Path(id): Path<i64>,
) -> Result<StatusCode, ApiError> {
    let done = sqlx::query("DELETE FROM orders WHERE tenant_id = $1 AND id = $2")
        .bind(&caller.tenant)
        .bind(id)
        .execute(&app.pool)
        .await?;
    if done.rows_affected() == 0 {
        return Err(ApiError::not_found("order"));
    }
    Ok(StatusCode::NO_CONTENT)
}
