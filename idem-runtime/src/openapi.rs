//! OpenAPI: what idem adds to every `#[idempotent]` operation, written into the
//! document a service already builds with [utoipa] 5.
//!
//! One call, [`document`] (or the modifier [`IdemOpenApi`]), gives each operation
//! of an `#[idempotent]` handler
//!
//! * the required request header `Idempotency-Key` (a string of at most
//!   [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) characters, with the `pattern`
//!   of both its spellings, and what a retry gets);
//! * the response header `Idempotent-Replayed` on each of the handler's own
//!   responses (a replay is the stored answer, marked `true`);
//! * the answers idem gives in the handler's place: `400` (no usable key), `409`
//!   with `Retry-After` (the first request with the key is still running), `422`
//!   (the key was used for another request), `503` with `Retry-After` (the store
//!   failed or stayed busy; for leased operations also the running limit was
//!   full) and, for leased operations, `202` with `Retry-After` (the outcome is
//!   uncertain and being reconciled), each an `application/problem+json` document
//!   of the schema [`PROBLEM_SCHEMA`], added to the components;
//! * for a long operation (`accepted`), its `202` with `Location` and
//!   `Retry-After`: an `application/json` document of the schema
//!   [`OPERATION_SCHEMA`] (the operation resource's, see
//!   [`crate::operations`]), or the uncertain problem above.
//!
//! The handler's own responses stay as the service wrote them. Where the
//! service declared a status idem answers too (its own `400` or `422` for bad
//! input, its `503`), the response is both: idem adds its sentence to the
//! service's description, and its media type and headers where the service's
//! response has none (a media type both have keeps the service's schema, which
//! then describes idem's problem document too). Every answer idem can give is
//! thus declared, but its `500`s, which are server faults like any other.
//! Operations of other handlers are not touched.
//!
//! **Which operations.** The attribute cannot see routes, so every
//! `#[idempotent]` handler registers itself, by its function's name and its
//! `operation`, when the program starts. An operation of the document is
//! idempotent when its `operationId` is one of those names: `#[utoipa::path]`'s
//! default `operationId` is the function's name, so it matches as written (an
//! explicit `operation_id` may name the idem operation instead). Two handlers
//! of the same name are one for this purpose: give an idempotent handler a name
//! (or an `operation_id`) no other handler of the document has.
//!
//! **Attribute order.** Put `#[utoipa::path]` above `#[idempotent]`: utoipa then
//! reads the handler as written, and its doc comment without the section the
//! attribute adds. (The other order compiles too.)
//!
//! ```
//! # #[cfg(feature = "postgres")]
//! # mod demo {
//! use sqlx::Postgres;
//! use axum::Json;
//! use axum::http::StatusCode;
//! use idem_runtime::{SingleTenant, Tx, idempotent};
//! use utoipa::OpenApi;
//!
//! /// Creates an order.
//! #[utoipa::path(post, path = "/orders", responses((status = 201, description = "created")))]
//! #[idempotent(operation = "create-order", retention = "24h", single_tenant)]
//! async fn create_order(tx: &mut Tx<Postgres>, Json(order): Json<serde_json::Value>) -> StatusCode {
//!     StatusCode::CREATED
//! }
//!
//! // utoipa's `modifiers(&Name)` takes a name, not a path.
//! use idem_runtime::openapi::IdemOpenApi;
//!
//! #[derive(OpenApi)]
//! #[openapi(paths(create_order), modifiers(&IdemOpenApi))]
//! struct ApiDoc;
//!
//! pub fn check() {
//!     let api = ApiDoc::openapi();
//!     let post = api.paths.paths["/orders"].post.as_ref().unwrap();
//!     let key = &post.parameters.as_ref().unwrap()[0];
//!     assert_eq!(key.name, "Idempotency-Key");
//!     assert!(post.responses.responses.contains_key("409"));
//! }
//! # }
//! # fn main() {
//! # #[cfg(feature = "postgres")]
//! # demo::check();
//! # }
//! ```

use std::collections::BTreeSet;
use std::time::Duration;

