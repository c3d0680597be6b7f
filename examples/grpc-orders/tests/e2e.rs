//! The gRPC example end to end: a tonic client against the real service (the
//! `grpc-orders` binary) over a real socket, on SQLite, PostgreSQL and MySQL /
//! MariaDB, and with its payments' leases on Redis. Each test has a database
//! (or Redis prefix) of its own.

mod harness;

use grpc_orders::pb::{
    CountOrdersRequest, CreateOrderRequest, CreatePaymentRequest, CreateRefundRequest,
};
use harness::{Db, Hold, Server, call};
use tonic::Code;
use tonic_types::StatusExt as _;

/// `CreateOrder` for `sku` under `key`.
fn order(key: &str, sku: &str) -> tonic::Request<CreateOrderRequest> {
    call(
        Some(key),
        CreateOrderRequest {
            sku: sku.into(),
            quantity: 1,
            amount_cents: 1250,
            note: String::new(),
            labels: [("channel".to_owned(), "web".to_owned())].into(),
        },
    )
}

fn replayed<T>(r: &tonic::Response<T>) -> bool {
    r.metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

async fn counts(server: &Server) -> (i64, i64, i64) {
    let c = server
        .client()
        .await
        .count_orders(call(None, CountOrdersRequest {}))
        .await
        .unwrap()
        .into_inner();
    (c.orders, c.refunds, c.charges)
}

/// Concurrent duplicates of one call: one order, every answer the same.
async fn concurrent_duplicates_make_one_order<D: Db>() {
    let db = D::create().await;
    // The first call is held inside its transaction until every duplicate
    // waits for it. The duplicates wait up to the longest in-flight wait, so
    // that a slow machine answers late rather than ABORTED.
    let hold = Hold::new();
    let server = Server::start(&db.url(), &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "5000")]).await;
    let n = 6;
    let mut calls = Vec::new();
    for _ in 0..n {
        let mut client = server.client().await;
        calls.push(tokio::spawn(async move {
            client.create_order(order("dup-1", "book")).await
        }));
    }
    server.wait_until_executing(1).await;
    server.wait_until_waiting(n - 1).await;
    hold.release();
    let mut ids = Vec::new();
    let mut fresh = 0;
    for c in calls {
        let answer = c.await.unwrap().expect("each duplicate gets the order");
        fresh += usize::from(!replayed(&answer));
        ids.push(answer.into_inner().id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one order for every duplicate: {ids:?}");
    assert_eq!(fresh, 1, "one execution; the others replay it");
    assert_eq!(counts(&server).await.0, 1);
    db.drop().await;
}

/// The client gives up once the method runs (the answer is lost); its retry
/// with the key replays the order the server made. The method is held inside
/// its transaction until the client has gone.
async fn a_retry_after_a_lost_response_replays<D: Db>() {
    let db = D::create().await;
    let hold = Hold::new();
    let server = Server::start(&db.url(), &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "5000")]).await;
    let mut client = server.client().await;
    let lost = tokio::spawn(async move { client.create_order(order("lost-1", "lamp")).await });
    server.wait_until_executing(1).await;
    // The client goes away: tonic cancels the call, the server's work goes on.
    lost.abort();
    assert!(lost.await.unwrap_err().is_cancelled());
    hold.release();
    let retry = server
        .client()
        .await
        .create_order(order("lost-1", "lamp"))
        .await
        .unwrap();
    assert!(replayed(&retry), "the work went on without its client");
    assert_eq!(retry.get_ref().sku, "lamp");
    assert_eq!(counts(&server).await.0, 1);
    db.drop().await;
}

