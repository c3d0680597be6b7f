//! The driver: databases, server children, load, report.
//!
//! A run is a sequence of groups, one per RTT of `IDEM_BENCH_DB_RTTS`: each
//! starts a PostgreSQL server whose pool reaches the database through the
//! delaying proxy (none at RTT 0) and runs the selected scenarios in interleaved
//! slices. The first group also runs the SQLite scenarios, on a second server,
//! interleaved with the rest. Then the memory run of (b) and the statement
//! profile, and one report.

mod grpc;
mod load;
mod long_ops;
mod profile;
mod redis_targets;
mod report;
mod system;

use load::*;
use long_ops::*;
use profile::*;
use redis_targets::RedisRun;
use system::*;

use super::*;

/// Every knob, from the environment.
pub struct Settings {
    /// `IDEM_BENCH_SECS` (10): measured seconds per scenario.
    secs: f64,
    /// `IDEM_BENCH_WARMUP_SECS` (2): seconds of load before measuring, not counted.
    warmup: f64,
    /// `IDEM_BENCH_CLIENTS` (8): concurrent clients in every scenario but (e), (h).
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
    /// `IDEM_BENCH_SCENARIOS` (abcdefghist; empty skips PostgreSQL's): which
    /// scenarios on PostgreSQL.
    scenarios: String,
    /// `IDEM_BENCH_SQLITE_SCENARIOS` (abce; empty skips SQLite): which of (a),
    /// (b), (c), (e) also run on the SQLite file.
    sqlite_scenarios: String,
    /// `IDEM_BENCH_MYSQL_SCENARIOS` (abce; empty skips MySQL): which of (a), (b),
    /// (c), (e) also run on MySQL / MariaDB.
    mysql_scenarios: String,
    /// `IDEM_BENCH_MYSQL_URL` (or `IDEM_TEST_MYSQL_URL`, or the local server): a
    /// database `idem_bench_<pid>` is made there for the run.
    mysql_admin_url: String,
    /// `IDEM_BENCH_REDIS_SCENARIOS` (fj; empty skips Redis): which of (f), (j)
    /// also run with leased mode's records in Redis.
    pub redis_scenarios: String,
    /// `IDEM_BENCH_REDIS_URL` (or `IDEM_TEST_REDIS_URL`, or the local server).
    pub redis_url: String,
    /// `IDEM_BENCH_REDIS_CLUSTER` (or `IDEM_TEST_REDIS_CLUSTER`, or
    /// `.ci/redis-cluster`'s 127.0.0.1:7000-7002; empty skips the cluster):
    /// some nodes of a Redis Cluster, `host:port,...`.
    pub redis_cluster: String,
    /// `IDEM_BENCH_REDIS_ACKS` (1:1000; empty skips): `<replicas>:<ms>` of the
    /// cluster run with `with_replica_acks`.
    pub redis_acks: String,
    /// `IDEM_BENCH_DB_RTTS` (0,500,1000): round-trip times in microseconds that
    /// the proxy adds between the server and PostgreSQL; every PostgreSQL
    /// scenario runs at each.
    rtts: Vec<u64>,
    /// `IDEM_BENCH_RSS_SECS` (60; 0 skips): seconds of (b) at RTT 0 with the
    /// server's RSS sampled every second.
    rss_secs: f64,
    /// `IDEM_BENCH_LONG_OPS` (3000; 0 skips (k)): long operations running beside
    /// (b) in (k), on each database.
    long_ops: usize,
    /// `IDEM_BENCH_PROFILE_REQUESTS` (200; 0 skips): sequential requests per
    /// scenario through the counting proxy.
    profile_requests: usize,
    /// `IDEM_BENCH_ADMIN_URL` (or `IDEM_TEST_DATABASE_URL`, or the local server).
    admin_url: String,
    /// `IDEM_BENCH_KEEP_DB=1` keeps the database and the SQLite file.
    keep_db: bool,
    /// `IDEM_BENCH_GRPC` (1; 0 skips (u), (v)): the gRPC scenarios.
    grpc: bool,
}

