//! The history checker: a randomized, seeded run of the real
//! `orders` example on PostgreSQL that records every request and answer, then
//! checks the history, and the database, against the promise:
//!
//! > for one tenant, one operation and one key, within the retention window, the
//! > service executes at most one accepted logical request, and every retry gets a
//! > stable representation of that request's result.
//!
//! The workload: a few logical requests (tenant + key + body; some keys are shared
//! by two tenants), each sent many times, concurrently (bursts of spawned tasks)
//! and one after another, every time in another spelling of the same JSON (keys
//! reordered, other white space), sometimes with the same key and another body or
//! another `X-Currency` (which must be `422` and have no effect). Interleaved by
//! the seed: SIGKILL of the server and a restart on the same database (idle, or in
//! the middle of a burst), `pg_terminate_backend` of the server's connections in
//! the middle of a burst, and expiry (fast-forwarding `expires_at` of one key or of
//! all, between bursts or during one), after which a retry executes anew: a new
//! retention window. Each server is started with latency, in-flight wait and
//! sweep interval drawn from the seed.
//!
//! What is checked (every violation is listed, with the seed and the history of
//! the logical request concerned):
//!
//! 1. at most one order per (tenant, key, retention window): every order carries
//!    its logical request's marker in `note`, and each must be the one named by
//!    that window's stored outcome (captured atomically when the test expires the
//!    window, or read at the end for the current one);
//! 2. every `2xx` for a (tenant, key, window) is `201` with the same bytes as that
//!    window's stored outcome (so all of them are identical), at most one of them
//!    is not marked replayed, and `Location` names the order;
//! 3. no `2xx` whose effect is missing: the order every stored outcome (hence every
//!    `2xx`) names exists, for that tenant, with that request's values;
//! 4. after the run (chaos stopped, one more restart), every logical request retried
//!    with its key settles on a `201` within a long deadline, never `409` forever,
//!    and no row is left in any state but `completed`;
//! 5. a key reused with another body or currency is `422`
//!    (`urn:idem:problem:fingerprint-mismatch`), never `2xx`, and no order has its
//!    values.
//!
//! Besides: the same body in another spelling is never `422`; `409` carries
//! `Retry-After`; a `5xx` is only accepted in a step that killed the server or
//! terminated its connections, and a request without an answer only in one that
//! killed it.
//!
//! Only the schedule is determined by the seed (which logical requests, how many
//! copies, which chaos after how long, which server settings); how the concurrent
//! requests interleave is up to the machine, and the checks hold for every
//! interleaving.
//!
//! Running it (PostgreSQL on 127.0.0.1:5432, or `IDEM_TEST_DATABASE_URL`; the
//! `orders` example must be built, which `cargo test --workspace` does):
//!
//! ```sh
//! cargo build --all-features --example orders
//! cargo test --all-features --test history                 # short run, 150 operations
//! IDEM_HISTORY_OPS=5000 cargo test --all-features --test history -- --nocapture
//! IDEM_HISTORY_SEED=1234 cargo test --all-features --test history   # replay a schedule
//! ```
//!
//! `IDEM_HISTORY_OPS` (default 150) is the number of operations of the schedule,
//! each a burst of concurrent requests (maybe with a fault), one to three
//! sequential retries, an expiry, or a crash and restart; the number of logical
//! requests grows with it up to 64. The short run takes about ten seconds; 5000
//! operations (some 18,000 requests, 800 restarts) about five minutes.
//!
//! The seed is printed at the start (`--nocapture` shows it on success, the test
//! harness on failure) and in every assertion message; a failure lists the
//! violations, the history of the logical requests concerned, and the schedule.
//! `IDEM_HISTORY_DEBUG=1` prints that report on success too (the whole schedule,
//! also of a long run).

mod common;
use common::orders;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use common::TestDb;

/// A key's digest as the table holds it.
fn digest_bytes(key: &str) -> Vec<u8> {
    idem_runtime::IdempotencyKey::parse(key)
        .unwrap()
        .digest()
        .as_bytes()
        .to_vec()
}

/// The `application_name` of the server's connections: what `pg_terminate_backend`
/// aims at, so the test's own connections survive.
const APP: &str = "idem-history-orders";

const TENANTS: [&str; 3] = ["acme", "globex", "initech"];

/// How long a client waits for one answer. Far beyond anything the server should
/// take (its slowest configuration is 200 ms of work and 3 s of in-flight wait):
/// a request that needs longer is stuck, and is reported as such.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// One logical request: the same tenant, key and body every time.
struct Logical {
    tenant: &'static str,
    key: String,
    /// Unique to this logical request in this run; stored in the order's `note`,
    /// so the orders table says which logical request made each order.
    marker: String,
    sku: String,
    quantity: i64,
    amount_cents: i64,
    currency: &'static str,
}

/// What a request sends with the logical request's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// The logical request itself.
    Same,
    /// Same key, another body (quantity and note differ).
    OtherBody,
    /// Same key and body, another `X-Currency` (part of the fingerprint).
    OtherCurrency,
}

