//! A method's result as the pipeline stores it, and the pipeline's answer as
//! tonic sends it.
//!
//! The pipeline speaks HTTP responses (the stores keep a status, headers and a
//! body), so a gRPC result travels as one: a message is `200` with its prost
//! encoding as the body; a status is its HTTP code with a small JSON body
//! (code, message, the binary details). Both are told apart from idem's own
//! answers (problem documents) by their content type, and turned back into a
//! message or a status on the way out.

use std::time::Duration;

use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use http_body_util::BodyExt as _;
use serde::{Deserialize, Serialize};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, PreconditionViolation, StatusExt as _};

use super::{ERROR_DOMAIN, REPLAYED_METADATA, is_stored, reason};
use crate::handler::{EffectUnknown, HandlerOutcome};
use crate::lease::Uncertain;
use crate::model::StoredResponse;
use crate::problem;
use crate::response::REPLAYED_HEADER;

/// The content type of a stored message: its prost encoding.
const MESSAGE_TYPE: &str = "application/grpc+proto";
/// The content type of a stored status: [`StoredStatus`] as JSON.
const STATUS_TYPE: &str = "application/vnd.idem.grpc-status+json";
/// The status metadata entry [`uncertain`] sets.
const UNCERTAIN_METADATA: &str = "x-idem-uncertain";

/// A status as it is stored.
#[derive(Serialize, Deserialize)]
struct StoredStatus {
    code: i32,
    message: String,
    /// `grpc-status-details-bin`: a `google.rpc.Status`, base64.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    details: String,
}

/// What a leased method returns when it cannot know whether its effect
/// happened (the provider timed out after it may have charged): the key's
/// outcome becomes uncertain, retries get `ABORTED` with
/// [`reason::OUTCOME_UNCERTAIN`] and `RetryInfo` until a reconciler settles it,
/// and the method never runs again for it meanwhile. As [`crate::Uncertain`]
/// for an HTTP handler. In the transactional mode, where the effect is in the
/// transaction, it is the `UNKNOWN` status it is: rolled back, and sent as is.
///
/// ```
/// let status = idem_runtime::grpc::uncertain("the payment provider timed out");
/// assert_eq!(status.code(), tonic::Code::Unknown);
/// ```
pub fn uncertain(detail: impl Into<String>) -> Status {
    let mut status = Status::unknown(detail);
    status
        .metadata_mut()
        .insert(UNCERTAIN_METADATA, MetadataValue::from_static("1"));
    status
}

/// The HTTP status a gRPC code corresponds to (gRPC's own mapping, with `499`
/// for `CANCELLED`): what a stored status is kept as, and what `idem show`
/// prints.
pub fn http_status(code: Code) -> StatusCode {
    let n = match code {
        Code::Ok => 200,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
        Code::Unauthenticated => 401,
        Code::PermissionDenied => 403,
        Code::NotFound => 404,
        Code::AlreadyExists | Code::Aborted => 409,
        Code::ResourceExhausted => 429,
        Code::Cancelled => 499,
        Code::Unimplemented => 501,
        Code::Unavailable => 503,
        Code::DeadlineExceeded => 504,
        Code::Unknown | Code::Internal | Code::DataLoss => 500,
    };
    StatusCode::from_u16(n).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A message as a store keeps it: for a reconciler's
/// `Resolution::Completed`, so that replays answer it as the method's message.
///
/// ```
/// # #[derive(Clone, PartialEq, prost::Message)]
/// # struct Payment { #[prost(string, tag = "1")] charge_id: String }
/// let stored = idem_runtime::grpc::stored_message(&Payment { charge_id: "ch_1".into() });
/// assert_eq!(stored.status, 200);
/// ```
pub fn stored_message<M: prost::Message>(message: &M) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![(CONTENT_TYPE.as_str().to_owned(), MESSAGE_TYPE.to_owned())],
        body: message.encode_to_vec().into(),
    }
}

/// A status as a store keeps it (a decision, [`is_stored`]): for a
/// reconciler's `Resolution::Completed` when the effect was refused, say.
pub fn stored_status(status: &Status) -> StoredResponse {
    StoredResponse {
        status: http_status(status.code()).as_u16(),
        headers: vec![(CONTENT_TYPE.as_str().to_owned(), STATUS_TYPE.to_owned())],
        body: status_json(status).into(),
    }
}

