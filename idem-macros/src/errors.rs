//! Every error the attribute reports, collected so that all of them are shown at
//! once. Errors are `syn::Error`s made with `new_spanned`, which keeps the first
//! and the last token of what they point at: rustc then underlines a whole type
//! such as `Vec<u8>` or `&mut Tx`, where a single `Span` (all that stable Rust can
//! join) would underline only its first token.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;

#[derive(Debug, Default)]
pub struct Errors {
    errors: Vec<syn::Error>,
}

impl Errors {
    /// An error underlining `tokens` from their first to their last token.
    pub fn push_spanned<T: ToTokens, M: std::fmt::Display>(&mut self, tokens: T, msg: M) {
        self.errors.push(syn::Error::new_spanned(tokens, msg));
    }

    /// An error at one span.
    pub fn push_at<M: std::fmt::Display>(&mut self, span: Span, msg: M) {
        self.errors.push(syn::Error::new(span, msg));
    }

    /// An error from `first` to `last`.
    pub fn push_range<M: std::fmt::Display>(&mut self, range: (Span, Span), msg: M) {
        self.errors.push(ranged(range, msg));
    }

    pub fn push(&mut self, e: syn::Error) {
        self.errors.push(e);
    }

    pub fn push_darling(&mut self, e: darling::Error) {
        for e in e.flatten() {
            self.errors.push(e.into());
        }
    }

    /// Another collection's errors, after these.
    pub fn extend(&mut self, other: Errors) {
        self.errors.extend(other.errors);
    }

    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    #[cfg(test)]
    pub fn messages(&self) -> Vec<String> {
        self.errors.iter().map(|e| e.to_string()).collect()
    }

    pub fn to_compile_errors(&self) -> TokenStream {
        self.errors
            .iter()
            .map(syn::Error::to_compile_error)
            .collect()
    }
}

/// An error from `first` to `last`: `new_spanned` keeps both ends of the two
/// tokens it is given, where a joined `Span` would keep the first only.
pub fn ranged<M: std::fmt::Display>((first, last): (Span, Span), msg: M) -> syn::Error {
    let mut ends = proc_macro2::Ident::new("x", first).into_token_stream();
    ends.extend(proc_macro2::Ident::new("x", last).into_token_stream());
    syn::Error::new_spanned(ends, msg)
}
