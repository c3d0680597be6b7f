//! Following a long operation: which `202 Accepted` to follow, what the
//! operation's resource says to do next, and which of the request's headers go
//! with the `GET`s.
//!
//! The wire is idem's (`idem_runtime::operations`): the `202` names the
//! resource in `Location`; `GET` on it answers a document
//! `{"status": "running" | "stalled" | "succeeded" | "failed" | "uncertain",
//! "result"?: ..., "retry_after"?: ...}`; `result`, once done, replays the
//! stored answer. Nothing here is specific to idem beyond that shape, so a
//! server with the same resources is followed the same way.

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderName, LOCATION};
use reqwest::{StatusCode, Url};

use crate::IDEMPOTENCY_KEY;
use crate::decide::{problem_type, retry_after};

/// The resource of a long operation, when `status` and `headers` are a `202
/// Accepted` that names one in `Location`, resolved against `url` (the
/// answer's, after any redirect). Only a resource of the origin the caller
/// sent the request to (`requested`) is followed: the `GET`s carry the
/// request's credentials, which another origin must not get, and which the
/// HTTP client itself took off a redirect that left that origin.
pub(crate) fn operation_of(
    status: StatusCode,
    headers: &HeaderMap,
    url: &Url,
    requested: &Url,
) -> Option<Url> {
    if status != StatusCode::ACCEPTED {
        return None;
    }
    let location = headers.get(LOCATION)?.to_str().ok()?.trim();
    let resource = url.join(location).ok()?;
    (same_origin(url, &resource) && same_origin(requested, &resource)).then_some(resource)
}

fn same_origin(a: &Url, b: &Url) -> bool {
    // Opaque origins (not http, https...) never compare equal, so are never
    // followed.
    a.origin() == b.origin()
}

/// What to do after an answer about a long operation, the resource's or its
/// result's. Only answers [`judge`](crate::decide::judge) leaves final come
/// here: a `5xx`, a `409` in flight, a lost answer are asked again by the
/// retry rules before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Poll {
    /// The work goes on (`running`, `uncertain`, or a state this client does
    /// not know): ask the resource again, not before `retry_after`.
    Again {
        /// What the document said.
        state: String,
        retry_after: Option<Duration>,
    },
    /// Done: `GET` the stored answer here.
    Result(Url),
    /// Send the original request again with the same key: the work `stalled`
    /// (a resend takes it over), or the resource is gone (the work failed and
    /// released its key, so a resend runs it again, as after a `5xx`), or it is
    /// done with no `result` to read (a resend replays the stored answer).
    Resend {
        /// What the document said, if there was one.
        state: Option<String>,
        retry_after: Option<Duration>,
    },
    /// Not an answer about the operation (a `401`, another `404`, a `2xx` that
    /// is no document): to a poll, the end of following ([`crate::PollRefused`]);
    /// to the result's `GET`, the answer.
    Final,
}

/// What an answer of the operation's resource (`url`) says to do next.
pub(crate) fn judge_poll(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    url: &Url,
    now: SystemTime,
) -> Poll {
    if gone(status, headers, body) {
        return Poll::Resend {
            state: None,
            retry_after: retry_after(headers, now),
        };
    }
    if !status.is_success() {
        return Poll::Final;
    }
    let Some(doc) = Document::read(body) else {
        return Poll::Final;
    };
    let retry_after = retry_after(headers, now).or(doc.retry_after.map(Duration::from_secs));
    // A `result` means done, whatever the state is called: a state added later
    // that is done still carries one.
    if let Some(result) = doc.result {
        return match url.join(&result) {
            Ok(result) if same_origin(url, &result) => Poll::Result(result),
            _ => Poll::Resend {
                state: Some(doc.status),
                retry_after: None,
            },
        };
    }
    match doc.status.as_str() {
        "stalled" | "succeeded" | "failed" => Poll::Resend {
            state: Some(doc.status),
            retry_after,
        },
        _ => Poll::Again {
            state: doc.status,
            retry_after,
        },
    }
}