impl Settings {
    fn from_env() -> Result<Settings, String> {
        let admin_url = std::env::var("IDEM_BENCH_ADMIN_URL")
            .or_else(|_| std::env::var("IDEM_TEST_DATABASE_URL"))
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let rtts: String = env_or("IDEM_BENCH_DB_RTTS", "0,500,1000".to_owned())?;
        let rtts = rtts
            .split(',')
            .map(|r| r.trim().parse::<u64>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| format!("IDEM_BENCH_DB_RTTS={rtts:?}: microseconds, comma-separated"))?;
        // An explicitly empty list of scenarios skips that database's, unlike
        // the other settings (empty is their default).
        let scenarios =
            std::env::var("IDEM_BENCH_SCENARIOS").unwrap_or_else(|_| "abcdefghist".to_owned());
        let sqlite_scenarios = std::env::var("IDEM_BENCH_SQLITE_SCENARIOS")
            .unwrap_or_else(|_| "abce".to_owned())
            .chars()
            .filter(|c| "abce".contains(*c))
            .collect();
        let mysql_scenarios = std::env::var("IDEM_BENCH_MYSQL_SCENARIOS")
            .unwrap_or_else(|_| "abce".to_owned())
            .chars()
            .filter(|c| "abce".contains(*c))
            .collect();
        let redis_scenarios = std::env::var("IDEM_BENCH_REDIS_SCENARIOS")
            .unwrap_or_else(|_| "fj".to_owned())
            .chars()
            .filter(|c| "fj".contains(*c))
            .collect();
        let redis_url = std::env::var("IDEM_BENCH_REDIS_URL")
            .or_else(|_| std::env::var("IDEM_TEST_REDIS_URL"))
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let redis_cluster = std::env::var("IDEM_BENCH_REDIS_CLUSTER")
            .or_else(|_| std::env::var("IDEM_TEST_REDIS_CLUSTER"))
            .unwrap_or_else(|_| "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002".to_owned());
        let redis_acks =
            std::env::var("IDEM_BENCH_REDIS_ACKS").unwrap_or_else(|_| "1:1000".to_owned());
        let mysql_admin_url = std::env::var("IDEM_BENCH_MYSQL_URL")
            .or_else(|_| std::env::var("IDEM_TEST_MYSQL_URL"))
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        Ok(Settings {
            secs: env_or("IDEM_BENCH_SECS", 10.0)?,
            warmup: env_or("IDEM_BENCH_WARMUP_SECS", 2.0)?,
            clients: env_or("IDEM_BENCH_CLIENTS", 8)?,
            slices: env_or("IDEM_BENCH_SLICES", 5_usize)?.max(1),
            contention_clients: env_or("IDEM_BENCH_CONTENTION_CLIENTS", 64)?,
            contention_keys: env_or("IDEM_BENCH_CONTENTION_KEYS", 16)?,
            replay_keys: env_or("IDEM_BENCH_REPLAY_KEYS", 1000)?,
            scenarios,
            sqlite_scenarios,
            mysql_scenarios,
            mysql_admin_url,
            redis_scenarios,
            redis_url,
            redis_cluster,
            redis_acks,
            rtts,
            rss_secs: env_or("IDEM_BENCH_RSS_SECS", 60.0)?,
            long_ops: env_or("IDEM_BENCH_LONG_OPS", 3000)?,
            profile_requests: env_or("IDEM_BENCH_PROFILE_REQUESTS", 200)?,
            admin_url,
            keep_db: std::env::var("IDEM_BENCH_KEEP_DB").as_deref() == Ok("1"),
            grpc: std::env::var("IDEM_BENCH_GRPC").as_deref() != Ok("0"),
        })
    }

