//! What a command needs of a database beyond idem_runtime's own traits: the few
//! round trips whose SQL differs between PostgreSQL and SQLite. Everything else
//! (migrating, stats, the sweep, every decision and all output) is written once in
//! `main.rs`, generic over [`Store`].

use idem_runtime::StatsBackend;
use idem_runtime::sweeper::SweepBackend;
use sqlx::migrate::Migrator;
use sqlx::{ColumnIndex, Decode, Pool, Row, Type};

use crate::Failure;

/// One key's address: the three parts of the primary key.
pub struct KeyRef<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Operation name.
    pub operation: &'a str,
    /// The Idempotency-Key.
    pub key: &'a str,
}

/// One row as `show` prints it, already in backend-neutral form: timestamps as
/// RFC 3339 text in UTC (whole seconds, formatted by the database from its own
/// values), the fingerprint in lowercase hex, the header JSON as text.
pub struct StoredRow {
    /// `processing`, `completed`, `failed` or `uncertain`.
    pub state: String,
    /// Which execution of the key the row holds (1 for the first).
    pub generation: i64,
    /// The request's fingerprint, in lowercase hex.
    pub fingerprint: String,
    /// When the current execution claimed the key.
    pub created_at: String,
    /// When its outcome was stored, if it was.
    pub completed_at: Option<String>,
    /// When the key is forgotten.
    pub expires_at: String,
    /// `expires_at` has passed, by the database clock.
    pub expired: bool,
    /// Leased mode: when the running execution's lease ends.
    pub lease_expires_at: Option<String>,
    /// The stored status, if an outcome is stored.
    pub response_status: Option<i64>,
    /// The stored body's size in bytes.
    pub body_bytes: Option<i64>,
    /// The stored headers' JSON (`[[name, value], ...]`), as text.
    pub response_headers: Option<String>,
    /// The body, only when asked for.
    pub body: Option<Vec<u8>>,
}

/// A database the CLI runs on: PostgreSQL ([`crate::postgres`]) or SQLite
/// ([`crate::sqlite`]).
pub trait Store: StatsBackend + SweepBackend {
    /// idem's migrations for this database.
    fn migrator() -> Migrator;

    /// The versions recorded as applied in idem's migration table; none when that
    /// table does not exist yet.
    async fn applied_versions(pool: &Pool<Self>) -> Result<Vec<i64>, Failure>;

    /// The key's row, its body only when `with_body` (so that a plain `show`
    /// never moves the body out of the database); `None` when there is no row.
    async fn fetch(
        pool: &Pool<Self>,
        key: &KeyRef<'_>,
        with_body: bool,
    ) -> Result<Option<StoredRow>, Failure>;

    /// Deletes the key's row in one transaction that first locks it against
    /// running requests (PostgreSQL: the row; SQLite: the database's write lock,
    /// the only lock it has), waiting at most [`crate::PURGE_LOCK_WAIT`] and
    /// refusing past that. `allow` sees the locked row's state and may refuse;
    /// then nothing is deleted. Returns the deleted row's state and generation,
    /// `None` when there was no row.
    async fn purge(
        pool: &Pool<Self>,
        key: &KeyRef<'_>,
        allow: impl FnOnce(&str) -> Result<(), Failure>,
    ) -> Result<Option<(String, i64)>, Failure>;
}

/// Both backends' `show` queries return the same column names and, as Rust types,
/// the same column types, so the row is decoded once here.
pub fn stored_row<R>(row: &R) -> Result<StoredRow, Failure>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(StoredRow {
        state: row.try_get("state")?,
        generation: row.try_get("generation")?,
        fingerprint: row.try_get("fingerprint")?,
        created_at: row.try_get("created_at")?,
        completed_at: row.try_get("completed_at")?,
        expires_at: row.try_get("expires_at")?,
        expired: row.try_get("expired")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
        response_status: row.try_get("response_status")?,
        body_bytes: row.try_get("body_bytes")?,
        response_headers: row.try_get("response_headers")?,
        body: row.try_get("body")?,
    })
}

/// The statements both backends share: `$n` parameters read the same in both.
pub const SELECT_STATE_SQL: &str = "SELECT state, generation FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3";

/// Deletes the key's row.
pub const DELETE_SQL: &str = "DELETE FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3";

/// The versions idem's migration table records as applied (the same SQL on both).
pub fn applied_versions_sql() -> String {
    format!(
        "SELECT version FROM {} WHERE success ORDER BY version",
        idem_runtime::store::postgres::MIGRATIONS_TABLE
    )
}

/// The two [`Store`] methods that are the same on both backends but for the
/// `SHOW_SQL` of the backend's module: expanded inside each `impl Store`.
macro_rules! same_on_both {
    () => {
        async fn applied_versions(pool: &Pool<Self>) -> Result<Vec<i64>, Failure> {
            match sqlx::query_scalar(sqlx::AssertSqlSafe(applied_versions_sql()))
                .fetch_all(pool)
                .await
            {
                Ok(v) => Ok(v),
                // No history table yet: nothing was ever applied.
                Err(e) if is_undefined_table(&e) => Ok(vec![]),
                Err(e) => Err(e.into()),
            }
        }

        async fn fetch(
            pool: &Pool<Self>,
            key: &KeyRef<'_>,
            with_body: bool,
        ) -> Result<Option<StoredRow>, Failure> {
            let row = sqlx::query(SHOW_SQL)
                .bind(key.tenant)
                .bind(key.operation)
                .bind(key.key)
                .bind(with_body)
                .fetch_optional(pool)
                .await?;
            row.as_ref().map(stored_row).transpose()
        }
    };
}
pub(crate) use same_on_both;

/// Connects once directly, then hands out a small lazy pool: a pool retries a
/// refused connection until its timeout and then reports only "timed out", which
/// hides the real reason. `what` opens the message when nothing answers in time.
pub async fn probe_then_pool<DB: sqlx::Database>(
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

/// The part of a purge both backends share, in the transaction `$tx` that holds
/// the key's row: given the row `SELECT_STATE_SQL` read, return `Ok(None)` when
/// there is none, else ask `$allow` about its state, delete it, and evaluate to
/// `(state, generation)`; the caller commits.
macro_rules! delete_if_allowed {
    ($tx:expr, $row:expr, $key:expr, $allow:expr) => {{
        let Some(row) = $row else {
            return Ok(None);
        };
        let state: String = row.try_get("state")?;
        let generation: i64 = row.try_get("generation")?;
        $allow(&state)?;
        sqlx::query($crate::backend::DELETE_SQL)
            .bind($key.tenant)
            .bind($key.operation)
            .bind($key.key)
            .execute(&mut *$tx)
            .await?;
        (state, generation)
    }};
}
pub(crate) use delete_if_allowed;
