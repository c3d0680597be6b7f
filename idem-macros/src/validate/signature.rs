//! The function itself: written once with `#[idempotent]`, `async`, safe,
//! without an ABI, `const`, generics, a `where` clause or variadics.

use syn::{GenericParam, Generics, ItemFn, Signature};

use crate::errors::Errors;

/// Is this attribute `#[idempotent]` (by any path)?
pub fn is_idempotent_attr(a: &syn::Attribute) -> bool {
    a.path()
        .segments
        .last()
        .is_some_and(|s| s.ident == "idempotent")
}

/// Is this attribute `#[instrument]` (by any path, as `tracing::instrument`)?
pub fn is_instrument_attr(a: &syn::Attribute) -> bool {
    a.path()
        .segments
        .last()
        .is_some_and(|s| s.ident == "instrument")
}

/// The attribute written twice: the first expansion sees the second.
pub(super) fn check_written_once(func: &ItemFn, errors: &mut Errors) {
    let name = &func.sig.ident;
    for attr in func.attrs.iter().filter(|a| is_idempotent_attr(a)) {
        errors.push_spanned(
            attr,
            format!(
                "`#[idempotent]` is written twice on `{name}`: keep one (a handler has one operation, retention and fingerprint)"
            ),
        );
    }
}

/// `#[instrument]` written below `#[idempotent]`: it would apply to the
/// function idem writes (its parameters are the extractors, its answer a
/// `Response`), not to the handler as written, so `skip(tx)` names nothing
/// and `err` finds no `Result`. Above `#[idempotent]` it expands first, on the
/// handler as written, and is kept in it.
pub(super) fn check_attrs_below(func: &ItemFn, errors: &mut Errors) {
    for attr in &func.attrs {
        if is_instrument_attr(attr) {
            errors.push_spanned(
                attr,
                "`#[instrument]` below `#[idempotent]` would instrument the function idem writes (its parameters are the extractors, its answer a `Response`), not your handler: write it above `#[idempotent]`, where it sees your signature and body",
            );
        }
    }
}

/// The function's shape: what axum cannot call as a handler, or the expansion
/// cannot give concrete types.
pub(super) fn check_signature(sig: &Signature, errors: &mut Errors) {
    check_qualifiers(sig, errors);
    check_generics(&sig.generics, errors);
    if let Some(v) = &sig.variadic {
        errors.push_spanned(v, "`#[idempotent]` handlers cannot be variadic");
    }
}

/// A transactional handler whose return type names `Uncertain`: that is a
/// leased handler's answer (an effect elsewhere that may have happened). A
/// transaction's effects commit with the key or not at all, so idem refuses
/// it at run time (rolled back, `500`); written in the type, it is refused
/// here, where the fix is to choose leased mode.
pub(super) fn refuse_uncertain(sig: &Signature, errors: &mut Errors) {
    fn find(tokens: proc_macro2::TokenStream) -> Option<proc_macro2::Ident> {
        tokens.into_iter().find_map(|t| match t {
            proc_macro2::TokenTree::Ident(i) if i == "Uncertain" => Some(i),
            proc_macro2::TokenTree::Group(g) => find(g.stream()),
            _ => None,
        })
    }
    let syn::ReturnType::Type(_, ty) = &sig.output else {
        return;
    };
    if let Some(at) = find(quote::ToTokens::to_token_stream(ty)) {
        errors.push_at(
            at.span(),
            "`Uncertain` is a leased handler's answer: this handler's effects commit with its key in one transaction, or not at all, so its outcome is never uncertain (returned, it is rolled back and answered `500`). For an effect outside the database, such as a payment provider, use leased mode: `lease = \"30s\"` and a `lease: &mut Lease<Postgres>` parameter",
        );
    }
}

pub(super) fn check_qualifiers(sig: &Signature, errors: &mut Errors) {
    let name = &sig.ident;
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
}

pub(super) fn check_generics(generics: &Generics, errors: &mut Errors) {
    for param in &generics.params {
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
    if generics.params.is_empty()
        && let Some(w) = &generics.where_clause
    {
        errors.push_spanned(
            w,
            "`where` clauses are not supported by `#[idempotent]`: its handlers have concrete types; remove the `where` clause",
        );
    }
}
