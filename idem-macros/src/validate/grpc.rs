//! A tonic service method: `&self`, the `#[tenant]` and other parameters read
//! from the call, the handle (`&mut Tx<..>` or `&mut Lease<..>`), and the
//! `tonic::Request<M>` last; written as an `async fn`, or as
//! `#[tonic::async_trait]` has already rewritten it (its attribute on the
//! `impl` runs before this one on the method).

use proc_macro2::Span;
use syn::{FnArg, GenericArgument, ItemFn, PathArguments, ReturnType, Signature, Type};

use super::extractors::{Class, first_type_arg, last_segment};
use super::{BodyPrint, Tenant, fingerprint, parameters, signature};
use crate::errors::Errors;
use crate::parse::{RawArgs, Written};

/// A checked gRPC method, ready to expand.
#[derive(Debug)]
pub struct GrpcConfig {
    pub operation: String,
    pub retention: std::time::Duration,
    pub in_flight_wait: Option<std::time::Duration>,
    pub lease: Option<std::time::Duration>,
    pub lease_ceiling: Option<std::time::Duration>,
    /// Metadata entries fingerprinted (lower case).
    pub headers: Vec<String>,
    /// What of the message is fingerprinted (`Fields` are top-level fields).
    pub body: BodyPrint,
    pub tenant: Tenant,
    /// The handle's index.
    pub tx: usize,
    /// The `tonic::Request<M>` parameter's index.
    pub request: usize,
    pub key: Key,
    /// The method's output: `Result<Response<T>, Status>`.
    pub output: Type,
    /// The method as `#[tonic::async_trait]` rewrote it.
    pub desugared: bool,
    pub krate: Option<syn::Path>,
}

/// Where the key comes from.
#[derive(Debug)]
pub enum Key {
    /// The `idempotency-key` metadata entry.
    Metadata,
    /// A string field of the request message, and the span it was named at.
    Field(String, Span),
}

/// Is this a tonic service method: a receiver, and a `Request<M>` (last, or
/// out of place, which [`validate_grpc`] refuses with where it goes: an HTTP
/// handler's errors would say nothing a method can follow)?
pub fn is_grpc_method(func: &ItemFn) -> bool {
    let sig = &func.sig;
    sig.inputs.iter().any(|a| matches!(a, FnArg::Receiver(_))) && request_param(sig).is_some()
}

/// The last parameter that is a `Request<M>`.
pub fn request_param(sig: &Signature) -> Option<usize> {
    sig.inputs.iter().rposition(|arg| {
        let FnArg::Typed(t) = arg else {
            return false;
        };
        last_segment(&t.ty).is_some_and(|seg| {
            seg.ident == "Request"
                && matches!(&seg.arguments, PathArguments::AngleBracketed(a)
                    if matches!(a.args.first(), Some(GenericArgument::Type(_))))
        })
    })
}

/// Whether the request is the last parameter; refused if not: tonic calls the method
/// with it alone, so idem's parameters (the transaction or lease, the
/// `#[tenant]`) go between `&self` and it.
fn request_is_last(sig: &Signature, request: usize, errors: &mut Errors) -> bool {
    if request + 1 == sig.inputs.len() {
        return true;
    }
    errors.push_spanned(
        &sig.inputs[request],
        "the request goes last: tonic calls the method with `&self` and the request alone, so the parameters `#[idempotent]` fills (the transaction or lease, the `#[tenant]`) go between them; move the request to the end",
    );
    false
}

/// Refuses `Request<Streaming<M>>`: idem fingerprints one message, and would
/// hold the key's claim (in transactional mode, its transaction and row lock)
/// for as long as the client kept the stream open.
fn refuse_a_client_stream(sig: &Signature, request: usize, errors: &mut Errors) {
    let FnArg::Typed(t) = &sig.inputs[request] else {
        return;
    };
    let Some(message) = last_segment(&t.ty).and_then(first_type_arg) else {
        return;
    };
    if last_segment(message).is_some_and(|s| s.ident == "Streaming") {
        errors.push_spanned(
            message,
            format!(
                "`{}` takes a client stream: `#[idempotent]` makes a call with one request message idempotent (it fingerprints that message, and holds the key's claim while the method runs); take a unary `Request<M>`, or make each streamed message idempotent on its own",
                sig.ident
            ),
        );
    }
}

