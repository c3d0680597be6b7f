//! Validate: the written arguments and the handler's signature, checked together
//! into a [`Config`] that expansion can trust. Every error is collected, each at
//! its own token, so the user sees all of them at once.

use std::time::Duration;

use darling::util::SpannedValue;
use proc_macro2::Span;
use syn::{FnArg, ItemFn, Type};

use crate::parse::RawArgs;

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
    /// Index of the body extractor parameter, if the handler has one.
    pub body_param: Option<usize>,
    pub krate: syn::Path,
}

/// What of the body goes into the fingerprint.
#[derive(Debug)]
pub enum BodyPrint {
    None,
    Whole,
    /// Field paths (segments) and the span of the attribute token they came from.
    Fields(Vec<(Vec<String>, Span)>),
}

/// Where the tenant comes from.
#[derive(Debug)]
pub enum Tenant {
    Param(usize),
    Single,
}

/// Types that read the request body (axum's `FromRequest`, not `FromRequestParts`).
/// Besides these, any type whose name ends in `Json` or `Form` (`ValidJson`), and
/// any parameter marked `#[body]`, is taken as the body extractor.
const BODY_EXTRACTORS: &[&str] = &[
    "Json",
    "Form",
    "Bytes",
    "String",
    "Body",
    "Request",
    "Multipart",
    "RawForm",
];

/// The longest in-flight wait accepted: a waiting request holds a connection.
const MAX_IN_FLIGHT_WAIT: Duration = Duration::from_secs(60);

/// Is this parameter marked `#[tenant]`?
pub fn tenant_attr(arg: &syn::PatType) -> Option<&syn::Attribute> {
    arg.attrs.iter().find(|a| a.path().is_ident("tenant"))
}

