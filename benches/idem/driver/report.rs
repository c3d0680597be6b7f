//! The report: one table per database and RTT, the ratios, the contention lines,
//! the proxy's check, the targets side by side, the memory run, the profile.

use super::*;

pub struct Report<'a> {
    pub s: &'a Settings,
    pub header: String,
    /// A line for each Redis target the run could not reach.
    pub redis_skipped: &'a [String],
    pub groups: &'a [Group],
    pub long_ops: &'a [LongOps],
    pub rss: Option<&'a Measured>,
    pub profiled: &'a [Profiled],
}

/// The targets of the issue at one RTT.
struct Targets {
    b_a: f64,
    b_d: f64,
    c_b: f64,
}

/// The targets are set at RTT 0 and at RTT 1 ms; other RTTs are shown without.
fn targets(db: Db) -> Option<Targets> {
    match db {
        Db::Postgres { rtt_us: 0 } => Some(Targets {
            b_a: 0.55,
            b_d: 1.5,
            c_b: 3.0,
        }),
        Db::Postgres { rtt_us: 1000 } => Some(Targets {
            b_a: 0.85,
            b_d: 2.0,
            c_b: 3.0,
        }),
        _ => None,
    }
}

/// What a first execution (b) costs beside the bare transaction (a), by CPU per
/// request: the database's backends as a multiple of (a)'s (target: at most
/// 2.0), the server's as microseconds added (target: at most 50). Judged on
/// PostgreSQL, printed for every database.
fn cpu_lines(db: Db, results: &[&Measured]) -> String {
    let (Some(a), Some(b)) = (find(results, 'a'), find(results, 'b')) else {
        return String::new();
    };
    let per = |m: &Measured, i: usize| m.cpu[i] * 1e6 / m.tally.requests.max(1) as f64;
    let (db_a, db_b) = (per(a, 1), per(b, 1));
    let (srv_a, srv_b) = (per(a, 0), per(b, 0));
    let db_ratio = db_b / db_a.max(1e-9);
    let srv_added = srv_b - srv_a;
    let judged = matches!(db, Db::Postgres { .. });
    let judge = |met: bool, target: &str| {
        if judged {
            format!("target {target:<8} {:<8}", verdict(met))
        } else {
            format!("{:<25}", "no target")
        }
    };
    // More decimals only where a verdict stands beside the figure.
    let (db_shown, srv_shown) = if judged {
        (beside(db_ratio, 2.0, 2), beside(srv_added, 50.0, 0))
    } else {
        (format!("{db_ratio:.2}"), format!("{srv_added:.0}"))
    };
    let srv_shown = if srv_added >= 0.0 {
        format!("+{srv_shown}")
    } else {
        srv_shown
    };
    format!(
        "db us b/a = {db_shown:>5}   {}({db_b:.0} us against {db_a:.0})\n\
         srv us b-a = {srv_shown:>5}   {}({srv_b:.0} us against {srv_a:.0})\n",
        judge(db_ratio <= 2.0, "<= 2.00"),
        judge(srv_added <= 50.0, "<= +50"),
    )
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

/// `value` as printed beside its `target`: with `decimals` decimals, or up to
/// three more where that many would show the target's own figure for a value
/// that is not the target, so that the figure agrees with its verdict: a ratio
/// of 0.549 against 0.55 reads "0.549 >= 0.55: NOT met", never "0.55 >= 0.55:
/// NOT met".
fn beside(value: f64, target: f64, decimals: usize) -> String {
    (decimals..=decimals + 3)
        .map(|d| (format!("{value:.d$}"), format!("{target:.d$}")))
        .find(|(shown, at)| shown != at || value == target)
        .map_or_else(|| format!("{value:.0$}", decimals + 3), |(shown, _)| shown)
}

/// The scenarios of one database (and RTT) in a group.
fn of(results: &[Measured], db: Db) -> Vec<&Measured> {
    results.iter().filter(|m| m.db == db).collect()
}

fn find<'m>(results: &[&'m Measured], id: char) -> Option<&'m Measured> {
    results.iter().copied().find(|m| m.sc.id == id)
}

/// A throughput ratio and the same ratio by CPU per request.
fn ratio(results: &[&Measured], num: char, den: char) -> Option<(f64, f64)> {
    let (n, d) = (find(results, num)?, find(results, den)?);
    Some((
        n.throughput() / d.throughput().max(1e-9),
        d.cpu_per_request() / n.cpu_per_request().max(1e-12),
    ))
}