impl Logical {
    fn other_marker(&self) -> String {
        format!("{}/other", self.marker)
    }

    fn currency(&self, v: Variant) -> &'static str {
        match (v, self.currency) {
            (Variant::OtherCurrency, "EUR") => "USD",
            (Variant::OtherCurrency, _) => "EUR",
            _ => self.currency,
        }
    }

    /// The body of `v`, spelt at random: the fields in any order, any white
    /// space. Every spelling is the same logical request (canonical JSON).
    fn body(&self, v: Variant, rng: &mut fastrand::Rng) -> String {
        let (quantity, note) = match v {
            Variant::OtherBody => (self.quantity + 1, self.other_marker()),
            _ => (self.quantity, self.marker.clone()),
        };
        let s = |x: &str| serde_json::to_string(x).unwrap();
        let mut fields = vec![
            format!("\"sku\":{}", s(&self.sku)),
            format!("\"quantity\":{quantity}"),
            format!("\"amount_cents\":{}", self.amount_cents),
            format!("\"note\":{}", s(&note)),
        ];
        rng.shuffle(&mut fields);
        let sep = [",", ", ", ",\n  ", " ,\t"][rng.usize(..4)];
        let pad = [" ", "", "\n"][rng.usize(..3)];
        format!("{{{pad}{}{pad}}}", fields.join(sep))
    }
}

/// A running `orders` process and the settings the seed gave it.
struct Server {
    process: orders::Server,
    latency: Duration,
    /// Its settings, for the step log.
    settings: String,
}

impl Server {
    async fn start(url: &str, latency_ms: u64, wait_ms: u64, sweep_ms: u64) -> Server {
        let (latency, wait, sweep) = (
            latency_ms.to_string(),
            wait_ms.to_string(),
            sweep_ms.to_string(),
        );
        let process = orders::Server::start(
            url,
            &[
                ("ORDERS_LATENCY_MS", latency.as_str()),
                ("IDEM_IN_FLIGHT_WAIT_MS", wait.as_str()),
                ("IDEM_SWEEP_INTERVAL_MS", sweep.as_str()),
            ],
        )
        .await;
        Server {
            process,
            latency: Duration::from_millis(latency_ms),
            settings: format!("latency={latency_ms}ms wait={wait_ms}ms sweep={sweep_ms}ms"),
        }
    }

    /// SIGKILL: no shutdown hooks, no graceful rollback — a crash.
    async fn kill(&mut self) {
        self.process.kill().await;
    }
}

/// A row of the example's `orders` table.
#[derive(Clone, Debug, sqlx::FromRow)]
struct OrderRow {
    id: i64,
    tenant_id: String,
    note: Option<String>,
    quantity: i32,
    currency: String,
    amount_cents: i64,
    sku: String,
}

/// What one request got.
#[derive(Clone, Debug)]
enum Outcome {
    Answer {
        status: u16,
        replayed: bool,
        retry_after: Option<String>,
        location: Option<String>,
        body: Vec<u8>,
    },
    /// No answer: the connection failed (refused, reset) or the client timed out.
    Failed(String),
}

impl Outcome {
    fn problem_type(&self) -> Option<String> {
        match self {
            Outcome::Answer { body, .. } => serde_json::from_slice::<serde_json::Value>(body)
                .ok()?
                .get("type")?
                .as_str()
                .map(str::to_owned),
            Outcome::Failed(_) => None,
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Answer {
                status,
                replayed,
                body,
                ..
            } => write!(
                f,
                "{status}{} {}",
                if *replayed { " (replayed)" } else { "" },
                String::from_utf8_lossy(body)
            ),
            Outcome::Failed(e) => write!(f, "no answer: {e}"),
        }
    }
}

/// One recorded request and its answer.
struct Event {
    step: usize,
    l: usize,
    variant: Variant,
    /// The window of the logical request when the step began and when it ended:
    /// they differ only for a step that expired the key while requests ran.
    lo: usize,
    hi: usize,
    /// Which server (counting restarts) it was sent to.
    server: usize,
    outcome: Outcome,
}

/// What a step did to the server or its connections: the faults that excuse a
/// `5xx` or a failed connection.
#[derive(Clone, Copy, Default)]
struct Faults {
    killed: bool,
    terminated: bool,
}

/// A fault injected while a step's requests run.
#[derive(Clone, Copy)]
enum Fault {
    Kill,
    Terminate,
    /// Expiry of one logical request's window, or of all.
    Expire(Option<usize>),
}

/// When a fault strikes: `delay` after the step's requests are spawned, or, if
/// `on_execute`, `delay` after the server starts executing one of them (inside
/// its transaction, after the claim). Timing only places the fault; no check
/// depends on where it lands.
#[derive(Clone, Copy)]
struct Chaos {
    fault: Fault,
    on_execute: bool,
    delay: Duration,
}

