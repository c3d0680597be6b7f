//! `idem`: the admin CLI for idem's idempotency table.
//!
//! ```text
//! idem [--database-url URL] [--json] <command>
//!
//!   migrate                               create or update idem's table and functions
//!   stats                                 rows by state and operation, stored bytes,
//!                                         oldest valid row, oldest in-flight age,
//!                                         expired rows not yet swept
//!   show <tenant> <operation> <key>       one key: state, generation, timestamps,
//!        [--body]                         stored status and body size; the stored
//!                                         headers' values and the body only with --body
//!   purge <tenant> <operation> <key>      delete one key, so that its next request
//!         [--force]                       executes anew; refuses a `processing` or
//!                                         `uncertain` row unless --force
//!   sweep --once [--batch-size N]         one run of the retention sweeper
//!         [--max-batches N] [--stale-after-secs S]
//! ```
//!
//! The database comes from `--database-url`, or else the environment variable
//! `DATABASE_URL`. `--json` (before or after the command) prints one JSON document
//! on stdout instead of a table. Errors are one line on stderr, starting with
//! `idem: error:`, and never print the URL or a stored body.
//!
//! # Exit codes
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | success |
//! | 1 | unexpected failure (a stored row the CLI cannot read, stdout unwritable) |
//! | 2 | usage: bad arguments (clap's own code), no database URL, or a URL that does not parse |
//! | 3 | not found: `show` or `purge` of a key that has no row |
//! | 4 | refused: `purge` of a `processing` or `uncertain` row without `--force`, or of a row a running request holds locked |
//! | 5 | database error: unreachable server, authentication, unknown database, a failed query or migration |
//! | 6 | not migrated: the table `idempotency_requests` does not exist; run `idem migrate` |
//!
//! # Safety of `purge`
//!
//! Deleting a key is what the sweeper does after retention: the next request with
//! that key executes as new. Purging a finished row before its retention ends
//! therefore allows a retry to run the operation a second time; that is the point
//! when repairing a key, and the reason the CLI asks for `--force` before it
//! deletes a row whose execution may still be running or whose effect is unknown.

use std::io::Write;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idem_runtime::store::postgres::{MIGRATIONS_TABLE, migrator};
use idem_runtime::{StoreError, Sweeper};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Row};

/// How long connecting may take before the CLI gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `purge` waits for a row that a running request holds locked (a macro,
/// so that it can be spliced into the statement at compile time).
macro_rules! purge_lock_wait {
    () => {
        "2s"
    };
}

/// A timestamp column as RFC 3339 text in UTC, formatted by the database (the
/// crate has no date library, and the database clock is the reference anyway).
macro_rules! rfc3339 {
    ($col:literal) => {
        concat!(
            "to_char(",
            $col,
            " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
        )
    };
}

/// idem's admin CLI: inspect, purge and sweep the idempotency table.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    /// PostgreSQL URL, e.g. postgres://user@host:5432/db
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,

    /// Print JSON instead of a table
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or update idem's table and functions (safe to repeat)
    Migrate,
    /// Rows by state and operation, stored bytes, oldest rows, sweeper backlog
    Stats,
    /// Show one key: state, generation, timestamps, stored status and size
    Show {
        /// Tenant id (the idempotency scope)
        tenant: String,
        /// Operation name, e.g. create-order
        operation: String,
        /// The Idempotency-Key
        key: String,
        /// Also print the stored response: header values and body
        #[arg(long)]
        body: bool,
    },
    /// Delete one key so that its next request executes anew
    Purge {
        /// Tenant id (the idempotency scope)
        tenant: String,
        /// Operation name, e.g. create-order
        operation: String,
        /// The Idempotency-Key
        key: String,
        /// Also delete a `processing` or `uncertain` row (its effect may happen twice)
        #[arg(long)]
        force: bool,
    },
    /// Run the retention sweeper
    Sweep {
        /// Run once and exit (the continuous sweeper runs in the service: Sweeper::spawn)
        #[arg(long, required = true)]
        once: bool,
        /// Rows deleted per statement
        #[arg(long, default_value_t = Sweeper::DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
        /// Statements per run
        #[arg(long, default_value_t = Sweeper::DEFAULT_MAX_BATCHES, value_parser = clap::value_parser!(u32).range(1..))]
        max_batches: u32,
        /// Age in seconds beyond which an in-flight row is reported as stale
        #[arg(long, default_value_t = Sweeper::DEFAULT_STALE_AFTER.as_secs())]
        stale_after_secs: u64,
    },
}

