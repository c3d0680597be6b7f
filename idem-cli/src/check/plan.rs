//! What a run will do, decided before it sends anything: which scenarios
//! apply (and why not, for the others), how many requests each sends, and which
//! create effects. The run follows it exactly; `--dry-run` prints it alone.

use std::fmt::Write;
use std::time::Duration;

use super::request::{Target, read_other_body};
use super::{CheckArgs, body, redact};
use crate::Failure;

/// The scenarios, in the order they run.
pub(crate) const SCENARIOS: &[(&str, &str)] = &[
    ("first-request", "the first request succeeds"),
    (
        "retry",
        "an immediate retry replays the first answer, marked replayed",
    ),
    (
        "equivalent-body",
        "a logically equal body (members reordered, respaced) replays",
    ),
    (
        "other-body",
        "another body under a used key is 422, and changes nothing",
    ),
    ("missing-key", "a request without a key is 400 problem+json"),
    ("malformed-key-empty", "an empty key is 400"),
    (
        "malformed-key-too-long",
        "a 256-character key is 400 and reserves nothing",
    ),
    (
        "malformed-key-control",
        "a key with a control character is 400 and reserves nothing",
    ),
    (
        "malformed-key-comma",
        "a bare key with a comma is 400 and reserves nothing",
    ),
    (
        "malformed-key-structured",
        "a malformed structured-field string is 400 and reserves nothing",
    ),
    (
        "concurrent",
        "concurrent duplicates execute once; the rest replay, or are 409 or 503 with Retry-After",
    ),
    (
        "other-tenant",
        "the same key from another tenant is independent",
    ),
    (
        "restart",
        "a restart between request and retry loses nothing",
    ),
    (
        "late-retry",
        "a retry long after the first answer still replays",
    ),
    (
        "problem-documents",
        "every problem document is well-formed (RFC 9457)",
    ),
];

/// One scenario's part of the plan.
pub(crate) struct Step {
    pub(crate) id: &'static str,
    pub(crate) title: &'static str,
    /// `Err(why)` when the arguments leave it out.
    pub(crate) applies: Result<(), String>,
    /// Requests it sends to the URL (none when it does not apply).
    pub(crate) requests: u32,
    /// Requests to `--effects`.
    pub(crate) counts: u32,
    /// Effects it creates when the service keeps the promise.
    pub(crate) effects: u32,
}

/// The whole run, decided before the first request.
pub(crate) struct Plan {
    pub(crate) steps: Vec<Step>,
    /// The run's id, in every key.
    pub(crate) run: String,
    /// The body with its members reordered and respaced, if the body is JSON.
    pub(crate) equivalent: Option<Vec<u8>>,
    /// Another body for the key, given or derived.
    pub(crate) other: Option<Vec<u8>>,
}

impl Plan {
    pub(crate) fn new(args: &CheckArgs, target: &Target) -> Result<Plan, Failure> {
        // 64 bits: two runs against the same service never share a key.
        let run = format!("{:016x}", fastrand::u64(..));
        let equivalent = target.body.as_deref().and_then(body::equivalent);
        let other = match &args.other_body {
            Some(path) => Some(read_other_body(path)?),
            None => target.body.as_deref().and_then(body::other),
        };
        let counting = u32::from(target.effects.is_some());
        let n = args.concurrency;
        let steps = SCENARIOS
            .iter()
            .map(|&(id, title)| {
                let (applies, requests, counts, effects) = match id {
                    "first-request" => (Ok(()), 1, 2 * counting, 1),
                    "retry" => (Ok(()), 1, counting, 0),
                    "equivalent-body" => match (&target.body, &equivalent) {
                        (None, _) => (Err("the request has no body".to_owned()), 0, 0, 0),
                        (Some(b), None) if body::is_json(b) => (
                            Err("the body names a JSON member twice: reordered, it would be another value".to_owned()),
                            0,
                            0,
                            0,
                        ),
                        (_, None) => (Err("the body is not JSON".to_owned()), 0, 0, 0),
                        _ => (Ok(()), 1, 2 * counting, 0),
                    },
                    "other-body" => match (&target.body, &other) {
                        (None, None) => (
                            Err(
                                "the request has no body (give --other-body to check a body)"
                                    .to_owned(),
                            ),
                            0,
                            0,
                            0,
                        ),
                        (_, None) => (
                            Err(
                                "no other body: the body holds no integer or string value to \
                                 change; give one with --other-body"
                                    .to_owned(),
                            ),
                            0,
                            0,
                            0,
                        ),
                        // The other body alone (is it valid?), under the used
                        // key, then the first body again.
                        _ => (Ok(()), 3, 2 * counting, 1),
                    },
                    "missing-key" => (Ok(()), 1, 2 * counting, 0),
                    "malformed-key-empty" => (Ok(()), 1, 2 * counting, 0),
                    // The malformed key, then the key a lenient parser could
                    // have made of it, which must execute as new.
                    id if id.starts_with("malformed-key-") => (Ok(()), 2, 2 * counting, 1),
                    // An OPTIONS per duplicate to open its connection, the
                    // duplicates, then a retry after they all answered.
                    "concurrent" => (Ok(()), 2 * n + 1, 2 * counting, 1),
                    "other-tenant" if args.tenant_header.is_empty() => {
                        (Err("no --tenant-header".to_owned()), 0, 0, 0)
                    }
                    "other-tenant" => (Ok(()), 1, 0, 1),
                    "restart" if args.restart_cmd.is_none() => {
                        (Err("no --restart-cmd".to_owned()), 0, 0, 0)
                    }
                    "restart" => (Ok(()), 2, 2 * counting, 1),
                    "late-retry" if args.after.is_zero() => (Err("--after 0s".to_owned()), 0, 0, 0),
                    "late-retry" => (Ok(()), 1, 2 * counting, 0),
                    _ => (Ok(()), 0, 0, 0),
                };
                Step {
                    id,
                    title,
                    applies,
                    requests,
                    counts,
                    effects,
                }
            })
            .collect();
        Ok(Plan {
            steps,
            run,
            equivalent,
            other,
        })
    }