    fn clients_for(&self, sc: &Scenario) -> usize {
        if sc.kind.is_contention() {
            self.contention_clients
        } else {
            self.clients
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Bare,
    Idem,
    Replay,
    Middleware,
    Contention,
    Leased,
    /// The peer crate, first executions.
    Peer,
    /// The peer crate under (e)'s contention.
    PeerContention,
}

impl Kind {
    pub fn is_contention(self) -> bool {
        matches!(self, Kind::Contention | Kind::PeerContention)
    }
}

pub struct Scenario {
    pub id: char,
    pub kind: Kind,
    pub title: &'static str,
    pub path: &'static str,
}

pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        id: 'a',
        kind: Kind::Bare,
        title: "bare insert, 1 tx",
        path: "/bare/orders",
    },
    Scenario {
        id: 'b',
        kind: Kind::Idem,
        title: "#[idempotent] first exec",
        path: "/idem/orders",
    },
    Scenario {
        id: 'c',
        kind: Kind::Replay,
        title: "#[idempotent] replay",
        path: "/idem/orders",
    },
    Scenario {
        id: 'd',
        kind: Kind::Middleware,
        title: "middleware, 3 tx",
        path: "/mw/orders",
    },
    Scenario {
        id: 'e',
        kind: Kind::Contention,
        title: "contention 64c/16 keys",
        path: "/idem/orders",
    },
    Scenario {
        id: 'f',
        kind: Kind::Leased,
        title: "leased first exec",
        path: "/leased/orders",
    },
    Scenario {
        id: 'g',
        kind: Kind::Peer,
        title: "peer first exec",
        path: "/peer/orders",
    },
    Scenario {
        id: 'h',
        kind: Kind::PeerContention,
        title: "peer contention 64c/16k",
        path: "/peer/orders",
    },
    Scenario {
        id: 'i',
        kind: Kind::Replay,
        title: "replay, replay cache on",
        path: "/cached/orders",
    },
    Scenario {
        id: 'j',
        kind: Kind::Replay,
        title: "leased replay",
        path: "/leased/orders",
    },
    Scenario {
        id: 's',
        kind: Kind::Idem,
        title: "(b), answers sealed at rest",
        path: "/sealed/orders",
    },
    Scenario {
        id: 't',
        kind: Kind::Replay,
        title: "(c), answers sealed at rest",
        path: "/sealed/orders",
    },
];

fn scenario(id: char) -> &'static Scenario {
    SCENARIOS
        .iter()
        .find(|sc| sc.id == id)
        .expect("a known scenario")
}

/// How (g) and (h) are set up, for the report (see `server.rs`, `mod peer`).
const PEER: &str = "peer (g), (h): axum-idempotent 0.6.0 as its README sets it up: direct-key mode on \
    Idempotency-Key (required), responses cached 300 s, ruts 0.13.0 SessionLayer (cookie \"session\") over \
    its in-memory MokaStore, tower-cookies 0.11.0 CookieManagerLayer; on (a)'s handler (the insert in its \
    own transaction); a session per client in (g), one per key in (h) (the clients of a key share it)";

/// Where a scenario runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Db {
    /// PostgreSQL on this machine, reached with this added round-trip time.
    Postgres { rtt_us: u64 },
    /// The SQLite file, in the server's process.
    Sqlite,
    /// MySQL / MariaDB on this machine (loopback, no proxy).
    MySql,
    /// Leased mode's records in Redis, the insert on PostgreSQL at RTT 0.
    Redis(RedisAt),
}

/// Where a Redis scenario keeps its records.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RedisAt {
    /// One server.
    Server,
    /// The Redis Cluster.
    Cluster,
    /// The Redis Cluster, each state change waiting for its replica (`WAIT`).
    ClusterAcks,
}

impl Db {
    /// Part of the scenario's tenant, so each database and RTT has its own rows.
    fn tag(self) -> String {
        match self {
            Db::Postgres { rtt_us } => format!("pg{rtt_us}"),
            Db::Sqlite => "sqlite".to_owned(),
            Db::MySql => "mysql".to_owned(),
            Db::Redis(RedisAt::Server) => "redis".to_owned(),
            Db::Redis(RedisAt::Cluster) => "rcluster".to_owned(),
            Db::Redis(RedisAt::ClusterAcks) => "rclusterwait".to_owned(),
        }
    }

    pub fn label(self) -> String {
        match self {
            Db::Postgres { rtt_us: 0 } => "PostgreSQL, RTT 0 (loopback, no proxy)".to_owned(),
            Db::Postgres { rtt_us } => {
                format!("PostgreSQL, RTT {rtt_us} us (every answer delayed by the proxy)")
            }
            Db::Sqlite => {
                "SQLite file (WAL), in the server's process: RTT does not apply".to_owned()
            }
            Db::MySql => "MySQL / MariaDB (InnoDB), RTT 0 (loopback, no proxy)".to_owned(),
            Db::Redis(RedisAt::Server) => {
                "Redis, one server: the lease records in Redis, the insert on PostgreSQL at RTT 0 \
                 (px us: the redis-server CPU)"
                    .to_owned()
            }
            Db::Redis(RedisAt::Cluster) => {
                "Redis Cluster, 3 masters + 3 replicas: the lease records in the cluster, the \
                 insert on PostgreSQL at RTT 0 (px us: the six redis-servers' CPU)"
                    .to_owned()
            }
            Db::Redis(RedisAt::ClusterAcks) => {
                "Redis Cluster with WAIT after each state change (with_replica_acks), the insert \
                 on PostgreSQL at RTT 0 (px us: the six redis-servers' CPU)"
                    .to_owned()
            }
        }
    }
}

