//! The attribute's options: `operation`, `retention`, `in_flight_wait`,
//! `lease`, `lease_ceiling`, `accepted` and `crate`, each read into its value or
//! refused at its own tokens.

use std::time::Duration;

use darling::util::SpannedValue;
use proc_macro2::Span;

use crate::errors::Errors;
use crate::parse::{RawArgs, Text, Written, example};

/// The longest in-flight wait accepted: a waiting request holds a connection.
const MAX_IN_FLIGHT_WAIT: Duration = Duration::from_secs(60);
/// The shortest retention or lease the store can hold: it counts milliseconds.
const MIN_RETENTION: Duration = Duration::from_millis(1);
/// The longest retention or lease accepted: far inside PostgreSQL's timestamp and
/// interval ranges (about 292,000 years), and SQLite's milliseconds.
const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);
/// A lease is renewed every third of its length, each renewal one round trip.
const MIN_LEASE: Duration = Duration::from_millis(100);

/// The options' values; `None` where an option was missing or refused (its
/// error is already collected) or not written.
pub(super) struct Options {
    pub(super) operation: Option<String>,
    pub(super) retention: Option<Duration>,
    pub(super) in_flight_wait: Option<Duration>,
    pub(super) lease: Option<Duration>,
    pub(super) lease_ceiling: Option<Duration>,
    pub(super) accepted: bool,
    pub(super) krate: Option<syn::Path>,
}

pub(super) fn check_options(args: &RawArgs, written: &Written, errors: &mut Errors) -> Options {
    let checked_names = |n: &str| written.unreadable || written.names.contains(n);
    let operation = check_operation(
        args.operation.as_ref(),
        checked_names("operation"),
        args.accepted.is_present(),
        errors,
    );
    let retention = check_retention(args.retention.as_ref(), checked_names("retention"), errors);
    let in_flight_wait = args.in_flight_wait.as_ref().and_then(|w| {
        check_duration(
            "in_flight_wait",
            w,
            Duration::ZERO,
            MAX_IN_FLIGHT_WAIT,
            "",
            errors,
        )
    });
    let lease = args.lease.as_ref().and_then(|l| {
        check_duration(
            "lease",
            l,
            MIN_LEASE,
            MAX_DURATION,
            "a lease is renewed every third of its length, each renewal a database round trip: a shorter lease lapses before it is renewed",
            errors,
        )
    });
    let lease_ceiling = check_lease_ceiling(args, lease, errors);
    if let (Some(w), true) = (args.in_flight_wait.as_ref(), args.lease.is_some()) {
        errors.push_at(
            w.span(),
            "`in_flight_wait` applies to the transactional mode; a leased duplicate is answered at once with `Retry-After` until the lease lapses: remove `in_flight_wait`",
        );
    }
    let accepted = check_accepted(args, errors);
    let krate = check_crate(args.krate.as_ref(), errors);
    Options {
        operation,
        retention,
        in_flight_wait,
        lease,
        lease_ceiling,
        accepted,
        krate,
    }
}

/// `accepted` answers `202` and keeps working after the answer: only a lease,
/// renewed in the background, can hold the key that long (a transaction would
/// have to stay open, and the deadline cuts it short).
fn check_accepted(args: &RawArgs, errors: &mut Errors) -> bool {
    if !args.accepted.is_present() {
        return false;
    }
    if args.lease.is_none() {
        errors.push_at(
            args.accepted.span(),
            "`accepted` needs `lease = \"...\"`: a long operation answers `202 Accepted` at once and keeps working after its answer, which only a lease renewed in the background can hold the key for (a transaction cannot stay open past its request); add `lease = \"30s\"` and take `lease: &mut idem_runtime::Lease<Postgres>` instead of the transaction, or remove `accepted`",
        );
        return false;
    }
    true
}

fn check_retention(
    retention: Option<&Text>,
    written: bool,
    errors: &mut Errors,
) -> Option<Duration> {
    match retention {
        None if !written => {
            errors.push_at(
                Span::call_site(),
                "missing `retention`: add `retention = \"24h\"`, how long keys and outcomes are kept (it changes correctness, so it has no default)",
            );
            None
        }
        None => None,
        Some(r) => check_duration(
            "retention",
            r,
            MIN_RETENTION,
            MAX_DURATION,
            "a key is stored in whole milliseconds: below one, every retry would run again",
            errors,
        ),
    }
}

fn check_lease_ceiling(
    args: &RawArgs,
    lease: Option<Duration>,
    errors: &mut Errors,
) -> Option<Duration> {
    match args.lease_ceiling.as_ref() {
        Some(c) if args.lease.is_none() => {
            errors.push_at(
                c.span(),
                "`lease_ceiling` needs `lease = \"...\"`: it bounds the renewal of a leased handler; add `lease = \"30s\"` or remove `lease_ceiling`",
            );
            None
        }
        Some(c) => match lease {
            Some(l) => {
                let ceiling =
                    check_duration("lease_ceiling", c, Duration::ZERO, MAX_DURATION, "", errors);
                match ceiling {
                    Some(ceiling) if ceiling < l => {
                        errors.push_at(
                            c.span(),
                            format!(
                                "`lease_ceiling` ({}) is shorter than `lease` ({}): the lease would never be renewed; it must be between {} and 100 years: write at least \"{}\", or remove it (the default is ten leases)",
                                c.as_str(),
                                args.lease.as_ref().map(|l| l.as_str()).unwrap_or_default(),
                                humantime::format_duration(l),
                                humantime::format_duration(l),
                            ),
                        );
                        None
                    }
                    other => other,
                }
            }
            // The lease itself was refused; its error is enough.
            None => None,
        },
        None => None,
    }
}

