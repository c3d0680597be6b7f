//! Request input that is checked before idem claims anything: a rejected request
//! reserves no key, so the client can correct it and retry with the same key.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use idem_runtime::FingerprintBody;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::problems::ApiError;

/// Checks a deserialised body beyond its types.
pub trait Validate {
    fn validate(&self) -> Result<(), String>;
}

/// A JSON body that parsed and validated; its rejections are problem+json
/// (400 for malformed JSON, 415 for another media type, 422 for the wrong shape
/// or values).
pub struct ValidJson<T>(pub T);

impl<S, T> FromRequest<S> for ValidJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Validate,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let is_json = req
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if !is_json {
            return Err(ApiError::invalid(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send `Content-Type: application/json`",
            ));
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::invalid(StatusCode::BAD_REQUEST, e.body_text()))?;
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