/// The driver's own connections, for migrations and the checks of rows.
pub struct Pools {
    pub pg: PgPool,
    pub sqlite: Option<sqlx::SqlitePool>,
    pub mysql: Option<sqlx::MySqlPool>,
}

/// The scenarios that ran interleaved on one PostgreSQL RTT (the first group
/// also has the SQLite ones).
pub struct Group {
    pub rtt_us: u64,
    pub results: Vec<Measured>,
    /// How far from their due time the delaying proxy wrote its chunks (RTT > 0).
    pub delay: Option<proxy::DelayReport>,
    /// Median latency of (a) alone, one request at a time, in milliseconds.
    pub sequential_p50: f64,
}

/// Requests of the sequential (a) that checks the proxy at each RTT.
const PROBE_REQUESTS: usize = 200;

pub async fn main() -> Result<(), String> {
    let s = Settings::from_env()?;
    let load_before = loadavg();
    drop_stale(&s.admin_url).await?;
    let name = format!("idem_bench_{}", std::process::id());
    admin_exec(&s.admin_url, format!("CREATE DATABASE {name}")).await?;
    let url = database_url(&s.admin_url, &name);
    let sqlite = sqlite_path();
    let mysql_url = if s.mysql_scenarios.is_empty() {
        None
    } else {
        mysql_exec(&s.mysql_admin_url, format!("CREATE DATABASE {name}")).await?;
        Some(replace_database(&s.mysql_admin_url, &name))
    };
    let result = run_all(&s, &url, &sqlite, mysql_url.as_deref(), &load_before).await;
    if s.keep_db {
        eprintln!("kept database {name} and {}", sqlite.display());
    } else {
        admin_exec(
            &s.admin_url,
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
        .await?;
        remove_sqlite(&sqlite);
        if mysql_url.is_some() {
            mysql_exec(
                &s.mysql_admin_url,
                format!("DROP DATABASE IF EXISTS {name}"),
            )
            .await?;
        }
    }
    result
}

/// Migrates both databases and creates the business tables; answers the driver's
/// pools (no SQLite pool when no SQLite scenario runs).
async fn prepare_databases(
    s: &Settings,
    url: &str,
    sqlite: &std::path::Path,
    mysql_url: Option<&str>,
) -> Result<Pools, String> {
    let pg = PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    idem_runtime::migrate(&pg)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::raw_sql(SCHEMA)
        .execute(&pg)
        .await
        .map_err(|e| e.to_string())?;
    let mysql = match mysql_url {
        None => None,
        Some(url) => {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(2)
                .connect(url)
                .await
                .map_err(|e| format!("MySQL: {e}"))?;
            idem_runtime::migrate(&pool)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::raw_sql(MYSQL_SCHEMA)
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
            Some(pool)
        }
    };
    if s.sqlite_scenarios.is_empty() {
        return Ok(Pools {
            pg,
            sqlite: None,
            mysql,
        });
    }
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let sqlite = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(sqlite)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
        .map_err(|e| format!("SQLite at {}: {e}", sqlite.display()))?;
    idem_runtime::migrate(&sqlite)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::raw_sql(SQLITE_SCHEMA)
        .execute(&sqlite)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Pools {
        pg,
        sqlite: Some(sqlite),
        mysql,
    })
}