/// Why a command failed; each kind has its documented exit code.
#[derive(Debug)]
enum Failure {
    Other(String),
    Usage(String),
    NotFound(String),
    Refused(String),
    Database(String),
    NotMigrated,
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Other(_) => 1,
            Failure::Usage(_) => 2,
            Failure::NotFound(_) => 3,
            Failure::Refused(_) => 4,
            Failure::Database(_) => 5,
            Failure::NotMigrated => 6,
        }
    }

    fn message(&self) -> String {
        match self {
            Failure::Other(m)
            | Failure::Usage(m)
            | Failure::NotFound(m)
            | Failure::Refused(m)
            | Failure::Database(m) => m.clone(),
            Failure::NotMigrated => {
                "the table idempotency_requests does not exist in this database; \
                 run `idem migrate` first"
                    .to_owned()
            }
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        if is_undefined_table(&e) {
            return Failure::NotMigrated;
        }
        match e {
            sqlx::Error::Io(io) => Failure::Database(format!("cannot reach the database: {io}")),
            // The message alone: Display adds the server's source line, noise here.
            sqlx::Error::Database(db) => Failure::Database(match db.code() {
                Some(code) => format!("the database said: {} (SQLSTATE {code})", db.message()),
                None => format!("the database said: {}", db.message()),
            }),
            sqlx::Error::PoolTimedOut => {
                Failure::Database("timed out waiting for a database connection".to_owned())
            }
            other => Failure::Database(format!("database error: {other}")),
        }
    }
}

/// `undefined_table`: the schema was never migrated in this database.
fn is_undefined_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01"))
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Database(e) => e.into(),
            StoreError::Migrate(sqlx::migrate::MigrateError::Execute(e)) => e.into(),
            StoreError::Migrate(e) => Failure::Database(format!("migration failed: {e}")),
            StoreError::Corrupt(m) => Failure::Other(format!("a stored row is corrupt: {m}")),
            other => Failure::Database(other.to_string()),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&Failure::Other(format!("cannot start the runtime: {e}"))),
    };
    match runtime.block_on(run(cli)) {
        Ok(out) => match write_stdout(&out) {
            Ok(()) => ExitCode::SUCCESS,
            // A closed pipe (`idem stats | head -1`) is the reader's choice, not an error.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => fail(&Failure::Other(format!("cannot write the output: {e}"))),
        },
        Err(f) => fail(&f),
    }
}

fn write_stdout(out: &str) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()
}

fn fail(f: &Failure) -> ExitCode {
    // One line, whatever the underlying error's Display does.
    let line = f.message().replace(['\n', '\r'], " ");
    let _ = writeln!(std::io::stderr(), "idem: error: {line}");
    ExitCode::from(f.code())
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let pool = connect(cli.database_url.as_deref()).await?;
    let json = cli.json;
    match cli.command {
        Command::Migrate => migrate(&pool, json).await,
        Command::Stats => stats(&pool, json).await,
        Command::Show {
            tenant,
            operation,
            key,
            body,
        } => show(&pool, json, &tenant, &operation, &key, body).await,
        Command::Purge {
            tenant,
            operation,
            key,
            force,
        } => purge(&pool, json, &tenant, &operation, &key, force).await,
        Command::Sweep {
            once: _,
            batch_size,
            max_batches,
            stale_after_secs,
        } => {
            let sweeper = Sweeper::new(pool)
                .with_batch_size(batch_size)
                .with_max_batches(max_batches)
                .with_stale_after(Duration::from_secs(stale_after_secs));
            let report = sweeper.sweep_once().await?;
            if json {
                return to_json(&report);
            }
            Ok(Table::pairs(vec![
                ("deleted", report.deleted.to_string()),
                ("batches", report.batches.to_string()),
                ("backlog", report.backlog.to_string()),
                ("stale in flight", report.stale_in_flight.to_string()),
                (
                    "oldest in flight",
                    report
                        .oldest_in_flight
                        .map_or("-".to_owned(), |d| age(d.as_secs_f64())),
                ),
            ])
            .render())
        }
    }
}