impl Report<'_> {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n{}\n", self.header);
        let mut dbs: Vec<Db> = Vec::new();
        for g in self.groups {
            for m in &g.results {
                if !dbs.contains(&m.db) {
                    dbs.push(m.db);
                }
            }
        }
        // PostgreSQL by RTT first, then SQLite, MySQL, Redis last.
        dbs.sort_by_key(|db| match db {
            Db::Postgres { rtt_us } => (0, *rtt_us),
            Db::Sqlite => (1, 0),
            Db::MySql => (2, 0),
            Db::Redis(RedisAt::Server) => (3, 0),
            Db::Redis(RedisAt::Cluster) => (3, 1),
            Db::Redis(RedisAt::ClusterAcks) => (3, 2),
        });
        for db in &dbs {
            let results: Vec<&Measured> = self
                .groups
                .iter()
                .flat_map(|g| of(&g.results, *db))
                .collect();
            out.push_str(&self.section(*db, &results));
        }
        out.push_str(&self.redis_lines());
        out.push_str(&self.proxy_check());
        out.push_str(&self.targets_table());
        out.push_str(&long_ops_lines(self.long_ops));
        if let Some(m) = self.rss {
            out.push_str(&rss_lines(m));
        }
        if !self.profiled.is_empty() {
            let _ = writeln!(
                out,
                "\nstatement profile (through a counting proxy, no delay; RTs = round trips; pings = sqlx \
                 liveness pings, on acquire (test_before_acquire) and on release):"
            );
            out.push_str(&profile_table(self.profiled));
        }
        out
    }

    /// One database's table, ratios and contention lines.
    fn section(&self, db: Db, results: &[&Measured]) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "== {} ==", db.label());
        t.push_str(&table(results));
        for (name, num, den) in [
            ("b/a", 'b', 'a'),
            ("b/d", 'b', 'd'),
            ("c/b", 'c', 'b'),
            ("i/b", 'i', 'b'),
            ("s/b", 's', 'b'),
            ("t/c", 't', 'c'),
            ("b/g", 'b', 'g'),
            ("f/b", 'f', 'b'),
            ("j/f", 'j', 'f'),
        ] {
            let Some((r, by_cpu)) = ratio(results, num, den) else {
                continue;
            };
            let target = targets(db).and_then(|t| match name {
                "b/a" => Some(t.b_a),
                "b/d" => Some(t.b_d),
                "c/b" => Some(t.c_b),
                _ => None,
            });
            let (shown, judged) = match target {
                Some(x) => (
                    beside(r, x, 2),
                    format!("target >= {x:.2}   {:<8}", verdict(r >= x)),
                ),
                None => (format!("{r:.2}"), format!("{:<25}", "no target")),
            };
            let _ = writeln!(
                t,
                "{name} = {shown:>5}   {judged} (by CPU per request: {by_cpu:.2})"
            );
        }
        t.push_str(&cpu_lines(db, results));
        for m in results.iter().filter(|m| m.sc.kind.is_contention()) {
            t.push_str(&contention_line(m));
        }
        t.push('\n');
        t
    }

    /// Leased mode's first executions (f) and replays (j) side by side: its
    /// records in PostgreSQL (RTT 0), in one Redis, in the Redis Cluster, and
    /// in the cluster with `WAIT`; and the Redis targets the run skipped.
    fn redis_lines(&self) -> String {
        let mut t = String::new();
        let all: Vec<&Measured> = self.groups.iter().flat_map(|g| &g.results).collect();
        let at = |db: Db, id: char| all.iter().copied().find(|m| m.db == db && m.sc.id == id);
        let columns = [
            ("PostgreSQL", Db::Postgres { rtt_us: 0 }),
            ("Redis", Db::Redis(RedisAt::Server)),
            ("Cluster", Db::Redis(RedisAt::Cluster)),
            ("Cluster+WAIT", Db::Redis(RedisAt::ClusterAcks)),
        ];
        let redis_ran = all.iter().any(|m| matches!(m.db, Db::Redis(_)));
        if redis_ran {
            let _ = writeln!(
                t,
                "leased mode by where its records are (req/s, p50 ms; the insert on PostgreSQL at RTT 0 \
                 in all; WAIT: with_replica_acks({}), no target):",
                self.s.redis_acks.replace(':', ", ") + " ms"
            );
            for (id, what) in [('f', "(f) first exec"), ('j', "(j) replay")] {
                let _ = write!(t, "{what:<16}");
                for (name, db) in columns {
                    let cell = match at(db, id) {
                        Some(m) => {
                            format!("{name} {:.0} / {:.2}", m.throughput(), m.percentile(0.5))
                        }
                        None => format!("{name} -"),
                    };
                    let _ = write!(t, " {cell:<28}");
                }
                t.push('\n');
            }
            for (name, (num, den)) in [
                (
                    "Redis / PostgreSQL",
                    (Db::Redis(RedisAt::Server), Db::Postgres { rtt_us: 0 }),
                ),
                (
                    "Cluster / Redis",
                    (Db::Redis(RedisAt::Cluster), Db::Redis(RedisAt::Server)),
                ),
                (
                    "WAIT / no WAIT",
                    (Db::Redis(RedisAt::ClusterAcks), Db::Redis(RedisAt::Cluster)),
                ),
            ] {
                let _ = write!(t, "{name:<20}");
                for (id, what) in [('f', "f"), ('j', "j")] {
                    let cell = match (at(num, id), at(den, id)) {
                        (Some(n), Some(d)) => format!(
                            "{what} {:.2} (p50 {:+.2} ms)",
                            n.throughput() / d.throughput().max(1e-9),
                            n.percentile(0.5) - d.percentile(0.5)
                        ),
                        _ => format!("{what} -"),
                    };
                    let _ = write!(t, " {cell:<26}");
                }
                let _ = writeln!(t, " no target");
            }
        }
        for line in self.redis_skipped {
            let _ = writeln!(t, "skipped: {line}");
        }
        if !t.is_empty() {
            t.push('\n');
        }
        t
    }

    /// At each RTT > 0: how much of the RTT shows in the median of (a) alone, one
    /// request at a time, against the round trips the profile counts, and how far
    /// from their due time the proxy wrote its chunks.
    fn proxy_check(&self) -> String {
        let mut t = String::new();
        let Some(g0) = self.groups.iter().find(|g| g.rtt_us == 0) else {
            return t;
        };
        let rts_a = self
            .profiled
            .iter()
            .find(|p| p.id == 'a')
            .map(Profiled::round_trips);
        for g in self.groups.iter().filter(|g| g.rtt_us > 0) {
            let added = g.sequential_p50 - g0.sequential_p50;
            let _ = write!(
                t,
                "proxy at RTT {} us: (a) alone, {PROBE_REQUESTS} sequential requests: p50 {:.2} ms against {:.2} ms \
                 at RTT 0, {added:+.2} ms = {:.1} RTTs on the request's path",
                g.rtt_us,
                g.sequential_p50,
                g0.sequential_p50,
                added * 1000.0 / g.rtt_us as f64
            );
            if let Some(rts) = rts_a {
                let _ = write!(t, " (profile: {rts:.0} round trips per request)");
            }
            if let Some(d) = &g.delay {
                let _ = write!(
                    t,
                    "; {} chunks delayed, written {:+.0} us from their due time on average ({:.0} us either \
                     way, at worst {} us late)",
                    d.chunks, d.off_us_mean, d.off_us_abs_mean, d.late_us_max
                );
            }
            t.push('\n');
        }
        if !t.is_empty() {
            t.push('\n');
        }
        t
    }

    /// The targets, one column per PostgreSQL RTT.
    fn targets_table(&self) -> String {
        let rtts: Vec<u64> = self.groups.iter().map(|g| g.rtt_us).collect();
        let results = |rtt_us: u64| -> Vec<&Measured> {
            self.groups
                .iter()
                .flat_map(|g| of(&g.results, Db::Postgres { rtt_us }))
                .collect()
        };
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        for (name, num, den, pick) in [
            ("b/a (first exec vs bare)", 'b', 'a', 0),
            ("b/d (vs the three-commit pattern)", 'b', 'd', 1),
            ("c/b (replay vs first exec)", 'c', 'b', 2),
            ("i/b (replay, replay cache on)", 'i', 'b', 2),
        ] {
            let cells = rtts
                .iter()
                .map(|&rtt_us| {
                    let db = Db::Postgres { rtt_us };
                    let Some((r, _)) = ratio(&results(rtt_us), num, den) else {
                        return "-".to_owned();
                    };
                    match targets(db).map(|t| [t.b_a, t.b_d, t.c_b][pick]) {
                        Some(x) => format!("{} >= {x:.2}: {}", beside(r, x, 2), verdict(r >= x)),
                        None => format!("{r:.2} (no target)"),
                    }
                })
                .collect();
            rows.push((name.to_owned(), cells));
        }
        let rts = self.round_trips_cell();
        rows.push((
            "round trips per first exec".to_owned(),
            rtts.iter().map(|_| rts.clone()).collect(),
        ));
        let contention = rtts
            .iter()
            .map(|&rtt_us| match find(&results(rtt_us), 'e') {
                Some(e) => {
                    let met = e.exactly_once() && e.tally.errors == 0 && e.tally.divergent == 0;
                    format!(
                        "{} dup, {} divergent: {}",
                        e.duplicate_effects(),
                        e.tally.divergent,
                        verdict(met)
                    )
                }
                None => "-".to_owned(),
            })
            .collect();
        rows.push(("(e) exactly once, 0 divergent".to_owned(), contention));
        let peer = rtts
            .iter()
            .map(|&rtt_us| {
                let r = results(rtt_us);
                match (find(&r, 'e'), find(&r, 'h')) {
                    (Some(e), Some(h)) => format!(
                        "idem {} dup, peer {} dup: {}",
                        e.duplicate_effects(),
                        h.duplicate_effects(),
                        verdict(e.duplicate_effects() == 0 && e.exactly_once())
                    ),
                    _ => "-".to_owned(),
                }
            })
            .collect();
        rows.push(("vs the peer (e)/(h) duplicates".to_owned(), peer));
        let rss = rtts
            .iter()
            .map(|&rtt_us| match (rtt_us, self.rss) {
                (0, Some(m)) => {
                    let growth = m.rss_end as i64 - m.rss_start as i64;
                    format!(
                        "{:+.2} MiB in {:.0} s: {}",
                        growth as f64 / 1024.0,
                        m.secs,
                        verdict(growth <= 1024)
                    )
                }
                _ => "-".to_owned(),
            })
            .collect();
        rows.push(("server RSS, (b) with recorder".to_owned(), rss));

        let mut t = String::new();
        let _ = writeln!(
            t,
            "targets (PostgreSQL; {} clients, (e)/(h) {} clients):",
            self.s.clients, self.s.contention_clients
        );
        let _ = write!(t, "{:<34}", "target");
        for rtt in &rtts {
            let _ = write!(t, " {:<34}", format!("RTT {rtt} us"));
        }
        t.push('\n');
        for (name, cells) in rows {
            let _ = write!(t, "{name:<34}");
            for c in cells {
                let _ = write!(t, " {c:<34}");
            }
            t.push('\n');
        }
        t
    }

    /// Round trips of (b) against (a)'s, from the profile (the same at every
    /// RTT: the delay changes when answers come, not how many).
    fn round_trips_cell(&self) -> String {
        let rts = |id| {
            self.profiled
                .iter()
                .find(|p| p.id == id)
                .map(Profiled::round_trips)
        };
        // A connection's first use prepares idem's session statements: the failed
        // probe's ROLLBACK, the PREPARE message and the BEGIN again, three round
        // trips once per connection, not per request.
        let first_uses = self
            .profiled
            .iter()
            .find(|p| p.id == 'b')
            .map(|p| {
                p.per_request
                    .statements
                    .iter()
                    .filter(|(s, _)| s.starts_with("PREPARE idem_probe_3"))
                    .map(|(_, n)| *n)
                    .sum::<u64>() as f64
                    / p.n.max(1) as f64
            })
            .unwrap_or(0.0);
        match (rts('b'), rts('a')) {
            (Some(b), Some(a)) => {
                let steady = b - 3.0 * first_uses;
                format!(
                    "{b:.2} ({steady:.2} steady) <= {a:.2}: {}",
                    verdict(steady <= a + 0.005)
                )
            }
            _ => "no profile".to_owned(),
        }
    }
}

