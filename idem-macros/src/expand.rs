//! Expand: a checked [`Config`] and the user's function into an ordinary Axum
//! handler whose body is one call of `__private::run`, whose mode the boxed
//! body's handle picks (leased mode boxes it with `leased_handler_for`).
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
use crate::validate::{
    BodyPrint, Config, Tenant, first_type_arg, is_idempotent_attr, is_instrument_attr, last_segment,
};

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
    if crate::validate::is_grpc_method(&func) {
        return checked(
            args,
            func,
            crate::validate::validate_grpc,
            |config, func| crate::expand_grpc::expand(&config, func),
            crate::expand_grpc::refused,
        );
    }
    checked(args, func, crate::validate::validate, expand, refused)
}

/// What a validator makes of the attribute's arguments and the function.
type Validator<C> =
    fn(crate::parse::RawArgs, &crate::parse::Written, &ItemFn, &mut Errors) -> Option<C>;

/// Parses the arguments, checks them with the function, and expands what
/// passed, or answers the errors with `refused`'s stand-in.
fn checked<C>(
    args: TokenStream,
    func: ItemFn,
    validate: Validator<C>,
    expand: impl FnOnce(C, ItemFn) -> TokenStream,
    refused: fn(ItemFn, &Errors, &syn::Path) -> TokenStream,
) -> TokenStream {
    let mut errors = Errors::default();
    let (raw, written) = crate::parse::parse_args(args, &mut errors);
    // What a refused copy names the runtime by: the `crate` given, where it
    // is a path (where not, that is one of the errors).
    let rt = raw
        .krate
        .as_ref()
        .and_then(|k| syn::parse_str::<syn::Path>(k.as_str()).ok())
        .unwrap_or_else(|| syn::parse_quote!(::idem_runtime));
    match validate(raw, &written, &func, &mut errors) {
        Some(config) if errors.is_empty() => expand(config, func),
        _ => refused(func, &errors, &rt),
    }
}