use axum::http::header::{LOCATION, RETRY_AFTER};
use utoipa::openapi::path::{Operation, Parameter, ParameterIn};
use utoipa::openapi::{
    Components, Content, Header, ObjectBuilder, OpenApi, Ref, RefOr, Required, Response, Schema,
    SchemaFormat, Type,
};

use crate::handler::OperationSpec;

/// The name of the component schema of idem's problem documents
/// (`#/components/schemas/IdemProblem`), which [`document`] adds.
pub const PROBLEM_SCHEMA: &str = "IdemProblem";

/// The name of the component schema of a long operation's document
/// (`#/components/schemas/IdemOperation`, [`crate::operations::Operation`]),
/// which [`document`] adds when an operation is `accepted`.
pub const OPERATION_SCHEMA: &str = "IdemOperation";

/// One `#[idempotent]` handler, registered by the attribute from the handler's
/// body (the attribute sees neither the route nor, for an associated function,
/// a place beside the handler for an item of its own).
#[doc(hidden)]
pub struct OpenApiRegistration {
    handler: &'static str,
    spec: &'static OperationSpec,
}

impl OpenApiRegistration {
    /// The handler's function name and its operation.
    pub const fn new(handler: &'static str, spec: &'static OperationSpec) -> Self {
        OpenApiRegistration { handler, spec }
    }
}

inventory::collect!(OpenApiRegistration);

/// Registers an `#[idempotent]` handler for [`document`]; the attribute emits it
/// in the generated handler's body. Without the feature it expands to nothing.
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_openapi {
    ($handler:expr, $spec:expr) => {
        $crate::__private::inventory::submit! {
            $crate::__private::OpenApiRegistration::new($handler, $spec)
        }
    };
}

/// The utoipa modifier that applies [`document`]:
/// `#[openapi(modifiers(&IdemOpenApi))]`.
///
/// ```
/// use idem_runtime::openapi::IdemOpenApi;
/// use utoipa::OpenApi;
///
/// #[derive(OpenApi)]
/// #[openapi(modifiers(&IdemOpenApi))]
/// struct ApiDoc;
///
/// // No idempotent operation in this document: nothing is added.
/// let api = ApiDoc::openapi();
/// assert!(api.components.is_none_or(|c| !c.schemas.contains_key("IdemProblem")));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct IdemOpenApi;

impl utoipa::Modify for IdemOpenApi {
    fn modify(&self, api: &mut OpenApi) {
        document(api);
    }
}

/// Adds what idem answers to every operation of `api` that is an
/// `#[idempotent]` handler's (see the [module](self) for which ones and what).
///
/// Only adds: a parameter or header the document already has is left as it
/// is, and a response status it already has keeps what it says, idem's answer
/// added to it; calling it twice changes nothing more. A response given as a
/// `$ref` is shared with other operations: it gets neither idem's answer nor
/// the `Idempotent-Replayed` header (write the status in the operation).
///
/// ```
/// use utoipa::openapi::path::{HttpMethod, OperationBuilder};
/// use utoipa::openapi::{OpenApiBuilder, PathItem, Paths, ResponseBuilder};
///
/// // A document built by hand, with one operation no handler registered.
/// let get = OperationBuilder::new()
///     .operation_id(Some("list_orders"))
///     .response("200", ResponseBuilder::new().description("the orders"));
/// let mut api = OpenApiBuilder::new()
///     .paths(Paths::builder().path("/orders", PathItem::new(HttpMethod::Get, get)))
///     .build();
/// let before = api.clone();
///
/// idem_runtime::openapi::document(&mut api);
/// assert!(api == before);
/// ```
pub fn document(api: &mut OpenApi) {
    let registered: Vec<&'static OpenApiRegistration> =
        inventory::iter::<OpenApiRegistration>().collect();
    document_with(api, &registered);
}

