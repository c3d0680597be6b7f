//! Problem rendering: whatever a problem holds (any type, title and detail text,
//! any status and retry-after, or a constructor's own), the response is an
//! `application/problem+json` document that parses and says what the problem
//! holds, with a status and a `Retry-After` that agree with it.

#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use arbitrary::Arbitrary;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use idem_runtime::{IdempotencyKey, Problem};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[derive(Debug, Arbitrary)]
enum Input {
    /// Built field by field: the fields are public.
    Fields {
        type_uri: String,
        title: String,
        status: u16,
        detail: Option<String>,
        retry_after: Option<u64>,
    },
    New {
        type_uri: String,
        status: u16,
        title: String,
        detail: Option<String>,
    },
    MalformedKey(Vec<u8>),
    InFlight(u64, u32),
    Uncertain(u64, u32),
    Fixed(u8),
}

fn problem(input: Input) -> Option<Problem> {
    Some(match input {
        Input::Fields {
            type_uri,
            title,
            status,
            detail,
            retry_after,
        } => Problem {
            type_uri,
            title,
            status,
            detail,
            retry_after,
        },
        Input::New {
            type_uri,
            status,
            title,
            detail,
        } => {
            let p = Problem::new(&type_uri, StatusCode::from_u16(status).ok()?, &title);
            match detail {
                Some(d) => p.with_detail(d),
                None => p,
            }
        }
        Input::MalformedKey(bytes) => Problem::malformed_key(&IdempotencyKey::parse(bytes).err()?),
        Input::InFlight(secs, nanos) => {
            let nanos = nanos % 1_000_000_000;
            // Found by this target: rounding up overflows here (README.md); skipped
            // so that the target goes on past it.
            if secs == u64::MAX && nanos > 0 {
                return None;
            }
            Problem::in_flight(Duration::new(secs, nanos))
        }
        Input::Uncertain(secs, nanos) => {
            Problem::uncertain(Duration::new(secs, nanos % 1_000_000_000))
        }
        Input::Fixed(n) => match n % 3 {
            0 => Problem::missing_key(),
            1 => Problem::mismatch(),
            _ => Problem::store_unavailable(),
        },
    })
}

/// The body of a response whose body is already in memory: one poll finishes it.
fn body(resp: axum::response::Response) -> Vec<u8> {
    let fut = pin!(axum::body::to_bytes(resp.into_body(), usize::MAX));
    match fut.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(bytes) => bytes.expect("an in-memory body").to_vec(),
        Poll::Pending => panic!("a problem's body is not in memory"),
    }
}

fuzz_target!(|input: Input| {
    let by_hand = matches!(input, Input::Fields { .. });
    let Some(p) = problem(input) else {
        return;
    };
    let resp = p.clone().into_response();
    let status = resp.status();
    assert_eq!(
        resp.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let retry_after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = body(resp);
    let doc: Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("not JSON: {e}: {}", String::from_utf8_lossy(&bytes)));
    assert_eq!(doc["type"], p.type_uri.as_str());
    assert_eq!(doc["title"], p.title.as_str());
    match &p.detail {
        Some(d) => assert_eq!(doc["detail"], d.as_str()),
        None => assert!(doc.get("detail").is_none()),
    }
    // The document's status is the response's (RFC 9457 §3.1.4), when it is a
    // status at all: one set by hand outside 100..=999 is answered with 500 but
    // stays in the document (found by this target; see README.md).
    if StatusCode::from_u16(p.status).is_ok() {
        assert_eq!(doc["status"], status.as_u16(), "{p:?}");
    } else {
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(retry_after, p.retry_after.map(|s| s.to_string()));
    if let Some(secs) = p.retry_after {
        assert_eq!(doc["retry_after"], secs);
        // idem's own problems never ask for an immediate retry.
        assert!(by_hand || secs >= 1, "Retry-After 0: {p:?}");
    }
});