/// The errors, a stub the router accepts, and the function as written.
fn refused(func: ItemFn, errors: &Errors, rt: &syn::Path) -> TokenStream {
    let errors = errors.to_compile_errors();
    let ItemFn {
        attrs, vis, sig, ..
    } = &func;
    // An `#[instrument]` below the attribute is one of its errors: on the
    // stub it would report its own about parameters the stub lacks.
    let attrs = attrs
        .iter()
        .filter(|a| !is_idempotent_attr(a) && !is_instrument_attr(a));
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
        name_a_bare_handles_database(&mut original, rt);
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
fn name_a_bare_handles_database(func: &mut ItemFn, rt: &syn::Path) {
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
                <#rt::__private::AnyBackend>
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
        // `r#type` reads as an identifier, but `Ident::new` refuses the `r#`;
        // a keyword left bare reads as none, and the next candidate is taken.
        let c = c
            .trim_start_matches("r#")
            .trim_start_matches('_')
            .to_owned();
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

/// The handler Axum calls, in steps as the module's documentation shows it:
/// its parameters, then its body (the inner function, the operation's spec,
/// the tenant, the fingerprint, the run), then how it is emitted.
fn expand(config: Config, func: ItemFn) -> TokenStream {
    let handler = Handler::new(&config, &func);
    let (outer_params, call_args) = handler.parameters();
    let block = handler.block(&call_args);
    let docs = generated_docs(&config, &written_signature(&func), &handler.request);
    let rt = handler.rt.clone();
    let mut func = func;
    func.attrs.retain(|a| !is_idempotent_attr(a));
    expectations_allowed(&mut func.attrs);
    func.attrs.extend(docs);
    func.sig.inputs = syn::parse_quote!(#(#outer_params),*);
    func.sig.output = syn::parse_quote!(-> #rt::Response);
    *func.block = syn::parse_quote!({ #block });
    emit(func, &config)
}

/// The user's `#[expect(..)]` holds for the code the user wrote, which is the
/// inner function (it keeps the attribute); on the outer one, the attribute's
/// own code, a lint may or may not fire, so there it is an `allow`: an
/// expectation left there would be reported unfulfilled at the user's line.
fn expectations_allowed(attrs: &mut [syn::Attribute]) {
    for attr in attrs {
        if attr.path().is_ident("expect")
            && let syn::Meta::List(list) = &mut attr.meta
        {
            let span = syn::spanned::Spanned::span(&list.path);
            list.path = syn::Path::from(syn::Ident::new("allow", span));
        }
    }
}

/// What the steps of the expansion share.
struct Handler<'a> {
    config: &'a Config,
    func: &'a ItemFn,
    /// `::idem_runtime::__private`, or under the `crate` path (whose handler
    /// is emitted through a macro at that path, see `emit`, so that a wrong
    /// path is reported there rather than at each use).
    rt: TokenStream,
    /// Each parameter's outer name; `None` for the handle (and a receiver).
    names: Vec<Option<syn::Ident>>,
    /// The idempotency request's parameter: `idempotency`, unless the user's
    /// parameters take that name.
    request: syn::Ident,
    /// What the handle is called in the closure that receives it.
    handle: TokenStream,
}

impl<'a> Handler<'a> {
    fn new(config: &'a Config, func: &'a ItemFn) -> Self {
        let rt = match &config.krate {
            None => quote!(::idem_runtime::__private),
            Some(path) => quote!(#path::__private),
        };
        let mut taken: Vec<String> = Vec::new();
        let names = func
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
        let handle = if config.lease.is_some() {
            quote!(__idem_lease)
        } else {
            quote!(__idem_tx)
        };
        Handler {
            config,
            func,
            rt,
            names,
            request,
            handle,
        }
    }

    fn name_of(&self, i: usize) -> syn::Ident {
        self.names[i].clone().expect("a typed parameter")
    }

    fn ty_of(&self, i: usize) -> Option<TokenStream> {
        match self.func.sig.inputs.iter().nth(i) {
            Some(FnArg::Typed(t)) => Some(t.ty.to_token_stream()),
            _ => None,
        }
    }

    /// The outer parameters (the user's, less the handle, with the request
    /// before the body), and the inner function's arguments.
    fn parameters(&self) -> (Vec<TokenStream>, Vec<TokenStream>) {
        let request = &self.request;
        let request_ty = self.request_type();
        let mut outer_params = Vec::new();
        let mut call_args = Vec::new();
        for (i, arg) in self.func.sig.inputs.iter().enumerate() {
            let FnArg::Typed(arg) = arg else { continue };
            if i == self.config.tx {
                call_args.push(self.handle.clone());
                continue;
            }
            if Some(i) == self.config.request_before {
                outer_params.push(quote!(#request: #request_ty));
            }
            let name = self.names[i]
                .as_ref()
                .expect("every typed parameter is named");
            let ty = &arg.ty;
            outer_params.push(quote!(#name: #ty));
            call_args.push(quote!(#name));
        }
        if self.config.request_before.is_none() {
            outer_params.push(quote!(#request: #request_ty));
        }
        (outer_params, call_args)
    }

    /// The request's type. The transaction (or lease) parameter's type picks the
    /// backend: `Tx` and `Lease` are PostgreSQL, `Tx<Sqlite>` and
    /// `Lease<Sqlite>` SQLite. It is named once, here; everything else is
    /// inferred from the request. The request copies the headers only for an
    /// operation that fingerprints some.
    fn request_type(&self) -> TokenStream {
        let rt = &self.rt;
        let handle_elem = match self.func.sig.inputs.iter().nth(self.config.tx) {
            Some(FnArg::Typed(t)) => match &*t.ty {
                syn::Type::Reference(r) => Some((*r.elem).clone()),
                _ => None,
            },
            _ => None,
        };
        let handle_trait = if self.config.lease.is_some() {
            quote!(LeaseHandle)
        } else {
            quote!(TxHandle)
        };
        match (&handle_elem, self.config.headers.is_empty()) {
            (Some(elem), true) => quote!(#rt::IdemRequest<<#elem as #rt::#handle_trait>::Db>),
            (Some(elem), false) => {
                quote!(#rt::IdemRequest<<#elem as #rt::#handle_trait>::Db, true>)
            }
            (None, true) => quote!(#rt::IdemRequest<#rt::AnyBackend>),
            (None, false) => quote!(#rt::IdemRequest<#rt::AnyBackend, true>),
        }
    }

    /// The generated function's body: the user's function, the operation's
    /// spec and registrations, the checks before the claim, then the run.
    fn block(&self, call_args: &[TokenStream]) -> TokenStream {
        let rt = &self.rt;
        let request = &self.request;
        let handle = &self.handle;
        let inner = self.inner_fn();
        let spec = self.spec();
        let fn_name_str = self.func.sig.ident.to_string();
        let register_accepted = self.register_accepted();
        let (checks, body_steps) = self.body_steps();
        let reject = self.reject();
        let tenant_expr = self.tenant_expr();
        let boxer = if self.config.lease.is_some() {
            quote!(leased_handler_for)
        } else {
            quote!(handler_for)
        };
        let outcome = self.outcome();
        quote! {
            #inner

            #spec
            // With idem-runtime's feature `openapi`, the handler registers itself for
            // `idem_runtime::openapi::document` (the route is the router's, and an
            // item beside the handler would not fit an associated function); without
            // it, nothing. The name is `#[utoipa::path]`'s default operation id,
            // which the registration matches.
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
            #rt::run(
                #request,
                &__IDEM_SPEC,
                __idem_tenant,
                __idem_fingerprint,
                __idem_handler,
            )
            .await
        }
    }

    /// The inner function keeps the user's signature and body unchanged.
    fn inner_fn(&self) -> ItemFn {
        let mut inner = self.func.clone();
        strip_marker_attrs(&mut inner);
        inner.sig.ident = format_ident!("__idem_inner");
        inner.vis = syn::Visibility::Inherited;
        inner
            .attrs
            .retain(|a| a.path().is_ident("allow") || a.path().is_ident("expect"));
        inner
    }

    /// The operation as the runtime reads it.
    fn spec(&self) -> TokenStream {
        let config = self.config;
        Spec {
            operation: &config.operation,
            retention: config.retention,
            in_flight_wait: config.in_flight_wait,
            headers: &config.headers,
            lease: config.lease,
            lease_ceiling: config.lease_ceiling,
            accepted: config.accepted,
        }
        .to_static(&self.rt)
    }

    /// A long operation registers itself for `idem_runtime::operations::router`,
    /// which serves the resources of those operations only.
    fn register_accepted(&self) -> TokenStream {
        let rt = &self.rt;
        if self.config.accepted {
            quote!(#rt::__idem_accepted!(&__IDEM_SPEC);)
        } else {
            quote!()
        }
    }

    fn tenant_expr(&self) -> TokenStream {
        let rt = &self.rt;
        match self.config.tenant {
            Tenant::Single => quote!(#rt::single_tenant()),
            Tenant::Param(i) => {
                let name = self.name_of(i);
                let ty = self.ty_of(i);
                quote!(#rt::tenant_id::<#ty>(&#name))
            }
        }
    }

    /// `Result<B, B::Rejection>`: the rejection is the answer, before any claim.
    /// Behind a name the attribute cannot read (`Result<OrderBody, _>`), the
    /// probe's tag screens the parameter: a `Result` body's `Err` is answered,
    /// anything else passes unchanged.
    fn reject(&self) -> Option<TokenStream> {
        let rt = &self.rt;
        if let Some(i) = self.config.probed {
            let (name, ty) = (self.name_of(i), self.ty_of(i));
            let state = self.state_type();
            return Some(quote! {
                let #name = {
                    #[allow(unused_imports)]
                    use #rt::{ProbeIsBody as _, ProbeNotBody as _, ProbeReadsBody as _, ProbeUnplaced as _};
                    match (&&&&#rt::BodyProbe::<#ty, #state>::NEW).__idem_body_kind().screen(#name) {
                        ::core::ops::ControlFlow::Continue(__idem_ok) => __idem_ok,
                        ::core::ops::ControlFlow::Break(__idem_rejection) => return __idem_rejection,
                    }
                };
            });
        }
        self.config.body_result.map(|i| {
            let name = self.name_of(i);
            quote! {
                let #name = match #name {
                    ::core::result::Result::Err(__idem_rejection) => {
                        return #rt::rejected(__idem_rejection);
                    }
                    __idem_ok => __idem_ok,
                };
            }
        })
    }

    /// What of the body goes into the fingerprint: the steps chained on
    /// `start_fingerprint`, and a check that stands alone (a body behind an
    /// alias that the fingerprint leaves out).
    fn body_steps(&self) -> (TokenStream, TokenStream) {
        let rt = &self.rt;
        match &self.config.body {
            BodyPrint::None => (quote!(), quote!()),
            BodyPrint::Whole(i) => {
                let (name, ty) = (self.name_of(*i), self.ty_of(*i));
                let step =
                    quote!(.and_then(|__idem_fp| #rt::fingerprint_body::<#ty>(__idem_fp, &#name)));
                (quote!(), step)
            }
            BodyPrint::Fields(i, fields) => (quote!(), self.field_steps(*i, fields)),
            BodyPrint::Probe(i) => (quote!(), self.probe(*i, false)),
            BodyPrint::ProbeNamed(i) => (quote!(), self.probe(*i, true)),
            BodyPrint::ProbeLeftOut(i) => (self.probe_left_out(*i), quote!()),
        }
    }

    /// One step per field, reading it at the span of its path in the attribute
    /// (where rustc then reports a field that does not exist).
    fn field_steps(&self, i: usize, fields: &[(Vec<String>, Span)]) -> TokenStream {
        let rt = &self.rt;
        let (name, ty) = (self.name_of(i), self.ty_of(i));
        let steps = fields.iter().map(|(segments, span)| {
            // A raw identifier (`body.r#type`) is the field `type`: the path
            // names it as serde writes it.
            let unraw = |s: &String| s.strip_prefix("r#").unwrap_or(s).to_owned();
            let path = segments.iter().map(unraw).collect::<Vec<_>>().join(".");
            let members = segments.iter().map(|s| match s.parse::<u32>() {
                Ok(index) => {
                    let idx = syn::Index { index, span: *span };
                    quote!(#idx)
                }
                Err(_) => {
                    let id = match s.strip_prefix("r#") {
                        Some(raw) => syn::Ident::new_raw(raw, *span),
                        None => syn::Ident::new(s, *span),
                    };
                    quote!(#id)
                }
            });
            let access = quote_spanned!(*span=> &__idem_b #(.#members)*);
            quote!(.and_then(|__idem_fp| #rt::body_field::<#ty, _, _>(__idem_fp, #path, &#name, |__idem_b| #access)))
        });
        quote!(#(#steps)*)
    }

    /// A last parameter behind an alias: its type decides whether it is a body,
    /// fingerprinted whole. A failed bound on the chosen tag's method is
    /// reported at the method call, which gets the parameter type's span.
    /// `named`: `fingerprint(body)` asks for it, so an extractor of the parts
    /// (no body to take) is refused.
    fn probe(&self, i: usize, named: bool) -> TokenStream {
        let rt = &self.rt;
        let (name, ty) = (self.name_of(i), self.ty_of(i));
        let at = first_span(&ty);
        let state = self.state_type();
        let print = syn::Ident::new(
            if named {
                "named_print"
            } else {
                "default_print"
            },
            at,
        );
        let probe = quote_spanned!(at=> (&&&&#rt::BodyProbe::<#ty, #state>::NEW).__idem_body_kind().#print(__idem_fp, &#name));
        quote!(.and_then(|__idem_fp| {
            #[allow(unused_imports)]
            use #rt::{ProbeIsBody as _, ProbeNotBody as _, ProbeReadsBody as _, ProbeUnplaced as _};
            #probe
        }))
    }

    /// The state the probe asks the last parameter about: the handler's last
    /// `State<S>` (the last, so that the router's own state named after a
    /// sub-state's is the one asked), else `()`. A handler that names no state
    /// and ends with an extractor for a particular one is refused (see
    /// `BodyProbe`): whether it reads the body cannot be asked without that
    /// state.
    fn state_type(&self) -> TokenStream {
        self.func
            .sig
            .inputs
            .iter()
            .rev()
            .find_map(|arg| match arg {
                FnArg::Typed(t) => state_of(&t.ty),
                FnArg::Receiver(_) => None,
            })
            .map_or_else(|| quote!(()), ToTokens::to_token_stream)
    }

    /// Likewise, with `fingerprint(header = ..)` only: a body there is refused.
    fn probe_left_out(&self, i: usize) -> TokenStream {
        let rt = &self.rt;
        let ty = self.ty_of(i);
        let at = first_span(&ty);
        let state = self.state_type();
        let probe = quote_spanned!(at=> (&&&&#rt::BodyProbe::<#ty, #state>::NEW).__idem_body_kind().left_out());
        quote! {
            {
                #[allow(unused_imports)]
                use #rt::{ProbeIsBody as _, ProbeNotBody as _, ProbeReadsBody as _, ProbeUnplaced as _};
                #probe;
            }
        }
    }

    /// The handler's output as an outcome (`from_result` or `ok`, by
    /// `KindProbe`), at the span of the declared return type.
    fn outcome(&self) -> TokenStream {
        let rt = &self.rt;
        let output_span = match &self.func.sig.output {
            ReturnType::Default => self.func.sig.ident.span(),
            ReturnType::Type(_, ty) => syn::spanned::Spanned::span(&**ty),
        };
        quote_spanned!(output_span=>
            (&#rt::KindProbe(&__idem_out)).__idem_kind().outcome(__idem_out)
        )
    }
}

/// The generated handler as it is emitted: as is, or, with the runtime under a
/// path the attribute cannot check, through a macro found at that path, so a
/// wrong path is reported at the macro and nothing of the handler is checked
/// against it. Only the macro call is emitted beside it (no stub item, no
/// import), so that it fits where an associated function goes, in an `impl`.
fn emit(func: ItemFn, config: &Config) -> TokenStream {
    let Some(path) = &config.krate else {
        return quote!(#func);
    };
    quote! {
        #path::__private::__idem_item! { #func }
    }
}

/// `S` of a parameter typed `State<S>` (any path to it).
fn state_of(ty: &syn::Type) -> Option<&syn::Type> {
    last_segment(ty)
        .filter(|seg| seg.ident == "State")
        .and_then(first_type_arg)
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
            BodyPrint::Whole(_) | BodyPrint::Probe(_) | BodyPrint::ProbeNamed(_) => {
                parts.push("the body".to_owned());
            }
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

/// What the `static __IDEM_SPEC: OperationSpec` of an expansion holds, for
/// an HTTP handler and a gRPC method alike.
pub struct Spec<'a> {
    pub operation: &'a str,
    pub retention: std::time::Duration,
    pub in_flight_wait: Option<std::time::Duration>,
    pub headers: &'a [String],
    pub lease: Option<std::time::Duration>,
    pub lease_ceiling: Option<std::time::Duration>,
    pub accepted: bool,
}

impl Spec<'_> {
    /// The `static __IDEM_SPEC`, with the runtime at `rt`.
    pub fn to_static(&self, rt: &TokenStream) -> TokenStream {
        let opt_duration = |d: Option<std::time::Duration>| match d {
            Some(d) => {
                let d = duration_tokens(rt, d);
                quote!(::core::option::Option::Some(#d))
            }
            None => quote!(::core::option::Option::None),
        };
        let operation = self.operation;
        let retention = duration_tokens(rt, self.retention);
        let in_flight_wait = opt_duration(self.in_flight_wait);
        let headers = self.headers;
        let lease = opt_duration(self.lease);
        let lease_ceiling = opt_duration(self.lease_ceiling);
        let accepted = self.accepted;
        quote! {
            static __IDEM_SPEC: #rt::OperationSpec = #rt::OperationSpec {
                operation: #operation,
                retention: #retention,
                in_flight_wait: #in_flight_wait,
                fingerprint_headers: &[#(#headers),*],
                lease: #lease,
                lease_ceiling: #lease_ceiling,
                accepted: #accepted,
            };
        }
    }
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
    fn a_refused_handler_names_the_runtime_by_its_crate_path() {
        // A bare `Tx` is refused; the function's copy names its database
        // through the `crate` given, not a crate the user may not have.
        let out = expand_str(
            quote!(crate = "idem_rt", operation = "x", retention = "24h"),
            quote! {
                async fn f(#[tenant] c: Caller, tx: &mut idem_rt::Tx, Json(b): Json<B>) -> StatusCode { todo!() }
            },
        );
        assert!(out.contains("compile_error"), "{out}");
        assert!(!out.contains(":: idem_runtime ::"), "{out}");
        assert!(out.contains("idem_rt :: __private :: AnyBackend"), "{out}");
    }

    #[test]
    fn a_grpc_key_field_of_a_raw_name_is_named_as_the_proto_names_it() {
        let out = expand_str(
            quote!(operation = "x", retention = "24h", key = "body.r#type"),
            quote! {
                async fn create_order(&self, #[tenant] caller: Extension<Caller>, tx: &mut Tx<Postgres>, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
                    todo!()
                }
            },
        );
        assert!(out.contains("KeySource :: Field (\"type\")"), "{out}");
        assert!(out.contains("__idem_m . r#type"), "{out}");
    }

    #[test]
    fn a_raw_field_is_read_raw_and_named_as_serde_names_it() {
        let out = expand_str(
            quote!(
                operation = "transfer",
                retention = "24h",
                fingerprint(body.r#type)
            ),
            quote! {
                async fn transfer(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<Transfer>) -> StatusCode { todo!() }
            },
        );
        assert!(out.contains("\"type\""), "{out}");
        assert!(out.contains("& __idem_b . r#type"), "{out}");
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
