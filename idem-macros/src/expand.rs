//! Expand: a checked [`Config`] and the user's function into an ordinary Axum
//! handler whose body is one call of `__private::run` (leased mode:
//! `__private::run_leased`, with `leased_handler_for`).
//!
//! ```text
//! /// <the user's docs, then a section on the generated signature>
//! async fn name(<extractors>, idempotency: IdemRequest<Db>, <body extractor>) -> Response {
//!     async fn __idem_inner(<the user's parameters>) -> <the user's return type> { <the user's body> }
//!     static __IDEM_SPEC: OperationSpec = ...;
//!     __idem_openapi!("name", &__IDEM_SPEC); // registers the handler (feature `openapi`)
//!     <a body extractor's rejection (`Result<B, B::Rejection>`) is answered here>
//!     let tenant = tenant_id::<Tenant>(&tenant_param);
//!     let fingerprint = start_fingerprint(&idempotency, &SPEC, &tenant).and_then(<body>);
//!     run(idempotency, &SPEC, tenant, fingerprint, handler_for(&idempotency, move |tx| Box::pin(async move {
//!         outcome(__idem_inner(<parameters>, tx).await) // from_result or ok, by KindProbe
//!     }))).await
//! }
//! ```
//!
//! The outer parameters keep the user's names where a pattern binds one name
//! (`Json(cmd)` becomes `cmd: Json<NewOrder>`). Types are emitted with the user's
//! own tokens, so rustc's errors underline the whole type.
//!
//! When anything is wrong, the output is the errors, a stub with the handler's name
//! that axum accepts (`async fn name() {}`), so that mounting it adds no second
//! error, and the function as written under a hidden name, so that its body is
//! still checked and its imports still used.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::{FnArg, ItemFn, Pat, ReturnType};

use crate::errors::Errors;
use crate::validate::{BodyPrint, Config, Tenant, is_idempotent_attr};

/// The attribute's entry point over `proc_macro2` tokens.
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            let msg = syn::Error::new(
                e.span(),
                "`#[idempotent]` goes on an `async fn` Axum handler",
            )
            .to_compile_error();
            return quote!(#item #msg);
        }
    };
    let mut errors = Errors::default();
    let (raw, written) = crate::parse::parse_args(args, &mut errors);
    let config = crate::validate::validate(raw, &written, &func, &mut errors);
    match config {
        Some(config) if errors.is_empty() => expand(config, func),
        _ => refused(func, &errors),
    }
}

