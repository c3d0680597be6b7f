//! The handler's parameters: the `#[tenant]` (or `single_tenant`), the handle
//! (`&mut Tx`, or `&mut Lease` in leased mode), and the body: one, last, and
//! when fallible, failing with its extractor's rejection.

use syn::{FnArg, GenericArgument, PathArguments, Signature, Type};

use super::Tenant;
use super::extractors::{Class, classify, last_segment};
use crate::errors::Errors;
use crate::parse::{RawArgs, Written};

/// Is this parameter marked `#[tenant]`?
pub fn tenant_attr(arg: &syn::PatType) -> Option<&syn::Attribute> {
    arg.attrs.iter().find(|a| a.path().is_ident("tenant"))
}

/// A `#[tenant]` on the transaction or lease handle, refused at the mark:
/// whether there was one (so that "no tenant" is not said as well).
pub(super) fn refuse_tenant_on_handle(arg: &syn::PatType, errors: &mut Errors) -> bool {
    let Some(attr) = tenant_attr(arg) else {
        return false;
    };
    errors.push_spanned(
        attr,
        "`#[tenant]` marks the parameter that identifies the caller, not the transaction",
    );
    true
}

/// The parameters placed: `None` where one is missing or was refused.
pub(super) struct Parameters {
    pub(super) tenant: Option<Tenant>,
    /// The handle's index.
    pub(super) tx: Option<usize>,
    /// Every parameter but a receiver, an `impl Trait` and a reference, with
    /// what it is.
    pub(super) classes: Vec<(usize, Class)>,
}

/// Places the tenant and the handle, and reports either missing.
pub(super) fn check_parameters(
    args: &RawArgs,
    written: &Written,
    sig: &Signature,
    errors: &mut Errors,
) -> Parameters {
    let name = &sig.ident;
    let leased = args.lease.is_some();
    let (handle, others) = if leased {
        (
            "lease: &mut idem_runtime::Lease<Postgres>",
            "(or `Lease<Sqlite>`, `Lease<MySql>`, `Lease<Redis>`: where the lease is kept)",
        )
    } else {
        (
            "tx: &mut idem_runtime::Tx<Postgres>",
            "(or `Tx<Sqlite>`, `Tx<MySql>`)",
        )
    };
    let mut tenant = None;
    let mut tx = None;
    // A refused `#[tenant]` or handle is not also reported missing.
    let mut tenant_refused =
        written.names.contains("single_tenant") && !args.single_tenant.is_present();
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
        if let Some(span) = nested_impl_trait(&arg.ty) {
            errors.push_at(
                span,
                "`impl Trait` inside a parameter's type is a generic, which `#[idempotent]` does not support: name the concrete type (`Json<NewOrder>`, not `Json<impl Serialize>`)",
            );
            continue;
        }
        if let Type::Reference(r) = &*arg.ty {
            if check_handle(arg, r, leased, handle, tx.is_some(), errors) {
                tx = Some(i);
                tx_refused = false;
            } else {
                tx_refused = true;
            }
            tenant_refused |= refuse_tenant_on_handle(arg, errors);
            continue;
        }
        let class = classify(arg);
        if let Some(attr) = tenant_attr(arg) {
            if check_tenant(
                arg,
                attr,
                class,
                args.single_tenant.is_present(),
                tenant.is_some(),
                errors,
            ) {
                tenant = Some(Tenant::Param(i));
                tenant_refused = false;
            } else {
                tenant_refused = true;
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
                "`{name}` takes no lease: add a parameter `{handle}` {others}; it carries the downstream idempotency key and lets the handler report an uncertain outcome"
            )
        } else {
            format!(
                "`{name}` takes no transaction: add a parameter `{handle}` {others} and write the operation's effects through it, so they commit together with the stored outcome"
            )
        };
        errors.push_spanned(&sig.ident, msg);
    }
    Parameters {
        tenant,
        tx,
        classes,
    }
}

