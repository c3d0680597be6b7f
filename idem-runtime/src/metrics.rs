//! Metric names, recorded through the [`metrics`] facade: install any recorder
//! (`metrics-exporter-prometheus`, for one) and they appear. Labels are the
//! operation and an outcome; never the raw key, and the tenant only when
//! [`crate::Idem::with_tenant_label`] asks for it (tenants can be many).
//!
//! | name | kind | labels | what |
//! | --- | --- | --- | --- |
//! | `idem_claims_total` | counter | operation, outcome | claims by outcome: `executed`, `reclaimed` (an expired key executed anew), `replayed`, `mismatched`, `in_flight` (`409`), `running` (a long operation's retry while it runs: its `202`), `busy` (SQLite's write lock held by others), `at_capacity` (the operation's running limit was full), `taken_over` (leased), `uncertain`, `deadline` (abandoned at the request deadline before the claim was decided: `503`, nothing reserved, no completion counted), `error` |
//! | `idem_claim_seconds` | histogram | operation | claim latency, waits included |
//! | `idem_claim_wait_seconds` | histogram | operation | time a claim spent waiting for a concurrent request with its key |
//! | `idem_completions_total` | counter | operation, outcome | `stored`, `rolled_back`, `too_large`, `stale_owner`, `uncertain`, `deadline` (abandoned at the request deadline), `panicked` (the handler panicked: rolled back, or its lease lapses), `error` |
//! | `idem_completion_seconds` | histogram | operation | from claim to commit of the stored outcome |
//! | `idem_stored_bytes_total` | counter | operation | response body bytes stored |
//! | `idem_reconciled_total` | counter | operation, outcome | uncertain rows resolved: `completed`, `released`, `still_uncertain`, `raced` (another reconciler was first), `error` |
//! | `idem_sweeper_deleted_total` | counter | | expired rows deleted by the sweeper |
//! | `idem_sweeper_backlog` | gauge | | expired rows not yet swept, after a sweep |
//! | `idem_oldest_in_flight_seconds` | gauge | | age of the oldest `processing` or `uncertain` row |
//! | `idem_stale_in_flight` | gauge | | rows in flight for longer than the sweeper's threshold |
//! | `idem_uncertain_rows` | gauge | | `uncertain` rows awaiting reconciliation, after a sweep |
//! | `idem_running_executions` | gauge | operation | leased executions holding a slot of the operation's running limit in this process (only for an operation with a limit) |
//! | `idem_running_limit` | gauge | operation | that limit's total |

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

/// Counter: claims by operation and outcome, one per request that reached
/// its claim. A first execution that finds its key finished by another at
/// commit counts `executed` (and its completion `rolled_back`), though it is
/// answered the other's outcome. A request abandoned at its deadline before
/// its claim was decided counts `deadline` here and no completion.
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
/// Gauge: leased executions holding a slot of the operation's running limit.
pub const RUNNING_EXECUTIONS: &str = "idem_running_executions";
/// Gauge: the total of the operation's running limit.
pub const RUNNING_LIMIT: &str = "idem_running_limit";

// Labels take `impl Into<SharedString>`: the handler passes the operation as the
// `&'static str` its attribute wrote, which becomes a label without an allocation.
//
// The per-request metrics (a claim's and a completion's counters, their
// histograms, the stored bytes) go through `Key`s built once per operation and
// kept in `OPERATIONS`, where the `metrics` macros build the key (its label list,
// an allocation, and its hash) on every call. The handles themselves are not
// kept: a handle belongs to the recorder that was current when it was
// registered, the current recorder can change (a global one installed after the
// first request, a thread-local one per test with `metrics::with_local_recorder`),
// and `metrics` offers no way to tell which one is current. So every call
// registers with the current recorder, by a key built (and retained) once.

use std::collections::BTreeMap;
use std::sync::{PoisonError, RwLock};

use metrics::{Key, Label, Level, Metadata};

/// The outcomes of [`CLAIMS_TOTAL`] with a key kept per operation.
const CLAIM_OUTCOMES: [&str; 12] = [
    "executed",
    "reclaimed",
    "replayed",
    "mismatched",
    "in_flight",
    "running",
    "busy",
    "at_capacity",
    "taken_over",
    "uncertain",
    "deadline",
    "error",
];

/// The outcomes of [`COMPLETIONS_TOTAL`] with a key kept per operation.
const COMPLETION_OUTCOMES: [&str; 8] = [
    "stored",
    "rolled_back",
    "too_large",
    "stale_owner",
    "uncertain",
    "deadline",
    "panicked",
    "error",
];

/// What the macros would give the recorder for a call in this module.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// The keys of one operation's per-request metrics, with the labels the macros
/// would give them (`operation`, then `outcome`), so that both reach one series.
struct Operation {
    claims: [Key; CLAIM_OUTCOMES.len()],
    completions: [Key; COMPLETION_OUTCOMES.len()],
    claim_seconds: Key,
    claim_wait_seconds: Key,
    completion_seconds: Key,
    stored_bytes: Key,
}

