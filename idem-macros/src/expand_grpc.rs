//! Expand a tonic service method: the signature tonic declares (`&self`, the
//! request; as `#[tonic::async_trait]` wrote it when it ran first), and a body
//! that reads the key and the parameters from the call, fingerprints the
//! message, and runs the method's own body under the promise through the same
//! pipeline as an HTTP handler.
//!
//! ```text
//! async fn name(&self, __idem_call: Request<M>) -> R {   // or async_trait's form
//!     let __idem_this = service(self);                   // Clone: the work runs on a task
//!     static __IDEM_SPEC: OperationSpec = ...;
//!     let __idem_request = request::<Db, HEADERS, _, _>(&__idem_this, &__idem_call, ..)?;
//!     let __idem_p1 = param::<Extension<Caller>, _>(&__idem_call)?;
//!     let __idem_tenant = tenant_id::<Extension<Caller>>(&__idem_p1);
//!     let __idem_fingerprint = start_fingerprint(..).and_then(<the message>);
//!     let handler = handler_for(&__idem_request, move |__idem_tx| Box::pin(async move {
//!         let __idem_self = &__idem_this;                // `self` in the body
//!         let <the user's patterns> = ...;
//!         outcome(<the user's body>.await)
//!     }));
//!     answer(run(__idem_request, &__IDEM_SPEC, tenant, fingerprint, handler).await).await
//! }
//! ```

use std::collections::BTreeSet;

use proc_macro2::{Group, Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::{FnArg, ItemFn, Pat, Signature};

use crate::errors::Errors;
use crate::validate::{BodyPrint, GrpcConfig, Key, Tenant, is_idempotent_attr};

/// The errors, and the method with tonic's signature and no body, so that
/// the `impl` adds no error of its own.
pub fn refused(func: ItemFn, errors: &Errors, _rt: &syn::Path) -> TokenStream {
    let errors = errors.to_compile_errors();
    let ItemFn {
        attrs, vis, sig, ..
    } = &func;
    let attrs = attrs.iter().filter(|a| !is_idempotent_attr(a));
    let sig = tonic_signature(sig);
    quote! {
        #errors
        #(#attrs)*
        #[allow(unused_variables)]
        #vis #sig {
            ::core::unreachable!("`#[idempotent]` refused this method")
        }
    }
}

/// The signature tonic declares: the receiver and the request (renamed
/// `__idem_call`), without the parameters idem reads from the call, and, in
/// async_trait's form, without the lifetimes only those parameters had.
fn tonic_signature(sig: &Signature) -> Signature {
    let mut out = sig.clone();
    // The request: last, unless the method was refused for placing it
    // elsewhere.
    let request =
        crate::validate::request_param(sig).unwrap_or_else(|| sig.inputs.len().saturating_sub(1));
    let mut dropped = BTreeSet::new();
    out.inputs = sig
        .inputs
        .iter()
        .enumerate()
        .filter_map(|(i, arg)| match arg {
            FnArg::Receiver(_) => Some(arg.clone()),
            FnArg::Typed(t) if i == request => {
                let mut t = t.clone();
                t.attrs.clear();
                t.pat = Box::new(syn::parse_quote!(__idem_call));
                Some(FnArg::Typed(t))
            }
            FnArg::Typed(t) => {
                lifetimes(t.ty.to_token_stream(), &mut dropped);
                None
            }
        })
        .collect();
    // A lifetime the kept parameters or the output name stays.
    let mut kept = BTreeSet::new();
    for arg in &out.inputs {
        lifetimes(arg.to_token_stream(), &mut kept);
    }
    lifetimes(out.output.to_token_stream(), &mut kept);
    dropped.retain(|l| !kept.contains(l));
    if sig.asyncness.is_none() && !dropped.is_empty() {
        out.generics.params = out
            .generics
            .params
            .into_iter()
            .filter(|p| !matches!(p, syn::GenericParam::Lifetime(l) if dropped.contains(&l.lifetime.ident.to_string())))
            .collect();
        if let Some(w) = out.generics.where_clause.as_mut() {
            w.predicates = w
                .predicates
                .clone()
                .into_iter()
                .filter(|p| !matches!(p, syn::WherePredicate::Lifetime(l) if dropped.contains(&l.lifetime.ident.to_string())))
                .collect();
        }
    }
    out
}

