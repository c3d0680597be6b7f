//! `idem`: the admin CLI for idem's idempotency table, on PostgreSQL, SQLite or
//! MySQL.
//!
//! ```text
//! idem [--database-url URL] [--json] <command>
//!
//!   migrate                               create or update idem's table (and, on
//!                                         PostgreSQL, its functions)
//!   stats                                 rows by state and operation, stored bytes,
//!                                         oldest valid row, oldest in-flight age,
//!                                         expired rows not yet swept
//!   show <tenant> <operation> <key>       one key: state, generation, timestamps,
//!        [--digest] [--body]              stored status and body size; the stored
//!                                         headers' values and the body only with --body
//!   purge <tenant> <operation> <key>      delete one key, so that its next request
//!         [--digest] [--force]            executes anew; refuses a `processing` or
//!                                         `uncertain` row unless --force
//!   sweep [--batch-size N]                one run of the retention sweeper, then
//!         [--max-batches N]               exit (`--once`, which it used to require,
//!         [--stale-after-secs S]          is accepted and changes nothing)
//! ```
//!
//! The table holds each key's SHA-256, never the key: `show` and `purge` digest
//! the key they are given (either spelling of the `Idempotency-Key` header), or,
//! with `--digest`, take the 64 hex digits `show` prints (what
//! `printf %s KEY | sha256sum` prints, too). Output names the key by its digest.
//!
//! The database comes from `--database-url`, or else the environment variable
//! `DATABASE_URL` (an empty one counts as unset): `postgres://...` (or `postgresql://...`) for
//! PostgreSQL, `sqlite:PATH` (or `sqlite://PATH`) for a SQLite file,
//! `mysql://...` (or `mariadb://...`) for MySQL 8 or MariaDB 10.11. Each database
//! is a cargo feature of the CLI: `postgres` (the default), `sqlite` and `mysql`;
//! a URL of a database the build left out is a usage error. `--json` (before or after
//! the command) prints one JSON document on stdout instead of a table. Errors are
//! one line on stderr, starting with `idem: error:`, and never print the URL or a
//! stored body (a SQLite file's path, which holds no password, is printed when
//! the file is missing).
//!
//! Every command works on each of the three databases with the same output. The
//! URL is looked at once, in [`run`] ([`connect`] knows the databases, each behind
//! its cargo feature); each command is then written once, generic over `idem_runtime::Backend`, and holds no SQL: the statements
//! are the runtime's ([`idem_runtime::admin`], the sweeper, stats, migrations).
//!
//! # Exit codes
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | success |
//! | 1 | unexpected failure (a stored row the CLI cannot read, stdout unwritable) |
//! | 2 | usage: bad arguments (clap's own code), a key that is not a valid `Idempotency-Key` or a `--digest` that is not 64 hex digits, no database URL, a URL that does not parse or is none of `postgres://`, `sqlite:` and `mysql://`, a database this build of the CLI leaves out (its cargo feature), an in-memory SQLite database |
//! | 3 | not found: `show` or `purge` of a key that has no row |
//! | 4 | refused: `purge` of a `processing` or `uncertain` row without `--force`, or of a row a running request holds locked (on SQLite: while another writer holds the database's write lock) |
//! | 5 | database error: unreachable server, authentication, unknown database, a SQLite file that does not exist or is not a SQLite database, a failed query or migration (on SQLite also `migrate` or `sweep` not getting the write lock within [`connect::BUSY_TIMEOUT`]) |
//! | 6 | not migrated: the table `idempotency_requests` does not exist; run `idem migrate` |
//!
//! # Safety of `purge`
//!
//! Deleting a key is what the sweeper does after retention: the next request with
//! that key executes as new. Purging a finished row before its retention ends
//! therefore allows a retry to run the operation a second time; that is the point
//! when repairing a key, and the reason the CLI asks for `--force` before it
//! deletes a row whose execution may still be running or whose effect is unknown.
//!
//! # SQLite
//!
//! Only `migrate` creates a missing SQLite file; the other commands report it
//! (exit 5) and leave the path alone. The CLI never changes the file's journal
//! mode. SQLite has no row locks: `purge` takes the database's write lock
//! (`BEGIN IMMEDIATE`), waiting for it at most [`PURGE_LOCK_WAIT`] as PostgreSQL
//! waits for the row, and is refused (exit 4) if another writer holds it longer.
//! The other commands that write (`migrate`, `sweep`) wait at most
//! [`connect::BUSY_TIMEOUT`] for it, then fail with exit 5.
//!
//! # MySQL and MariaDB
//!
//! `purge` locks the key's row as on PostgreSQL, waiting for it at most
//! [`PURGE_LOCK_WAIT`] (InnoDB's `innodb_lock_wait_timeout`, whole seconds).

