//! `orders`: an Axum service whose `POST`s are safe to retry, built with
//! `#[idempotent]`. The README's quickstart runs it; the end-to-end suite in
//! `tests/orders_e2e.rs` kills, restarts and races it.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | the PostgreSQL database |
//! | `IDEM_ADDR` | `127.0.0.1:3000` | listen address (`127.0.0.1:0` picks a free port) |
//! | `ORDERS_LATENCY_MS` | `0` | slow work inside the transaction, after the claim |
//! | `IDEM_IN_FLIGHT_WAIT_MS` | `1000` | how long a duplicate waits for the first (at most 5000) |
//! | `PAYMENTS_PROVIDER_LATENCY_MS` | `0` | the simulated provider's latency per call |
//! | `PAYMENTS_PROVIDER_OUTAGE_CALLS` | `0` | the provider's first N calls fail (503) |
//! | `PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE` | `0` | the provider's first N charges time out after charging |
//! | `PAYMENTS_RECONCILE_INTERVAL_MS` | `5000` | how often uncertain payments are reconciled |
//! | `IDEM_SWEEP_INTERVAL_MS` | `60000` | how often expired keys are swept |
//!
//! `GET /metrics` serves the idem metrics in the Prometheus text format.

mod auth;
mod fulfilment;
mod input;
mod payments;
mod problems;
mod routes;

use std::time::Duration;

use idem_runtime::Idem;
use sqlx::postgres::PgPoolOptions;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

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

fn env_count(name: &str) -> Result<u64, String> {
    match std::env::var(name) {
        Err(_) => Ok(0),
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name} must be a whole number, not {v:?}")),
    }
}

async fn run() -> Result<(), String> {
    let database_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let addr = std::env::var("IDEM_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let latency = env_ms("ORDERS_LATENCY_MS", 0, 3_600_000)?;
    let in_flight_wait = env_ms("IDEM_IN_FLIGHT_WAIT_MS", 1000, 5000)?;

    let pool = PgPoolOptions::new()
        .max_connections(32)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&database_url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    idem_runtime::migrate(&pool)
        .await
        .map_err(|e| format!("idem migrations failed: {e}"))?;
    sqlx::migrate!("examples/orders/migrations")
        .run(&pool)
        .await
        .map_err(|e| format!("orders migrations failed: {e}"))?;

    let provider = std::sync::Arc::new(payments::Provider::new(payments::ProviderConfig {
        latency: env_ms("PAYMENTS_PROVIDER_LATENCY_MS", 0, 3_600_000)?,
        outage_calls: env_count("PAYMENTS_PROVIDER_OUTAGE_CALLS")?,
        timeout_after_charge: env_count("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE")?,
    }));
    let reconcile_every = env_ms("PAYMENTS_RECONCILE_INTERVAL_MS", 5000, 3_600_000)?;
    idem_runtime::reconcile::Reconciler::new(pool.clone(), payments::AskProvider(provider.clone()))
        .with_interval(reconcile_every)
        .spawn();

    // Expired keys are forgotten in bounded batches; several replicas may sweep.
    idem_runtime::Sweeper::new(pool.clone())
        .with_interval(env_ms("IDEM_SWEEP_INTERVAL_MS", 60_000, 86_400_000)?)
        .spawn();
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
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

    let idem = Idem::new(pool.clone()).with_in_flight_wait(in_flight_wait);
    let app = routes::router(routes::AppState {
        idem,
        pool,
        latency,
        provider,
    })
    .route(
        "/metrics",
        axum::routing::get(move || std::future::ready(prometheus.render())),
    );
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!("orders listening on http://{local}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await
        .map_err(|e| e.to_string())
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
