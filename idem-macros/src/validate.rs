//! Validate: the written arguments and the handler's signature, checked together
//! into a [`Config`] that expansion can trust. Every error is collected, each at
//! its own tokens, so the user sees all of them at once; the signature is checked
//! even when an option could not be read.

use std::time::Duration;

use darling::util::SpannedValue;
use proc_macro2::Span;
use syn::{FnArg, GenericArgument, GenericParam, ItemFn, Pat, PathArguments, Type};

use crate::errors::Errors;
use crate::parse::{RawArgs, RawFingerprint};

/// A checked attribute, ready to expand.
#[derive(Debug)]
pub struct Config {
    pub operation: String,
    pub retention: Duration,
    pub in_flight_wait: Option<Duration>,
    /// Leased mode: the lease and the renewal ceiling.
    pub lease: Option<Duration>,
    pub lease_ceiling: Option<Duration>,
    pub headers: Vec<String>,
    pub body: BodyPrint,
    pub tenant: Tenant,
    /// Index into the handler's parameters.
    pub tx: usize,
    /// The parameter before which the idempotency request goes (the body, or a
    /// last parameter that may be one); `None`: last.
    pub request_before: Option<usize>,
    /// The body is a `Result<B, B::Rejection>`: a rejection is answered first.
    pub body_result: Option<usize>,
    /// `None`: `::idem_runtime`. Its tokens carry the span of the string it was
    /// written in, where an unresolved path is then reported.
    pub krate: Option<syn::Path>,
}

/// What of the body goes into the fingerprint, and from which parameter.
#[derive(Debug)]
pub enum BodyPrint {
    None,
    Whole(usize),
    /// Field paths (segments) and the span of the attribute token they came from.
    Fields(usize, Vec<(Vec<String>, Span)>),
    /// The last parameter's type cannot be named (an alias): its type decides
    /// whether it is a body, fingerprinted whole.
    Probe(usize),
    /// Likewise, with `fingerprint(header = ..)` only: a body there is refused.
    ProbeLeftOut(usize),
}

/// Where the tenant comes from.
#[derive(Debug)]
pub enum Tenant {
    Param(usize),
    Single,
}

/// Types that read the request body (axum's `FromRequest`, not
/// `FromRequestParts`). Besides these, any type whose name ends in `Json` or
/// `Form` (`ValidJson`), and any parameter marked `#[body]`, is the body.
const BODY_EXTRACTORS: &[&str] = &["Json", "Form", "Bytes", "String", "RawForm"];

/// Bodies that are streams: there is no value to fingerprint before the claim.
const STREAMING_BODIES: &[&str] = &["Body", "Request", "Multipart"];

/// Extractors of the request's parts (never the body).
const PARTS_EXTRACTORS: &[&str] = &[
    "State",
    "Path",
    "Query",
    "Extension",
    "HeaderMap",
    "Method",
    "Uri",
    "OriginalUri",
    "MatchedPath",
    "ConnectInfo",
    "TypedHeader",
    "Host",
    "RawQuery",
    "RawPathParams",
    "NestedPath",
    "Version",
    "Parts",
    "Extensions",
    "CookieJar",
    "PrivateCookieJar",
    "SignedCookieJar",
    "WebSocketUpgrade",
    "Scheme",
];

/// The longest in-flight wait accepted: a waiting request holds a connection.
const MAX_IN_FLIGHT_WAIT: Duration = Duration::from_secs(60);
/// The shortest retention or lease the store can hold: it counts milliseconds.
const MIN_RETENTION: Duration = Duration::from_millis(1);
/// The longest retention or lease accepted: far inside PostgreSQL's timestamp and
/// interval ranges (about 292,000 years), and SQLite's milliseconds.
const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);
/// A lease is renewed every third of its length, each renewal one round trip.
const MIN_LEASE: Duration = Duration::from_millis(100);

/// Is this parameter marked `#[tenant]`?
pub fn tenant_attr(arg: &syn::PatType) -> Option<&syn::Attribute> {
    arg.attrs.iter().find(|a| a.path().is_ident("tenant"))
}

/// Is this attribute `#[idempotent]` (by any path)?
pub fn is_idempotent_attr(a: &syn::Attribute) -> bool {
    a.path()
        .segments
        .last()
        .is_some_and(|s| s.ident == "idempotent")
}

/// What a parameter is, from its type and pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Reads the body; `streaming`: has no value to fingerprint.
    Body {
        streaming: bool,
        result: bool,
    },
    Parts,
    Unknown,
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Paren(p) => last_segment(&p.elem),
        Type::Group(g) => last_segment(&g.elem),
        _ => None,
    }
}

