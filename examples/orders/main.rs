//! `orders`: an Axum service whose `POST`s are safe to retry, built with
//! `#[idempotent]`. The README's quickstart runs it; the end-to-end suite in
//! `tests/orders_e2e.rs` kills, restarts and races it.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | unset: the SQLite file `idem-orders.db` in the working directory | `postgres://...` for PostgreSQL, `mysql://...` for MySQL / MariaDB, `sqlite:PATH` for another SQLite file |
//! | `IDEM_LEASE_STORE` | unset: the database of `DATABASE_URL` | `redis://HOST:PORT[/DB]`: the leases of `POST /payments` live in Redis (its reconciler too); the provider's charges stay in the database. Several URLs separated by commas (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`) are the nodes of a Redis Cluster |
//! | `IDEM_LEASE_STORE_PREFIX` | `idem` | with `IDEM_LEASE_STORE`: the prefix of every Redis key (one per service sharing a server) |
//! | `IDEM_KEY_RING` | unset: answers are stored in clear | `ID:BASE64` keys of 32 bytes, separated by commas (`2026-12:q2Fk...=`): every answer idem stores (orders, payments, exports, on every store) is sealed with the active key and opened when a retry replays it (docs/security.md); a malformed ring stops the service at start |
//! | `IDEM_ACTIVE_KEY` | the only key | with several keys in `IDEM_KEY_RING`: the id of the one that seals new answers |
//! | `IDEM_ADDR` | `127.0.0.1:3000` | listen address (`127.0.0.1:0` picks a free port) |
//! | `ORDERS_LATENCY_MS` | `0` | slow work inside the transaction, after the claim |
//! | `ORDERS_HOLD_FILE` | unset | a path: while the file exists, `POST /orders` and `POST /refunds` wait inside their transaction after the claim (the tests hold a request mid-way and release it by removing the file) |
//! | `EXPORTS_DURATION_MS` | `3000` | how long an export (`POST /exports`, a long operation) works (at most 3600000) |
//! | `IDEM_IN_FLIGHT_WAIT_MS` | `1000` | how long a duplicate waits for the first (at most 5000) |
//! | `PAYMENTS_PROVIDER_LATENCY_MS` | `0` | the simulated provider's latency per call |
//! | `PAYMENTS_PROVIDER_LATENCY_AFTER_CHARGE_MS` | `0` | the provider charges, then takes this long to answer |
//! | `PAYMENTS_PROVIDER_HOLD_FILE` | unset | a path: while the file exists, the provider charges and then does not answer (the tests hold a payment's lease mid-way and release it by removing the file) |
//! | `PAYMENTS_PROVIDER_OUTAGE_CALLS` | `0` | the provider's first N calls fail (503) |
//! | `PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE` | `0` | the provider's first N charges time out after charging |
//! | `PAYMENTS_RECONCILE_INTERVAL_MS` | `5000` | how often uncertain payments are reconciled (1 to 3600000) |
//! | `IDEM_SWEEP_INTERVAL_MS` | `60000` | how often expired keys are swept (1 to 86400000) |
//! | `ORDERS_HEADER_TIMEOUT_MS` | `10000` | a connection that sends no whole request head within this time (since it opened, or since its last answer) is closed |
//! | `ORDERS_BODY_TIMEOUT_MS` | `30000` | a request body that has not arrived within this time is `408` |
//! | `ORDERS_SHUTDOWN_GRACE_MS` | `30000` | on `SIGTERM` or `SIGINT`, how long requests in flight may take to finish |
//! | `ORDERS_WRITE_TIMEOUT_MS` | `30000` | a write to a client that stopped reading, pending this long without progress, closes its connection |
//! | `ORDERS_MAX_CONNECTIONS` | `1024` | connections served at once; more wait in the listen backlog until one closes |
//!
//! `GET /metrics` serves the idem metrics in the Prometheus text format, and
//! `GET /openapi.json` the service's OpenAPI document (`routes.rs`, `ApiDoc`, and
//! `openapi.rs`), which declares every answer of every route.
//!
//! Every route behaves the same on SQLite, PostgreSQL and MySQL / MariaDB.

