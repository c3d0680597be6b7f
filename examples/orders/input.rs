//! Request input that is checked before idem claims anything: a rejected request
//! reserves no key, so the client can correct it and retry with the same key.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use idem_runtime::FingerprintBody;
use serde::Deserialize;
use serde::Serialize;
use serde::de::{DeserializeOwned, Deserializer, Error as _, Unexpected};

use crate::problems::ApiError;
use crate::server::BodyTimeout;

/// The body timeout when no [`BodyTimeout`] was set (the edges layer sets it).
const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Checks a deserialised body beyond its types.
pub trait Validate {
    fn validate(&self) -> Result<(), String>;
}

/// A JSON object body that parsed and validated; its rejections are
/// problem+json (400 for malformed JSON, 408 for a body that does not arrive in
/// time, 413 for one over the limit, 415 for another media type, 422 for the
/// wrong shape or values, a top-level array or scalar among them).
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
        if let Some(rejection) = not_an_object(&bytes) {
            return Err(rejection);
        }
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value = T::deserialize(&mut de)
            .and_then(|v| de.end().map(|()| v))
            .map_err(refused)?;
        value
            .validate()
            .map_err(|m| ApiError::invalid(StatusCode::UNPROCESSABLE_ENTITY, m))?;
        Ok(ValidJson(value))
    }
}

/// The rejection of a body that is not a JSON object, `None` for one that may be.
///
/// serde's derived structs also take a JSON array, field by field in order: on
/// its own, `[2241691]` would be a payment of 22,416.91 where the schema says
/// object. Malformed JSON stays a 400 whatever it starts with; an empty body is
/// left to the deserialiser, which calls it malformed.
fn not_an_object(bytes: &[u8]) -> Option<ApiError> {
    let first = bytes
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))?;
    if *first == b'{' {
        return None;
    }
    Some(
        match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
            Err(e) => refused(e),
            Ok(_) => ApiError::invalid(
                StatusCode::UNPROCESSABLE_ENTITY,
                "the body must be a JSON object",
            ),
        },
    )
}

/// A body serde_json refused: 422 for well-formed JSON of the wrong shape or
/// values, 400 for malformed JSON.
fn refused(e: serde_json::Error) -> ApiError {
    let status = if e.is_data() {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::BAD_REQUEST
    };
    ApiError::invalid(status, e.to_string())
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

/// An order's id in the path (`/orders/{id}`): a whole number that fits an
/// `i64`, as the document says (an `integer`; written `7` or, as for the
/// body's integers, `7.0`). Anything else is a `400` problem document of the
/// service's own type, like its other input errors (axum's is plain text).
pub struct OrderId(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for OrderId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // A segment that is not UTF-8 once percent-decoded: axum's status (400)
        // and words.
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::invalid(e.status(), e.body_text()))?;
        raw.parse::<i64>()
            .ok()
            .or_else(|| exact_whole(&raw))
            .map(OrderId)
            .ok_or_else(|| {
                ApiError::invalid(
                    StatusCode::BAD_REQUEST,
                    format!("the order id must be a whole number that fits 64 bits (signed), not `{raw}`"),
                )
            })
    }
}

/// `text`, a number as JSON writes one (a sign, digits, a fraction, an
/// exponent; in a path, a `+` in front too), as an `i64` when its value is
/// whole and fits. Decided on the digits, not on an `f64`, which rounds:
/// `9007199254740993.0` is not `9007199254740992`, and `1.0000000000000001`
/// has a fraction.
pub(crate) fn exact_whole(text: &str) -> Option<i64> {
    let (negative, rest) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty()
        || !digits_only(int)
        || !digits_only(frac)
        || (frac.is_empty() && mantissa.contains('.'))
    {
        return None;
    }
    // The value is `digits` times ten to the `shift`.
    let all = format!("{int}{frac}");
    let digits = all.trim_start_matches('0');
    if digits.is_empty() {
        return Some(0);
    }
    let shift = exponent.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let (whole, zeros) = if shift < 0 {
        let cut = usize::try_from(shift.unsigned_abs()).ok()?;
        // Past the first digit (not a zero): a fraction.
        let kept = digits.len().checked_sub(cut)?;
        let (whole, fraction) = digits.split_at(kept);
        if !fraction.bytes().all(|b| b == b'0') || whole.is_empty() {
            return None;
        }
        (whole, 0)
    } else {
        (digits, usize::try_from(shift).ok()?)
    };
    // `i64` has at most 19 digits.
    if whole.len() + zeros > 19 {
        return None;
    }
    let n = (0..zeros).fold(whole.parse::<i128>().ok()?, |n, _| n * 10);
    i64::try_from(if negative { -n } else { n }).ok()
}

/// Deserialises an integer field that JSON may spell either way: `5` or `5.0`.
/// JSON Schema's `integer` is a number with no fractional part, whatever its
/// spelling, and the document declares these fields so; serde's integers take
/// only the first spelling. A fraction (however small), or a value out of the
/// field's range, is still refused (`422`). Both spellings are the same
/// value, so the same request to idem (the fingerprint is of the parsed body).
/// The number is read as written ([`exact_whole`]), not through an `f64`.
pub fn whole<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i64>,
{
    let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
    let text = raw.get();
    let n = exact_whole(text).ok_or_else(|| {
        // serde's words for what came instead, as its integers' visitor says
        // them. The text is JSON (a `RawValue`): one that does not read as a
        // value is a number past a float's range.
        let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
            return D::Error::invalid_type(
                Unexpected::Other("a number out of range"),
                &"an integer",
            );
        };
        let unexpected = match &value {
            serde_json::Value::Number(n) => match (n.as_u64(), n.as_f64()) {
                (Some(u), _) => {
                    return D::Error::invalid_value(Unexpected::Unsigned(u), &"an integer");
                }
                (None, Some(f)) => Unexpected::Float(f),
                (None, None) => Unexpected::Other("a number"),
            },
            serde_json::Value::String(s) => Unexpected::Str(s),
            serde_json::Value::Bool(b) => Unexpected::Bool(*b),
            serde_json::Value::Null => Unexpected::Unit,
            serde_json::Value::Array(_) => Unexpected::Seq,
            serde_json::Value::Object(_) => Unexpected::Map,
        };
        D::Error::invalid_type(unexpected, &"an integer")
    })?;
    T::try_from(n).map_err(|_| {
        D::Error::invalid_value(Unexpected::Signed(n), &"an integer in the field's range")
    })
}