mod connect;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idem_runtime::admin::{self, KeyAddress, KeyRecord, PurgeError};
use idem_runtime::{Backend, IdempotencyKey, KeyDigest, StoreError, Sweeper};
use serde::Serialize;
use sqlx::Pool;

/// How long connecting may take before the CLI gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `purge` waits for a row that a running request holds locked (on
/// SQLite: for the database's write lock).
const PURGE_LOCK_WAIT: Duration = Duration::from_secs(2);

/// idem's admin CLI: inspect, purge and sweep the idempotency table.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    /// PostgreSQL, SQLite or MySQL URL, e.g. postgres://user@host:5432/db, sqlite:path/to/app.db
    /// or mysql://user@host:3306/db [default: the environment variable DATABASE_URL]
    // Not clap's `env`: clap would list an argument taken from the environment in
    // its usage lines (`Usage: idem show --database-url <URL> ...`), as if it were
    // required. `database_url` reads the variable instead.
    #[arg(long, global = true, value_name = "URL")]
    database_url: Option<String>,

    /// Print JSON instead of a table
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or update idem's table (safe to repeat; the only command that creates a missing SQLite file)
    Migrate,
    /// Rows by state and operation, stored bytes, oldest rows, sweeper backlog
    Stats,
    /// Show one key: state, generation, timestamps, stored status and size
    Show {
        /// Tenant id (the idempotency scope)
        tenant: String,
        /// Operation name, e.g. create-order
        operation: String,
        /// The Idempotency-Key (digested here: the table holds only its SHA-256)
        key: String,
        /// KEY is the key's digest (64 hex digits, as `show` prints it), not the key
        #[arg(long)]
        digest: bool,
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
        /// The Idempotency-Key (digested here: the table holds only its SHA-256)
        key: String,
        /// KEY is the key's digest (64 hex digits, as `show` prints it), not the key
        #[arg(long)]
        digest: bool,
        /// Also delete a `processing` or `uncertain` row (its effect may happen twice)
        #[arg(long)]
        force: bool,
    },
    /// Run the retention sweeper once, then exit (the continuous sweeper runs in the service: Sweeper::spawn)
    Sweep {
        /// Accepted and ignored: every `idem sweep` is one pass (the flag used to be required)
        #[arg(long, hide = true)]
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
                Some(code) if is_sqlite(&*db) => {
                    format!("the database said: {} (SQLite code {code})", db.message())
                }
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

/// A table that does not exist: the schema was never migrated in this database.
/// PostgreSQL says `undefined_table`; SQLite has only its generic error code, and
/// says so in the message.
fn is_undefined_table(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    if is_sqlite(&**db) {
        db.message().starts_with("no such table")
    } else {
        // PostgreSQL's undefined_table, MySQL's ER_NO_SUCH_TABLE.
        matches!(db.code().as_deref(), Some("42P01" | "42S02"))
    }
}

/// Whether the error came from SQLite (whose codes are not SQLSTATEs).
#[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
fn is_sqlite(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "sqlite")]
    return db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some();
    #[cfg(not(feature = "sqlite"))]
    return false;
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