/// The `&mut` parameter: the handle, recognised by its name, `Tx` or `Lease`,
/// which also picks the mode (a wrong type is one error here, not type errors
/// in the expansion and at the router). `true` when it is the handle.
pub(super) fn check_handle(
    arg: &syn::PatType,
    r: &syn::TypeReference,
    leased: bool,
    handle: &str,
    taken: bool,
    errors: &mut Errors,
) -> bool {
    let handle_name = last_segment(&r.elem).map(|s| s.ident.to_string());
    let expected = if leased { "Lease" } else { "Tx" };
    if r.mutability.is_none() {
        errors.push_spanned(
            &arg.ty,
            format!("take it as `{handle}`; other references cannot be extracted from a request"),
        );
    } else if taken {
        errors.push_spanned(
            &arg.ty,
            format!("the handler takes two `&mut` parameters: keep one, `{handle}`"),
        );
    } else if handle_name.as_deref() == Some("Tx") && leased {
        errors.push_spanned(
            &arg.ty,
            "with `lease = \"...\"` the handler holds a lease, not a transaction: take `lease: &mut idem_runtime::Lease<Postgres>` (or `<Sqlite>`, `<MySql>`, `<Redis>`: where the lease is kept), or remove `lease` to write the effects in the transaction that holds the key",
        );
    } else if handle_name.as_deref() == Some("Lease") && !leased {
        errors.push_spanned(
            &arg.ty,
            "`Lease` is the handle of leased mode: add `lease = \"30s\"` to `#[idempotent(...)]` for an effect outside the database, or take `tx: &mut idem_runtime::Tx<Postgres>` (or `<Sqlite>`, `<MySql>`) to write the effects in the transaction that holds the key",
        );
    } else if handle_name.as_deref() == Some(expected) && !names_its_database(&r.elem) {
        // No default database (docs/decisions.md): a default that followed the
        // features would change with a dependency's features, far from here.
        errors.push_spanned(
            &r.elem,
            if leased {
                "name where the lease is kept: `&mut Lease<Postgres>`, `&mut Lease<Sqlite>`, `&mut Lease<MySql>` or `&mut Lease<Redis>`; idem has no default database, as sqlx has none, so a bare `Lease` cannot change meaning when a dependency enables another of idem-runtime's database features"
            } else {
                "name the transaction's database: `&mut Tx<Postgres>`, `&mut Tx<Sqlite>` or `&mut Tx<MySql>` (sqlx's types); idem has no default database, as sqlx has none, so a bare `Tx` cannot change meaning when a dependency enables another of idem-runtime's database features"
            },
        );
    } else if handle_name.as_deref() != Some(expected) {
        errors.push_spanned(
            &arg.ty,
            if leased {
                "this is not idem's lease: take `lease: &mut idem_runtime::Lease<Postgres>` (or `<Sqlite>`, `<MySql>`, `<Redis>`), written with its name `Lease`, which the attribute reads"
            } else {
                "this is not idem's transaction: take `tx: &mut idem_runtime::Tx<Postgres>` (or `<Sqlite>`, `<MySql>`), written with its name `Tx`, which the attribute reads to pick the backend; the effects go through `&mut **tx`"
            },
        );
    } else {
        return true;
    }
    false
}

/// Whether the handle's type names its database (`Tx<Postgres>`), or is a
/// bare `Tx` / `Lease`.
fn names_its_database(ty: &syn::Type) -> bool {
    last_segment(ty).is_some_and(|s| matches!(s.arguments, syn::PathArguments::AngleBracketed(_)))
}

/// A parameter marked `#[tenant]` (not the handle): `true` when it is the
/// tenant.
pub(super) fn check_tenant(
    arg: &syn::PatType,
    attr: &syn::Attribute,
    class: Class,
    single_tenant: bool,
    taken: bool,
    errors: &mut Errors,
) -> bool {
    if single_tenant {
        errors.push_spanned(
            attr,
            "`#[tenant]` contradicts `single_tenant`: keep `#[tenant]` to scope keys by caller, or remove it for a service with one tenant",
        );
    } else if taken {
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
        return true;
    }
    false
}

/// The parameter at `i`, unless it is the receiver.
pub(super) fn typed(sig: &Signature, i: usize) -> Option<&syn::PatType> {
    match &sig.inputs[i] {
        FnArg::Typed(t) => Some(t),
        FnArg::Receiver(_) => None,
    }
}

