//! The gRPC scenarios: (u) `CreateOrder` first executions and (v) its replays,
//! against the grpc-orders example (a child process, this binary in the role
//! `grpc`) on the bench's PostgreSQL at RTT 0, driven by its generated tonic
//! client; printed beside HTTP's (b) and (c) of the same run.

use grpc_orders::pb::CreateOrderRequest;
use grpc_orders::pb::orders_client::OrdersClient;
use tonic::transport::Channel;

use super::*;

/// One gRPC scenario's figures.
pub struct GrpcMeasured {
    pub title: &'static str,
    pub requests: u64,
    pub errors: u64,
    pub secs: f64,
    /// Sorted latencies, microseconds.
    pub latencies_us: Vec<u32>,
    /// CPU seconds of the server and of PostgreSQL's backends.
    pub cpu: [f64; 2],
}

impl GrpcMeasured {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.secs.max(1e-3)
    }

    fn p50_ms(&self) -> f64 {
        let l = &self.latencies_us;
        l.get(l.len() / 2).map_or(0.0, |us| f64::from(*us) / 1000.0)
    }

    fn us_per_request(&self, i: usize) -> f64 {
        self.cpu[i] * 1e6 / (self.requests.max(1) as f64)
    }
}

/// (u) and (v).
pub struct GrpcRun {
    pub first: GrpcMeasured,
    pub replay: GrpcMeasured,
}

fn call(tenant: &str, key: &str) -> tonic::Request<CreateOrderRequest> {
    let mut r = tonic::Request::new(CreateOrderRequest {
        sku: "bench-sku".into(),
        quantity: 1,
        amount_cents: 1234,
        note: String::new(),
        labels: Default::default(),
    });
    let m = r.metadata_mut();
    m.insert("authorization", format!("Bearer {tenant}").parse().unwrap());
    m.insert("x-currency", "EUR".parse().unwrap());
    m.insert("idempotency-key", key.parse().unwrap());
    r
}

async fn clients(addr: &str, n: usize) -> Result<Vec<OrdersClient<Channel>>, String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(
            OrdersClient::connect(addr.to_owned())
                .await
                .map_err(|e| format!("gRPC connect: {e}"))?,
        );
    }
    Ok(out)
}

/// Runs `clients` loops until `until`; each call's key is `key(client, i)`.
async fn load(
    clients: &[OrdersClient<Channel>],
    tenant: &str,
    until: Instant,
    key: impl Fn(usize, u64) -> String + Send + Sync + Clone + 'static,
) -> (u64, u64, Vec<u32>) {
    let mut tasks = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        let mut client = client.clone();
        let tenant = tenant.to_owned();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut lat) = (0_u64, 0_u64, Vec::new());
            let mut i = 0;
            while Instant::now() < until {
                let started = Instant::now();
                match client.create_order(call(&tenant, &key(c, i))).await {
                    Ok(_) => ok += 1,
                    Err(_) => errors += 1,
                }
                lat.push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
                i += 1;
            }
            (ok, errors, lat)
        }));
    }
    let (mut ok, mut errors, mut lat) = (0, 0, Vec::new());
    for t in tasks {
        if let Ok((o, e, l)) = t.await {
            ok += o;
            errors += e;
            lat.extend(l);
        }
    }
    lat.sort_unstable();
    (ok, errors, lat)
}

async fn measured(
    s: &Settings,
    server: &Server,
    title: &'static str,
    clients: &[OrdersClient<Channel>],
    tenant: &str,
    key: impl Fn(usize, u64) -> String + Send + Sync + Clone + 'static,
) -> GrpcMeasured {
    let warm = Instant::now() + Duration::from_secs_f64(s.warmup);
    let k = key.clone();
    load(clients, tenant, warm, move |c, i| {
        format!("warm-{}", k(c, i))
    })
    .await;
    let probe = server.probe();
    let before = cpu_snapshot(&probe);
    let started = Instant::now();
    let (requests, errors, latencies_us) = load(
        clients,
        tenant,
        started + Duration::from_secs_f64(s.secs),
        key,
    )
    .await;
    let secs = started.elapsed().as_secs_f64();
    let after = cpu_snapshot(&probe);
    let tick = |i: usize| after[i].saturating_sub(before[i]) as f64 / 100.0;
    GrpcMeasured {
        title,
        requests,
        errors,
        secs,
        latencies_us,
        cpu: [tick(0), tick(1)],
    }
}