/// Picks the backend from the URL, once, and runs the command on it.
async fn run(cli: Cli) -> Result<String, Failure> {
    let url = database_url(cli.database_url.clone())?;
    let url = url.as_str();
    let json = cli.json;
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        return execute(connect::postgres(url).await?, cli.command, json).await;
        #[cfg(not(feature = "postgres"))]
        return Err(without("PostgreSQL", "postgres"));
    } else if url.starts_with("sqlite:") {
        // Only `migrate` may create the file; the other commands read or repair
        // an existing database.
        #[cfg(feature = "sqlite")]
        return execute(
            connect::sqlite(url, matches!(cli.command, Command::Migrate)).await?,
            cli.command,
            json,
        )
        .await;
        #[cfg(not(feature = "sqlite"))]
        return Err(without("SQLite", "sqlite"));
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        #[cfg(feature = "mysql")]
        return execute(connect::mysql(url).await?, cli.command, json).await;
        #[cfg(not(feature = "mysql"))]
        return Err(without("MySQL", "mysql"));
    } else {
        // The URL itself is not echoed, since it may hold a password.
        Err(Failure::Usage(
            "invalid database URL: it must start with postgres://, postgresql://, sqlite:, \
             mysql:// or mariadb://"
                .to_owned(),
        ))
    }
}

/// The URL of `--database-url`, or else of the environment variable
/// `DATABASE_URL` (an empty one counts as unset).
fn database_url(flag: Option<String>) -> Result<String, Failure> {
    if let Some(url) = flag {
        return Ok(url);
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Ok(url),
        Ok(_) | Err(std::env::VarError::NotPresent) => Err(Failure::Usage(
            "no database: pass --database-url or set DATABASE_URL".to_owned(),
        )),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Failure::Usage("DATABASE_URL is not valid UTF-8".to_owned()))
        }
    }
}

/// The answer for a database this build of the CLI leaves out.
#[allow(dead_code)]
fn without(database: &str, feature: &str) -> Failure {
    Failure::Usage(format!(
        "this idem was built without {database}: rebuild it with the cargo feature `{feature}`"
    ))
}

