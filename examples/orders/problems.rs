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

    /// `503` with `Retry-After`, as idem answers when its store fails: the
    /// database could not be reached, nothing was changed, and the same request
    /// may be retried.
    pub fn unavailable(e: impl std::fmt::Display) -> Self {
        tracing::warn!(error = %e, "orders: the database is unavailable");
        let mut p = Problem::store_unavailable();
        p.retry_after = Some(crate::server::RETRY_AFTER_SECS);
        ApiError(p)
    }
}

/// Whether a database error is the database being out of reach (the connection
/// failed or was cut, the pool found none in time, the server is shutting down
/// or full) rather than something wrong with this request.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // SQLSTATE class 08 (connection exception), 57P01-57P03 (the server is
        // shutting down or starting), 57P05 (a session idle past the server's
        // idle_session_timeout), 53300 (too many connections).
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03" | "57P05" | "53300")
        }),
        _ => false,
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if is_unavailable(&e) {
            ApiError::unavailable(e)
        } else {
            ApiError::internal(e)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let unauthorized = self.0.status == StatusCode::UNAUTHORIZED.as_u16();
        let mut response = self.0.into_response();
        if unauthorized {
            // RFC 9110 §15.5.2: a 401 names the scheme it wants.
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}
