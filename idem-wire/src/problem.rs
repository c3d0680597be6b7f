//! The problem documents (RFC 9457, `application/problem+json`) idem answers
//! with: their media type and one stable `type` URI per failure, so a client can
//! tell, say, a fingerprint mismatch from its own validation error.
//!
//! ```
//! use idem_wire::problem;
//!
//! let content_type = "application/problem+json; charset=utf-8";
//! let doc_type = "urn:idem:problem:request-in-flight";
//! assert!(problem::is_problem_content_type(content_type));
//! assert_eq!(doc_type, problem::IN_FLIGHT);
//! ```

/// The media type of a problem document.
///
/// ```
/// assert_eq!(idem_wire::problem::CONTENT_TYPE, "application/problem+json");
/// ```
pub const CONTENT_TYPE: &str = "application/problem+json";

/// `400`: the request has no `Idempotency-Key` header.
///
/// ```
/// assert_eq!(idem_wire::problem::MISSING_KEY, "urn:idem:problem:missing-idempotency-key");
/// ```
pub const MISSING_KEY: &str = "urn:idem:problem:missing-idempotency-key";

/// `400`: the `Idempotency-Key` header is unusable (see
/// [`check_bare_key`](crate::check_bare_key)).
///
/// ```
/// assert_eq!(idem_wire::problem::MALFORMED_KEY, "urn:idem:problem:malformed-idempotency-key");
/// ```
pub const MALFORMED_KEY: &str = "urn:idem:problem:malformed-idempotency-key";

/// `422`: the key was used before for a different request. Never worth a retry.
///
/// ```
/// assert_eq!(idem_wire::problem::FINGERPRINT_MISMATCH, "urn:idem:problem:fingerprint-mismatch");
/// ```
pub const FINGERPRINT_MISMATCH: &str = "urn:idem:problem:fingerprint-mismatch";

/// `409`: a request with the same key is still running; retry after
/// `Retry-After` with the same key.
///
/// ```
/// assert_eq!(idem_wire::problem::IN_FLIGHT, "urn:idem:problem:request-in-flight");
/// ```
pub const IN_FLIGHT: &str = "urn:idem:problem:request-in-flight";

/// `503`: the database was busy with other writers past its wait (SQLite's
/// one write lock, held by a request for another key): nothing was looked up
/// or reserved for this key; retry after `Retry-After` with the same key. Not
/// [`IN_FLIGHT`]: no request with this key needs to be running.
///
/// ```
/// assert_eq!(idem_wire::problem::STORE_BUSY, "urn:idem:problem:store-busy");
/// ```
pub const STORE_BUSY: &str = "urn:idem:problem:store-busy";

/// `503`: the operation already runs as many executions at once in this
/// process as its running limit allows (in all, or for this tenant): nothing was
/// reserved for this key; retry after `Retry-After` with the same key.
///
/// ```
/// assert_eq!(idem_wire::problem::AT_CAPACITY, "urn:idem:problem:at-capacity");
/// ```
pub const AT_CAPACITY: &str = "urn:idem:problem:at-capacity";

/// `500`: the response was larger than the configured limit and was not
/// stored; the operation was rolled back.
///
/// ```
/// assert_eq!(idem_wire::problem::RESPONSE_TOO_LARGE, "urn:idem:problem:response-too-large");
/// ```
pub const RESPONSE_TOO_LARGE: &str = "urn:idem:problem:response-too-large";

/// `500`: the tenant id supplied by the application is unusable.
///
/// ```
/// assert_eq!(idem_wire::problem::INVALID_TENANT, "urn:idem:problem:invalid-tenant");
/// ```
pub const INVALID_TENANT: &str = "urn:idem:problem:invalid-tenant";

/// `500`: the request body could not be fingerprinted.
///
/// ```
/// assert_eq!(idem_wire::problem::FINGERPRINT_FAILED, "urn:idem:problem:fingerprint-failed");
/// ```
pub const FINGERPRINT_FAILED: &str = "urn:idem:problem:fingerprint-failed";

/// `404`: no operation resource of a long operation with this id is visible
/// to the caller (unknown, another tenant's, or forgotten after its
/// retention); the same answer whichever it is.
///
/// ```
/// assert_eq!(idem_wire::problem::OPERATION_NOT_FOUND, "urn:idem:problem:operation-not-found");
/// ```
pub const OPERATION_NOT_FOUND: &str = "urn:idem:problem:operation-not-found";

/// `503`: the idempotency store failed; nothing was stored and a retry with the
/// same key is safe.
/// (`500` when the response itself could not be captured for storing; the
/// operation was rolled back, and a retry is safe too. Also `503` when the key
/// holds an outcome that cannot be read, such as an answer sealed with a key
/// the service no longer has: it is not run again, and its `detail` says so;
/// retry later with the same key, never a new one.)
///
/// ```
/// assert_eq!(idem_wire::problem::STORE_UNAVAILABLE, "urn:idem:problem:store-unavailable");
/// ```
pub const STORE_UNAVAILABLE: &str = "urn:idem:problem:store-unavailable";

/// `500`: the handler panicked; its transaction was rolled back (in leased
/// mode, where it may have called downstream, its lease is taken over once it
/// lapses). The retry is the same key, never a new one.
///
/// ```
/// assert_eq!(idem_wire::problem::HANDLER_PANICKED, "urn:idem:problem:handler-panicked");
/// ```
pub const HANDLER_PANICKED: &str = "urn:idem:problem:handler-panicked";

/// `202`: an earlier execution's external effect is unknown and is being
/// reconciled; nothing runs again meanwhile. Retry after `Retry-After` with the
/// same key until a final answer comes.
///
/// ```
/// assert_eq!(idem_wire::problem::OUTCOME_UNCERTAIN, "urn:idem:problem:outcome-uncertain");
/// ```
pub const OUTCOME_UNCERTAIN: &str = "urn:idem:problem:outcome-uncertain";

/// Whether a `Content-Type` value names a problem document: its media type,
/// parameters aside, is [`CONTENT_TYPE`] in any case.
///
/// ```
/// use idem_wire::problem::is_problem_content_type;
///
/// assert!(is_problem_content_type("application/problem+json"));
/// assert!(is_problem_content_type("Application/Problem+JSON; charset=utf-8"));
/// assert!(!is_problem_content_type("application/json"));
/// ```
pub fn is_problem_content_type(value: &str) -> bool {
    value
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case(CONTENT_TYPE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_is_an_idem_urn_and_they_differ() {
        let all = [
            MISSING_KEY,
            MALFORMED_KEY,
            FINGERPRINT_MISMATCH,
            IN_FLIGHT,
            RESPONSE_TOO_LARGE,
            INVALID_TENANT,
            FINGERPRINT_FAILED,
            STORE_UNAVAILABLE,
            HANDLER_PANICKED,
            OUTCOME_UNCERTAIN,
        ];
        for t in all {
            assert!(t.starts_with("urn:idem:problem:"), "{t}");
        }
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len());
    }

    #[test]
    fn the_content_type_is_read_by_its_essence() {
        for yes in [
            "application/problem+json",
            " application/problem+json ",
            "Application/Problem+JSON; charset=utf-8",
            "application/problem+json;charset=utf-8",
        ] {
            assert!(is_problem_content_type(yes), "{yes:?}");
        }
        for no in [
            "",
            "application/json",
            "application/problem+jsonx",
            "text/plain; application/problem+json",
        ] {
            assert!(!is_problem_content_type(no), "{no:?}");
        }
    }
}
