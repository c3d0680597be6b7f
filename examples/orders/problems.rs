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

/// Another writer held what a statement waited for ([`is_busy`]).
pub const BUSY: &str = "urn:orders:problem:busy";

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if is_busy(&e) {
            let mut busy = Problem::new(BUSY, StatusCode::SERVICE_UNAVAILABLE, "Busy").with_detail(
                "the order could not be locked in time; nothing changed, retry shortly",
            );
            busy.retry_after = Some(1);
            ApiError(busy)
        } else if is_unavailable(&e) {
            ApiError::unavailable(e)
        } else {
            ApiError::internal(e)
        }
    }
}

/// SQLite's "database is locked" (`SQLITE_BUSY`, `SQLITE_LOCKED` and their extended
/// codes): another writer held the database's one write lock past the busy
/// timeout; MySQL's lock wait timeout or deadlock. Nothing changed; the request
/// can simply be retried.
fn is_busy(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    // MySQL: the row lock was not had within innodb_lock_wait_timeout (1205), or
    // InnoDB rolled the transaction back as a deadlock's victim (1213).
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return matches!(my.number(), 1205 | 1213);
    }
    // SQLite's codes are numbers, its primary code in the low byte; PostgreSQL's
    // SQLSTATEs can be digits too, and are not asked.
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
        && db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| c & 0xff == 5 || c & 0xff == 6)
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
