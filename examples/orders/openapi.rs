//! The service's own part of its OpenAPI document, beyond each route's
//! `#[utoipa::path]`: the answers every route can give because of what runs
//! around its handler (the edges layer in `server.rs`, the extractors in
//! `auth.rs` and `input.rs`), and the bearer authentication they check. Written
//! once here, from each operation's shape, as idem writes its own part
//! (`IdemOpenApi`, which runs after this and adds its answers to these).
//!
//! Every error answer of the service is `application/problem+json` (the edges
//! layer turns any other into one), so each error response of the document
//! gets the schema [`PROBLEM`] when its route did not give one.

use utoipa::Modify;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    Components, Content, Header, ObjectBuilder, OpenApi, Ref, RefOr, Response, Schema,
    SchemaFormat, Type,
};

use crate::problems::BUSY;
use crate::server::{MAX_HEAD_BYTES, MAX_HEADERS};

/// The component schema of the service's problem documents.
pub const PROBLEM: &str = "Problem";

/// The security scheme of `Authorization: Bearer <tenant>`.
const BEARER: &str = "tenant";

const MEDIA_TYPE: &str = "application/problem+json";
const INVALID: &str = "urn:orders:problem:invalid-request";

/// The utoipa modifier: `#[openapi(modifiers(&OrdersAnswers, &IdemOpenApi))]`.
pub struct OrdersAnswers;

impl Modify for OrdersAnswers {
    fn modify(&self, api: &mut OpenApi) {
        let components = api.components.get_or_insert_with(Components::new);
        components
            .schemas
            .entry(PROBLEM.to_owned())
            .or_insert_with(|| problem_schema().into());
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "`Authorization: Bearer <tenant>`, the tenant matching `[a-z0-9-]{1,64}` \
                         (a demo: the token is the tenant's name). The tenant is the idempotency \
                         scope.",
                    ))
                    .build(),
            ),
        );
        // Every route in the document is the tenant's (`GET /openapi.json`, which
        // is not, is not in it).
        api.security = Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
        for item in api.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for op in operations.into_iter().flatten() {
                annotate(op);
            }
        }
    }
}

/// Adds to one operation what its shape says it can answer besides its own.
fn annotate(op: &mut Operation) {
    let params = op.parameters.as_deref().unwrap_or_default();
    let has_path_id = params.iter().any(|p| p.parameter_in == ParameterIn::Path);
    let has_currency = params.iter().any(|p| {
        p.parameter_in == ParameterIn::Header && p.name.eq_ignore_ascii_case("x-currency")
    });
    let has_body = op.request_body.is_some();

    add(
        op,
        "401",
        "No usable `Authorization: Bearer <tenant>` header; nothing was done.",
        "urn:orders:problem:unauthorized",
        false,
    );
    if has_path_id {
        add(
            op,
            "400",
            "The order id in the path is not a whole number that fits 64 bits (signed); nothing was done.",
            INVALID,
            false,
        );
    }
    if has_currency {
        add(
            op,
            "400",
            "The `X-Currency` header is missing or not three upper-case letters; nothing was done.",
            INVALID,
            false,
        );
    }
    if has_body {
        add(
            op,
            "400",
            "The body is not JSON; nothing was done.",
            INVALID,
            false,
        );
        add(
            op,
            "408",
            "The body did not arrive in time (`ORDERS_BODY_TIMEOUT_MS`); nothing was done.",
            INVALID,
            false,
        );
        add(
            op,
            "413",
            "The body is over 512 KiB; nothing was done.",
            INVALID,
            false,
        );
        add(
            op,
            "415",
            "The body is not sent as `Content-Type: application/json` (parameters allowed); \
             nothing was done.",
            INVALID,
            false,
        );
        add(
            op,
            "422",
            "The body is JSON of the wrong shape or values; nothing was done.",
            INVALID,
            false,
        );
    }
    add(
        op,
        "431",
        &format!(
            "The request has over {MAX_HEADERS} header fields or {} KiB of request line and \
             headers; nothing was done, and the connection is closed.",
            MAX_HEAD_BYTES / 1024
        ),
        "urn:orders:problem:headers-too-large",
        false,
    );
    add(
        op,
        "503",
        "The database is unavailable; nothing was done. The same request may be sent again \
         after `Retry-After`.",
        idem_runtime::problem::STORE_UNAVAILABLE,
        true,
    );
    // Where the route names it in its own words (the fulfilment steps), they stay.
    let busy_named = matches!(
        op.responses.responses.get("503"),
        Some(RefOr::T(r)) if r.description.contains(BUSY)
    );
    if !busy_named {
        add(
            op,
            "503",
            "Another writer held the database's write lock (SQLite) or the row's (MySQL) \
             past the wait; nothing changed. The same request may be sent again after \
             `Retry-After`.",
            BUSY,
            true,
        );
    }
    // The routes' own error answers (404, 409, ...) are problem documents too.
    for (status, response) in &mut op.responses.responses {
        if let RefOr::T(response) = response
            && is_error(status)
            && response.content.is_empty()
        {
            response
                .content
                .insert(MEDIA_TYPE.to_owned(), problem_content());
        }
    }
}