impl Operation {
    /// Every key is retained (its labels shared behind an `Arc`) once here:
    /// recorders retain the key they are given at every registration (the
    /// Prometheus exporter does), which for a key with an owned label list
    /// copies the list into a new `Arc`, an allocation a call; a retained key
    /// is retained again by a reference count.
    fn new(operation: &SharedString) -> Self {
        let op = || Label::new("operation", operation.clone());
        let key =
            |name: &'static str, labels: Vec<Label>| Key::from_parts(name, labels).to_retained();
        let outcome = |name: &'static str, outcome: &'static str| {
            key(name, vec![op(), Label::new("outcome", outcome)])
        };
        Operation {
            claims: CLAIM_OUTCOMES.map(|o| outcome(CLAIMS_TOTAL, o)),
            completions: COMPLETION_OUTCOMES.map(|o| outcome(COMPLETIONS_TOTAL, o)),
            claim_seconds: key(CLAIM_SECONDS, vec![op()]),
            claim_wait_seconds: key(CLAIM_WAIT_SECONDS, vec![op()]),
            completion_seconds: key(COMPLETION_SECONDS, vec![op()]),
            stored_bytes: key(STORED_BYTES_TOTAL, vec![op()]),
        }
    }
}

/// Operation names are few (one per `#[idempotent]` handler or consumer), and
/// an entry is added once per name, on its first request.
static OPERATIONS: RwLock<BTreeMap<SharedString, Operation>> = RwLock::new(BTreeMap::new());

/// Runs `f` with the operation's keys, building them on its first use.
fn with_operation<R>(operation: SharedString, f: impl FnOnce(&Operation) -> R) -> R {
    {
        // A panic elsewhere while holding the lock leaves the map as it was.
        let known = OPERATIONS.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(keys) = known.get(&*operation) {
            return f(keys);
        }
    }
    let mut known = OPERATIONS.write().unwrap_or_else(PoisonError::into_inner);
    let keys = known
        .entry(operation.clone())
        .or_insert_with(|| Operation::new(&operation));
    f(keys)
}

fn counter(key: &Key) -> metrics::Counter {
    metrics::with_recorder(|r| r.register_counter(key, &METADATA))
}

fn histogram(key: &Key) -> metrics::Histogram {
    metrics::with_recorder(|r| r.register_histogram(key, &METADATA))
}

pub(crate) fn claim(
    operation: impl Into<SharedString>,
    tenant: Option<&str>,
    outcome: &'static str,
) {
    let operation = operation.into();
    match (tenant, CLAIM_OUTCOMES.iter().position(|o| *o == outcome)) {
        // Tenants can be many: their series are not kept here.
        (Some(t), _) => metrics::counter!(CLAIMS_TOTAL, "operation" => operation, "outcome" => outcome, "tenant" => t.to_owned()).increment(1),
        (None, Some(i)) => with_operation(operation, |keys| counter(&keys.claims[i]).increment(1)),
        (None, None) => metrics::counter!(CLAIMS_TOTAL, "operation" => operation, "outcome" => outcome).increment(1),
    }
}

pub(crate) fn completion(operation: impl Into<SharedString>, outcome: &'static str) {
    let operation = operation.into();
    match COMPLETION_OUTCOMES.iter().position(|o| *o == outcome) {
        Some(i) => with_operation(operation, |keys| counter(&keys.completions[i]).increment(1)),
        None => {
            metrics::counter!(COMPLETIONS_TOTAL, "operation" => operation, "outcome" => outcome)
                .increment(1)
        }
    }
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
    let operation = operation.into();
    let pick: fn(&Operation) -> &Key = match name {
        CLAIM_SECONDS => |keys| &keys.claim_seconds,
        CLAIM_WAIT_SECONDS => |keys| &keys.claim_wait_seconds,
        COMPLETION_SECONDS => |keys| &keys.completion_seconds,
        _ => {
            metrics::histogram!(name, "operation" => operation).record(secs);
            return;
        }
    };
    with_operation(operation, |keys| histogram(pick(keys)).record(secs));
}

/// Counts the body bytes of a stored response.
pub(crate) fn stored_bytes(operation: impl Into<SharedString>, bytes: u64) {
    with_operation(operation.into(), |keys| {
        counter(&keys.stored_bytes).increment(bytes)
    });
}

pub(crate) fn reconciled(operation: impl Into<SharedString>, outcome: &'static str) {
    metrics::counter!(RECONCILED_TOTAL, "operation" => operation.into(), "outcome" => outcome)
        .increment(1);
}

/// The slots an operation's running limit has taken, and its total (a change
/// of the running count, not a request's hot path: only operations with a
/// limit get here).
pub(crate) fn running(operation: &'static str, running: usize, limit: usize) {
    metrics::gauge!(RUNNING_EXECUTIONS, "operation" => operation).set(running as f64);
    metrics::gauge!(RUNNING_LIMIT, "operation" => operation).set(limit as f64);
}
