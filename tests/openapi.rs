//! `idem_runtime::openapi` (feature `openapi`): the orders example's
//! `GET /openapi.json` documents what idem answers on its idempotent routes and
//! nothing of it on the others, and every answer of its own (`.ci/schemathesis`
//! holds the running service to the document; these hold the document to its
//! declarations, so `cargo test` alone guards them); handlers register
//! themselves from inside an `impl` block and with either attribute order.
//!
//! The whole test crate forbids unsafe code: the registration the attribute
//! emits must compile there too.

#![forbid(unsafe_code)]

mod common;
use common::orders;

use axum::Json;
use axum::http::StatusCode;
use idem_runtime::openapi::IdemOpenApi;
use idem_runtime::{Tx, idempotent};
use serde_json::Value;
use sqlx::Postgres;
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

/// The problem answers idem gives, which of them carry `Retry-After`, and a
/// problem type each names.
const PROBLEMS: &[(&str, bool, &str)] = &[
    ("400", false, idem_runtime::problem::MISSING_KEY),
    ("409", true, idem_runtime::problem::IN_FLIGHT),
    ("422", false, idem_runtime::problem::FINGERPRINT_MISMATCH),
    ("503", true, idem_runtime::problem::STORE_UNAVAILABLE),
];

/// The error answers each route declares: its edges' and extractors'
/// (authentication, the head's size, the database; the body, the path's id,
/// `X-Currency`), its handler's, and idem's `409` on the idempotent ones (idem's
/// `400`, `422` and `503` share the service's). Every one is a problem document.
const ERRORS: &[(&str, &str, &[&str])] = &[
    (
        "/orders",
        "post",
        &[
            "400", "401", "408", "409", "413", "415", "422", "431", "503",
        ],
    ),
    (
        "/refunds",
        "post",
        &[
            "400", "401", "404", "408", "409", "413", "415", "422", "431", "503",
        ],
    ),
    (
        "/payments",
        "post",
        &[
            "400", "401", "402", "408", "409", "413", "415", "422", "431", "503",
        ],
    ),
    (
        "/exports",
        "post",
        &[
            "400", "401", "408", "409", "413", "415", "422", "431", "503",
        ],
    ),
    ("/orders", "get", &["401", "431", "503"]),
    ("/orders/{id}", "get", &["400", "401", "404", "431", "503"]),
    (
        "/orders/{id}",
        "delete",
        &["400", "401", "404", "431", "503"],
    ),
    (
        "/orders/{id}/pay",
        "post",
        &["400", "401", "404", "409", "431", "503"],
    ),
    (
        "/orders/{id}/ship",
        "post",
        &["400", "401", "404", "409", "431", "503"],
    ),
];

fn problem_schema(response: &Value) -> Option<&str> {
    response["content"]["application/problem+json"]["schema"]["$ref"].as_str()
}

async fn orders_document() -> Value {
    let db = common::SqliteDb::new().await;
    let server = orders::Server::start(&format!("sqlite://{}", db.path.display()), &[]).await;
    let answer = reqwest::get(format!("{}/openapi.json", server.base))
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    serde_json::from_str(&answer.text().await.unwrap()).unwrap()
}