fn first_type_arg(seg: &syn::PathSegment) -> Option<&Type> {
    match &seg.arguments {
        PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
            GenericArgument::Type(t) => Some(t),
            _ => None,
        }),
        _ => None,
    }
}

fn classify_type(ty: &Type) -> Class {
    let Some(seg) = last_segment(ty) else {
        return Class::Unknown;
    };
    let name = seg.ident.to_string();
    if name == "Option" || name == "Result" {
        return match first_type_arg(seg).map(classify_type) {
            Some(Class::Body { streaming, .. }) => Class::Body {
                streaming,
                result: name == "Result",
            },
            Some(Class::Parts) => Class::Parts,
            _ => Class::Unknown,
        };
    }
    if STREAMING_BODIES.contains(&name.as_str()) {
        Class::Body {
            streaming: true,
            result: false,
        }
    } else if BODY_EXTRACTORS.contains(&name.as_str())
        || name.ends_with("Json")
        || name.ends_with("Form")
    {
        Class::Body {
            streaming: false,
            result: false,
        }
    } else if PARTS_EXTRACTORS.contains(&name.as_str()) {
        Class::Parts
    } else {
        Class::Unknown
    }
}

fn classify(arg: &syn::PatType) -> Class {
    let by_type = classify_type(&arg.ty);
    let marked = arg.attrs.iter().any(|a| a.path().is_ident("body"));
    match by_type {
        Class::Body { .. } => by_type,
        _ if marked => Class::Body {
            streaming: false,
            result: matches!(last_segment(&arg.ty), Some(s) if s.ident == "Result"),
        },
        Class::Unknown => {
            // `Json(cmd): OrderBody`: the pattern names the extractor an alias hides.
            if let Pat::TupleStruct(p) = &*arg.pat {
                let name = p
                    .path
                    .segments
                    .last()
                    .map(|s| s.ident.to_string())
                    .unwrap_or_default();
                if BODY_EXTRACTORS.contains(&name.as_str())
                    || name.ends_with("Json")
                    || name.ends_with("Form")
                {
                    return Class::Body {
                        streaming: false,
                        result: false,
                    };
                }
                if STREAMING_BODIES.contains(&name.as_str()) {
                    return Class::Body {
                        streaming: true,
                        result: false,
                    };
                }
                if PARTS_EXTRACTORS.contains(&name.as_str()) {
                    return Class::Parts;
                }
            }
            Class::Unknown
        }
        Class::Parts => Class::Parts,
    }
}