mod auth;
mod exports;
mod fulfilment;
mod input;
mod openapi;
mod payments;
mod problems;
mod routes;
mod server;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use idem_runtime::Backend;
use idem_runtime::at_rest::KeyRing;
use idem_runtime::reconcile::Reconciler;
use idem_runtime::redis::{Redis, RedisLeaseStore};
use idem_runtime::{Executions, Idem, Sweeper};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{PgPool, Pool, SqlitePool};

/// Where the service keeps its data when `DATABASE_URL` is unset: a file beside
/// the caller, so that a restart (or a crash) finds what was committed.
const DEFAULT_SQLITE_FILE: &str = "idem-orders.db";

/// The database `DATABASE_URL` names.
enum Store {
    Postgres(PgPool),
    Sqlite(SqlitePool),
    MySql(sqlx::MySqlPool),
}

async fn connect() -> Result<Store, String> {
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = PgPoolOptions::new()
            .max_connections(32)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
        tracing::info!("orders: using PostgreSQL from DATABASE_URL");
        return Ok(Store::Postgres(pool));
    }
    if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let url = url.replacen("mariadb://", "mysql://", 1);
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(32)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
        tracing::info!("orders: using MySQL from DATABASE_URL");
        return Ok(Store::MySql(pool));
    }
    let opts = if url.is_empty() {
        SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE)
    } else if url.starts_with("sqlite:") {
        let rest = url.trim_start_matches("sqlite:").trim_start_matches("//");
        let (path, params) = rest.split_once('?').unwrap_or((rest, ""));
        // No path is a private temporary database to SQLite, and an in-memory one
        // is shared-cache in sqlx, where a writer makes others fail at once
        // instead of waiting: either forgets every key at exit.
        if path.is_empty() {
            return Err("DATABASE_URL names no SQLite file; give one (sqlite:orders.db)".into());
        }
        if path == ":memory:" || params.split('&').any(|p| p == "mode=memory") {
            return Err(
                "DATABASE_URL names an in-memory SQLite database; give a file (sqlite:orders.db)"
                    .into(),
            );
        }
        SqliteConnectOptions::from_str(&url)
            .map_err(|e| format!("DATABASE_URL is not a usable SQLite URL: {e}"))?
    } else {
        return Err(format!(
            "DATABASE_URL must start with postgres://, postgresql://, mysql:// or sqlite: (or be unset for \
             the embedded SQLite file), not {:?}",
            url.split(':').next().unwrap_or_default()
        ));
    };
    // WAL: readers never wait for the writer. The busy timeout is how long a
    // write waits for another, idem's claim included: past it the claim is
    // `503 store-busy` (docs/sqlite.md), whatever the in-flight wait says.
    let opts = opts
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    let path = std::path::absolute(opts.get_filename())
        .unwrap_or_else(|_| opts.get_filename().to_path_buf());
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(opts)
        .await
        .map_err(|e| format!("cannot open the SQLite database {}: {e}", path.display()))?;
    tracing::info!(
        "orders: using the SQLite database {} (set DATABASE_URL=postgres://... for PostgreSQL)",
        path.display()
    );
    Ok(Store::Sqlite(pool))
}

/// The largest request body; a larger one is `413`. Half of what idem stores of
/// an answer: an order's answer holds its body's fields re-serialised (JSON
/// escapes never make them longer than they arrived) and a few hundred bytes
/// more, so every order the service accepts has an answer idem can store and
/// replay, instead of a `500` that rolls back (and burns an id) on every retry.
const MAX_BODY_BYTES: usize = 512 * 1024;
/// What idem stores of an answer (its default, stated here beside the body limit
/// it must agree with).
const MAX_STORED_ANSWER_BYTES: usize = 1024 * 1024;
const _: () = assert!(2 * MAX_BODY_BYTES <= MAX_STORED_ANSWER_BYTES);