/// Checks everything. `errors` collects what is wrong; the result is `None` when
/// anything was.
pub fn validate(
    args: RawArgs,
    func: &ItemFn,
    errors: &mut darling::error::Accumulator,
) -> Option<Config> {
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        errors.push(
            darling::Error::custom(format!(
                "`#[idempotent]` handlers must be async: write `async fn {}`",
                sig.ident
            ))
            .with_span(&sig.fn_token),
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.push(
            darling::Error::custom(
                "generic handlers are not supported by `#[idempotent]`: the fingerprint and the stored outcome need concrete types; write one handler per concrete type",
            )
            .with_span(&sig.generics),
        );
    }

    let operation = check_operation(args.operation, errors);
    let retention = match args.retention {
        None => {
            errors.push(darling::Error::custom(
                "missing `retention`: add `retention = \"24h\"`, how long keys and outcomes are kept (it changes correctness, so it has no default)",
            ));
            None
        }
        Some(r) => check_duration("retention", &r, false, None, errors),
    };
    let in_flight_wait = args
        .in_flight_wait
        .and_then(|w| check_duration("in_flight_wait", &w, true, Some(MAX_IN_FLIGHT_WAIT), errors));
    let lease = args
        .lease
        .and_then(|l| check_duration("lease", &l, false, None, errors));
    let lease_ceiling = match args.lease_ceiling {
        Some(c) if lease.is_none() => {
            errors.push(
                darling::Error::custom("`lease_ceiling` needs `lease = \"...\"`: it bounds the renewal of a leased handler")
                    .with_span(&c.span()),
            );
            None
        }
        Some(c) => check_duration("lease_ceiling", &c, false, None, errors),
        None => None,
    };
    if in_flight_wait.is_some() && lease.is_some() {
        errors.push(darling::Error::custom(
            "`in_flight_wait` applies to the transactional mode; a leased duplicate is answered at once with `Retry-After` until the lease lapses: remove `in_flight_wait`",
        ));
    }
    let handle = if lease.is_some() {
        "lease: &mut idem_runtime::Lease"
    } else {
        "tx: &mut idem_runtime::Tx"
    };
    let krate = match args.krate {
        None => syn::parse_quote!(::idem_runtime),
        Some(k) => match syn::parse_str::<syn::Path>(k.as_str()) {
            Ok(p) => p,
            Err(_) => {
                errors.push(
                    darling::Error::custom(format!(
                        "`crate` must be a path such as \"::idem_runtime\" or \"my_crate::idem\", not {:?}",
                        k.as_str()
                    ))
                    .with_span(&k.span()),
                );
                syn::parse_quote!(::idem_runtime)
            }
        },
    };

    // The parameters: tenant, transaction, body.
    let mut tenant = None;
    let mut tx = None;
    let mut body_params: Vec<(usize, &Type)> = Vec::new();
    for (i, arg) in sig.inputs.iter().enumerate() {
        let arg = match arg {
            FnArg::Receiver(r) => {
                errors.push(
                    darling::Error::custom(
                        "`#[idempotent]` cannot take `self`: make the handler a free `async fn` and reach shared data through `State`",
                    )
                    .with_span(&r.self_token),
                );
                continue;
            }
            FnArg::Typed(t) => t,
        };
        for attr in &arg.attrs {
            if attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr") {
                errors.push(
                    darling::Error::custom(
                        "conditional parameters are not supported by `#[idempotent]`: write one handler per configuration",
                    )
                    .with_span(attr.path()),
                );
            }
        }
        if let Type::ImplTrait(t) = &*arg.ty {
            errors.push(
                darling::Error::custom(
                    "`impl Trait` parameters are generics, which `#[idempotent]` does not support: name the concrete extractor type",
                )
                .with_span(&t.impl_token),
            );
        }
        if let Type::Reference(r) = &*arg.ty {
            if r.mutability.is_none() {
                errors.push(
                    darling::Error::custom(format!(
                        "take it as `{handle}`; other references cannot be extracted from a request"
                    ))
                    .with_span(&arg.ty),
                );
            } else if tx.is_some() {
                errors.push(
                    darling::Error::custom(format!(
                        "the handler takes two `&mut` parameters: keep one, `{handle}`"
                    ))
                    .with_span(&arg.ty),
                );
            } else {
                tx = Some(i);
            }
            if let Some(attr) = tenant_attr(arg) {
                errors.push(
                    darling::Error::custom("`#[tenant]` marks the parameter that identifies the caller, not the transaction")
                        .with_span(attr.path()),
                );
            }
            continue;
        }
        if let Some(attr) = tenant_attr(arg) {
            if args.single_tenant.is_present() {
                errors.push(
                    darling::Error::custom(
                        "`#[tenant]` contradicts `single_tenant`: keep `#[tenant]` to scope keys by caller, or remove it for a service with one tenant",
                    )
                    .with_span(attr.path()),
                );
            } else if tenant.is_some() {
                errors.push(
                    darling::Error::custom(
                        "only one parameter can be the `#[tenant]`: remove this one or the other",
                    )
                    .with_span(attr),
                );
            } else {
                tenant = Some(Tenant::Param(i));
            }
        }
        if is_body_extractor(&arg.ty) || arg.attrs.iter().any(|a| a.path().is_ident("body")) {
            body_params.push((i, &arg.ty));
        }
    }
    if args.single_tenant.is_present() && tenant.is_none() {
        tenant = Some(Tenant::Single);
    }
    if tenant.is_none() {
        errors.push(
            darling::Error::custom(format!(
                "`{}` has no tenant: mark the parameter that identifies the caller with `#[tenant]` (its type implements `idem_runtime::TenantScope`), or add `single_tenant` to `#[idempotent(...)]` if this service has one tenant",
                sig.ident
            ))
            .with_span(&sig.ident),
        );
    }
    if tx.is_none() {
        let msg = if lease.is_some() {
            format!(
                "`{}` takes no lease: add a parameter `{handle}`; it carries the downstream idempotency key and lets the handler report an uncertain outcome",
                sig.ident
            )
        } else {
            format!(
                "`{}` takes no transaction: add a parameter `{handle}` and write the operation's effects through it, so they commit together with the stored outcome",
                sig.ident
            )
        };
        errors.push(darling::Error::custom(msg).with_span(&sig.ident));
    }
    let last_extractor = sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(_, a)| !matches!(a, FnArg::Typed(t) if matches!(&*t.ty, Type::Reference(_))))
        .map(|(i, _)| i)
        .next_back();
    for (n, (i, ty)) in body_params.iter().enumerate() {
        if n > 0 {
            errors.push(
                darling::Error::custom("a second body extractor: the request body can be read only once; keep one of them")
                    .with_span(ty),
            );
        } else if body_params.len() == 1 && Some(*i) != last_extractor {
            errors.push(
                darling::Error::custom(
                    "the body extractor must be the last parameter: axum reads the body after every other extractor; move this parameter to the end",
                )
                .with_span(ty),
            );
        }
    }
    let body_param = body_params.first().map(|(i, _)| *i);

    let (headers, body) = check_fingerprint(args.fingerprint, body_param, errors);

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
        body_param,
        krate,
    })
}

