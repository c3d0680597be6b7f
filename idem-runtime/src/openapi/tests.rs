use std::time::Duration;

use serde_json::{Value, json};
use utoipa::openapi::path::{HttpMethod, OperationBuilder};
use utoipa::openapi::{Content, OpenApiBuilder, PathItem, Paths, Ref, ResponseBuilder};

use super::*;

static CREATE_ORDER: OperationSpec = OperationSpec {
    retention: Duration::from_secs(24 * 3600),
    fingerprint_headers: &["x-currency"],
    ..OperationSpec::named("create-order")
};

static CREATE_PAYMENT: OperationSpec = OperationSpec {
    lease: Some(Duration::from_secs(30)),
    ..OperationSpec::named("create-payment")
};

static CREATE_EXPORT: OperationSpec = OperationSpec {
    lease: Some(Duration::from_secs(6)),
    accepted: true,
    ..OperationSpec::named("create-export")
};

static ORDER: OpenApiRegistration = OpenApiRegistration::new("create_order", &CREATE_ORDER);
static EXPORT: OpenApiRegistration = OpenApiRegistration::new("create_export", &CREATE_EXPORT);
static PAYMENT: OpenApiRegistration = OpenApiRegistration::new("create_payment", &CREATE_PAYMENT);

fn op(id: &str, statuses: &[&str]) -> OperationBuilder {
    statuses.iter().fold(
        OperationBuilder::new().operation_id(Some(id)),
        |op, status| op.response(*status, ResponseBuilder::new().description("the handler's")),
    )
}

/// `POST /orders` (create_order), `GET /orders` (list_orders) and `POST
/// /payments` (create_payment, given `payment_statuses`).
fn api(payment_statuses: &[&str]) -> OpenApi {
    let orders = PathItem::new(HttpMethod::Post, op("create_order", &["201"]));
    let mut list = PathItem::new(HttpMethod::Get, op("list_orders", &["200"]));
    list.post = orders.post;
    OpenApiBuilder::new()
        .paths(Paths::builder().path("/orders", list).path(
            "/payments",
            PathItem::new(HttpMethod::Post, op("create_payment", payment_statuses)),
        ))
        .build()
}

/// A document of one path, `method` on it the operation `op`.
fn one_path(path: &str, method: HttpMethod, op: OperationBuilder) -> OpenApi {
    OpenApiBuilder::new()
        .paths(Paths::builder().path(path, PathItem::new(method, op)))
        .build()
}

fn json_of(api: &OpenApi) -> Value {
    serde_json::to_value(api).unwrap()
}

#[test]
fn a_registered_operation_gets_the_key_the_replay_header_and_the_problems() {
    let mut doc = api(&["201"]);
    document_with(&mut doc, &[&ORDER]);
    let v = json_of(&doc);
    let post = &v["paths"]["/orders"]["post"];

    let key = &post["parameters"][0];
    assert_eq!(key["name"], "Idempotency-Key");
    assert_eq!(key["in"], "header");
    assert_eq!(key["required"], true);
    assert_eq!(key["schema"]["type"], "string");
    assert_eq!(key["schema"]["maxLength"], 2 * 255 + 2);
    assert_eq!(key["schema"]["pattern"], key_pattern());
    let said = key["description"].as_str().unwrap();
    assert!(said.contains("Structured Field string"), "{said}");
    assert!(said.contains("`X-Currency`"), "{said}");
    assert!(said.contains("kept for 24h"), "{said}");

    let responses = post["responses"].as_object().unwrap();
    let statuses: Vec<&str> = responses.keys().map(String::as_str).collect();
    assert_eq!(statuses, ["201", "400", "409", "422", "503"]);
    assert_eq!(responses["201"]["description"], "the handler's");
    assert_eq!(
        responses["201"]["headers"]["Idempotent-Replayed"]["schema"]["enum"],
        json!(["true"])
    );
    for status in ["400", "409", "422", "503"] {
        let problem = &responses[status]["content"]["application/problem+json"]["schema"];
        assert_eq!(
            problem["$ref"], "#/components/schemas/IdemProblem",
            "{status}"
        );
        assert!(
            responses[status]["headers"]
                .get("Idempotent-Replayed")
                .is_none(),
            "{status}"
        );
    }
    for status in ["409", "503"] {
        assert_eq!(
            responses[status]["headers"]["Retry-After"]["schema"]["type"],
            "integer"
        );
    }
    for status in ["400", "422"] {
        assert!(responses[status].get("headers").is_none(), "{status}");
    }
    assert!(
        responses["409"]["description"]
            .as_str()
            .unwrap()
            .contains(idem_wire::problem::IN_FLIGHT)
    );

    let schema = &v["components"]["schemas"]["IdemProblem"];
    assert_eq!(schema["required"], json!(["type", "title", "status"]));
    let types = schema["properties"]["type"]["description"]
        .as_str()
        .unwrap();
    // Every problem type idem-wire defines (read off its source, so that a
    // new one cannot be left out of the description unseen).
    let wire = include_str!("../../../idem-wire/src/problem.rs");
    let defined: Vec<&str> = wire
        .lines()
        .filter(|l| l.starts_with("pub const "))
        .filter_map(|l| l.split('"').nth(1))
        .filter(|t| t.starts_with("urn:idem:problem:"))
        .collect();
    assert!(defined.len() >= 13, "{defined:?}");
    for t in defined {
        assert!(
            types.contains(&format!("`{t}`")),
            "{t} missing from {types}"
        );
    }
}

