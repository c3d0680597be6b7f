//! Leased mode on the Redis lease store (feature `redis`), against the real
//! Redis at 127.0.0.1:6379 (`IDEM_TEST_REDIS_URL` overrides it). Every test has
//! a key prefix of its own, so they run in parallel.
//!
//! The behaviours of `tests/leased.rs` that apply (fencing, takeover with the
//! stable downstream key, renewal, uncertain outcomes and the reconciler,
//! mismatch, concurrent claims, the handler's answers) are written here against
//! Redis; the SQL suite inspects rows with SQL, which has no meaning here, so
//! these inspect the Redis records (PTTL, HGET, ZSCORE, SCAN) instead. Plus what
//! only Redis has: retention by expiry, no raw key anywhere, foreign data left
//! untouched.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idem_runtime::lease::{Acquisition, LeaseError};
use idem_runtime::reconcile::{Reconcile, Reconciler, Resolution, UncertainOutcome};
use idem_runtime::redis::{EvictionVerdict, Redis, RedisLeaseStore, eviction_verdict};
use idem_runtime::{
    FingerprintBuilder, Idem, IdempotencyKey, Lease, LeaseRequest, LeasedClaim, StoreError,
    StoredResponse, Uncertain, idempotent,
};
use redis::AsyncCommands;
use redis::aio::ConnectionManager;
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};
use tower::ServiceExt;

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

async fn conn() -> ConnectionManager {
    let client = redis::Client::open(redis_url()).unwrap();
    ConnectionManager::new(client).await.unwrap()
}

/// A store under a prefix of this test's own.
async fn store(test: &str) -> RedisLeaseStore {
    let prefix = format!("idem-t{}-{test}", std::process::id());
    let mut c = conn().await;
    delete_prefix(&mut c, &prefix).await;
    RedisLeaseStore::with_connection(c, &prefix).await.unwrap()
}

async fn keys_under(c: &mut ConnectionManager, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await
            .unwrap();
        out.extend(batch);
        if next == 0 {
            return out;
        }
        cursor = next;
    }
}

async fn delete_prefix(c: &mut ConnectionManager, prefix: &str) {
    for k in keys_under(c, prefix).await {
        let _: () = c.del(k).await.unwrap();
    }
}

const HOUR: Duration = Duration::from_secs(3600);

fn fp(amount: i64) -> idem_runtime::Fingerprint {
    FingerprintBuilder::new("acme", "create-payment", "POST", "/payments")
        .body(&json!({ "amount": amount }))
        .unwrap()
        .finish()
}

fn lease_req(key: &IdempotencyKey, lease: Duration) -> LeaseRequest<'_> {
    LeaseRequest {
        tenant: "acme",
        operation: "create-payment",
        key,
        fingerprint: fp(100),
        retention: HOUR,
        lease,
    }
}

fn paid(charge: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: format!("{{\"charge\":\"{charge}\"}}").into(),
    }
}

