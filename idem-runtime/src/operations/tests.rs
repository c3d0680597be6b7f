//! The operation resource's address, document and poll interval.

use std::time::Duration;

use axum::http::{StatusCode, header};

use super::{Address, Status, poll_interval};
use crate::handler::OperationSpec;

static SPEC: OperationSpec = OperationSpec {
    lease: Some(Duration::from_secs(6)),
    accepted: true,
    ..OperationSpec::named("create-export")
};

#[test]
fn the_poll_interval_is_a_third_of_the_lease_and_at_least_a_second() {
    assert_eq!(poll_interval(&SPEC), Duration::from_secs(2));
    let short = OperationSpec {
        lease: Some(Duration::from_millis(300)),
        ..SPEC
    };
    assert_eq!(poll_interval(&short), Duration::from_secs(1));
}

#[test]
fn the_address_is_the_operation_and_the_keys_digest_never_the_key() {
    let key = crate::IdempotencyKey::parse("order-42").unwrap();
    let a = Address::new("/operations", &SPEC, &key.digest());
    let doc = a.document(Status::Running, None);
    assert_eq!(
        doc.href,
        format!("/operations/create-export/{}", key.digest())
    );
    assert_eq!(doc.id, format!("create-export/{}", key.digest()));
    assert!(!doc.href.contains("order-42"));
    assert_eq!(doc.retry_after, Some(2));
    assert_eq!(doc.result, None);
    let done = a.document(Status::Succeeded, Some(201));
    assert_eq!(done.response_status, Some(201));
    assert_eq!(done.result, Some(format!("{}/result", doc.href)));
    assert_eq!(done.retry_after, None);
    let json = serde_json::to_value(&doc).unwrap();
    assert_eq!(json["status"], "running");
    assert!(json.get("response_status").is_none());
}

#[tokio::test]
async fn the_202_carries_location_and_retry_after() {
    let digest = crate::IdempotencyKey::parse("k").unwrap().digest();
    let resp = Address::new("/ops", &SPEC, &digest).accepted();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    assert_eq!(
        resp.headers()[header::LOCATION],
        format!("/ops/create-export/{digest}").as_str()
    );
    assert_eq!(resp.headers()[header::RETRY_AFTER], "2");
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
}