#[test]
fn an_unregistered_operation_is_left_as_it_was() {
    let before = api(&["201"]);
    let mut doc = before.clone();
    document_with(&mut doc, &[&ORDER]);
    let (after, before_v) = (json_of(&doc), json_of(&before));
    assert_eq!(
        after["paths"]["/orders"]["get"],
        before_v["paths"]["/orders"]["get"]
    );
    assert_eq!(after["paths"]["/payments"], before_v["paths"]["/payments"]);

    // With nothing registered, the whole document is untouched.
    let mut doc = before.clone();
    document_with(&mut doc, &[]);
    assert_eq!(json_of(&doc), json_of(&before));
}

/// A status the service declared too keeps what the service wrote, and gets
/// idem's answer besides: its sentence, its media type and `Retry-After`.
#[test]
fn a_status_the_service_declared_keeps_its_own_and_gets_idems() {
    let mut doc = api(&["201", "409"]);
    document_with(&mut doc, &[&PAYMENT]);
    let v = json_of(&doc);
    let responses = &v["paths"]["/payments"]["post"]["responses"];
    let said = responses["409"]["description"].as_str().unwrap();
    assert!(said.starts_with("the handler's Or: "), "{said}");
    assert!(said.contains(idem_wire::problem::IN_FLIGHT), "{said}");
    assert_eq!(
        responses["409"]["content"]["application/problem+json"]["schema"]["$ref"],
        "#/components/schemas/IdemProblem"
    );
    assert!(responses["409"]["headers"]["Retry-After"].is_object());
    // It is the handler's own answer too, so a replay of it is marked.
    assert!(responses["409"]["headers"]["Idempotent-Replayed"].is_object());
    assert!(responses["422"]["content"].is_object());
}

/// The service's own media type (and schema) for a status stays: idem's
/// document is then described by it.
#[test]
fn a_problem_schema_the_service_declared_is_kept() {
    let own = ResponseBuilder::new()
        .description("Invalid input.")
        .content(
            "application/problem+json",
            Content::new(Some(Ref::from_schema_name("Problem"))),
        );
    let mut doc = one_path(
        "/orders",
        HttpMethod::Post,
        op("create_order", &["201"]).response("422", own),
    );
    document_with(&mut doc, &[&ORDER]);
    let once = json_of(&doc);
    let invalid = &once["paths"]["/orders"]["post"]["responses"]["422"];
    assert_eq!(
        invalid["content"]["application/problem+json"]["schema"]["$ref"],
        "#/components/schemas/Problem"
    );
    let said = invalid["description"].as_str().unwrap();
    assert!(said.starts_with("Invalid input. Or: "), "{said}");
    assert!(
        said.contains(idem_wire::problem::FINGERPRINT_MISMATCH),
        "{said}"
    );
    document_with(&mut doc, &[&ORDER]);
    assert_eq!(json_of(&doc), once);
}

/// The key's pattern spells `IdempotencyKey::parse`'s grammar: both spellings,
/// their characters and lengths. (The orders example's Schemathesis run,
/// `.ci/schemathesis`, sends keys drawn from it and from outside it.)
#[test]
fn the_key_pattern_is_the_grammar_of_both_spellings() {
    assert_eq!(
        key_pattern(),
        r#"^(?:[!#-+\--~][!-+\--~]{0,254}|"(?! *")(?:[ !#-\[\]-~]|\\[\\"]){1,255}")$"#
    );
}

#[test]
fn a_leased_operation_gets_202_uncertain_with_retry_after() {
    let mut doc = api(&["201"]);
    document_with(&mut doc, &[&ORDER, &PAYMENT]);
    let v = json_of(&doc);
    let uncertain = &v["paths"]["/payments"]["post"]["responses"]["202"];
    assert!(
        uncertain["description"]
            .as_str()
            .unwrap()
            .contains(idem_wire::problem::OUTCOME_UNCERTAIN)
    );
    assert_eq!(uncertain["headers"]["Retry-After"]["schema"]["minimum"], 1);
    // The transactional one has none.
    assert!(
        v["paths"]["/orders"]["post"]["responses"]
            .get("202")
            .is_none()
    );
}

