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
    /// A header that must be stored has a value that is not UTF-8 text.
    #[error("the response header `{0}` is not UTF-8 text and cannot be stored")]
    BinaryHeader(String),
}

/// Buffers a response, keeping its parts so it can still be sent, and extracts the
/// stored form: status, the allow-listed headers and the body.
///
/// # Errors
///
/// [`CaptureError`] when the body is too large, fails, or an allow-listed header
/// holds bytes that are not UTF-8 text.
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
            // UTF-8, not only visible ASCII (`to_str`): `http` takes any byte
            // from 0x80 in a value (a `Location` of `/w/café`), and the replay
            // (`HeaderValue::from_str`) sends such text byte for byte.
            let text = std::str::from_utf8(value.as_bytes())
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header::LOCATION;

    fn with_location(value: HeaderValue) -> Response {
        let mut resp = Response::new(Body::from("made"));
        *resp.status_mut() = StatusCode::CREATED;
        resp.headers_mut().insert(LOCATION, value);
        resp
    }

    #[tokio::test]
    async fn a_utf8_header_value_is_stored_and_replayed_byte_for_byte() {
        let value = HeaderValue::from_bytes("/widgets/café".as_bytes()).unwrap();
        let (sent, stored) = capture(with_location(value.clone()), &[LOCATION], 1024)
            .await
            .expect("a UTF-8 Location is stored");
        assert_eq!(sent.headers()[LOCATION], value);
        assert_eq!(
            stored.headers,
            [("location".to_owned(), "/widgets/café".to_owned())]
        );
        let replayed = replay(stored);
        assert_eq!(replayed.headers()[LOCATION], value);
        assert_eq!(replayed.status(), StatusCode::CREATED);
    }

    #[tokio::test]
    async fn a_header_value_that_is_not_utf8_is_refused_by_name() {
        let value = HeaderValue::from_bytes(b"/widgets/caf\xe9").unwrap();
        let err = capture(with_location(value), &[LOCATION], 1024)
            .await
            .expect_err("Latin-1 is not stored");
        assert!(
            matches!(&err, CaptureError::BinaryHeader(name) if name == "location"),
            "{err}"
        );
    }
}
