//! `POST /orders/{id}/pay` and `POST /orders/{id}/ship`: idempotent state
//! transitions (created -> paid -> shipped) with `idem_runtime::transition`. A
//! repeated step is a successful no-op, a step out of order is `409`, and two
//! concurrent steps produce one effect. The handlers, stamped per backend, are in
//! `routes`; the states and the answers are here.

use axum::http::StatusCode;
use idem_runtime::Problem;
use idem_runtime::transition::{Resource, States, TransitionError, Transitioned};
use serde::Serialize;
use serde_json::Value;

use crate::problems::ApiError;

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

pub const ORDERS: Resource = Resource {
    table: "orders",
    id_column: "id",
    state_column: "status",
    version_column: "version",
    scope_column: Some("tenant_id"),
};

/// A concurrent step that lost is retried this often; the retry then sees the
/// winner's state and is a no-op.
pub const ATTEMPTS: usize = 3;

/// What a transition's outcome answers: `Some(body)` to commit and send, `None`
/// when a concurrent step won the race (roll back and try again), or an error.
pub fn answer(
    id: i64,
    to: OrderStatus,
    outcome: Result<Transitioned<()>, TransitionError<OrderStatus, sqlx::Error>>,
) -> Result<Option<Value>, ApiError> {
    let (changed, version) = match outcome {
        Ok(Transitioned::Applied { version, .. }) => (true, version),
        Ok(Transitioned::AlreadyThere { version }) => (false, version),
        Err(TransitionError::Conflict) => return Ok(None),
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
        // Busy (`503` with `Retry-After: 1`), or unreachable (`503` with
        // Retry-After, like idem's store failure): see `ApiError`'s `From`.
        Err(TransitionError::Database(e)) => return Err(e.into()),
        Err(e) => return Err(ApiError::internal(e)),
        // An outcome this example does not know (Transitioned can grow).
        Ok(_) => return Err(ApiError::internal("unknown transition outcome")),
    };
    let step = Step {
        id,
        status: to.name(),
        version,
        changed,
    };
    // A map, as `json!` made it before `Step` described it: the same bytes.
    Ok(Some(
        serde_json::to_value(step).map_err(ApiError::internal)?,
    ))
}

/// A fulfilment step's answer (`200`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Step {
    /// The order's id.
    id: i64,
    /// The order's state after the step: the one the step asked for.
    #[schema(schema_with = step_status)]
    status: &'static str,
    /// The order's version, raised by each step that changed it.
    version: i64,
    /// Whether this step changed the order (`false`: it was there already).
    changed: bool,
}

/// `status` of a [`Step`]: a state a step leads to.
fn step_status() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::Type::String)
        .enum_values(Some(["paid", "shipped"]))
        .build()
}
