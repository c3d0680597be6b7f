//! What a parameter is, read from its type and pattern: the request body (and
//! whether it is a stream or a fallible `Result`), an extractor of the
//! request's parts, or a type the attribute cannot place.

use syn::{GenericArgument, Pat, PathArguments, Type};

/// Types that read the request body (axum's `FromRequest`, not
/// `FromRequestParts`). Besides these, any generic type whose name ends in
/// `Json` or `Form` (`ValidJson<T>`), and any parameter marked `#[body]`, is the
/// body. A name so ending without a type argument (`AcceptJson`, a guard of the
/// request's headers) is not taken for one: it is placed as any other
/// extractor is (last, through the probe).
const BODY_EXTRACTORS: &[&str] = &["Json", "Form", "Bytes", "String", "RawForm"];

/// Bodies that are streams: there is no value to fingerprint before the claim.
const STREAMING_BODIES: &[&str] = &["Body", "Request", "Multipart"];

/// Extractors of the request's parts (never the body).
const PARTS_EXTRACTORS: &[&str] = &[
    "State",
    "Path",
    "Query",
    "Extension",
    "HeaderMap",
    "Method",
    "Uri",
    "OriginalUri",
    "MatchedPath",
    "ConnectInfo",
    "TypedHeader",
    "Host",
    "RawQuery",
    "RawPathParams",
    "NestedPath",
    "Version",
    "Parts",
    "Extensions",
    "CookieJar",
    "PrivateCookieJar",
    "SignedCookieJar",
    "WebSocketUpgrade",
    "Scheme",
];

/// What a parameter is, from its type and pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    /// Reads the body; `streaming`: has no value to fingerprint.
    Body {
        streaming: bool,
        result: bool,
    },
    Parts,
    Unknown,
}

pub(crate) fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Paren(p) => last_segment(&p.elem),
        Type::Group(g) => last_segment(&g.elem),
        _ => None,
    }
}

pub(crate) fn first_type_arg(seg: &syn::PathSegment) -> Option<&Type> {
    match &seg.arguments {
        PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
            GenericArgument::Type(t) => Some(t),
            _ => None,
        }),
        _ => None,
    }
}

fn classify_type(ty: &Type) -> Class {
    let Some(seg) = last_segment(ty) else {
        return Class::Unknown;
    };
    let name = seg.ident.to_string();
    if name == "Option" || name == "Result" {
        return match first_type_arg(seg).map(classify_type) {
            Some(Class::Body { streaming, .. }) => Class::Body {
                streaming,
                result: name == "Result",
            },
            Some(Class::Parts) => Class::Parts,
            _ => Class::Unknown,
        };
    }
    if STREAMING_BODIES.contains(&name.as_str()) {
        Class::Body {
            streaming: true,
            result: false,
        }
    } else if BODY_EXTRACTORS.contains(&name.as_str())
        || (first_type_arg(seg).is_some() && body_like(&name))
    {
        Class::Body {
            streaming: false,
            result: false,
        }
    } else if PARTS_EXTRACTORS.contains(&name.as_str()) {
        Class::Parts
    } else {
        Class::Unknown
    }
}

/// A name a body extractor of the application's may have (`ValidJson`).
fn body_like(name: &str) -> bool {
    name.ends_with("Json") || name.ends_with("Form")
}

pub(super) fn classify(arg: &syn::PatType) -> Class {
    let by_type = classify_type(&arg.ty);
    let marked = arg.attrs.iter().any(|a| a.path().is_ident("body"));
    match by_type {
        Class::Body { .. } => by_type,
        _ if marked => Class::Body {
            streaming: false,
            result: matches!(last_segment(&arg.ty), Some(s) if s.ident == "Result"),
        },
        Class::Unknown => {
            // `Json(cmd): OrderBody`: the pattern names the extractor an alias hides.
            if let Pat::TupleStruct(p) = &*arg.pat {
                let name = p
                    .path
                    .segments
                    .last()
                    .map(|s| s.ident.to_string())
                    .unwrap_or_default();
                // An alias hides the type's arguments; a pattern named as its
                // type (`AcceptJson(x): AcceptJson`) is no alias.
                let aliased = last_segment(&arg.ty).is_none_or(|s| s.ident != name);
                if BODY_EXTRACTORS.contains(&name.as_str()) || (aliased && body_like(&name)) {
                    return Class::Body {
                        streaming: false,
                        result: false,
                    };
                }
                if STREAMING_BODIES.contains(&name.as_str()) {
                    return Class::Body {
                        streaming: true,
                        result: false,
                    };
                }
                if PARTS_EXTRACTORS.contains(&name.as_str()) {
                    return Class::Parts;
                }
            }
            Class::Unknown
        }
        Class::Parts => Class::Parts,
    }
}
