//! `idem check`: runs the scenarios of the idempotency promise against any HTTP
//! endpoint (idem's or not) and reports, scenario by scenario, what held.
//!
//! It needs no database and no knowledge of the service beyond the request a
//! client would send: it generates its keys itself (`idem-check-<run>-<scenario>`,
//! so they can be found in the service's logs). It sends only to `--url` and
//! `--effects`, never follows a redirect, and sends a number of requests fixed
//! before it starts ([`plan`]), each bounded by `--timeout`.
//!
//! * [`plan`]: which scenarios apply, and how many requests and effects each costs;
//! * [`request`]: the target, sending one request, and what was sent and received;
//! * [`scenarios`]: the scenarios, run in order, each judged pass, fail or not
//!   applicable;
//! * [`report`]: the table, JSON and JUnit reports;
//! * [`body`]: the bodies derived from the request's (a logically equal one, another one);
//! * [`redact`]: credentials left out of everything printed.

mod body;
mod plan;
mod redact;
mod report;
mod request;
mod scenarios;

use std::time::Duration;

use crate::Failure;

/// The arguments of `idem check` (their doc comments are the `--help` text).
#[derive(Debug, clap::Args)]
#[command(after_long_help = AFTER_HELP)]
pub(crate) struct CheckArgs {
    /// The endpoint to check, e.g. https://staging.example.com/orders
    // The doc comment is the `--help` text, where a URL is written bare.
    #[allow(rustdoc::bare_urls)]
    #[arg(long, value_name = "URL")]
    pub(crate) url: String,

    /// Not read: `check` speaks HTTP to the endpoint, never to a database.
    // The global `--database-url` would otherwise be listed in this command's
    // help; clap does not give a global option to a subcommand that declares
    // one of the same id, so this hidden one stands in for it here.
    #[arg(
        long = "database-url",
        id = "database_url",
        value_name = "URL",
        hide = true
    )]
    pub(crate) database_url: Option<String>,

    /// The request's method
    #[arg(long, default_value = "POST")]
    pub(crate) method: String,

    /// The request's body: a file, or - for standard input [default: no body]
    #[arg(long, value_name = "FILE|-")]
    pub(crate) body: Option<String>,

    /// A header every request sends, e.g. -H 'Authorization: Bearer acme' (repeatable;
    /// a JSON body gets Content-Type: application/json unless one is given)
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE")]
    pub(crate) headers: Vec<String>,

    /// A header that makes the request another tenant's (replacing -H's of the same name),
    /// e.g. --tenant-header 'Authorization: Bearer globex' (repeatable); enables the
    /// isolation scenario
    #[arg(long, value_name = "NAME: VALUE")]
    pub(crate) tenant_header: Vec<String>,

    /// A URL whose GET answer counts the request's effects: a number, or a JSON array
    /// whose length is the count (sent with the -H headers)
    #[arg(long, value_name = "URL")]
    pub(crate) effects: Option<String>,

    /// Another body, valid on its own, to send under a used key (it must be 422)
    /// [default: the body with its first integer incremented, or else its first string
    /// value changed]
    #[arg(long, value_name = "FILE")]
    pub(crate) other_body: Option<String>,

    /// The service compares JSON bodies as values: a body with its fields reordered and
    /// respaced must replay (without it, a 422 for one is not applicable)
    #[arg(long)]
    pub(crate) canonical_json: bool,

    /// Duplicates sent at once in the concurrency scenario
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(2..=256))]
    pub(crate) concurrency: u32,

    /// How long each request may take, e.g. 10s, 500ms
    #[arg(long, default_value = "10s", value_parser = some_time)]
    pub(crate) timeout: Duration,

    /// How long after the first answer the late retry is sent (0s leaves it out)
    #[arg(long, default_value = "2s", value_parser = duration)]
    pub(crate) after: Duration,

    /// A shell command (sh -c) that restarts the service, run between a request and its
    /// retry; enables the restart scenario
    #[arg(long, value_name = "COMMAND")]
    pub(crate) restart_cmd: Option<String>,

    /// How long the restart command, and the service coming back after it, may take
    #[arg(long, default_value = "60s", value_parser = some_time)]
    pub(crate) restart_timeout: Duration,

    /// The report: a table, or json or junit for CI
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub(crate) format: Format,

    /// Print the plan (scenarios, requests, effects) and send nothing
    #[arg(long)]
    pub(crate) dry_run: bool,
}