/// Another message under a used key: `FAILED_PRECONDITION` with a
/// `PreconditionFailure`, and nothing runs.
async fn another_message_under_a_key_is_failed_precondition<D: Db>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let mut client = server.client().await;
    client.create_order(order("reused-1", "pen")).await.unwrap();
    let status = client
        .create_order(order("reused-1", "pencil"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let violation = &status
        .get_details_precondition_failure()
        .unwrap()
        .violations[0];
    assert_eq!(violation.r#type, "IDEMPOTENCY_KEY");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "IDEMPOTENCY_KEY_REUSED"
    );
    // The currency is part of the request too.
    let mut other_currency = order("reused-1", "pen");
    other_currency
        .metadata_mut()
        .insert("x-currency", "USD".parse().unwrap());
    let status = client.create_order(other_currency).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(counts(&server).await.0, 1);
    db.drop().await;
}

/// A duplicate while the first holds the key, past the in-flight wait:
/// `ABORTED` with `RetryInfo`; once done, the retry replays.
async fn a_duplicate_in_flight_is_aborted_with_retry_info<D: Db>() {
    let db = D::create().await;
    let hold = Hold::new();
    let server = Server::start(&db.url(), &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "100")]).await;
    let mut client = server.client().await;
    let first = tokio::spawn(async move { client.create_order(order("busy-1", "desk")).await });
    server.wait_until_executing(1).await;
    let status = server
        .client()
        .await
        .create_order(order("busy-1", "desk"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert!(
        status
            .get_details_retry_info()
            .unwrap()
            .retry_delay
            .is_some()
    );
    assert_eq!(status.get_details_error_info().unwrap().reason, "IN_FLIGHT");
    hold.release();
    let first = first.await.unwrap().unwrap();
    assert!(!replayed(&first));
    let retry = server
        .client()
        .await
        .create_order(order("busy-1", "desk"))
        .await
        .unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref().id, first.get_ref().id);
    db.drop().await;
}

/// SIGKILL inside the method's transaction: nothing is left, and the retry on
/// the restarted service executes.
async fn a_crash_before_commit_leaves_nothing<D: Db>() {
    let db = D::create().await;
    let mut server = Server::start(&db.url(), &[("ORDERS_LATENCY_MS", "600000")]).await;
    let mut client = server.client().await;
    let in_flight =
        tokio::spawn(async move { client.create_order(order("crash-1", "chair")).await });
    server.wait_until_executing(1).await;
    server.kill().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client sees the service die"
    );
    db.wait_until_no_open_transaction().await;
    let server = Server::start(&db.url(), &[]).await;
    assert_eq!(counts(&server).await.0, 0, "the crash left no order");
    let retry = server
        .client()
        .await
        .create_order(order("crash-1", "chair"))
        .await
        .unwrap();
    assert!(!replayed(&retry), "nothing was stored: the retry executes");
    assert_eq!(counts(&server).await.0, 1);
    db.drop().await;
}

/// `CreateRefund`'s key is its `request_id`: a stored `NOT_FOUND` replays,
/// the key is left out of the request's identity, and a missing one reserves
/// nothing.
async fn a_refunds_key_is_its_request_id_and_not_found_is_stored<D: Db>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let mut client = server.client().await;
    let refund = |order_id: i64, amount_cents: i64, request_id: &str| {
        call(
            None,
            CreateRefundRequest {
                order_id,
                amount_cents,
                request_id: request_id.into(),
            },
        )
    };
    let missing = client
        .create_refund(refund(999, 100, "r-1"))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert!(missing.metadata().get("idempotent-replayed").is_none());
    let again = client
        .create_refund(refund(999, 100, "r-1"))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::NotFound, "a decision: stored");
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again.message(), missing.message());

    let order_id = client
        .create_order(order("o-1", "bike"))
        .await
        .unwrap()
        .into_inner()
        .id;
    let made = client
        .create_refund(refund(order_id, 100, "r-2"))
        .await
        .unwrap();
    let replay = client
        .create_refund(refund(order_id, 100, "r-2"))
        .await
        .unwrap();
    assert!(replayed(&replay));
    assert_eq!(replay.get_ref(), made.get_ref());
    let reused = client
        .create_refund(refund(order_id, 200, "r-2"))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition);
    let no_key = client
        .create_refund(refund(order_id, 100, ""))
        .await
        .unwrap_err();
    assert_eq!(no_key.code(), Code::InvalidArgument);
    assert!(
        no_key.message().contains("request_id"),
        "{}",
        no_key.message()
    );
    assert_eq!(
        no_key.get_details_error_info().unwrap().reason,
        "IDEMPOTENCY_KEY_MISSING"
    );
    assert_eq!(counts(&server).await.1, 1, "one refund");
    db.drop().await;
}