/// [`document`] with the registrations given, so the tests choose them.
fn document_with(api: &mut OpenApi, registered: &[&OpenApiRegistration]) {
    let mut any = false;
    let mut accepted = false;
    for item in api.paths.paths.values_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ];
        for op in operations.into_iter().flatten() {
            if let Some(facts) = Facts::of(op, registered) {
                annotate(op, &facts);
                any = true;
                accepted |= facts.accepted;
            }
        }
    }
    if any {
        let schemas = &mut api.components.get_or_insert_with(Components::new).schemas;
        schemas
            .entry(PROBLEM_SCHEMA.to_owned())
            .or_insert_with(|| problem_schema().into());
        if accepted {
            schemas
                .entry(OPERATION_SCHEMA.to_owned())
                .or_insert_with(|| operation_schema().into());
        }
    }
}

/// What the handlers registered under an operation's id say about it. Handlers
/// of one name are taken together: leased (or accepted) if any is.
struct Facts {
    leased: bool,
    /// A long operation: `202` with its operation resource.
    accepted: bool,
    headers: BTreeSet<&'static str>,
    /// Only when every such handler keeps its outcomes equally long.
    retention: Option<Duration>,
}

impl Facts {
    fn of(op: &Operation, registered: &[&OpenApiRegistration]) -> Option<Facts> {
        let id = op.operation_id.as_deref()?;
        let mut matching = registered
            .iter()
            .filter(|r| r.handler == id || r.spec.operation == id)
            .peekable();
        let first = matching.peek()?.spec.retention;
        let mut facts = Facts {
            leased: false,
            accepted: false,
            headers: BTreeSet::new(),
            retention: Some(first),
        };
        for r in matching {
            facts.leased |= r.spec.lease.is_some();
            facts.accepted |= r.spec.accepted;
            facts.headers.extend(r.spec.fingerprint_headers);
            if facts.retention != Some(r.spec.retention) {
                facts.retention = None;
            }
        }
        Some(facts)
    }
}

fn annotate(op: &mut Operation, facts: &Facts) {
    let key = title_case(idem_wire::IDEMPOTENCY_KEY);
    let params = op.parameters.get_or_insert_with(Vec::new);
    if !params
        .iter()
        .any(|p| p.parameter_in == ParameterIn::Header && p.name.eq_ignore_ascii_case(&key))
    {
        params.insert(0, key_parameter(&key, facts));
    }

    // The handler's own responses (idem's, from an earlier call, are not): a
    // replay of each is marked.
    let replayed = title_case(idem_wire::IDEMPOTENT_REPLAYED);
    for response in op.responses.responses.values_mut() {
        if let RefOr::T(response) = response
            && !is_idem_answer(response)
            && !response
                .headers
                .keys()
                .any(|h| h.eq_ignore_ascii_case(&replayed))
        {
            response.headers.insert(replayed.clone(), replayed_header());
        }
    }

    // A status the service declared too is one answer of two origins: the
    // service's stays as written, and idem's is added to it.
    let mut add = |status: &str, response: Response| match op.responses.responses.get_mut(status) {
        None => {
            op.responses
                .responses
                .insert(status.to_owned(), RefOr::T(response));
        }
        Some(RefOr::T(own)) => merge(own, response),
        // Shared with other operations (in the components): idem's answer is
        // this operation's alone, and cannot be written there.
        Some(RefOr::Ref(_)) => {}
    };
    add(
        "400",
        problem_response(
            "The `Idempotency-Key` header is missing or malformed; nothing was done. \
             Fix the key and send the request again.",
            &[
                idem_wire::problem::MISSING_KEY,
                idem_wire::problem::MALFORMED_KEY,
            ],
            None,
        ),
    );
    add(
        "409",
        problem_response(
            "A request with this key is still being processed; nothing was done. \
             Retry with the same key after `Retry-After`.",
            &[idem_wire::problem::IN_FLIGHT],
            Some("Seconds to wait before retrying with the same key."),
        ),
    );
    add(
        "422",
        problem_response(
            "This key was used for a different request; nothing was done. \
             A new request needs a new key.",
            &[idem_wire::problem::FINGERPRINT_MISMATCH],
            None,
        ),
    );
    add(
        "503",
        if facts.leased {
            problem_response(
                "The idempotency store is unavailable or busy, or the operation already runs \
                 as many executions as its running limit allows; nothing was stored or \
                 reserved (or the key's stored outcome could not be read, and it does not \
                 run again; or whether another request finished the key could not be \
                 read). Retrying with the same key after `Retry-After` is safe.",
                &[
                    idem_wire::problem::STORE_UNAVAILABLE,
                    idem_wire::problem::STORE_BUSY,
                    idem_wire::problem::AT_CAPACITY,
                ],
                Some("Seconds to wait before retrying with the same key."),
            )
        } else {
            problem_response(
                "The idempotency store is unavailable or busy; nothing was stored or \
                 reserved (or the key's stored outcome could not be read, and it does not \
                 run again; or whether another request finished the key could not be \
                 read). Retrying with the same key after `Retry-After` is safe.",
                &[
                    idem_wire::problem::STORE_UNAVAILABLE,
                    idem_wire::problem::STORE_BUSY,
                ],
                Some("Seconds to wait before retrying with the same key."),
            )
        },
    );
    if facts.accepted {
        add("202", accepted_response());
    } else if facts.leased {
        add(
            "202",
            problem_response(
                "An earlier attempt with this key may have taken effect; its outcome is \
                 being reconciled and it will not run again meanwhile. Retry with the \
                 same key after `Retry-After` until a final answer comes.",
                &[idem_wire::problem::OUTCOME_UNCERTAIN],
                Some("Seconds to wait before asking again with the same key."),
            ),
        );
    }
}