/// The lifetimes named in `tokens`.
fn lifetimes(tokens: TokenStream, out: &mut BTreeSet<String>) {
    let mut quote_seen = false;
    for t in tokens {
        match t {
            TokenTree::Punct(p) if p.as_char() == '\'' => {
                quote_seen = true;
                continue;
            }
            TokenTree::Ident(i) if quote_seen => {
                out.insert(i.to_string());
            }
            TokenTree::Group(g) => lifetimes(g.stream(), out),
            _ => {}
        }
        quote_seen = false;
    }
}

/// The receiver in the body of a method as written, as `__idem_self` (a `&Self`
/// to the service's clone the task owns): every `self` but `self::` paths,
/// `pub(self)`, a `use`, and the nested items (`fn`, `impl`, `trait`, `mod`),
/// whose `self` is their own.
fn replace_self(tokens: TokenStream) -> TokenStream {
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    let mut out = Vec::with_capacity(trees.len());
    let mut i = 0;
    while i < trees.len() {
        let t = &trees[i];
        let punct = |j: usize, c: char| matches!(trees.get(j), Some(TokenTree::Punct(p)) if p.as_char() == c);
        match t {
            // An item or a `use`, copied as written up to its body or `;`.
            // `fn` is an item only where a name follows: `fn(u32) -> u32` is
            // a function pointer's type, in a statement whose `self` is the
            // method's.
            TokenTree::Ident(id)
                if ["fn", "impl", "trait", "mod", "use"]
                    .iter()
                    .any(|k| id == k)
                    && (id != "fn" || matches!(trees.get(i + 1), Some(TokenTree::Ident(_)))) =>
            {
                while i < trees.len() {
                    out.push(trees[i].clone());
                    let end = match &trees[i] {
                        TokenTree::Group(g) => g.delimiter() == proc_macro2::Delimiter::Brace,
                        TokenTree::Punct(p) => p.as_char() == ';',
                        _ => false,
                    };
                    i += 1;
                    if end {
                        break;
                    }
                }
                continue;
            }
            TokenTree::Ident(id) if id == "pub" => {
                out.push(t.clone());
                if let Some(TokenTree::Group(g)) = trees.get(i + 1)
                    && g.delimiter() == proc_macro2::Delimiter::Parenthesis
                {
                    out.push(trees[i + 1].clone());
                    i += 1;
                }
            }
            TokenTree::Ident(id) if id == "self" && !punct(i + 1, ':') => {
                out.push(TokenTree::Ident(Ident::new("__idem_self", id.span())));
            }
            TokenTree::Group(g) => out.push(regroup(g, replace_self)),
            _ => out.push(t.clone()),
        }
        i += 1;
    }
    out.into_iter().collect()
}

/// `g` with its tokens rewritten by `rewrite`, keeping its delimiter and span.
fn regroup(g: &Group, rewrite: fn(TokenStream) -> TokenStream) -> TokenTree {
    let mut regrouped = Group::new(g.delimiter(), rewrite(g.stream()));
    regrouped.set_span(g.span());
    TokenTree::Group(regrouped)
}

/// The receiver in the body as `#[tonic::async_trait]` wrote it: only its
/// `let __self = self;` names it (async_trait renamed the others, and left
/// nested items alone).
fn replace_async_traits_self(tokens: TokenStream) -> TokenStream {
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    let mut out = Vec::with_capacity(trees.len());
    for (i, t) in trees.iter().enumerate() {
        let receiver = i >= 2
            && matches!(t, TokenTree::Ident(id) if id == "self")
            && matches!(&trees[i - 1], TokenTree::Punct(p) if p.as_char() == '=')
            && matches!(&trees[i - 2], TokenTree::Ident(id) if id == "__self");
        match t {
            TokenTree::Ident(id) if receiver => {
                out.push(TokenTree::Ident(Ident::new("__idem_self", id.span())));
            }
            TokenTree::Group(g) => out.push(regroup(g, replace_async_traits_self)),
            _ => out.push(t.clone()),
        }
    }
    out.into_iter().collect()
}

