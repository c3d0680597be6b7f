//! What the two consumer examples share: the ledger credit, how it is applied
//! exactly once with `process_once`, their environment and their start-up.
//! (`examples/shared/` has no `main.rs`, so cargo does not take it for an
//! example; the consumers include it with `#[path]`.)

use std::time::Duration;

use idem_runtime::consumer::{ConsumeError, Delivery, Message, process_once};
use serde::Deserialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The operation every credit is claimed under.
pub const OPERATION: &str = "apply-ledger-credit";

/// A message's payload.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credit {
    pub account: String,
    pub amount_cents: i64,
}

/// A variable, or its default.
pub fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// A whole-number variable, or its default; a clear error for anything else.
pub fn env_u64(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name} must be a whole number, not {v:?}")),
    }
}

/// Connects to `DATABASE_URL` and applies idem's migrations and the ledger's.
pub async fn connect() -> Result<PgPool, String> {
    let database_url = env(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&database_url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    idem_runtime::migrate(&pool)
        .await
        .map_err(|e| e.to_string())?;
    // One set of tables for both consumers: they can share a database.
    sqlx::migrate!("examples/consumer/migrations")
        .run(&pool)
        .await
        .map_err(|e| format!("consumer migrations failed: {e}"))?;
    Ok(pool)
}

/// Applies `credit` at most once for `(scope, id)`, in one transaction with the
/// record of it; `retention` is how long the id is remembered.
pub async fn apply(
    pool: &PgPool,
    scope: &str,
    id: &str,
    payload: &[u8],
    credit: &Credit,
    retention: Duration,
) -> Result<Delivery<()>, ConsumeError<sqlx::Error>> {
    let msg = Message {
        scope,
        operation: OPERATION,
        id,
        payload,
    };
    let (account, amount) = (credit.account.clone(), credit.amount_cents);
    process_once(pool, &msg, retention, move |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO ledger_entries (account, amount_cents) VALUES ($1, $2)")
                .bind(&account)
                .bind(amount)
                .execute(&mut **tx)
                .await?;
            sqlx::query(
                "INSERT INTO balances (account, balance_cents) VALUES ($1, $2) \
                 ON CONFLICT (account) DO UPDATE SET balance_cents = balances.balance_cents + EXCLUDED.balance_cents",
            )
            .bind(&account)
            .bind(amount)
            .execute(&mut **tx)
            .await?;
            Ok(())
        })
    })
    .await
}

/// Whether the database refused the credit itself, as it would again on every
/// delivery: a data exception (SQLSTATE class 22), a constraint (23) or an
/// exception a trigger raised (P0001), in the credit's own statements or at
/// its `COMMIT` (a deferred constraint). Anything else (the store, a lost
/// connection, a deadlock, a timeout, a failover) may go through on a later
/// delivery.
pub fn refused(e: &ConsumeError<sqlx::Error>) -> bool {
    match e {
        ConsumeError::Effect(sqlx::Error::Database(db))
        | ConsumeError::Commit(sqlx::Error::Database(db)) => db
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c == "P0001"),
        _ => false,
    }
}

/// Logs to stdout (`RUST_LOG`, default `info`), runs `run`, and exits 1 with its
/// error, logged.
pub async fn main_with(
    run: impl std::future::Future<Output = Result<(), String>>,
) -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    match run.await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("consumer: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