/// Starts the example on the bench's database and measures (u), then (v).
pub async fn grpc_run(s: &Settings, url: &str) -> Result<GrpcRun, String> {
    eprintln!("idem bench: gRPC (u) first executions and (v) replays ...");
    let server = Server::start_as(
        "grpc",
        "grpc-orders listening on ",
        url,
        &[
            ("IDEM_ADDR", "127.0.0.1:0".to_owned()),
            ("RUST_LOG", "warn".to_owned()),
        ],
    )
    .await?;
    let addr = server.base.clone();
    let clients = clients(&addr, s.clients).await?;
    let run = std::process::id();
    let first = measured(
        s,
        &server,
        "gRPC #[idempotent] first exec",
        &clients,
        "grpc-u",
        move |c, i| format!("u-{run}-{c}-{i}"),
    )
    .await;
    // Completed keys for (v), made one by one beforehand.
    let keys = s.replay_keys.max(1);
    let mut one = clients[0].clone();
    for k in 0..keys {
        one.create_order(call("grpc-v", &format!("v-{run}-{k}")))
            .await
            .map_err(|e| format!("gRPC replay key {k}: {e}"))?;
    }
    let replay = measured(
        s,
        &server,
        "gRPC #[idempotent] replay",
        &clients,
        "grpc-v",
        move |c, i| format!("v-{run}-{}", (c as u64 * 7919 + i) % keys as u64),
    )
    .await;
    server.stop().await;
    Ok(GrpcRun { first, replay })
}

/// The gRPC section: (u) and (v), HTTP's (b) and (c) at RTT 0 beside them.
pub fn render(run: &GrpcRun, groups: &[Group]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ngRPC (tonic 0.14, the grpc-orders example as the server: CreateOrder with its validation, \
         key from metadata, the message and x-currency fingerprinted), PostgreSQL at RTT 0, \
         measured after the groups in the same run, with HTTP's (b) and (c) at RTT 0 beside it:\n"
    );
    let _ = writeln!(
        out,
        "| scenario | req/s | p50 ms | server us/req | PostgreSQL us/req | errors |\n| --- | --- | --- | --- | --- | --- |"
    );
    let http = |id: char| {
        groups
            .iter()
            .flat_map(|g| g.results.iter())
            .find(|m| m.sc.id == id && m.db == Db::Postgres { rtt_us: 0 })
    };
    for id in ['b', 'c'] {
        if let Some(m) = http(id) {
            let req = m.tally.requests.max(1) as f64;
            let _ = writeln!(
                out,
                "| ({id}) HTTP {} | {:.0} | {:.2} | {:.0} | {:.0} | {} |",
                m.sc.title,
                m.throughput(),
                m.percentile(0.5),
                m.cpu[0] * 1e6 / req,
                m.cpu[1] * 1e6 / req,
                m.tally.errors
            );
        }
    }
    for (id, m) in [('u', &run.first), ('v', &run.replay)] {
        let _ = writeln!(
            out,
            "| ({id}) {} | {:.0} | {:.2} | {:.0} | {:.0} | {} |",
            m.title,
            m.throughput(),
            m.p50_ms(),
            m.us_per_request(0),
            m.us_per_request(1),
            m.errors
        );
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let _ = writeln!(
        out,
        "\nv/u (gRPC replay / first exec) {:.2}",
        ratio(run.replay.throughput(), run.first.throughput())
    );
    if let (Some(b), Some(c)) = (http('b'), http('c')) {
        let _ = writeln!(
            out,
            "u/b (gRPC / HTTP first exec) {:.2}, v/c (gRPC / HTTP replay) {:.2}; server us per first exec: gRPC {:.0}, HTTP {:.0}",
            ratio(run.first.throughput(), b.throughput()),
            ratio(run.replay.throughput(), c.throughput()),
            run.first.us_per_request(0),
            b.cpu[0] * 1e6 / b.tally.requests.max(1) as f64
        );
    }
    let errors = run.first.errors + run.replay.errors;
    let _ = writeln!(
        out,
        "gRPC answers that were errors: {errors} (target 0): {}",
        if errors == 0 { "met" } else { "NOT met" }
    );
    out
}