/// Whether a gRPC status a reconciler resolved with may be stored: `None` for
/// an answer that is not a status ([`stored_status`]'s content type); else
/// whether [`is_stored`] keeps its code (a body that is not a status cannot be
/// replayed, and is not kept either). A live method's `ABORTED` rolls back; a
/// reconciler's must not be replayed for the whole retention instead.
pub(crate) fn status_kept(stored: &StoredResponse) -> Option<bool> {
    let is_status = stored
        .headers
        .iter()
        .any(|(name, value)| name.eq_ignore_ascii_case("content-type") && value == STATUS_TYPE);
    if !is_status {
        return None;
    }
    Some(
        serde_json::from_slice::<StoredStatus>(&stored.body)
            .is_ok_and(|s| is_stored(Code::from(s.code))),
    )
}

/// A status's stored body: [`StoredStatus`] as JSON.
fn status_json(status: &Status) -> Vec<u8> {
    let stored = StoredStatus {
        code: status.code() as i32,
        message: status.message().to_owned(),
        details: if status.details().is_empty() {
            String::new()
        } else {
            base64::engine::general_purpose::STANDARD.encode(status.details())
        },
    };
    serde_json::to_vec(&stored).unwrap_or_default()
}

/// A method's result as the pipeline settles it: a message and the statuses
/// [`is_stored`] names are stored; the others roll back (or release the lease,
/// or lapse it where the execution took the key over);
/// in leased mode, an [`uncertain`] status marks the outcome uncertain.
pub(crate) fn outcome<T: prost::Message>(
    result: Result<tonic::Response<T>, Status>,
    leased: bool,
) -> HandlerOutcome {
    match result {
        Ok(response) => HandlerOutcome::ok(
            (
                [(CONTENT_TYPE, HeaderValue::from_static(MESSAGE_TYPE))],
                response.get_ref().encode_to_vec(),
            )
                .into_response(),
        ),
        // Leased mode marks the key uncertain by the response's marker.
        Err(status) if leased && status.metadata().contains_key(UNCERTAIN_METADATA) => {
            HandlerOutcome::ok(Uncertain::new(status.message()).into_response())
        }
        Err(status) => {
            let response = (
                http_status(status.code()),
                [(CONTENT_TYPE, HeaderValue::from_static(STATUS_TYPE))],
                status_json(&status),
            )
                .into_response();
            if is_stored(status.code()) {
                HandlerOutcome::ok(response)
            } else {
                let mut response = response;
                if matches!(
                    status.code(),
                    Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
                ) {
                    response.extensions_mut().insert(EffectUnknown);
                }
                HandlerOutcome::err(response)
            }
        }
    }
}

/// What idem's problem documents hold that a status needs.
#[derive(Deserialize)]
struct ProblemBody {
    #[serde(rename = "type")]
    type_uri: String,
    title: String,
    #[serde(default)]
    detail: Option<String>,
}

/// The pipeline's answer as tonic sends it: the method's message or status
/// (fresh or replayed, a replay marked with [`REPLAYED_METADATA`]), or idem's
/// own answer as the status docs/grpc.md names.
pub(crate) async fn answer<T: prost::Message + Default>(
    response: Response,
) -> Result<tonic::Response<T>, Status> {
    let (parts, body) = response.into_parts();
    let replayed = parts.headers.contains_key(REPLAYED_HEADER);
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let retry_after = parts
        .headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs);
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Err(fault(format!("the answer could not be read: {e}"))),
    };
    let mark = |metadata: &mut tonic::metadata::MetadataMap| {
        if replayed {
            metadata.insert(REPLAYED_METADATA, MetadataValue::from_static("true"));
        }
    };
    match content_type.as_str() {
        MESSAGE_TYPE => {
            let message = T::decode(bytes).map_err(|e| {
                unreadable(format!("it is not this method's message: {e}"), retry_after)
            })?;
            let mut response = tonic::Response::new(message);
            mark(response.metadata_mut());
            Ok(response)
        }
        STATUS_TYPE => {
            let stored: StoredStatus = serde_json::from_slice(&bytes)
                .map_err(|e| unreadable(format!("a stored status: {e}"), retry_after))?;
            let details = base64::engine::general_purpose::STANDARD
                .decode(stored.details.as_bytes())
                .unwrap_or_default();
            let mut status =
                Status::with_details(Code::from(stored.code), stored.message, details.into());
            mark(status.metadata_mut());
            Err(status)
        }
        // idem's own answer, live. A stored one (a reconciler's answer in
        // HTTP's form) is no gRPC answer, and must not pass for idem's: an
        // `in-flight` kept for the whole retention, say.
        problem::CONTENT_TYPE if !replayed => Err(from_problem(parts.status, &bytes, retry_after)),
        _ => Err(unreadable(
            format!(
                "an answer that is not gRPC's (HTTP {}, {content_type:?})",
                parts.status
            ),
            retry_after,
        )),
    }
}