/// Checks everything. `errors` collects what is wrong; the result is `None` when
/// anything was.
pub fn validate(args: RawArgs, func: &ItemFn, errors: &mut Errors) -> Option<Config> {
    let sig = &func.sig;
    let name = &sig.ident;

    // The attribute written twice: the first expansion sees the second.
    for attr in func.attrs.iter().filter(|a| is_idempotent_attr(a)) {
        errors.push_spanned(
            attr,
            format!(
                "`#[idempotent]` is written twice on `{name}`: keep one (a handler has one operation, retention and fingerprint)"
            ),
        );
    }

    // The function itself.
    if sig.asyncness.is_none() {
        errors.push_spanned(
            sig.fn_token,
            format!("`#[idempotent]` handlers must be async: write `async fn {name}`"),
        );
    }
    if let syn::Safety::Unsafe(unsafety) = &sig.safety {
        errors.push_spanned(
            unsafety,
            "`#[idempotent]` handlers cannot be `unsafe fn`: axum calls a handler as a safe function; remove `unsafe` here and put the unsafe operations in an `unsafe { ... }` block inside the handler",
        );
    }
    if let Some(abi) = &sig.abi {
        errors.push_spanned(
            abi,
            "`#[idempotent]` handlers cannot be `extern` functions: remove the ABI; axum calls handlers as Rust functions",
        );
    }
    if let Some(constness) = &sig.constness {
        errors.push_spanned(
            constness,
            "`#[idempotent]` handlers cannot be `const fn`: remove `const`",
        );
    }
    for param in &sig.generics.params {
        match param {
            GenericParam::Lifetime(l) => errors.push_spanned(
                l,
                format!(
                    "lifetime parameters are not supported by `#[idempotent]`: axum's extractors own their data, so take owned types (`String`, not `&{} str`) and remove `<{}>`",
                    l.lifetime, l.lifetime
                ),
            ),
            GenericParam::Type(t) => errors.push_spanned(
                t,
                "generic handlers are not supported by `#[idempotent]`: the fingerprint and the stored outcome need concrete types; write one handler per concrete type",
            ),
            GenericParam::Const(c) => errors.push_spanned(
                c,
                "const generic parameters are not supported by `#[idempotent]`: write one handler per value",
            ),
        }
    }
    if sig.generics.params.is_empty()
        && let Some(w) = &sig.generics.where_clause
    {
        errors.push_spanned(
            w,
            "`where` clauses are not supported by `#[idempotent]`: its handlers have concrete types; remove the `where` clause",
        );
    }
    if let Some(v) = &sig.variadic {
        errors.push_spanned(v, "`#[idempotent]` handlers cannot be variadic");
    }

    // The options.
    let written = &args.meta;
    let checked_names = |n: &str| written.unreadable || written.names.contains(n);
    let operation = check_operation(args.operation, checked_names("operation"), errors);
    let retention = match &args.retention {
        None if !checked_names("retention") => {
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
    };
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
    let lease_ceiling = match &args.lease_ceiling {
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
    };
    if let (Some(w), true) = (&args.in_flight_wait, args.lease.is_some()) {
        errors.push_at(
            w.span(),
            "`in_flight_wait` applies to the transactional mode; a leased duplicate is answered at once with `Retry-After` until the lease lapses: remove `in_flight_wait`",
        );
    }
    let leased = args.lease.is_some();
    let handle = if leased {
        "lease: &mut idem_runtime::Lease"
    } else {
        "tx: &mut idem_runtime::Tx"
    };
    let krate = match &args.krate {
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
    };

    // The parameters: tenant, transaction, body.
    let mut tenant = None;
    let mut tx = None;
    // A refused `#[tenant]` or handle is not also reported missing.
    let mut tenant_refused =
        args.meta.names.contains("single_tenant") && !args.single_tenant.is_present();
    let mut tx_refused = false;
    let mut classes: Vec<(usize, Class)> = Vec::new();
    for (i, arg) in sig.inputs.iter().enumerate() {
        let arg = match arg {
            FnArg::Receiver(r) => {
                errors.push_spanned(
                    r,
                    "`#[idempotent]` cannot take `self`: make the handler a free `async fn` and reach shared data through `State`",
                );
                continue;
            }
            FnArg::Typed(t) => t,
        };
        for attr in &arg.attrs {
            if attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr") {
                errors.push_spanned(
                    attr,
                    "conditional parameters are not supported by `#[idempotent]`: write one handler per configuration",
                );
            }
        }
        if let Type::ImplTrait(t) = &*arg.ty {
            errors.push_spanned(
                t,
                "`impl Trait` parameters are generics, which `#[idempotent]` does not support: name the concrete extractor type",
            );
            continue;
        }
        if let Type::Reference(r) = &*arg.ty {
            // The handle is recognised by its name, `Tx` or `Lease`, which also
            // picks the mode: a wrong type is one error here, not type errors in
            // the expansion and at the router.
            let handle_name = last_segment(&r.elem).map(|s| s.ident.to_string());
            let expected = if leased { "Lease" } else { "Tx" };
            tx_refused = true;
            if r.mutability.is_none() {
                errors.push_spanned(
                    &arg.ty,
                    format!(
                        "take it as `{handle}`; other references cannot be extracted from a request"
                    ),
                );
            } else if tx.is_some() {
                errors.push_spanned(
                    &arg.ty,
                    format!("the handler takes two `&mut` parameters: keep one, `{handle}`"),
                );
            } else if handle_name.as_deref() == Some("Tx") && leased {
                errors.push_spanned(
                    &arg.ty,
                    "with `lease = \"...\"` the handler holds a lease, not a transaction: take `lease: &mut idem_runtime::Lease` (`&mut Lease<sqlx::Sqlite>` on SQLite), or remove `lease` to write the effects in the transaction that holds the key",
                );
            } else if handle_name.as_deref() == Some("Lease") && !leased {
                errors.push_spanned(
                    &arg.ty,
                    "`Lease` is the handle of leased mode: add `lease = \"30s\"` to `#[idempotent(...)]` for an effect outside the database, or take `tx: &mut idem_runtime::Tx` to write the effects in the transaction that holds the key",
                );
            } else if handle_name.as_deref() != Some(expected) {
                errors.push_spanned(
                    &arg.ty,
                    if leased {
                        "this is not idem's lease: take `lease: &mut idem_runtime::Lease` (`&mut Lease<sqlx::Sqlite>` on SQLite), written with its name `Lease`, which the attribute reads"
                    } else {
                        "this is not idem's transaction: take `tx: &mut idem_runtime::Tx` (PostgreSQL) or `tx: &mut Tx<sqlx::Sqlite>` (SQLite), written with its name `Tx`, which the attribute reads to pick the backend; the effects go through `&mut **tx`"
                    },
                );
            } else {
                tx = Some(i);
                tx_refused = false;
            }
            if let Some(attr) = tenant_attr(arg) {
                tenant_refused = true;
                errors.push_spanned(
                    attr,
                    "`#[tenant]` marks the parameter that identifies the caller, not the transaction",
                );
            }
            continue;
        }
        let class = classify(arg);
        if let Some(attr) = tenant_attr(arg) {
            tenant_refused = true;
            if args.single_tenant.is_present() {
                errors.push_spanned(
                    attr,
                    "`#[tenant]` contradicts `single_tenant`: keep `#[tenant]` to scope keys by caller, or remove it for a service with one tenant",
                );
            } else if tenant.is_some() {
                errors.push_spanned(
                    attr,
                    "only one parameter can be the `#[tenant]`: remove this one or the other",
                );
            } else if matches!(class, Class::Body { .. }) {
                errors.push_spanned(
                    attr,
                    "the request body cannot be the `#[tenant]`: a client could name any tenant in it; mark the caller's auth extractor `#[tenant]` instead",
                );
            } else if let Some(wrapper) = last_segment(&arg.ty)
                .map(|s| s.ident.to_string())
                .filter(|n| n == "Option" || n == "Result")
            {
                // Caught here, by its spelling: after expansion the compiler would
                // report the missing `TenantScope` and axum's `Handler` error too.
                errors.push_spanned(
                    &arg.ty,
                    format!(
                        "the `#[tenant]` cannot be an `{wrapper}`: a request without a caller has no tenant to scope its key by; take the caller's type itself (its extractor refuses an anonymous request before anything is claimed), or use `single_tenant`"
                    ),
                );
            } else {
                tenant = Some(Tenant::Param(i));
                tenant_refused = false;
            }
        }
        classes.push((i, class));
    }
    if args.single_tenant.is_present() && tenant.is_none() {
        tenant = Some(Tenant::Single);
    }
    if tenant.is_none() && !tenant_refused {
        errors.push_spanned(
            &sig.ident,
            format!(
                "`{name}` has no tenant: mark the parameter that identifies the caller with `#[tenant]` (its type implements `idem_runtime::TenantScope`), or add `single_tenant` to `#[idempotent(...)]` if this service has one tenant"
            ),
        );
    }
    if tx.is_none() && !tx_refused {
        let msg = if leased {
            format!(
                "`{name}` takes no lease: add a parameter `{handle}`; it carries the downstream idempotency key and lets the handler report an uncertain outcome"
            )
        } else {
            format!(
                "`{name}` takes no transaction: add a parameter `{handle}` and write the operation's effects through it, so they commit together with the stored outcome"
            )
        };
        errors.push_spanned(&sig.ident, msg);
    }

    // The body: the extractor axum runs last.
    let typed = |i: usize| match &sig.inputs[i] {
        FnArg::Typed(t) => Some(t),
        FnArg::Receiver(_) => None,
    };
    let last = classes.last().map(|(i, _)| *i);
    let bodies: Vec<(usize, Class)> = classes
        .iter()
        .copied()
        .filter(|(_, c)| matches!(c, Class::Body { .. }))
        .collect();
    for (n, (i, _)) in bodies.iter().enumerate() {
        let Some(arg) = typed(*i) else { continue };
        if n > 0 {
            errors.push_spanned(
                &arg.ty,
                "a second body extractor: the request body can be read only once; keep one of them",
            );
        } else if bodies.len() == 1 && Some(*i) != last {
            errors.push_spanned(
                &arg.ty,
                "the body extractor must be the last parameter: axum reads the body after every other extractor; move this parameter to the end",
            );
        }
    }
    let body_param = bodies.first().copied();
    let tenant_index = match tenant {
        Some(Tenant::Param(t)) => Some(t),
        _ => None,
    };
    // A last parameter of a type the attribute cannot place (an alias, a custom
    // extractor) may read the body: its type decides, through a probe.
    let maybe_body = match (body_param, classes.last()) {
        (None, Some((i, Class::Unknown))) if Some(*i) != tenant_index => Some(*i),
        _ => None,
    };

    let (headers, body) = check_fingerprint(
        args.fingerprint,
        args.meta.fingerprint_span,
        args.meta.fingerprint_refused,
        body_param.map(|(i, c)| (i, c, typed(i))),
        maybe_body,
        errors,
    );

    let body_result = match body_param {
        Some((i, Class::Body { result: true, .. })) => Some(i),
        _ => None,
    };
    if let Some(arg) = body_result.and_then(typed) {
        check_rejection(arg, errors);
    }
    if !errors.is_empty() {
        return None;
    }
    Some(Config {
        operation: operation?,
        retention: retention?,
        in_flight_wait,
        lease,
        lease_ceiling,
        headers,
        body,
        tenant: tenant?,
        tx: tx?,
        request_before: body_param.map(|(i, _)| i).or(maybe_body),
        body_result,
        krate,
    })
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

fn check_operation(
    op: Option<SpannedValue<String>>,
    written: bool,
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
    } else {
        name.chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/')))
            .map(|c| format!(
                "`operation` may hold ASCII letters, digits and `-` `_` `.` `:` `/` only, not {c:?}: write e.g. \"create-order\""
            ))
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
    let example = match what {
        "in_flight_wait" => "\"500ms\"",
        "lease" => "\"30s\"",
        "lease_ceiling" => "\"5m\"",
        _ => "\"24h\"",
    };
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

/// A fallible body `Result<B, E>` is answered with `B`'s rejection before the
/// claim, so `E` must be that rejection: axum's own (`JsonRejection`,
/// `FormRejection`, ...), an extractor's `...Rejection`, or the path
/// `<B as FromRequest<S>>::Rejection`. Anything else (`String`, an error type of
/// the application) is refused here with what to write, instead of axum's
/// `Handler` error at the router.
fn check_rejection(arg: &syn::PatType, errors: &mut Errors) {
    let Some(seg) = last_segment(&arg.ty) else {
        return;
    };
    let PathArguments::AngleBracketed(a) = &seg.arguments else {
        return;
    };
    let mut types = a.args.iter().filter_map(|g| match g {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    });
    let (Some(body), Some(err)) = (types.next(), types.next()) else {
        return;
    };
    let is_rejection = match err {
        // `<Json<T> as FromRequest<S>>::Rejection`
        Type::Path(p) if p.qself.is_some() => true,
        _ => last_segment(err).is_some_and(|e| e.ident.to_string().ends_with("Rejection")),
    };
    if is_rejection {
        return;
    }
    let body_name = last_segment(body).map_or_else(|| "B".to_owned(), |b| b.ident.to_string());
    let rejection = match body_name.as_str() {
        "Json" => "axum::extract::rejection::JsonRejection".to_owned(),
        "Form" => "axum::extract::rejection::FormRejection".to_owned(),
        "RawForm" => "axum::extract::rejection::RawFormRejection".to_owned(),
        "Bytes" => "axum::extract::rejection::BytesRejection".to_owned(),
        "String" => "axum::extract::rejection::StringRejection".to_owned(),
        other => format!("<{other}<..> as axum::extract::FromRequest<S>>::Rejection"),
    };
    errors.push_spanned(
        err,
        format!(
            "a fallible body's error must be the extractor's rejection, which idem answers before the claim: write `Result<{body_name}<..>, {rejection}>`, or take `{body_name}<..>` alone and let axum answer a bad body"
        ),
    );
}

fn check_fingerprint(
    fp: Option<RawFingerprint>,
    fp_span: Option<(Span, Span)>,
    refused: bool,
    body_param: Option<(usize, Class, Option<&syn::PatType>)>,
    maybe_body: Option<usize>,
    errors: &mut Errors,
) -> (Vec<String>, BodyPrint) {
    let streaming = |errors: &mut Errors, why: &str| {
        if let Some((
            _,
            Class::Body {
                streaming: true, ..
            },
            Some(arg),
        )) = body_param
        {
            errors.push_spanned(
                &arg.ty,
                format!(
                    "this body is a stream, which idem cannot fingerprint before the claim ({why}): take `Bytes` (fingerprinted byte for byte), `Json<T>` or `Form<T>` instead, or write `fingerprint(ignore_body)` to leave the body out (with `header = \"...\"` to identify the request by its headers)"
                ),
            );
        }
    };
    let Some(fp) = fp else {
        // Documented default: the whole body when there is one.
        return (
            Vec::new(),
            match (body_param, maybe_body) {
                (Some((i, _, _)), _) => {
                    streaming(
                        errors,
                        "without `fingerprint(...)`, the whole body is part of the fingerprint",
                    );
                    BodyPrint::Whole(i)
                }
                (None, Some(i)) => BodyPrint::Probe(i),
                (None, None) => BodyPrint::None,
            },
        );
    };
    let at_fingerprint = |errors: &mut Errors, msg: String| match fp_span {
        Some(range) => errors.push_range(range, msg),
        None => errors.push_at(Span::call_site(), msg),
    };
    let mut headers: Vec<String> = Vec::new();
    for h in &fp.header {
        let lower = h.as_str().to_ascii_lowercase();
        let mut err = |msg: String| errors.push_at(h.span(), msg);
        if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
            err(format!(
                "{:?} is not a valid HTTP header name: header names are tokens such as \"x-currency\"",
                h.as_str()
            ));
        } else if lower == "idempotency-key" {
            err(
                "the Idempotency-Key is the key itself, not part of the fingerprint: remove this header".into(),
            );
        } else if headers.contains(&lower) {
            err(format!(
                "the header {:?} is listed twice: remove one",
                h.as_str()
            ));
        } else {
            headers.push(lower);
        }
    }
    // The suggestions below repeat the headers that were accepted.
    let header_list = headers
        .iter()
        .map(|h| format!("header = {h:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let with = |first: &str| {
        if header_list.is_empty() {
            format!("fingerprint({first})")
        } else {
            format!("fingerprint({first}, {header_list})")
        }
    };
    let param = body_param.map(|(i, _, _)| i).or(maybe_body);
    let mut fields = Vec::new();
    for f in &fp.fields {
        let segments: Vec<String> = f.as_str().split('.').map(str::to_owned).collect();
        if segments
            .iter()
            .any(|s| syn::parse_str::<syn::Ident>(s).is_err() && s.parse::<u32>().is_err())
        {
            errors.push_at(
                f.span(),
                format!(
                    "`body.{}` is not a field path: write `body.field` or `body.field.subfield`",
                    f.as_str()
                ),
            );
        } else if fields.iter().any(|(s, _)| s == &segments) {
            errors.push_at(
                f.span(),
                format!("`body.{}` is listed twice: remove one", f.as_str()),
            );
        } else {
            fields.push((segments, f.span()));
        }
    }
    let wants_body = fp.body.is_present() || !fp.fields.is_empty();
    if fp.body.is_present() && !fp.fields.is_empty() {
        errors.push_at(
            fp.body.span(),
            "`body` already fingerprints the whole body: remove either `body` or the `body.<field>` paths",
        );
    }
    if fp.ignore_body.is_present() && wants_body {
        errors.push_at(
            fp.ignore_body.span(),
            "`ignore_body` contradicts `body`: keep `body` (or `body.<field>`) to fingerprint the body, or `ignore_body` to leave it out",
        );
    }
    let Some(param) = param else {
        if wants_body {
            at_fingerprint(
                errors,
                "`fingerprint(body...)` needs a body: add a body extractor such as `Json<T>` or `Form<T>` as the last parameter, or remove `body` from `fingerprint(...)`".to_owned(),
            );
        } else if fp.ignore_body.is_present() {
            errors.push_at(
                fp.ignore_body.span(),
                "`ignore_body`, but the handler reads no body: remove `ignore_body`",
            );
        }
        return (headers, BodyPrint::None);
    };
    if fp.ignore_body.is_present() {
        return (headers, BodyPrint::None);
    }
    if fp.body.is_present() {
        streaming(errors, "`fingerprint(body)` asks for it");
        return (headers, BodyPrint::Whole(param));
    }
    if !fields.is_empty() {
        streaming(errors, "`fingerprint(body.<field>)` asks for it");
        return (headers, BodyPrint::Fields(param, fields));
    }
    if !fp.fields.is_empty() {
        // Every field was refused above.
        return (headers, BodyPrint::None);
    }
    if refused {
        // What the refused item meant is unknown: nothing more to judge.
        return (headers, BodyPrint::None);
    }
    // Headers only, and the handler has a body: leaving it out must be written.
    if body_param.is_some() {
        at_fingerprint(
            errors,
            format!(
                "`{}` leaves the request body out of the fingerprint, so a retry with the same key and another body would replay the first answer: write `{}` to make the body part of the request's identity, or `{}` if the body does not identify the request",
                if header_list.is_empty() {
                    "fingerprint()".to_owned()
                } else {
                    format!("fingerprint({header_list})")
                },
                with("body"),
                if header_list.is_empty() {
                    "fingerprint(ignore_body)".to_owned()
                } else {
                    format!("fingerprint({header_list}, ignore_body)")
                },
            ),
        );
        return (headers, BodyPrint::None);
    }
    (headers, BodyPrint::ProbeLeftOut(param))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::parse_args;
    use quote::quote;
    use syn::parse_quote;

    fn check(args: proc_macro2::TokenStream, func: ItemFn) -> Result<Config, String> {
        let mut errors = Errors::default();
        let raw = parse_args(args, &mut errors);
        let cfg = validate(raw, &func, &mut errors);
        if !errors.is_empty() {
            return Err(errors.messages().join("\n"));
        }
        Ok(cfg.unwrap())
    }

    fn handler() -> ItemFn {
        parse_quote! {
            async fn create_order(#[tenant] caller: Caller, tx: &mut Tx, Json(cmd): Json<NewOrder>) -> Response { todo!() }
        }
    }

    #[test]
    fn the_design_example_is_accepted() {
        let c = check(
            quote!(
                operation = "create-order",
                retention = "24h",
                fingerprint(body, header = "X-Currency")
            ),
            handler(),
        )
        .unwrap();
        assert_eq!(c.operation, "create-order");
        assert_eq!(c.retention, Duration::from_secs(24 * 3600));
        assert_eq!(c.headers, ["x-currency"]);
        assert!(matches!(c.body, BodyPrint::Whole(2)));
        assert!(matches!(c.tenant, Tenant::Param(0)));
        assert_eq!(c.tx, 1);
        assert_eq!(c.request_before, Some(2));
    }

    #[test]
    fn fingerprint_defaults_to_the_body() {
        let c = check(quote!(operation = "x", retention = "7d"), handler()).unwrap();
        assert!(matches!(c.body, BodyPrint::Whole(2)));
        let c = check(
            quote!(operation = "x", retention = "7d"),
            parse_quote!(
                async fn f(#[tenant] c: Caller, tx: &mut Tx) {}
            ),
        )
        .unwrap();
        assert!(matches!(c.body, BodyPrint::None));
        assert_eq!(c.request_before, None);
    }

    #[test]
    fn errors_are_collected_and_explained() {
        let e = check(
            quote!(retention = "0s", fingerprint(header = "bad header")),
            parse_quote!(
                fn f<T>(x: T) {}
            ),
        )
        .unwrap_err();
        for expected in [
            "must be async",
            "generic handlers",
            "missing `operation`",
            "between 1ms and 100 years",
            "not a valid HTTP header name",
            "has no tenant",
            "takes no transaction",
        ] {
            assert!(e.contains(expected), "missing {expected:?} in\n{e}");
        }
    }

    #[test]
    fn a_misspelled_option_does_not_hide_the_signature() {
        let e = check(
            quote!(operation = "x", retension = "1h"),
            parse_quote!(
                fn f(x: X) {}
            ),
        )
        .unwrap_err();
        for expected in ["did you mean `retention`", "must be async", "has no tenant"] {
            assert!(e.contains(expected), "missing {expected:?} in\n{e}");
        }
        // The option meant is not also reported missing.
        assert!(!e.contains("missing `retention`"), "{e}");
        // A refused value is not also reported as missing.
        let e = check(quote!(operation = "x", retention = 24h), handler()).unwrap_err();
        assert!(!e.contains("missing"), "{e}");
    }

    #[test]
    fn durations() {
        for (text, secs) in [("90s", 90), ("15m", 900), ("24h", 86400), ("7d", 604800)] {
            let c = check(quote!(operation = "x", retention = #text), handler()).unwrap();
            assert_eq!(c.retention, Duration::from_secs(secs));
        }
        let e = check(quote!(operation = "x", retention = "soon"), handler()).unwrap_err();
        assert!(e.contains("not a duration"), "{e}");
        for (args, expected) in [
            (
                quote!(operation = "x", retention = "1h", in_flight_wait = "2h"),
                "between 0s and 1m",
            ),
            (
                quote!(operation = "x", retention = "500us"),
                "between 1ms and 100 years",
            ),
            (
                quote!(operation = "x", retention = "101years"),
                "between 1ms and 100 years",
            ),
        ] {
            let e = check(args, handler()).unwrap_err();
            assert!(e.contains(expected), "{e}");
        }
    }

    #[test]
    fn leases() {
        let leased = || -> ItemFn {
            parse_quote!(
                async fn f(#[tenant] c: Caller, lease: &mut Lease) {}
            )
        };
        let c = check(
            quote!(operation = "x", retention = "1h", lease = "30s"),
            leased(),
        )
        .unwrap();
        assert_eq!(c.lease, Some(Duration::from_secs(30)));
        let e = check(
            quote!(operation = "x", retention = "1h", lease = "50ms"),
            leased(),
        )
        .unwrap_err();
        assert!(e.contains("between 100ms and 100 years"), "{e}");
        let e = check(
            quote!(
                operation = "x",
                retention = "1h",
                lease = "30s",
                lease_ceiling = "10s"
            ),
            leased(),
        )
        .unwrap_err();
        assert!(e.contains("shorter than `lease`"), "{e}");
        check(
            quote!(
                operation = "x",
                retention = "1h",
                lease = "30s",
                lease_ceiling = "30s"
            ),
            leased(),
        )
        .unwrap();
    }

    #[test]
    fn operation_names() {
        for bad in ["", "create order", "création"] {
            assert!(
                check(quote!(operation = #bad, retention = "1h"), handler()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn tenants_and_transactions() {
        let two = parse_quote!(
            async fn f(#[tenant] a: A, #[tenant] b: B, tx: &mut Tx) {}
        );
        let e = check(quote!(operation = "x", retention = "1h"), two).unwrap_err();
        assert!(e.contains("only one parameter"), "{e}");
        let both = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx) {}
        );
        let e = check(
            quote!(operation = "x", retention = "1h", single_tenant),
            both,
        )
        .unwrap_err();
        assert!(e.contains("contradicts"), "{e}");
        let single = parse_quote!(
            async fn f(tx: &mut Tx) {}
        );
        let c = check(
            quote!(operation = "x", retention = "1h", single_tenant),
            single,
        )
        .unwrap();
        assert!(matches!(c.tenant, Tenant::Single));
    }

    #[test]
    fn body_shapes() {
        for (func, param) in [
            (
                parse_quote!(
                    async fn f(#[tenant] a: A, tx: &mut Tx, b: ValidJson<B>) {}
                ),
                2,
            ),
            (
                parse_quote!(
                    async fn f(#[tenant] a: A, tx: &mut Tx, #[body] b: Checked<B>) {}
                ),
                2,
            ),
            (
                parse_quote!(
                    async fn f(#[tenant] a: A, tx: &mut Tx, b: Option<Json<B>>) {}
                ),
                2,
            ),
            (
                parse_quote!(
                    async fn f(#[tenant] a: A, tx: &mut Tx, Json(b): Payload) {}
                ),
                2,
            ),
        ] {
            let c = check(quote!(operation = "x", retention = "1h"), func).unwrap();
            assert!(matches!(c.body, BodyPrint::Whole(p) if p == param));
            assert_eq!(c.request_before, Some(param));
            assert_eq!(c.body_result, None);
        }
        let result: ItemFn = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, b: Result<Json<B>, JsonRejection>) {}
        );
        let c = check(quote!(operation = "x", retention = "1h"), result).unwrap();
        assert_eq!(c.body_result, Some(2));
        // An alias: its type decides.
        let alias: ItemFn = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, b: Payload) {}
        );
        let c = check(quote!(operation = "x", retention = "1h"), alias).unwrap();
        assert!(matches!(c.body, BodyPrint::Probe(2)));
        // A known parts extractor last is not a body.
        let parts: ItemFn = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, p: Path<i64>) {}
        );
        let c = check(quote!(operation = "x", retention = "1h"), parts).unwrap();
        assert!(matches!(c.body, BodyPrint::None));
        assert_eq!(c.request_before, None);
    }

    #[test]
    fn body_rules() {
        let not_last = parse_quote!(
            async fn f(#[tenant] a: A, Json(b): Json<B>, tx: &mut Tx, s: State<S>) {}
        );
        let e = check(quote!(operation = "x", retention = "1h"), not_last).unwrap_err();
        assert!(e.contains("must be the last parameter"), "{e}");
        let two = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, s: String, b: Bytes) {}
        );
        let e = check(quote!(operation = "x", retention = "1h"), two).unwrap_err();
        assert!(e.contains("second body extractor"), "{e}");
        let none = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx) {}
        );
        let e = check(
            quote!(operation = "x", retention = "1h", fingerprint(body)),
            none,
        )
        .unwrap_err();
        assert!(e.contains("needs a body"), "{e}");
        let e = check(
            quote!(
                operation = "x",
                retention = "1h",
                fingerprint(body, body.sku)
            ),
            handler(),
        )
        .unwrap_err();
        assert!(e.contains("already fingerprints"), "{e}");
        let e = check(
            quote!(
                operation = "x",
                retention = "1h",
                fingerprint(header = "x-a")
            ),
            handler(),
        )
        .unwrap_err();
        assert!(e.contains("leaves the request body out"), "{e}");
        assert!(
            e.contains("fingerprint(header = \"x-a\", ignore_body)"),
            "{e}"
        );
        let c = check(
            quote!(
                operation = "x",
                retention = "1h",
                fingerprint(header = "x-a", ignore_body)
            ),
            handler(),
        )
        .unwrap();
        assert!(matches!(c.body, BodyPrint::None));
        let stream: ItemFn = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, m: Multipart) {}
        );
        let e = check(quote!(operation = "x", retention = "1h"), stream).unwrap_err();
        assert!(e.contains("is a stream"), "{e}");
    }

    #[test]
    fn function_shapes() {
        let e = check(
            quote!(operation = "x", retention = "1h"),
            parse_quote!(
                async unsafe fn f<'a>(#[tenant] a: A, tx: &mut Tx) {}
            ),
        )
        .unwrap_err();
        assert!(e.contains("cannot be `unsafe fn`"), "{e}");
        assert!(e.contains("lifetime parameters"), "{e}");
        assert!(!e.contains("generic handlers"), "{e}");
    }
}
