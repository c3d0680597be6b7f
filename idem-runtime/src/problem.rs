//! RFC 9457 `application/problem+json` answers, one stable `type` per failure, so
//! a client can tell a fingerprint mismatch from its own validation error.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

// The type URIs and the media type are idem's wire contract, defined once in
// `idem-wire` (which the client reads them from too); the documentation here says
// what this crate answers with each.

/// `400`: the request has no `Idempotency-Key` header.
pub const MISSING_KEY: &str = idem_wire::problem::MISSING_KEY;
/// `400`: the `Idempotency-Key` header is unusable.
pub const MALFORMED_KEY: &str = idem_wire::problem::MALFORMED_KEY;
/// `422`: the key was used before for a different request.
pub const FINGERPRINT_MISMATCH: &str = idem_wire::problem::FINGERPRINT_MISMATCH;
/// `409`: a request with the same key is still running.
pub const IN_FLIGHT: &str = idem_wire::problem::IN_FLIGHT;
/// `500`: the response was larger than the configured limit and was not stored;
/// the operation was rolled back.
pub const RESPONSE_TOO_LARGE: &str = idem_wire::problem::RESPONSE_TOO_LARGE;
/// `500`: the tenant id supplied by the application is unusable.
pub const INVALID_TENANT: &str = idem_wire::problem::INVALID_TENANT;
/// `500`: the request body could not be fingerprinted.
pub const FINGERPRINT_FAILED: &str = idem_wire::problem::FINGERPRINT_FAILED;
/// `503`: the idempotency store failed; nothing was stored and a retry is safe.
/// Also `500` when the handler's response itself could not be captured for
/// storing (its body failed mid-stream, or a stored header's value is not text):
/// the operation was rolled back.
pub const STORE_UNAVAILABLE: &str = idem_wire::problem::STORE_UNAVAILABLE;
/// `503`: the database stayed locked by other writers past the claim's wait
/// (SQLite); nothing was reserved and a retry is safe.
pub const STORE_BUSY: &str = idem_wire::problem::STORE_BUSY;
/// `503`: the operation's running limit was full; nothing was reserved and a
/// retry is safe.
pub const AT_CAPACITY: &str = idem_wire::problem::AT_CAPACITY;
/// `500`: the handler panicked; its transaction was rolled back.
pub const HANDLER_PANICKED: &str = idem_wire::problem::HANDLER_PANICKED;

/// `404`: no operation resource with this id is visible to the caller
/// ([`crate::operations::router`]); the same answer for an unknown id, another
/// tenant's operation and one forgotten after its retention.
pub const OPERATION_NOT_FOUND: &str = idem_wire::problem::OPERATION_NOT_FOUND;

/// `202`: an earlier execution's external effect is unknown and is being
/// reconciled; nothing runs again meanwhile. Retry later with the same key.
pub const OUTCOME_UNCERTAIN: &str = idem_wire::problem::OUTCOME_UNCERTAIN;

/// The media type of problem details.
pub const CONTENT_TYPE: &str = idem_wire::problem::CONTENT_TYPE;

/// A problem details object (RFC 9457).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// A stable URI naming the kind of problem; the constants of this module.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// A short, stable summary of the kind of problem.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What went wrong with this request. Never holds the raw idempotency key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// For [`IN_FLIGHT`], [`OUTCOME_UNCERTAIN`], [`STORE_UNAVAILABLE`],
    /// [`STORE_BUSY`] and [`AT_CAPACITY`]: seconds after which a retry may succeed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// What an outcome idem cannot read is answered with, on HTTP and gRPC alike:
/// not "nothing stored" (a client that believed it might pay again under a
/// new key), and the same key later.
pub(crate) const OUTCOME_UNREADABLE: &str = "this key's outcome could not be read; it will not \
     run again for this key. Retry later with the same key, not a new one";

impl Problem {
    /// A problem of the given type, status and title.
    pub fn new(type_uri: &str, status: StatusCode, title: &str) -> Self {
        Problem {
            type_uri: type_uri.to_owned(),
            title: title.to_owned(),
            status: status.as_u16(),
            detail: None,
            retry_after: None,
        }
    }