/// What the answer of an operation's `result` says to do next: it is the
/// stored answer, to hand over, unless the record is gone (then the original
/// request, sent again, answers for it).
pub(crate) fn judge_result(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Poll {
    if gone(status, headers, body) {
        Poll::Resend {
            state: None,
            retry_after: None,
        }
    } else {
        Poll::Final
    }
}

/// idem's `404` for an operation it does not have (any more, or for this
/// caller).
fn gone(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
    status == StatusCode::NOT_FOUND
        && problem_type(headers, body).as_deref() == Some(idem_wire::problem::OPERATION_NOT_FOUND)
}

/// The fields of an operation document the client reads.
struct Document {
    status: String,
    result: Option<String>,
    retry_after: Option<u64>,
}

impl Document {
    fn read(body: &[u8]) -> Option<Document> {
        let doc: serde_json::Value = serde_json::from_slice(body).ok()?;
        Some(Document {
            status: doc.get("status")?.as_str()?.to_owned(),
            result: doc
                .get("result")
                .and_then(|r| r.as_str())
                .map(str::to_owned),
            retry_after: doc.get("retry_after").and_then(serde_json::Value::as_u64),
        })
    }
}

/// The headers of the original request that go with its `GET`s: all but those
/// about its body (`Content-*`, `Transfer-Encoding`, `Expect`, `Trailer`,
/// digests), its conditions (`If-*`, which are about the request's target, not
/// the operation's resource) and `Idempotency-Key` (the resource is the key's
/// record already; the key stays off requests that need none). So the caller's
/// credentials (`Authorization`, `Cookie`, a tenant header) and preferences
/// (`Accept`) go along, and the client's default headers are added by reqwest
/// as on any request.
pub(crate) fn poll_headers(request: &HeaderMap) -> HeaderMap {
    let mut carried = HeaderMap::with_capacity(request.len());
    for (name, value) in request {
        if carries(name) {
            carried.append(name.clone(), value.clone());
        }
    }
    carried
}

fn carries(name: &HeaderName) -> bool {
    // Header names are lowercase in a `HeaderMap`.
    let name = name.as_str();
    !(name == IDEMPOTENCY_KEY
        || name.starts_with("content-")
        || name.starts_with("if-")
        || matches!(
            name,
            "transfer-encoding" | "expect" | "trailer" | "digest" | "repr-digest" | "want-digest"
        ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    fn located(location: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(LOCATION, HeaderValue::from_str(location).unwrap());
        h
    }

    const NOW: SystemTime = SystemTime::UNIX_EPOCH;

    #[test]
    fn a_202_is_followed_to_its_location_on_the_same_origin_only() {
        let post = url("http://127.0.0.1:3000/api/exports?x=1");
        let op = "/operations/create-export/ab12";
        assert_eq!(
            operation_of(StatusCode::ACCEPTED, &located(op), &post, &post),
            Some(url("http://127.0.0.1:3000/operations/create-export/ab12"))
        );
        // Relative to the request's path, as any reference is.
        assert_eq!(
            operation_of(StatusCode::ACCEPTED, &located("ops/1"), &post, &post),
            Some(url("http://127.0.0.1:3000/api/ops/1"))
        );
        assert_eq!(
            operation_of(
                StatusCode::ACCEPTED,
                &located("http://127.0.0.1:3000/ops/1"),
                &post,
                &post
            ),
            Some(url("http://127.0.0.1:3000/ops/1"))
        );
        for elsewhere in [
            "http://127.0.0.1:3001/ops/1",
            "https://127.0.0.1:3000/ops/1",
            "//evil.example/ops/1",
            "mailto:ops@example.com",
        ] {
            assert_eq!(
                operation_of(StatusCode::ACCEPTED, &located(elsewhere), &post, &post),
                None,
                "{elsewhere}"
            );
        }
        assert_eq!(
            operation_of(StatusCode::ACCEPTED, &HeaderMap::new(), &post, &post),
            None
        );
        for other in [StatusCode::OK, StatusCode::CREATED, StatusCode::SEE_OTHER] {
            assert_eq!(
                operation_of(other, &located(op), &post, &post),
                None,
                "{other}"
            );
        }
        // An answer from where a redirect led, to another origin (or down to
        // http): its resource is not followed with the request's credentials,
        // relative or absolute.
        for redirected in [
            "http://127.0.0.1:3001/api/exports",
            "http://other.example/api/exports",
        ] {
            let redirected = url(redirected);
            for location in [op, "http://127.0.0.1:3001/ops/1"] {
                assert_eq!(
                    operation_of(StatusCode::ACCEPTED, &located(location), &redirected, &post),
                    None,
                    "{redirected} {location}"
                );
            }
        }
    }

    fn doc(json: serde_json::Value, retry_after: Option<&'static str>) -> (HeaderMap, Vec<u8>) {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(r) = retry_after {
            h.insert(RETRY_AFTER, HeaderValue::from_static(r));
        }
        (h, json.to_string().into_bytes())
    }

    fn poll(json: serde_json::Value, retry_after: Option<&'static str>) -> Poll {
        let (h, b) = doc(json, retry_after);
        judge_poll(
            StatusCode::OK,
            &h,
            &b,
            &url("http://h/operations/create-export/ab"),
            NOW,
        )
    }

    #[test]
    fn running_and_uncertain_are_asked_again_after_retry_after() {
        for state in ["running", "uncertain", "queued"] {
            assert_eq!(
                poll(serde_json::json!({"status": state}), Some("2")),
                Poll::Again {
                    state: state.into(),
                    retry_after: Some(Duration::from_secs(2))
                }
            );
        }
        // No header: the document's own `retry_after`.
        assert_eq!(
            poll(
                serde_json::json!({"status": "running", "retry_after": 3}),
                None
            ),
            Poll::Again {
                state: "running".into(),
                retry_after: Some(Duration::from_secs(3))
            }
        );
    }

    #[test]
    fn done_reads_the_result_relative_to_the_resource() {
        assert_eq!(
            poll(
                serde_json::json!({"status": "succeeded", "response_status": 201,
                    "result": "/operations/create-export/ab/result"}),
                None
            ),
            Poll::Result(url("http://h/operations/create-export/ab/result"))
        );
        assert_eq!(
            poll(
                serde_json::json!({"status": "failed", "result": "ab/result"}),
                None
            ),
            Poll::Result(url("http://h/operations/create-export/ab/result"))
        );
        // Done with nowhere to read it (or elsewhere): the original request replays it.
        for result in [serde_json::json!(null), serde_json::json!("http://other/r")] {
            assert_eq!(
                poll(
                    serde_json::json!({"status": "succeeded", "result": result}),
                    None
                ),
                Poll::Resend {
                    state: Some("succeeded".into()),
                    retry_after: None
                }
            );
        }
    }

    #[test]
    fn stalled_sends_the_original_request_again() {
        assert_eq!(
            poll(serde_json::json!({"status": "stalled"}), Some("2")),
            Poll::Resend {
                state: Some("stalled".into()),
                retry_after: Some(Duration::from_secs(2))
            }
        );
    }

    #[test]
    fn a_gone_operation_is_sent_again_anything_else_is_handed_over() {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        let gone_body = br#"{"type":"urn:idem:problem:operation-not-found"}"#;
        let resource = url("http://h/operations/x/ab");
        assert_eq!(
            judge_poll(StatusCode::NOT_FOUND, &h, gone_body, &resource, NOW),
            Poll::Resend {
                state: None,
                retry_after: None
            }
        );
        assert_eq!(
            judge_result(StatusCode::NOT_FOUND, &h, gone_body),
            Poll::Resend {
                state: None,
                retry_after: None
            }
        );
        // Another 404, a refusal, a body that is no document: the caller's to see.
        let other = br#"{"type":"urn:test:problem:other"}"#;
        assert_eq!(
            judge_poll(StatusCode::NOT_FOUND, &h, other, &resource, NOW),
            Poll::Final
        );
        for s in [StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN] {
            assert_eq!(judge_poll(s, &h, gone_body, &resource, NOW), Poll::Final);
        }
        let (h, _) = doc(serde_json::json!({}), None);
        for body in [&b"<html>"[..], b"{}", br#"{"status": 7}"#] {
            assert_eq!(
                judge_poll(StatusCode::OK, &h, body, &resource, NOW),
                Poll::Final
            );
        }
        // The stored answer itself, whatever it is.
        for s in [StatusCode::CREATED, StatusCode::UNPROCESSABLE_ENTITY] {
            assert_eq!(judge_result(s, &h, b"{}"), Poll::Final);
        }
    }

    #[test]
    fn the_polls_carry_the_callers_headers_but_not_the_bodys_nor_the_key() {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer acme"));
        h.append("cookie", HeaderValue::from_static("a=1"));
        h.append("cookie", HeaderValue::from_static("b=2"));
        h.insert("x-tenant", HeaderValue::from_static("acme"));
        h.insert("accept", HeaderValue::from_static("application/json"));
        for dropped in [
            "idempotency-key",
            "content-type",
            "content-length",
            "content-encoding",
            "content-digest",
            "transfer-encoding",
            "expect",
            "trailer",
            "if-match",
            "if-none-match",
            "repr-digest",
        ] {
            h.insert(
                HeaderName::from_static(dropped),
                HeaderValue::from_static("v"),
            );
        }
        let carried = poll_headers(&h);
        let names: Vec<_> = carried.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["authorization", "cookie", "x-tenant", "accept"]);
        assert_eq!(carried.get_all("cookie").iter().count(), 2);
    }
}