/// No key, a malformed key, no caller: refused before anything is claimed.
async fn bad_calls_are_refused_and_reserve_nothing<D: Db>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let mut client = server.client().await;
    let mut no_key = order("x", "cup");
    no_key.metadata_mut().remove("idempotency-key");
    let status = client.create_order(no_key).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("idempotency-key"),
        "{}",
        status.message()
    );
    let status = client
        .create_order(order(&"k".repeat(300), "cup"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "IDEMPOTENCY_KEY_MALFORMED"
    );
    let mut anonymous = order("anon-1", "cup");
    anonymous.metadata_mut().remove("authorization");
    assert_eq!(
        client.create_order(anonymous).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    // The refused call reserved nothing: the key, sent properly, executes.
    let first = client.create_order(order("anon-1", "cup")).await.unwrap();
    assert!(!replayed(&first));
    // A method's own INVALID_ARGUMENT is a decision: stored.
    let mut bad = order("bad-1", "");
    bad.get_mut().quantity = 0;
    let first = client.create_order(bad).await.unwrap_err();
    assert_eq!(first.code(), Code::InvalidArgument);
    let mut bad = order("bad-1", "");
    bad.get_mut().quantity = 0;
    let again = client.create_order(bad).await.unwrap_err();
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(counts(&server).await.0, 1, "only the properly sent anon-1");
    db.drop().await;
}

/// `CreatePayment` holds a lease: duplicates make one charge at the provider,
/// a retry replays it, a decline is stored. Deterministic: the first call is
/// held after its charge, its lease held, while each duplicate is sent.
async fn payments_charge_once<D: Db>(lease_store: Option<&str>) {
    let db = D::create().await;
    let prefix = harness::unique("idem-grpc");
    let hold = Hold::new();
    let mut env = vec![hold.env_as("PAYMENTS_PROVIDER_HOLD_FILE")];
    if let Some(url) = lease_store {
        env.push(("IDEM_LEASE_STORE", url));
        env.push(("IDEM_LEASE_STORE_PREFIX", &prefix));
    }
    let server = Server::start(&db.url(), &env).await;
    let pay = |key: &str, amount_cents: i64| call(Some(key), CreatePaymentRequest { amount_cents });
    let mut client = server.client().await;
    let first = tokio::spawn(async move { client.create_payment(pay("pay-1", 900)).await });
    server.wait_until_executing(1).await;
    // A lease has no waiting room: each duplicate is refused while the first
    // runs, with the hint to retry.
    for _ in 0..3 {
        // Bounded: a duplicate that ran would charge, then wait on the hold.
        let refused = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            server.client().await.create_payment(pay("pay-1", 900)),
        )
        .await
        .expect("refused at once, not held with the first call")
        .unwrap_err();
        assert_eq!(refused.code(), Code::Aborted, "{refused:?}");
        assert!(refused.get_details_retry_info().is_some());
    }
    hold.release();
    let first = first.await.unwrap().expect("the first call charges");
    assert!(!replayed(&first));
    let charge = first.into_inner().charge_id;
    let mut client = server.client().await;
    let retry = client.create_payment(pay("pay-1", 900)).await.unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref().charge_id, charge);
    let declined = client
        .create_payment(pay("pay-2", 2_000_000))
        .await
        .unwrap_err();
    assert_eq!(declined.code(), Code::FailedPrecondition);
    let again = client
        .create_payment(pay("pay-2", 2_000_000))
        .await
        .unwrap_err();
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(counts(&server).await.2, 1, "one charge at the provider");
    db.drop().await;
}

/// A 32-byte key, base64, with the id `k1`: what `IDEM_KEY_RING` takes.
const RING: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// With `IDEM_KEY_RING` set, every answer the service stores (an order's message
/// in the transactional mode, a payment's in leased mode, a refund's stored
/// `NOT_FOUND`) is sealed in its row: the row names the key, and none of the
/// answer's telling values (the sku, the charge's id, the status's message) is
/// in it. A retry replays the same message or status, opened from the row.
async fn answers_are_sealed_at_rest_and_replay_the_message<D: Db>() {
    let db = D::create().await;
    let server = Server::start(&db.url(), &[("IDEM_KEY_RING", RING)]).await;
    let mut client = server.client().await;
    let sku = "sealed-sku-4242";
    let first = client.create_order(order("sealed-1", sku)).await.unwrap();
    assert!(!replayed(&first));
    let pay = || {
        call(
            Some("sealed-pay-1"),
            CreatePaymentRequest { amount_cents: 4242 },
        )
    };
    let charged = client.create_payment(pay()).await.unwrap();
    assert!(!replayed(&charged));
    let refund = || {
        call(
            None,
            CreateRefundRequest {
                order_id: 4242,
                amount_cents: 100,
                request_id: "sealed-r-1".into(),
            },
        )
    };
    let missing = client.create_refund(refund()).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let rows = db.answers().await;
    assert_eq!(
        rows.len(),
        3,
        "an order's answer, a payment's and a refund's"
    );
    for (headers, body) in &rows {
        assert!(headers.contains(":idem-sealed"), "{headers}");
        assert!(headers.contains("\"k1\""), "{headers}");
        assert!(
            !headers.contains("grpc"),
            "the content type is sealed: {headers}"
        );
        assert!(
            !body.windows(sku.len()).any(|w| w == sku.as_bytes()),
            "the order's sku is in a row"
        );
        let charge = charged.get_ref().charge_id.as_bytes();
        assert!(
            !body.windows(charge.len()).any(|w| w == charge),
            "the charge id is in a row"
        );
        let status = missing.message().as_bytes();
        assert!(
            !body.windows(status.len()).any(|w| w == status),
            "the refund's status message is in a row"
        );
    }
    let again = client.create_order(order("sealed-1", sku)).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
    let again = client.create_payment(pay()).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), charged.get_ref());
    let again = client.create_refund(refund()).await.unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again.message(), missing.message());
    assert_eq!(counts(&server).await, (1, 0, 1));
    db.drop().await;
}

