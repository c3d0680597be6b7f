//! `idem_runtime::openapi` (feature `openapi`): the orders example's
//! `GET /openapi.json` documents what idem answers on its idempotent routes and
//! nothing of it on the others; handlers register themselves from inside an
//! `impl` block and with either attribute order.
//!
//! The whole test crate forbids unsafe code: the registration the attribute
//! emits must compile there too.

#![forbid(unsafe_code)]

mod common;
#[path = "common/orders.rs"]
mod orders;

use axum::Json;
use axum::http::StatusCode;
use idem_runtime::openapi::IdemOpenApi;
use idem_runtime::{Tx, idempotent};
use serde_json::Value;
use utoipa::OpenApi;

/// The example's routes, as its router mounts them: (path, method, idempotent).
const ROUTES: &[(&str, &str, bool)] = &[
    ("/orders", "post", true),
    ("/refunds", "post", true),
    ("/payments", "post", true),
    ("/exports", "post", true),
    ("/orders", "get", false),
    ("/orders/{id}", "get", false),
    ("/orders/{id}", "delete", false),
    ("/orders/{id}/pay", "post", false),
    ("/orders/{id}/ship", "post", false),
];

/// What the example declares itself for each idempotent route: its own
/// statuses and their descriptions, which idem leaves as they are.
const OWN_RESPONSES: &[(&str, &[(&str, &str)])] = &[
    ("/orders", &[("201", "The order, created")]),
    (
        "/refunds",
        &[
            ("201", "The refund"),
            (
                "404",
                "No such order for this tenant (stored, and replayed)",
            ),
        ],
    ),
    ("/payments", &[("201", "The charge")]),
    ("/exports", &[("201", "The export")]),
];

fn header<'a>(response: &'a Value, name: &str) -> Option<&'a Value> {
    response
        .get("headers")?
        .as_object()?
        .iter()
        .find_map(|(k, v)| k.eq_ignore_ascii_case(name).then_some(v))
}

fn key_parameter(op: &Value) -> Option<&Value> {
    op.get("parameters")?.as_array()?.iter().find(|p| {
        p["in"] == "header"
            && p["name"]
                .as_str()
                .is_some_and(|n| n.eq_ignore_ascii_case("idempotency-key"))
    })
}

/// The problem answers idem adds, and which of them carry `Retry-After`.
const PROBLEMS: &[(&str, bool)] = &[("400", false), ("409", true), ("422", false), ("503", true)];

