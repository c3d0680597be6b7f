//! (k) Long operations beside (b): on each database, two rounds of (b) alone,
//! then `IDEM_BENCH_LONG_OPS` long operations started (`POST /long/exports`,
//! each accepted with `202` and held, its 6 s lease renewed in the background)
//! and (b) beside them, then the operations released (`POST
//! /bench/long/release`, which answers once their outcomes are stored). Each
//! side is measured half in each round, so a machine whose load drifts during
//! the run weighs on both alike; with the renewal batches the server sent
//! while (b) ran beside the operations. With the leases in Redis (one server, the cluster)
//! the scenario beside them is (f), leased first executions, as the Redis
//! server has no transactional route. Targets: renewal statements per second of the process
//! at most 5, and (b)'s p50 within 1.3x of its value with none running.

use super::*;

/// One database's (k).
pub struct LongOps {
    pub db: Db,
    /// Long operations running beside the second (b).
    pub running: usize,
    /// Seconds it took to start them all (the longer of the rounds).
    pub start_secs: f64,
    /// (b) alone, and (b) beside them.
    pub alone: Measured,
    pub beside: Measured,
    /// Renewal statements (batches) and lease renewals per second while (b) ran
    /// beside them.
    pub statements_per_sec: f64,
    pub renewals_per_sec: f64,
}

impl LongOps {
    pub fn p50_ratio(&self) -> f64 {
        self.beside.percentile(0.5) / self.alone.percentile(0.5).max(1e-9)
    }
}

/// The mean latency in ms: printed beside the p50, which jumps between the
/// modes of a bimodal latency (a request that waits for a core or not, on a
/// machine whose cores the server, the database and the load share).
fn mean_ms(m: &Measured) -> f64 {
    let l = &m.tally.latencies_us;
    l.iter().map(|&us| u64::from(us)).sum::<u64>() as f64 / l.len().max(1) as f64 / 1000.0
}

/// The server's renewal counters: batches sent, lease renewals they carried.
async fn renewals(client: &reqwest::Client, base: &str) -> Result<(u64, u64), String> {
    client
        .get(format!("{base}/bench/renewals"))
        .send()
        .await
        .map_err(|e| format!("renewals: {e}"))?
        .json()
        .await
        .map_err(|e| format!("renewals: {e}"))
}

/// Starts `n` long operations with fresh keys, 32 at a time; each must be
/// accepted (`202`).
async fn start_long_ops(
    client: &reqwest::Client,
    base: &str,
    (db, round): (Db, usize),
    n: usize,
) -> Result<(), String> {
    let to = Endpoint {
        url: format!("{base}/long/exports"),
        tenant: format!("bench-k-{}", db.tag()),
        cookie: None,
    };
    let mut next = 0;
    while next < n {
        let mut batch = JoinSetOf::new();
        for i in next..(next + 32).min(n) {
            let (client, to) = (client.clone(), to.clone());
            batch.spawn(async move { send(&client, &to, &format!("k-{round}-{i}")).await });
        }
        next = (next + 32).min(n);
        while let Some(done) = batch.join_next().await {
            let answer = done.map_err(|e| e.to_string())??;
            if answer.status != 202 {
                return Err(format!("a long operation answered {}", describe(&answer)));
            }
        }
    }
    Ok(())
}

type JoinSetOf = tokio::task::JoinSet<Result<Answer, String>>;

/// Ends the running long operations; returns once their outcomes are stored.
async fn release_long_ops(client: &reqwest::Client, base: &str) -> Result<(), String> {
    let answer = client
        .post(format!("{base}/bench/long/release"))
        .send()
        .await
        .map_err(|e| format!("release: {e}"))?;
    if answer.status() != reqwest::StatusCode::NO_CONTENT {
        return Err(format!("release answered {}", answer.status()));
    }
    Ok(())
}

/// The rounds of (k): each measures half of (b)'s time alone and half beside.
const ROUNDS: usize = 2;