    pub(crate) fn step(&self, id: &str) -> &Step {
        self.steps
            .iter()
            .find(|s| s.id == id)
            .expect("a scenario of SCENARIOS")
    }

    /// Requests to the URL and to `--effects` (with the probe before the run).
    pub(crate) fn requests(&self, target: &Target) -> (u32, u32) {
        let url = self.steps.iter().map(|s| s.requests).sum();
        let counts =
            self.steps.iter().map(|s| s.counts).sum::<u32>() + u32::from(target.effects.is_some());
        (url, counts)
    }

    /// How long a run can take at most: every request to its timeout (the
    /// concurrent ones together, and their OPTIONS together), the wait for the
    /// late retry, the restart.
    pub(crate) fn bound(&self, target: &Target, args: &CheckArgs) -> Duration {
        let (url, counts) = self.requests(target);
        let sequential = url + counts - 2 * (args.concurrency - 1);
        let mut bound = target.timeout * sequential;
        if self.step("late-retry").applies.is_ok() {
            bound += args.after;
        }
        if self.step("restart").applies.is_ok() {
            bound += args.restart_timeout;
        }
        bound
    }

    /// The plan as printed: before a run on stderr, alone with `--dry-run`.
    pub(crate) fn render(&self, target: &Target, args: &CheckArgs) -> String {
        let (url, counts) = self.requests(target);
        let effects: u32 = self.steps.iter().map(|s| s.effects).sum();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "idem check: {} {} (run {}, keys idem-check-{}-<scenario>)",
            target.method,
            redact::url(&target.url),
            self.run,
            self.run
        );
        let _ = write!(out, "sends {url} requests to that URL");
        if let Some(e) = &target.effects {
            let _ = write!(out, " and {counts} GETs to {}", redact::url(e));
        }
        let _ = writeln!(
            out,
            ", one at a time except {n} at once (after {n} OPTIONS, at once, that open their \
             connections), each within {each} (at most {all} in all)",
            n = args.concurrency,
            each = humantime::format_duration(target.timeout),
            all = humantime::format_duration(self.bound(target, args))
        );
        let mut waits = Vec::new();
        if self.step("late-retry").applies.is_ok() {
            waits.push(format!(
                "waits until {} after the first answer for the late retry",
                humantime::format_duration(args.after)
            ));
        }
        if self.step("restart").applies.is_ok() {
            waits.push(format!(
                "runs the restart command once (at most {})",
                humantime::format_duration(args.restart_timeout)
            ));
        }
        if !waits.is_empty() {
            let _ = writeln!(out, "{}", waits.join("; "));
        }
        let creating: Vec<String> = self
            .steps
            .iter()
            .filter(|s| s.applies.is_ok() && s.effects > 0)
            .map(|s| format!("{} {}", s.id, s.effects))
            .collect();
        let _ = writeln!(
            out,
            "creates {effects} effects when the service keeps the promise (what one successful \
             request does, {effects} times): {}",
            creating.join(", ")
        );
        for s in &self.steps {
            match &s.applies {
                Ok(()) => {
                    let _ = writeln!(
                        out,
                        "  {:<26} {:>3} request{}  {}",
                        s.id,
                        s.requests,
                        if s.requests == 1 { " " } else { "s" },
                        s.title
                    );
                }
                Err(why) => {
                    let _ = writeln!(out, "  {:<26}   - not applicable: {why}", s.id);
                }
            }
        }
        out
    }
}
