//! The request side of an idempotent gRPC method: what its parameters are read
//! from ([`FromGrpcRequest`]), and its key.

use axum::http::Extensions;
use tonic::Status;
use tonic::metadata::MetadataMap;

use super::{ERROR_DOMAIN, reason};
use crate::key::{IdempotencyKey, KeyError};

/// A parameter of an idempotent gRPC method other than the handle and the
/// request: read from the call's metadata and extensions before anything is
/// claimed, as an axum extractor reads a request's parts. The `#[tenant]`
/// parameter is one.
///
/// Implemented for `axum::Extension<T>`: the value an interceptor or a tower
/// layer inserted. For a tenant named by metadata, implement it for a type of
/// your own:
///
/// ```
/// use idem_runtime::grpc::FromGrpcRequest;
/// use idem_runtime::TenantScope;
///
/// struct Caller(String);
///
/// impl TenantScope for Caller {
///     fn tenant_id(&self) -> &str {
///         &self.0
///     }
/// }
///
/// impl FromGrpcRequest for Caller {
///     fn from_grpc_request(
///         metadata: &tonic::metadata::MetadataMap,
///         _: &axum::http::Extensions,
///     ) -> Result<Self, tonic::Status> {
///         metadata
///             .get("x-tenant-id")
///             .and_then(|v| v.to_str().ok())
///             .map(|t| Caller(t.to_owned()))
///             .ok_or_else(|| tonic::Status::unauthenticated("send x-tenant-id"))
///     }
/// }
/// ```
pub trait FromGrpcRequest: Sized {
    /// Reads the value, or refuses the call with the status to send.
    ///
    /// # Errors
    ///
    /// The status the call is answered with; nothing is claimed.
    fn from_grpc_request(metadata: &MetadataMap, extensions: &Extensions) -> Result<Self, Status>;
}

impl<T: Clone + Send + Sync + 'static> FromGrpcRequest for axum::Extension<T> {
    /// The value an interceptor or a tower layer inserted; `INTERNAL` without
    /// one (the service is wired wrong, not the call).
    fn from_grpc_request(_: &MetadataMap, extensions: &Extensions) -> Result<Self, Status> {
        extensions.get::<T>().cloned().map(axum::Extension).ok_or_else(|| {
            tracing::error!(
                extension = std::any::type_name::<T>(),
                "idem: a gRPC method's parameter is missing from the request's extensions"
            );
            Status::internal(format!(
                "the service has no `{}` for this call: an interceptor or tower layer must insert it",
                std::any::type_name::<T>()
            ))
        })
    }
}