/// (k) on one database: a fresh server (`env` selects the database).
async fn one(
    s: &Settings,
    url: &str,
    env: &[(&str, String)],
    (db, beside_id): (Db, char),
) -> Result<LongOps, String> {
    let server = Server::start(url, env).await?;
    let client = http_client(s.clients.max(32));
    let mut alone = Measured::new(scenario(beside_id), db, 0, s.clients);
    alone.tenant = format!("bench-k-alone-{}", db.tag());
    let mut beside = Measured::new(scenario(beside_id), db, 0, s.clients);
    beside.tenant = format!("bench-k-beside-{}", db.tag());
    let secs = s.secs / ROUNDS as f64;
    let (mut start_secs, mut counted_secs, mut counted) = (0.0f64, 0.0, (0, 0));
    for round in 0..ROUNDS {
        let tag = db.tag();
        eprintln!(
            "idem bench: {tag}: (k) round {round}: ({beside_id}) with no long operation running ..."
        );
        run_slice(s, &mut alone, round, (s.warmup, secs), &server, &client).await?;
        eprintln!(
            "idem bench: {tag}: (k) round {round}: starting {} long operations ...",
            s.long_ops
        );
        let started = Instant::now();
        start_long_ops(&client, &server.base, (db, round), s.long_ops).await?;
        start_secs = start_secs.max(started.elapsed().as_secs_f64());
        eprintln!("idem bench: {tag}: (k) round {round}: ({beside_id}) beside them ...");
        // The warm-up lets the renewals of the operations just started settle
        // into their batches; the counters bracket the measured window only.
        let warmup = s.warmup.max(6.0);
        let before = renewals(&client, &server.base).await?;
        let t0 = Instant::now();
        run_slice(s, &mut beside, round, (warmup, secs), &server, &client).await?;
        let after = renewals(&client, &server.base).await?;
        counted_secs += t0.elapsed().as_secs_f64();
        counted.0 += after.0 - before.0;
        counted.1 += after.1 - before.1;
        release_long_ops(&client, &server.base).await?;
    }
    // `percentile` reads a sorted list; the rounds' slices were appended
    // client by client, in the order each client saw its answers.
    alone.tally.latencies_us.sort_unstable();
    beside.tally.latencies_us.sort_unstable();
    let counted_secs = counted_secs.max(1e-3);
    let measured = (
        counted.0 as f64 / counted_secs,
        counted.1 as f64 / counted_secs,
    );
    server.stop().await;
    Ok(LongOps {
        db,
        running: s.long_ops,
        start_secs,
        alone,
        beside,
        statements_per_sec: measured.0,
        renewals_per_sec: measured.1,
    })
}

/// (k) on PostgreSQL (RTT 0), and on the SQLite file, MySQL and Redis (one
/// server and the cluster, not the run with `WAIT`) when their scenarios run.
pub async fn long_ops_run(
    s: &Settings,
    url: &str,
    (sqlite_url, mysql_url): (Option<&str>, Option<&str>),
    redis: &[RedisRun],
) -> Result<Vec<LongOps>, String> {
    let mut out = vec![one(s, url, &[], (Db::Postgres { rtt_us: 0 }, 'b')).await?];
    if let Some(sqlite_url) = sqlite_url {
        let env = [("IDEM_BENCH_BACKEND", "sqlite".to_owned())];
        out.push(one(s, sqlite_url, &env, (Db::Sqlite, 'b')).await?);
    }
    if let Some(mysql_url) = mysql_url {
        let env = [("IDEM_BENCH_BACKEND", "mysql".to_owned())];
        out.push(one(s, mysql_url, &env, (Db::MySql, 'b')).await?);
    }
    for run in redis.iter().filter(|r| r.at != RedisAt::ClusterAcks) {
        out.push(one(s, url, &run.env, (Db::Redis(run.at), 'f')).await?);
    }
    Ok(out)
}

/// The report's lines for (k), its targets judged: renewal statements at most 5 a
/// second, and the p50 beside the operations within 1.3x of the p50 alone.
pub fn long_ops_lines(runs: &[LongOps]) -> String {
    if runs.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\n(k) long operations running beside (b) (6 s leases, renewed in batches; issue 37):\n",
    );
    for k in runs {
        let _ = writeln!(
            out,
            "  {:<12} {} running (started in {:.1} s): ({}) {:.0} -> {:.0} req/s, mean {:.2} -> {:.2} ms, p50 {:.2} -> {:.2} ms = {:.2}x \
             (target <= 1.30x: {}); renewal statements {:.1}/s carrying {:.0} lease renewals/s (target <= 5/s: {})",
            k.db.tag(),
            k.running,
            k.start_secs,
            k.alone.sc.id,
            k.alone.throughput(),
            k.beside.throughput(),
            mean_ms(&k.alone),
            mean_ms(&k.beside),
            k.alone.percentile(0.5),
            k.beside.percentile(0.5),
            k.p50_ratio(),
            if k.p50_ratio() <= 1.3 {
                "met"
            } else {
                "NOT met"
            },
            k.statements_per_sec,
            k.renewals_per_sec,
            if k.statements_per_sec <= 5.0 {
                "met"
            } else {
                "NOT met"
            },
        );
    }
    out
}
