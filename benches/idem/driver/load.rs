//! The load generator: requests, the clients of each scenario, one measured slice,
//! and the check of the business rows afterwards.

use tokio::task::JoinSet;

use super::*;

// --- requests ---------------------------------------------------------------------

pub struct Answer {
    pub status: u16,
    /// `Idempotent-Replayed` (idem) or `idempotency-replayed` (the peer).
    pub replayed: bool,
    pub retry_after: bool,
    pub location: Option<String>,
    pub body: Bytes,
}

impl Answer {
    /// What two answers to the same key must share, byte for byte: status,
    /// `Location` and body (not the replay marker, which says which one replayed).
    fn same_as(&self, other: &Answer) -> bool {
        (self.status, &self.location, &self.body) == (other.status, &other.location, &other.body)
    }
}

/// Where a scenario's requests go and as whom.
#[derive(Clone)]
pub struct Endpoint {
    pub url: String,
    pub tenant: String,
    /// The peer's session cookie (`session=<id>`), which it needs to cache at all.
    pub cookie: Option<String>,
}

fn order_body(key: &str) -> String {
    format!(r#"{{"sku":"A-1","quantity":2,"amount_cents":1999,"currency":"EUR","note":"{key}"}}"#)
}

pub async fn send(client: &reqwest::Client, to: &Endpoint, key: &str) -> Result<Answer, String> {
    let mut req = client
        .post(&to.url)
        .header("authorization", format!("Bearer {}", to.tenant))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(order_body(key));
    if let Some(cookie) = &to.cookie {
        req = req.header("cookie", cookie);
    }
    let resp = req.send().await.map_err(|e| format!("transport: {e}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers();
    let replayed =
        headers.contains_key("idempotent-replayed") || headers.contains_key("idempotency-replayed");
    let retry_after = headers.contains_key("retry-after");
    let location = headers
        .get("location")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = resp.bytes().await.map_err(|e| format!("body: {e}"))?;
    Ok(Answer {
        status,
        replayed,
        retry_after,
        location,
        body,
    })
}

/// Opens a session with the peer's session layer (`POST /peer/session`) and
/// answers its cookie, `session=<id>`.
pub async fn open_session(client: &reqwest::Client, base: &str) -> Result<String, String> {
    let resp = client
        .post(format!("{base}/peer/session"))
        .send()
        .await
        .map_err(|e| format!("peer session: {e}"))?;
    resp.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .find(|c| c.starts_with("session="))
        .map(str::to_owned)
        .ok_or_else(|| format!("peer session: no cookie in a {}", resp.status()))
}

pub fn http_client(max_idle: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(max_idle)
        .build()
        .expect("reqwest client")
}

pub fn describe(a: &Answer) -> String {
    let body = String::from_utf8_lossy(&a.body);
    let body: String = body.chars().take(160).collect();
    format!("{} {}", a.status, body)
}

// --- tallies ------------------------------------------------------------------------

#[derive(Default)]
pub struct Tally {
    pub latencies_us: Vec<u32>,
    pub requests: u64,
    pub errors: u64,
    pub in_flight_409: u64,
    pub executed_total: u64,
    pub error_examples: Vec<String>,
    pub last_done: Option<Instant>,
    pub rounds: u64,
    pub rounds_total: u64,
    /// Contention: answers that differ from the first answer to their key.
    pub divergent: u64,
    /// Contention: keys with at least one such answer.
    pub divergent_keys: u64,
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
        self.divergent_keys += o.divergent_keys;
    }

    fn error(&mut self, what: String) {
        self.errors += 1;
        if self.error_examples.len() < 5 {
            self.error_examples.push(what);
        }
    }

    fn record(&mut self, started: Instant, done: Instant) {
        self.requests += 1;
        self.latencies_us
            .push(u32::try_from(done.duration_since(started).as_micros()).unwrap_or(u32::MAX));
        self.last_done = Some(done);
    }
}

// --- clients ------------------------------------------------------------------------

/// When a scenario's clients measure: from the end of the warm-up to `end`.
#[derive(Clone, Copy)]
pub struct Window {
    pub measure_from: Instant,
    pub end: Instant,
}

/// One client of (a), (b), (c), (d), (f) or (g): requests back to back until
/// `end`. A client of the peer (g) opens its own session first, as a browser or
/// an app would.
async fn client_loop(
    client: reqwest::Client,
    mut to: Endpoint,
    (sc, base): (&'static Scenario, String),
    (slice, index, clients, replay_keys): (usize, usize, usize, usize),
    Window { measure_from, end }: Window,
) -> Tally {
    let mut t = Tally::default();
    if sc.kind == Kind::Peer {
        match open_session(&client, &base).await {
            Ok(cookie) => to.cookie = Some(cookie),
            Err(e) => {
                t.error(e);
                return t;
            }
        }
    }
    let mut seq = 0usize;
    while Instant::now() < end {
        let key = match sc.kind {
            Kind::Replay => format!("c-{}", (index * replay_keys / clients + seq) % replay_keys),
            _ => format!("{}-{slice}-{index}-{seq}", sc.id),
        };
        seq += 1;
        let started = Instant::now();
        let answer = send(&client, &to, &key).await;
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
        t.record(started, done);
        if !ok {
            t.error(match answer {
                Ok(a) => describe(&a),
                Err(e) => e,
            });
        }
    }
    t
}

/// One client's request in a round of (e) or (h): retried after a `409` that
/// carries `Retry-After`; every attempt is a request in the tally. Answers the
/// final answer, if any.
async fn contention_request(
    client: reqwest::Client,
    to: Endpoint,
    key: String,
    record: bool,
) -> (Tally, String, Option<Answer>) {
    let mut t = Tally::default();
    for _ in 0..100 {
        let started = Instant::now();
        let answer = send(&client, &to, &key).await;
        let done = Instant::now();
        if record {
            t.record(started, done);
        }
        match answer {
            Ok(a) if a.status == 201 => {
                if !a.replayed {
                    t.executed_total += 1;
                }
                return (t, key, Some(a));
            }
            Ok(a) if a.status == 409 && a.retry_after => {
                if record {
                    t.in_flight_409 += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(a) => {
                t.error(describe(&a));
                return (t, key, Some(a));
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

/// One round of (e) or (h): every client at once, `keys` fresh keys, the clients
/// of one key on the same peer session (the same user retrying). Every answer to
/// a key must be the same bytes as the first; for idem a difference is an error,
/// for the peer a result.
async fn contention_round(
    s: &Settings,
    (m, client, to): (&Measured, &reqwest::Client, &Endpoint),
    sessions: &[String],
    (slice, round): (usize, u64),
    record: bool,
) -> Result<Tally, String> {
    let mut tally = Tally::default();
    let mut set = JoinSet::new();
    for c in 0..m.clients {
        let slot = c % s.contention_keys;
        let key = format!("{}-{slice}-{round}-{slot}", m.sc.id);
        let mut to = to.clone();
        to.cookie = sessions.get(slot).cloned();
        set.spawn(contention_request(client.clone(), to, key, record));
    }
    let mut answers: HashMap<String, (Answer, bool)> = HashMap::new();
    while let Some(r) = set.join_next().await {
        let (t, key, answer) = r.map_err(|e| e.to_string())?;
        tally.merge(t);
        let Some(answer) = answer else { continue };
        match answers.get_mut(&key) {
            Some((first, diverged)) if !first.same_as(&answer) => {
                tally.divergent += 1;
                if !*diverged {
                    *diverged = true;
                    tally.divergent_keys += 1;
                }
                if m.sc.kind == Kind::Contention {
                    tally.error(format!("{key}: two different answers"));
                }
            }
            Some(_) => {}
            None => {
                answers.insert(key, (answer, false));
            }
        }
    }
    Ok(tally)
}

/// The proxy's check: (a)'s handler alone, one request at a time (after 20 not
/// counted), so that its median is round trips rather than queueing for the CPU.
/// Answers the median in milliseconds.
pub async fn sequential_p50(base: &str, tenant: &str, n: usize) -> Result<f64, String> {
    let client = http_client(1);
    let to = Endpoint {
        url: format!("{base}/bare/orders"),
        tenant: tenant.to_owned(),
        cookie: None,
    };
    let mut latencies = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let started = Instant::now();
        let a = send(&client, &to, &format!("probe-{i}")).await?;
        if a.status != 201 {
            return Err(format!("probe: {}", describe(&a)));
        }
        if i >= 20 {
            latencies.push(started.elapsed());
        }
    }
    latencies.sort_unstable();
    Ok(latencies
        .get(n / 2)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0))
}

/// The keys that (c) replays, executed once each before any clock starts.
pub async fn prepare_replays(s: &Settings, to: &Endpoint) -> Result<(), String> {
    let client = http_client(s.clients);
    let mut set = JoinSet::new();
    for part in 0..s.clients {
        let client = client.clone();
        let to = to.clone();
        let (n, total) = (s.replay_keys, s.clients);
        set.spawn(async move {
            for i in (part..n).step_by(total) {
                let a = send(&client, &to, &format!("c-{i}")).await?;
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

// --- one scenario -----------------------------------------------------------------

/// One scenario on one database, its figures summed over its slices.
pub struct Measured {
    pub sc: &'static Scenario,
    pub db: Db,
    pub tenant: String,
    /// Index of its server in the group's servers.
    pub server: usize,
    pub clients: usize,
    pub tally: Tally,
    pub secs: f64,
    /// CPU seconds: server (without the proxy), PostgreSQL backends, driver, proxy.
    pub cpu: [f64; 4],
    pub rss_start: u64,
    pub rss_end: u64,
    pub rss_peak: u64,
    pub rss_samples: Vec<(f64, u64)>,
    /// Business rows of the tenant, their distinct keys, and keys with more than
    /// one row.
    pub rows: i64,
    pub keys: i64,
    pub dup_keys: i64,
    pub expected_rows: i64,
}

impl Measured {
    pub fn new(sc: &'static Scenario, db: Db, server: usize, clients: usize) -> Measured {
        Measured {
            sc,
            db,
            tenant: format!("bench-{}-{}", sc.id, db.tag()),
            server,
            clients,
            tally: Tally::default(),
            secs: 0.0,
            cpu: [0.0; 4],
            rss_start: 0,
            rss_end: 0,
            rss_peak: 0,
            rss_samples: Vec::new(),
            rows: 0,
            keys: 0,
            dup_keys: 0,
            expected_rows: 0,
        }
    }

    pub fn throughput(&self) -> f64 {
        self.tally.requests as f64 / self.secs.max(1e-3)
    }

    /// The `p` quantile of the latencies in ms; they must have been sorted
    /// (`finish_check`, or the scenario's own end), which is checked: an
    /// unsorted list answers an arbitrary request's latency.
    pub fn percentile(&self, p: f64) -> f64 {
        let l = &self.tally.latencies_us;
        if l.is_empty() {
            return 0.0;
        }
        assert!(l.is_sorted(), "percentile of unsorted latencies");
        let i = ((l.len() as f64 - 1.0) * p).round() as usize;
        l[i] as f64 / 1000.0
    }

    /// Business rows: exactly the first executions the clients saw, one per key.
    pub fn exactly_once(&self) -> bool {
        self.rows == self.expected_rows && self.keys == self.rows
    }

    /// Effects beyond the first for a key.
    pub fn duplicate_effects(&self) -> i64 {
        self.rows - self.keys
    }

    /// CPU seconds per request of the server, the PostgreSQL backends and the load
    /// generator; not the proxy's, which stands for the network.
    pub fn cpu_per_request(&self) -> f64 {
        self.cpu[..3].iter().sum::<f64>() / self.tally.requests.max(1) as f64
    }

    pub fn endpoint(&self, base: &str) -> Endpoint {
        Endpoint {
            url: format!("{base}{}", self.sc.path),
            tenant: self.tenant.clone(),
            cookie: None,
        }
    }
}

/// Samples a server's memory every second of a measured window (from
/// `measure_from`, where it also resets the peak, to `end`).
fn sample_memory(
    pid: u32,
    Window { measure_from, end }: Window,
) -> tokio::task::JoinHandle<Vec<(f64, u64)>> {
    tokio::spawn(async move {
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
    })
}

/// One slice of a scenario: `warmup` seconds of load that are not counted, then
/// `secs` measured, added to `m`.
pub async fn run_slice(
    s: &Settings,
    m: &mut Measured,
    slice: usize,
    (warmup, secs): (f64, f64),
    server: &Server,
    client: &reqwest::Client,
) -> Result<(), String> {
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(warmup);
    let end = measure_from + Duration::from_secs_f64(secs);
    let window = Window { measure_from, end };
    let sampler = sample_memory(server.pid, window);
    let cpu_before = {
        let probe = server.probe();
        tokio::spawn(async move {
            tokio::time::sleep_until(measure_from.into()).await;
            cpu_snapshot(&probe)
        })
    };

    let tally = if m.sc.kind.is_contention() {
        contention_slice(s, m, slice, window, server, client).await?
    } else {
        let mut tally = Tally::default();
        let mut set = JoinSet::new();
        for index in 0..m.clients {
            set.spawn(client_loop(
                client.clone(),
                m.endpoint(&server.base),
                (m.sc, server.base.clone()),
                (slice, index, m.clients, s.replay_keys),
                window,
            ));
        }
        while let Some(r) = set.join_next().await {
            tally.merge(r.map_err(|e| e.to_string())?);
        }
        tally
    };
    let cpu_after = cpu_snapshot(&server.probe());
    let cpu_before = cpu_before.await.map_err(|e| e.to_string())?;
    let samples = sampler.await.map_err(|e| e.to_string())?;
    let (_, peak) = memory_kib(server.pid);
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

/// Rounds of (e) or (h) until the window ends; warm-up rounds are not recorded
/// but put rows in the table too (`rounds_total`).
async fn contention_slice(
    s: &Settings,
    m: &Measured,
    slice: usize,
    Window { measure_from, end }: Window,
    server: &Server,
    client: &reqwest::Client,
) -> Result<Tally, String> {
    let to = m.endpoint(&server.base);
    // The peer dedupes within a session only: the clients of one key share one.
    let mut sessions = Vec::new();
    if m.sc.kind == Kind::PeerContention {
        for _ in 0..s.contention_keys {
            sessions.push(open_session(client, &server.base).await?);
        }
    }
    let mut tally = Tally::default();
    let mut round = 0u64;
    while Instant::now() < end {
        let record = Instant::now() >= measure_from;
        let t = contention_round(s, (m, client, &to), &sessions, (slice, round), record).await?;
        tally.merge(t);
        if record {
            tally.rounds += 1;
        }
        round += 1;
    }
    tally.rounds_total = round;
    Ok(tally)
}

/// Counts the scenario's business rows: one per executed key, never two (for the
/// peer, the count of duplicates is the result).
pub async fn check_rows(s: &Settings, m: &mut Measured, pools: &Pools) -> Result<(), String> {
    const COUNTS: &str = "SELECT count(*) AS keys, \
            CAST(coalesce(sum(n), 0) AS bigint) AS rows, \
            CAST(coalesce(sum(CASE WHEN n > 1 THEN 1 ELSE 0 END), 0) AS bigint) AS dup_keys \
         FROM (SELECT count(*) AS n FROM orders WHERE tenant_id = $1 GROUP BY note) t";
    // MySQL: `?`, and SIGNED for bigint.
    const MYSQL_COUNTS: &str = "SELECT count(*) AS `keys`, \
            CAST(coalesce(sum(n), 0) AS SIGNED) AS `rows`, \
            CAST(coalesce(sum(CASE WHEN n > 1 THEN 1 ELSE 0 END), 0) AS SIGNED) AS dup_keys \
         FROM (SELECT count(*) AS n FROM orders WHERE tenant_id = ? GROUP BY note) t";
    if let (Db::MySql, Some(pool)) = (m.db, &pools.mysql) {
        let (keys, rows, dup_keys): (i64, i64, i64) = sqlx::query_as(MYSQL_COUNTS)
            .bind(&m.tenant)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
        return finish_check(s, m, (keys, rows, dup_keys));
    }
    let (keys, rows, dup_keys): (i64, i64, i64) = match (m.db, &pools.sqlite) {
        (Db::Sqlite, Some(pool)) => sqlx::query_as(COUNTS)
            .bind(&m.tenant)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?,
        _ => sqlx::query_as(COUNTS)
            .bind(&m.tenant)
            .fetch_one(&pools.pg)
            .await
            .map_err(|e| e.to_string())?,
    };
    finish_check(s, m, (keys, rows, dup_keys))
}

fn finish_check(
    s: &Settings,
    m: &mut Measured,
    (keys, rows, dup_keys): (i64, i64, i64),
) -> Result<(), String> {
    (m.keys, m.rows, m.dup_keys) = (keys, rows, dup_keys);
    m.expected_rows = match m.sc.kind {
        Kind::Contention | Kind::PeerContention => {
            (m.tally.rounds_total * s.contention_keys as u64) as i64
        }
        Kind::Replay => s.replay_keys as i64,
        _ => m.tally.executed_total as i64,
    };
    m.tally.latencies_us.sort_unstable();
    Ok(())
}