async fn connect(url: Option<&str>) -> Result<PgPool, Failure> {
    let url = url.ok_or_else(|| {
        Failure::Usage("no database: pass --database-url or set DATABASE_URL".to_owned())
    })?;
    // The parser's message is enough to fix the URL; the URL itself is not echoed,
    // since it may hold a password.
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(Failure::Usage(
            "invalid database URL: it must start with postgres:// or postgresql://".to_owned(),
        ));
    }
    let opts = PgConnectOptions::from_str(url)
        .map_err(|e| Failure::Usage(format!("invalid database URL: {e}")))?
        .application_name("idem-cli");
    // One direct connection first: a pool retries a refused connection until its
    // timeout and then reports only "timed out", which hides the real reason.
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&opts))
        .await
        .map_err(|_| {
            Failure::Database(format!(
                "cannot reach the database: no answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            ))
        })??;
    let _ = probe.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(opts))
}

fn to_json<T: Serialize>(value: &T) -> Result<String, Failure> {
    let mut s = serde_json::to_string_pretty(value)
        .map_err(|e| Failure::Other(format!("cannot encode JSON: {e}")))?;
    s.push('\n');
    Ok(s)
}

// ---------------------------------------------------------------- migrate

#[derive(Serialize)]
struct MigrationLine {
    version: i64,
    description: String,
    applied_now: bool,
}

async fn applied_versions(pool: &PgPool) -> Result<Vec<i64>, Failure> {
    let sql = format!("SELECT version FROM {MIGRATIONS_TABLE} WHERE success ORDER BY version");
    match sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
    {
        Ok(v) => Ok(v),
        // No history table yet: nothing was ever applied.
        Err(e) if is_undefined_table(&e) => Ok(vec![]),
        Err(e) => Err(e.into()),
    }
}

async fn migrate(pool: &PgPool, json: bool) -> Result<String, Failure> {
    let before = applied_versions(pool).await?;
    idem_runtime::migrate(pool).await?;
    let after = applied_versions(pool).await?;
    let m = migrator();
    let lines: Vec<MigrationLine> = m
        .iter()
        .filter(|mig| after.contains(&mig.version))
        .map(|mig| MigrationLine {
            version: mig.version,
            description: mig.description.to_string(),
            applied_now: !before.contains(&mig.version),
        })
        .collect();
    if json {
        return to_json(&serde_json::json!({ "migrations": lines }));
    }
    let mut t = Table::new(&["VERSION", "DESCRIPTION", "STATUS"], &[true, false, false]);
    for l in &lines {
        t.row(vec![
            l.version.to_string(),
            l.description.clone(),
            if l.applied_now {
                "applied now"
            } else {
                "already applied"
            }
            .to_owned(),
        ]);
    }
    let fresh = lines.iter().filter(|l| l.applied_now).count();
    Ok(format!(
        "{}\n{} applied now, {} already applied\n",
        t.render().trim_end(),
        fresh,
        lines.len() - fresh
    ))
}

// ---------------------------------------------------------------- stats

async fn stats(pool: &PgPool, json: bool) -> Result<String, Failure> {
    let s = idem_runtime::stats(pool).await?;
    if json {
        return to_json(&s);
    }
    let mut out = Table::pairs(vec![
        ("taken at", s.taken_at.clone()),
        ("rows", s.rows.to_string()),
        ("  processing", s.by_state.processing.to_string()),
        ("  completed", s.by_state.completed.to_string()),
        ("  failed", s.by_state.failed.to_string()),
        ("  uncertain", s.by_state.uncertain.to_string()),
        ("stored bytes", s.stored_bytes.to_string()),
        (
            "oldest valid row",
            match (&s.oldest_valid_created_at, s.oldest_valid_age_seconds) {
                (Some(at), Some(secs)) => format!("{at} ({} ago)", age(secs)),
                _ => "-".to_owned(),
            },
        ),
        (
            "oldest in flight",
            s.oldest_in_flight_seconds.map_or("-".to_owned(), age),
        ),
        ("expired, not swept", s.expired_unswept.to_string()),
    ])
    .render();
    if !s.by_operation.is_empty() {
        let mut t = Table::new(
            &[
                "OPERATION",
                "ROWS",
                "PROCESSING",
                "COMPLETED",
                "FAILED",
                "UNCERTAIN",
                "EXPIRED",
                "BYTES",
            ],
            &[false, true, true, true, true, true, true, true],
        );
        for op in &s.by_operation {
            t.row(vec![
                op.operation.clone(),
                op.rows.to_string(),
                op.by_state.processing.to_string(),
                op.by_state.completed.to_string(),
                op.by_state.failed.to_string(),
                op.by_state.uncertain.to_string(),
                op.expired_unswept.to_string(),
                op.stored_bytes.to_string(),
            ]);
        }
        out.push('\n');
        out.push_str(&t.render());
    }
    Ok(out)
}

