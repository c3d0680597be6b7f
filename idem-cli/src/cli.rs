//! The command line as clap reads it: the global options and the commands,
//! whose doc comments are the `--help` text.

use clap::{Parser, Subcommand};
use idem_runtime::Sweeper;

/// The sweeper whose defaults `idem sweep` shows (the same for every database;
/// the type names one that this build has).
#[cfg(feature = "postgres")]
type Defaults = Sweeper<sqlx::Postgres>;
#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
type Defaults = Sweeper<sqlx::Sqlite>;
#[cfg(all(feature = "mysql", not(feature = "postgres"), not(feature = "sqlite")))]
type Defaults = Sweeper<sqlx::MySql>;

/// idem's admin CLI: inspect, purge and sweep the idempotency table, and check
/// any HTTP endpoint against the idempotency promise.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
pub(crate) struct Cli {
    /// PostgreSQL, SQLite or MySQL URL, e.g. postgres://user@host:5432/db, sqlite:path/to/app.db
    /// or mysql://user@host:3306/db [default: the environment variable DATABASE_URL]
    // Not clap's `env`: clap would list an argument taken from the environment in
    // its usage lines (`Usage: idem show --database-url <URL> ...`), as if it were
    // required. `database_url` reads the variable instead.
    #[arg(long, global = true, value_name = "URL")]
    pub(crate) database_url: Option<String>,

    /// Print JSON instead of a table
    #[arg(long, global = true)]
    pub(crate) json: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
    /// Delete one key so that its next request executes anew, or with --tenant
    /// every row of a tenant
    Purge {
        /// Tenant id (the idempotency scope)
        #[arg(required_unless_present = "whole_tenant")]
        tenant: Option<String>,
        /// Operation name, e.g. create-order
        #[arg(required_unless_present = "whole_tenant")]
        operation: Option<String>,
        /// The Idempotency-Key (digested here: the table holds only its SHA-256)
        #[arg(required_unless_present = "whole_tenant")]
        key: Option<String>,
        /// KEY is the key's digest (64 hex digits, as `show` prints it), not the key
        #[arg(long)]
        digest: bool,
        /// Also delete `processing` and `uncertain` rows (their effects may happen twice)
        #[arg(long)]
        force: bool,
        /// Erase every row of this tenant, in every operation, in batches (no TENANT
        /// OPERATION KEY then); executions in flight are left unless --force
        #[arg(
            long = "tenant",
            value_name = "TENANT",
            value_parser = clap::builder::NonEmptyStringValueParser::new(),
            conflicts_with_all = ["tenant", "operation", "key", "digest"]
        )]
        whole_tenant: Option<String>,
        /// With --tenant: wait up to SECS for executions in flight to finish, erasing
        /// them as they do
        #[arg(long, value_name = "SECS")]
        wait: Option<u64>,
    },
    /// Run the retention sweeper once, then exit (the continuous sweeper runs in the service: Sweeper::spawn)
    Sweep {
        /// Accepted and ignored: every `idem sweep` is one pass (the flag used to be required)
        #[arg(long, hide = true)]
        once: bool,
        /// Rows deleted per statement
        #[arg(long, default_value_t = Defaults::DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
        /// Statements per run
        #[arg(long, default_value_t = Defaults::DEFAULT_MAX_BATCHES, value_parser = clap::value_parser!(u32).range(1..))]
        max_batches: u32,
        /// Age in seconds beyond which an in-flight row is reported as stale (at most a century)
        #[arg(long, default_value_t = Defaults::DEFAULT_STALE_AFTER.as_secs(), value_parser = clap::value_parser!(u64).range(..=Defaults::MAX_STALE_AFTER.as_secs()))]
        stale_after_secs: u64,
    },
    /// Re-seal stored answers under the key ring's active key, a page at a time (safe
    /// beside live traffic; run again after an interruption), then count rows per key.
    /// The ring comes from IDEM_KEY_RING and IDEM_ACTIVE_KEY, or --key-ring-file
    Rekey {
        /// Rows per page
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
        /// Also seal the answers stored in clear
        #[arg(long)]
        seal_clear: bool,
        /// Refuse answers stored in clear, as a service whose ring refuses them does
        /// (KeyRing::refusing_clear_answers): they are counted as broken and left, never
        /// sealed, --seal-clear or not. Use it once no row should be in clear: a clear
        /// row then is one written by someone without the keys
        #[arg(long)]
        refuse_clear: bool,
        /// A key file (`ID BASE64` lines and an `active ID` line) instead of the environment
        #[arg(long, value_name = "PATH")]
        key_ring_file: Option<std::path::PathBuf>,
    },
    /// Check an HTTP endpoint (idem's or not) against the idempotency promise: retries
    /// replay, conflicts are refused, concurrent duplicates execute once (no database needed)
    Check(Box<crate::check::CheckArgs>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_definition_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