/// A field's identifier at `span`: `r#type` for a field written `body.r#type`.
fn field_ident(name: &str, span: Span) -> Ident {
    let mut id: Ident =
        syn::parse_str(name).unwrap_or_else(|_| Ident::new("__idem_not_a_field", span));
    id.set_span(span);
    id
}

/// The method's expansion (see the module's documentation).
pub fn expand(config: &GrpcConfig, func: ItemFn) -> TokenStream {
    let rt = match &config.krate {
        None => quote!(::idem_runtime::__private),
        Some(path) => quote!(#path::__private),
    };
    let sig = &func.sig;
    let output = &config.output;
    let typed = |i: usize| match &sig.inputs[i] {
        FnArg::Typed(t) => t,
        FnArg::Receiver(_) => unreachable!("validated: not the receiver"),
    };

    // The backend, named once by the handle's type.
    let handle = match &*typed(config.tx).ty {
        syn::Type::Reference(r) => (*r.elem).clone(),
        _ => unreachable!("validated: the handle is a reference"),
    };
    let (handle_trait, boxer) = if config.lease.is_some() {
        (quote!(LeaseHandle), quote!(leased_handler_for))
    } else {
        (quote!(TxHandle), quote!(handler_for))
    };
    let db = quote!(<#handle as #rt::#handle_trait>::Db);
    let headers_flag = !config.headers.is_empty();
    let leased = config.lease.is_some();
    let method_name = method_name(&sig.ident);

    // The key, and the accessor of its field: the field is named once, at the
    // attribute's string, where a field the message lacks is reported.
    let (key_accessor, key_source) = match &config.key {
        Key::Metadata => (
            quote!(),
            quote!(#rt::grpc::KeySource::Metadata, ::core::option::Option::None),
        ),
        Key::Field(f, span) => {
            let field = field_ident(f, *span);
            let access = quote_spanned!(*span=> &mut __idem_m.#field);
            // The field as the proto names it (and clients see it in a
            // violation): `r#type` is `type`.
            let named = f.strip_prefix("r#").unwrap_or(f);
            (
                quote!(let __idem_key_field = #rt::grpc::key_field(__idem_call.get_ref(), |__idem_m| #access);),
                quote!(#rt::grpc::KeySource::Field(#named), ::core::option::Option::Some(__idem_key_field)),
            )
        }
    };

    // The parameters read from the call, and their bindings in the task.
    let mut reads = Vec::new();
    let mut binds = Vec::new();
    for (i, arg) in sig.inputs.iter().enumerate() {
        let FnArg::Typed(t) = arg else { continue };
        let pat = strip_attrs(&t.pat);
        if i == config.request {
            binds.push(quote!(let #pat = __idem_call;));
        } else if i == config.tx {
            binds.push(quote!(let #pat = __idem_handle;));
        } else {
            let ty = &t.ty;
            let var = format_ident!("__idem_p{}", i);
            reads.push(quote! {
                let #var = match #rt::grpc::param::<#ty, _>(&__idem_call) {
                    ::core::result::Result::Ok(v) => v,
                    ::core::result::Result::Err(status) => return ::core::result::Result::Err(status),
                };
            });
            binds.push(quote!(let #pat = #var;));
        }
    }
    let tenant = match config.tenant {
        Tenant::Single => quote!(#rt::single_tenant()),
        Tenant::Param(i) => {
            let ty = &typed(i).ty;
            let var = format_ident!("__idem_p{}", i);
            quote!(#rt::tenant_id::<#ty>(&#var))
        }
    };

    // The message's part of the fingerprint.
    let print = match (&config.body, &config.key) {
        (BodyPrint::Whole(_), Key::Field(..)) => {
            quote!(.and_then(|__idem_fp| #rt::grpc::message_without(__idem_fp, __idem_call.get_mut(), __idem_key_field)))
        }
        (BodyPrint::Whole(_), Key::Metadata) => {
            quote!(.and_then(|__idem_fp| #rt::grpc::message(__idem_fp, __idem_call.get_ref())))
        }
        (BodyPrint::Fields(_, fields), _) => {
            let copies = fields.iter().map(|(segments, span)| {
                let field = field_ident(&segments[0], *span);
                let access = quote_spanned!(*span=> &mut __idem_x.#field);
                quote!(#rt::grpc::copy_field(&mut *__idem_m, &mut __idem_p, |__idem_x| #access);)
            });
            quote!(.and_then(|__idem_fp| {
                let __idem_m = __idem_call.get_mut();
                let mut __idem_p = #rt::grpc::projection(&*__idem_m);
                #(#copies)*
                #rt::grpc::message(__idem_fp, &__idem_p)
            }))
        }
        _ => quote!(),
    };

    // The method's own body, as a future of `R`.
    let block = if config.desugared {
        replace_async_traits_self(func.block.to_token_stream())
    } else {
        replace_self(func.block.to_token_stream())
    };
    let body = if config.desugared {
        // async_trait's body is the boxed future already.
        quote!((#block).await)
    } else {
        quote! {
            async move {
                if let ::core::option::Option::Some(__ret) = ::core::option::Option::None::<#output> {
                    #[allow(unreachable_code)]
                    return __ret;
                }
                let __ret: #output = #block;
                #[allow(unreachable_code)]
                __ret
            }
            .await
        }
    };

    let spec = spec(config, &rt);
    let common = quote! {
        if let ::core::option::Option::Some(__ret) = ::core::option::Option::None::<#output> {
            #[allow(unreachable_code)]
            return __ret;
        }
        #spec
        #[allow(unused_mut)]
        let mut __idem_call = __idem_call;
        #key_accessor
        let __idem_request = match #rt::grpc::request::<#db, #headers_flag, _, _>(
            &__idem_this, &mut __idem_call, #method_name, #key_source,
        ) {
            ::core::result::Result::Ok(r) => r,
            ::core::result::Result::Err(status) => return ::core::result::Result::Err(status),
        };
        #(#reads)*
        let __idem_tenant = #tenant;
        let __idem_fingerprint = #rt::start_fingerprint(&__idem_request, &__IDEM_SPEC, &__idem_tenant) #print;
        let __idem_handler = #rt::#boxer(&__idem_request, move |__idem_handle| {
            #rt::Box::pin(async move {
                #[allow(unused_variables)]
                let __idem_self = &__idem_this;
                #(#binds)*
                let __idem_out: #output = #body;
                #rt::grpc::outcome(__idem_out, #leased)
            })
        });
        #rt::grpc::answer(
            #rt::run(__idem_request, &__IDEM_SPEC, __idem_tenant, __idem_fingerprint, __idem_handler).await,
        )
        .await
    };
    let receiver_span = sig
        .inputs
        .first()
        .map(syn::spanned::Spanned::span)
        .unwrap_or_else(Span::call_site);
    let this = quote_spanned!(receiver_span=> let __idem_this = #rt::grpc::service(self););
    let new_block = if config.desugared {
        quote!({ #this #rt::Box::pin(async move { #common }) })
    } else {
        quote!({ #this #common })
    };
    let mut out = func.clone();
    out.attrs.retain(|a| !is_idempotent_attr(a));
    out.sig = tonic_signature(sig);
    *out.block = syn::parse2(new_block).expect("the generated block parses");
    quote!(#out)
}

/// A parameter's pattern without the attributes only the attribute reads.
fn strip_attrs(pat: &Pat) -> TokenStream {
    match pat {
        Pat::Ident(p) => {
            let mut p = p.clone();
            p.attrs.clear();
            p.to_token_stream()
        }
        other => other.to_token_stream(),
    }
}

fn spec(config: &GrpcConfig, rt: &TokenStream) -> TokenStream {
    crate::expand::Spec {
        operation: &config.operation,
        retention: config.retention,
        in_flight_wait: config.in_flight_wait,
        headers: &config.headers,
        lease: config.lease,
        lease_ceiling: config.lease_ceiling,
        accepted: false,
    }
    .to_static(rt)
}

/// The method's name as the fingerprint's route has it (`/<name>`): a raw
/// identifier without its `r#` (prost names an rpc `Type` `r#type`), which in a
/// route would start a fragment and leave `/r` for every such method.
fn method_name(ident: &syn::Ident) -> String {
    syn::ext::IdentExt::unraw(ident).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_method_name_is_its_own_in_the_route() {
        let (ty, matched): (syn::Ident, syn::Ident) =
            (syn::parse_quote!(r#type), syn::parse_quote!(r#match));
        assert_eq!(method_name(&ty), "type");
        assert_eq!(method_name(&matched), "match");
        assert_eq!(
            method_name(&syn::parse_quote!(create_order)),
            "create_order"
        );
    }

    #[test]
    fn self_becomes_the_tasks_service_and_nested_items_keep_theirs() {
        let out = replace_self(quote! {
            let x = self.pool.get(self::X, f(self));
            struct Guard;
            impl Drop for Guard { fn drop(&mut self) {} }
            fn helper(&self) -> u8 { self.0 }
            use std::io::{self};
            pub(self) struct P;
            g(move || self.n)
            let cb: Option<fn(u32) -> u32> = self.cb;
        });
        assert_eq!(
            out.to_string(),
            quote! {
                let x = __idem_self.pool.get(self::X, f(__idem_self));
                struct Guard;
                impl Drop for Guard { fn drop(&mut self) {} }
                fn helper(&self) -> u8 { self.0 }
                use std::io::{self};
                pub(self) struct P;
                g(move || __idem_self.n)
                let cb: Option<fn(u32) -> u32> = __idem_self.cb;
            }
            .to_string()
        );
        let out = replace_async_traits_self(quote!({
            Box::pin(async move {
                let __self = self;
                impl Drop for Guard {
                    fn drop(&mut self) {}
                }
                __self.n
            })
        }));
        assert_eq!(
            out.to_string(),
            quote!({
                Box::pin(async move {
                    let __self = __idem_self;
                    impl Drop for Guard {
                        fn drop(&mut self) {}
                    }
                    __self.n
                })
            })
            .to_string()
        );
    }

    #[test]
    fn a_lifetime_the_kept_parameters_name_stays() {
        let sig: Signature = syn::parse_quote! {
            fn m<'a, 'async_trait>(&'a self, tx: &'a mut Tx<Sqlite>, request: Request<M>)
                -> ::core::pin::Pin<Box<dyn ::core::future::Future<Output = R> + ::core::marker::Send + 'async_trait>>
                where 'a: 'async_trait, Self: 'async_trait
        };
        let text = tonic_signature(&sig).to_token_stream().to_string();
        assert!(text.contains("< 'a , 'async_trait >"), "{text}");
        assert!(text.contains("'a : 'async_trait"), "{text}");
    }

    #[test]
    fn async_traits_form_keeps_tonics_lifetimes_only() {
        let sig: Signature = syn::parse_quote! {
            fn create_order<'life0, 'life1, 'async_trait>(&'life0 self, #[tenant] caller: Extension<Caller>, tx: &'life1 mut Tx<Sqlite>, request: Request<M>)
                -> ::core::pin::Pin<Box<dyn ::core::future::Future<Output = Result<Response<O>, Status>> + ::core::marker::Send + 'async_trait>>
                where 'life0: 'async_trait, 'life1: 'async_trait, Self: 'async_trait
        };
        let out = tonic_signature(&sig);
        let text = out.to_token_stream().to_string();
        assert!(text.contains("< 'life0 , 'async_trait >"), "{text}");
        assert!(!text.contains("'life1"), "{text}");
        assert!(
            text.contains("(& 'life0 self , __idem_call : Request < M >)"),
            "{text}"
        );
        assert_eq!(
            crate::validate::async_trait_output(&sig)
                .unwrap()
                .to_token_stream()
                .to_string(),
            "Result < Response < O > , Status >"
        );
    }
}
