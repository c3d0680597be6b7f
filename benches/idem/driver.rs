//! The driver: database, server child, load, table.

use tokio::io::AsyncBufReadExt;
use tokio::task::JoinSet;

use super::*;

/// Every knob, from the environment.
pub struct Settings {
    /// `IDEM_BENCH_SECS` (10): measured seconds per scenario.
    secs: f64,
    /// `IDEM_BENCH_WARMUP_SECS` (2): seconds of load before measuring, not counted.
    warmup: f64,
    /// `IDEM_BENCH_CLIENTS` (8): concurrent clients in every scenario but (e).
    clients: usize,
    /// `IDEM_BENCH_SLICES` (5): each scenario's measured time is cut into this
    /// many slices, run round-robin with the other scenarios' (a b c ... a b c
    /// ...), so that load from elsewhere on a shared machine hits all alike. One
    /// scenario alone runs in one piece.
    slices: usize,
    /// `IDEM_BENCH_CONTENTION_CLIENTS` (64) and `IDEM_BENCH_CONTENTION_KEYS` (16).
    contention_clients: usize,
    contention_keys: usize,
    /// `IDEM_BENCH_REPLAY_KEYS` (1000): completed keys that (c) replays.
    replay_keys: usize,
    /// `IDEM_BENCH_SCENARIOS` (abcdef): which scenarios, in that order.
    scenarios: String,
    /// `IDEM_BENCH_PROFILE_REQUESTS` (200; 0 skips): sequential requests per
    /// scenario through the counting proxy.
    profile_requests: usize,
    /// `IDEM_BENCH_ADMIN_URL` (or `IDEM_TEST_DATABASE_URL`, or the local server).
    admin_url: String,
    /// `IDEM_BENCH_KEEP_DB=1` keeps the database for inspection.
    keep_db: bool,
}