/// The `R` of `Pin<Box<dyn Future<Output = R> + Send + 'async_trait>>`, the
/// return type `#[tonic::async_trait]` writes for `-> R`.
pub fn async_trait_output(sig: &Signature) -> Option<Type> {
    let ReturnType::Type(_, ty) = &sig.output else {
        return None;
    };
    let only_type = |ty: &Type, name: &str| -> Option<Type> {
        let seg = last_segment(ty).filter(|s| s.ident == name)?;
        let PathArguments::AngleBracketed(a) = &seg.arguments else {
            return None;
        };
        a.args.iter().find_map(|g| match g {
            GenericArgument::Type(t) => Some(t.clone()),
            _ => None,
        })
    };
    let boxed = only_type(ty, "Pin")?;
    let Type::TraitObject(dyn_future) = only_type(&boxed, "Box")? else {
        return None;
    };
    dyn_future.bounds.iter().find_map(|b| {
        let syn::TypeParamBound::Trait(t) = b else {
            return None;
        };
        let seg = t.path.segments.last().filter(|s| s.ident == "Future")?;
        let PathArguments::AngleBracketed(a) = &seg.arguments else {
            return None;
        };
        a.args.iter().find_map(|g| match g {
            GenericArgument::AssocType(at) if at.ident == "Output" => Some(at.ty.clone()),
            _ => None,
        })
    })
}

/// Checks a gRPC method. `errors` collects what is wrong; `None` when
/// anything was.
pub fn validate_grpc(
    mut args: RawArgs,
    written: &Written,
    func: &ItemFn,
    errors: &mut Errors,
) -> Option<GrpcConfig> {
    let sig = &func.sig;
    let name = &sig.ident;
    signature::check_written_once(func, errors);
    signature::check_attrs_below(func, errors);
    let desugared = sig.asyncness.is_none() && async_trait_output(sig).is_some();
    if !desugared {
        signature::check_qualifiers(sig, errors);
        signature::check_generics(&sig.generics, errors);
    }
    let output = if desugared {
        async_trait_output(sig)
    } else {
        match &sig.output {
            ReturnType::Type(_, ty) => Some((**ty).clone()),
            ReturnType::Default => {
                errors.push_spanned(
                    name,
                    format!(
                        "`{name}` returns nothing: a tonic method returns `Result<tonic::Response<T>, tonic::Status>`"
                    ),
                );
                None
            }
        }
    };
    let options = super::options::check_options(&args, written, errors);
    if options.accepted {
        errors.push_at(
            args.accepted.span(),
            "`accepted` answers `202 Accepted` with an HTTP resource, which gRPC has not: a gRPC method answers when its work is done; remove `accepted` (with `lease`, a long method holds its lease while it runs)",
        );
    }
    let key = check_key(&args, name, errors);
    let request = request_param(sig).expect("a gRPC method has a request");
    if !request_is_last(sig, request, errors) {
        // The other checks read the parameters around the request as if it
        // were last, and would only add confusion.
        return None;
    }
    refuse_a_client_stream(sig, request, errors);
    let (tenant, tx) = check_params(&args, written, sig, request, errors);
    let arg = parameters::typed(sig, request);
    let body = fingerprint::Body {
        param: Some((
            request,
            Class::Body {
                streaming: false,
                result: false,
            },
            arg,
        )),
        maybe: None,
    };
    let (headers, print) = fingerprint::check_fingerprint(args.fingerprint.take(), &body, errors);
    check_fields(&print, key.as_ref(), errors);
    if !errors.is_empty() {
        return None;
    }
    Some(GrpcConfig {
        operation: options.operation?,
        retention: options.retention?,
        in_flight_wait: options.in_flight_wait,
        lease: options.lease,
        lease_ceiling: options.lease_ceiling,
        headers,
        body: print,
        tenant: tenant?,
        tx: tx?,
        request,
        key: key?,
        output: output?,
        desugared,
        krate: options.krate,
    })
}

/// `key = "metadata"` or `key = "body.<field>"`, required.
fn check_key(args: &RawArgs, name: &syn::Ident, errors: &mut Errors) -> Option<Key> {
    let Some(key) = args.key.as_ref() else {
        errors.push_spanned(
            name,
            format!(
                "`{name}` names no key source: add `key = \"metadata\"` to read the `idempotency-key` metadata entry, or `key = \"body.request_id\"` to read a string field of the request message (AIP-155's `request_id`)"
            ),
        );
        return None;
    };
    let text = key.as_str();
    if text == "metadata" {
        return Some(Key::Metadata);
    }
    match text.strip_prefix("body.") {
        Some(field) if syn::parse_str::<syn::Ident>(field).is_ok() => {
            Some(Key::Field(field.to_owned(), key.span()))
        }
        _ => {
            errors.push_at(
                key.span(),
                format!(
                    "`key` is \"metadata\" (the `idempotency-key` metadata entry) or \"body.<field>\" (a string field of the request message, such as \"body.request_id\"), not {text:?}"
                ),
            );
            None
        }
    }
}