async fn run_all(
    s: &Settings,
    url: &str,
    sqlite: &std::path::Path,
    mysql_url: Option<&str>,
    load_before: &str,
) -> Result<(), String> {
    let pools = prepare_databases(s, url, sqlite, mysql_url).await?;
    let mysql_version = match &pools.mysql {
        Some(pool) => {
            let v: String = sqlx::query_scalar("SELECT CONCAT('; MySQL ', VERSION())")
                .fetch_one(pool)
                .await
                .map_err(|e| e.to_string())?;
            v
        }
        None => String::new(),
    };
    let pg: String = sqlx::query_scalar(
        "SELECT 'PostgreSQL ' || current_setting('server_version') \
             || ', fsync ' || current_setting('fsync') \
             || ', synchronous_commit ' || current_setting('synchronous_commit') \
             || ', shared_buffers ' || current_setting('shared_buffers')",
    )
    .fetch_one(&pools.pg)
    .await
    .map_err(|e| e.to_string())?;
    eprintln!(
        "idem bench: {} s per scenario after {} s warm-up, {} clients ({} over {} keys in (e), (h)), \
         RTTs {:?} us; load {load_before}",
        s.secs, s.warmup, s.clients, s.contention_clients, s.contention_keys, s.rtts
    );

    let sqlite_url = format!("sqlite:{}", sqlite.display());
    let (redis_runs, redis_skipped) = redis_targets::targets(s).await;
    let mut groups = Vec::new();
    for (i, &rtt_us) in s.rtts.iter().enumerate() {
        let sqlite = (i == 0 && pools.sqlite.is_some()).then_some(sqlite_url.as_str());
        let mysql = mysql_url.filter(|_| i == 0 && pools.mysql.is_some());
        let redis: &[RedisRun] = if i == 0 { &redis_runs } else { &[] };
        let group = run_group(s, &pools, (url, sqlite, mysql, redis), rtt_us).await;
        if group.is_err() {
            redis_targets::cleanup(s, &redis_runs).await;
        }
        groups.push(group?);
    }
    let long_ops = if s.long_ops > 0 {
        let sqlite = pools.sqlite.is_some().then_some(sqlite_url.as_str());
        let mysql = mysql_url.filter(|_| pools.mysql.is_some());
        let run = long_ops_run(s, url, (sqlite, mysql), &redis_runs).await;
        if run.is_err() {
            redis_targets::cleanup(s, &redis_runs).await;
        }
        run?
    } else {
        Vec::new()
    };
    redis_targets::cleanup(s, &redis_runs).await;
    let rss = if s.rss_secs > 0.0 {
        Some(rss_run(s, &pools, url).await?)
    } else {
        None
    };
    let profiled = if s.profile_requests > 0 {
        eprintln!(
            "idem bench: statement profile ({} sequential requests per scenario) ...",
            s.profile_requests
        );
        profile(s, url).await?
    } else {
        Vec::new()
    };
    let grpc = if s.grpc {
        Some(grpc::grpc_run(s, url).await?)
    } else {
        None
    };
    let load_after = loadavg();

    let header = format!(
        "idem bench: {}; {pg}{mysql_version}\n{} s measured per scenario in {} interleaved slices, after {} s warm-up; \
         {} clients, (e) and (h) {} clients over {} fresh keys per round; load average before \
         {load_before}, after {load_after}\n{PEER}",
        machine(),
        s.secs,
        s.slices,
        s.warmup,
        s.clients,
        s.contention_clients,
        s.contention_keys
    );
    let report = report::Report {
        s,
        header,
        redis_skipped: &redis_skipped,
        groups: &groups,
        long_ops: &long_ops,
        rss: rss.as_ref(),
        profiled: &profiled,
    };
    println!("{}", report.render());
    if let Some(run) = &grpc {
        println!("{}", grpc::render(run, &groups));
    }
    pools.pg.close().await;
    if let Some(p) = pools.sqlite {
        p.close().await;
    }
    if let Some(p) = pools.mysql {
        p.close().await;
    }
    Ok(())
}

