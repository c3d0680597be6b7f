//! The `#[idempotent]` attribute. Use it through `idem_runtime::idempotent`; this
//! crate only forwards to [`expand::idempotent`] (parse → validate → expand).

mod expand;
mod parse;
mod validate;

use proc_macro::TokenStream;

/// Makes an Axum handler safe to retry: for one tenant, one operation and one
/// `Idempotency-Key`, the handler runs at most once within the retention window,
/// and every retry gets the stored answer.
///
/// DOCS_PLACEHOLDER
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