/// The receiver, the `#[tenant]`, the handle; every parameter but the
/// request is read from the call.
fn check_params(
    args: &RawArgs,
    written: &Written,
    sig: &Signature,
    request: usize,
    errors: &mut Errors,
) -> (Option<Tenant>, Option<usize>) {
    let name = &sig.ident;
    let leased = args.lease.is_some();
    let handle = if leased {
        "lease: &mut idem_runtime::Lease<Postgres>"
    } else {
        "tx: &mut idem_runtime::Tx<Postgres>"
    };
    let single = args.single_tenant.is_present();
    let mut tenant = None;
    let mut tx = None;
    let mut tenant_refused = written.names.contains("single_tenant") && !single;
    let mut tx_refused = false;
    for (i, arg) in sig.inputs.iter().enumerate() {
        let arg = match arg {
            FnArg::Receiver(r) => {
                if !matches!(r.kind, syn::ReceiverKind::Reference(_, _, None))
                    || r.mutability.is_some()
                {
                    errors.push_spanned(
                        r,
                        "a tonic service method takes `&self`: tonic's generated trait declares it so",
                    );
                }
                continue;
            }
            FnArg::Typed(t) => t,
        };
        if i == request {
            if let Some(attr) = parameters::tenant_attr(arg) {
                errors.push_spanned(
                    attr,
                    "the request message cannot be the `#[tenant]`: a client could name any tenant in it; mark the caller's identity `#[tenant]` instead (such as `#[tenant] caller: Extension<Caller>`, inserted by an interceptor)",
                );
                tenant_refused = true;
            }
            continue;
        }
        for attr in &arg.attrs {
            if attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr") {
                errors.push_spanned(
                    attr,
                    "conditional parameters are not supported by `#[idempotent]`: write one method per configuration",
                );
            }
        }
        if let Type::ImplTrait(t) = &*arg.ty {
            errors.push_spanned(
                t,
                "`impl Trait` parameters are generics, which `#[idempotent]` does not support: name the concrete type",
            );
            continue;
        }
        if let Some(span) = parameters::nested_impl_trait(&arg.ty) {
            errors.push_at(
                span,
                "`impl Trait` inside a parameter's type is a generic, which `#[idempotent]` does not support: name the concrete type",
            );
            continue;
        }
        if let Type::Reference(r) = &*arg.ty {
            if parameters::check_handle(arg, r, leased, handle, tx.is_some(), errors) {
                tx = Some(i);
                tx_refused = false;
            } else {
                tx_refused = true;
            }
            tenant_refused |= parameters::refuse_tenant_on_handle(arg, errors);
            continue;
        }
        if let Some(attr) = parameters::tenant_attr(arg) {
            if parameters::check_tenant(arg, attr, Class::Parts, single, tenant.is_some(), errors) {
                tenant = Some(Tenant::Param(i));
                tenant_refused = false;
            } else {
                tenant_refused = true;
            }
        }
    }
    if single && tenant.is_none() {
        tenant = Some(Tenant::Single);
    }
    if tenant.is_none() && !tenant_refused {
        errors.push_spanned(
            name,
            format!(
                "`{name}` has no tenant: mark the parameter that identifies the caller with `#[tenant]` (such as `#[tenant] caller: Extension<Caller>`, inserted by an interceptor; its type implements `idem_runtime::TenantScope` and `idem_runtime::grpc::FromGrpcRequest`), or add `single_tenant` to `#[idempotent(...)]` if this service has one tenant"
            ),
        );
    }
    if tx.is_none() && !tx_refused {
        let msg = if leased {
            format!(
                "`{name}` takes no lease: add a parameter `{handle}` (or `Lease<Sqlite>`, `Lease<MySql>`, `Lease<Redis>`) before the request; tonic still calls `{name}(&self, request)`"
            )
        } else {
            format!(
                "`{name}` takes no transaction: add a parameter `{handle}` (or `Tx<Sqlite>`, `Tx<MySql>`) before the request and write the method's effects through it; tonic still calls `{name}(&self, request)`"
            )
        };
        errors.push_spanned(name, msg);
    }
    (tenant, tx)
}

/// A gRPC fingerprint selects top-level fields, and never the key field.
fn check_fields(print: &BodyPrint, key: Option<&Key>, errors: &mut Errors) {
    let BodyPrint::Fields(_, fields) = print else {
        return;
    };
    for (segments, span) in fields {
        if segments.len() > 1 {
            errors.push_at(
                *span,
                format!(
                    "a gRPC fingerprint selects top-level fields of the message: write `body.{}` to fingerprint the whole `{}`",
                    segments[0], segments[0]
                ),
            );
        } else if let Some(Key::Field(k, _)) = key
            && k == &segments[0]
        {
            errors.push_at(
                *span,
                format!("`body.{k}` is the key, which is never part of the fingerprint: remove it"),
            );
        }
    }
}