fn check_operation(
    op: Option<SpannedValue<String>>,
    errors: &mut darling::error::Accumulator,
) -> Option<String> {
    let Some(op) = op else {
        errors.push(darling::Error::custom(
            "missing `operation`: add `operation = \"create-order\"`, the operation's stable name (it scopes the key, so keep it when you rename the handler)",
        ));
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
            errors.push(darling::Error::custom(msg).with_span(&op.span()));
            None
        }
        None => Some(name.to_owned()),
    }
}

fn check_duration(
    what: &str,
    value: &SpannedValue<String>,
    zero_ok: bool,
    max: Option<Duration>,
    errors: &mut darling::error::Accumulator,
) -> Option<Duration> {
    let err = |msg: String| darling::Error::custom(msg).with_span(&value.span());
    match humantime::parse_duration(value.as_str()) {
        Err(e) => {
            errors.push(err(format!(
                "`{what}` is not a duration ({e}): write e.g. \"90s\", \"15m\", \"24h\" or \"7d\""
            )));
            None
        }
        Ok(d) if d.is_zero() && !zero_ok => {
            errors.push(err(format!(
                "`{what}` must be longer than zero: a key that is forgotten at once protects nothing; write e.g. \"24h\""
            )));
            None
        }
        Ok(d) if max.is_some_and(|m| d > m) => {
            errors.push(err(format!(
                "`{what}` is at most {}: a waiting request holds a database connection",
                humantime::format_duration(max.unwrap_or_default())
            )));
            None
        }
        Ok(d) => Some(d),
    }
}

fn check_fingerprint(
    fp: Option<SpannedValue<crate::parse::RawFingerprint>>,
    body_param: Option<usize>,
    errors: &mut darling::error::Accumulator,
) -> (Vec<String>, BodyPrint) {
    let Some(fp) = fp else {
        // Documented default: the whole body when there is one.
        return (
            Vec::new(),
            if body_param.is_some() {
                BodyPrint::Whole
            } else {
                BodyPrint::None
            },
        );
    };
    let fp_span = fp.span();
    let fp = fp.into_inner();
    let mut headers: Vec<String> = Vec::new();
    for h in &fp.header {
        let lower = h.as_str().to_ascii_lowercase();
        let err = |msg: String| darling::Error::custom(msg).with_span(&h.span());
        if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
            errors.push(err(format!(
                "{:?} is not a valid HTTP header name: header names are tokens such as \"x-currency\"",
                h.as_str()
            )));
        } else if lower == "idempotency-key" {
            errors.push(err(
                "the Idempotency-Key is the key itself, not part of the fingerprint: remove this header".into(),
            ));
        } else if headers.contains(&lower) {
            errors.push(err(format!(
                "the header {:?} is listed twice: remove one",
                h.as_str()
            )));
        } else {
            headers.push(lower);
        }
    }
    let body = if fp.body.is_present() && !fp.fields.is_empty() {
        errors.push(
            darling::Error::custom("`body` already fingerprints the whole body: remove either `body` or the `body.<field>` paths")
                .with_span(&fp.body.span()),
        );
        BodyPrint::Whole
    } else if fp.body.is_present() {
        BodyPrint::Whole
    } else if fp.fields.is_empty() {
        BodyPrint::None
    } else {
        let mut fields = Vec::new();
        for f in &fp.fields {
            let segments: Vec<String> = f.as_str().split('.').map(str::to_owned).collect();
            if segments
                .iter()
                .any(|s| syn::parse_str::<syn::Ident>(s).is_err() && s.parse::<u32>().is_err())
            {
                errors.push(
                    darling::Error::custom(format!(
                        "`body.{}` is not a field path: write `body.field` or `body.field.subfield`",
                        f.as_str()
                    ))
                    .with_span(&f.span()),
                );
            } else if fields.iter().any(|(s, _)| s == &segments) {
                errors.push(
                    darling::Error::custom(format!(
                        "`body.{}` is listed twice: remove one",
                        f.as_str()
                    ))
                    .with_span(&f.span()),
                );
            } else {
                fields.push((segments, f.span()));
            }
        }
        BodyPrint::Fields(fields)
    };
    if !matches!(body, BodyPrint::None) && body_param.is_none() {
        errors.push(
            darling::Error::custom(
                "`fingerprint(body...)` needs a body: add a body extractor such as `Json<T>` or `Form<T>` as the last parameter, or remove `body` from `fingerprint(...)`",
            )
            .with_span(&fp_span),
        );
    }
    (headers, body)
}