// ---------------------------------------------------------------- show

// The body leaves the database only when asked for ($4), so that a plain `show`
// cannot leak it into a terminal's scrollback or a log.
const SHOW_SQL: &str = concat!(
    "SELECT state, generation, encode(fingerprint, 'hex') AS fingerprint, ",
    rfc3339!("created_at"),
    " AS created_at, ",
    rfc3339!("completed_at"),
    " AS completed_at, ",
    rfc3339!("expires_at"),
    " AS expires_at, ",
    rfc3339!("lease_expires_at"),
    " AS lease_expires_at, ",
    "expires_at <= now() AS expired, response_status, ",
    "octet_length(response_body)::bigint AS body_bytes, response_headers, ",
    "CASE WHEN $4 THEN response_body END AS body ",
    "FROM idempotency_requests ",
    "WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3"
);

#[derive(Debug, Serialize)]
struct Shown {
    tenant: String,
    operation: String,
    key: String,
    state: String,
    generation: i64,
    fingerprint: String,
    created_at: String,
    completed_at: Option<String>,
    expires_at: String,
    expired: bool,
    lease_expires_at: Option<String>,
    response_status: Option<i16>,
    body_bytes: Option<i64>,
    header_names: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<Vec<(String, String)>>,
    /// The body as text, when it is UTF-8 (only with --body).
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    /// The body in hex, when it is not UTF-8 (only with --body).
    #[serde(skip_serializing_if = "Option::is_none")]
    body_hex: Option<String>,
}

fn not_found(tenant: &str, operation: &str, key: &str) -> Failure {
    Failure::NotFound(format!(
        "no row for tenant {tenant:?}, operation {operation:?}, key {key:?} \
         (never claimed, swept after its retention, or not committed yet)"
    ))
}

