//! The operations files in `ops/`: the Grafana dashboard parses, charts every
//! idem metric and names no metric idem does not export; the alert rules name
//! only idem's metrics. (`promtool check rules` and `promtool test rules` check
//! the rules themselves; `.ci/run` runs them.)

use idem_runtime::metrics as m;

/// Every metric idem records, as the runtime names it.
const METRICS: &[&str] = &[
    m::CLAIMS_TOTAL,
    m::CLAIM_SECONDS,
    m::CLAIM_WAIT_SECONDS,
    m::COMPLETIONS_TOTAL,
    m::COMPLETION_SECONDS,
    m::STORED_BYTES_TOTAL,
    m::RECONCILED_TOTAL,
    m::SWEEPER_DELETED_TOTAL,
    m::SWEEPER_BACKLOG,
    m::OLDEST_IN_FLIGHT_SECONDS,
    m::STALE_IN_FLIGHT,
    m::UNCERTAIN_ROWS,
    m::RUNNING_EXECUTIONS,
    m::RUNNING_LIMIT,
];

fn ops_file(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("ops")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `idem_...` names a PromQL text uses, as idem names them: a histogram's
/// `_bucket`, `_count` and `_sum` series belong to the histogram.
fn metric_names(promql: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = promql;
    while let Some(at) = rest.find("idem_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|b| METRICS.contains(b))
            .map_or(name.clone(), str::to_owned);
        names.push(base);
    }
    names
}

fn exprs(panel: &serde_json::Value, out: &mut Vec<(String, String)>) {
    let title = panel["title"].as_str().unwrap_or_default().to_owned();
    for t in panel["targets"].as_array().into_iter().flatten() {
        let expr = t["expr"].as_str().expect("every target has an expr");
        out.push((title.clone(), expr.to_owned()));
    }
    for p in panel["panels"].as_array().into_iter().flatten() {
        exprs(p, out);
    }
}

#[test]
fn the_dashboard_charts_every_idem_metric_and_only_those() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&ops_file("grafana-dashboard.json")).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "idem-overview");
    let mut all = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        exprs(p, &mut all);
    }
    let mut used = Vec::new();
    for (title, expr) in &all {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{title}: {expr} charts no idem metric");
        for n in names {
            assert!(METRICS.contains(&n.as_str()), "{title}: unknown metric {n}");
            used.push(n);
        }
    }
    for metric in METRICS {
        assert!(used.iter().any(|u| u == metric), "no panel charts {metric}");
    }
    // Panel ids are how Grafana links and remembers panels: they must be unique.
    let mut ids: Vec<_> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_u64().expect("id"))
        .collect();
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), n, "duplicate panel ids");
}

#[test]
fn the_alert_rules_watch_the_issue_s_metrics_by_their_names() {
    let rules = ops_file("alerts.yml");
    let exprs: Vec<&str> = rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    let names = metric_names(&exprs.join("\n"));
    for n in &names {
        assert!(
            METRICS.contains(&n.as_str()),
            "alerts.yml: unknown metric {n}"
        );
    }
    for watched in [
        m::STALE_IN_FLIGHT,
        m::RECONCILED_TOTAL,
        m::SWEEPER_BACKLOG,
        m::CLAIMS_TOTAL,
        m::CLAIM_SECONDS,
        m::COMPLETIONS_TOTAL,
        m::RUNNING_EXECUTIONS,
        m::RUNNING_LIMIT,
    ] {
        assert!(
            names.iter().any(|n| n == watched),
            "no alert watches {watched}"
        );
    }
}