fn table(results: &[&Measured]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<30} {:>3} {:>7} {:>7} {:>7} {:>7} {:>7} {:>4} {:>4} {:>12} {:>6} {:>6} {:>6} {:>6} {:>16}",
        "scenario",
        "cli",
        "reqs",
        "req/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "err",
        "409",
        "rows/expect",
        "srv us",
        "pg us",
        "px us",
        "gen us",
        "RSS MiB st/end/pk"
    );
    for m in results {
        let n = m.tally.requests.max(1) as f64;
        let us = |cpu: f64| format!("{:.0}", cpu * 1e6 / n);
        let pg = match m.db {
            Db::Sqlite | Db::MySql => "-".to_owned(),
            Db::Postgres { .. } | Db::Redis(_) => us(m.cpu[1]),
        };
        // The delaying proxy's CPU, or the redis-servers'.
        let px = match m.db {
            Db::Postgres { rtt_us } if rtt_us > 0 => us(m.cpu[3]),
            Db::Redis(_) => us(m.cpu[3]),
            _ => "-".to_owned(),
        };
        // `!` marks a violation of exactly-once by idem (or a miscount); `*` the
        // peer's duplicates, which are its result.
        let mark = match (m.exactly_once(), m.sc.kind) {
            (true, _) => "",
            (false, Kind::Peer | Kind::PeerContention) => "*",
            (false, _) => "!",
        };
        let _ = writeln!(
            t,
            "{:<30} {:>3} {:>7} {:>7.0} {:>7.2} {:>7.2} {:>7.1} {:>4} {:>4} {:>12} {:>6} {:>6} {:>6} {:>6} {:>16}",
            format!("({}) {}", m.sc.id, m.sc.title),
            m.clients,
            m.tally.requests,
            m.throughput(),
            m.percentile(0.50),
            m.percentile(0.99),
            m.percentile(1.0),
            m.tally.errors,
            m.tally.in_flight_409,
            format!("{}/{}{mark}", m.rows, m.expected_rows),
            us(m.cpu[0]),
            pg,
            px,
            us(m.cpu[2]),
            format!(
                "{:.1}/{:.1}/{:.1}",
                mib(m.rss_start),
                mib(m.rss_end),
                mib(m.rss_peak)
            ),
        );
    }
    t
}