/// Each scenario above, stamped per database.
macro_rules! backend_tests {
    ($($module:ident => $db:ty),* $(,)?) => {$(
        mod $module {
            use super::*;

            backend_tests!(@each $db;
                concurrent_duplicates_make_one_order,
                a_retry_after_a_lost_response_replays,
                another_message_under_a_key_is_failed_precondition,
                a_duplicate_in_flight_is_aborted_with_retry_info,
                a_crash_before_commit_leaves_nothing,
                a_refunds_key_is_its_request_id_and_not_found_is_stored,
                bad_calls_are_refused_and_reserve_nothing,
                answers_are_sealed_at_rest_and_replay_the_message,
            );

            #[tokio::test]
            async fn payments_charge_once() {
                super::payments_charge_once::<$db>(None).await;
            }
        }
    )*};
    (@each $db:ty; $($test:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $test() {
            super::$test::<$db>().await;
        }
    )*};
}

backend_tests!(
    sqlite => harness::SqliteDb,
    postgres => harness::PgDb,
    mysql => harness::MySqlDb,
);

/// The payments' leases on Redis (the charges stay in the database).
#[tokio::test]
async fn redis_payments_charge_once() {
    payments_charge_once::<harness::SqliteDb>(Some("redis://127.0.0.1:6379")).await;
}

/// The client half: one key for every attempt, `ABORTED` waited out by its
/// `RetryInfo` until the replay, `FAILED_PRECONDITION` never retried.
#[tokio::test]
async fn the_client_half_waits_out_in_flight_and_never_retries_a_reused_key() {
    use idem_client::IdempotencyKey;
    use idem_client::grpc::Retrying;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let db = harness::SqliteDb::create().await;
    let hold = Hold::new();
    let server = Server::start(&db.url(), &[hold.env(), ("IDEM_IN_FLIGHT_WAIT_MS", "100")]).await;
    let mut first_client = server.client().await;
    let first = tokio::spawn(async move { first_client.create_order(order("cli-1", "mug")).await });
    server.wait_until_executing(1).await;

    let client = server.client().await;
    let attempts = AtomicUsize::new(0);
    let send = |mut request: tonic::Request<CreateOrderRequest>| {
        // The first attempt meets the held call (ABORTED); the first call is
        // let go before the second, which then waits it out or replays it.
        if attempts.fetch_add(1, Ordering::SeqCst) == 1 {
            hold.release();
        }
        let template = call(None, ());
        for (name, value) in [
            ("authorization", "authorization"),
            ("x-currency", "x-currency"),
        ] {
            let v = template.metadata().get(value).unwrap().clone();
            request.metadata_mut().insert(name, v);
        }
        let mut client = client.clone();
        async move { client.create_order(request).await }
    };
    let key = IdempotencyKey::new("cli-1").unwrap();
    // Each ABORTED asks for a second's wait; enough attempts for a slow machine.
    let answer = Retrying::new()
        .attempts(60)
        .call_with_key(&key, order("x", "mug").into_inner(), send)
        .await
        .expect("the retry replays the first call's order");
    assert!(replayed(&answer));
    assert!(
        attempts.load(Ordering::SeqCst) >= 2,
        "it waited out ABORTED"
    );
    assert_eq!(
        answer.get_ref().id,
        first.await.unwrap().unwrap().get_ref().id
    );

    let attempts_before = attempts.load(Ordering::SeqCst);
    let status = Retrying::new()
        .call_with_key(&key, order("x", "teapot").into_inner(), send)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        attempts_before + 1,
        "never retried"
    );
    assert_eq!(counts(&server).await.0, 1);
    db.drop().await;
}