    /// Adds a detail sentence.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds `Retry-After`: the wait in whole seconds, rounded up, at least 1
    /// ([`idem_wire::retry_after_seconds`]).
    fn retrying_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(idem_wire::retry_after_seconds(wait));
        self
    }

    /// `400`, [`MISSING_KEY`].
    pub fn missing_key() -> Self {
        Problem::new(MISSING_KEY, StatusCode::BAD_REQUEST, "Idempotency-Key header required")
            .with_detail("this operation needs an Idempotency-Key header: send a unique value, and the same value again when you retry")
    }

    /// `400`, [`MALFORMED_KEY`], with the reason.
    pub fn malformed_key(reason: &crate::KeyError) -> Self {
        Problem::new(
            MALFORMED_KEY,
            StatusCode::BAD_REQUEST,
            "Idempotency-Key header malformed",
        )
        .with_detail(reason.to_string())
    }

    /// `422`, [`FINGERPRINT_MISMATCH`].
    pub fn mismatch() -> Self {
        Problem::new(
            FINGERPRINT_MISMATCH,
            StatusCode::UNPROCESSABLE_ENTITY,
            "Idempotency-Key reused for a different request",
        )
        .with_detail("this key was first used with a different request body or headers; use a new key for a new request")
    }

    /// `409`, [`IN_FLIGHT`], with `Retry-After`: the wait in whole seconds,
    /// rounded up, at least 1 ([`idem_wire::retry_after_seconds`]).
    pub fn in_flight(retry_after: Duration) -> Self {
        Problem::new(
            IN_FLIGHT,
            StatusCode::CONFLICT,
            "A request with this Idempotency-Key is in progress",
        )
        .with_detail(
            "the first request with this key has not finished; retry with the same key later",
        )
        .retrying_after(retry_after)
    }

    /// `503`, [`STORE_BUSY`], with `Retry-After`: the database stayed locked by
    /// other writers; nothing was reserved for the key.
    pub fn busy(retry_after: Duration) -> Self {
        Problem::new(
            STORE_BUSY,
            StatusCode::SERVICE_UNAVAILABLE,
            "The database is busy",
        )
        .with_detail(
            "other requests (of any key, perhaps this one) held the database's write lock for longer than this one could wait; nothing was looked up or reserved for this key: retry with the same key later",
        )
        .retrying_after(retry_after)
    }

    /// `503`, [`AT_CAPACITY`], with `Retry-After`: the operation's running limit
    /// was full (see [`crate::Idem::with_running_limit`]); nothing was reserved
    /// for the key.
    pub fn at_capacity(retry_after: Duration) -> Self {
        Problem::new(
            AT_CAPACITY,
            StatusCode::SERVICE_UNAVAILABLE,
            "Too many of these operations are running",
        )
        .with_detail(
            "this operation already runs as many executions at once as it may (in all, or for this tenant); nothing was reserved for this key: retry with the same key later",
        )
        .retrying_after(retry_after)
    }

    /// `202`, [`OUTCOME_UNCERTAIN`], with `Retry-After`: the wait in whole
    /// seconds, rounded up, at least 1 ([`idem_wire::retry_after_seconds`]).
    pub fn uncertain(retry_after: Duration) -> Self {
        Problem::new(
            OUTCOME_UNCERTAIN,
            StatusCode::ACCEPTED,
            "The outcome of this request is being confirmed",
        )
        .with_detail("an earlier attempt may have taken effect; it is being reconciled and will not run twice. Retry later with the same key")
        .retrying_after(retry_after)
    }

    /// `503`, [`STORE_UNAVAILABLE`], with `Retry-After: 1` (every `503` says
    /// when to come back; a retry with the same key is always safe).
    pub fn store_unavailable() -> Self {
        let mut p = Problem::new(
            STORE_UNAVAILABLE,
            StatusCode::SERVICE_UNAVAILABLE,
            "Idempotency store unavailable",
        )
        .with_detail("nothing was stored; retrying with the same key is safe");
        p.retry_after = Some(1);
        p
    }

    /// [`Problem::store_unavailable`] for a key that holds an outcome which
    /// cannot be read (an answer sealed with a key the ring lacks, or changed):
    /// "nothing was stored" would be false, and a client that believed it
    /// might resubmit with a new key and pay twice.
    pub(crate) fn outcome_unreadable() -> Self {
        Self::store_unavailable().with_detail(OUTCOME_UNREADABLE)
    }
}

impl IntoResponse for Problem {
    /// A status outside 100..=999 cannot be sent: the answer is `500`, and the
    /// document says `500` too, so the status line and the body never disagree.
    fn into_response(mut self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        self.status = status.as_u16();
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut resp = (status, body).into_response();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounding itself is idem-wire's (`retry_after_seconds`, tested there):
    /// both waits go through it, and the header says what the document says.
    #[test]
    fn in_flight_and_uncertain_round_retry_after_up() {
        assert_eq!(
            Problem::in_flight(Duration::from_millis(1500)).retry_after,
            Some(2)
        );
        assert_eq!(
            Problem::uncertain(Duration::from_millis(1500)).retry_after,
            Some(2)
        );
        assert_eq!(
            Problem::in_flight(Duration::from_millis(10)).retry_after,
            Some(1)
        );
        let resp = Problem::in_flight(Duration::from_secs(3)).into_response();
        assert_eq!(resp.status(), StatusCode::CONFLICT);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
        assert_eq!(resp.headers()[header::CONTENT_TYPE], CONTENT_TYPE);
    }

    #[tokio::test]
    async fn a_status_that_cannot_be_sent_is_500_in_the_status_line_and_the_body() {
        use http_body_util::BodyExt;

        for bad in [0u16, 42, 1000, u16::MAX] {
            let mut p = Problem::new("urn:example:odd", StatusCode::IM_A_TEAPOT, "Odd");
            p.status = bad;
            let resp = p.into_response();
            assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR, "{bad}");
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["status"], 500, "{bad}");
        }
        // A sendable status is kept as it is, in both.
        let resp = Problem::new("urn:example:odd", StatusCode::IM_A_TEAPOT, "Odd").into_response();
        assert_eq!(resp.status(), StatusCode::IM_A_TEAPOT);
    }
}