const AFTER_HELP: &str = "\
Exit codes: 0 every applicable scenario passed (or --dry-run); 2 bad arguments (a URL,
a header, a body file); 7 a scenario failed; 8 the check could not run (the request
itself does not succeed, or --effects stopped counting). The plan (how many requests, which
scenarios create effects) is printed on stderr before the first request.

Example (the orders example of the idem repository):
  idem check --url http://127.0.0.1:3000/orders --body order.json \\
    -H 'Authorization: Bearer acme' -H 'X-Currency: EUR' \\
    --tenant-header 'Authorization: Bearer globex' \\
    --effects http://127.0.0.1:3000/orders

Full guide: docs/check.md in the idem repository.";

/// The report's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    /// An aligned table for a person (colour on a terminal only)
    Table,
    /// One JSON document
    Json,
    /// JUnit XML, one test case per scenario
    Junit,
}

/// The exit code when a scenario failed (documented in the CLI's table).
pub(crate) const FAILED: u8 = 7;

/// The exit code when the check could not judge the service: the request
/// itself does not succeed, or `--effects` stopped counting.
pub(crate) const COULD_NOT_RUN: u8 = 8;

/// The longest `--timeout`, `--after` or `--restart-timeout`: a week. A
/// longer one is surely a slip, and the run's arithmetic (a deadline past
/// what an `Instant` holds, the plan's bound of fifty timeouts) must not
/// overflow mid-run, after effects were made.
const LONGEST: Duration = Duration::from_secs(7 * 24 * 3600);

fn duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("{e} (write e.g. 10s, 500ms, 1m)"))?;
    if d > LONGEST {
        return Err("longer than a week (the most it takes, written 7d)".to_owned());
    }
    Ok(d)
}

/// A [`duration`] that is not zero: a request or a restart given no time
/// fails at once, and that would be reported as the service's failure (and a
/// restart killed half-way), not as the slip it is.
fn some_time(s: &str) -> Result<Duration, String> {
    match duration(s)? {
        Duration::ZERO => Err("no time at all: give it some, e.g. 10s".to_owned()),
        d => Ok(d),
    }
}

/// Runs `idem check`: the report to print and the exit code.
pub(crate) async fn check(mut args: CheckArgs, json: bool) -> Result<(String, u8), Failure> {
    if json {
        args.format = Format::Json;
    }
    let target = request::Target::from_args(&args)?;
    let plan = plan::Plan::new(&args, &target)?;
    if args.dry_run {
        return Ok((plan.render(&target, &args), 0));
    }
    // Before the first request, on stderr (stdout holds the report alone).
    eprint!("{}", plan.render(&target, &args));
    if let Some(effects) = &target.effects {
        // A URL that cannot count is a mistake in the arguments: said before
        // anything with an effect is sent.
        target
            .count_effects()
            .await
            .map_err(|e| Failure::Usage(format!("--effects {}: {e}", redact::url(effects))))?;
    }
    let report = scenarios::run(&args, &target, &plan).await;
    let code = if report.found_breach {
        FAILED
    } else if report.could_not_run.is_some() {
        COULD_NOT_RUN
    } else if report.failed() > 0 {
        FAILED
    } else {
        0
    };
    let out = match args.format {
        Format::Table => report::table(&report, report::colour()),
        Format::Json => report::json(&report)?,
        Format::Junit => report::junit(&report),
    };
    Ok((out, code))
}
