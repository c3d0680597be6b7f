//! `idem`: the admin CLI for idem's idempotency table, on PostgreSQL, SQLite or
//! MySQL; and `idem check`, a conformance checker for any HTTP endpoint that
//! takes an `Idempotency-Key` (no database: [`check`]).
//!
//! ```text
//! idem [--database-url URL] [--json] <command>
//!
//!   check --url URL [--body FILE|-]       run the scenarios of the idempotency
//!         [-H 'Name: value']... ...       promise against the endpoint; report
//!                                         pass / fail / not applicable for each
//!                                         (--format table|json|junit, --dry-run)
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
//!   purge --tenant TENANT [--force]       erase every row of a tenant, in batches;
//!         [--wait SECS]                   rows in flight are left unless --force
//!                                         (or waited for, with --wait)
//!   sweep [--batch-size N]                one run of the retention sweeper, then
//!         [--max-batches N]               exit (`--once`, which it used to require,
//!         [--stale-after-secs S]          is accepted and changes nothing)
//!   rekey [--batch-size N] [--seal-clear] re-seal stored answers under the key
//!         [--refuse-clear]                ring's active key (IDEM_KEY_RING and
//!         [--key-ring-file PATH]          IDEM_ACTIVE_KEY, or the file), then
//!                                         count rows per key
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
//! the command) prints one JSON document on stdout instead of a table, also
//! where a command that did part of its work is refused (exit 4: `purge
//! --tenant` that left rows, `rekey` that left answers). Errors are
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
//! | 2 | usage: bad arguments (clap's own code), a key that is not a valid `Idempotency-Key` or a `--digest` that is not 64 hex digits, no database URL, a URL that does not parse or is none of `postgres://`, `sqlite:` and `mysql://`, a database this build of the CLI leaves out (its cargo feature), an in-memory SQLite database, `rekey` without a key ring or with one that does not load |
//! | 3 | not found: `show` or `purge` of a key that has no row (never claimed, swept, or not committed yet) |
//! | 4 | refused: `purge` of a `processing` or `uncertain` row without `--force`, or of a row a running request holds locked (on SQLite: while another writer holds the database's write lock); `purge --tenant` that left rows (executions in flight, rows a running request holds, rows written meanwhile), after erasing the rest; `rekey` that left answers it could not open (sealed with a key the ring lacks, or broken), after re-sealing the rest |
//! | 5 | database error: unreachable server, authentication, unknown database, a SQLite file that does not exist or is not a SQLite database, a failed query or migration (on SQLite also `migrate`, `sweep`, `purge --tenant` or `rekey` not getting the write lock within [`connect::BUSY_TIMEOUT`]) |
//! | 6 | not migrated: the table `idempotency_requests` does not exist; run `idem migrate` |
//! | 7 | `check`: a scenario failed (the report says which, with its requests and answers) |
//! | 8 | `check` could not run: the request itself does not succeed (no answer, or not a `2xx`), or `--effects` stopped counting; no finding about the promise |
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
//! The other commands that write (`migrate`, `sweep`, `purge --tenant`, `rekey`) wait at most
//! [`connect::BUSY_TIMEOUT`] for it, then fail with exit 5.
//!
//! # MySQL and MariaDB
//!
//! `purge` locks the key's row as on PostgreSQL, waiting for it at most
//! [`PURGE_LOCK_WAIT`] (InnoDB's `innodb_lock_wait_timeout`, whole seconds).

mod check;
mod cli;
mod commands;
mod connect;
mod failure;
mod output;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use cli::{Cli, Command};
use commands::execute;
use failure::Failure;

/// How long connecting may take before the CLI gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `purge` waits for a row that a running request holds locked (on
/// SQLite: for the database's write lock).
const PURGE_LOCK_WAIT: Duration = Duration::from_secs(2);

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
        Ok((out, code)) => match write_stdout(&out) {
            Ok(()) => ExitCode::from(code),
            // A closed pipe (`idem stats | head -1`) is the reader's choice, not an error.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::from(code),
            Err(e) => fail(&Failure::Other(format!("cannot write the output: {e}"))),
        },
        Err(f) => {
            // What was done before a refusal (`--json`): a closed pipe or an
            // unwritable stdout leaves the refusal's own line and code.
            if let Some(report) = f.report() {
                let _ = write_stdout(report);
            }
            fail(&f)
        }
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

/// Runs the command: `check` on its own (it needs no database); the others on
/// the backend the URL names, picked once. The output and the exit code.
async fn run(cli: Cli) -> Result<(String, u8), Failure> {
    if let Command::Check(args) = cli.command {
        return check::check(*args, cli.json).await;
    }
    database(cli).await.map(|out| (out, 0))
}

/// Picks the backend from the URL, once, and runs the command on it.
async fn database(cli: Cli) -> Result<String, Failure> {
    let checked = commands::check_arguments(&cli.command)?;
    let url = database_url(cli.database_url.clone())?;
    let url = url.as_str();
    let json = cli.json;
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        return execute(connect::postgres(url).await?, cli.command, json, checked).await;
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
            checked,
        )
        .await;
        #[cfg(not(feature = "sqlite"))]
        return Err(without("SQLite", "sqlite"));
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        #[cfg(feature = "mysql")]
        return execute(connect::mysql(url).await?, cli.command, json, checked).await;
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