/// What the environment configures besides the database.
struct Settings {
    latency: Duration,
    hold_file: Option<std::sync::Arc<std::path::Path>>,
    export_duration: Duration,
    in_flight_wait: Duration,
    sweep_every: Duration,
    reconcile_every: Duration,
    provider: payments::ProviderConfig,
    /// `IDEM_LEASE_STORE`: where `POST /payments` keeps its leases, when not in
    /// the database.
    lease_store: Option<RedisLeaseStore>,
    /// `IDEM_KEY_RING`: what every stored answer is sealed with, if set.
    key_ring: Option<KeyRing>,
    limits: server::Limits,
    edges: server::Edges,
}

impl Settings {
    /// The reconciler of uncertain payments, and the sweeper: expired keys are
    /// forgotten in bounded batches (several replicas may sweep).
    fn spawn_background<DB: Backend>(&self, pool: &Pool<DB>, provider: &Arc<payments::Provider>) {
        match &self.lease_store {
            Some(redis) => {
                Reconciler::<_, Redis>::on_store(
                    redis.clone(),
                    payments::AskProvider(provider.clone()),
                )
                .with_interval(self.reconcile_every)
                .spawn();
            }
            None => {
                let mut reconciler =
                    Reconciler::new(pool.clone(), payments::AskProvider(provider.clone()))
                        .with_interval(self.reconcile_every);
                if let Some(ring) = &self.key_ring {
                    reconciler = reconciler.with_key_ring(ring.clone());
                }
                reconciler.spawn();
            }
        }
        Sweeper::new(pool.clone())
            .with_interval(self.sweep_every)
            .spawn();
    }

    /// `POST /payments` on the Redis lease store, when `IDEM_LEASE_STORE` names one.
    fn redis_payments<DB: Backend>(
        &self,
        state: &routes::AppState<DB>,
    ) -> Option<routes::redis_payments::PaymentsState> {
        let store = self.lease_store.as_ref()?;
        Some(routes::redis_payments::PaymentsState {
            idem: store
                .idem()
                .with_max_response_bytes(MAX_STORED_ANSWER_BYTES)
                .sharing_executions_with(&state.idem),
            provider: state.provider.clone(),
        })
    }

    fn state<DB: Backend>(
        &self,
        pool: Pool<DB>,
        provider: Arc<payments::Provider>,
    ) -> routes::AppState<DB> {
        let mut idem = Idem::new(pool.clone())
            .with_in_flight_wait(self.in_flight_wait)
            .with_max_response_bytes(MAX_STORED_ANSWER_BYTES);
        if let Some(ring) = &self.key_ring {
            idem = idem.with_key_ring(ring.clone());
        }
        routes::AppState {
            idem,
            pool,
            latency: self.latency,
            hold_file: self.hold_file.clone(),
            export_duration: self.export_duration,
            provider,
        }
    }
}

/// Migrates the database, starts the background work and builds the routes;
/// with them, the executions idem runs for them (a shutdown waits for those).
async fn app(store: Store, settings: &Settings) -> Result<(Router, Executions), String> {
    match store {
        Store::Postgres(pool) => {
            idem_runtime::migrate(&pool)
                .await
                .map_err(|e| format!("idem migrations failed: {e}"))?;
            sqlx::migrate!("examples/orders/migrations")
                .run(&pool)
                .await
                .map_err(|e| format!("orders migrations failed: {e}"))?;
            let provider = Arc::new(payments::Provider::new(
                settings.provider.clone(),
                payments::Ledger::Postgres(pool.clone()),
            ));
            settings.spawn_background(&pool, &provider);
            let state = settings.state(pool, provider);
            let executions = state.idem.executions();
            let payments = settings.redis_payments(&state);
            Ok((routes::postgres::router(state, payments), executions))
        }
        Store::Sqlite(pool) => {
            idem_runtime::migrate(&pool)
                .await
                .map_err(|e| format!("idem migrations failed: {e}"))?;
            sqlx::migrate!("examples/orders/migrations/sqlite")
                .run(&pool)
                .await
                .map_err(|e| format!("orders migrations failed: {e}"))?;
            let provider = Arc::new(payments::Provider::new(
                settings.provider.clone(),
                payments::Ledger::Sqlite(pool.clone()),
            ));
            settings.spawn_background(&pool, &provider);
            let state = settings.state(pool, provider);
            let executions = state.idem.executions();
            let payments = settings.redis_payments(&state);
            Ok((routes::sqlite::router(state, payments), executions))
        }
        Store::MySql(pool) => {
            idem_runtime::migrate(&pool)
                .await
                .map_err(|e| format!("idem migrations failed: {e}"))?;
            sqlx::migrate!("examples/orders/migrations/mysql")
                .run(&pool)
                .await
                .map_err(|e| format!("orders migrations failed: {e}"))?;
            let provider = Arc::new(payments::Provider::new(
                settings.provider.clone(),
                payments::Ledger::MySql(pool.clone()),
            ));
            settings.spawn_background(&pool, &provider);
            let state = settings.state(pool, provider);
            let executions = state.idem.executions();
            let payments = settings.redis_payments(&state);
            Ok((routes::mysql::router(state, payments), executions))
        }
    }
}