/// One RTT: its PostgreSQL server (and, in the first group, the SQLite server),
/// the replays prepared, every scenario in interleaved slices, the rows checked.
async fn run_group(
    s: &Settings,
    pools: &Pools,
    (pg_url, sqlite_url, mysql_url, redis): (&str, Option<&str>, Option<&str>, &[RedisRun]),
    rtt_us: u64,
) -> Result<Group, String> {
    let mut servers =
        vec![Server::start(pg_url, &[("IDEM_BENCH_DB_RTT_US", rtt_us.to_string())]).await?];
    let db = Db::Postgres { rtt_us };
    let probe_tenant = format!("probe-{}", db.tag());
    let sequential_p50 = sequential_p50(&servers[0].base, &probe_tenant, PROBE_REQUESTS).await?;
    let mut results: Vec<Measured> = SCENARIOS
        .iter()
        .filter(|sc| s.scenarios.contains(sc.id))
        .map(|sc| Measured::new(sc, db, 0, s.clients_for(sc)))
        .collect();
    if let Some(sqlite_url) = sqlite_url {
        let backend = [("IDEM_BENCH_BACKEND", "sqlite".to_owned())];
        servers.push(Server::start(sqlite_url, &backend).await?);
        results.extend(
            s.sqlite_scenarios
                .chars()
                .map(scenario)
                .map(|sc| Measured::new(sc, Db::Sqlite, 1, s.clients_for(sc))),
        );
    }
    if let Some(mysql_url) = mysql_url {
        let backend = [("IDEM_BENCH_BACKEND", "mysql".to_owned())];
        let index = servers.len();
        servers.push(Server::start(mysql_url, &backend).await?);
        results.extend(
            s.mysql_scenarios
                .chars()
                .map(scenario)
                .map(|sc| Measured::new(sc, Db::MySql, index, s.clients_for(sc))),
        );
    }
    // Leased mode with its records in Redis: a server each, its insert on
    // PostgreSQL without the delaying proxy.
    for run in redis {
        let index = servers.len();
        let mut server = Server::start(pg_url, &run.env).await?;
        server.redis_pids = run.pids.clone();
        servers.push(server);
        let db = Db::Redis(run.at);
        results.extend(
            s.redis_scenarios
                .chars()
                .map(scenario)
                .map(|sc| Measured::new(sc, db, index, s.clients_for(sc))),
        );
    }
    let mut replays = false;
    for m in &results {
        if m.sc.kind == Kind::Replay {
            prepare_replays(s, &m.endpoint(&servers[m.server].base)).await?;
            replays = true;
        }
    }
    // Statistics for the replays' rows. Not where no scenario prepared any:
    // an idem table analysed empty makes the servers' sessions cache
    // sequential-scan plans for the key lookups, which they keep while the
    // table grows under the load (a single-scenario run of (b) measured
    // seq scans of the whole table per probe).
    if replays {
        let _ = sqlx::raw_sql("VACUUM ANALYZE").execute(&pools.pg).await;
    }

    let clients: Vec<reqwest::Client> = results.iter().map(|m| http_client(m.clients)).collect();
    let slices = if results.len() == 1 { 1 } else { s.slices };
    for slice in 0..slices {
        for (m, client) in results.iter_mut().zip(&clients) {
            eprintln!(
                "idem bench: {}: ({}) {}, slice {}/{slices} ...",
                m.db.tag(),
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
            run_slice(s, m, slice, (warmup, secs), &servers[m.server], client).await?;
        }
    }
    for m in &mut results {
        check_rows(s, m, pools).await?;
        for e in &m.tally.error_examples {
            eprintln!("  {} ({}) error: {e}", m.db.tag(), m.sc.id);
        }
    }
    let delay = if rtt_us > 0 {
        Some(delay_report(&servers[0].base).await?)
    } else {
        None
    };
    for server in servers {
        server.stop().await;
    }
    Ok(Group {
        rtt_us,
        results,
        delay,
        sequential_p50,
    })
}

async fn delay_report(base: &str) -> Result<proxy::DelayReport, String> {
    reqwest::get(format!("{base}/bench/delay"))
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())
}

/// The memory run: a fresh server at RTT 0, with the metrics recorder of
/// `IDEM_BENCH_METRICS` (Prometheus with upkeep by default), serving (b) for
/// `IDEM_BENCH_RSS_SECS` after the warm-up, its RSS sampled every second.
async fn rss_run(s: &Settings, pools: &Pools, url: &str) -> Result<Measured, String> {
    eprintln!(
        "idem bench: memory run, (b) for {} s at RTT 0 ...",
        s.rss_secs
    );
    let server = Server::start(url, &[]).await?;
    let sc = scenario('b');
    let mut m = Measured::new(sc, Db::Postgres { rtt_us: 0 }, 0, s.clients);
    m.tenant = "bench-b-rss".to_owned();
    let client = http_client(m.clients);
    run_slice(s, &mut m, 0, (s.warmup, s.rss_secs), &server, &client).await?;
    check_rows(s, &mut m, pools).await?;
    server.stop().await;
    Ok(m)
}

/// Runs one statement on the MySQL server (creating or dropping the run's
/// database).
async fn mysql_exec(admin_url: &str, sql: String) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::MySqlConnection::connect(admin_url)
        .await
        .map_err(|e| format!("MySQL at {admin_url}: {e}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    let _ = conn.close().await;
    Ok(())
}

/// `admin_url` with its database replaced by `name`.
fn replace_database(admin_url: &str, name: &str) -> String {
    let (base, query) = admin_url.split_once('?').unwrap_or((admin_url, ""));
    let server = match base.rsplit_once('/') {
        Some((head, _)) if !head.ends_with(':') && !head.ends_with(":/") => head,
        _ => base,
    };
    if query.is_empty() {
        format!("{server}/{name}")
    } else {
        format!("{server}/{name}?{query}")
    }
}