async fn acquire(s: &RedisLeaseStore, key: &IdempotencyKey, lease: Duration) -> Lease<Redis> {
    match s.claim(&lease_req(key, lease)).await.unwrap() {
        LeasedClaim::Acquired(l) => l,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

/// Claims until the lease has lapsed on the server's clock (every claim before
/// answers in flight), within a bound.
async fn take_over(s: &RedisLeaseStore, key: &IdempotencyKey, lease: Duration) -> Lease<Redis> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match s.claim(&lease_req(key, lease)).await.unwrap() {
            LeasedClaim::Acquired(l) => return l,
            LeasedClaim::InFlight { .. } => {}
            other => panic!("expected in flight, then a takeover; got {other:?}"),
        }
        assert!(Instant::now() < deadline, "the lease never lapsed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_stale_owner_cannot_publish_after_a_takeover_which_keeps_the_downstream_key() {
    let s = store("stale").await;
    let key = IdempotencyKey::parse("stale-1").unwrap();
    let first = acquire(&s, &key, Duration::from_millis(200)).await;
    assert_eq!(first.generation(), 1);
    assert_eq!(first.acquisition(), Acquisition::New);
    let second = take_over(&s, &key, Duration::from_secs(30)).await;
    assert_eq!(second.acquisition(), Acquisition::TakenOver);
    assert_eq!(second.generation(), 2);
    assert_eq!(first.downstream_key(), second.downstream_key());
    assert_eq!(
        second.downstream_key(),
        idem_runtime::lease::downstream_key("acme", "create-payment", &key)
    );

    // The stalled first owner can neither renew, publish, release nor mark.
    assert!(matches!(
        first.renew().await,
        Err(LeaseError::StaleOwner { generation: 1 })
    ));
    assert!(matches!(
        first.complete(&paid("ch_stale")).await,
        Err(LeaseError::StaleOwner { generation: 1 })
    ));
    second.complete(&paid("ch_1")).await.unwrap();
    match s.claim(&lease_req(&key, HOUR)).await.unwrap() {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_1")),
        other => panic!("expected the new owner's outcome, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stale_owner_cannot_release_or_mark_the_new_owners_record() {
    let s = store("stale-fence").await;
    for (i, release) in [(1, true), (2, false)] {
        let key = IdempotencyKey::parse(format!("stale-fence-{i}")).unwrap();
        let first = acquire(&s, &key, Duration::from_millis(200)).await;
        let second = take_over(&s, &key, Duration::from_secs(30)).await;
        let refused = if release {
            first.release().await
        } else {
            first.mark_uncertain().await
        };
        assert!(matches!(refused, Err(LeaseError::StaleOwner { .. })));
        // The new owner's record is untouched: still in flight, then its outcome.
        assert!(matches!(
            s.claim(&lease_req(&key, HOUR)).await.unwrap(),
            LeasedClaim::InFlight { .. }
        ));
        second.complete(&paid("ch_2")).await.unwrap();
    }
    assert_eq!(
        s.connection()
            .zcard::<_, i64>(s.uncertain_index("create-payment"))
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn renewal_extends_the_lease_on_the_server_clock() {
    let s = store("renew").await;
    let key = IdempotencyKey::parse("renew-1").unwrap();
    let lease = acquire(&s, &key, Duration::from_secs(2)).await;
    let name = s.record_key("acme", "create-payment", &key);
    let mut c = s.connection();
    let before: i64 = c.hget(&name, "lease_until").await.unwrap();
    // The record outlives its lease by the retention, so a crashed owner's
    // record is taken over rather than forgotten.
    let pttl: i64 = c.pttl(&name).await.unwrap();
    assert!(pttl > HOUR.as_millis() as i64, "pttl {pttl}");
    tokio::time::sleep(Duration::from_millis(5)).await;
    lease.renew().await.unwrap();
    let after: i64 = c.hget(&name, "lease_until").await.unwrap();
    assert!(after > before, "{after} > {before}");
    match s.claim(&lease_req(&key, HOUR)).await.unwrap() {
        LeasedClaim::InFlight { retry_after } => {
            assert!(retry_after >= Duration::from_secs(1) && retry_after <= Duration::from_secs(2))
        }
        other => panic!("expected in flight, got {other:?}"),
    }
    lease.complete(&paid("ch_r")).await.unwrap();
}

#[tokio::test]
async fn release_frees_the_key_and_a_mismatch_is_reported() {
    let s = store("release").await;
    let key = IdempotencyKey::parse("release-1").unwrap();
    let lease = acquire(&s, &key, HOUR).await;
    let other = LeaseRequest {
        fingerprint: fp(999),
        ..lease_req(&key, HOUR)
    };
    assert!(matches!(
        s.claim(&other).await.unwrap(),
        LeasedClaim::Mismatch
    ));
    lease.release().await.unwrap();
    let again = acquire(&s, &key, HOUR).await;
    assert_eq!(again.acquisition(), Acquisition::New);
    again.complete(&paid("ch_x")).await.unwrap();
    assert!(matches!(
        s.claim(&other).await.unwrap(),
        LeasedClaim::Mismatch
    ));
}

#[tokio::test]
async fn retention_is_the_records_expiry() {
    let s = store("retention").await;
    let key = IdempotencyKey::parse("retention-1").unwrap();
    let req = LeaseRequest {
        retention: Duration::from_millis(300),
        ..lease_req(&key, HOUR)
    };
    let lease = match s.claim(&req).await.unwrap() {
        LeasedClaim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    lease.complete(&paid("ch_t")).await.unwrap();
    let name = s.record_key("acme", "create-payment", &key);
    let mut c = s.connection();
    let pttl: i64 = c.pttl(&name).await.unwrap();
    assert!(pttl > 0 && pttl <= 300, "the retention is the TTL: {pttl}");
    // Redis expires it (bounded poll: expiry is the server's).
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.exists::<_, bool>(&name).await.unwrap() {
        assert!(Instant::now() < deadline, "the record never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new execution, generation 1 again: the expired record is gone.
    let again = acquire(&s, &key, HOUR).await;
    assert_eq!(
        (again.acquisition(), again.generation()),
        (Acquisition::New, 1)
    );
    again.release().await.unwrap();
}

/// Charges made downstream, by downstream key.
#[derive(Default, Clone)]
struct Ledger(Arc<Mutex<HashMap<String, String>>>);

struct AskLedger(Ledger);

impl Reconcile for AskLedger {
    fn operation(&self) -> &str {
        "create-payment"
    }
    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        match self.0.0.lock().unwrap().get(&outcome.downstream_key) {
            Some(charge) => Resolution::Completed(paid(charge)),
            None => Resolution::Released,
        }
    }
}

#[tokio::test]
async fn an_uncertain_outcome_never_expires_and_is_reconciled_by_its_downstream_key() {
    let s = store("uncertain").await;
    let ledger = Ledger::default();
    let charged = IdempotencyKey::parse("uncertain-charged").unwrap();
    let not_charged = IdempotencyKey::parse("uncertain-none").unwrap();
    for key in [&charged, &not_charged] {
        let lease = acquire(&s, key, HOUR).await;
        if key == &charged {
            ledger
                .0
                .lock()
                .unwrap()
                .insert(lease.downstream_key(), "ch_u".into());
        }
        lease.mark_uncertain().await.unwrap();
    }
    let mut c = s.connection();
    let name = s.record_key("acme", "create-payment", &charged);
    assert_eq!(c.pttl::<_, i64>(&name).await.unwrap(), -1, "no expiry");
    let index = s.uncertain_index("create-payment");
    assert_eq!(c.zcard::<_, i64>(&index).await.unwrap(), 2);
    assert!(matches!(
        s.claim(&lease_req(&charged, HOUR)).await.unwrap(),
        LeasedClaim::Uncertain
    ));

    let reconciler = Reconciler::<_, Redis>::on_store(s.clone(), AskLedger(ledger.clone()));
    let report = reconciler.run_once().await.unwrap();
    assert_eq!(
        (report.completed, report.released, report.errors),
        (1, 1, 0)
    );
    match s.claim(&lease_req(&charged, HOUR)).await.unwrap() {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_u")),
        other => panic!("expected the reconciled outcome, got {other:?}"),
    }
    let pttl: i64 = c.pttl(&name).await.unwrap();
    assert!(
        pttl > 0 && pttl <= HOUR.as_millis() as i64,
        "retention from the resolution: {pttl}"
    );
    assert_eq!(c.zcard::<_, i64>(&index).await.unwrap(), 0);
    let again = acquire(&s, &not_charged, HOUR).await;
    assert_eq!(again.acquisition(), Acquisition::New);
    again.release().await.unwrap();
    // A round with nothing left does nothing.
    assert_eq!(reconciler.run_once().await.unwrap(), Default::default());
}

#[tokio::test]
async fn a_late_resolution_never_applies_to_a_later_execution_of_the_key() {
    let s = store("late").await;
    let key = IdempotencyKey::parse("late-1").unwrap();
    acquire(&s, &key, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();

    /// Resolves the row after the key was released and executed again.
    struct Late(RedisLeaseStore, IdempotencyKey);
    impl Reconcile for Late {
        fn operation(&self) -> &str {
            "create-payment"
        }
        async fn reconcile(&self, _: &UncertainOutcome) -> Resolution {
            // Meanwhile: someone resolves it, and a new execution holds the key.
            let mut c = self.0.connection();
            let _: () = c
                .del(self.0.record_key("acme", "create-payment", &self.1))
                .await
                .unwrap();
            let lease = acquire(&self.0, &self.1, HOUR).await;
            lease.mark_uncertain().await.unwrap();
            Resolution::Completed(paid("ch_late"))
        }
    }
    let r = Reconciler::<_, Redis>::on_store(s.clone(), Late(s.clone(), key.clone()));
    let report = r.run_once().await.unwrap();
    assert_eq!(
        report.completed, 0,
        "the answer was about another execution"
    );
    // The later execution is still uncertain, untouched.
    assert!(matches!(
        s.claim(&lease_req(&key, HOUR)).await.unwrap(),
        LeasedClaim::Uncertain
    ));
}

#[tokio::test]
async fn of_concurrent_claims_of_one_key_exactly_one_acquires() {
    let s = store("race").await;
    let key = IdempotencyKey::parse("race-1").unwrap();
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (s, key, barrier) = (s.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                s.claim(&lease_req(&key, HOUR)).await.unwrap()
            })
        })
        .collect();
    let mut acquired = 0;
    for t in tasks {
        match t.await.unwrap() {
            LeasedClaim::Acquired(l) => {
                acquired += 1;
                std::mem::forget(l);
            }
            LeasedClaim::InFlight { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(acquired, 1);
}

#[tokio::test]
async fn no_raw_key_is_ever_sent_to_or_kept_in_redis() {
    let s = store("raw").await;
    let raw = "RAW-KEY-7f3a-never-stored";
    let key = IdempotencyKey::parse(raw).unwrap();
    let done = acquire(&s, &key, HOUR).await;
    done.renew().await.unwrap();
    done.complete(&paid("ch_raw")).await.unwrap();
    let raw2 = format!("{raw}-uncertain");
    let key2 = IdempotencyKey::parse(&raw2).unwrap();
    acquire(&s, &key2, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let mut c = s.connection();
    let prefix = format!("idem-t{}-raw", std::process::id());
    let keys = keys_under(&mut c, &prefix).await;
    assert_eq!(
        keys.len(),
        3,
        "two records and the uncertain index: {keys:?}"
    );
    for k in keys {
        assert!(!k.contains(raw), "a key name holds the raw key: {k}");
        let kind: String = redis::cmd("TYPE")
            .arg(&k)
            .query_async(&mut c)
            .await
            .unwrap();
        let values: Vec<Vec<u8>> = match kind.as_str() {
            "hash" => {
                let h: HashMap<String, Vec<u8>> = c.hgetall(&k).await.unwrap();
                h.into_iter()
                    .flat_map(|(f, v)| [f.into_bytes(), v])
                    .collect()
            }
            "zset" => c.zrange(&k, 0, -1).await.unwrap(),
            other => panic!("unexpected {other} at {k}"),
        };
        for v in values {
            let v = String::from_utf8_lossy(&v);
            assert!(!v.contains(raw), "{k} holds the raw key: {v}");
        }
    }
}

#[tokio::test]
async fn foreign_or_malformed_data_is_a_clear_error_and_is_left_as_it_was() {
    let s = store("foreign").await;
    let mut c = s.connection();
    // Not a hash.
    let key = IdempotencyKey::parse("foreign-1").unwrap();
    let name = s.record_key("acme", "create-payment", &key);
    let _: () = c.set(&name, "someone else's").await.unwrap();
    let e = s.claim(&lease_req(&key, HOUR)).await.unwrap_err();
    assert!(matches!(e, StoreError::Redis(_)), "{e}");
    assert!(e.to_string().contains("not a hash"), "{e}");
    assert_eq!(c.get::<_, String>(&name).await.unwrap(), "someone else's");
    // A hash of another format.
    let key2 = IdempotencyKey::parse("foreign-2").unwrap();
    let name2 = s.record_key("acme", "create-payment", &key2);
    let _: () = c
        .hset_multiple(&name2, &[("v", "2"), ("state", "processing")])
        .await
        .unwrap();
    let e = s.claim(&lease_req(&key2, HOUR)).await.unwrap_err();
    assert!(e.to_string().contains("format 1"), "{e}");
    let h: HashMap<String, String> = c.hgetall(&name2).await.unwrap();
    assert_eq!(h.len(), 2);
    assert_eq!(h["v"], "2");
    // An idem record with a field gone.
    let key3 = IdempotencyKey::parse("foreign-3").unwrap();
    acquire(&s, &key3, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let name3 = s.record_key("acme", "create-payment", &key3);
    let _: () = c.hdel(&name3, "gen").await.unwrap();
    let before: HashMap<String, Vec<u8>> = c.hgetall(&name3).await.unwrap();
    let e = s.claim(&lease_req(&key3, HOUR)).await.unwrap_err();
    assert!(e.to_string().contains("corrupt"), "{e}");
    // The reconciler skips it, and it stays as it was.
    let r = Reconciler::<_, Redis>::on_store(s.clone(), AskLedger(Ledger::default()));
    r.run_once().await.unwrap();
    let after: HashMap<String, Vec<u8>> = c.hgetall(&name3).await.unwrap();
    assert_eq!(before, after);
    for n in [name, name2, name3] {
        let _: () = c.del(n).await.unwrap();
    }
}

#[tokio::test]
async fn the_start_up_check_reads_the_live_policy() {
    let s = store("policy").await;
    let mut c = s.connection();
    let policy: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut c)
        .await
        .unwrap();
    let max: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory")
        .query_async(&mut c)
        .await
        .unwrap();
    let expected = eviction_verdict(&policy[1], max[1].parse().unwrap());
    assert_eq!(s.check_eviction().await.unwrap(), expected);
    // The store was built, so the live policy is not one it refuses.
    assert!(!matches!(expected, EvictionVerdict::Refuse(_)));
}

// --- through `#[idempotent]`: the handler's answers --------------------------

#[derive(Clone)]
struct App {
    idem: Idem<Redis>,
    ledger: Ledger,
    calls: Arc<AtomicUsize>,
    entered: Option<mpsc::UnboundedSender<()>>,
    release: Arc<Semaphore>,
    crash_next: Arc<AtomicBool>,
}

impl FromRef<App> for Idem<Redis> {
    fn from_ref(a: &App) -> Idem<Redis> {
        a.idem.clone()
    }
}

#[idempotent(
    operation = "create-payment",
    single_tenant,
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment(State(app): State<App>, lease: &mut Lease<Redis>) -> Response {
    if app.crash_next.swap(false, Ordering::SeqCst) {
        panic!("simulated crash inside the handler");
    }
    if lease.acquisition() == Acquisition::New
        && let Some(entered) = &app.entered
    {
        entered.send(()).ok();
        app.release.acquire().await.unwrap().forget();
    }
    app.calls.fetch_add(1, Ordering::SeqCst);
    let charge = {
        let mut l = app.ledger.0.lock().unwrap();
        let n = l.len();
        l.entry(lease.downstream_key())
            .or_insert_with(|| format!("ch_{n}"))
            .clone()
    };
    if charge == "uncertain" {
        return Uncertain::new("timed out").into_response();
    }
    (StatusCode::CREATED, format!("{{\"charge\":\"{charge}\"}}")).into_response()
}

async fn app(test: &str, gate: bool) -> (Router, App, mpsc::UnboundedReceiver<()>) {
    let s = store(test).await;
    let (tx, entered) = mpsc::unbounded_channel();
    let app = App {
        idem: s.idem(),
        ledger: Ledger::default(),
        calls: Arc::default(),
        entered: gate.then_some(tx),
        release: Arc::new(Semaphore::new(0)),
        crash_next: Arc::default(),
    };
    let router = Router::new()
        .route("/payments", post(create_payment))
        .with_state(app.clone());
    (router, app, entered)
}

fn pay(key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

async fn send(router: &Router, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
    )
}

#[tokio::test]
async fn a_duplicate_in_flight_gets_409_and_a_finished_payment_replays() {
    let (router, app, mut entered) = app("http-flight", true).await;
    let r = router.clone();
    let first = tokio::spawn(async move { send(&r, pay("pay-1")).await });
    entered.recv().await.unwrap();
    let (status, headers, _) = send(&router, pay("pay-1")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.contains_key("retry-after"));
    app.release.add_permits(1);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, replayed) = send(&router, pay("pay-1")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, body);
    assert_eq!(app.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_crashed_worker_is_taken_over_after_its_lease_and_charges_once() {
    let (router, app, _) = app("http-crash", false).await;
    app.crash_next.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&router, pay("pay-crash")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    // Retries answer 409 until the lease lapses, then one takes over.
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let (status, _, body) = send(&router, pay("pay-crash")).await;
        match status {
            StatusCode::CONFLICT => {}
            StatusCode::CREATED => break body,
            other => panic!("{other}"),
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(send(&router, pay("pay-crash")).await.2, body);
    assert_eq!(app.ledger.0.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn an_uncertain_answer_is_202_and_never_runs_again() {
    let (router, app, _) = app("http-uncertain", false).await;
    // The ledger says "uncertain" for this key's downstream key.
    let key = IdempotencyKey::parse("pay-u").unwrap();
    app.ledger.0.lock().unwrap().insert(
        idem_runtime::lease::downstream_key(idem_runtime::SingleTenant::ID, "create-payment", &key),
        "uncertain".into(),
    );
    assert_eq!(send(&router, pay("pay-u")).await.0, StatusCode::ACCEPTED);
    assert_eq!(send(&router, pay("pay-u")).await.0, StatusCode::ACCEPTED);
    assert_eq!(app.calls.load(Ordering::SeqCst), 1);
}
