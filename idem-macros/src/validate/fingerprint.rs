//! `fingerprint(...)`: its headers and body fields, and what of the body goes
//! into the fingerprint (the whole body by default); a stream cannot be
//! fingerprinted, and a body left out must be left out in writing.

use proc_macro2::Span;

use super::BodyPrint;
use super::extractors::Class;
use crate::errors::Errors;
use crate::parse::Fingerprint;

/// The body parameter as `parameters` placed it.
pub(super) struct Body<'a> {
    /// A recognised body: its index, class and tokens.
    pub(super) param: Option<(usize, Class, Option<&'a syn::PatType>)>,
    /// Else a last parameter that may be one (an alias, probed by its type).
    pub(super) maybe: Option<usize>,
}

impl Body<'_> {
    fn index(&self) -> Option<usize> {
        self.param.map(|(i, _, _)| i).or(self.maybe)
    }

    /// A stream cannot be fingerprinted before the claim: refused, saying why
    /// it would have to be.
    fn refuse_a_stream(&self, errors: &mut Errors, why: &str) {
        if let Some((
            _,
            Class::Body {
                streaming: true, ..
            },
            Some(arg),
        )) = self.param
        {
            errors.push_spanned(
                &arg.ty,
                format!(
                    "this body is a stream, which idem cannot fingerprint before the claim ({why}): take `Bytes` (fingerprinted byte for byte), `Json<T>` or `Form<T>` instead, or write `fingerprint(ignore_body)` to leave the body out (with `header = \"...\"` to identify the request by its headers)"
                ),
            );
        }
    }
}

/// The headers fingerprinted (lower case) and what of the body is, checked in
/// steps: the headers, the field paths, the body options together, and then
/// what they make of the handler's body.
pub(super) fn check_fingerprint(
    fp: Option<Fingerprint>,
    body: &Body,
    errors: &mut Errors,
) -> (Vec<String>, BodyPrint) {
    let Some(fp) = fp else {
        return (Vec::new(), default_print(body, errors));
    };
    let headers = check_headers(&fp, errors);
    let fields = check_fields(&fp, errors);
    check_body_options(&fp, errors);
    let print = body_print(&fp, body, fields, &headers, errors);
    (headers, print)
}

/// Documented default, without `fingerprint(...)`: the whole body when there
/// is one.
fn default_print(body: &Body, errors: &mut Errors) -> BodyPrint {
    match (body.param, body.maybe) {
        (Some((i, _, _)), _) => {
            body.refuse_a_stream(
                errors,
                "without `fingerprint(...)`, the whole body is part of the fingerprint",
            );
            BodyPrint::Whole(i)
        }
        (None, Some(i)) => BodyPrint::Probe(i),
        (None, None) => BodyPrint::None,
    }
}

/// Valid header names, not the key, each once.
fn check_headers(fp: &Fingerprint, errors: &mut Errors) -> Vec<String> {
    let mut headers: Vec<String> = Vec::new();
    for h in &fp.header {
        let lower = h.as_str().to_ascii_lowercase();
        let mut err = |msg: String| errors.push_at(h.span(), msg);
        if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
            err(format!(
                "{:?} is not a valid HTTP header name: header names are tokens such as \"x-currency\"",
                h.as_str()
            ));
        } else if lower == "idempotency-key" {
            err(
                "the Idempotency-Key is the key itself, not part of the fingerprint: remove this header".into(),
            );
        } else if headers.contains(&lower) {
            err(format!(
                "the header {:?} is listed twice: remove one",
                h.as_str()
            ));
        } else {
            headers.push(lower);
        }
    }
    headers
}