/// Adds idem's answer to a response the service declared for the same status:
/// its description after the service's, and the media types and headers the
/// service's does not have. A media type both have keeps the service's schema,
/// which then describes idem's document too (idem's is
/// [`PROBLEM_SCHEMA`]: `type`, `title`, `status`, `detail`, `retry_after`).
/// Merging twice adds nothing more.
fn merge(own: &mut Response, idem: Response) {
    if own.description.contains(&idem.description) {
        return;
    }
    own.description = if own.description.is_empty() {
        idem.description
    } else {
        format!("{} Or: {}", own.description, idem.description)
    };
    for (media_type, content) in idem.content {
        if !own
            .content
            .keys()
            .any(|m| m.eq_ignore_ascii_case(&media_type))
        {
            own.content.insert(media_type, content);
        }
    }
    for (name, header) in idem.headers {
        if !own.headers.keys().any(|h| h.eq_ignore_ascii_case(&name)) {
            own.headers.insert(name, header);
        }
    }
}

/// Whether a response is one [`problem_response`] made: its problem document is
/// [`PROBLEM_SCHEMA`].
fn is_idem_answer(response: &Response) -> bool {
    response
        .content
        .get(idem_wire::problem::CONTENT_TYPE)
        .and_then(|c| c.schema.as_ref())
        .is_some_and(|s| matches!(s, RefOr::Ref(r) if *r == Ref::from_schema_name(PROBLEM_SCHEMA)))
}

fn key_parameter(name: &str, facts: &Facts) -> Parameter {
    let mut description = format!(
        "Identifies this logical request: a unique value per request, sent again unchanged \
         on every retry. A Structured Field string (`\"...\"`, RFC 8941) or a bare token of \
         visible ASCII without a comma, at most {max} characters (the quotes aside). \
         A retry with the same key and the same request gets the stored answer \
         (`Idempotent-Replayed: true`) and nothing runs again; the same key with a \
         different request is `422`; while the first request with the key is still \
         running, {running}.",
        max = idem_wire::MAX_KEY_LEN,
        running = if facts.accepted {
            "the same `202` with the operation's `Location` and `Retry-After` (or `409` with \
             `Retry-After` if its claim could not read the key in time)"
        } else {
            "`409` with `Retry-After`"
        },
    );
    if !facts.headers.is_empty() {
        let headers: Vec<String> = facts
            .headers
            .iter()
            .map(|h| format!("`{}`", title_case(h)))
            .collect();
        description.push_str(&format!(
            " The request is the method, the path, the body and the header {}.",
            headers.join(", ")
        ));
    }
    if let Some(retention) = facts.retention {
        description.push_str(&format!(
            " Answers are kept for {}.",
            human_duration(retention)
        ));
    }
    // The pattern is the grammar itself; `maxLength` is the longest value it
    // matches (a string item of escaped characters), for tools that read only that.
    let schema = ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(2 * idem_wire::MAX_KEY_LEN + 2))
        .pattern(Some(key_pattern()));
    Parameter::builder()
        .name(name)
        .parameter_in(ParameterIn::Header)
        .required(Required::True)
        .description(Some(description))
        .schema(Some(schema))
        .build()
}