/// Runs one command, the same way on every backend.
async fn execute<DB: Backend>(
    pool: Pool<DB>,
    command: Command,
    json: bool,
) -> Result<String, Failure> {
    match command {
        Command::Migrate => migrate(&pool, json).await,
        Command::Stats => stats(&pool, json).await,
        Command::Show {
            tenant,
            operation,
            key,
            digest,
            body,
        } => {
            let key = address(&tenant, &operation, &key, digest)?;
            show(&pool, json, &key, body).await
        }
        Command::Purge {
            tenant,
            operation,
            key,
            digest,
            force,
        } => {
            let key = address(&tenant, &operation, &key, digest)?;
            purge(&pool, json, &key, force).await
        }
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

async fn migrate<DB: Backend>(pool: &Pool<DB>, json: bool) -> Result<String, Failure> {
    let before = admin::applied_migrations(pool).await?;
    idem_runtime::migrate(pool).await?;
    let after = admin::applied_migrations(pool).await?;
    let m = idem_runtime::migrator::<DB>();
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

async fn stats<DB: Backend>(pool: &Pool<DB>, json: bool) -> Result<String, Failure> {
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

/// The row's address: the key as a client sends it (either spelling the header
/// allows), digested here as idem does, or with `--digest` the digest itself.
/// Neither is echoed in an error: a key may be a secret.
fn address<'a>(
    tenant: &'a str,
    operation: &'a str,
    key: &str,
    is_digest: bool,
) -> Result<KeyAddress<'a>, Failure> {
    if !is_digest {
        let key = IdempotencyKey::parse(key)
            .map_err(|e| Failure::Usage(format!("not a valid key: {e}")))?;
        return Ok(KeyAddress::of(tenant, operation, &key));
    }
    let digest = KeyDigest::from_hex(key).map_err(|e| Failure::Usage(format!("--digest: {e}")))?;
    Ok(KeyAddress {
        tenant,
        operation,
        digest,
    })
}

// ---------------------------------------------------------------- show

#[derive(Debug, Serialize)]
struct Shown {
    tenant: String,
    operation: String,
    key_digest: String,
    state: String,
    generation: i64,
    fingerprint: String,
    created_at: String,
    completed_at: Option<String>,
    expires_at: String,
    expired: bool,
    lease_expires_at: Option<String>,
    response_status: Option<i64>,
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

fn not_found(key: &KeyAddress<'_>) -> Failure {
    Failure::NotFound(format!(
        "no row for tenant {:?}, operation {:?}, key digest {} \
         (never claimed, swept after its retention, or not committed yet)",
        key.tenant, key.operation, key.digest
    ))
}

async fn show<DB: Backend>(
    pool: &Pool<DB>,
    json: bool,
    key: &KeyAddress<'_>,
    with_body: bool,
) -> Result<String, Failure> {
    let KeyRecord {
        state,
        generation,
        fingerprint,
        created_at,
        completed_at,
        expires_at,
        expired,
        lease_expires_at,
        response_status,
        body_bytes,
        response_headers,
        body,
        ..
    } = admin::show(pool, key, with_body)
        .await?
        .ok_or_else(|| not_found(key))?;
    // The header text as each database gives it (jsonb's or SQLite's): the same
    // JSON either way.
    let headers: Vec<(String, String)> = match response_headers {
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| Failure::Other(format!("stored headers unreadable: {e}")))?,
        None => Vec::new(),
    };
    let (body_text, body_hex) = match body {
        Some(b) => match String::from_utf8(b) {
            Ok(text) => (Some(text), None),
            Err(e) => (None, Some(hex(e.as_bytes()))),
        },
        None => (None, None),
    };
    let shown = Shown {
        tenant: key.tenant.to_owned(),
        operation: key.operation.to_owned(),
        key_digest: key.digest.to_string(),
        state,
        generation,
        fingerprint,
        created_at,
        completed_at,
        expires_at,
        expired,
        lease_expires_at,
        response_status,
        body_bytes,
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
        ("key digest", shown.key_digest.clone()),
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
    key_digest: String,
    state: String,
    generation: i64,
}

async fn purge<DB: Backend>(
    pool: &Pool<DB>,
    json: bool,
    key: &KeyAddress<'_>,
    force: bool,
) -> Result<String, Failure> {
    // Decided inside the backend's transaction, with the row (or the database)
    // locked, so that the state checked is the state deleted.
    let allow = |state: &str| {
        if matches!(state, "processing" | "uncertain") && !force {
            return Err(Failure::Refused(format!(
                "the key is {state}: its execution may still be running or its effect is unknown, \
                 and purging it lets a retry execute again; nothing was purged (use --force to purge anyway)"
            )));
        }
        Ok(())
    };
    let (state, generation) = admin::purge(pool, key, PURGE_LOCK_WAIT, allow)
        .await
        .map_err(|e| match e {
            PurgeError::Locked(what) => locked(what),
            PurgeError::Refused(failure) => failure,
            PurgeError::Store(e) => e.into(),
            other => Failure::Other(format!("purge failed: {other}")),
        })?
        .ok_or_else(|| not_found(key))?;
    let purged = Purged {
        purged: true,
        tenant: key.tenant.to_owned(),
        operation: key.operation.to_owned(),
        key_digest: key.digest.to_string(),
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
        ("key digest", purged.key_digest),
        (
            "was",
            format!("{} (generation {})", purged.state, generation),
        ),
    ])
    .render())
}

/// The message of a purge refused because a running request holds what it needs.
fn locked(what: &str) -> Failure {
    Failure::Refused(format!(
        "{what} (waited {} s); nothing was purged, try again when it has finished",
        PURGE_LOCK_WAIT.as_secs()
    ))
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