struct Run {
    seed: u64,
    rng: fastrand::Rng,
    /// Before `db`: fields drop in order, so the server is killed before its
    /// database is dropped.
    server: Server,
    db: TestDb,
    url: String,
    /// How many servers were started so far (the current one is `servers - 1`).
    servers: usize,
    client: reqwest::Client,
    ls: Vec<Logical>,
    /// Tenant and key digest (what the table holds) to the logical request.
    by_key: HashMap<(String, String), usize>,
    /// Per logical request: the stored response body of every window the test
    /// closed, captured by the very statement that expired it. Its length is the
    /// index of the current window.
    closed: Vec<Vec<Vec<u8>>>,
    /// Per logical request: a `2xx` was seen in the current window, so its outcome
    /// is committed and a different body with its key must be refused.
    completed: Vec<bool>,
    events: Vec<Event>,
    steps: Vec<String>,
    faults: Vec<Faults>,
    violations: Vec<(Option<usize>, String)>,
    /// The first server's settings (restarts say theirs in the schedule).
    first_server: String,
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.parse()
            .unwrap_or_else(|_| panic!("{name} must be a whole number, not {v:?}")),
    )
}

impl Run {
    async fn new(seed: u64, logical: usize) -> Run {
        let mut rng = fastrand::Rng::with_seed(seed);
        let db = TestDb::new().await;
        let sep = if db.url.contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}application_name={APP}", db.url);
        let ls: Vec<Logical> = (0..logical)
            .map(|i| Logical {
                tenant: TENANTS[i % TENANTS.len()],
                // Logical requests 2k and 2k + 1 share a key under two tenants.
                key: format!("key-{seed}-{}", i / 2),
                marker: format!("history-{seed}-L{i}"),
                sku: format!("SKU-{}", rng.u32(1..1000)),
                quantity: rng.i64(1..10),
                amount_cents: rng.i64(0..100_000),
                currency: ["EUR", "USD", "GBP"][rng.usize(..3)],
            })
            .collect();
        let by_key = ls
            .iter()
            .enumerate()
            .map(|(i, l)| ((l.tenant.to_owned(), common::digest_hex(&l.key)), i))
            .collect();
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(CLIENT_TIMEOUT)
            .build()
            .unwrap();
        let server = Self::start_server(&mut rng, &url).await;
        let n = ls.len();
        let mut run = Run {
            seed,
            rng,
            server,
            db,
            url,
            servers: 1,
            client,
            ls,
            by_key,
            closed: vec![Vec::new(); n],
            completed: vec![false; n],
            events: Vec::new(),
            steps: Vec::new(),
            faults: Vec::new(),
            violations: Vec::new(),
            first_server: String::new(),
        };
        run.first_server = run.server.settings.clone();
        run
    }

    /// A server with settings drawn from the seed: no latency up to 200 ms of work
    /// inside the transaction (so crashes land inside it), an in-flight wait below
    /// or above that (so duplicates replay, or get `409`), and a sweeper that runs
    /// often or rarely (expired rows deleted, or re-executed over).
    async fn start_server(rng: &mut fastrand::Rng, url: &str) -> Server {
        let latency = [0, 10, 50, 200][rng.usize(..4)];
        let wait = [50, 300, 1000, 3000][rng.usize(..4)];
        let sweep = [100, 60_000][rng.usize(..2)];
        Server::start(url, latency, wait, sweep).await
    }

    fn log(&mut self, line: String) {
        self.steps.push(line);
    }

    fn window(&self, l: usize) -> usize {
        self.closed[l].len()
    }

    fn violation(&mut self, l: Option<usize>, what: String) {
        self.violations.push((l, what));
    }

    /// Sends one request in its own task; the body's spelling is drawn now, so the
    /// schedule stays a function of the seed.
    fn spawn(&mut self, l: usize, v: Variant) -> tokio::task::JoinHandle<Outcome> {
        let logical = &self.ls[l];
        let body = logical.body(v, &mut self.rng);
        let request = self
            .client
            .post(format!("{}/orders", self.server.process.base))
            .header("authorization", format!("Bearer {}", logical.tenant))
            .header("content-type", "application/json")
            .header("x-currency", logical.currency(v))
            .header("idempotency-key", &logical.key)
            .body(body);
        tokio::spawn(async move {
            let resp = match request.send().await {
                Ok(r) => r,
                Err(e) => return Outcome::Failed(format!("{e:?}")),
            };
            let status = resp.status().as_u16();
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap_or("<not text>").to_owned())
            };
            let replayed = header("idempotent-replayed").is_some_and(|v| v == "true");
            let retry_after = header("retry-after");
            let location = header("location");
            match resp.bytes().await {
                Ok(body) => Outcome::Answer {
                    status,
                    replayed,
                    retry_after,
                    location,
                    body: body.to_vec(),
                },
                Err(e) => Outcome::Failed(format!("{status}, then the body failed: {e:?}")),
            }
        })
    }

    /// One step: the requests run concurrently, and the chaos (if any) strikes
    /// while they run.
    async fn step(&mut self, reqs: Vec<(usize, Variant)>, chaos: Option<Chaos>) {
        let step = self.steps.len();
        let server = self.servers - 1;
        let lo: Vec<usize> = reqs.iter().map(|&(l, _)| self.window(l)).collect();
        let mut desc: Vec<String> = reqs
            .iter()
            .map(|&(l, v)| match v {
                Variant::Same => format!("L{l}"),
                other => format!("L{l}:{other:?}"),
            })
            .collect();
        desc.sort();
        let mut executions = self.server.process.executions.clone();
        let before = *executions.borrow_and_update();
        let handles: Vec<_> = reqs.iter().map(|&(l, v)| self.spawn(l, v)).collect();
        let mut all = tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for h in handles {
                outcomes.push(h.await.unwrap());
            }
            outcomes
        });
        let mut faults = Faults::default();
        let mut chaos_desc = String::new();
        let mut finished = None;
        if let Some(chaos) = chaos {
            let mut when = format!("{:?} after spawning", chaos.delay);
            if chaos.on_execute {
                when = format!("{:?} after an execution began", chaos.delay);
                tokio::select! {
                    _ = executions.wait_for(|&n| n > before) => {}
                    // Nothing executed (all replayed, or refused): strike anyway.
                    outcomes = &mut all => {
                        finished = Some(outcomes.unwrap());
                        when = "after the requests (none executed)".to_owned();
                    }
                }
            }
            tokio::time::sleep(chaos.delay).await;
            chaos_desc = match chaos.fault {
                Fault::Kill => {
                    self.server.kill().await;
                    faults.killed = true;
                    format!(" + SIGKILL {when}")
                }
                Fault::Terminate => {
                    let n = self.terminate().await;
                    faults.terminated = true;
                    format!(" + pg_terminate_backend of {n} connections {when}")
                }
                Fault::Expire(which) => {
                    let what = self.expire(which).await;
                    format!(" + expiry of {what} {when}")
                }
            };
        }
        let outcomes = match finished {
            Some(o) => o,
            None => all.await.unwrap(),
        };
        if faults.killed {
            chaos_desc += &format!(", {}", self.restart().await);
        }
        self.faults.push(faults);
        self.log(format!(
            "step {step}: {} to server {server}{chaos_desc}",
            desc.join(" ")
        ));
        for (i, ((l, v), outcome)) in reqs.into_iter().zip(outcomes).enumerate() {
            let ok = matches!(
                outcome,
                Outcome::Answer {
                    status: 200..=299,
                    ..
                }
            );
            let hi = self.window(l);
            if ok && v == Variant::Same && lo[i] == hi {
                self.completed[l] = true;
            }
            self.events.push(Event {
                step,
                l,
                variant: v,
                lo: lo[i],
                hi,
                server,
                outcome,
            });
        }
    }

    /// Kills the server (if a step has not already) and starts the next one on
    /// the same database; says which, for the step's line in the schedule.
    async fn restart(&mut self) -> String {
        self.server.kill().await;
        self.server = Self::start_server(&mut self.rng, &self.url).await;
        self.servers += 1;
        format!(
            "restarted as server {}: {}",
            self.servers - 1,
            self.server.settings
        )
    }

    /// Terminates every connection of the server, and waits until they are gone,
    /// so that the next step starts without a fault in flight.
    async fn terminate(&mut self) -> usize {
        // MATERIALIZED: the filter runs first whatever the planner prefers; a
        // pg_terminate_backend evaluated before it could end other tests' connections.
        let victims: Vec<(i32, String)> = sqlx::query_as(
            "WITH victims AS MATERIALIZED ( \
                 SELECT pid, backend_start::text AS started FROM pg_stat_activity \
                  WHERE datname = current_database() AND application_name = $1) \
             SELECT pid, started FROM victims WHERE pg_terminate_backend(pid)",
        )
        .bind(APP)
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        let (pids, started): (Vec<i32>, Vec<String>) = victims.into_iter().unzip();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            // By pid and start time: a pid may be reused by a new connection.
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity a \
                   JOIN unnest($1::int[], $2::text[]) AS v(pid, started) \
                     ON a.pid = v.pid AND a.backend_start::text = v.started",
            )
            .bind(&pids)
            .bind(&started)
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "seed {}: terminated backends still there after 60 s",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        pids.len()
    }

    /// Ends the retention window of one logical request, or of all: the stored
    /// outcome's `expires_at` moves into the past. The same statement returns the
    /// outcome it expired, so each window's stored result is known exactly, however
    /// the expiry interleaves with requests in flight.
    async fn expire(&mut self, which: Option<usize>) -> String {
        let (tenant, key) = match which {
            Some(l) => (
                Some(self.ls[l].tenant.to_owned()),
                Some(digest_bytes(&self.ls[l].key)),
            ),
            None => (None, None),
        };
        let rows: Vec<(String, Vec<u8>, Option<Vec<u8>>)> = sqlx::query_as(
            "UPDATE idempotency_requests SET expires_at = now() - interval '1 second' \
              WHERE operation = 'create-order' AND state = 'completed' AND expires_at > now() \
                AND ($1::text IS NULL OR (tenant_id = $1 AND key_digest = $2)) \
             RETURNING tenant_id, key_digest, response_body",
        )
        .bind(&tenant)
        .bind(&key)
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        let mut expired = Vec::new();
        for (tenant, digest, body) in rows {
            let key = idem_runtime::KeyDigest::from_slice(&digest)
                .map(|d| d.to_string())
                .unwrap_or_default();
            let Some(&l) = self.by_key.get(&(tenant.clone(), key.clone())) else {
                self.violation(None, format!("a row no request made: {tenant}/{key}"));
                continue;
            };
            self.closed[l].push(body.unwrap_or_default());
            self.completed[l] = false;
            expired.push(l);
        }
        // A window in which a 2xx was answered must have its outcome stored.
        let targets: Vec<usize> = match which {
            Some(l) => vec![l],
            None => (0..self.ls.len()).collect(),
        };
        for l in targets {
            if self.completed[l] && !expired.contains(&l) {
                self.violation(
                    Some(l),
                    format!(
                        "L{l} was answered 2xx in window {}, but at expiry it has no completed outcome",
                        self.window(l)
                    ),
                );
                self.completed[l] = false;
            }
        }
        expired.sort();
        let what = match which {
            Some(l) => format!("L{l}"),
            None => "all".to_owned(),
        };
        format!("{what} (closed windows of {expired:?})")
    }

    /// `n` requests of logical requests drawn at random, sometimes with another
    /// body or currency for a key whose outcome is known to be committed.
    fn draw_requests(&mut self, ls: &[usize], n: usize) -> Vec<(usize, Variant)> {
        let mut reqs = Vec::new();
        for _ in 0..n {
            let l = ls[self.rng.usize(..ls.len())];
            let v = if self.completed[l] && self.rng.u8(..10) == 0 {
                [Variant::OtherBody, Variant::OtherCurrency][self.rng.usize(..2)]
            } else {
                Variant::Same
            };
            reqs.push((l, v));
        }
        reqs
    }

    /// Mostly nothing; else a crash, terminated connections or an expiry, placed
    /// within the server's latency of an execution (inside its transaction or
    /// at its commit), or a little after the requests left (before any claim).
    fn draw_chaos(&mut self, ls: &[usize]) -> Option<Chaos> {
        let fault = match self.rng.u8(..20) {
            0..=1 => Fault::Kill,
            2..=3 => Fault::Terminate,
            4 => Fault::Expire(Some(ls[self.rng.usize(..ls.len())])),
            _ => return None,
        };
        let on_execute = self.rng.u8(..3) != 0;
        let span = self.server.latency.as_millis() as u64 + 5;
        let delay = Duration::from_millis(self.rng.u64(0..=span));
        Some(Chaos {
            fault,
            on_execute,
            delay,
        })
    }

    /// One step of the schedule, drawn from the seed.
    async fn random_step(&mut self) {
        let n = self.ls.len();
        match self.rng.u8(..100) {
            // A burst of duplicates of one logical request.
            0..=34 => {
                let l = self.rng.usize(..n);
                let copies = self.rng.usize(2..=8);
                let reqs = self.draw_requests(&[l], copies);
                let chaos = self.draw_chaos(&[l]);
                let chaos = mismatch_safe(chaos, &reqs);
                self.step(reqs, chaos).await;
            }
            // Several logical requests at once.
            35..=59 => {
                let ls: Vec<usize> = (0..self.rng.usize(2..=4))
                    .map(|_| self.rng.usize(..n))
                    .collect();
                let copies = self.rng.usize(2..=10);
                let reqs = self.draw_requests(&ls, copies);
                let chaos = self.draw_chaos(&ls);
                let chaos = mismatch_safe(chaos, &reqs);
                self.step(reqs, chaos).await;
            }
            // Retries one after another.
            60..=79 => {
                let l = self.rng.usize(..n);
                for _ in 0..self.rng.usize(1..=3) {
                    let reqs = self.draw_requests(&[l], 1);
                    self.step(reqs, None).await;
                }
            }
            // The retention of one key, or of all, runs out.
            80..=89 => {
                let which = if self.rng.u8(..5) == 0 {
                    None
                } else {
                    Some(self.rng.usize(..n))
                };
                let step = self.steps.len();
                let what = self.expire(which).await;
                self.faults.push(Faults::default());
                self.log(format!("step {step}: expiry of {what}"));
            }
            // A crash while idle, and a restart.
            _ => {
                let step = self.steps.len();
                let restarted = self.restart().await;
                self.faults.push(Faults::default());
                self.log(format!("step {step}: SIGKILL while idle, {restarted}"));
            }
        }
    }

    /// After the chaos: one more restart, then every logical request is retried
    /// with its key, as a well-behaved client does (waiting what `Retry-After`
    /// says), until it gets a final answer or a long deadline passes.
    async fn settle(&mut self) -> Vec<Option<Outcome>> {
        let step = self.steps.len();
        let restarted = self.restart().await;
        self.faults.push(Faults::default());
        self.log(format!(
            "step {step}: SIGKILL, {restarted}, then retries of every logical request until final"
        ));
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut finals = vec![None; self.ls.len()];
        let mut pending: Vec<usize> = (0..self.ls.len()).collect();
        while !pending.is_empty() && Instant::now() < deadline {
            let handles: Vec<_> = pending
                .iter()
                .map(|&l| (l, self.spawn(l, Variant::Same)))
                .collect();
            let mut wait = Duration::from_millis(100);
            let mut next = Vec::new();
            for (l, h) in handles {
                let outcome = h.await.unwrap();
                match &outcome {
                    Outcome::Answer {
                        status: 409,
                        retry_after,
                        ..
                    } => {
                        let secs = retry_after
                            .as_deref()
                            .and_then(|s| s.parse().ok())
                            .unwrap_or(1);
                        wait = wait.max(Duration::from_secs(secs));
                        next.push(l);
                    }
                    Outcome::Answer {
                        status: 200..=299 | 400..=499,
                        ..
                    } => finals[l] = Some(outcome.clone()),
                    _ => next.push(l),
                }
                self.events.push(Event {
                    step,
                    l,
                    variant: Variant::Same,
                    lo: self.window(l),
                    hi: self.window(l),
                    server: self.servers - 1,
                    outcome,
                });
            }
            pending = next;
            if !pending.is_empty() {
                tokio::time::sleep(wait).await;
            }
        }
        finals
    }

    /// Checks the history and the database against the promise.
    async fn check(&mut self, finals: Vec<Option<Outcome>>) {
        let seed = self.seed;
        // (4) every key settles on a final answer after the chaos.
        for (l, f) in finals.iter().enumerate() {
            match f {
                Some(Outcome::Answer { status: 201, .. }) => {}
                Some(other) => {
                    self.violation(Some(l), format!("L{l}'s final retry got {other}, not 201"))
                }
                None => self.violation(
                    Some(l),
                    format!("L{l} never got a final answer: stuck past the restart"),
                ),
            }
        }
        let stuck: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_requests WHERE state <> 'completed'",
        )
        .fetch_one(&self.db.pool)
        .await
        .unwrap();
        if stuck != 0 {
            self.violation(
                None,
                format!("{stuck} row(s) not completed after the final retries"),
            );
        }

        // Every window's stored outcome: the closed ones, and the current row.
        let mut windows: Vec<Vec<Vec<u8>>> = self.closed.clone();
        for (l, w) in windows.iter_mut().enumerate() {
            let row: Option<(String, Option<i16>, Option<Vec<u8>>)> = sqlx::query_as(
                "SELECT state, response_status, response_body FROM idempotency_requests \
                  WHERE tenant_id = $1 AND operation = 'create-order' AND key_digest = $2",
            )
            .bind(self.ls[l].tenant)
            .bind(digest_bytes(&self.ls[l].key))
            .fetch_optional(&self.db.pool)
            .await
            .unwrap();
            match row {
                Some((state, Some(201), Some(body))) if state == "completed" => w.push(body),
                other => {
                    self.violations.push((
                        Some(l),
                        format!("L{l}'s row at the end is {other:?}, not a completed 201"),
                    ));
                    w.push(Vec::new());
                }
            }
        }

        // The orders, by the marker in their note.
        let orders: Vec<OrderRow> = sqlx::query_as(
            "SELECT id, tenant_id, note, quantity, currency::text AS currency, amount_cents, sku \
               FROM orders",
        )
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        let mut by_id = HashMap::new();
        for o in &orders {
            by_id.insert(o.id, o.clone());
        }
        let window_ids: Vec<Vec<Option<i64>>> = windows
            .iter()
            .map(|w| w.iter().map(|b| order_id(b)).collect())
            .collect();

        // (3) each stored outcome names an order that exists, with its values.
        for l in 0..self.ls.len() {
            for (w, id) in window_ids[l].iter().enumerate() {
                let lg = &self.ls[l];
                match id.and_then(|id| by_id.get(&id)) {
                    Some(o)
                        if o.tenant_id == lg.tenant
                            && o.note.as_deref() == Some(lg.marker.as_str())
                            && i64::from(o.quantity) == lg.quantity
                            && o.currency == lg.currency
                            && o.amount_cents == lg.amount_cents
                            && o.sku == lg.sku => {}
                    found => {
                        let found = format!("{found:?}");
                        self.violation(
                            Some(l),
                            format!(
                                "L{l} window {w}: the stored outcome {} names no matching order (found {found})",
                                String::from_utf8_lossy(&windows[l][w])
                            ),
                        );
                    }
                }
            }
            let mut ids: Vec<i64> = window_ids[l].iter().flatten().copied().collect();
            ids.sort();
            ids.dedup();
            if ids.len() != window_ids[l].len() {
                self.violation(
                    Some(l),
                    format!("L{l}: two windows name the same order: {:?}", window_ids[l]),
                );
            }
        }

        // (1) and (5): every order is its window's one effect, never a mismatch's.
        let markers: HashMap<String, usize> = self
            .ls
            .iter()
            .enumerate()
            .map(|(i, l)| (l.marker.clone(), i))
            .collect();
        for o in &orders {
            let (id, tenant, quantity, currency) = (o.id, &o.tenant_id, o.quantity, &o.currency);
            let note = o.note.clone().unwrap_or_default();
            if let Some(l) = note.strip_suffix("/other").and_then(|m| markers.get(m)) {
                self.violation(
                    Some(*l),
                    format!("order {id} was made by L{l}'s key with another body (must be 422)"),
                );
                continue;
            }
            let Some(&l) = markers.get(&note) else {
                self.violation(None, format!("order {id} has an unknown note {note:?}"));
                continue;
            };
            if currency != self.ls[l].currency {
                self.violation(
                    Some(l),
                    format!(
                        "order {id} of L{l} has currency {currency}: made by the key with another X-Currency (must be 422)"
                    ),
                );
            }
            if !window_ids[l].contains(&Some(id)) {
                self.violation(
                    Some(l),
                    format!(
                        "order {id} of L{l} (tenant {tenant}, quantity {quantity}) is named by none of its windows' \
                         stored outcomes {:?}: a second execution within one window",
                        window_ids[l]
                    ),
                );
            }
        }

        // (2) every 2xx is its window's stored outcome, byte for byte; at most one
        // original per window; and the answers the rules allow, otherwise.
        let mut originals: HashMap<(usize, usize), usize> = HashMap::new();
        let mut problems = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            let faults = self.faults[e.step];
            let excused = faults.killed || faults.terminated;
            let what = format!(
                "event {i} (step {}, L{} {:?}, server {})",
                e.step, e.l, e.variant, e.server
            );
            match (&e.outcome, e.variant) {
                (
                    Outcome::Answer {
                        status: status @ 200..=299,
                        replayed,
                        location,
                        body,
                        ..
                    },
                    Variant::Same,
                ) => {
                    let w = (e.lo..=e.hi).find(|&w| windows[e.l].get(w) == Some(body));
                    match w {
                        None => problems.push((
                            Some(e.l),
                            format!(
                                "{what}: {status} {} is not the stored outcome of window(s) {}..={}",
                                String::from_utf8_lossy(body),
                                e.lo,
                                e.hi
                            ),
                        )),
                        Some(w) => {
                            if *status != 201 {
                                problems.push((Some(e.l), format!("{what}: {status}, not 201")));
                            }
                            let id = window_ids[e.l][w];
                            if location.as_deref()
                                != id.map(|id| format!("/orders/{id}")).as_deref()
                            {
                                problems.push((
                                    Some(e.l),
                                    format!("{what}: Location {location:?} for order {id:?}"),
                                ));
                            }
                            if !replayed {
                                *originals.entry((e.l, w)).or_default() += 1;
                            }
                        }
                    }
                }
                (
                    Outcome::Answer {
                        status: 200..=299, ..
                    },
                    _,
                ) => problems.push((
                    Some(e.l),
                    format!("{what}: another body with the key got {}", e.outcome),
                )),
                (
                    Outcome::Answer { status: 422, .. },
                    Variant::OtherBody | Variant::OtherCurrency,
                ) => {
                    let t = e.outcome.problem_type();
                    if t.as_deref() != Some("urn:idem:problem:fingerprint-mismatch") {
                        problems.push((Some(e.l), format!("{what}: 422 of type {t:?}")));
                    }
                }
                (
                    Outcome::Answer {
                        status: 409,
                        retry_after,
                        ..
                    },
                    _,
                ) => {
                    if retry_after.is_none() {
                        problems.push((Some(e.l), format!("{what}: 409 without Retry-After")));
                    }
                    if e.variant != Variant::Same {
                        problems.push((
                            Some(e.l),
                            format!("{what}: 409 for another body over a committed outcome"),
                        ));
                    }
                }
                (
                    Outcome::Answer {
                        status: 500..=599, ..
                    },
                    _,
                ) if excused => {}
                (Outcome::Failed(_), _) if faults.killed => {}
                _ => problems.push((Some(e.l), format!("{what}: unexpected {}", e.outcome))),
            }
        }
        self.violations.extend(problems);
        let mut originals: Vec<_> = originals.into_iter().filter(|&(_, n)| n > 1).collect();
        originals.sort();
        for ((l, w), n) in originals {
            self.violation(
                Some(l),
                format!("L{l} window {w}: {n} answers not marked replayed (one execution each?)"),
            );
        }

        // A summary, seen with --nocapture.
        let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
        for e in &self.events {
            let k = match &e.outcome {
                Outcome::Answer {
                    status, replayed, ..
                } => format!("{status}{}", if *replayed { " replayed" } else { "" }),
                Outcome::Failed(_) => "no answer".to_owned(),
            };
            *statuses.entry(k).or_default() += 1;
        }
        let windows_total: usize = windows.iter().map(Vec::len).sum();
        let count = |what: &str| self.steps.iter().filter(|s| s.contains(what)).count();
        eprintln!(
            "history (seed {seed}): {} steps, {} requests, {} servers ({} SIGKILLs in a burst), \
             {} bursts with pg_terminate_backend, {} expiries, {} orders, {} windows, answers {statuses:?}",
            self.steps.len(),
            self.events.len(),
            self.servers,
            count("+ SIGKILL"),
            count("pg_terminate_backend"),
            count("expiry of"),
            orders.len(),
            windows_total,
        );

        if std::env::var_os("IDEM_HISTORY_DEBUG").is_some() {
            eprintln!("{}", self.report(&windows));
        }
        if !self.violations.is_empty() {
            panic!("{}", self.report(&windows));
        }
    }

    /// The violations, then the history of the logical requests concerned and the
    /// schedule around them.
    fn report(&self, windows: &[Vec<Vec<u8>>]) -> String {
        use std::fmt::Write;
        let seed = self.seed;
        let mut out = format!(
            "seed {seed}: {} violation(s) of the promise (rerun with IDEM_HISTORY_SEED={seed})\n",
            self.violations.len()
        );
        for (_, v) in self.violations.iter().take(30) {
            let _ = writeln!(out, "  - {v}");
        }
        // The logical requests of the first violations, in the order they appear.
        let mut shown: Vec<usize> = Vec::new();
        for l in self.violations.iter().filter_map(|(l, _)| *l) {
            if !shown.contains(&l) {
                shown.push(l);
            }
        }
        for &l in shown.iter().take(3) {
            let lg = &self.ls[l];
            let _ = writeln!(
                out,
                "\nhistory of L{l} (tenant {}, key {}, currency {}, marker {}):",
                lg.tenant, lg.key, lg.currency, lg.marker
            );
            for (w, b) in windows[l].iter().enumerate() {
                let _ = writeln!(out, "  window {w} stored: {}", String::from_utf8_lossy(b));
            }
            let mut last_step = None;
            for e in self.events.iter().filter(|e| e.l == l).take(300) {
                if last_step != Some(e.step) {
                    let _ = writeln!(out, "  {}", self.steps[e.step]);
                    last_step = Some(e.step);
                }
                let _ = writeln!(
                    out,
                    "      L{l} {:?} (window {}..={}, server {}) -> {}",
                    e.variant, e.lo, e.hi, e.server, e.outcome
                );
            }
        }
        // The whole schedule: the faults that struck other keys' steps matter too
        // (a restart, an expiry of all). Long runs only print it when asked.
        if self.steps.len() <= 400 || std::env::var_os("IDEM_HISTORY_DEBUG").is_some() {
            let _ = writeln!(
                out,
                "\nschedule (seed {seed}; server 0: {}):",
                self.first_server
            );
            for s in &self.steps {
                let _ = writeln!(out, "  {s}");
            }
        } else {
            let _ = writeln!(
                out,
                "\n(the schedule of {} steps is printed with IDEM_HISTORY_DEBUG=1)",
                self.steps.len()
            );
        }
        out
    }
}

