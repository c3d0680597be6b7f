//! Connecting to the database a URL names: the only part of the CLI that knows
//! which databases exist (each behind its cargo feature). Everything a command
//! then does goes through `idem_runtime`, generic over its `Backend`.

use std::str::FromStr;
#[cfg(feature = "sqlite")]
use std::time::Duration;

use sqlx::Pool;

use crate::Failure;

/// Connects to the server the URL names, or says clearly why not.
#[cfg(feature = "postgres")]
pub async fn postgres(url: &str) -> Result<sqlx::PgPool, Failure> {
    // The parser's message is enough to fix the URL; the URL itself is not echoed,
    // since it may hold a password.
    let opts = sqlx::postgres::PgConnectOptions::from_str(url)
        .map_err(|e| Failure::Usage(format!("invalid database URL: {e}")))?
        .application_name("idem-cli");
    probe_then_pool(opts, "cannot reach the database").await
}

/// Connects to the MySQL or MariaDB server the URL names (`mysql://` or
/// `mariadb://`, with sqlx's query parameters), or says clearly why not.
#[cfg(feature = "mysql")]
pub async fn mysql(url: &str) -> Result<sqlx::MySqlPool, Failure> {
    // sqlx knows the scheme `mysql://` only; `mariadb://` is the same protocol.
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_owned(),
    };
    let opts = sqlx::mysql::MySqlConnectOptions::from_str(&url)
        .map_err(|e| Failure::Usage(format!("invalid database URL: {e}")))?;
    probe_then_pool(opts, "cannot reach the database").await
}

/// How long a command that writes (`migrate`, `sweep`) waits for SQLite's write
/// lock before it fails; `purge` waits [`crate::PURGE_LOCK_WAIT`] instead.
#[cfg(feature = "sqlite")]
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the SQLite file the URL names (`sqlite:PATH` or `sqlite://PATH`, with
/// sqlx's query parameters). A missing file is created only when `create` (for
/// `migrate`); otherwise it is reported and left alone. The journal mode is left
/// as the file has it.
#[cfg(feature = "sqlite")]
pub async fn sqlite(url: &str, create: bool) -> Result<sqlx::SqlitePool, Failure> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let (path, params) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() {
        return Err(Failure::Usage(
            "invalid database URL: no file path after sqlite: (e.g. sqlite:app.db)".to_owned(),
        ));
    }
    if path == ":memory:" || params.split('&').any(|p| p == "mode=memory") {
        return Err(Failure::Usage(
            "invalid database URL: an in-memory SQLite database starts empty and ends with \
             the command; give the path of the service's file"
                .to_owned(),
        ));
    }
    let opts = sqlx::sqlite::SqliteConnectOptions::from_str(url)
        .map_err(|e| Failure::Usage(format!("invalid database URL: {e}")))?
        // After parsing, so that it wins over `?mode=rwc`.
        .create_if_missing(create)
        .busy_timeout(BUSY_TIMEOUT);
    if !create {
        // SQLite would refuse to open it too (create_if_missing is off), but with
        // a message that does not say which file or what to do.
        let file = opts.get_filename();
        match std::fs::metadata(file) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let shown = std::path::absolute(file).unwrap_or_else(|_| file.to_owned());
                return Err(Failure::Database(format!(
                    "the SQLite database {} does not exist; nothing was created \
                     (`idem migrate` creates it)",
                    shown.display()
                )));
            }
            Err(e) => {
                return Err(Failure::Database(format!(
                    "cannot open the SQLite database {}: {e}",
                    file.display()
                )));
            }
        }
    }
    probe_then_pool(opts, "cannot open the SQLite database").await
}

/// Connects once directly, then hands out a small lazy pool: a pool retries a
/// refused connection until its timeout and then reports only "timed out", which
/// hides the real reason. `what` opens the message when nothing answers in time.
async fn probe_then_pool<DB: sqlx::Database>(
    opts: <DB::Connection as sqlx::Connection>::Options,
    what: &str,
) -> Result<Pool<DB>, Failure> {
    use sqlx::{ConnectOptions, Connection};

    let probe = tokio::time::timeout(crate::CONNECT_TIMEOUT, opts.connect())
        .await
        .map_err(|_| {
            Failure::Database(format!(
                "{what}: no answer within {} s",
                crate::CONNECT_TIMEOUT.as_secs()
            ))
        })??;
    let _ = probe.close().await;
    Ok(sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(2)
        .acquire_timeout(crate::CONNECT_TIMEOUT)
        .connect_lazy_with(opts))
}