/// The errors, a stub the router accepts, and the function as written.
fn refused(func: ItemFn, errors: &Errors) -> TokenStream {
    let errors = errors.to_compile_errors();
    let ItemFn {
        attrs, vis, sig, ..
    } = &func;
    let attrs = attrs.iter().filter(|a| !is_idempotent_attr(a));
    let name = &sig.ident;
    let stub = quote! {
        #(#attrs)*
        #vis async fn #name() {}
    };
    let has_receiver = sig.inputs.iter().any(|a| matches!(a, FnArg::Receiver(_)));
    let original = if has_receiver {
        // Outside an `impl`, `self` would be one more error.
        quote!()
    } else {
        let mut original = func.clone();
        strip_marker_attrs(&mut original);
        name_a_bare_handles_database(&mut original);
        original.attrs.retain(|a| {
            !is_idempotent_attr(a) && (a.path().is_ident("allow") || a.path().is_ident("expect"))
        });
        original.sig.ident = format_ident!("__idem_unchecked_{}", name);
        original.sig.abi = None;
        original.sig.constness = None;
        original.vis = syn::Visibility::Inherited;
        quote! {
            #[doc(hidden)]
            #[allow(dead_code, non_snake_case, unused_variables, clippy::all)]
            #original
        }
    };
    quote!(#errors #stub #original)
}

/// A bare `Tx` or `Lease`, already refused with the databases to name, gets one
/// in the copy of the function, so that rustc does not report it a second time
/// (a missing generic argument).
fn name_a_bare_handles_database(func: &mut ItemFn) {
    for arg in func.sig.inputs.iter_mut() {
        let FnArg::Typed(t) = arg else { continue };
        let syn::Type::Reference(r) = &mut *t.ty else {
            continue;
        };
        let syn::Type::Path(p) = &mut *r.elem else {
            continue;
        };
        if let Some(last) = p.path.segments.last_mut()
            && (last.ident == "Tx" || last.ident == "Lease")
            && last.arguments.is_none()
        {
            last.arguments = syn::PathArguments::AngleBracketed(syn::parse_quote!(
                <::idem_runtime::__private::AnyBackend>
            ));
        }
    }
}

fn strip_marker_attrs(func: &mut ItemFn) {
    for arg in func.sig.inputs.iter_mut() {
        if let FnArg::Typed(t) = arg {
            t.attrs
                .retain(|a| !a.path().is_ident("tenant") && !a.path().is_ident("body"));
        }
    }
}

/// The names bound by a pattern, in order.
fn bindings(pat: &Pat, out: &mut Vec<syn::Ident>) {
    match pat {
        Pat::Ident(p) => {
            out.push(p.ident.clone());
            if let Some((_, sub)) = &p.subpat {
                bindings(sub, out);
            }
        }
        Pat::TupleStruct(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Tuple(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bindings(&f.pat, out)),
        Pat::Reference(p) => bindings(&p.pat, out),
        Pat::Paren(p) => bindings(&p.pat, out),
        Pat::Slice(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Type(p) => bindings(&p.pat, out),
        _ => {}
    }
}

/// The outer parameter's name: the one name the user's pattern binds, else the
/// type's name in snake case, else `argN`; never one taken already.
fn param_name(arg: &syn::PatType, i: usize, taken: &mut Vec<String>) -> syn::Ident {
    let mut bound = Vec::new();
    bindings(&arg.pat, &mut bound);
    let from_pattern = match bound.as_slice() {
        // A capitalised "binding" may be a constant or a unit struct.
        [one]
            if one
                .to_string()
                .starts_with(|c: char| c.is_lowercase() || c == '_') =>
        {
            Some(one.to_string())
        }
        _ => None,
    };
    let from_type = match &*arg.ty {
        syn::Type::Path(p) => p.path.segments.last().map(|s| snake(&s.ident.to_string())),
        _ => None,
    };
    let candidates = from_pattern
        .into_iter()
        .chain(from_type)
        .chain(std::iter::once(format!("arg{i}")));
    for c in candidates {
        let c = c.trim_start_matches('_').to_owned();
        if c.is_empty()
            || c.starts_with("idem")
            || taken.contains(&c)
            || syn::parse_str::<syn::Ident>(&c).is_err()
        {
            continue;
        }
        taken.push(c.clone());
        return syn::Ident::new(&c, Span::call_site());
    }
    let c = format!("__idem_arg{i}");
    taken.push(c.clone());
    syn::Ident::new(&c, Span::call_site())
}

fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

fn expand(config: Config, mut func: ItemFn) -> TokenStream {
    let fn_name = func.sig.ident.clone();
    // `#[utoipa::path]`'s default operation id, which the registration matches.
    let fn_name_str = fn_name.to_string();
    // A runtime under another path is imported once, so that a wrong path is one
    // error (at the import) rather than one per use.
    let rt = match &config.krate {
        None => quote!(::idem_runtime::__private),
        Some(path) => quote!(#path::__private),
    };

    let written = written_signature(&func);

    // The inner function keeps the user's signature and body unchanged.
    let mut inner = func.clone();
    strip_marker_attrs(&mut inner);
    inner.sig.ident = format_ident!("__idem_inner");
    inner.vis = syn::Visibility::Inherited;
    inner
        .attrs
        .retain(|a| a.path().is_ident("allow") || a.path().is_ident("expect"));

    // The transaction (or lease) parameter's type picks the backend: `Tx` and
    // `Lease` are PostgreSQL, `Tx<Sqlite>` and `Lease<Sqlite>` SQLite. It is named
    // once, in the request's type; everything else is inferred from the request.
    let handle_elem = match func.sig.inputs.iter().nth(config.tx) {
        Some(FnArg::Typed(t)) => match &*t.ty {
            syn::Type::Reference(r) => Some((*r.elem).clone()),
            _ => None,
        },
        _ => None,
    };
    let leased = config.lease.is_some();
    let handle_trait = if leased {
        quote!(LeaseHandle)
    } else {
        quote!(TxHandle)
    };
    // The request copies the headers only for an operation that fingerprints some.
    let request_ty = match (&handle_elem, config.headers.is_empty()) {
        (Some(elem), true) => quote!(#rt::IdemRequest<<#elem as #rt::#handle_trait>::Db>),
        (Some(elem), false) => quote!(#rt::IdemRequest<<#elem as #rt::#handle_trait>::Db, true>),
        (None, true) => quote!(#rt::IdemRequest<#rt::__private::AnyBackend>),
        (None, false) => quote!(#rt::IdemRequest<#rt::__private::AnyBackend, true>),
    };

    let mut taken: Vec<String> = Vec::new();
    let names: Vec<Option<syn::Ident>> = func
        .sig
        .inputs
        .iter()
        .enumerate()
        .map(|(i, arg)| match arg {
            FnArg::Typed(t) if i != config.tx => Some(param_name(t, i, &mut taken)),
            _ => None,
        })
        .collect();
    let request = if taken.iter().any(|t| t == "idempotency") {
        format_ident!("__idem_request")
    } else {
        format_ident!("idempotency")
    };
    let typed = |i: usize| match func.sig.inputs.iter().nth(i) {
        Some(FnArg::Typed(t)) => Some(t),
        _ => None,
    };

    let mut outer_params = Vec::new();
    let mut call_args = Vec::new();
    let handle = if leased {
        quote!(__idem_lease)
    } else {
        quote!(__idem_tx)
    };
    for (i, arg) in func.sig.inputs.iter().enumerate() {
        let FnArg::Typed(arg) = arg else { continue };
        if i == config.tx {
            call_args.push(handle.clone());
            continue;
        }
        if Some(i) == config.request_before {
            outer_params.push(quote!(#request: #request_ty));
        }
        let name = names[i].as_ref().expect("every typed parameter is named");
        let ty = &arg.ty;
        outer_params.push(quote!(#name: #ty));
        call_args.push(quote!(#name));
    }
    if config.request_before.is_none() {
        outer_params.push(quote!(#request: #request_ty));
    }
    let name_of = |i: usize| names[i].clone().expect("a typed parameter");
    let ty_of = |i: usize| typed(i).map(|t| t.ty.to_token_stream());

    let tenant_expr = match config.tenant {
        Tenant::Single => quote!(#rt::single_tenant()),
        Tenant::Param(i) => {
            let name = name_of(i);
            let ty = ty_of(i);
            quote!(#rt::tenant_id::<#ty>(&#name))
        }
    };

    // `Result<B, B::Rejection>`: the rejection is the answer, before any claim.
    let reject = config.body_result.map(|i| {
        let name = name_of(i);
        quote! {
            let #name = match #name {
                ::core::result::Result::Err(__idem_rejection) => {
                    return #rt::rejected(__idem_rejection);
                }
                __idem_ok => __idem_ok,
            };
        }
    });

    let mut checks = quote!();
    let body_steps = match &config.body {
        BodyPrint::None => quote!(),
        BodyPrint::Whole(i) => {
            let (name, ty) = (name_of(*i), ty_of(*i));
            quote!(.and_then(|__idem_fp| #rt::fingerprint_body::<#ty>(__idem_fp, &#name)))
        }
        BodyPrint::Fields(i, fields) => {
            let (name, ty) = (name_of(*i), ty_of(*i));
            let steps = fields.iter().map(|(segments, span)| {
                let path = segments.join(".");
                let members = segments.iter().map(|s| match s.parse::<u32>() {
                    Ok(index) => {
                        let idx = syn::Index { index, span: *span };
                        quote!(#idx)
                    }
                    Err(_) => {
                        let id = syn::Ident::new(s, *span);
                        quote!(#id)
                    }
                });
                let access = quote_spanned!(*span=> &__idem_b #(.#members)*);
                quote!(.and_then(|__idem_fp| #rt::body_field::<#ty, _, _>(__idem_fp, #path, &#name, |__idem_b| #access)))
            });
            quote!(#(#steps)*)
        }
        BodyPrint::Probe(i) => {
            let (name, ty) = (name_of(*i), ty_of(*i));
            // A failed bound on the chosen tag's method is reported at the method
            // call: give it the parameter type's span.
            let at = first_span(&ty);
            let probe = quote_spanned!(at=> (&&&#rt::BodyProbe::<#ty>::NEW).__idem_body_kind().default_print(__idem_fp, &#name));
            quote!(.and_then(|__idem_fp| {
                #[allow(unused_imports)]
                use #rt::{ProbeIsBody as _, ProbeNotBody as _, ProbeReadsBody as _};
                #probe
            }))
        }
        BodyPrint::ProbeLeftOut(i) => {
            let ty = ty_of(*i);
            let at = first_span(&ty);
            let probe =
                quote_spanned!(at=> (&&&#rt::BodyProbe::<#ty>::NEW).__idem_body_kind().left_out());
            checks = quote! {
                {
                    #[allow(unused_imports)]
                    use #rt::{ProbeIsBody as _, ProbeNotBody as _, ProbeReadsBody as _};
                    #probe;
                }
            };
            quote!()
        }
    };

    let operation = &config.operation;
    let opt_duration = |d: Option<std::time::Duration>| match d {
        Some(d) => {
            let d = duration_tokens(&rt, d);
            quote!(::core::option::Option::Some(#d))
        }
        None => quote!(::core::option::Option::None),
    };
    let retention = duration_tokens(&rt, config.retention);
    let in_flight_wait = opt_duration(config.in_flight_wait);
    let lease = opt_duration(config.lease);
    let lease_ceiling = opt_duration(config.lease_ceiling);
    let (run_fn, boxer) = if leased {
        (quote!(run_leased), quote!(leased_handler_for))
    } else {
        (quote!(run), quote!(handler_for))
    };
    let headers = &config.headers;
    let accepted = config.accepted;
    // A long operation registers itself for `idem_runtime::operations::router`,
    // which serves the resources of those operations only.
    let register_accepted = if accepted {
        quote!(#rt::__idem_accepted!(&__IDEM_SPEC);)
    } else {
        quote!()
    };
    let output_span = match &func.sig.output {
        ReturnType::Default => func.sig.ident.span(),
        ReturnType::Type(_, ty) => syn::spanned::Spanned::span(&**ty),
    };
    let outcome = quote_spanned!(output_span=>
        (&#rt::KindProbe(&__idem_out)).__idem_kind().outcome(__idem_out)
    );

    let docs = generated_docs(&config, &written, &request);
    func.attrs.retain(|a| !is_idempotent_attr(a));
    func.attrs.extend(docs);
    func.sig.inputs = syn::parse_quote!(#(#outer_params),*);
    func.sig.output = syn::parse_quote!(-> #rt::Response);
    let body: TokenStream = quote! {
        #inner

        static __IDEM_SPEC: #rt::OperationSpec = #rt::OperationSpec {
            operation: #operation,
            retention: #retention,
            in_flight_wait: #in_flight_wait,
            fingerprint_headers: &[#(#headers),*],
            lease: #lease,
            lease_ceiling: #lease_ceiling,
            accepted: #accepted,
        };
        // With idem-runtime's feature `openapi`, the handler registers itself for
        // `idem_runtime::openapi::document` (the route is the router's, and an
        // item beside the handler would not fit an associated function); without
        // it, nothing.
        #rt::__idem_openapi!(#fn_name_str, &__IDEM_SPEC);
        #register_accepted
        #checks
        #reject
        let __idem_tenant = #tenant_expr;
        let __idem_fingerprint = #rt::start_fingerprint(&#request, &__IDEM_SPEC, &__idem_tenant) #body_steps;
        let __idem_handler = #rt::#boxer(&#request, move |#handle| {
            #rt::Box::pin(async move {
                let __idem_out = __idem_inner(#(#call_args),*).await;
                #[allow(unused_imports)]
                use #rt::{ViaPlain as _, ViaResult as _};
                #outcome
            })
        });
        #rt::#run_fn(
            #request,
            &__IDEM_SPEC,
            __idem_tenant,
            __idem_fingerprint,
            __idem_handler,
        )
        .await
    };
    *func.block = syn::parse_quote!({ #body });
    match &config.krate {
        None => quote!(#func),
        Some(path) => {
            // The runtime under a path the attribute cannot check: the handler is
            // emitted through a macro found at that path, so a wrong path is one
            // error (at the macro) and nothing of the handler is checked against
            // it; a stub under the same name, imported by glob, stands in for it
            // then (a defined item shadows a glob import, so when the path is right
            // the stub is never used), and the router stays quiet.
            let stub_mod = format_ident!("__idem_stub_{}", fn_name);
            let vis = &func.vis;
            quote! {
                #[doc(hidden)]
                #[allow(non_snake_case, dead_code)]
                mod #stub_mod {
                    pub async fn #fn_name() {}
                }
                #[doc(hidden)]
                #[allow(unused_imports)]
                #vis use #stub_mod::*;
                #path::__private::__idem_item! { #func }
            }
        }
    }
}

/// The span of a type's first token.
fn first_span(ty: &Option<TokenStream>) -> Span {
    ty.as_ref()
        .and_then(|t| t.clone().into_iter().next())
        .map(|t| t.span())
        .unwrap_or_else(Span::call_site)
}

/// The handler's signature as written, for its documentation.
fn written_signature(func: &ItemFn) -> String {
    let sig = &func.sig;
    let text = quote!(#sig).to_string();
    tidy(&text)
}

/// Token text made readable: `& mut Tx < Sqlite >` becomes `&mut Tx<Sqlite>`.
fn tidy(text: &str) -> String {
    let mut s = text.to_owned();
    for (from, to) in [
        (" :: ", "::"),
        (":: ", "::"),
        (" < ", "<"),
        ("< ", "<"),
        (" <", "<"),
        (" >", ">"),
        (" ,", ","),
        (" : ", ": "),
        ("& mut ", "&mut "),
        ("& ", "&"),
        ("# [", "#["),
        (" ( ", "("),
        ("( ", "("),
        (" (", "("),
        (" )", ")"),
        (" ]", "]"),
        ("[ ", "["),
        ("- >", "->"),
        ("' ", "'"),
    ] {
        while s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s.replace("->", " -> ").replace("  ", " ")
}

fn generated_docs(config: &Config, written: &str, request: &syn::Ident) -> Vec<syn::Attribute> {
    let fingerprint = {
        let mut parts = Vec::new();
        match &config.body {
            BodyPrint::Whole(_) | BodyPrint::Probe(_) => parts.push("the body".to_owned()),
            BodyPrint::Fields(_, f) => parts.push(format!(
                "the body's {}",
                f.iter()
                    .map(|(s, _)| format!("`{}`", s.join(".")))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            BodyPrint::None | BodyPrint::ProbeLeftOut(_) => {}
        }
        for h in &config.headers {
            parts.push(format!("the header `{h}`"));
        }
        if parts.is_empty() {
            "the method and the path".to_owned()
        } else {
            format!("the method, the path, {}", parts.join(", "))
        }
    };
    let mode = match config.lease {
        Some(l) if config.accepted => format!(
            "a long operation in leased mode (lease {}): the request is answered `202 Accepted` at once, with `Location` of the operation's resource (`idem_runtime::operations`), while the handler works on holding a lease, not a transaction; its answer is stored, and replayed to retries once done",
            humantime::format_duration(l)
        ),
        Some(l) => format!(
            "leased mode (lease {}): the handler holds a lease, not a transaction",
            humantime::format_duration(l)
        ),
        None => "the transaction the handler takes is opened by idem and holds the key".to_owned(),
    };
    let lines = [
        String::new(),
        "# Idempotency".to_owned(),
        String::new(),
        format!(
            "Made safe to retry by `#[idempotent]`: operation `{}`, outcomes kept for {}, a request identified by its tenant, {}; {}.",
            config.operation,
            humantime::format_duration(config.retention),
            fingerprint,
            mode
        ),
        String::new(),
        "As written:".to_owned(),
        String::new(),
        "```text".to_owned(),
        written.to_owned(),
        "```".to_owned(),
        String::new(),
        format!(
            "Axum calls the generated signature above: `{request}` reads the `Idempotency-Key` header (a missing or malformed key is answered `400` before anything is claimed); the response is the handler's, or the stored one on a retry (`Idempotent-Replayed: true`)."
        ),
    ];
    lines
        .iter()
        .map(|l| syn::parse_quote!(#[doc = #l]))
        .collect()
}

fn duration_tokens(rt: &TokenStream, d: std::time::Duration) -> TokenStream {
    let secs = d.as_secs();
    let nanos = d.subsec_nanos();
    quote!(#rt::Duration::new(#secs, #nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(args: TokenStream, item: TokenStream) -> String {
        idempotent(args, item).to_string()
    }

    #[test]
    fn the_generated_signature_keeps_names_and_documents_itself() {
        let out = expand_str(
            quote!(
                operation = "create-order",
                retention = "24h",
                fingerprint(body, header = "x-currency")
            ),
            quote! {
                /// Creates an order.
                pub async fn create_order(#[tenant] caller: Caller, State(app): State<App>, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode { todo!() }
            },
        );
        let params = "(caller : Caller , app : State < App > , idempotency : :: idem_runtime :: __private :: IdemRequest";
        assert!(out.contains(params), "{out}");
        assert!(
            out.contains("cmd : Json < NewOrder >) -> :: idem_runtime :: __private :: Response"),
            "{out}"
        );
        assert!(out.contains("\" Creates an order.\""), "{out}");
        assert!(out.contains("\"# Idempotency\""), "{out}");
        assert!(
            out.contains("async fn create_order(#[tenant] caller: Caller, State(app): State<App>, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> StatusCode"),
            "{out}"
        );
        assert!(out.contains("the body, the header `x-currency`"), "{out}");
        // Fingerprinting a header, the request copies the headers.
        assert!(
            out.contains(
                "IdemRequest < < Tx < Postgres > as :: idem_runtime :: __private :: TxHandle > :: Db , true >"
            ),
            "{out}"
        );
    }

    #[test]
    fn the_handler_registers_itself_by_name_for_openapi() {
        let out = expand_str(
            quote!(operation = "create-order", retention = "24h"),
            quote! {
                async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>) -> StatusCode { todo!() }
            },
        );
        assert!(
            out.contains(
                ":: idem_runtime :: __private :: __idem_openapi ! (\"create_order\" , & __IDEM_SPEC)"
            ),
            "{out}"
        );
    }

    #[test]
    fn an_accepted_handler_registers_its_operation_and_says_so() {
        let out = expand_str(
            quote!(
                operation = "create-export",
                retention = "24h",
                lease = "6s",
                accepted
            ),
            quote! {
                async fn create_export(#[tenant] caller: Caller, lease: &mut Lease<Postgres>) -> StatusCode { todo!() }
            },
        );
        assert!(out.contains("accepted : true"), "{out}");
        assert!(
            out.contains(":: idem_runtime :: __private :: __idem_accepted ! (& __IDEM_SPEC)"),
            "{out}"
        );
        assert!(out.contains("202 Accepted"), "{out}");
        let plain = expand_str(
            quote!(
                operation = "create-payment",
                retention = "24h",
                lease = "6s"
            ),
            quote! {
                async fn create_payment(#[tenant] caller: Caller, lease: &mut Lease<Postgres>) -> StatusCode { todo!() }
            },
        );
        assert!(plain.contains("accepted : false"), "{plain}");
        assert!(!plain.contains("__idem_accepted"), "{plain}");
    }

    #[test]
    fn a_refused_handler_becomes_a_stub_beside_the_function_as_written() {
        let out = expand_str(
            quote!(operation = "create-order"),
            quote! {
                /// Creates an order.
                pub async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>) -> StatusCode { todo!() }
            },
        );
        assert!(out.contains("compile_error"), "{out}");
        assert!(out.contains("pub async fn create_order () { }"), "{out}");
        assert!(
            out.contains(
                "async fn __idem_unchecked_create_order (caller : Caller , tx : & mut Tx < Postgres >)"
            ),
            "{out}"
        );
        assert!(!out.contains("# [tenant]"), "{out}");
    }

    #[test]
    fn signatures_are_tidied() {
        assert_eq!(
            tidy(
                "async fn f (# [tenant] c : Caller , tx : & mut Tx < Sqlite > , Json (cmd) : Json < A >) -> Result < Json < B > , E >"
            ),
            "async fn f(#[tenant] c: Caller, tx: &mut Tx<Sqlite>, Json(cmd): Json<A>) -> Result<Json<B>, E>"
        );
    }
}