/// The database out of reach: `UNAVAILABLE` with `RetryInfo`, nothing stored;
/// once it is back, the retry with the key executes.
#[tokio::test]
async fn a_store_out_of_reach_is_unavailable_with_retry_info() {
    let db = harness::PgDb::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let mut client = server.client().await;
    client.create_order(order("warm-1", "pen")).await.unwrap();
    db.refuse_connections(true).await;
    let status = client
        .create_order(order("down-1", "pen"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status
            .get_details_retry_info()
            .unwrap()
            .retry_delay
            .is_some()
    );
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "STORE_UNAVAILABLE"
    );
    db.refuse_connections(false).await;
    let retry = client.create_order(order("down-1", "pen")).await.unwrap();
    assert!(!replayed(&retry), "nothing was stored: the retry executes");
    assert_eq!(counts(&server).await.0, 2);
    db.drop().await;
}

/// The provider charges but its answer is lost: the payment's outcome is
/// uncertain (`ABORTED`, reason `OUTCOME_UNCERTAIN`, with `RetryInfo`), never
/// charged again; once the reconciler has asked the provider, the retry
/// replays the charge.
async fn an_uncertain_payment_is_settled_by_the_reconciler(lease_store: Option<&str>) {
    use idem_client::IdempotencyKey;
    use idem_client::grpc::Retrying;

    let db = harness::SqliteDb::create().await;
    let prefix = harness::unique("idem-grpc");
    let mut env = vec![
        ("PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE", "1"),
        ("PAYMENTS_RECONCILE_INTERVAL_MS", "200"),
    ];
    if let Some(url) = lease_store {
        env.push(("IDEM_LEASE_STORE", url));
        env.push(("IDEM_LEASE_STORE_PREFIX", &prefix));
    }
    let server = Server::start(&db.url(), &env).await;
    let mut client = server.client().await;
    let pay = || call(Some("unsure-1"), CreatePaymentRequest { amount_cents: 700 });
    let status = client.create_payment(pay()).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "OUTCOME_UNCERTAIN"
    );
    assert!(status.get_details_retry_info().is_some());

    let send = |mut request: tonic::Request<CreatePaymentRequest>| {
        *request.metadata_mut() = pay().metadata().clone();
        let mut client = client.clone();
        async move { client.create_payment(request).await }
    };
    let settled = Retrying::new()
        .attempts(300)
        .max_wait(std::time::Duration::from_millis(100))
        .call_with_key(
            &IdempotencyKey::new("unsure-1").unwrap(),
            CreatePaymentRequest { amount_cents: 700 },
            send,
        )
        .await
        .expect("the reconciler settles the payment");
    assert!(
        replayed(&settled),
        "the reconciler's answer, not a second run"
    );
    assert!(settled.get_ref().charge_id.starts_with("ch_"));
    assert_eq!(
        counts(&server).await.2,
        1,
        "one charge, made before the timeout"
    );
    db.drop().await;
}

#[tokio::test]
async fn an_uncertain_payment_is_settled_by_the_reconciler_on_sqlite() {
    an_uncertain_payment_is_settled_by_the_reconciler(None).await;
}

#[tokio::test]
async fn an_uncertain_payment_is_settled_by_the_reconciler_on_redis() {
    an_uncertain_payment_is_settled_by_the_reconciler(Some("redis://127.0.0.1:6379")).await;
}

/// A reconcile interval of 0 (the reconciler in a tight loop) stops the
/// example at start, naming the variable, before it listens.
#[tokio::test]
async fn a_reconcile_interval_of_zero_is_a_clear_startup_error() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_grpc-orders"))
        .env("PAYMENTS_RECONCILE_INTERVAL_MS", "0")
        .env("IDEM_ADDR", "127.0.0.1:0")
        .env("DATABASE_URL", "sqlite::memory:")
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), out)
        .await
        .expect("the example exits within 60 s")
        .unwrap();
    assert!(!out.status.success(), "exited successfully");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(
            "PAYMENTS_RECONCILE_INTERVAL_MS is 0; an interval of at least 1 ms is needed"
        ),
        "{said}"
    );
    assert!(out.stdout.is_empty(), "it never listened: {out:?}");
}