fn is_body_extractor(ty: &Type) -> bool {
    match ty {
        Type::Path(p) => p.path.segments.last().is_some_and(|s| {
            let name = s.ident.to_string();
            BODY_EXTRACTORS.contains(&name.as_str())
                || name.ends_with("Json")
                || name.ends_with("Form")
        }),
        Type::Paren(p) => is_body_extractor(&p.elem),
        Type::Group(g) => is_body_extractor(&g.elem),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::parse_args;
    use quote::quote;
    use syn::parse_quote;

    fn check(args: proc_macro2::TokenStream, func: ItemFn) -> Result<Config, String> {
        let mut errors = darling::Error::accumulator();
        let raw = parse_args(args).map_err(|e| e.to_string())?;
        let cfg = validate(raw, &func, &mut errors);
        errors.finish().map_err(|e| {
            e.into_iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        })?;
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
        assert!(matches!(c.body, BodyPrint::Whole));
        assert!(matches!(c.tenant, Tenant::Param(0)));
        assert_eq!(c.tx, 1);
        assert_eq!(c.body_param, Some(2));
    }

    #[test]
    fn fingerprint_defaults_to_the_body() {
        let c = check(quote!(operation = "x", retention = "7d"), handler()).unwrap();
        assert!(matches!(c.body, BodyPrint::Whole));
        let c = check(
            quote!(operation = "x", retention = "7d"),
            parse_quote!(
                async fn f(#[tenant] c: Caller, tx: &mut Tx) {}
            ),
        )
        .unwrap();
        assert!(matches!(c.body, BodyPrint::None));
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
            "longer than zero",
            "not a valid HTTP header name",
            "has no tenant",
            "takes no transaction",
        ] {
            assert!(e.contains(expected), "missing {expected:?} in\n{e}");
        }
    }

    #[test]
    fn durations() {
        for (text, secs) in [("90s", 90), ("15m", 900), ("24h", 86400), ("7d", 604800)] {
            let c = check(quote!(operation = "x", retention = #text), handler()).unwrap();
            assert_eq!(c.retention, Duration::from_secs(secs));
        }
        let e = check(quote!(operation = "x", retention = "soon"), handler()).unwrap_err();
        assert!(e.contains("not a duration"), "{e}");
        let e = check(
            quote!(operation = "x", retention = "1h", in_flight_wait = "2h"),
            handler(),
        )
        .unwrap_err();
        assert!(e.contains("at most"), "{e}");
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
    fn custom_body_extractors() {
        let by_name = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, b: ValidJson<B>) {}
        );
        let c = check(quote!(operation = "x", retention = "1h"), by_name).unwrap();
        assert_eq!(c.body_param, Some(2));
        let marked = parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx, #[body] b: Checked<B>) {}
        );
        let c = check(quote!(operation = "x", retention = "1h"), marked).unwrap();
        assert_eq!(c.body_param, Some(2));
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
    }
}
