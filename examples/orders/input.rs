//! Request input that is checked before idem claims anything: a rejected request
//! reserves no key, so the client can correct it and retry with the same key.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use idem_runtime::FingerprintBody;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::problems::ApiError;
use crate::server::BodyTimeout;

/// The body timeout when no [`BodyTimeout`] was set (the edges layer sets it).
const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Checks a deserialised body beyond its types.
pub trait Validate {
    fn validate(&self) -> Result<(), String>;
}

/// A JSON body that parsed and validated; its rejections are problem+json
/// (400 for malformed JSON, 408 for a body that does not arrive in time, 413 for
/// one over the limit, 415 for another media type, 422 for the wrong shape or
/// values).
pub struct ValidJson<T>(pub T);

/// Whether a `Content-Type` value is `application/json`: the media type's type
/// and subtype compared without regard to case, parameters (`charset=utf-8`)
/// allowed and ignored (JSON is UTF-8). `application/jsonfoo` is another type.
pub fn is_json(content_type: &[u8]) -> bool {
    let Ok(value) = std::str::from_utf8(content_type) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
}

impl<S, T> FromRequest<S> for ValidJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Validate,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !req
            .headers()
            .get("content-type")
            .is_some_and(|v| is_json(v.as_bytes()))
        {
            return Err(ApiError::invalid(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send `Content-Type: application/json`",
            ));
        }
        let wait = req
            .extensions()
            .get::<BodyTimeout>()
            .map_or(DEFAULT_BODY_TIMEOUT, |t| t.0);
        let bytes = tokio::time::timeout(wait, axum::body::Bytes::from_request(req, state))
            .await
            .map_err(|_| {
                ApiError::invalid(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("the request body did not arrive within {wait:?}"),
                )
            })?
            // The rejection's own status: 413 past the body limit, 400 otherwise.
            .map_err(|e| ApiError::invalid(e.status(), e.body_text()))?;
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value = T::deserialize(&mut de)
            .and_then(|v| de.end().map(|()| v))
            .map_err(|e| {
                let status = if e.is_data() {
                    StatusCode::UNPROCESSABLE_ENTITY
                } else {
                    StatusCode::BAD_REQUEST
                };
                ApiError::invalid(status, e.to_string())
            })?;
        value
            .validate()
            .map_err(|m| ApiError::invalid(StatusCode::UNPROCESSABLE_ENTITY, m))?;
        Ok(ValidJson(value))
    }
}

impl<T: Serialize> FingerprintBody for ValidJson<T> {
    type Value = T;
    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

/// The required `X-Currency` header: three upper-case letters.
pub struct Currency(pub String);

impl<S: Send + Sync> FromRequestParts<S> for Currency {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let value = parts.headers.get("x-currency").ok_or_else(|| {
            ApiError::invalid(StatusCode::BAD_REQUEST, "the X-Currency header is required")
        })?;
        match value.to_str() {
            Ok(c) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => {
                Ok(Currency(c.to_owned()))
            }
            _ => Err(ApiError::invalid(
                StatusCode::BAD_REQUEST,
                "X-Currency must be three upper-case letters, such as EUR",
            )),
        }
    }
}