/// The `Idempotency-Key` values idem accepts ([`crate::IdempotencyKey::parse`]),
/// as a regular expression in the dialect of JSON Schema's `pattern` (ECMA-262;
/// Python's `re` reads it alike): a bare token of 1 to
/// [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) visible ASCII characters without a
/// comma, not opening with `"`; or an RFC 8941 string item of 1 to
/// `MAX_KEY_LEN` characters (`\"` and `\\` one each), not all spaces. A value
/// it does not match is `400`, so a client or tester that generates values from
/// the document gets no refusal the document did not announce. (Spaces and tabs
/// around the value are HTTP's, not the value's: they are ignored.)
fn key_pattern() -> String {
    let max = idem_wire::MAX_KEY_LEN;
    // Visible ASCII (0x21-0x7e) but `,`; the first character not `"` either,
    // which opens the structured spelling.
    let bare = format!(r#"[!#-+\--~][!-+\--~]{{0,{}}}"#, max - 1);
    // RFC 8941's unescaped characters (0x20-0x7e but `"` and `\`) or an escape;
    // the look-ahead refuses a string of spaces only, which is an empty key.
    let string = format!(r#""(?! *")(?:[ !#-\[\]-~]|\\[\\"]){{1,{max}}}""#);
    format!("^(?:{bare}|{string})$")
}

fn replayed_header() -> Header {
    Header::builder()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["true"])),
        )
        .description(Some(
            "Present, `true`, when this answer is the stored answer of an earlier request \
             with the same key, replayed; absent on the first execution.",
        ))
        .build()
}

fn problem_response(description: &str, types: &[&str], retry_after: Option<&str>) -> Response {
    let types: Vec<String> = types.iter().map(|t| format!("`{t}`")).collect();
    let mut response = Response::builder()
        .description(format!(
            "{description} Problem type {} (answered by idem, not by the handler).",
            types.join(" or ")
        ))
        .content(
            idem_wire::problem::CONTENT_TYPE,
            Content::new(Some(Ref::from_schema_name(PROBLEM_SCHEMA))),
        );
    if let Some(description) = retry_after {
        response = response.header(
            title_case(RETRY_AFTER.as_str()),
            seconds_header(description),
        );
    }
    response.build()
}

/// A long operation's `202`: its operation document (the first request's
/// answer, and every retry's while it runs), or the uncertain problem.
fn accepted_response() -> Response {
    Response::builder()
        .description(format!(
            "A long operation: accepted and running. The body is its operation document \
             (`status` `running`) and `Location` its resource, where `GET` tells how it \
             goes and, once done, where its answer is; every retry with the same key gets \
             this same answer while it runs, and the stored answer once it is done. \
             As `application/problem+json` (problem type `{}`): an earlier attempt may \
             have taken effect and is being reconciled (answered by idem, not by the \
             handler).",
            idem_wire::problem::OUTCOME_UNCERTAIN
        ))
        .content(
            "application/json",
            Content::new(Some(Ref::from_schema_name(OPERATION_SCHEMA))),
        )
        .content(
            idem_wire::problem::CONTENT_TYPE,
            Content::new(Some(Ref::from_schema_name(PROBLEM_SCHEMA))),
        )
        .header(
            title_case(LOCATION.as_str()),
            Header::builder()
                .schema(ObjectBuilder::new().schema_type(Type::String))
                .description(Some(
                    "The operation resource: `{operations path}/{operation}/{digest}`.",
                ))
                .build(),
        )
        .header(
            title_case(RETRY_AFTER.as_str()),
            seconds_header(
                "Seconds to wait before asking again (the resource, or a retry with the same key).",
            ),
        )
        .build()
}

