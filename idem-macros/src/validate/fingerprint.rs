//! `fingerprint(...)`: its headers and body fields, and what of the body goes
//! into the fingerprint (the whole body by default); a stream cannot be
//! fingerprinted, and a body left out must be left out in writing.

use proc_macro2::Span;

use super::BodyPrint;
use super::extractors::Class;
use crate::errors::Errors;
use crate::parse::RawFingerprint;

pub(super) fn check_fingerprint(
    fp: Option<RawFingerprint>,
    fp_span: Option<(Span, Span)>,
    refused: bool,
    body_param: Option<(usize, Class, Option<&syn::PatType>)>,
    maybe_body: Option<usize>,
    errors: &mut Errors,
) -> (Vec<String>, BodyPrint) {
    let streaming = |errors: &mut Errors, why: &str| {
        if let Some((
            _,
            Class::Body {
                streaming: true, ..
            },
            Some(arg),
        )) = body_param
        {
            errors.push_spanned(
                &arg.ty,
                format!(
                    "this body is a stream, which idem cannot fingerprint before the claim ({why}): take `Bytes` (fingerprinted byte for byte), `Json<T>` or `Form<T>` instead, or write `fingerprint(ignore_body)` to leave the body out (with `header = \"...\"` to identify the request by its headers)"
                ),
            );
        }
    };
    let Some(fp) = fp else {
        // Documented default: the whole body when there is one.
        return (
            Vec::new(),
            match (body_param, maybe_body) {
                (Some((i, _, _)), _) => {
                    streaming(
                        errors,
                        "without `fingerprint(...)`, the whole body is part of the fingerprint",
                    );
                    BodyPrint::Whole(i)
                }
                (None, Some(i)) => BodyPrint::Probe(i),
                (None, None) => BodyPrint::None,
            },
        );
    };
    let at_fingerprint = |errors: &mut Errors, msg: String| match fp_span {
        Some(range) => errors.push_range(range, msg),
        None => errors.push_at(Span::call_site(), msg),
    };
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
    // The suggestions below repeat the headers that were accepted.
    let header_list = headers
        .iter()
        .map(|h| format!("header = {h:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let with = |first: &str| {
        if header_list.is_empty() {
            format!("fingerprint({first})")
        } else {
            format!("fingerprint({first}, {header_list})")
        }
    };
    let param = body_param.map(|(i, _, _)| i).or(maybe_body);
    let mut fields = Vec::new();
    for f in &fp.fields {
        let segments: Vec<String> = f.as_str().split('.').map(str::to_owned).collect();
        if segments
            .iter()
            .any(|s| syn::parse_str::<syn::Ident>(s).is_err() && s.parse::<u32>().is_err())
        {
            errors.push_at(
                f.span(),
                format!(
                    "`body.{}` is not a field path: write `body.field` or `body.field.subfield`",
                    f.as_str()
                ),
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
    let wants_body = fp.body.is_present() || !fp.fields.is_empty();
    if fp.body.is_present() && !fp.fields.is_empty() {
        errors.push_at(
            fp.body.span(),
            "`body` already fingerprints the whole body: remove either `body` or the `body.<field>` paths",
        );
    }
    if fp.ignore_body.is_present() && wants_body {
        errors.push_at(
            fp.ignore_body.span(),
            "`ignore_body` contradicts `body`: keep `body` (or `body.<field>`) to fingerprint the body, or `ignore_body` to leave it out",
        );
    }
    let Some(param) = param else {
        if wants_body {
            at_fingerprint(
                errors,
                "`fingerprint(body...)` needs a body: add a body extractor such as `Json<T>` or `Form<T>` as the last parameter, or remove `body` from `fingerprint(...)`".to_owned(),
            );
        } else if fp.ignore_body.is_present() {
            errors.push_at(
                fp.ignore_body.span(),
                "`ignore_body`, but the handler reads no body: remove `ignore_body`",
            );
        }
        return (headers, BodyPrint::None);
    };
    if fp.ignore_body.is_present() {
        return (headers, BodyPrint::None);
    }
    if fp.body.is_present() {
        streaming(errors, "`fingerprint(body)` asks for it");
        return (headers, BodyPrint::Whole(param));
    }
    if !fields.is_empty() {
        streaming(errors, "`fingerprint(body.<field>)` asks for it");
        return (headers, BodyPrint::Fields(param, fields));
    }
    if !fp.fields.is_empty() {
        // Every field was refused above.
        return (headers, BodyPrint::None);
    }
    if refused {
        // What the refused item meant is unknown: nothing more to judge.
        return (headers, BodyPrint::None);
    }
    // Headers only, and the handler has a body: leaving it out must be written.
    if body_param.is_some() {
        at_fingerprint(
            errors,
            format!(
                "`{}` leaves the request body out of the fingerprint, so a retry with the same key and another body would replay the first answer: write `{}` to make the body part of the request's identity, or `{}` if the body does not identify the request",
                if header_list.is_empty() {
                    "fingerprint()".to_owned()
                } else {
                    format!("fingerprint({header_list})")
                },
                with("body"),
                if header_list.is_empty() {
                    "fingerprint(ignore_body)".to_owned()
                } else {
                    format!("fingerprint({header_list}, ignore_body)")
                },
            ),
        );
        return (headers, BodyPrint::None);
    }
    (headers, BodyPrint::ProbeLeftOut(param))
}