/// A long operation's 202: its document with `Location` and `Retry-After`, or
/// the uncertain problem; the document's schema is added once.
#[test]
fn an_accepted_operation_gets_202_operation_with_location() {
    let mut doc = one_path("/exports", HttpMethod::Post, op("create_export", &["201"]));
    document_with(&mut doc, &[&EXPORT, &ORDER]);
    let v = json_of(&doc);
    let post = &v["paths"]["/exports"]["post"];
    let accepted = &post["responses"]["202"];
    assert_eq!(
        accepted["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/IdemOperation"
    );
    assert_eq!(
        accepted["content"]["application/problem+json"]["schema"]["$ref"],
        "#/components/schemas/IdemProblem"
    );
    assert!(accepted["headers"]["Location"].is_object());
    assert_eq!(accepted["headers"]["Retry-After"]["schema"]["minimum"], 1);
    assert!(
        accepted["description"]
            .as_str()
            .unwrap()
            .contains(idem_wire::problem::OUTCOME_UNCERTAIN)
    );
    // An idem answer: no `Idempotent-Replayed` on it; the handler's 201 has it.
    assert!(accepted["headers"].get("Idempotent-Replayed").is_none());
    assert!(post["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
    assert!(
        post["parameters"][0]["description"]
            .as_str()
            .unwrap()
            .contains("the same `202`")
    );
    let schema = &v["components"]["schemas"]["IdemOperation"];
    assert_eq!(
        schema["properties"]["status"]["enum"],
        json!(["running", "stalled", "succeeded", "failed", "uncertain"])
    );
    // Without a long operation there is no such schema.
    let mut plain = api(&["201"]);
    document_with(&mut plain, &[&ORDER, &PAYMENT]);
    assert!(
        json_of(&plain)["components"]["schemas"]
            .get("IdemOperation")
            .is_none()
    );
}

#[test]
fn the_idem_operation_name_matches_as_an_operation_id() {
    let mut doc = one_path("/orders", HttpMethod::Put, op("create-order", &["200"]));
    document_with(&mut doc, &[&ORDER]);
    let put = doc.paths.paths["/orders"].put.as_ref().unwrap();
    assert_eq!(put.parameters.as_ref().unwrap()[0].name, "Idempotency-Key");
}

#[test]
fn documenting_twice_adds_nothing_more() {
    let mut once = api(&["201"]);
    document_with(&mut once, &[&ORDER, &PAYMENT]);
    let mut twice = once.clone();
    document_with(&mut twice, &[&ORDER, &PAYMENT]);
    assert_eq!(json_of(&once), json_of(&twice));
}

#[test]
fn a_key_parameter_the_service_declared_is_kept() {
    let declared = Parameter::builder()
        .name("idempotency-key")
        .parameter_in(ParameterIn::Header)
        .required(Required::True)
        .description(Some("ours"))
        .build();
    let mut doc = one_path(
        "/orders",
        HttpMethod::Post,
        op("create_order", &["201"]).parameter(declared.clone()),
    );
    document_with(&mut doc, &[&ORDER]);
    let post = doc.paths.paths["/orders"].post.as_ref().unwrap();
    assert!(post.parameters.as_ref().unwrap() == &vec![declared]);
}

/// The registration macro, expanded in a function body as the attribute emits
/// it, reaches `document`'s registry.
#[test]
fn the_registration_macro_works_inside_a_function_body() {
    fn handler() {
        static SPEC: OperationSpec = OperationSpec {
            retention: Duration::from_secs(60),
            ..OperationSpec::named("registered-in-a-body")
        };
        crate::__idem_openapi!("registered_in_a_body", &SPEC);
    }
    handler();
    let found = inventory::iter::<OpenApiRegistration>()
        .find(|r| r.handler == "registered_in_a_body")
        .expect("registered before main");
    assert_eq!(found.spec.operation, "registered-in-a-body");
}

#[test]
fn durations_read_in_their_largest_whole_unit() {
    assert_eq!(human_duration(Duration::from_secs(86_400)), "24h");
    assert_eq!(human_duration(Duration::from_secs(1800)), "30m");
    assert_eq!(human_duration(Duration::from_secs(90)), "90s");
    assert_eq!(human_duration(Duration::from_millis(1500)), "1500ms");
    assert_eq!(title_case("idempotency-key"), "Idempotency-Key");
}
