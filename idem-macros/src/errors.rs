//! Every error the attribute reports, collected so that all of them are shown at
//! once. Errors are `syn::Error`s made with `new_spanned`, which keeps the first
//! and the last token of what they point at: rustc then underlines a whole type
//! such as `Vec<u8>` or `&mut Tx`, where a single `Span` (all that stable Rust can
//! join) would underline only its first token.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;

#[derive(Default)]
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
    pub fn push_range<M: std::fmt::Display>(&mut self, (first, last): (Span, Span), msg: M) {
        let mut start = proc_macro2::Ident::new("x", first).into_token_stream();
        start.extend(proc_macro2::Ident::new("x", last).into_token_stream());
        self.errors.push(syn::Error::new_spanned(start, msg));
    }

    pub fn push(&mut self, e: syn::Error) {
        self.errors.push(e);
    }

    pub fn push_darling(&mut self, e: darling::Error) {
        for e in e.flatten() {
            self.errors.push(e.into());
        }
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
