//! The retry decisions: which answers ask for another attempt, how long to wait.

use std::time::{Duration, SystemTime};

use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderMap, RETRY_AFTER};

/// The problem type of idem's `409`: the first request with this key still runs;
/// [`idem_wire::problem::IN_FLIGHT`].
///
/// ```
/// assert_eq!(idem_client::REQUEST_IN_FLIGHT, "urn:idem:problem:request-in-flight");
/// ```
pub const REQUEST_IN_FLIGHT: &str = idem_wire::problem::IN_FLIGHT;
/// The problem type of idem's `202`: the effect may have happened, the outcome is
/// being reconciled; [`idem_wire::problem::OUTCOME_UNCERTAIN`].
///
/// ```
/// assert_eq!(idem_client::OUTCOME_UNCERTAIN, "urn:idem:problem:outcome-uncertain");
/// ```
pub const OUTCOME_UNCERTAIN: &str = idem_wire::problem::OUTCOME_UNCERTAIN;

/// What to do with an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Hand it to the caller.
    Final,
    /// Send the request again (same key, same bytes), not before `retry_after`.
    Retry { retry_after: Option<Duration> },
}

/// Judges one answer by the contract:
///
/// * `202` with the outcome-uncertain problem: retry (the server answers the
///   same key with the reconciled outcome once it has it); any other `2xx`: final;
/// * `409` with the in-flight problem, or with `Retry-After`: retry; any other
///   `409` (a business conflict): final;
/// * `5xx` but `501` and `505` (which never change): retry;
/// * everything else, `422` above all (the key was used for another request: a
///   bug in the caller, which a retry would only repeat): final;
/// * and before all of these, a replay (`Idempotent-Replayed: true`): final,
///   whatever its status. It is the key's stored outcome, which every other
///   attempt would get again (a handler's `409` with a stored `Retry-After`, a
///   server that stores its `5xx`).
pub(crate) fn judge(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Verdict {
    if replayed(headers) {
        return Verdict::Final;
    }
    let retry = || Verdict::Retry {
        retry_after: retry_after(headers, SystemTime::now()),
    };
    match status {
        StatusCode::ACCEPTED
            if problem_type(headers, body).as_deref() == Some(OUTCOME_UNCERTAIN) =>
        {
            retry()
        }
        StatusCode::CONFLICT
            if headers.contains_key(RETRY_AFTER)
                || problem_type(headers, body).as_deref() == Some(REQUEST_IN_FLIGHT) =>
        {
            retry()
        }
        StatusCode::NOT_IMPLEMENTED | StatusCode::HTTP_VERSION_NOT_SUPPORTED => Verdict::Final,
        s if s.is_server_error() => retry(),
        _ => Verdict::Final,
    }
}

/// Whether [`judge`] reads the body of this answer: only a problem document's
/// `type` can make a `202` or a `409` without `Retry-After` a retry. For every
/// other answer the status and headers decide, so a final `2xx` (or any answer
/// but those) needs no buffering before it is handed over.
pub(crate) fn reads_body(status: StatusCode, headers: &HeaderMap) -> bool {
    !replayed(headers)
        && is_problem(headers)
        && (status == StatusCode::ACCEPTED
            || (status == StatusCode::CONFLICT && !headers.contains_key(RETRY_AFTER)))
}

/// The answer is a replay of the key's stored outcome.
fn replayed(headers: &HeaderMap) -> bool {
    headers
        .get(idem_wire::IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// The answer says it is `application/problem+json`.
pub(crate) fn is_problem(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(idem_wire::problem::is_problem_content_type)
}

/// The `type` of an `application/problem+json` body.
pub(crate) fn problem_type(headers: &HeaderMap, body: &[u8]) -> Option<String> {
    if !is_problem(headers) {
        return None;
    }
    let doc: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(doc.get("type")?.as_str()?.to_owned())
}

/// `Retry-After` as a wait from `now`: delta-seconds or an HTTP date (a date in
/// the past is no wait), read by [`idem_wire::parse_retry_after`]. Unreadable
/// values count as absent.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    idem_wire::parse_retry_after(headers.get(RETRY_AFTER)?.to_str().ok()?, now)
}

/// Full jitter: a wait drawn uniformly from `[0, min(max, base * 2^(retry - 1))]`
/// for the `retry`th retry (1-based), so that callers that failed together do not
/// come back together.
pub(crate) fn full_jitter(base: Duration, max: Duration, retry: u32) -> Duration {
    let factor = 2u32
        .checked_pow(retry.saturating_sub(1))
        .unwrap_or(u32::MAX);
    let cap = base.saturating_mul(factor).min(max);
    let cap_nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(fastrand::u64(0..=cap_nanos))
}

/// The wait before the `retry`th retry: the server's `Retry-After`, if any,
/// with the backoff's [`full_jitter`] on top, so that clients the server told
/// the same `Retry-After` (idem sends one second for a busy store) come back
/// spread over the jitter rather than at one instant.
pub(crate) fn next_wait(
    base: Duration,
    max: Duration,
    retry: u32,
    retry_after: Option<Duration>,
) -> Duration {
    retry_after
        .unwrap_or_default()
        .saturating_add(full_jitter(base, max, retry))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn problem(t: &str) -> (HeaderMap, Vec<u8>) {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static(idem_wire::problem::CONTENT_TYPE),
        );
        (h, serde_json::json!({"type": t}).to_string().into_bytes())
    }

    #[test]
    fn the_uncertain_202_is_retried_other_2xx_are_final() {
        let (mut h, b) = problem(OUTCOME_UNCERTAIN);
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(
            judge(StatusCode::ACCEPTED, &h, &b),
            Verdict::Retry {
                retry_after: Some(Duration::from_secs(2))
            }
        );
        // A plain 202 (an asynchronous job accepted) is an answer, even with Retry-After.
        let mut plain = HeaderMap::new();
        plain.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(judge(StatusCode::ACCEPTED, &plain, b"{}"), Verdict::Final);
        for s in [StatusCode::OK, StatusCode::CREATED, StatusCode::NO_CONTENT] {
            assert_eq!(judge(s, &h, &b), Verdict::Final, "{s}");
        }
    }

    #[test]
    fn the_in_flight_409_is_retried_a_business_409_is_final() {
        let (h, b) = problem(REQUEST_IN_FLIGHT);
        assert_eq!(
            judge(StatusCode::CONFLICT, &h, &b),
            Verdict::Retry { retry_after: None }
        );
        let (h, b) = problem("urn:orders:problem:invalid-transition");
        assert_eq!(judge(StatusCode::CONFLICT, &h, &b), Verdict::Final);
        let mut with_retry_after = HeaderMap::new();
        with_retry_after.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        assert_eq!(
            judge(StatusCode::CONFLICT, &with_retry_after, b""),
            Verdict::Retry {
                retry_after: Some(Duration::from_secs(1))
            }
        );
    }

    #[test]
    fn a_422_and_other_4xx_are_final_whatever_they_say() {
        let (mut h, b) = problem(REQUEST_IN_FLIGHT);
        h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        for s in [400, 401, 402, 403, 404, 408, 410, 412, 415, 422, 429] {
            let s = StatusCode::from_u16(s).unwrap();
            assert_eq!(judge(s, &h, &b), Verdict::Final, "{s}");
        }
    }

    /// A replay is the key's outcome, which another attempt would get again:
    /// final whatever its status, `Retry-After` or problem type.
    #[test]
    fn a_replayed_answer_is_final_whatever_it_says() {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        let in_flight = br#"{"type":"urn:idem:problem:request-in-flight"}"#;
        assert!(matches!(
            judge(StatusCode::CONFLICT, &h, in_flight),
            Verdict::Retry { .. }
        ));
        h.insert(
            idem_wire::IDEMPOTENT_REPLAYED,
            HeaderValue::from_static("true"),
        );
        for s in [409, 500, 503] {
            let s = StatusCode::from_u16(s).unwrap();
            assert_eq!(judge(s, &h, in_flight), Verdict::Final, "{s}");
            assert!(!reads_body(s, &h), "{s}");
        }
    }

    #[test]
    fn server_errors_are_retried_but_501_and_505() {
        let h = HeaderMap::new();
        for s in [500, 502, 503, 504, 507, 599] {
            let s = StatusCode::from_u16(s).unwrap();
            assert!(matches!(judge(s, &h, b""), Verdict::Retry { .. }), "{s}");
        }
        for s in [501, 505] {
            let s = StatusCode::from_u16(s).unwrap();
            assert_eq!(judge(s, &h, b""), Verdict::Final, "{s}");
        }
    }

    /// Where `reads_body` says the body does not matter, no body changes the
    /// verdict: the middleware may judge such an answer unread.
    #[test]
    fn only_the_answers_that_read_their_body_depend_on_it() {
        let bodies: [&[u8]; 4] = [
            b"",
            b"not json",
            br#"{"type":"urn:idem:problem:outcome-uncertain"}"#,
            br#"{"type":"urn:idem:problem:request-in-flight"}"#,
        ];
        let content_types = [
            None,
            Some("application/problem+json"),
            Some("application/json"),
        ];
        let mut read = Vec::new();
        for code in 100..=999u16 {
            let status = StatusCode::from_u16(code).unwrap();
            for ct in content_types {
                for with_retry_after in [false, true] {
                    let mut h = HeaderMap::new();
                    if let Some(ct) = ct {
                        h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
                    }
                    if with_retry_after {
                        h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
                    }
                    if reads_body(status, &h) {
                        read.push((code, ct, with_retry_after));
                        continue;
                    }
                    let unread = judge(status, &h, b"");
                    for body in bodies {
                        assert_eq!(judge(status, &h, body), unread, "{code} {ct:?} {h:?}");
                    }
                }
            }
        }
        let problem = Some("application/problem+json");
        assert_eq!(
            read,
            [
                (202, problem, false),
                (202, problem, true),
                (409, problem, false)
            ]
        );
    }

    #[test]
    fn problem_types_are_read_only_from_problem_documents() {
        let (mut h, b) = problem(OUTCOME_UNCERTAIN);
        assert_eq!(problem_type(&h, &b).as_deref(), Some(OUTCOME_UNCERTAIN));
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("Application/Problem+JSON; charset=utf-8"),
        );
        assert_eq!(problem_type(&h, &b).as_deref(), Some(OUTCOME_UNCERTAIN));
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        assert_eq!(problem_type(&h, &b), None);
        let (h, _) = problem("x");
        assert_eq!(problem_type(&h, b"not json"), None);
        assert_eq!(problem_type(&h, br#"{"type": 7}"#), None);
    }

    /// The values themselves are idem-wire's to read (`parse_retry_after`, tested
    /// there with seconds and dates); here, the header reaches it.
    #[test]
    fn retry_after_is_read_from_the_header() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h, now), None);
        h.insert(RETRY_AFTER, HeaderValue::from_static(" 7 "));
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(7)));
        // now + 90 s
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Tue, 14 Nov 2023 22:14:50 GMT"),
        );
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(90)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h, now), None);
        h.insert(RETRY_AFTER, HeaderValue::from_bytes(b"\xff").unwrap());
        assert_eq!(retry_after(&h, now), None);
    }

    #[test]
    fn a_retry_after_is_waited_out_with_the_jitter_on_top() {
        let (base, max) = (Duration::from_millis(100), Duration::from_secs(2));
        let second = Duration::from_secs(1);
        let waits: Vec<Duration> = (0..200)
            .map(|_| next_wait(base, max, 1, Some(second)))
            .collect();
        assert!(waits.iter().all(|w| *w >= second && *w <= second + base));
        assert!(
            waits.iter().any(|w| *w != waits[0]),
            "every client told Retry-After: 1 would come back at once"
        );
        assert!(next_wait(base, max, 1, None) <= base);
        assert_eq!(
            next_wait(base, max, 1, Some(Duration::MAX)),
            Duration::MAX,
            "a far Retry-After saturates, for the deadline to refuse"
        );
    }

    #[test]
    fn full_jitter_stays_within_its_capped_exponential_bound() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(2);
        for retry in 1..=40 {
            let cap = (base * 2u32.saturating_pow(retry - 1).min(1 << 20)).min(max);
            for _ in 0..200 {
                assert!(full_jitter(base, max, retry) <= cap, "retry {retry}");
            }
        }
        assert_eq!(full_jitter(Duration::ZERO, max, 3), Duration::ZERO);
        // Spread: 200 draws from [0, 100ms] are not all the same.
        let draws: std::collections::HashSet<_> =
            (0..200).map(|_| full_jitter(base, max, 1)).collect();
        assert!(draws.len() > 1);
    }
}