async fn show(
    pool: &PgPool,
    json: bool,
    tenant: &str,
    operation: &str,
    key: &str,
    with_body: bool,
) -> Result<String, Failure> {
    let row = sqlx::query(SHOW_SQL)
        .bind(tenant)
        .bind(operation)
        .bind(key)
        .bind(with_body)
        .fetch_optional(pool)
        .await?
        .ok_or_else(|| not_found(tenant, operation, key))?;
    let headers: Option<sqlx::types::Json<Vec<(String, String)>>> = row
        .try_get("response_headers")
        .map_err(|e| Failure::Other(format!("stored headers unreadable: {e}")))?;
    let headers = headers.map(|h| h.0).unwrap_or_default();
    let body: Option<Vec<u8>> = row.try_get("body")?;
    let (body_text, body_hex) = match body {
        Some(b) => match String::from_utf8(b) {
            Ok(text) => (Some(text), None),
            Err(e) => (None, Some(hex(e.as_bytes()))),
        },
        None => (None, None),
    };
    let shown = Shown {
        tenant: tenant.to_owned(),
        operation: operation.to_owned(),
        key: key.to_owned(),
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
        header_names: headers.iter().map(|(n, _)| n.clone()).collect(),
        headers: with_body.then_some(headers),
        body: body_text,
        body_hex,
    };
    if json {
        return to_json(&shown);
    }
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
    let mut pairs = vec![
        ("tenant", shown.tenant.clone()),
        ("operation", shown.operation.clone()),
        ("key", shown.key.clone()),
        ("state", shown.state.clone()),
        ("generation", shown.generation.to_string()),
        ("fingerprint", shown.fingerprint.clone()),
        ("created at", shown.created_at.clone()),
        ("completed at", dash(&shown.completed_at)),
        (
            "expires at",
            format!(
                "{}{}",
                shown.expires_at,
                if shown.expired { " (expired)" } else { "" }
            ),
        ),
        ("lease expires at", dash(&shown.lease_expires_at)),
        (
            "status",
            shown
                .response_status
                .map_or("-".to_owned(), |s| s.to_string()),
        ),
        (
            "body bytes",
            shown.body_bytes.map_or("-".to_owned(), |b| b.to_string()),
        ),
    ];
    match &shown.headers {
        Some(hs) => {
            for (name, value) in hs {
                pairs.push(("header", format!("{name}: {value}")));
            }
        }
        None if !shown.header_names.is_empty() => {
            pairs.push(("headers", shown.header_names.join(", ")));
        }
        None => pairs.push(("headers", "-".to_owned())),
    }
    let mut out = Table::pairs(pairs).render();
    if let Some(text) = &shown.body {
        out.push_str("\n--- body ---\n");
        out.push_str(text);
        if !text.ends_with('\n') {
            out.push('\n');
        }
    } else if let Some(h) = &shown.body_hex {
        out.push_str("\n--- body (not UTF-8, hex) ---\n");
        out.push_str(h);
        out.push('\n');
    }
    Ok(out)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

// ---------------------------------------------------------------- purge

#[derive(Debug, Serialize)]
struct Purged {
    purged: bool,
    tenant: String,
    operation: String,
    key: String,
    state: String,
    generation: i64,
}

async fn purge(
    pool: &PgPool,
    json: bool,
    tenant: &str,
    operation: &str,
    key: &str,
    force: bool,
) -> Result<String, Failure> {
    let mut tx = pool.begin().await?;
    // A row locked by a request that is executing right now: waiting for it would
    // hang the operator's terminal, and deleting it after would race the request.
    sqlx::query(concat!(
        "SET LOCAL lock_timeout = '",
        purge_lock_wait!(),
        "'"
    ))
    .execute(&mut *tx)
    .await?;
    let row = sqlx::query(
        "SELECT state, generation FROM idempotency_requests \
          WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3 FOR UPDATE",
    )
    .bind(tenant)
    .bind(operation)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => {
            Failure::Refused(format!(
                "the key is locked by a request that is running now (waited {}); \
                 nothing was purged, try again when it has finished",
                purge_lock_wait!()
            ))
        }
        _ => Failure::from(e),
    })?
    .ok_or_else(|| not_found(tenant, operation, key))?;
    let state: String = row.try_get("state")?;
    let generation: i64 = row.try_get("generation")?;
    if matches!(state.as_str(), "processing" | "uncertain") && !force {
        return Err(Failure::Refused(format!(
            "the key is {state}: its execution may still be running or its effect is unknown, \
             and purging it lets a retry execute again; nothing was purged (use --force to purge anyway)"
        )));
    }
    sqlx::query(
        "DELETE FROM idempotency_requests \
          WHERE tenant_id = $1 AND operation = $2 AND idempotency_key = $3",
    )
    .bind(tenant)
    .bind(operation)
    .bind(key)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    let purged = Purged {
        purged: true,
        tenant: tenant.to_owned(),
        operation: operation.to_owned(),
        key: key.to_owned(),
        state,
        generation,
    };
    if json {
        return to_json(&purged);
    }
    Ok(Table::pairs(vec![
        ("purged", "yes".to_owned()),
        ("tenant", purged.tenant),
        ("operation", purged.operation),
        ("key", purged.key),
        (
            "was",
            format!("{} (generation {})", purged.state, generation),
        ),
    ])
    .render())
}

// ---------------------------------------------------------------- output

/// An aligned text table: two spaces between columns, numbers right-aligned.
struct Table {
    header: Option<Vec<String>>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str], right: &[bool]) -> Self {
        Table {
            header: Some(header.iter().map(|h| (*h).to_owned()).collect()),
            right: right.to_vec(),
            rows: Vec::new(),
        }
    }

    /// A two-column list of labels and values, without a header.
    fn pairs(items: Vec<(&str, String)>) -> Self {
        Table {
            header: None,
            right: vec![false, false],
            rows: items
                .into_iter()
                .map(|(k, v)| vec![k.to_owned(), v])
                .collect(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let all: Vec<&Vec<String>> = self.header.iter().chain(self.rows.iter()).collect();
        let columns = all.iter().map(|r| r.len()).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                all.iter()
                    .filter_map(|r| r.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in all {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
                let pad = widths[c] - cell.chars().count();
                if self.right.get(c).copied().unwrap_or(false) {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// A short human age: "42s", "3m 5s", "2h 0m", "4d 1h".
fn age(secs: f64) -> String {
    let s = secs.max(0.0).floor() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_trim() {
        let mut t = Table::new(&["NAME", "N"], &[false, true]);
        t.row(vec!["a".into(), "100".into()]);
        t.row(vec!["long-name".into(), "2".into()]);
        assert_eq!(
            t.render(),
            "NAME         N\na          100\nlong-name    2\n"
        );
    }

    #[test]
    fn ages_read_well() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(185.0), "3m 5s");
        assert_eq!(age(7205.0), "2h 0m");
        assert_eq!(age(90000.0), "1d 1h");
        assert_eq!(age(-3.0), "0s");
    }

    #[test]
    fn the_cli_definition_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
