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
//! | `idem_completions_total` | counter | operation, outcome | `stored`, `rolled_back`, `too_large`, `stale_owner`, `uncertain`, `deadline` (abandoned at the request deadline), `error` |
//! | `idem_completion_seconds` | histogram | operation | from claim to commit of the stored outcome |
//! | `idem_stored_bytes_total` | counter | operation | response body bytes stored |
//! | `idem_reconciled_total` | counter | operation, outcome | uncertain rows resolved: `completed`, `released`, `still_uncertain`, `raced` (another reconciler was first), `error` |
//! | `idem_sweeper_deleted_total` | counter | | expired rows deleted by the sweeper |
//! | `idem_sweeper_backlog` | gauge | | expired rows not yet swept, after a sweep |
//! | `idem_oldest_in_flight_seconds` | gauge | | age of the oldest `processing` or `uncertain` row |
//! | `idem_stale_in_flight` | gauge | | rows in flight for longer than the sweeper's threshold |
//! | `idem_uncertain_rows` | gauge | | `uncertain` rows awaiting reconciliation, after a sweep |

use metrics::SharedString;

/// Bucket bounds in seconds for idem's histograms ([`CLAIM_SECONDS`],
/// [`CLAIM_WAIT_SECONDS`], [`COMPLETION_SECONDS`]): 0.5 ms to 10 s.
///
/// Give them to your recorder. `metrics-exporter-prometheus` exports every
/// histogram as a summary unless told otherwise, and a summary keeps, per metric
/// and operation, three 20-second quantile sketches of a few hundred KiB each,
/// regrown every 20 s: megabytes of memory that creep upwards for minutes. As
/// Prometheus histograms with these buckets they cost a few hundred bytes per
/// series, and stay flat (measured in BENCHMARKS.md). Quantiles then come from
/// PromQL, e.g.
/// `histogram_quantile(0.99, sum by (le, operation) (rate(idem_claim_seconds_bucket[5m])))`.
///
/// ```ignore
/// use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
///
/// let handle = PrometheusBuilder::new()
///     .set_buckets_for_metric(Matcher::Prefix("idem_".into()), idem_runtime::metrics::SECONDS_BUCKETS)?
///     .install_recorder()?;
/// // and call handle.run_upkeep() every few seconds, or samples pile up
/// ```
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

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
/// Gauge: `uncertain` rows, awaiting reconciliation.
pub const UNCERTAIN_ROWS: &str = "idem_uncertain_rows";

// Labels take `impl Into<SharedString>`: the handler passes the operation as the
// `&'static str` its attribute wrote, which becomes a label without an allocation
// per request.

pub(crate) fn claim(
    operation: impl Into<SharedString>,
    tenant: Option<&str>,
    outcome: &'static str,
) {
    let operation = operation.into();
    match tenant {
        Some(t) => metrics::counter!(CLAIMS_TOTAL, "operation" => operation, "outcome" => outcome, "tenant" => t.to_owned()).increment(1),
        None => metrics::counter!(CLAIMS_TOTAL, "operation" => operation, "outcome" => outcome).increment(1),
    }
}

pub(crate) fn completion(operation: impl Into<SharedString>, outcome: &'static str) {
    metrics::counter!(COMPLETIONS_TOTAL, "operation" => operation.into(), "outcome" => outcome)
        .increment(1);
}

/// Records a wait for another holder of a key that began at `started`.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn claim_waited(operation: impl Into<SharedString>, started: std::time::Instant) {
    seconds(
        CLAIM_WAIT_SECONDS,
        operation,
        started.elapsed().as_secs_f64(),
    );
}

pub(crate) fn seconds(name: &'static str, operation: impl Into<SharedString>, secs: f64) {
    metrics::histogram!(name, "operation" => operation.into()).record(secs);
}

pub(crate) fn reconciled(operation: impl Into<SharedString>, outcome: &'static str) {
    metrics::counter!(RECONCILED_TOTAL, "operation" => operation.into(), "outcome" => outcome)
        .increment(1);
}