#[tokio::test]
async fn the_orders_example_documents_idem_on_its_idempotent_routes_only() {
    let doc = orders_document().await;

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
                // The service's own problems only: nothing of idem's.
                assert_ne!(
                    problem_schema(response),
                    Some("#/components/schemas/IdemProblem"),
                    "{method} {path} {status}"
                );
                // (The service's own 503 is idem's type: the same database.)
                let said = response["description"].as_str().unwrap();
                for &(_, _, idem) in PROBLEMS.iter().filter(|p| p.0 != "503") {
                    assert!(!said.contains(idem), "{method} {path} {status}: {said}");
                }
            }
            assert!(!responses.contains_key("422"), "{method} {path}");
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

        for &(status, retry_after, problem_type) in PROBLEMS {
            let response = &responses[status];
            // Idem's own schema where the service declared nothing under the
            // status (409), the service's where it did: one problem shape.
            let schema = if status == "409" {
                "#/components/schemas/IdemProblem"
            } else {
                "#/components/schemas/Problem"
            };
            assert_eq!(
                problem_schema(response),
                Some(schema),
                "{method} {path} {status}"
            );
            let said = response["description"].as_str().unwrap();
            assert!(
                said.contains(problem_type),
                "{method} {path} {status}: {said}"
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
            let said = response["description"].as_str().unwrap();
            assert!(said.starts_with(description), "{path} {status}: {said}");
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

/// The example's document declares every answer each route gives and no more
/// than it accepts (`.ci/schemathesis` tests the service
/// against it): each error status with the service's problem schema, the
/// bearer authentication, `format`'s two values, `X-Currency`'s letters, the
/// bounds `validate` checks.
#[tokio::test]
async fn the_orders_example_declares_what_it_answers_and_accepts() {
    let doc = orders_document().await;

    let problem = &doc["components"]["schemas"]["Problem"];
    assert_eq!(
        problem["required"],
        serde_json::json!(["type", "title", "status"])
    );
    for &(path, method, statuses) in ERRORS {
        let op = &doc["paths"][path][method];
        let responses = op["responses"].as_object().unwrap();
        let errors: Vec<&str> = responses
            .keys()
            .map(String::as_str)
            .filter(|s| s.starts_with('4') || s.starts_with('5'))
            .collect();
        assert_eq!(errors, statuses, "{method} {path}");
        for status in statuses {
            let response = &responses[*status];
            assert!(
                problem_schema(response).is_some(),
                "{method} {path} {status}"
            );
        }
        assert!(
            header(&responses["503"], "retry-after").is_some(),
            "{method} {path}"
        );
        // A statement behind another writer's lock is answered so on every
        // route, in the route's own words or the shared ones.
        assert!(
            responses["503"]["description"]
                .as_str()
                .unwrap()
                .contains("`urn:orders:problem:busy`"),
            "{method} {path}"
        );
    }
    assert_eq!(doc["security"], serde_json::json!([{"tenant": []}]));
    let scheme = &doc["components"]["securitySchemes"]["tenant"];
    assert_eq!(scheme["type"], "http");
    assert_eq!(scheme["scheme"], "bearer");

    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        schemas["Format"]["enum"],
        serde_json::json!(["csv", "json"])
    );
    assert_eq!(
        schemas["NewExport"]["properties"]["format"]["$ref"],
        "#/components/schemas/Format"
    );
    let currency = doc["paths"]["/orders"]["post"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "X-Currency")
        .unwrap();
    assert_eq!(currency["required"], true);
    assert_eq!(currency["schema"]["pattern"], "^[A-Z]{3}$");
    let order = &schemas["NewOrder"];
    assert_eq!(order["additionalProperties"], false);
    assert_eq!(order["properties"]["sku"]["minLength"], 1);
    assert_eq!(order["properties"]["sku"]["maxLength"], 64);
    assert_eq!(order["properties"]["quantity"]["minimum"], 1);
    assert_eq!(order["properties"]["amount_cents"]["minimum"], 0);
    assert_eq!(
        schemas["NewRefund"]["properties"]["amount_cents"]["minimum"],
        0
    );
    assert_eq!(
        schemas["NewPayment"]["properties"]["amount_cents"]["minimum"],
        1
    );
    for path in ["/orders/{id}", "/orders/{id}/pay", "/orders/{id}/ship"] {
        let id = &doc["paths"][path]
            .as_object()
            .unwrap()
            .values()
            .next()
            .unwrap()["parameters"][0];
        assert_eq!(id["in"], "path", "{path}");
        assert_eq!(id["schema"]["type"], "integer", "{path}");
        assert_eq!(id["schema"]["format"], "int64", "{path}");
    }
    // The fulfilment steps' answer and the charge have schemas.
    assert_eq!(
        doc["paths"]["/orders/{id}/pay"]["post"]["responses"]["200"]["content"]["application/json"]
            ["schema"]["$ref"],
        "#/components/schemas/Step"
    );
    assert_eq!(
        doc["paths"]["/payments"]["post"]["responses"]["201"]["content"]["application/json"]["schema"]
            ["$ref"],
        "#/components/schemas/Payment"
    );
}

/// What the document now declares, the service answers: the path's id that
/// does not parse is a problem of the service's own type (it was axum's), and
/// an integer written with a zero fraction, in the body or the path, is the
/// integer the schema says it is.
#[tokio::test]
async fn the_orders_example_answers_as_its_document_says() {
    let db = common::SqliteDb::new().await;
    let server = orders::Server::start(&format!("sqlite://{}", db.path.display()), &[]).await;
    let http = reqwest::Client::new();
    let auth = ("authorization", "Bearer openapi");

    for path in ["/orders/9223372036854775808", "/orders/x/pay"] {
        let method = if path.ends_with("/pay") {
            reqwest::Method::POST
        } else {
            reqwest::Method::GET
        };
        let answer = http
            .request(method, format!("{}{path}", server.base))
            .header(auth.0, auth.1)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(
            answer.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        let problem: Value = answer.json().await.unwrap();
        assert_eq!(
            problem["type"], "urn:orders:problem:invalid-request",
            "{path}"
        );
    }

    let order = |key: &str, body: &str| {
        http.post(format!("{}/orders", server.base))
            .header(auth.0, auth.1)
            .header("content-type", "application/json")
            .header("x-currency", "EUR")
            .header("idempotency-key", key)
            .body(body.to_owned())
            .send()
    };
    let created = order(
        "whole-1",
        r#"{"sku":"a","quantity":2.0,"amount_cents":-0.0}"#,
    )
    .await
    .unwrap();
    assert_eq!(created.status(), reqwest::StatusCode::CREATED);
    let created: Value = created.json().await.unwrap();
    assert_eq!(
        (created["quantity"].clone(), created["amount_cents"].clone()),
        (2.into(), 0.into())
    );
    // The same values, spelled otherwise: the same request, replayed.
    let again = order("whole-1", r#"{"sku":"a","quantity":2,"amount_cents":0}"#)
        .await
        .unwrap();
    assert_eq!(again.status(), reqwest::StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    // A fraction is not an integer, however written, and however small.
    for (key, body) in [
        ("whole-2", r#"{"sku":"a","quantity":2.5,"amount_cents":1}"#),
        (
            "whole-3",
            r#"{"sku":"a","quantity":1.0000000000000001,"amount_cents":1}"#,
        ),
        (
            "whole-4",
            r#"{"sku":"a","quantity":1,"amount_cents":25e-1}"#,
        ),
    ] {
        let fraction = order(key, body).await.unwrap();
        assert_eq!(
            fraction.status(),
            reqwest::StatusCode::UNPROCESSABLE_ENTITY,
            "{body}"
        );
    }
    // Read as written, not through a float: 2^53 + 1 is not 2^53, so under
    // the same key it is another request (`422`), not a replay; with an
    // exponent, a whole number is one.
    for (amount, status, replayed) in [
        ("9007199254740992", reqwest::StatusCode::CREATED, None),
        (
            "9007199254740993.0",
            reqwest::StatusCode::UNPROCESSABLE_ENTITY,
            None,
        ),
        (
            "90071992547409.92e2",
            reqwest::StatusCode::CREATED,
            Some("true"),
        ),
    ] {
        let quantity = if replayed.is_some() { "1e0" } else { "1" };
        let body = format!(r#"{{"sku":"a","quantity":{quantity},"amount_cents":{amount}}}"#);
        let answer = order("whole-big", &body).await.unwrap();
        assert_eq!(answer.status(), status, "{body}");
        if let Some(replayed) = replayed {
            assert_eq!(answer.headers()["idempotent-replayed"], replayed, "{body}");
        }
    }
    // The path's id is an integer the same way.
    for (path, status) in [
        (
            format!("/orders/{}.0", created["id"]),
            reqwest::StatusCode::OK,
        ),
        (
            format!("/orders/{}.5", created["id"]),
            reqwest::StatusCode::BAD_REQUEST,
        ),
    ] {
        let answer = http
            .get(format!("{}{path}", server.base))
            .header(auth.0, auth.1)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), status, "{path}");
    }
    let export = http
        .post(format!("{}/exports", server.base))
        .header(auth.0, auth.1)
        .header("content-type", "application/json")
        .header("idempotency-key", "export-xml")
        .body(r#"{"format":"xml"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(export.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
}

/// Handlers written here to be documented (never served: no database).
struct Orders;

impl Orders {
    /// An associated function: registered from its body, as any other handler.
    #[idempotent(operation = "create-in-impl", retention = "1h", single_tenant)]
    async fn create_in_impl(tx: &mut Tx<Postgres>, Json(body): Json<Value>) -> StatusCode {
        let _ = (tx, body);
        StatusCode::CREATED
    }
}

/// `#[utoipa::path]` above `#[idempotent]`, the documented order.
#[utoipa::path(post, path = "/above", responses((status = 201, description = "created")))]
#[idempotent(operation = "path-above", retention = "1h", single_tenant)]
async fn path_above(tx: &mut Tx<Postgres>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

/// `#[idempotent]` above `#[utoipa::path]`: compiles and registers too.
#[idempotent(operation = "path-below", retention = "1h", single_tenant)]
#[utoipa::path(post, path = "/below", responses((status = 201, description = "created")))]
async fn path_below(tx: &mut Tx<Postgres>) -> StatusCode {
    let _ = tx;
    StatusCode::CREATED
}

#[derive(OpenApi)]
#[openapi(paths(path_above, path_below), modifiers(&IdemOpenApi))]
struct Both;

#[test]
fn either_attribute_order_documents_the_handler() {
    // Mounted, as a service would.
    let _router: axum::Router<idem_runtime::Idem<Postgres>> = axum::Router::new()
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