/// (e) or (h): rounds, errors, 409s, divergent answers and duplicate effects.
fn contention_line(m: &Measured) -> String {
    let who = if m.sc.kind == Kind::PeerContention {
        "peer"
    } else {
        "idem"
    };
    let verdict = match m.sc.kind {
        Kind::PeerContention => "the peer's result, not a bench error".to_owned(),
        _ if m.exactly_once() && m.tally.errors == 0 && m.tally.divergent == 0 => {
            "exactly once, met".to_owned()
        }
        _ => "NOT met".to_owned(),
    };
    format!(
        "({}) {who}: {} rounds measured ({} in all), {} errors, {} answers 409 + Retry-After, \
         {} divergent answers on {} keys; business rows {} for {} keys: {} duplicate effects on {} keys; {verdict}\n",
        m.sc.id,
        m.tally.rounds,
        m.tally.rounds_total,
        m.tally.errors,
        m.tally.in_flight_409,
        m.tally.divergent,
        m.tally.divergent_keys,
        m.rows,
        m.keys,
        m.duplicate_effects(),
        m.dup_keys,
    )
}

/// The memory run: start, end, max of the per-second samples, the verdict, and
/// the samples every 10 s.
fn rss_lines(m: &Measured) -> String {
    let max = m.rss_samples.iter().map(|s| s.1).max().unwrap_or(0);
    let growth = m.rss_end as i64 - m.rss_start as i64;
    let marks: Vec<String> = m
        .rss_samples
        .iter()
        .step_by(10)
        .map(|(t, kib)| format!("{t:.0}s {:.1}", mib(*kib)))
        .collect();
    format!(
        "\nserver RSS over {:.0} s of (b) at RTT 0 ({} requests, metrics recorder {}): start {:.1} MiB, \
         end {:.1} MiB, max {:.1} MiB (peak VmHWM {:.1}); end - start {:+.2} MiB <= 1 MiB: {}\n\
         RSS MiB over time: {}\n",
        m.secs,
        m.tally.requests,
        std::env::var("IDEM_BENCH_METRICS").unwrap_or_else(|_| "prometheus".to_owned()),
        mib(m.rss_start),
        mib(m.rss_end),
        mib(max),
        mib(m.rss_peak),
        growth as f64 / 1024.0,
        verdict(growth <= 1024),
        marks.join(", ")
    )
}

