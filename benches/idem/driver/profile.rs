//! The statement profile: a server whose pool talks to PostgreSQL through the
//! counting proxy, and sequential requests, so that every request's round trips,
//! protocol messages and SQL statements are counted exactly. Round trips do not
//! depend on the RTT, so the profile runs once, without a delay.

use super::*;

pub struct Profiled {
    pub id: char,
    pub title: &'static str,
    pub per_request: proxy::Stats,
    pub n: usize,
}

impl Profiled {
    /// Round trips per request.
    pub fn round_trips(&self) -> f64 {
        self.per_request.round_trips as f64 / self.n.max(1) as f64
    }
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
/// trips per request of each selected scenario but the contention ones.
pub async fn profile(s: &Settings, url: &str) -> Result<Vec<Profiled>, String> {
    let server = Server::start(url, &[("IDEM_BENCH_PROXY", "1".to_owned())]).await?;
    let client = http_client(1);
    let n = s.profile_requests;
    let mut out = Vec::new();
    for sc in SCENARIOS {
        if sc.kind.is_contention() || !s.scenarios.contains(sc.id) {
            continue;
        }
        let mut to = Endpoint {
            url: format!("{}{}", server.base, sc.path),
            tenant: format!("profile-{}", sc.id),
            cookie: None,
        };
        if sc.kind == Kind::Peer {
            to.cookie = Some(open_session(&client, &server.base).await?);
        }
        let key = |i: usize| format!("p{}-{i}", sc.id);
        if sc.kind == Kind::Replay {
            for i in 0..n {
                send(&client, &to, &key(i)).await?;
            }
        }
        // Warm-up requests, so that every connection the pool opens for sequential
        // requests has its statements prepared (sqlx's, and idem's in the
        // session); a connection opened later shows in the first-use count.
        for i in 0..20 {
            send(&client, &to, &format!("pw{}-{i}", sc.id)).await?;
        }
        let before = protocol_stats(&client, &server.base).await?;
        for i in 0..n {
            let a = send(&client, &to, &key(i)).await?;
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