/// `IDEM_KEY_RING` and `IDEM_ACTIVE_KEY`, if set.
fn key_ring() -> Result<Option<KeyRing>, String> {
    let ring = KeyRing::from_env().map_err(|e| format!("cannot use IDEM_KEY_RING: {e}"))?;
    if let Some(ring) = &ring {
        // The key's id, never its bytes.
        tracing::info!(
            active = ring.active_id(),
            "orders: stored answers are sealed at rest (IDEM_KEY_RING)"
        );
    }
    Ok(ring)
}

/// The Redis lease store `IDEM_LEASE_STORE` names, if it names one: one
/// server, or (several URLs separated by commas) the nodes of a Redis Cluster;
/// sealing with `ring` when there is one.
async fn lease_store(ring: Option<&KeyRing>) -> Result<Option<RedisLeaseStore>, String> {
    let Ok(value) = std::env::var("IDEM_LEASE_STORE") else {
        return Ok(None);
    };
    let urls: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty()
        || urls
            .iter()
            .any(|u| !(u.starts_with("redis://") || u.starts_with("rediss://")))
    {
        return Err(format!(
            "IDEM_LEASE_STORE must be a redis:// URL, or several separated by commas for a \
             Redis Cluster (or unset for the database), not {value:?}"
        ));
    }
    let prefix = std::env::var("IDEM_LEASE_STORE_PREFIX").unwrap_or_else(|_| "idem".into());
    let store = if let [url] = urls[..] {
        RedisLeaseStore::connect_with_prefix(url, &prefix).await
    } else {
        RedisLeaseStore::connect_cluster_with_prefix(urls.iter().copied(), &prefix).await
    }
    .map_err(|e| format!("cannot use IDEM_LEASE_STORE: {e}"))?;
    tracing::info!(
        nodes = urls.len(),
        "orders: POST /payments keeps its leases in Redis (IDEM_LEASE_STORE)"
    );
    Ok(Some(match ring {
        Some(ring) => store.with_key_ring(ring.clone()),
        None => store,
    }))
}

fn env_ms(name: &str, default: u64, max: u64) -> Result<Duration, String> {
    let ms = match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v
            .parse::<u64>()
            .map_err(|_| format!("{name} must be a whole number of milliseconds, not {v:?}"))?,
    };
    if ms > max {
        return Err(format!("{name} is {ms}; at most {max} is allowed"));
    }
    Ok(Duration::from_millis(ms))
}

/// As [`env_ms`], for how often a background task runs: never 0, at which
/// it would run in a tight loop.
fn env_interval(name: &str, default: u64, max: u64) -> Result<Duration, String> {
    let every = env_ms(name, default, max)?;
    if every.is_zero() {
        return Err(format!(
            "{name} is 0; an interval of at least 1 ms is needed"
        ));
    }
    Ok(every)
}