/// A step that may send another body with a key must not race an expiry: the
/// body would be refused before the window closes and may execute after it.
fn mismatch_safe(chaos: Option<Chaos>, reqs: &[(usize, Variant)]) -> Option<Chaos> {
    match chaos {
        Some(Chaos {
            fault: Fault::Expire(_),
            ..
        }) if reqs.iter().any(|&(_, v)| v != Variant::Same) => None,
        c => c,
    }
}

fn order_id(body: &[u8]) -> Option<i64> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()?
        .get("id")?
        .as_i64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_keeps_the_promise() {
    let seed = env_u64("IDEM_HISTORY_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    let ops = env_u64("IDEM_HISTORY_OPS").unwrap_or(150) as usize;
    // Few logical requests, so that each sees many duplicates, chaos and windows
    // (a long run gets more windows per key, not more keys).
    let logical = (ops / 12).clamp(6, 64);
    eprintln!(
        "history: IDEM_HISTORY_SEED={seed} IDEM_HISTORY_OPS={ops} ({logical} logical requests)"
    );
    // Every panic says the seed, also those of the harness (a server that does not
    // start, a query that fails), not only the checker's own report.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        eprintln!("history: failed with IDEM_HISTORY_SEED={seed} IDEM_HISTORY_OPS={ops}");
        default_hook(info);
    }));
    let started = Instant::now();
    let mut run = Run::new(seed, logical).await;
    for _ in 0..ops {
        run.random_step().await;
    }
    let finals = run.settle().await;
    run.check(finals).await;
    eprintln!("history (seed {seed}): passed in {:?}", started.elapsed());
}