/// The body: the extractor axum runs last. Returns the body parameter, and
/// else a last parameter that may be one (see `BodyPrint::Probe`).
pub(super) fn check_body(
    sig: &Signature,
    params: &Parameters,
    errors: &mut Errors,
) -> (Option<(usize, Class)>, Option<usize>) {
    let classes = &params.classes;
    let last = classes.last().map(|(i, _)| *i);
    let bodies: Vec<(usize, Class)> = classes
        .iter()
        .copied()
        .filter(|(_, c)| matches!(c, Class::Body { .. }))
        .collect();
    for (n, (i, _)) in bodies.iter().enumerate() {
        let Some(arg) = typed(sig, *i) else { continue };
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
    let tenant_index = match params.tenant {
        Some(Tenant::Param(t)) => Some(t),
        _ => None,
    };
    // A last parameter of a type the attribute cannot place (an alias, a custom
    // extractor) may read the body: its type decides, through a probe.
    let maybe_body = match (body_param, classes.last()) {
        (None, Some((i, Class::Unknown))) if Some(*i) != tenant_index => Some(*i),
        _ => None,
    };
    (body_param, maybe_body)
}

/// A body written `Result<B, E>`: its index, with `E` checked.
pub(super) fn check_body_result(
    sig: &Signature,
    body_param: Option<(usize, Class)>,
    errors: &mut Errors,
) -> Option<usize> {
    let body_result = match body_param {
        Some((i, Class::Body { result: true, .. })) => Some(i),
        _ => None,
    };
    if let Some(arg) = body_result.and_then(|i| typed(sig, i)) {
        check_rejection(arg, errors);
    }
    body_result
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
    let body_name = last_segment(body).map_or_else(|| "B".to_owned(), |b| b.ident.to_string());
    // axum's own body extractors, whose rejection is known by name: axum
    // implements the extractor only for `Result<T, T::Rejection>`, so another
    // `...Rejection` would end in its `Handler` error at the router.
    let known = match body_name.as_str() {
        "Json" => Some("JsonRejection"),
        "Form" => Some("FormRejection"),
        "RawForm" => Some("RawFormRejection"),
        "Bytes" => Some("BytesRejection"),
        "String" => Some("StringRejection"),
        _ => None,
    };
    let err_name = last_segment(err).map(|e| e.ident.to_string());
    let is_rejection = match err {
        // `<Json<T> as FromRequest<S>>::Rejection`
        Type::Path(p) if p.qself.is_some() => true,
        _ => match (known, &err_name) {
            (Some(want), Some(name)) => name == want,
            (None, Some(name)) => name.ends_with("Rejection"),
            (_, None) => false,
        },
    };
    if is_rejection {
        return;
    }
    let rejection = match known {
        Some(name) => format!("axum::extract::rejection::{name}"),
        None => format!("<{body_name}<..> as axum::extract::FromRequest<S>>::Rejection"),
    };
    let message = match (&err_name, known) {
        (Some(name), Some(_)) if name.ends_with("Rejection") => format!(
            "`{body_name}<..>`'s rejection is `{rejection}`, not `{name}`: axum extracts `Result<{body_name}<..>, E>` only with its own rejection as `E`; write `Result<{body_name}<..>, {rejection}>`"
        ),
        _ => format!(
            "a fallible body's error must be the extractor's rejection, which idem answers before the claim: write `Result<{body_name}<..>, {rejection}>`, or take `{body_name}<..>` alone and let axum answer a bad body"
        ),
    };
    errors.push_spanned(err, message);
}

/// Where `ty` holds an `impl Trait` below its top (`Json<impl Serialize>`):
/// the attribute names the type in paths (`BodyProbe::<T>`), where rustc
/// refuses it with no word of what to write instead.
pub(crate) fn nested_impl_trait(ty: &Type) -> Option<proc_macro2::Span> {
    fn find(tokens: proc_macro2::TokenStream) -> Option<proc_macro2::Span> {
        tokens.into_iter().find_map(|tt| match tt {
            proc_macro2::TokenTree::Ident(i) if i == "impl" => Some(i.span()),
            proc_macro2::TokenTree::Group(g) => find(g.stream()),
            _ => None,
        })
    }
    find(quote::ToTokens::to_token_stream(ty))
}