/// An answer stored for the key (or just committed) that cannot be sent as the
/// method's: one a reconciler stored for another method or as HTTP, one from
/// before a change of the message. Not `INTERNAL` "nothing stored", which is
/// false (the effect is there) and which clients take as final, sending again
/// under a new key: `UNAVAILABLE`, as HTTP's `503` for an outcome idem cannot
/// read, retried under the same key.
fn unreadable(why: String, retry_after: Option<Duration>) -> Status {
    tracing::error!(why = %why, "idem: a stored gRPC answer cannot be sent as the method's");
    with_info(
        Code::Unavailable,
        format!("{} ({why})", problem::OUTCOME_UNREADABLE),
        reason::STORE_UNAVAILABLE,
        Some(retry_after.unwrap_or(Duration::from_secs(1))),
    )
}

/// An `INTERNAL` status of idem's own.
fn fault(message: impl Into<String>) -> Status {
    with_info(Code::Internal, message.into(), reason::SERVICE_FAULT, None)
}

/// A status with `ErrorInfo` (reason, idem's domain) and, when given, a
/// `RetryInfo` wait.
fn with_info(code: Code, message: String, why: &str, retry: Option<Duration>) -> Status {
    let mut details = ErrorDetails::new();
    details.set_error_info(why, ERROR_DOMAIN, std::collections::HashMap::new());
    if let Some(wait) = retry {
        details.set_retry_info(Some(wait));
    }
    Status::with_error_details(code, message, details)
}

