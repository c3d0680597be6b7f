//! The service's own error answers, as `application/problem+json` like idem's.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_runtime::Problem;

/// Any error this service answers with.
#[derive(Debug)]
pub struct ApiError(pub Problem);

impl ApiError {
    pub fn invalid(status: StatusCode, detail: impl Into<String>) -> Self {
        ApiError(
            Problem::new(
                "urn:orders:problem:invalid-request",
                status,
                "Invalid request",
            )
            .with_detail(detail),
        )
    }

    pub fn not_found(what: &str) -> Self {
        ApiError(
            Problem::new(
                "urn:orders:problem:not-found",
                StatusCode::NOT_FOUND,
                "Not found",
            )
            .with_detail(format!("no such {what} for this tenant")),
        )
    }

    pub fn internal(e: impl std::fmt::Display) -> Self {
        tracing::error!(error = %e, "orders: internal error");
        ApiError(Problem::new(
            "urn:orders:problem:internal",
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
        ))
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::internal(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.0.into_response()
    }
}