#[tokio::test]
async fn the_orders_example_documents_idem_on_its_idempotent_routes_only() {
    let db = common::SqliteDb::new().await;
    let server = orders::Server::start(&format!("sqlite://{}", db.path.display()), &[]).await;
    let answer = reqwest::get(format!("{}/openapi.json", server.base))
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    let doc: Value = serde_json::from_str(&answer.text().await.unwrap()).unwrap();

    let problem = &doc["components"]["schemas"]["IdemProblem"];
    assert_eq!(problem["type"], "object", "{problem}");
    for field in ["type", "title", "status", "detail"] {
        assert!(problem["properties"][field].is_object(), "{field}");
    }

    for &(path, method, idempotent) in ROUTES {
        let op = &doc["paths"][path][method];
        assert!(op.is_object(), "{method} {path} is not in the document");
        let responses = op["responses"].as_object().unwrap();
        if !idempotent {
            assert!(key_parameter(op).is_none(), "{method} {path}");
            for (status, response) in responses {
                assert!(
                    header(response, "idempotent-replayed").is_none(),
                    "{method} {path} {status}"
                );
                assert!(
                    response
                        .get("content")
                        .and_then(|c| c.get("application/problem+json"))
                        .is_none(),
                    "{method} {path} {status}"
                );
            }
            for (status, _) in PROBLEMS {
                assert!(!responses.contains_key(*status), "{method} {path} {status}");
            }
            assert!(!responses.contains_key("202"), "{method} {path}");
            continue;
        }

        let key =
            key_parameter(op).unwrap_or_else(|| panic!("{method} {path}: no Idempotency-Key"));
        assert_eq!(key["required"], true, "{method} {path}");
        assert_eq!(key["schema"]["type"], "string", "{method} {path}");
        // The grammar of both spellings; the longest is a string item of 255
        // escaped characters.
        assert!(key["schema"]["pattern"].is_string(), "{method} {path}");
        assert_eq!(key["schema"]["maxLength"], 2 * 255 + 2, "{method} {path}");

        for &(status, retry_after) in PROBLEMS {
            let response = &responses[status];
            assert_eq!(
                response["content"]["application/problem+json"]["schema"]["$ref"],
                "#/components/schemas/IdemProblem",
                "{method} {path} {status}"
            );
            assert_eq!(
                header(response, "retry-after").is_some(),
                retry_after,
                "{method} {path} {status}"
            );
        }
        // Only the leased operations can be uncertain; the long one's 202 is
        // its operation too.
        assert_eq!(
            responses.contains_key("202"),
            path == "/payments" || path == "/exports",
            "{path}"
        );
        let operation = responses
            .get("202")
            .and_then(|r| r["content"]["application/json"]["schema"]["$ref"].as_str());
        assert_eq!(
            operation,
            (path == "/exports").then_some("#/components/schemas/IdemOperation"),
            "{path}"
        );

        let own = OWN_RESPONSES.iter().find(|(p, _)| *p == path).unwrap().1;
        for (status, description) in own {
            let response = &responses[*status];
            assert_eq!(response["description"], *description, "{path} {status}");
            assert!(
                header(response, "idempotent-replayed").is_some(),
                "{path} {status}"
            );
        }
    }

    // The handler's own details stay: create_order's body, Location and X-Currency.
    let create = &doc["paths"]["/orders"]["post"];
    assert_eq!(
        create["responses"]["201"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/Order"
    );
    assert!(header(&create["responses"]["201"], "location").is_some());
    assert!(
        create["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "X-Currency")
    );
    assert_eq!(
        create["summary"],
        "Creates an order. A retry with the same key gets the same 201 back."
    );
}

/// Handlers written here to be documented (never served: no database).
struct Orders;

impl Orders {
    /// An associated function: registered from its body, as any other handler.
    #[idempotent(operation = "create-in-impl", retention = "1h", single_tenant)]
    async fn create_in_impl(tx: &mut Tx, Json(body): Json<Value>) -> StatusCode {
        let _ = (tx, body);
        StatusCode::CREATED
    }
}

/// `#[utoipa::path]` above `#[idempotent]`, the documented order.
#[utoipa::path(post, path = "/above", responses((status = 201, description = "created")))]
#[idempotent(operation = "path-above", retention = "1h", single_tenant)]
async fn path_above(tx: &mut Tx) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

/// `#[idempotent]` above `#[utoipa::path]`: compiles and registers too.
#[idempotent(operation = "path-below", retention = "1h", single_tenant)]
#[utoipa::path(post, path = "/below", responses((status = 201, description = "created")))]
async fn path_below(tx: &mut Tx) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

#[derive(OpenApi)]
#[openapi(paths(path_above, path_below), modifiers(&IdemOpenApi))]
struct Both;

#[test]
fn either_attribute_order_documents_the_handler() {
    // Mounted, as a service would.
    let _router: axum::Router<idem_runtime::Idem> = axum::Router::new()
        .route("/above", axum::routing::post(path_above))
        .route("/below", axum::routing::post(path_below))
        .route("/impl", axum::routing::post(Orders::create_in_impl));

    let doc = serde_json::to_value(Both::openapi()).unwrap();
    for path in ["/above", "/below"] {
        let op = &doc["paths"][path]["post"];
        assert!(key_parameter(op).is_some(), "{path}");
        assert!(op["responses"]["409"].is_object(), "{path}");
        assert!(
            header(&op["responses"]["201"], "idempotent-replayed").is_some(),
            "{path}"
        );
    }
    // Above, utoipa reads the doc comment as written; below, it reads the one
    // the attribute extends.
    assert!(doc["paths"]["/above"]["post"].get("description").is_none());
    let below = doc["paths"]["/below"]["post"]["description"]
        .as_str()
        .unwrap();
    assert!(below.contains("# Idempotency"), "{below}");
}

#[test]
fn an_associated_handler_registers_itself() {
    use utoipa::openapi::path::{HttpMethod, OperationBuilder};
    use utoipa::openapi::{OpenApiBuilder, PathItem, Paths, ResponseBuilder};

    // `#[utoipa::path]` cannot sit in an `impl` block (it emits a struct beside
    // the function), so the operation is written by hand, as a service would.
    let op = OperationBuilder::new()
        .operation_id(Some("create_in_impl"))
        .response("201", ResponseBuilder::new().description("created"));
    let mut api = OpenApiBuilder::new()
        .paths(Paths::builder().path("/impl", PathItem::new(HttpMethod::Post, op)))
        .build();
    idem_runtime::openapi::document(&mut api);
    let doc = serde_json::to_value(&api).unwrap();
    let op = &doc["paths"]["/impl"]["post"];
    assert!(key_parameter(op).is_some(), "{op}");
    assert!(op["responses"]["422"].is_object(), "{op}");
}