impl Settings {
    fn from_env() -> Result<Settings, String> {
        let admin_url = std::env::var("IDEM_BENCH_ADMIN_URL")
            .or_else(|_| std::env::var("IDEM_TEST_DATABASE_URL"))
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        Ok(Settings {
            secs: env_or("IDEM_BENCH_SECS", 10.0)?,
            warmup: env_or("IDEM_BENCH_WARMUP_SECS", 2.0)?,
            clients: env_or("IDEM_BENCH_CLIENTS", 8)?,
            slices: env_or("IDEM_BENCH_SLICES", 5_usize)?.max(1),
            contention_clients: env_or("IDEM_BENCH_CONTENTION_CLIENTS", 64)?,
            contention_keys: env_or("IDEM_BENCH_CONTENTION_KEYS", 16)?,
            replay_keys: env_or("IDEM_BENCH_REPLAY_KEYS", 1000)?,
            scenarios: env_or("IDEM_BENCH_SCENARIOS", "abcdef".to_owned())?,
            profile_requests: env_or("IDEM_BENCH_PROFILE_REQUESTS", 200)?,
            admin_url,
            keep_db: std::env::var("IDEM_BENCH_KEEP_DB").as_deref() == Ok("1"),
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Bare,
    Idem,
    Replay,
    Middleware,
    Contention,
    Leased,
}

struct Scenario {
    id: char,
    kind: Kind,
    title: &'static str,
    path: &'static str,
    tenant: &'static str,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        id: 'a',
        kind: Kind::Bare,
        title: "bare insert, 1 tx",
        path: "/bare/orders",
        tenant: "bench-a",
    },
    Scenario {
        id: 'b',
        kind: Kind::Idem,
        title: "#[idempotent] first exec",
        path: "/idem/orders",
        tenant: "bench-b",
    },
    Scenario {
        id: 'c',
        kind: Kind::Replay,
        title: "#[idempotent] replay",
        path: "/idem/orders",
        tenant: "bench-c",
    },
    Scenario {
        id: 'd',
        kind: Kind::Middleware,
        title: "middleware, 3 tx",
        path: "/mw/orders",
        tenant: "bench-d",
    },
    Scenario {
        id: 'e',
        kind: Kind::Contention,
        title: "contention 64c/16 keys",
        path: "/idem/orders",
        tenant: "bench-e",
    },
    Scenario {
        id: 'f',
        kind: Kind::Leased,
        title: "leased first exec",
        path: "/leased/orders",
        tenant: "bench-f",
    },
];

// --- the server child and /proc -----------------------------------------------

struct Server {
    child: tokio::process::Child,
    pid: u32,
    base: String,
    /// The database's name, to find its backends' CPU time.
    database: String,
}

impl Server {
    async fn start(database_url: &str, extra_env: &[(&str, &str)]) -> Result<Server, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        // `IDEM_BENCH_SERVER_WRAPPER="valgrind --tool=callgrind"` profiles the server.
        let wrapper = std::env::var("IDEM_BENCH_SERVER_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut cmd = match words.next() {
            Some(program) => {
                let mut c = tokio::process::Command::new(program);
                c.args(words).arg(exe);
                c
            }
            None => tokio::process::Command::new(exe),
        };
        cmd.env(ROLE_ENV, "server")
            .env("DATABASE_URL", database_url)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the server: {e}"))?;
        let pid = child.id().ok_or("the server exited at once")?;
        let stdout = child.stdout.take().ok_or("no server stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = line.strip_prefix(LISTENING) {
                    return Some(addr.trim().to_owned());
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .ok_or("the server did not report its address")?;
        let database = database_url
            .split('?')
            .next()
            .and_then(|u| u.rsplit('/').next())
            .unwrap_or_default()
            .to_owned();
        Ok(Server {
            child,
            pid,
            base: format!("http://{addr}"),
            database,
        })
    }

    async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets a process's peak RSS to its current RSS (Linux `clear_refs` 5).
fn reset_peak(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

/// User plus system CPU of a process in clock ticks (USER_HZ, 100 on Linux).
fn cpu_ticks(pid: &str) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat[open + 1..close].to_owned();
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

/// CPU ticks of the server, of the PostgreSQL backends serving `database` (their
/// process title names it: `postgres: user database host(port) state`), and of
/// this driver. Backends of other databases, whatever else runs on the machine,
/// and PostgreSQL's background processes are not counted.
fn cpu_snapshot(server_pid: u32, database: &str) -> [u64; 3] {
    let server = cpu_ticks(&server_pid.to_string()).map_or(0, |c| c.1);
    let me = cpu_ticks("self").map_or(0, |c| c.1);
    let needle = format!(" {database} ");
    let mut pg = 0;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.bytes().all(|b| b.is_ascii_digit())
                && let Some((comm, ticks)) = cpu_ticks(&name)
                && comm == "postgres"
                && std::fs::read(format!("/proc/{name}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
            {
                pg += ticks;
            }
        }
    }
    [server, pg, me]
}

const TICK_SECS: f64 = 0.01;

// --- requests ---------------------------------------------------------------------

struct Answer {
    status: u16,
    replayed: bool,
    retry_after: bool,
    body: Bytes,
}

fn order_body(key: &str) -> String {
    format!(r#"{{"sku":"A-1","quantity":2,"amount_cents":1999,"currency":"EUR","note":"{key}"}}"#)
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    tenant: &str,
    key: &str,
) -> Result<Answer, String> {
    let resp = client
        .post(url)
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(order_body(key))
        .send()
        .await
        .map_err(|e| format!("transport: {e}"))?;
    let status = resp.status().as_u16();
    let replayed = resp.headers().get("idempotent-replayed").is_some();
    let retry_after = resp.headers().get("retry-after").is_some();
    let body = resp.bytes().await.map_err(|e| format!("body: {e}"))?;
    Ok(Answer {
        status,
        replayed,
        retry_after,
        body,
    })
}

fn http_client(max_idle: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(max_idle)
        .build()
        .expect("reqwest client")
}

// --- one scenario -----------------------------------------------------------------

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    requests: u64,
    errors: u64,
    in_flight_409: u64,
    executed_total: u64,
    error_examples: Vec<String>,
    last_done: Option<Instant>,
    rounds: u64,
    rounds_total: u64,
    divergent: u64,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.latencies_us.extend(o.latencies_us);
        self.requests += o.requests;
        self.errors += o.errors;
        self.in_flight_409 += o.in_flight_409;
        self.executed_total += o.executed_total;
        for e in o.error_examples {
            if self.error_examples.len() < 5 {
                self.error_examples.push(e);
            }
        }
        self.last_done = self.last_done.max(o.last_done);
        self.rounds += o.rounds;
        self.rounds_total += o.rounds_total;
        self.divergent += o.divergent;
    }

    fn error(&mut self, what: String) {
        self.errors += 1;
        if self.error_examples.len() < 5 {
            self.error_examples.push(what);
        }
    }
}

fn describe(a: &Answer) -> String {
    let body = String::from_utf8_lossy(&a.body);
    let body: String = body.chars().take(160).collect();
    format!("{} {}", a.status, body)
}

/// One client of (a), (b), (c), (d) or (f): requests back to back until `end`.
/// When a scenario's clients measure: from the end of the warm-up to `end`.
#[derive(Clone, Copy)]
struct Window {
    measure_from: Instant,
    end: Instant,
}

async fn client_loop(
    client: reqwest::Client,
    url: String,
    sc: &'static Scenario,
    (slice, index, clients, replay_keys): (usize, usize, usize, usize),
    Window { measure_from, end }: Window,
) -> Tally {
    let mut t = Tally::default();
    let mut seq = 0usize;
    while Instant::now() < end {
        let key = match sc.kind {
            Kind::Replay => {
                format!("c-{}", (index * replay_keys / clients + seq) % replay_keys)
            }
            _ => format!("{}-{slice}-{index}-{seq}", sc.id),
        };
        seq += 1;
        let started = Instant::now();
        let answer = send(&client, &url, sc.tenant, &key).await;
        let done = Instant::now();
        let ok = match &answer {
            Ok(a) if sc.kind == Kind::Replay => a.status == 201 && a.replayed,
            Ok(a) => a.status == 201 && !a.replayed,
            Err(_) => false,
        };
        if let Ok(a) = &answer
            && a.status == 201
            && !a.replayed
        {
            t.executed_total += 1;
        }
        if started < measure_from {
            continue;
        }
        t.requests += 1;
        t.latencies_us
            .push(u32::try_from(done.duration_since(started).as_micros()).unwrap_or(u32::MAX));
        t.last_done = Some(done);
        if !ok {
            t.error(match answer {
                Ok(a) => describe(&a),
                Err(e) => e,
            });
        }
    }
    t
}

/// One client's request in a round of (e): retried after a `409` that carries
/// `Retry-After`; every attempt is a request in the tally.
async fn contention_request(
    client: reqwest::Client,
    url: String,
    tenant: &'static str,
    key: String,
    record: bool,
) -> (Tally, String, Option<Bytes>) {
    let mut t = Tally::default();
    for _ in 0..100 {
        let started = Instant::now();
        let answer = send(&client, &url, tenant, &key).await;
        let done = Instant::now();
        if record {
            t.requests += 1;
            t.latencies_us
                .push(u32::try_from(done.duration_since(started).as_micros()).unwrap_or(u32::MAX));
            t.last_done = Some(done);
        }
        match answer {
            Ok(a) if a.status == 201 => {
                if !a.replayed {
                    t.executed_total += 1;
                }
                return (t, key, Some(a.body));
            }
            Ok(a) if a.status == 409 && a.retry_after => {
                if record {
                    t.in_flight_409 += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(a) => {
                t.error(describe(&a));
                return (t, key, None);
            }
            Err(e) => {
                t.error(e);
                return (t, key, None);
            }
        }
    }
    t.error(format!("{key}: still 409 after 100 attempts"));
    (t, key, None)
}

/// The keys that (c) replays, executed once each before any clock starts.
async fn prepare_replays(s: &Settings, url: &str) -> Result<(), String> {
    let client = http_client(s.clients);
    let mut set = JoinSet::new();
    for part in 0..s.clients {
        let client = client.clone();
        let url = url.to_owned();
        let (n, total) = (s.replay_keys, s.clients);
        set.spawn(async move {
            for i in (part..n).step_by(total) {
                let a = send(&client, &url, "bench-c", &format!("c-{i}")).await?;
                if a.status != 201 {
                    return Err(format!("preparing replays: {}", describe(&a)));
                }
            }
            Ok::<_, String>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// One scenario's figures, summed over its slices.
struct Measured {
    sc: &'static Scenario,
    clients: usize,
    tally: Tally,
    secs: f64,
    cpu: [f64; 3],
    rss_start: u64,
    rss_end: u64,
    rss_peak: u64,
    rss_samples: Vec<(f64, u64)>,
    rows: i64,
    distinct: i64,
    expected_rows: i64,
}

impl Measured {
    fn new(sc: &'static Scenario, clients: usize) -> Measured {
        Measured {
            sc,
            clients,
            tally: Tally::default(),
            secs: 0.0,
            cpu: [0.0; 3],
            rss_start: 0,
            rss_end: 0,
            rss_peak: 0,
            rss_samples: Vec::new(),
            rows: 0,
            distinct: 0,
            expected_rows: 0,
        }
    }

    fn throughput(&self) -> f64 {
        self.tally.requests as f64 / self.secs.max(1e-3)
    }

    fn percentile(&self, p: f64) -> f64 {
        let l = &self.tally.latencies_us;
        if l.is_empty() {
            return 0.0;
        }
        let i = ((l.len() as f64 - 1.0) * p).round() as usize;
        l[i] as f64 / 1000.0
    }

    fn exactly_once(&self) -> bool {
        self.rows == self.expected_rows && self.distinct == self.rows
    }
}

/// One slice of a scenario: `warmup` seconds of load that are not counted, then
/// `secs` measured, added to `m`.
async fn run_slice(
    s: &Settings,
    m: &mut Measured,
    slice: usize,
    (warmup, secs): (f64, f64),
    server: &Server,
    client: &reqwest::Client,
) -> Result<(), String> {
    let sc = m.sc;
    let url = format!("{}{}", server.base, sc.path);
    let clients = m.clients;
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(warmup);
    let end = measure_from + Duration::from_secs_f64(secs);

    // Samples the server's memory every second of the measured window.
    let pid = server.pid;
    let sampler = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        reset_peak(pid);
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let now = Instant::now();
            samples.push((
                now.duration_since(measure_from).as_secs_f64(),
                memory_kib(pid).0,
            ));
            if now >= end {
                return samples;
            }
        }
    });
    let database = server.database.clone();
    let cpu_before = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        cpu_snapshot(pid, &database)
    });

    let mut tally = Tally::default();
    if sc.kind == Kind::Contention {
        let mut round = 0u64;
        while Instant::now() < end {
            let record = Instant::now() >= measure_from;
            let mut set = JoinSet::new();
            for c in 0..clients {
                let key = format!("e-{slice}-{round}-{}", c % s.contention_keys);
                set.spawn(contention_request(
                    client.clone(),
                    url.clone(),
                    sc.tenant,
                    key,
                    record,
                ));
            }
            // Every answer for one key must be the same bytes.
            let mut answers: HashMap<String, Bytes> = HashMap::new();
            while let Some(r) = set.join_next().await {
                let (t, key, body) = r.map_err(|e| e.to_string())?;
                tally.merge(t);
                if let Some(body) = body {
                    match answers.get(&key) {
                        Some(first) if *first != body => {
                            tally.divergent += 1;
                            tally.error(format!("{key}: two different answers"));
                        }
                        Some(_) => {}
                        None => {
                            answers.insert(key, body);
                        }
                    }
                }
            }
            if record {
                tally.rounds += 1;
            }
            round += 1;
        }
        // Warm-up rounds put rows in the table too.
        tally.rounds_total = round;
    } else {
        let mut set = JoinSet::new();
        for index in 0..clients {
            set.spawn(client_loop(
                client.clone(),
                url.clone(),
                sc,
                (slice, index, clients, s.replay_keys),
                Window { measure_from, end },
            ));
        }
        while let Some(r) = set.join_next().await {
            tally.merge(r.map_err(|e| e.to_string())?);
        }
    }
    let cpu_after = cpu_snapshot(pid, &server.database);
    let cpu_before = cpu_before.await.map_err(|e| e.to_string())?;
    let samples = sampler.await.map_err(|e| e.to_string())?;
    let (_, peak) = memory_kib(pid);
    let measured = tally
        .last_done
        .map_or(secs, |d| d.duration_since(measure_from).as_secs_f64());

    let offset = m.secs;
    if m.rss_samples.is_empty() {
        m.rss_start = samples.first().map_or(0, |s| s.1);
    }
    m.rss_end = samples.last().map_or(0, |s| s.1);
    m.rss_peak = m.rss_peak.max(peak);
    m.rss_samples
        .extend(samples.into_iter().map(|(t, kib)| (t + offset, kib)));
    m.secs += measured;
    for (i, cpu) in m.cpu.iter_mut().enumerate() {
        *cpu += cpu_after[i].saturating_sub(cpu_before[i]) as f64 * TICK_SECS;
    }
    m.tally.merge(tally);
    Ok(())
}

/// Counts the scenario's business rows: one per executed key, never two.
async fn check_rows(s: &Settings, m: &mut Measured, pool: &PgPool) -> Result<(), String> {
    let row = sqlx::query(
        "SELECT count(*) AS rows, count(DISTINCT note) AS distinct_notes \
         FROM orders WHERE tenant_id = $1",
    )
    .bind(m.sc.tenant)
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    m.rows = row.get("rows");
    m.distinct = row.get("distinct_notes");
    m.expected_rows = match m.sc.kind {
        Kind::Contention => (m.tally.rounds_total * s.contention_keys as u64) as i64,
        Kind::Replay => s.replay_keys as i64,
        _ => m.tally.executed_total as i64,
    };
    m.tally.latencies_us.sort_unstable();
    Ok(())
}

// --- the statement profile ----------------------------------------------------------

struct Profiled {
    id: char,
    title: &'static str,
    per_request: proxy::Stats,
    n: usize,
}

fn diff(after: &proxy::Stats, before: &proxy::Stats) -> proxy::Stats {
    let map = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| {
        a.iter()
            .filter_map(|(k, v)| {
                let d = v - b.get(k).copied().unwrap_or(0);
                (d > 0).then(|| (k.clone(), d))
            })
            .collect()
    };
    proxy::Stats {
        round_trips: after.round_trips - before.round_trips,
        pings: after.pings - before.pings,
        parse: after.parse - before.parse,
        bind: after.bind - before.bind,
        execute: after.execute - before.execute,
        simple_query: after.simple_query - before.simple_query,
        sync: after.sync - before.sync,
        bytes_up: after.bytes_up - before.bytes_up,
        bytes_down: after.bytes_down - before.bytes_down,
        statements: map(&after.statements, &before.statements),
        parsed: map(&after.parsed, &before.parsed),
    }
}

async fn protocol_stats(client: &reqwest::Client, base: &str) -> Result<proxy::Stats, String> {
    client
        .get(format!("{base}/bench/protocol"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())
}

/// Sequential requests through the counting proxy: exact statements and round
/// trips per request of each scenario.
async fn profile(s: &Settings, url: &str) -> Result<Vec<Profiled>, String> {
    let server = Server::start(url, &[("IDEM_BENCH_PROXY", "1")]).await?;
    let client = http_client(1);
    let n = s.profile_requests;
    let mut out = Vec::new();
    for sc in SCENARIOS {
        if sc.kind == Kind::Contention || !s.scenarios.contains(sc.id) {
            continue;
        }
        let url = format!("{}{}", server.base, sc.path);
        let tenant = format!("profile-{}", sc.id);
        let key = |i: usize| format!("p{}-{i}", sc.id);
        if sc.kind == Kind::Replay {
            for i in 0..n {
                send(&client, &url, &tenant, &key(i)).await?;
            }
        }
        // Two warm-up requests, so every connection-level statement is prepared.
        for i in 0..2 {
            send(&client, &url, &tenant, &format!("pw{}-{i}", sc.id)).await?;
        }
        let before = protocol_stats(&client, &server.base).await?;
        for i in 0..n {
            let a = send(&client, &url, &tenant, &key(i)).await?;
            if a.status != 201 {
                return Err(format!("profile ({}): {}", sc.id, describe(&a)));
            }
        }
        let after = protocol_stats(&client, &server.base).await?;
        out.push(Profiled {
            id: sc.id,
            title: sc.title,
            per_request: diff(&after, &before),
            n,
        });
    }
    server.stop().await;
    Ok(out)
}

// --- machine, database, report --------------------------------------------------------

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    format!(
        "{cores} cores ({model}), {:.1} GiB memory",
        mem_kib as f64 / 1024.0 / 1024.0
    )
}

fn database_url(admin: &str, name: &str) -> String {
    let (base, query) = match admin.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (admin, None),
    };
    let authority_end = base
        .find("://")
        .map(|i| i + 3)
        .and_then(|start| base[start..].find('/').map(|j| start + j))
        .unwrap_or(base.len());
    let mut url = format!("{}/{name}", &base[..authority_end]);
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    url
}

async fn admin_exec(admin: &str, sql: String) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .map_err(|e| format!("PostgreSQL at {admin}: {e}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    conn.close().await.ok();
    Ok(())
}

/// Drops `idem_bench_<pid>` databases whose process is gone (a killed run).
async fn drop_stale(admin: &str) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .map_err(|e| format!("PostgreSQL at {admin}: {e}"))?;
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_bench\\_%'")
            .fetch_all(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    conn.close().await.ok();
    for name in names {
        let pid = name.trim_start_matches("idem_bench_");
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            admin_exec(
                admin,
                format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            )
            .await?;
        }
    }
    Ok(())
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn table(results: &[Measured]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<30} {:>3} {:>7} {:>8} {:>7} {:>7} {:>7} {:>4} {:>4} {:>11} {:>8} {:>8} {:>8} {:>16}",
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
        "gen us",
        "RSS MiB st/end/pk"
    );
    for m in results {
        let n = m.tally.requests.max(1) as f64;
        let us = |cpu: f64| cpu * 1e6 / n;
        let _ = writeln!(
            t,
            "{:<30} {:>3} {:>7} {:>8.0} {:>7.2} {:>7.2} {:>7.1} {:>4} {:>4} {:>11} {:>8.0} {:>8.0} {:>8.0} {:>16}",
            format!("({}) {}", m.sc.id, m.sc.title),
            m.clients,
            m.tally.requests,
            m.throughput(),
            m.percentile(0.50),
            m.percentile(0.99),
            m.percentile(1.0),
            m.tally.errors,
            m.tally.in_flight_409,
            format!(
                "{}/{}{}",
                m.rows,
                m.expected_rows,
                if m.exactly_once() { "" } else { "!" }
            ),
            us(m.cpu[0]),
            us(m.cpu[1]),
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

fn ratios(results: &[Measured]) -> String {
    let thr = |id: char| {
        results
            .iter()
            .find(|m| m.sc.id == id)
            .map(Measured::throughput)
    };
    // CPU per request, server + PostgreSQL + load generator: on a CPU-bound
    // machine the throughput ratio follows its inverse, and unlike throughput it
    // hardly moves with load from elsewhere.
    let cpu = |id: char| {
        results
            .iter()
            .find(|m| m.sc.id == id)
            .map(|m| m.cpu.iter().sum::<f64>() / m.tally.requests.max(1) as f64)
    };
    let mut t = String::new();
    let mut ratio = |name: &str, num: char, den: char, target: f64| {
        if let (Some(a), Some(b), Some(ca), Some(cb)) = (thr(num), thr(den), cpu(num), cpu(den)) {
            let r = a / b;
            let _ = writeln!(
                t,
                "{name:<5} = {r:>5.2}   target >= {target:.2}   {:<8} (by CPU per request: {:.2})",
                if r >= target { "met" } else { "NOT met" },
                cb / ca
            );
        }
    };
    ratio("b/a", 'b', 'a', 0.80);
    ratio("c/b", 'c', 'b', 2.0);
    ratio("b/d", 'b', 'd', 1.5);
    if let Some(e) = results.iter().find(|m| m.sc.kind == Kind::Contention) {
        let _ = writeln!(
            t,
            "(e)   {} rounds measured ({} in all), {} errors, {} answers 409 + Retry-After (retried after 20 ms), \
             {} divergent answers, business rows {} for {} keys: {}",
            e.tally.rounds,
            e.tally.rounds_total,
            e.tally.errors,
            e.tally.in_flight_409,
            e.tally.divergent,
            e.rows,
            e.expected_rows,
            if e.exactly_once() && e.tally.errors == 0 {
                "exactly once, met"
            } else {
                "NOT met"
            }
        );
    }
    t
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

pub async fn main() -> Result<(), String> {
    let s = Settings::from_env()?;
    let load_before = loadavg();
    drop_stale(&s.admin_url).await?;
    let name = format!("idem_bench_{}", std::process::id());
    admin_exec(&s.admin_url, format!("CREATE DATABASE {name}")).await?;
    let url = database_url(&s.admin_url, &name);
    let result = run_all(&s, &url, &load_before).await;
    if s.keep_db {
        eprintln!("kept database {name}");
    } else {
        admin_exec(
            &s.admin_url,
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
        .await?;
    }
    result
}

async fn run_all(s: &Settings, url: &str, load_before: &str) -> Result<(), String> {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    idem_runtime::migrate(&pool)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::raw_sql(SCHEMA)
        .execute(&pool)
        .await
        .map_err(|e| e.to_string())?;
    let pg: String = sqlx::query_scalar(
        "SELECT 'PostgreSQL ' || current_setting('server_version') \
             || ', fsync ' || current_setting('fsync') \
             || ', synchronous_commit ' || current_setting('synchronous_commit') \
             || ', shared_buffers ' || current_setting('shared_buffers')",
    )
    .fetch_one(&pool)
    .await
    .map_err(|e| e.to_string())?;

    eprintln!(
        "idem bench: {} s per scenario after {} s warm-up, {} clients ({} over {} keys in (e)); load {load_before}",
        s.secs, s.warmup, s.clients, s.contention_clients, s.contention_keys
    );
    let server = Server::start(url, &[]).await?;
    let selected: Vec<&'static Scenario> = SCENARIOS
        .iter()
        .filter(|sc| s.scenarios.contains(sc.id))
        .collect();
    let mut results: Vec<Measured> = Vec::new();
    let mut clients = Vec::new();
    for sc in &selected {
        let n = if sc.kind == Kind::Contention {
            s.contention_clients
        } else {
            s.clients
        };
        if sc.kind == Kind::Replay {
            prepare_replays(s, &format!("{}{}", server.base, sc.path)).await?;
        }
        results.push(Measured::new(sc, n));
        clients.push(http_client(n));
    }
    let _ = sqlx::raw_sql("VACUUM ANALYZE").execute(&pool).await;
    let slices = if selected.len() == 1 { 1 } else { s.slices };
    for slice in 0..slices {
        for (m, client) in results.iter_mut().zip(&clients) {
            eprintln!(
                "idem bench: ({}) {}, slice {}/{slices} ...",
                m.sc.id,
                m.sc.title,
                slice + 1
            );
            // The first slice warms the scenario up; later ones settle briefly.
            let warmup = if slice == 0 {
                s.warmup
            } else {
                s.warmup.min(0.5)
            };
            let secs = s.secs / slices as f64;
            run_slice(s, m, slice, (warmup, secs), &server, client).await?;
        }
    }
    for m in &mut results {
        check_rows(s, m, &pool).await?;
        for e in &m.tally.error_examples {
            eprintln!("  ({}) error: {e}", m.sc.id);
        }
    }
    let (_, server_peak) = memory_kib(server.pid);
    server.stop().await;

    let profiled = if s.profile_requests > 0 {
        eprintln!(
            "idem bench: statement profile ({} sequential requests per scenario) ...",
            s.profile_requests
        );
        profile(s, url).await?
    } else {
        Vec::new()
    };
    let load_after = loadavg();

    let mut out = String::new();
    let _ = writeln!(out, "\nidem bench: {}; {pg}", machine());
    let _ = writeln!(
        out,
        "{} s measured per scenario in {} interleaved slices, after {} s warm-up; {} clients, (e) {} clients over {} fresh keys per round; \
         load average before {load_before}, after {load_after}\n",
        s.secs,
        if s.scenarios.len() == 1 { 1 } else { s.slices },
        s.warmup,
        s.clients,
        s.contention_clients,
        s.contention_keys
    );
    out.push_str(&table(&results));
    let _ = writeln!(
        out,
        "(srv/pg/gen us: CPU microseconds per request in the server process, in the PostgreSQL backends of the bench database, in this load generator)\n"
    );
    out.push_str(&ratios(&results));
    let _ = writeln!(
        out,
        "server peak RSS over the whole run: {:.1} MiB (last scenario's window)",
        mib(server_peak)
    );
    for m in &results {
        if m.rss_samples.len() >= 30 {
            let marks: Vec<String> = m
                .rss_samples
                .iter()
                .step_by(10)
                .map(|(t, kib)| format!("{t:.0}s {:.1}", mib(*kib)))
                .collect();
            let _ = writeln!(out, "({}) RSS MiB over time: {}", m.sc.id, marks.join(", "));
        }
    }
    if !profiled.is_empty() {
        let _ = writeln!(
            out,
            "\nstatement profile (through a counting proxy; RTs = round trips; pings = sqlx liveness pings, on acquire (test_before_acquire) and on release):"
        );
        out.push_str(&profile_table(&profiled));
    }
    println!("{out}");
    pool.close().await;
    Ok(())
}