/// A whole number between `min` and `max`, `default` when unset.
fn env_number(name: &str, default: usize, min: usize, max: usize) -> Result<usize, String> {
    let n = match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v
            .parse::<usize>()
            .map_err(|_| format!("{name} must be a whole number, not {v:?}"))?,
    };
    if !(min..=max).contains(&n) {
        return Err(format!("{name} is {n}; it must be between {min} and {max}"));
    }
    Ok(n)
}

fn env_count(name: &str) -> Result<u64, String> {
    match std::env::var(name) {
        Err(_) => Ok(0),
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name} must be a whole number, not {v:?}")),
    }
}

async fn run() -> Result<(), String> {
    let addr = std::env::var("IDEM_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let key_ring = key_ring()?;
    let settings = Settings {
        latency: env_ms("ORDERS_LATENCY_MS", 0, 3_600_000)?,
        hold_file: std::env::var_os("ORDERS_HOLD_FILE").map(|p| std::path::Path::new(&p).into()),
        export_duration: env_ms("EXPORTS_DURATION_MS", 3000, 3_600_000)?,
        in_flight_wait: env_ms("IDEM_IN_FLIGHT_WAIT_MS", 1000, 5000)?,
        sweep_every: env_interval("IDEM_SWEEP_INTERVAL_MS", 60_000, 86_400_000)?,
        reconcile_every: env_interval("PAYMENTS_RECONCILE_INTERVAL_MS", 5000, 3_600_000)?,
        lease_store: lease_store(key_ring.as_ref()).await?,
        key_ring,
        provider: payments::ProviderConfig {
            latency: env_ms("PAYMENTS_PROVIDER_LATENCY_MS", 0, 3_600_000)?,
            latency_after_charge: env_ms(
                "PAYMENTS_PROVIDER_LATENCY_AFTER_CHARGE_MS",
                0,
                3_600_000,
            )?,
            hold_after_charge: std::env::var_os("PAYMENTS_PROVIDER_HOLD_FILE")
                .map(|p| std::path::Path::new(&p).into()),
            outage_calls: env_count("PAYMENTS_PROVIDER_OUTAGE_CALLS")?,
            timeout_after_charge: env_count("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE")?,
        },
        limits: server::Limits {
            header_timeout: env_ms("ORDERS_HEADER_TIMEOUT_MS", 10_000, 3_600_000)?,
            shutdown_grace: env_ms("ORDERS_SHUTDOWN_GRACE_MS", 30_000, 3_600_000)?,
            write_timeout: env_ms("ORDERS_WRITE_TIMEOUT_MS", 30_000, 3_600_000)?,
            max_connections: env_number("ORDERS_MAX_CONNECTIONS", 1024, 1, 1_000_000)?,
        },
        edges: server::Edges {
            body_timeout: env_ms("ORDERS_BODY_TIMEOUT_MS", 30_000, 3_600_000)?,
        },
    };
    if settings.limits.header_timeout.is_zero()
        || settings.edges.body_timeout.is_zero()
        || settings.limits.write_timeout.is_zero()
    {
        return Err(
            "ORDERS_HEADER_TIMEOUT_MS, ORDERS_BODY_TIMEOUT_MS and ORDERS_WRITE_TIMEOUT_MS must be \
             at least 1"
                .into(),
        );
    }
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        // idem's histograms as Prometheus histograms with fixed buckets: left as
        // the exporter's default summaries, each costs about 1 MiB per operation
        // of quantile sketches that are regrown every 20 s (RSS creeps for minutes).
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Prefix("idem_".to_owned()),
            idem_runtime::metrics::SECONDS_BUCKETS,
        )
        .map_err(|e| format!("cannot configure the metrics recorder: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    // Without upkeep the recorder keeps every histogram sample it was given.
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });

    // The recorder first, so the background work's first figures are kept.
    let (app, executions) = app(connect().await?, &settings).await?;
    let app = app
        .route(
            "/metrics",
            axum::routing::get(move || std::future::ready(prometheus.render())),
        )
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            settings.edges,
            server::edges,
        ));
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!("orders listening on http://{local}");
    server::serve(listener, app, settings.limits, executions).await
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("orders: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
