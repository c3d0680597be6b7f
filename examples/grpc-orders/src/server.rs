//! Start-up: the database `DATABASE_URL` names (the SQLite file by default),
//! idem's table and the example's, then the tonic server.

use std::str::FromStr;
use std::time::Duration;

use idem_runtime::Idem;
use idem_runtime::at_rest::KeyRing;
use idem_runtime::reconcile::Reconciler;
use idem_runtime::redis::{Redis, RedisLeaseStore};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::auth::authenticate;
use crate::pb::orders_server::OrdersServer;
use crate::reconcile::AskProvider;
use crate::service::{self, Knobs};
use crate::store::Store;

/// Where the service keeps its data when `DATABASE_URL` is unset.
const DEFAULT_SQLITE_FILE: &str = "idem-grpc-orders.db";

fn millis(name: &str, default: u64, max: u64) -> Result<Duration, String> {
    match std::env::var(name) {
        Err(_) => Ok(Duration::from_millis(default)),
        Ok(v) => match v.parse::<u64>() {
            Ok(ms) if ms <= max => Ok(Duration::from_millis(ms)),
            _ => Err(format!(
                "{name} must be a whole number of milliseconds up to {max}, not {v:?}"
            )),
        },
    }
}

/// Runs the service until `SIGINT` or `SIGTERM`.
///
/// # Errors
///
/// A setting, the database or the address that cannot be used.
pub async fn run() -> Result<(), String> {
    let timeouts = match std::env::var("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE") {
        Err(_) => 0,
        Ok(v) => v.parse::<u64>().map_err(|_| {
            format!("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE must be a whole number, not {v:?}")
        })?,
    };
    let knobs = Knobs {
        latency: millis("ORDERS_LATENCY_MS", 0, 600_000)?,
        hold_file: std::env::var_os("ORDERS_HOLD_FILE").map(Into::into),
        provider_latency: millis("PAYMENTS_PROVIDER_LATENCY_MS", 0, 600_000)?,
        provider_hold_file: std::env::var_os("PAYMENTS_PROVIDER_HOLD_FILE").map(Into::into),
        timeouts_after_charge: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(timeouts)),
    };
    let reconcile_every = millis("PAYMENTS_RECONCILE_INTERVAL_MS", 5000, 3_600_000)?;
    if reconcile_every.is_zero() {
        // The reconciler would run in a tight loop.
        return Err(
            "PAYMENTS_RECONCILE_INTERVAL_MS is 0; an interval of at least 1 ms is needed".into(),
        );
    }
    let wait = millis("IDEM_IN_FLIGHT_WAIT_MS", 1000, 5000)?;
    let addr = std::env::var("IDEM_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".into());
    let ring = key_ring()?;
    let leases = lease_store(ring.as_ref()).await?;
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on IDEM_ADDR {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    // The first line on standard output: scripts and tests read the port here.
    println!("grpc-orders listening on {local}");
    let incoming = TcpIncoming::from(listener);
    let mut server = Server::builder();
    macro_rules! serve {
        ($pool:expr, $plain:ident, $on_redis:ident) => {{
            let pool = $pool;
            idem_runtime::migrate(&pool)
                .await
                .map_err(|e| format!("idem migrations failed: {e}"))?;
            Store::create_tables(&pool)
                .await
                .map_err(|e| format!("the example's tables could not be created: {e}"))?;
            let mut idem = Idem::new(pool.clone()).with_in_flight_wait(wait);
            if let Some(ring) = &ring {
                idem = idem.with_key_ring(ring.clone());
            }
            let ask = AskProvider { pool: pool.clone() };
            match &leases {
                // The service's ring, if any, seals what it resolves.
                None => idem.reconciler(ask).with_interval(reconcile_every).spawn(),
                // The store seals with the ring it was given.
                Some(store) => Reconciler::<_, Redis>::on_store(store.clone(), ask)
                    .with_interval(reconcile_every)
                    .spawn(),
            };
            let router = match leases {
                None => server.add_service(OrdersServer::with_interceptor(
                    service::$plain { idem, pool, knobs },
                    authenticate,
                )),
                Some(store) => server.add_service(OrdersServer::with_interceptor(
                    service::$on_redis {
                        idem,
                        pool,
                        redis: store.idem(),
                        knobs,
                    },
                    authenticate,
                )),
            };
            router
                .serve_with_incoming_shutdown(incoming, shutdown())
                .await
                .map_err(|e| format!("the server failed: {e}"))
        }};
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(32)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
        tracing::info!("grpc-orders: using PostgreSQL from DATABASE_URL");
        serve!(pool, OnPostgres, OnPostgresRedis)
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(32)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url.replacen("mariadb://", "mysql://", 1))
            .await
            .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
        tracing::info!("grpc-orders: using MySQL from DATABASE_URL");
        serve!(pool, OnMySql, OnMySqlRedis)
    } else {
        let opts = if url.is_empty() {
            SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE)
        } else if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(&url)
                .map_err(|e| format!("DATABASE_URL is not a usable SQLite URL: {e}"))?
        } else {
            return Err(format!(
                "DATABASE_URL must start with postgres://, mysql:// or sqlite: (or be unset for the SQLite file {DEFAULT_SQLITE_FILE}), not {:?}",
                url.split(':').next().unwrap_or_default()
            ));
        };
        let opts = opts
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts)
            .await
            .map_err(|e| format!("cannot open the SQLite database: {e}"))?;
        tracing::info!(
            "grpc-orders: using SQLite (set DATABASE_URL=postgres://... for PostgreSQL)"
        );
        serve!(pool, OnSqlite, OnSqliteRedis)
    }
}

/// `IDEM_KEY_RING` and `IDEM_ACTIVE_KEY`, if set: every answer the service
/// stores (orders, refunds, payments, on every store) is sealed with the active
/// key and opened when a retry replays it.
fn key_ring() -> Result<Option<KeyRing>, String> {
    let ring = KeyRing::from_env().map_err(|e| format!("cannot use IDEM_KEY_RING: {e}"))?;
    if let Some(ring) = &ring {
        // The key's id, never its bytes.
        tracing::info!(
            active = ring.active_id(),
            "grpc-orders: stored answers are sealed at rest (IDEM_KEY_RING)"
        );
    }
    Ok(ring)
}

/// The Redis lease store `IDEM_LEASE_STORE` names, if any, sealing with `ring`
/// when there is one.
async fn lease_store(ring: Option<&KeyRing>) -> Result<Option<RedisLeaseStore>, String> {
    let Ok(url) = std::env::var("IDEM_LEASE_STORE") else {
        return Ok(None);
    };
    let prefix = std::env::var("IDEM_LEASE_STORE_PREFIX").unwrap_or_else(|_| "idem".into());
    let store = RedisLeaseStore::connect_with_prefix(&url, &prefix)
        .await
        .map_err(|e| format!("cannot reach the lease store IDEM_LEASE_STORE: {e}"))?;
    Ok(Some(match ring {
        Some(ring) => store.with_key_ring(ring.clone()),
        None => store,
    }))
}

async fn shutdown() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