/// A long operation's document ([`crate::operations::Operation`]).
fn operation_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "A long operation's resource, as idem answers it. It never holds the idempotency key.",
        ))
        .property(
            "id",
            described(
                Type::String,
                "The operation's name and the SHA-256 of the idempotency key (lowercase hex), joined by `/`.",
            ),
        )
        .required("id")
        .property("operation", described(Type::String, "The operation's name."))
        .required("operation")
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["running", "stalled", "succeeded", "failed", "uncertain"]))
                .description(Some(
                    "`running`; `stalled` (its worker stopped: send the original request again \
                     with the same key to resume it); `succeeded` or `failed` (an answer is \
                     stored: 2xx/3xx or 4xx); `uncertain` (being reconciled).",
                )),
        )
        .required("status")
        .property(
            "href",
            described(Type::String, "The resource's path (the `Location` of the `202`)."),
        )
        .required("href")
        .property(
            "response_status",
            described(Type::Integer, "When done: the stored answer's status."),
        )
        .property(
            "result",
            described(
                Type::String,
                "When done: where the stored answer is replayed (`{href}/result`).",
            ),
        )
        .property(
            "retry_after",
            seconds().description(Some(
                    "While not done: seconds before asking again, as in `Retry-After`.",
                )),
        )
        .into()
}

/// RFC 9457's problem object, as idem writes it (`crate::Problem`).
fn problem_schema() -> Schema {
    use idem_wire::problem::*;
    let types = [
        MISSING_KEY,
        MALFORMED_KEY,
        FINGERPRINT_MISMATCH,
        IN_FLIGHT,
        STORE_UNAVAILABLE,
        STORE_BUSY,
        AT_CAPACITY,
        OUTCOME_UNCERTAIN,
        RESPONSE_TOO_LARGE,
        INVALID_TENANT,
        FINGERPRINT_FAILED,
        HANDLER_PANICKED,
        OPERATION_NOT_FOUND,
    ]
    .map(|t| format!("`{t}`"))
    .join(", ");
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "A problem document (RFC 9457) that idem answers in the handler's place.",
        ))
        .property(
            "type",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .format(Some(SchemaFormat::Custom("uri".to_owned())))
                .description(Some(format!(
                    "What went wrong, one stable URI per kind: {types}."
                ))),
        )
        .required("type")
        .property(
            "title",
            described(Type::String, "A short summary of the kind of problem."),
        )
        .required("title")
        .property(
            "status",
            described(Type::Integer, "The HTTP status code of the answer."),
        )
        .required("status")
        .property(
            "detail",
            described(Type::String, "What went wrong with this request."),
        )
        .property(
            "retry_after",
            seconds().description(Some(
                "With `409`, `202` and `503`: seconds to wait before retrying, as in the \
                     `Retry-After` header.",
            )),
        )
        .into()
}

/// A property of `schema_type` (a string, a number), with its description.
fn described(schema_type: Type, description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(schema_type)
        .description(Some(description))
}

/// A whole number of seconds, at least 1 (`Retry-After`'s).
fn seconds() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(1))
}

/// A `Retry-After` header, in seconds, with its description.
fn seconds_header(description: &str) -> Header {
    Header::builder()
        .schema(seconds())
        .description(Some(description))
        .build()
}

/// `idempotency-key` as `Idempotency-Key`: the wire constants are lower case,
/// a document reads better in the usual spelling (header names are
/// case-insensitive).
fn title_case(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut chars = part.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join("-")
}

/// A retention in the largest whole unit: `24h`, `30m`, `90s`, `1500ms`.
fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, len) in [("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms >= len && ms.is_multiple_of(len) {
            return format!("{}{unit}", ms / len);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests;