/// idem's own answer (a problem document) as a status: docs/grpc.md's table.
fn from_problem(http: StatusCode, bytes: &[u8], retry_after: Option<Duration>) -> Status {
    let Ok(p) = serde_json::from_slice::<ProblemBody>(bytes) else {
        return fault(format!("an unreadable answer (HTTP {http})"));
    };
    let message = match &p.detail {
        Some(detail) => format!("{}: {detail}", p.title),
        None => p.title.clone(),
    };
    // Every answer that asks for a retry says when.
    let wait = Some(retry_after.unwrap_or(Duration::from_secs(1)));
    match p.type_uri.as_str() {
        problem::MISSING_KEY => {
            with_info(Code::InvalidArgument, message, reason::KEY_MISSING, None)
        }
        problem::MALFORMED_KEY => {
            with_info(Code::InvalidArgument, message, reason::KEY_MALFORMED, None)
        }
        problem::FINGERPRINT_MISMATCH => {
            let mut details = ErrorDetails::new();
            details.set_error_info(
                reason::KEY_REUSED,
                ERROR_DOMAIN,
                std::collections::HashMap::new(),
            );
            details.set_precondition_failure(vec![PreconditionViolation::new(
                "IDEMPOTENCY_KEY",
                "idempotency key",
                "the key was first used with another request: send a new key for a new request",
            )]);
            Status::with_error_details(Code::FailedPrecondition, message, details)
        }
        problem::IN_FLIGHT => with_info(Code::Aborted, message, reason::IN_FLIGHT, wait),
        problem::OUTCOME_UNCERTAIN => {
            with_info(Code::Aborted, message, reason::OUTCOME_UNCERTAIN, wait)
        }
        problem::STORE_UNAVAILABLE | problem::STORE_BUSY | problem::AT_CAPACITY => {
            with_info(Code::Unavailable, message, reason::STORE_UNAVAILABLE, wait)
        }
        // Not `INTERNAL`, which clients take as final and may send again under
        // a new key: a leased method that panicked may have called downstream,
        // and only the same key finds that out. `UNKNOWN` is the code of an
        // outcome the client cannot know, retried under the key.
        problem::HANDLER_PANICKED => {
            with_info(Code::Unknown, message, reason::HANDLER_PANICKED, wait)
        }
        _ if http.is_server_error() => {
            with_info(Code::Internal, message, reason::SERVICE_FAULT, None)
        }
        _ => fault(format!("an answer idem cannot send over gRPC: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message of two fields, by hand (no build script in the runtime).
    #[derive(Clone, PartialEq, prost::Message)]
    struct Order {
        #[prost(int64, tag = "1")]
        id: i64,
        #[prost(string, tag = "2")]
        sku: String,
    }

    /// The codes a downstream call's failure passed up with `?` carries when
    /// the call may have done its work leave the effect unknown (leased mode
    /// lapses the lease rather than give the key back); the others do not.
    #[test]
    fn a_timeout_unknown_or_cancelled_status_leaves_the_effect_unknown() {
        for code in [Code::DeadlineExceeded, Code::Unknown, Code::Cancelled] {
            let out = outcome::<Order>(Err(Status::new(code, "downstream")), true);
            assert!(out.rolls_back() && out.effect_unknown(), "{code:?}");
        }
        for code in [
            Code::Unavailable,
            Code::Internal,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::NotFound,
        ] {
            let out = outcome::<Order>(Err(Status::new(code, "downstream")), true);
            assert!(!out.effect_unknown(), "{code:?}");
        }
    }

    fn replayed(mut r: Response) -> Response {
        r.headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        r
    }

    #[tokio::test]
    async fn a_message_goes_through_the_store_and_comes_back_marked_on_replay() {
        let order = Order {
            id: 7,
            sku: "book".into(),
        };
        let out = outcome(Ok(tonic::Response::new(order.clone())), false);
        assert!(!out.is_err);
        let fresh = answer::<Order>(out.response).await.unwrap();
        assert_eq!(fresh.get_ref(), &order);
        assert!(fresh.metadata().get(REPLAYED_METADATA).is_none());
        let again = outcome(Ok(tonic::Response::new(order.clone())), false);
        let replay = answer::<Order>(replayed(again.response)).await.unwrap();
        assert_eq!(replay.get_ref(), &order);
        assert_eq!(replay.metadata().get(REPLAYED_METADATA).unwrap(), "true");
    }

    #[tokio::test]
    async fn statuses_are_stored_or_rolled_back_by_the_table_and_keep_their_details() {
        let mut details = ErrorDetails::new();
        details.set_error_info("NO_STOCK", "orders", std::collections::HashMap::new());
        let status = Status::with_error_details(Code::FailedPrecondition, "no stock", details);
        let out = outcome::<Order>(Err(status), false);
        assert!(!out.is_err, "FAILED_PRECONDITION is a decision: stored");
        assert_eq!(out.response.status(), 400);
        let back = answer::<Order>(replayed(out.response)).await.unwrap_err();
        assert_eq!(back.code(), Code::FailedPrecondition);
        assert_eq!(back.message(), "no stock");
        assert_eq!(back.get_details_error_info().unwrap().reason, "NO_STOCK");
        assert_eq!(back.metadata().get(REPLAYED_METADATA).unwrap(), "true");
        for code in [
            Code::Unavailable,
            Code::Internal,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ] {
            assert!(
                outcome::<Order>(Err(Status::new(code, "x")), false).is_err,
                "{code:?}"
            );
        }
        for code in [Code::NotFound, Code::AlreadyExists, Code::PermissionDenied] {
            assert!(
                !outcome::<Order>(Err(Status::new(code, "x")), true).is_err,
                "{code:?}"
            );
        }
    }

    /// What a reconciler stores replays as the method's message or status.
    #[tokio::test]
    async fn a_reconcilers_stored_answer_replays_as_the_message_or_status() {
        let order = Order {
            id: 9,
            sku: "pen".into(),
        };
        let replay = crate::response::replay(stored_message(&order));
        let back = answer::<Order>(replay).await.unwrap();
        assert_eq!(back.get_ref(), &order);
        assert_eq!(back.metadata().get(REPLAYED_METADATA).unwrap(), "true");
        let refused = Status::failed_precondition("declined");
        let replay = crate::response::replay(stored_status(&refused));
        let back = answer::<Order>(replay).await.unwrap_err();
        assert_eq!(back.code(), Code::FailedPrecondition);
        assert_eq!(back.message(), "declined");
    }

    #[test]
    fn a_reconcilers_status_is_kept_only_where_a_methods_would_be() {
        assert_eq!(
            status_kept(&stored_status(&Status::aborted("conflict"))),
            Some(false)
        );
        assert_eq!(
            status_kept(&stored_status(&Status::resource_exhausted("quota"))),
            Some(false)
        );
        assert_eq!(
            status_kept(&stored_status(&Status::failed_precondition("declined"))),
            Some(true)
        );
        assert_eq!(
            status_kept(&stored_status(&Status::not_found("gone"))),
            Some(true)
        );
        let order = Order {
            id: 1,
            sku: "pen".into(),
        };
        assert_eq!(status_kept(&stored_message(&order)), None);
        let mut spoiled = stored_status(&Status::not_found("gone"));
        spoiled.body = bytes::Bytes::from_static(b"not json");
        assert_eq!(status_kept(&spoiled), Some(false));
    }

    /// A stored answer that cannot be sent as the method's (another method's
    /// message, a status that is not JSON, an HTTP answer a reconciler stored)
    /// is an outcome that could not be read, retried under the same key: never
    /// `INTERNAL` "nothing stored", after which a client may pay again under a
    /// new key.
    #[tokio::test]
    async fn a_stored_answer_that_cannot_be_sent_is_unreadable_not_nothing_stored() {
        let stored = |content_type: &str, body: &[u8]| {
            crate::response::replay(StoredResponse {
                status: 200,
                headers: vec![("content-type".into(), content_type.into())],
                body: bytes::Bytes::copy_from_slice(body),
            })
        };
        // Field 1 of `Order` is an int64: a length-delimited field 1 is not it.
        for replay in [
            stored(MESSAGE_TYPE, &[0x0a, 1, b'x']),
            stored(STATUS_TYPE, b"not json"),
            stored("application/json", br#"{"id":9}"#),
            // A reconciler's answer in HTTP's form, of idem's types or not.
            stored(
                problem::CONTENT_TYPE,
                br#"{"type":"urn:idem:problem:in-flight","title":"In flight","status":409}"#,
            ),
            stored(
                problem::CONTENT_TYPE,
                br#"{"type":"https://shop.example/declined","title":"Declined","status":402}"#,
            ),
        ] {
            let status = answer::<Order>(replay).await.unwrap_err();
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            assert_eq!(
                status.get_details_error_info().unwrap().reason,
                reason::STORE_UNAVAILABLE
            );
            assert!(
                status.message().contains("same key"),
                "{}",
                status.message()
            );
            assert!(status.get_details_retry_info().is_some());
        }
    }

    #[tokio::test]
    async fn an_uncertain_status_marks_leased_outcomes_and_is_unknown_otherwise() {
        let leased = outcome::<Order>(Err(uncertain("timed out")), true);
        assert!(!leased.is_err);
        assert!(
            leased
                .response
                .extensions()
                .get::<crate::lease::UncertainMarker>()
                .is_some()
        );
        let transactional = outcome::<Order>(Err(uncertain("timed out")), false);
        assert!(transactional.is_err, "rolled back");
        let sent = answer::<Order>(transactional.response).await.unwrap_err();
        assert_eq!(sent.code(), Code::Unknown);
        assert_eq!(sent.message(), "timed out");
    }

    #[tokio::test]
    async fn idems_answers_become_the_codes_the_docs_name() {
        let cases = [
            (problem::Problem::mismatch(), Code::FailedPrecondition, None),
            (
                problem::Problem::in_flight(Duration::from_secs(2)),
                Code::Aborted,
                Some(2),
            ),
            (
                problem::Problem::uncertain(Duration::from_secs(5)),
                Code::Aborted,
                Some(5),
            ),
            (
                problem::Problem::store_unavailable(),
                Code::Unavailable,
                Some(1),
            ),
            (problem::Problem::missing_key(), Code::InvalidArgument, None),
            (
                problem::Problem::new(
                    problem::HANDLER_PANICKED,
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "The handler failed",
                ),
                Code::Unknown,
                Some(1),
            ),
        ];
        for (p, code, retry) in cases {
            let status = answer::<Order>(p.into_response()).await.unwrap_err();
            assert_eq!(status.code(), code);
            assert_eq!(
                status
                    .get_details_retry_info()
                    .and_then(|r| r.retry_delay)
                    .map(|d| d.as_secs()),
                retry,
                "{code:?}"
            );
            assert_eq!(
                status.get_details_error_info().unwrap().domain,
                ERROR_DOMAIN
            );
        }
        let reused = answer::<Order>(problem::Problem::mismatch().into_response())
            .await
            .unwrap_err();
        assert_eq!(
            reused
                .get_details_precondition_failure()
                .unwrap()
                .violations[0]
                .r#type,
            "IDEMPOTENCY_KEY"
        );
    }
}