fn is_error(status: &str) -> bool {
    status.starts_with('4') || status.starts_with('5')
}

/// One more answer under `status`: a response of its own, or a sentence more
/// in the one the route (or an earlier call) declared. With `Retry-After`
/// when `retry_after`.
fn add(op: &mut Operation, status: &str, what: &str, problem: &str, retry_after: bool) {
    let sentence = format!("{what} Problem type `{problem}`.");
    let response = op
        .responses
        .responses
        .entry(status.to_owned())
        .or_insert_with(|| RefOr::T(Response::new("")));
    let RefOr::T(response) = response else {
        return;
    };
    if !response.description.contains(&sentence) {
        if !response.description.is_empty() {
            response.description.push(' ');
        }
        response.description.push_str(&sentence);
    }
    if response.content.is_empty() {
        response
            .content
            .insert(MEDIA_TYPE.to_owned(), problem_content());
    }
    if retry_after && !response.headers.contains_key("Retry-After") {
        response.headers.insert(
            "Retry-After".to_owned(),
            Header::builder()
                .schema(
                    ObjectBuilder::new()
                        .schema_type(Type::Integer)
                        .minimum(Some(1)),
                )
                .description(Some("Seconds to wait before sending the request again."))
                .build(),
        );
    }
}

fn problem_content() -> Content {
    Content::new(Some(Ref::from_schema_name(PROBLEM)))
}

/// RFC 9457's problem object, as `idem_runtime::Problem` writes it (the
/// service answers with that type too).
fn problem_schema() -> Schema {
    let field = |ty: Type, description: &str| {
        ObjectBuilder::new()
            .schema_type(ty)
            .description(Some(description))
    };
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "A problem document (RFC 9457): every error answer of the service, and of idem.",
        ))
        .property(
            "type",
            field(
                Type::String,
                "What went wrong, one stable URI per kind (`urn:orders:problem:...`, idem's \
                 `urn:idem:problem:...`, or `about:blank` for an unknown route or method).",
            )
            .format(Some(SchemaFormat::Custom("uri".to_owned()))),
        )
        .required("type")
        .property(
            "title",
            field(Type::String, "A short summary of the kind of problem."),
        )
        .required("title")
        .property(
            "status",
            field(Type::Integer, "The answer's HTTP status code."),
        )
        .required("status")
        .property(
            "detail",
            field(Type::String, "What went wrong with this request."),
        )
        .property(
            "retry_after",
            field(
                Type::Integer,
                "Seconds to wait before retrying, as in `Retry-After`.",
            )
            .minimum(Some(1)),
        )
        .into()
}
