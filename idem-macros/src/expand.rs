//! Expand: a checked [`Config`] and the user's function into an ordinary Axum
//! handler whose body is one call of `__private::run`.
//!
//! ```text
//! async fn name(<extractors>, __idem_request: IdemRequest, <body extractor>) -> Response {
//!     async fn __idem_inner(<the user's parameters>) -> <the user's return type> { <the user's body> }
//!     static __IDEM_SPEC: OperationSpec = ...;
//!     let tenant = tenant_id(&<tenant parameter>);
//!     let fingerprint = request.fingerprint(&SPEC, &tenant).body(...)...;
//!     run(request, &SPEC, tenant, fingerprint, handler(move |tx| Box::pin(async move {
//!         outcome(__idem_inner(<parameters>, tx).await)
//!     }))).await
//! }
//! ```

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, ReturnType};

use crate::validate::{BodyPrint, Config, Tenant};

/// The attribute's entry point over `proc_macro2` tokens.
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut func: ItemFn = match syn::parse2(item.clone()) {
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
    let mut errors = darling::Error::accumulator();
    let config = errors
        .handle(crate::parse::parse_args(args))
        .and_then(|raw| crate::validate::validate(raw, &func, &mut errors));
    match (errors.finish(), config) {
        (Ok(()), Some(config)) => expand(config, func),
        (result, _) => {
            // Re-emit the function as written, so the rest of the crate still
            // type-checks and IDEs keep working, with every error beside it.
            strip_marker_attrs(&mut func);
            let errors = result.err().map(|e| e.write_errors());
            quote!(#func #errors)
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

fn expand(config: Config, mut func: ItemFn) -> TokenStream {
    let krate = &config.krate;
    let rt = quote!(#krate::__private);

    // The inner function keeps the user's signature and body unchanged.
    let mut inner = func.clone();
    strip_marker_attrs(&mut inner);
    inner.sig.ident = format_ident!("__idem_inner");
    inner.vis = syn::Visibility::Inherited;
    inner
        .attrs
        .retain(|a| a.path().is_ident("allow") || a.path().is_ident("expect"));

    // The transaction (or lease) parameter's type picks the backend: `Tx` and
    // `Lease` are PostgreSQL, `Tx<Sqlite>` and `Lease<Sqlite>` SQLite.
    let handle_elem = match func.sig.inputs.iter().nth(config.tx) {
        Some(FnArg::Typed(t)) => match &*t.ty {
            syn::Type::Reference(r) => Some((*r.elem).clone()),
            _ => None,
        },
        _ => None,
    };
    let handle_trait = if config.lease.is_some() {
        quote!(LeaseHandle)
    } else {
        quote!(TxHandle)
    };
    let db = handle_elem
        .as_ref()
        .map(|elem| respan(quote!(<#elem as #rt::#handle_trait>::Db), elem.span()));
    let request_ty = match &db {
        Some(db) => quote!(#rt::IdemRequest<#db>),
        None => quote!(#rt::IdemRequest),
    };
    let mut outer_params = Vec::new();
    let mut call_args = Vec::new();
    let mut tenant_expr = None;
    let mut body_expr = None;
    let request = format_ident!("__idem_request");
    let insert_request_at = config.body_param.unwrap_or(usize::MAX);
    for (i, arg) in func.sig.inputs.iter().enumerate() {
        let FnArg::Typed(arg) = arg else { continue };
        if i == config.tx {
            // A parameter of another `&mut` type fails to type-check here, at its type.
            let handle = if config.lease.is_some() {
                quote!(__idem_lease)
            } else {
                quote!(__idem_tx)
            };
            call_args.push(respan(handle, arg.ty.span()));
            continue;
        }
        if i == insert_request_at {
            outer_params.push(quote!(#request: #request_ty));
        }
        let name = format_ident!("__idem_arg{}", i);
        let ty = &arg.ty;
        outer_params.push(quote!(#name: #ty));
        call_args.push(quote!(#name));
        if matches!(config.tenant, Tenant::Param(t) if t == i) {
            // Spanned at the user's type, so "does not identify a tenant" points there.
            tenant_expr = Some(respan(quote!(#rt::tenant_id(&#name)), ty.span()));
        }
        if Some(i) == config.body_param {
            body_expr = Some((name, ty.span()));
        }
    }
    if insert_request_at == usize::MAX {
        outer_params.push(quote!(#request: #request_ty));
    }
    let tenant_expr = match config.tenant {
        Tenant::Single => quote!(#rt::single_tenant()),
        Tenant::Param(_) => tenant_expr.unwrap_or_else(|| quote!(#rt::single_tenant())),
    };

    let body_steps = match (&config.body, &body_expr) {
        (BodyPrint::Whole, Some((name, span))) => {
            let call = respan(quote!(#rt::fingerprint_body(__idem_fp, &#name)), *span);
            quote!(.and_then(|__idem_fp| #call))
        }
        (BodyPrint::Fields(fields), Some((name, _))) => {
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
                quote_spanned!(*span=> .and_then(|__idem_fp| __idem_fp.body_field(#path, &#rt::body_value(&#name) #(.#members)*)))
            });
            quote!(#(#steps)*)
        }
        _ => quote!(),
    };

    let operation = &config.operation;
    let retention = duration_tokens(&rt, config.retention);
    let in_flight_wait = match config.in_flight_wait {
        Some(d) => {
            let d = duration_tokens(&rt, d);
            quote!(::core::option::Option::Some(#d))
        }
        None => quote!(::core::option::Option::None),
    };
    let opt_duration = |d: Option<std::time::Duration>| match d {
        Some(d) => {
            let d = duration_tokens(&rt, d);
            quote!(::core::option::Option::Some(#d))
        }
        None => quote!(::core::option::Option::None),
    };
    let lease = opt_duration(config.lease);
    let lease_ceiling = opt_duration(config.lease_ceiling);
    let (run_fn, boxer, handle_ty, handle) = match (&handle_elem, config.lease.is_some()) {
        (Some(elem), true) => (
            quote!(run_leased),
            quote!(leased_handler),
            quote!(#rt::Lease<<#elem as #rt::LeaseHandle>::Db>),
            quote!(__idem_lease),
        ),
        (None, true) => (
            quote!(run_leased),
            quote!(leased_handler),
            quote!(#rt::Lease),
            quote!(__idem_lease),
        ),
        (Some(elem), false) => (
            quote!(run),
            quote!(handler),
            quote!(#rt::Tx<<#elem as #rt::TxHandle>::Db>),
            quote!(__idem_tx),
        ),
        (None, false) => (
            quote!(run),
            quote!(handler),
            quote!(#rt::Tx),
            quote!(__idem_tx),
        ),
    };
    let headers = &config.headers;
    let output_span = match &func.sig.output {
        ReturnType::Default => func.sig.ident.span(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    let outcome = quote_spanned!(output_span=>
        (&#rt::KindProbe(&__idem_out)).__idem_kind().outcome(__idem_out)
    );

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
        };
        let __idem_tenant = #tenant_expr;
        let __idem_fingerprint = #rt::start_fingerprint(&#request, &__IDEM_SPEC, &__idem_tenant) #body_steps;
        #rt::#run_fn(
            #request,
            &__IDEM_SPEC,
            __idem_tenant,
            __idem_fingerprint,
            #rt::#boxer(move |#handle: &mut #handle_ty| {
                #rt::Box::pin(async move {
                    let __idem_out = __idem_inner(#(#call_args),*).await;
                    #[allow(unused_imports)]
                    use #rt::{ViaPlain as _, ViaResult as _};
                    #outcome
                })
            }),
        )
        .await
    };
    *func.block = syn::parse_quote!({ #body });
    quote!(#func)
}

/// Gives every token the span of the user's code it stands for, so that rustc's
/// trait errors point at the user's type rather than at the attribute.
fn respan(tokens: TokenStream, span: proc_macro2::Span) -> TokenStream {
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

fn duration_tokens(rt: &TokenStream, d: std::time::Duration) -> TokenStream {
    let secs = d.as_secs();
    let nanos = d.subsec_nanos();
    quote!(#rt::Duration::new(#secs, #nanos))
}
