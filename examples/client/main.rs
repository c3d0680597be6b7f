//! `cargo run --example client --features client`: places orders with idem-client
//! through a flaky connection and shows that each logical request made exactly one
//! order. (The feature brings in idem-client, which `orders` does not need.)
//!
//! Start the `orders` example first (`cargo run --example orders`). This program
//! starts a TCP proxy of its own, in process, in front of it; the proxy decides
//! each connection's fate with a seeded random generator: it passes the
//! connection through, closes it before the request reaches the service (the
//! request is lost), or forwards the request and closes the connection as soon as
//! the answer starts (the response is lost: the order exists, the client does not
//! know). The client sends every order through the proxy with
//! `IdempotencyMiddleware`, one connection per attempt, then lists the tenant's
//! orders directly from the service and checks there is one per logical request.
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `ORDERS_URL` | `http://127.0.0.1:3000` | the `orders` service |
//! | `CLIENT_ORDERS` | `5` | how many orders (logical requests) to place |
//! | `CLIENT_SEED` | random (printed) | the proxy's seed: the same seed, the same fates |
//! | `CLIENT_TENANT` | `client-demo-<random>` | the tenant to place them for (`[a-z0-9-]`) |
//!
//! It exits with status 1 if the count is off.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_client::{ErrorExt, IdempotencyMiddleware, ResponseExt};
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does with one connection.
#[derive(Clone, Copy, Debug)]
enum Fate {
    Pass,
    LoseRequest,
    LoseResponse,
}

/// How many connections met each fate.
#[derive(Default)]
struct Tally {
    passed: AtomicU32,
    lost_requests: AtomicU32,
    lost_responses: AtomicU32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let orders_url = std::env::var("ORDERS_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let n: u32 = env_or("CLIENT_ORDERS", 5)?;
    let seed: u64 = env_or("CLIENT_SEED", fastrand::u64(..))?;
    let tenant = std::env::var("CLIENT_TENANT")
        .unwrap_or_else(|_| format!("client-demo-{:08x}", fastrand::u32(..)));

    let upstream = reqwest::Url::parse(&orders_url)?;
    let upstream = format!(
        "{}:{}",
        upstream.host_str().ok_or("ORDERS_URL has no host")?,
        upstream.port_or_known_default().unwrap_or(80)
    );
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let proxy_url = format!("http://{}", listener.local_addr()?);
    let tally = Arc::new(Tally::default());
    tokio::spawn(proxy(listener, upstream, seed, tally.clone()));
    println!("proxy {proxy_url} -> {orders_url} (seed {seed}), tenant {tenant}");

    // One connection per attempt, so that each attempt meets a fate of its own.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let client = reqwest_middleware::ClientBuilder::new(http)
        .with(
            IdempotencyMiddleware::new()
                .attempt_timeout(Duration::from_secs(10))
                .max_attempts(20)
                .deadline(Duration::from_secs(60)),
        )
        .build();

    let mut ids = BTreeSet::new();
    for i in 1..=n {
        let sent = client
            .post(format!("{proxy_url}/orders"))
            .bearer_auth(&tenant)
            .header("x-currency", "EUR")
            .json(&json!({"sku": format!("DEMO-{i}"), "quantity": 1, "amount_cents": 100 * i}))
            .send()
            .await;
        let answer = match sent {
            Ok(answer) => answer,
            Err(e) => {
                match (e.gave_up(), e.interrupted()) {
                    (Some(gave_up), _) => eprintln!("order {i}: {gave_up}"),
                    (_, Some(interrupted)) => eprintln!("order {i}: {interrupted}"),
                    _ => eprintln!("order {i}: {e}"),
                }
                std::process::exit(1);
            }
        };
        let idem = answer
            .idem()
            .expect("a POST goes through the middleware")
            .clone();
        let status = answer.status();
        let body: Value = answer.json().await?;
        println!(
            "order {i}: {status}, id {}, {} attempt(s), replayed: {}",
            body["id"], idem.attempts, idem.replayed
        );
        if let Some(id) = body["id"].as_i64() {
            ids.insert(id);
        }
    }

    println!(
        "proxy: {} connections passed, {} requests lost, {} responses lost",
        tally.passed.load(Ordering::Relaxed),
        tally.lost_requests.load(Ordering::Relaxed),
        tally.lost_responses.load(Ordering::Relaxed)
    );
    // Straight to the service, not through the proxy.
    let listed: Vec<Value> = reqwest::Client::new()
        .get(format!("{orders_url}/orders"))
        .bearer_auth(&tenant)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let listed_ids: BTreeSet<i64> = listed.iter().filter_map(|o| o["id"].as_i64()).collect();
    println!("{} orders for {n} logical requests", listed.len());
    if listed.len() != n as usize || listed_ids != ids {
        eprintln!("expected exactly the {n} orders the client was answered with");
        std::process::exit(1);
    }
    Ok(())
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(v) => v.parse().map_err(|_| format!("{name}={v:?} is not valid")),
        Err(_) => Ok(default),
    }
}

/// Accepts connections and gives each a fate: half pass, a quarter lose their
/// request, a quarter their response.
async fn proxy(listener: TcpListener, upstream: String, seed: u64, tally: Arc<Tally>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    loop {
        let Ok((downstream, _)) = listener.accept().await else {
            continue;
        };
        let fate = match rng.u8(0..4) {
            0 => Fate::LoseRequest,
            1 => Fate::LoseResponse,
            _ => Fate::Pass,
        };
        let (upstream, tally) = (upstream.clone(), tally.clone());
        tokio::spawn(async move {
            let counter = match fate {
                Fate::Pass => &tally.passed,
                Fate::LoseRequest => &tally.lost_requests,
                Fate::LoseResponse => &tally.lost_responses,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let _ = relay(downstream, &upstream, fate).await;
        });
    }
}

async fn relay(mut downstream: TcpStream, upstream: &str, fate: Fate) -> std::io::Result<()> {
    match fate {
        // Closed before a byte is forwarded: the service never sees the request.
        Fate::LoseRequest => Ok(()),
        Fate::Pass => {
            let mut upstream = TcpStream::connect(upstream).await?;
            tokio::io::copy_bidirectional(&mut downstream, &mut upstream).await?;
            Ok(())
        }
        // The request goes through; once the answer starts (the service has
        // committed by then), both connections are closed without passing it on.
        Fate::LoseResponse => {
            let upstream = TcpStream::connect(upstream).await?;
            let (mut from_client, _to_client) = downstream.into_split();
            let (mut from_service, mut to_service) = upstream.into_split();
            let forward = tokio::spawn(async move {
                let _ = tokio::io::copy(&mut from_client, &mut to_service).await;
            });
            let mut first = [0u8; 1];
            let _ = from_service.read(&mut first).await;
            forward.abort();
            Ok(())
        }
    }
}