/// Field paths of identifiers and tuple indices, each once: their segments
/// and the span of the first.
fn check_fields(fp: &Fingerprint, errors: &mut Errors) -> Vec<(Vec<String>, Span)> {
    let mut fields: Vec<(Vec<String>, Span)> = Vec::new();
    for f in &fp.fields {
        let segments: Vec<String> = f.as_str().split('.').map(str::to_owned).collect();
        let bad = segments
            .iter()
            .find(|s| syn::parse_str::<syn::Ident>(s).is_err() && s.parse::<u32>().is_err());
        if let Some(bad) = bad {
            // A field named by a keyword (`type`) is written raw, as in Rust.
            let keyword = syn::parse_str::<syn::Ident>(&format!("r#{bad}")).is_ok();
            let hint = if keyword {
                format!("`{bad}` is a keyword: a field named so is written `r#{bad}`, as in Rust")
            } else {
                "write `body.field` or `body.field.subfield`".to_owned()
            };
            errors.push_at(
                f.span(),
                format!("`body.{}` is not a field path: {hint}", f.as_str()),
            );
        } else if fields.iter().any(|(s, _)| s == &segments) {
            errors.push_at(
                f.span(),
                format!("`body.{}` is listed twice: remove one", f.as_str()),
            );
        } else {
            fields.push((segments, f.span()));
        }
    }
    fields
}

/// `body`, `body.<field>` and `ignore_body` exclude one another.
fn check_body_options(fp: &Fingerprint, errors: &mut Errors) {
    if fp.body.is_present() && !fp.fields.is_empty() {
        errors.push_at(
            fp.body.span(),
            "`body` already fingerprints the whole body: remove either `body` or the `body.<field>` paths",
        );
    }
    if fp.ignore_body.is_present() && wants_body(fp) {
        errors.push_at(
            fp.ignore_body.span(),
            "`ignore_body` contradicts `body`: keep `body` (or `body.<field>`) to fingerprint the body, or `ignore_body` to leave it out",
        );
    }
}

fn wants_body(fp: &Fingerprint) -> bool {
    fp.body.is_present() || !fp.fields.is_empty()
}

/// What of the handler's body the options fingerprint; a body must be there
/// when they ask for it, and left out in writing when they do not.
fn body_print(
    fp: &Fingerprint,
    body: &Body,
    fields: Vec<(Vec<String>, Span)>,
    headers: &[String],
    errors: &mut Errors,
) -> BodyPrint {
    let Some(param) = body.index() else {
        if wants_body(fp) {
            errors.push_range(
                fp.span,
                "`fingerprint(body...)` needs a body: add a body extractor such as `Json<T>` or `Form<T>` as the last parameter, or remove `body` from `fingerprint(...)`",
            );
        } else if fp.ignore_body.is_present() {
            errors.push_at(
                fp.ignore_body.span(),
                "`ignore_body`, but the handler reads no body: remove `ignore_body`",
            );
        }
        return BodyPrint::None;
    };
    if fp.ignore_body.is_present() {
        return BodyPrint::None;
    }
    if fp.body.is_present() {
        body.refuse_a_stream(errors, "`fingerprint(body)` asks for it");
        return if body.param.is_some() {
            BodyPrint::Whole(param)
        } else {
            BodyPrint::ProbeNamed(param)
        };
    }
    if !fields.is_empty() {
        body.refuse_a_stream(errors, "`fingerprint(body.<field>)` asks for it");
        return BodyPrint::Fields(param, fields);
    }
    // Every field was refused above, or an item was: what it meant is
    // unknown, nothing more to judge.
    if !fp.fields.is_empty() || fp.refused {
        return BodyPrint::None;
    }
    // Headers only, and the handler has a body: leaving it out must be written.
    if body.param.is_some() {
        errors.push_range(fp.span, left_out(headers));
        return BodyPrint::None;
    }
    BodyPrint::ProbeLeftOut(param)
}

/// The body left out without saying so, with the two ways to say what is
/// meant (repeating the headers that were accepted).
fn left_out(headers: &[String]) -> String {
    let written = |first: Option<&str>, last: Option<&str>| {
        let items: Vec<String> = first
            .map(str::to_owned)
            .into_iter()
            .chain(headers.iter().map(|h| format!("header = {h:?}")))
            .chain(last.map(str::to_owned))
            .collect();
        format!("fingerprint({})", items.join(", "))
    };
    format!(
        "`{}` leaves the request body out of the fingerprint, so a retry with the same key and another body would replay the first answer: write `{}` to make the body part of the request's identity, or `{}` if the body does not identify the request",
        written(None, None),
        written(Some("body"), None),
        written(None, Some("ignore_body")),
    )
}
