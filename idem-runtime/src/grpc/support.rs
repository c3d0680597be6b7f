//! What the code `#[idempotent]` generates for a gRPC method calls. Not a
//! public API: names and signatures here change without notice.

use axum::extract::FromRef;
use axum::response::Response;
use tonic::Status;

pub use super::FromGrpcRequest;
pub use super::call::KeySource;
use crate::config::Idem;
use crate::fingerprint::{FingerprintBuilder, FingerprintError};
use crate::handler::{HandlerOutcome, IdemRequest, OperationSpec};
use crate::lease::LeaseBackend;

/// The service, owned: the method's body runs on a task of its own, which
/// cannot borrow `&self`.
pub fn service<S: Clone>(service: &S) -> S {
    service.clone()
}

/// The idempotency request of a call: the key (from `source`; `field` is the
/// key field's value when the key is a field of the message), the call's
/// gRPC path as its route, and its metadata when the operation fingerprints
/// some, with the service's [`Idem`].
///
/// # Errors
///
/// `INVALID_ARGUMENT` for a missing or malformed key.
#[allow(clippy::result_large_err)]
pub fn request<DB, const HEADERS: bool, S, M>(
    service: &S,
    call: &tonic::Request<M>,
    spec: &OperationSpec,
    source: KeySource,
    field: Option<&str>,
) -> Result<IdemRequest<DB, HEADERS>, Status>
where
    DB: LeaseBackend,
    Idem<DB>: FromRef<S>,
{
    let key = super::call::key(source, call.metadata(), field)?;
    let path = super::call::path(call.extensions(), spec.operation);
    let uri = axum::http::Uri::try_from(path.as_str())
        .unwrap_or_else(|_| axum::http::Uri::from_static("/"));
    Ok(IdemRequest::from_parts(
        Idem::from_ref(service),
        key,
        axum::http::Method::POST,
        uri,
        || call.metadata().clone().into_headers(),
    ))
}

/// A parameter read from the call (see [`FromGrpcRequest`]).
///
/// # Errors
///
/// The parameter's refusal.
#[allow(clippy::result_large_err)]
pub fn param<T: FromGrpcRequest, M>(call: &tonic::Request<M>) -> Result<T, Status> {
    T::from_grpc_request(call.metadata(), call.extensions())
}

/// Adds the whole message, in its canonical encoding.
///
/// # Errors
///
/// Never; the signature chains with the HTTP steps.
pub fn message<M: prost::Message>(
    fp: FingerprintBuilder,
    message: &M,
) -> Result<FingerprintBuilder, FingerprintError> {
    Ok(fp.raw_body(&message.encode_to_vec()))
}

/// Adds the whole message less its key field (left at its default while the
/// message is encoded, and put back).
///
/// # Errors
///
/// Never.
pub fn message_without<M, F>(
    fp: FingerprintBuilder,
    message: &mut M,
    key_field: F,
) -> Result<FingerprintBuilder, FingerprintError>
where
    M: prost::Message,
    F: for<'m> Fn(&'m mut M) -> &'m mut String,
{
    let key = std::mem::take(key_field(message));
    let encoded = message.encode_to_vec();
    *key_field(message) = key;
    Ok(fp.raw_body(&encoded))
}

/// A message holding only the fields `copy` copies from `message`, the rest at
/// their defaults: `fingerprint(body.a, body.b)`.
pub fn projection<M: prost::Message + Default>(message: &M, copy: impl FnOnce(&M, &mut M)) -> M {
    let mut p = M::default();
    copy(message, &mut p);
    p
}

/// The method's result as the pipeline settles it.
pub fn outcome<T: prost::Message>(result: Result<tonic::Response<T>, Status>) -> HandlerOutcome {
    super::answer::outcome(result)
}

/// The pipeline's answer as tonic sends it.
///
/// # Errors
///
/// The method's stored or returned status, or idem's own answer as a status.
pub async fn answer<T: prost::Message + Default>(
    response: Response,
) -> Result<tonic::Response<T>, Status> {
    super::answer::answer(response).await
}