fn check_crate(krate: Option<&Text>, errors: &mut Errors) -> Option<syn::Path> {
    match krate {
        None => None,
        Some(k) => match syn::parse_str::<proc_macro2::TokenStream>(k.as_str())
            .map(|t| respan(t, k.span()))
            .and_then(syn::parse2::<syn::Path>)
        {
            Ok(p) => Some(p),
            Err(_) => {
                errors.push_at(
                    k.span(),
                    format!(
                        "`crate` must be a path such as \"::idem_runtime\" or \"my_crate::idem\", not {:?}",
                        k.as_str()
                    ),
                );
                None
            }
        },
    }
}

/// The tokens with one span (a path parsed from a string literal gets the
/// literal's).
fn respan(tokens: proc_macro2::TokenStream, span: Span) -> proc_macro2::TokenStream {
    tokens
        .into_iter()
        .map(|mut tt| {
            if let proc_macro2::TokenTree::Group(g) = &tt {
                let mut ng = proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                ng.set_span(span);
                tt = proc_macro2::TokenTree::Group(ng);
            } else {
                tt.set_span(span);
            }
            tt
        })
        .collect()
}

/// `accepted`: the name is also a segment of the long operation's resource URL.
fn check_operation(
    op: Option<&Text>,
    written: bool,
    accepted: bool,
    errors: &mut Errors,
) -> Option<String> {
    let Some(op) = op else {
        if !written {
            errors.push_at(
                Span::call_site(),
                "missing `operation`: add `operation = \"create-order\"`, the operation's stable name (it scopes the key, so keep it when you rename the handler)",
            );
        }
        return None;
    };
    let name = op.as_str();
    let problem = if name.is_empty() {
        Some("`operation` must not be empty: name it, e.g. \"create-order\"".to_owned())
    } else if name.len() > 128 {
        Some(format!(
            "`operation` is {} characters long; keep it at most 128",
            name.len()
        ))
    } else if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/')))
    {
        Some(format!(
            "`operation` may hold ASCII letters, digits and `-` `_` `.` `:` `/` only, not {c:?}: write e.g. \"create-order\""
        ))
    } else if accepted && name.split('/').any(|seg| matches!(seg, "" | "." | "..")) {
        // A long operation's resource is `<operations path>/<operation>/<key>`:
        // an empty or dot segment there is one no client can follow (the
        // router strips leading slashes, clients resolve dot segments away).
        // Only there: another handler's name is only a scope, and renaming it
        // would forget its stored keys.
        Some(format!(
            "`operation` {name:?} has an empty, `.` or `..` segment between its `/`s, which a long operation's `Location` could not be followed through: write e.g. \"exports/create\""
        ))
    } else {
        None
    };
    match problem {
        Some(msg) => {
            errors.push_at(op.span(), msg);
            None
        }
        None => Some(name.to_owned()),
    }
}

fn range_text(min: Duration, max: Duration) -> String {
    let max = if max == MAX_DURATION {
        "100 years".to_owned()
    } else {
        humantime::format_duration(max).to_string()
    };
    format!("between {} and {max}", humantime::format_duration(min))
}

fn check_duration(
    what: &str,
    value: &SpannedValue<String>,
    min: Duration,
    max: Duration,
    why_min: &str,
    errors: &mut Errors,
) -> Option<Duration> {
    let range = range_text(min, max);
    // The example the grammar declares for the option.
    let example = example(what);
    let mut err = |msg: String| errors.push_at(value.span(), msg);
    match humantime::parse_duration(value.as_str()) {
        Err(e) => {
            err(format!(
                "`{what}` is not a duration ({e}): write e.g. \"90s\", \"15m\", \"24h\" or \"7d\""
            ));
            None
        }
        Ok(d) if d < min => {
            let why = if d.is_zero() && what == "retention" {
                "a key that is forgotten at once protects nothing".to_owned()
            } else {
                why_min.to_owned()
            };
            err(format!(
                "`{what}` must be {range}, not {:?}: {why}; write e.g. {example}",
                value.as_str()
            ));
            None
        }
        Ok(d) if d > max => {
            let why = if what == "in_flight_wait" {
                "a waiting request holds a database connection"
            } else {
                "keys expire at a database timestamp, and past PostgreSQL's range (about 292,000 years from now) every claim would fail; 100 years is the bound idem checks on every backend"
            };
            err(format!(
                "`{what}` must be {range}, not {:?}: {why}; write e.g. {example}",
                value.as_str()
            ));
            None
        }
        Ok(d) => Some(d),
    }
}