fn profile_table(profiled: &[Profiled]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<30} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>8}",
        "per request", "RTs", "pings", "Parse", "Exec", "Query", "B up", "B down"
    );
    for p in profiled {
        let n = p.n.max(1) as f64;
        let s = &p.per_request;
        let _ = writeln!(
            t,
            "{:<30} {:>6.2} {:>6.2} {:>6.2} {:>6.2} {:>6.2} {:>8.0} {:>8.0}",
            format!("({}) {}", p.id, p.title),
            s.round_trips as f64 / n,
            s.pings as f64 / n,
            s.parse as f64 / n,
            s.execute as f64 / n,
            s.simple_query as f64 / n,
            s.bytes_up as f64 / n,
            s.bytes_down as f64 / n,
        );
    }
    for p in profiled {
        let n = p.n.max(1) as f64;
        let _ = writeln!(t, "\n({}) {}: statements per request", p.id, p.title);
        for (sql, count) in &p.per_request.statements {
            let per = *count as f64 / n;
            if per >= 0.01 {
                let _ = writeln!(t, "  {per:>5.2}  {sql}");
            }
        }
        for (sql, count) in &p.per_request.parsed {
            let per = *count as f64 / n;
            if per >= 0.01 {
                let _ = writeln!(t, "  {per:>5.2}  PARSED: {sql}");
            }
        }
    }
    t
}
