//! `POST /orders/{id}/pay` and `POST /orders/{id}/ship`: idempotent state
//! transitions (created -> paid -> shipped) with `idem_runtime::transition`. A
//! repeated step is a successful no-op, a step out of order is `409`, and two
//! concurrent steps produce one effect.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use idem_runtime::Problem;
use idem_runtime::transition::{Resource, States, TransitionError, Transitioned, transition};
use serde_json::{Value, json};

use crate::auth::Caller;
use crate::problems::ApiError;
use crate::routes::AppState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderStatus {
    Created,
    Paid,
    Shipped,
}

impl States for OrderStatus {
    const ALL: &'static [Self] = &[Self::Created, Self::Paid, Self::Shipped];
    const TRANSITIONS: &'static [(Self, Self)] =
        &[(Self::Created, Self::Paid), (Self::Paid, Self::Shipped)];

    fn name(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Paid => "paid",
            Self::Shipped => "shipped",
        }
    }
}

const ORDERS: Resource = Resource {
    table: "orders",
    id_column: "id",
    state_column: "status",
    version_column: "version",
    scope_column: Some("tenant_id"),
};

/// A concurrent step that lost is retried this often; the retry then sees the
/// winner's state and is a no-op.
const ATTEMPTS: usize = 3;

async fn step(
    app: &AppState,
    caller: &Caller,
    id: i64,
    to: OrderStatus,
) -> Result<Json<Value>, ApiError> {
    for _ in 0..ATTEMPTS {
        let mut tx = app
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        let tenant = caller.tenant.clone();
        let outcome = transition(&mut tx, &ORDERS, id, Some(&caller.tenant), to, move |conn| {
            Box::pin(async move {
                match to {
                    OrderStatus::Paid => {
                        sqlx::query(
                            "INSERT INTO order_payments (tenant_id, order_id, amount_cents) \
                             SELECT tenant_id, id, amount_cents FROM orders WHERE id = $1 AND tenant_id = $2",
                        )
                        .bind(id)
                        .bind(&tenant)
                        .execute(&mut *conn)
                        .await?;
                    }
                    OrderStatus::Shipped => {
                        sqlx::query("INSERT INTO shipments (tenant_id, order_id) VALUES ($1, $2)")
                            .bind(&tenant)
                            .bind(id)
                            .execute(&mut *conn)
                            .await?;
                    }
                    OrderStatus::Created => {}
                }
                Ok::<_, sqlx::Error>(())
            })
        })
        .await;
        let (changed, version) = match outcome {
            Ok(Transitioned::Applied { version, .. }) => (true, version),
            Ok(Transitioned::AlreadyThere { version }) => (false, version),
            Err(TransitionError::Conflict) => continue, // dropped tx rolls back the effect
            Err(TransitionError::NotFound) => return Err(ApiError::not_found("order")),
            Err(TransitionError::Invalid { from, to }) => {
                return Err(ApiError(
                    Problem::new(
                        "urn:orders:problem:invalid-transition",
                        StatusCode::CONFLICT,
                        "Invalid order transition",
                    )
                    .with_detail(format!(
                        "an order that is {} cannot become {}",
                        from.name(),
                        to.name()
                    )),
                ));
            }
            Err(e) => return Err(ApiError::internal(e)),
        };
        tx.commit().await?;
        return Ok(Json(
            json!({"id": id, "status": to.name(), "version": version, "changed": changed}),
        ));
    }
    Err(ApiError::internal("the order kept changing concurrently"))
}

/// Pays an order; paying a paid order again changes nothing.
pub async fn pay(
    caller: Caller,
    State(app): State<AppState>,
    Path(id): Path<i64>,
) -> Result<Json<Value>, ApiError> {
    step(&app, &caller, id, OrderStatus::Paid).await
}

/// Ships a paid order; shipping a shipped order again changes nothing.
pub async fn ship(
    caller: Caller,
    State(app): State<AppState>,
    Path(id): Path<i64>,
) -> Result<Json<Value>, ApiError> {
    step(&app, &caller, id, OrderStatus::Shipped).await
}
