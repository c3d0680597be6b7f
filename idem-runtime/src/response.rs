//! Turning a handler's response into a stored outcome, and a stored outcome back
//! into a response.

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::model::StoredResponse;

/// The header that marks a replayed response (`Idempotent-Replayed: true`);
/// [`idem_wire::IDEMPOTENT_REPLAYED`].
pub const REPLAYED_HEADER: &str = idem_wire::IDEMPOTENT_REPLAYED;

/// Why a response cannot be stored.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CaptureError {
    /// The body is larger than the configured limit.
    #[error("the response body exceeds the {limit}-byte limit for stored responses")]
    TooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// The body stream failed.
    #[error("the response body could not be read: {0}")]
    Body(String),
    /// A header that must be stored has a value that is not visible ASCII text.
    #[error("the response header `{0}` is not text and cannot be stored")]
    BinaryHeader(String),
}

/// Buffers a response, keeping its parts so it can still be sent, and extracts the
/// stored form: status, the allow-listed headers and the body.
///
/// # Errors
///
/// [`CaptureError`] when the body is too large, fails, or an allow-listed header
/// holds bytes that are not text.
pub(crate) async fn capture(
    response: Response,
    stored_headers: &[HeaderName],
    limit: usize,
) -> Result<(Response, StoredResponse), CaptureError> {
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, limit).await.map_err(|e| {
        if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
        {
            CaptureError::TooLarge { limit }
        } else {
            CaptureError::Body(e.to_string())
        }
    })?;
    let mut headers = Vec::new();
    for (name, value) in &parts.headers {
        if stored_headers.contains(name) {
            let text = value
                .to_str()
                .map_err(|_| CaptureError::BinaryHeader(name.to_string()))?;
            headers.push((name.as_str().to_owned(), text.to_owned()));
        }
    }
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: body.clone(),
    };
    Ok((Response::from_parts(parts, Body::from(body)), stored))
}

/// Builds the replay of a stored outcome: its status, headers and body, plus
/// `Idempotent-Replayed: true`. A sealed answer that was not opened (see
/// [`crate::at_rest`]) is never sent: `503` instead.
pub fn replay(stored: StoredResponse) -> Response {
    if let Some(key_id) = crate::at_rest::sealed_with(&stored) {
        // Every path opens a sealed answer before it gets here; this one was
        // not, and its bytes are no answer.
        tracing::error!(
            key_id,
            "idem: a sealed answer reached the replay unopened; refused"
        );
        return crate::problem::Problem::outcome_unreadable().into_response();
    }
    let mut resp = Response::new(Body::from(Bytes::clone(&stored.body)));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = resp.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(n, v);
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    resp
}