/// Where a method's key comes from, as the status that refuses it names it.
#[derive(Debug, Clone, Copy)]
pub enum KeySource {
    /// The `idempotency-key` metadata entry.
    Metadata,
    /// A string field of the request message.
    Field(&'static str),
}

/// The key read from the call, or `INVALID_ARGUMENT` with `ErrorInfo` and a
/// `BadRequest` field violation.
pub(crate) fn key(
    source: KeySource,
    metadata: &MetadataMap,
    field: Option<&str>,
) -> Result<IdempotencyKey, Status> {
    let read = match (source, field) {
        (KeySource::Field(_), Some("")) => Err(KeyError::Missing),
        (KeySource::Field(name), Some(value)) => {
            let key = IdempotencyKey::parse(value).map_err(|e| refused(source, &e))?;
            // A field's key is taken as written: the header's spellings (white
            // space around it, a quoted string) would make ` abc` and `"abc"`
            // the key `abc` of another request, whose answer it would replay.
            if key.as_str() != value {
                return Err(as_written(name));
            }
            Ok(key)
        }
        _ => IdempotencyKey::from_headers(metadata.as_ref()),
    };
    read.map_err(|e| refused(source, &e))
}

/// A field key that is not its own spelling.
fn as_written(name: &str) -> Status {
    let message = format!(
        "the `{name}` field is not a usable idempotency key: a key in a field is taken as written, without surrounding spaces or quotes"
    );
    invalid_key(name, message, reason::KEY_MALFORMED)
}

/// `INVALID_ARGUMENT` for the key in `name`: `ErrorInfo` with `why`, and a
/// `BadRequest` violation of the entry or field.
fn invalid_key(name: &str, message: String, why: &str) -> Status {
    let mut details = tonic_types::ErrorDetails::new();
    details.set_error_info(why, ERROR_DOMAIN, std::collections::HashMap::new());
    details.add_bad_request_violation(name, message.clone());
    <Status as tonic_types::StatusExt>::with_error_details(
        tonic::Code::InvalidArgument,
        message,
        details,
    )
}

fn refused(source: KeySource, e: &KeyError) -> Status {
    let (name, why) = match source {
        KeySource::Metadata => (super::KEY_METADATA.to_owned(), "metadata entry"),
        KeySource::Field(f) => (f.to_owned(), "field"),
    };
    let (message, reason) = if e.is_missing() {
        (
            format!(
                "this method needs an idempotency key in the `{name}` {why}: send a unique value, and the same value again when you retry"
            ),
            reason::KEY_MISSING,
        )
    } else {
        // The rule as the HTTP header's refusal words it, said of the key; a
        // comma's advice depends on the source: metadata can quote a key (as a
        // header can), a field's key is taken as written and cannot hold one.
        let (bare, advice) = match (e, source) {
            (KeyError::Comma { .. }, KeySource::Metadata) => (
                "bare ",
                ", as two entries joined would; send a key with a comma as a structured-field \
                 string (\"a,b\")",
            ),
            (KeyError::Comma { .. }, KeySource::Field(_)) => {
                ("", "; a key in a field cannot hold one")
            }
            _ => ("", ""),
        };
        (
            format!(
                "the `{name}` {why} is not a usable idempotency key: the {bare}key {}{advice}",
                e.rule()
            ),
            reason::KEY_MALFORMED,
        )
    };
    invalid_key(&name, message, reason)
}

/// The route the fingerprint names: the method's own name, which the
/// expansion passes, so that two methods sharing an operation's name are never
/// one request. Never the gRPC path a layer may record (`tonic::GrpcMethod`:
/// tonic's clients do, its servers do not): a layer added or removed in a
/// deploy would change every fingerprint, and each retry of a key in its
/// retention would be refused as another request's.
pub(crate) fn path(method: &str) -> String {
    format!("/{method}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_read_from_metadata_or_a_field_and_refused_with_its_name() {
        let mut metadata = MetadataMap::new();
        let missing = key(KeySource::Metadata, &metadata, None).unwrap_err();
        assert_eq!(missing.code(), tonic::Code::InvalidArgument);
        assert!(
            missing.message().contains("idempotency-key"),
            "{}",
            missing.message()
        );
        metadata.insert("idempotency-key", "k-1".parse().unwrap());
        assert_eq!(
            key(KeySource::Metadata, &metadata, None).unwrap().as_str(),
            "k-1"
        );

        let field = KeySource::Field("request_id");
        let empty = key(field, &metadata, Some("")).unwrap_err();
        assert!(
            empty.message().contains("`request_id` field"),
            "{}",
            empty.message()
        );
        let long = "x".repeat(300);
        let bad = key(field, &metadata, Some(&long)).unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        assert!(bad.message().contains("not a usable"), "{}", bad.message());
        let spaced = key(field, &metadata, Some("a b")).unwrap_err();
        assert!(
            spaced.message().contains("visible ASCII"),
            "{}",
            spaced.message()
        );
        assert_eq!(
            key(field, &metadata, Some("7f0c2d3e-uuid"))
                .unwrap()
                .as_str(),
            "7f0c2d3e-uuid"
        );
    }

    /// Each refusal says the header's rule of the key, in the words
    /// [`KeyError::rule`] keeps for both transports, and never names the HTTP
    /// header, which a gRPC caller does not send.
    #[test]
    fn a_refusal_says_the_rule_of_the_key_without_the_header() {
        let field = KeySource::Field("request_id");
        for (e, said) in [
            (KeyError::Repeated, "the key appears more than once"),
            (KeyError::Empty, "the key is empty"),
            (
                KeyError::TooLong { len: 300 },
                "the key is 300 characters long; at most 255 are allowed",
            ),
            (
                KeyError::NotPrintableAscii { position: 0 },
                "the key holds a character outside visible ASCII",
            ),
            (
                KeyError::Comma { position: 1 },
                "the key holds a comma at position 1; a key in a field cannot hold one",
            ),
            (
                KeyError::MalformedStructuredString,
                "the key starts with '\"' but is not a valid structured-field string",
            ),
        ] {
            let status = refused(field, &e);
            let message = status.message();
            assert!(
                message.starts_with("the `request_id` field is not a usable idempotency key: "),
                "{message}"
            );
            assert!(message.contains(said), "{message}");
            assert!(message.contains(&e.rule()), "{message}");
            assert!(!message.contains("Idempotency-Key"), "{message}");
            assert!(e.to_string().contains(&e.rule()), "{e}");
        }
        // In metadata a key with a comma can be quoted, as in a header.
        let comma = refused(KeySource::Metadata, &KeyError::Comma { position: 1 });
        assert_eq!(
            comma.message(),
            "the `idempotency-key` metadata entry is not a usable idempotency key: the bare key \
             holds a comma at position 1, as two entries joined would; send a key with a comma \
             as a structured-field string (\"a,b\")"
        );
    }
}
