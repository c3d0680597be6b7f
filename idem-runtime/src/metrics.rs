//! Metric names, recorded through the [`metrics`] facade: install any recorder
//! (`metrics-exporter-prometheus`, for one) and they appear. Labels are the
//! operation and an outcome; never the raw key, and the tenant only when
//! [`crate::Idem::with_tenant_label`] asks for it (tenants can be many).
//!
//! | name | kind | labels | what |
//! | --- | --- | --- | --- |
//! | `idem_claims_total` | counter | operation, outcome | claims by outcome: `executed`, `reclaimed` (an expired key executed anew), `replayed`, `mismatched`, `in_flight`, `taken_over` (leased), `uncertain`, `error` |
//! | `idem_claim_seconds` | histogram | operation | claim latency, waits included |
//! | `idem_claim_wait_seconds` | histogram | operation | time a claim spent waiting for a concurrent request with its key |
//! | `idem_completions_total` | counter | operation, outcome | `stored`, `rolled_back`, `too_large`, `stale_owner`, `uncertain`, `error` |
//! | `idem_completion_seconds` | histogram | operation | from claim to commit of the stored outcome |
//! | `idem_stored_bytes_total` | counter | operation | response body bytes stored |
//! | `idem_reconciled_total` | counter | operation, outcome | uncertain rows resolved: `completed`, `released`, `still_uncertain`, `raced` (another reconciler was first), `error` |
//! | `idem_sweeper_deleted_total` | counter | | expired rows deleted by the sweeper |
//! | `idem_sweeper_backlog` | gauge | | expired rows not yet swept, after a sweep |
//! | `idem_oldest_in_flight_seconds` | gauge | | age of the oldest `processing` or `uncertain` row |
//! | `idem_stale_in_flight` | gauge | | rows in flight for longer than the sweeper's threshold |

/// Counter: claims by operation and outcome.
pub const CLAIMS_TOTAL: &str = "idem_claims_total";
/// Histogram: claim latency in seconds.
pub const CLAIM_SECONDS: &str = "idem_claim_seconds";
/// Histogram: seconds a claim waited on a concurrent request with its key.
pub const CLAIM_WAIT_SECONDS: &str = "idem_claim_wait_seconds";
/// Counter: completions by operation and outcome.
pub const COMPLETIONS_TOTAL: &str = "idem_completions_total";
/// Histogram: seconds from claim to the stored outcome's commit.
pub const COMPLETION_SECONDS: &str = "idem_completion_seconds";
/// Counter: stored response body bytes.
pub const STORED_BYTES_TOTAL: &str = "idem_stored_bytes_total";
/// Counter: reconciliations of uncertain rows by outcome.
pub const RECONCILED_TOTAL: &str = "idem_reconciled_total";
/// Counter: rows deleted by the sweeper.
pub const SWEEPER_DELETED_TOTAL: &str = "idem_sweeper_deleted_total";
/// Gauge: expired rows not yet swept.
pub const SWEEPER_BACKLOG: &str = "idem_sweeper_backlog";
/// Gauge: age in seconds of the oldest in-flight row.
pub const OLDEST_IN_FLIGHT_SECONDS: &str = "idem_oldest_in_flight_seconds";
/// Gauge: rows in flight for longer than the sweeper's threshold.
pub const STALE_IN_FLIGHT: &str = "idem_stale_in_flight";

pub(crate) fn claim(operation: &str, tenant: Option<&str>, outcome: &'static str) {
    match tenant {
        Some(t) => metrics::counter!(CLAIMS_TOTAL, "operation" => operation.to_owned(), "outcome" => outcome, "tenant" => t.to_owned()).increment(1),
        None => metrics::counter!(CLAIMS_TOTAL, "operation" => operation.to_owned(), "outcome" => outcome).increment(1),
    }
}

pub(crate) fn completion(operation: &str, outcome: &'static str) {
    metrics::counter!(COMPLETIONS_TOTAL, "operation" => operation.to_owned(), "outcome" => outcome)
        .increment(1);
}

pub(crate) fn seconds(name: &'static str, operation: &str, secs: f64) {
    metrics::histogram!(name, "operation" => operation.to_owned()).record(secs);
}

pub(crate) fn reconciled(operation: &str, outcome: &'static str) {
    metrics::counter!(RECONCILED_TOTAL, "operation" => operation.to_owned(), "outcome" => outcome)
        .increment(1);
}
