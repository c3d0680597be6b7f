//! The checks through `validate`: what each accepts, and the errors it
//! reports.

use super::*;
use crate::parse::parse_args;
use quote::quote;
use syn::parse_quote;

fn check(args: proc_macro2::TokenStream, func: ItemFn) -> Result<Config, String> {
    let mut errors = Errors::default();
    let (raw, written) = parse_args(args, &mut errors);
    let cfg = validate(raw, &written, &func, &mut errors);
    if !errors.is_empty() {
        return Err(errors.messages().join("\n"));
    }
    Ok(cfg.unwrap())
}

fn handler() -> ItemFn {
    parse_quote! {
        async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> Response { todo!() }
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
            async fn f(#[tenant] c: Caller, tx: &mut Tx<Postgres>) {}
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
            async fn f(#[tenant] c: Caller, lease: &mut Lease<Postgres>) {}
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

/// `accepted` is leased mode's: without `lease` it is refused, whatever the
/// handle; with it, the configuration says so.
#[test]
fn accepted_needs_a_lease() {
    let leased = || -> ItemFn {
        parse_quote!(
            async fn f(#[tenant] c: Caller, lease: &mut Lease<Postgres>) {}
        )
    };
    let c = check(
        quote!(operation = "x", retention = "1h", lease = "6s", accepted),
        leased(),
    )
    .unwrap();
    assert!(c.accepted);
    let c = check(
        quote!(operation = "x", retention = "1h", lease = "6s"),
        leased(),
    )
    .unwrap();
    assert!(!c.accepted);
    let e = check(
        quote!(operation = "x", retention = "1h", accepted),
        handler(),
    )
    .unwrap_err();
    assert!(e.contains("`accepted` needs `lease"), "{e}");
    let e = check(
        quote!(operation = "x", retention = "1h", accepted = true),
        leased(),
    )
    .unwrap_err();
    assert!(e.contains("`accepted` is a flag"), "{e}");
}

#[test]
fn operation_names() {
    for bad in ["", "create order", "création"] {
        assert!(
            check(quote!(operation = #bad, retention = "1h"), handler()).is_err(),
            "{bad}"
        );
    }
    // A long operation's name is a segment of its resource's URL: no empty or
    // dot segment there. Elsewhere such a name is only a scope.
    let leased = || -> ItemFn {
        parse_quote!(
            async fn f(#[tenant] a: A, lease: &mut Lease<Postgres>) {}
        )
    };
    for path_like in [".", "..", "/exports", "exports/", "a//b", "a/./b"] {
        let long = quote!(operation = #path_like, retention = "1h", lease = "6s", accepted);
        assert!(check(long, leased()).is_err(), "{path_like}");
        assert!(
            check(quote!(operation = #path_like, retention = "1h"), handler()).is_ok(),
            "{path_like}"
        );
    }
    for good in ["create-order", "exports/create", "v1.orders:create", "a.b"] {
        let long = quote!(operation = #good, retention = "1h", lease = "6s", accepted);
        assert!(check(long, leased()).is_ok(), "{good}");
    }
}

#[test]
fn tenants_and_transactions() {
    let two = parse_quote!(
        async fn f(#[tenant] a: A, #[tenant] b: B, tx: &mut Tx<Postgres>) {}
    );
    let e = check(quote!(operation = "x", retention = "1h"), two).unwrap_err();
    assert!(e.contains("only one parameter"), "{e}");
    let both = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>) {}
    );
    let e = check(
        quote!(operation = "x", retention = "1h", single_tenant),
        both,
    )
    .unwrap_err();
    assert!(e.contains("contradicts"), "{e}");
    let single = parse_quote!(
        async fn f(tx: &mut Tx<Postgres>) {}
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
                async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, b: ValidJson<B>) {}
            ),
            2,
        ),
        (
            parse_quote!(
                async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, #[body] b: Checked<B>) {}
            ),
            2,
        ),
        (
            parse_quote!(
                async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, b: Option<Json<B>>) {}
            ),
            2,
        ),
        (
            parse_quote!(
                async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, Json(b): Payload) {}
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
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, b: Result<Json<B>, JsonRejection>) {}
    );
    let c = check(quote!(operation = "x", retention = "1h"), result).unwrap();
    assert_eq!(c.body_result, Some(2));
    // An alias: its type decides.
    let alias: ItemFn = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, b: Payload) {}
    );
    let c = check(quote!(operation = "x", retention = "1h"), alias).unwrap();
    assert!(matches!(c.body, BodyPrint::Probe(2)));
    // Named by `fingerprint(body)`: still probed, and a parts extractor refused.
    let c = check(
        quote!(operation = "x", retention = "1h", fingerprint(body)),
        parse_quote!(
            async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, b: Payload) {}
        ),
    )
    .unwrap();
    assert!(matches!(c.body, BodyPrint::ProbeNamed(2)));
    // A known parts extractor last is not a body.
    let parts: ItemFn = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, p: Path<i64>) {}
    );
    let c = check(quote!(operation = "x", retention = "1h"), parts).unwrap();
    assert!(matches!(c.body, BodyPrint::None));
    assert_eq!(c.request_before, None);
}

#[test]
fn body_rules() {
    let not_last = parse_quote!(
        async fn f(#[tenant] a: A, Json(b): Json<B>, tx: &mut Tx<Postgres>, s: State<S>) {}
    );
    let e = check(quote!(operation = "x", retention = "1h"), not_last).unwrap_err();
    assert!(e.contains("must be the last parameter"), "{e}");
    let two = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, s: String, b: Bytes) {}
    );
    let e = check(quote!(operation = "x", retention = "1h"), two).unwrap_err();
    assert!(e.contains("second body extractor"), "{e}");
    let none = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>) {}
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
        async fn f(#[tenant] a: A, tx: &mut Tx<Postgres>, m: Multipart) {}
    );
    let e = check(quote!(operation = "x", retention = "1h"), stream).unwrap_err();
    assert!(e.contains("is a stream"), "{e}");
}

#[test]
fn function_shapes() {
    let e = check(
        quote!(operation = "x", retention = "1h"),
        parse_quote!(
            async unsafe fn f<'a>(#[tenant] a: A, tx: &mut Tx<Postgres>) {}
        ),
    )
    .unwrap_err();
    assert!(e.contains("cannot be `unsafe fn`"), "{e}");
    assert!(e.contains("lifetime parameters"), "{e}");
    assert!(!e.contains("generic handlers"), "{e}");
}

#[test]
fn a_bare_handle_is_refused_with_the_databases_to_name() {
    let bare_tx = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut Tx) {}
    );
    let e = check(quote!(operation = "x", retention = "1h"), bare_tx).unwrap_err();
    assert!(
        e.contains("`&mut Tx<Postgres>`, `&mut Tx<Sqlite>` or `&mut Tx<MySql>`"),
        "{e}"
    );
    assert!(
        !e.contains("takes no transaction"),
        "one error, not two: {e}"
    );
    let bare_lease = parse_quote!(
        async fn f(#[tenant] a: A, lease: &mut idem_runtime::Lease) {}
    );
    let e = check(
        quote!(operation = "x", retention = "1h", lease = "30s"),
        bare_lease,
    )
    .unwrap_err();
    assert!(e.contains("`&mut Lease<Redis>`"), "{e}");
    let named = parse_quote!(
        async fn f(#[tenant] a: A, tx: &mut idem_runtime::Tx<sqlx::MySql>) {}
    );
    assert!(check(quote!(operation = "x", retention = "1h"), named).is_ok());
}
