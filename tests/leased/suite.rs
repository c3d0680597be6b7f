//! Every test of the leased suite, written once against the enclosing store
//! module's `H` (its `LeaseHarness`, `tests/common/lease_harness.rs`) and `Db`.
//! The tests that go through `#[idempotent]` handlers need `Lease<Db>` of a
//! concrete store, so `tests/leased.rs` mounts this file in each store's module
//! and stamps a `#[tokio::test]` wrapper per test there.

use super::*;

pub async fn acquire(h: &H, key: &IdempotencyKey, lease: Duration) -> Lease<Db> {
    match h.claim(&lease_req(key, lease)).await {
        LeasedClaim::Acquired(l) => l,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

pub async fn record(h: &H, key: &str) -> Record {
    let key = IdempotencyKey::parse(key).unwrap();
    h.record(&key).await.expect("the key has a record")
}

/// Whether `key`'s lease is seen renewed twice (three values of its deadline
/// on the store) within `limit`, which only bounds a failure.
async fn renewed_twice(h: &H, key: &str, limit: Duration) -> bool {
    let mut seen = std::collections::HashSet::new();
    let deadline = Instant::now() + limit;
    while seen.len() < 3 && Instant::now() < deadline {
        seen.insert(record(h, key).await.lease_until);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen.len() >= 3
}

/// A hand-written request with a lease or retention under a
/// millisecond (zero included; every store counts whole milliseconds)
/// is refused the same way on every store, and reserves nothing.
pub async fn a_zero_lease_or_retention_by_hand_is_refused_and_reserves_nothing() {
    let h = H::new("zero").await;
    let key = IdempotencyKey::parse("zero-1").unwrap();
    for (lease, retention, named) in [
        (Duration::ZERO, HOUR, "a lease of 0ns is refused"),
        (HOUR, Duration::ZERO, "a retention of 0ns is refused"),
        (
            Duration::from_micros(500),
            HOUR,
            "a lease of 500µs is refused",
        ),
        (
            HOUR,
            Duration::from_micros(999),
            "a retention of 999µs is refused",
        ),
    ] {
        let req = LeaseRequest {
            retention,
            ..lease_req(&key, lease)
        };
        let e = h.try_claim(&req).await.expect_err("refused");
        assert!(matches!(e, StoreError::InvalidRequest(_)), "{e}");
        let message = e.to_string();
        assert!(message.starts_with("invalid request: "), "{message}");
        assert!(message.contains(named), "{message}");
        assert!(message.contains("at least 1 ms"), "{message}");
        assert_eq!(h.records().await, 0, "nothing reserved: {message}");
    }
    // A millisecond each is the least accepted.
    let least = LeaseRequest {
        retention: Duration::from_millis(1),
        ..lease_req(&key, Duration::from_millis(1))
    };
    assert!(matches!(h.claim(&least).await, LeasedClaim::Acquired(_)));
}

/// A hand-written lease and retention of `Duration::MAX` (taken as a
/// century) complete on every store, and the retry replays: not an expiry
/// past what the store counts (a refused claim on PostgreSQL and MySQL; on
/// SQLite a REAL no later read takes, so every retry of the key failed).
pub async fn a_lease_and_retention_of_duration_max_complete_and_replay() {
    let h = H::new("duration-max").await;
    let key = IdempotencyKey::parse("forever-1").unwrap();
    let req = LeaseRequest {
        retention: Duration::MAX,
        ..lease_req(&key, Duration::MAX)
    };
    let LeasedClaim::Acquired(lease) = h.claim(&req).await else {
        panic!("a new key is acquired");
    };
    lease.complete(&paid("ch_forever")).await.unwrap();
    match h.claim(&req).await {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_forever")),
        other => panic!("the retry replays: {other:?}"),
    }
}

pub async fn a_stale_owner_cannot_publish_and_the_provider_charges_once() {
    let h = H::new("stale-publish").await;
    let provider = Provider::default();
    let key = IdempotencyKey::parse("pay-1").unwrap();
    let lease = Duration::from_millis(200);

    // Worker A claims and charges, then stalls (no renewal) past its lease.
    let a = acquire(&h, &key, lease).await;
    assert_eq!(a.acquisition(), Acquisition::New);
    let charge_a = provider.charge(&a.downstream_key(), 100).await.unwrap();
    until_lease_lapsed(&h, &key).await;

    // Worker B takes over with a new generation and the same downstream key.
    let b = acquire(&h, &key, lease).await;
    assert_eq!(b.acquisition(), Acquisition::TakenOver);
    assert_eq!(b.generation(), a.generation() + 1);
    assert_eq!(b.downstream_key(), a.downstream_key());
    assert_eq!(
        b.downstream_key(),
        idem_runtime::lease::downstream_key(TENANT, OPERATION, &key)
    );
    let charge_b = provider.charge(&b.downstream_key(), 100).await.unwrap();
    assert_eq!(
        charge_b, charge_a,
        "the provider deduplicates by the stable key"
    );
    b.complete(&paid(&charge_b)).await.unwrap();

    // A wakes up and tries to renew, then to publish: fenced out.
    assert!(matches!(
        a.renew().await,
        Err(LeaseError::StaleOwner { generation: 1 })
    ));
    let late = a
        .complete(&StoredResponse {
            status: 201,
            headers: vec![],
            body: "A's result".into(),
        })
        .await;
    assert!(
        matches!(late, Err(LeaseError::StaleOwner { generation: 1 })),
        "{late:?}"
    );
    assert_eq!(
        h.record(&key).await.unwrap().body,
        Some(paid(&charge_b).body.to_vec()),
        "A's result is never published"
    );
    assert_eq!(provider.charge_count(), 1);
}

/// A stalled worker and the worker that took its key over, in one process,
/// are renewed in one batch: the batch tells the stalled one that its lease
/// is lost, not renewed because its key's row was (by the new owner), and
/// leaves the row's lease the new owner's.
pub async fn a_batch_renewal_tells_the_taken_over_owner_it_lost() {
    use idem_runtime::test_util::{Renewed, renew_together};

    let h = H::new("batch-takeover").await;
    let key = IdempotencyKey::parse("pay-b").unwrap();
    let a = acquire(&h, &key, Duration::from_millis(200)).await;
    until_lease_lapsed(&h, &key).await;
    let b = acquire(&h, &key, HOUR).await;
    assert_eq!(b.acquisition(), Acquisition::TakenOver);
    let before = record(&h, "pay-b").await.lease_until;
    next_instant(&h).await;
    assert_eq!(
        renew_together(&[&a, &b]).await.unwrap(),
        [Renewed::Lost, Renewed::Kept],
        "A is told it lost; B is renewed"
    );
    let row = record(&h, "pay-b").await;
    assert_eq!(row.generation, 2);
    assert_ne!(row.lease_until, before, "B's lease was renewed");
    assert!(!h.lease_lapsed(&key).await, "by B's hour, not A's 200 ms");
    assert!(matches!(
        a.renew().await,
        Err(LeaseError::StaleOwner { generation: 1 })
    ));
}

/// A lapse (what a taken-over execution that failed leaves) moves the row to
/// a fresh owner token: a renewal of the old one, sent before the lapse and
/// arriving after it, finds the lease lost and cannot extend it, so the
/// retry still takes the key over at once.
pub async fn a_renewal_arriving_after_a_lapse_cannot_extend_it() {
    use idem_runtime::test_util::{Renewed, lapse_then_renew};

    let h = H::new("lapse-renew").await;
    let key = IdempotencyKey::parse("pay-l").unwrap();
    let a = acquire(&h, &key, HOUR).await;
    assert_eq!(lapse_then_renew(a).await.unwrap(), Renewed::Lost);
    let row = record(&h, "pay-l").await;
    assert_eq!((row.state.as_str(), row.generation), ("processing", 1));
    assert!(
        h.lease_lapsed(&key).await,
        "still lapsed after the late renewal"
    );
    let b = acquire(&h, &key, HOUR).await;
    assert_eq!(b.acquisition(), Acquisition::TakenOver);
}

/// A mark of "outcome uncertain" whose answer was lost (it had committed) is
/// sent again by the handler's path: the second finds the execution's row
/// uncertain already and is the same mark, not a stale owner (whose client
/// would be told `409` for an effect that may have happened).
pub async fn an_uncertain_mark_sent_again_is_the_same_mark() {
    let h = H::new("mark-again").await;
    let key = IdempotencyKey::parse("pay-u").unwrap();
    let a = acquire(&h, &key, HOUR).await;
    idem_runtime::test_util::mark_uncertain_again(a)
        .await
        .expect("the same mark, sent again");
    assert_eq!(record(&h, "pay-u").await.state, "uncertain");
    assert_eq!(h.uncertain_listed().await, 1);
}

/// An outcome whose store's answer was lost (it had committed) is stored again
/// by the handler's path: the second finds the execution's own outcome and is
/// the same store, not a stale owner (whose client would get the answer marked
/// as a replay, and whose operator a false "not published").
pub async fn an_outcome_stored_again_is_the_same_store() {
    let h = H::new("store-again").await;
    let key = IdempotencyKey::parse("pay-s").unwrap();
    let a = acquire(&h, &key, HOUR).await;
    idem_runtime::test_util::store_outcome_again(a, &paid("ch_again"))
        .await
        .expect("the same store, sent again");
    assert_eq!(record(&h, "pay-s").await.state, "completed");
    match h.claim(&lease_req(&key, HOUR)).await {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_again")),
        other => panic!("expected a replay, got {other:?}"),
    }
    // That a store finds nothing to write once another owner finished the
    // key is `a_stale_owner_cannot_publish_and_the_provider_charges_once`.
}

/// A store of the execution's outcome that arrives after its row was marked
/// uncertain and a reconciler resolved it (sent before the mark, held up on
/// its way) writes nothing: the reconciler's outcome stands.
pub async fn a_store_arriving_after_a_resolution_changes_nothing() {
    let h = H::new("late-store").await;
    let key = IdempotencyKey::parse("pay-late").unwrap();
    let a = acquire(&h, &key, HOUR).await;
    let late = idem_runtime::test_util::store_after_uncertain(a, &paid("ch_late"), async {
        let report = reconciler(&h, Stubborn).run_once().await.unwrap();
        assert_eq!(report.completed, 1, "{report:?}");
    })
    .await;
    assert!(
        matches!(late, Err(LeaseError::StaleOwner { .. })),
        "{late:?}"
    );
    match h.claim(&lease_req(&key, HOUR)).await {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_fresh")),
        other => panic!("expected the reconciler's outcome, got {other:?}"),
    }
}

pub async fn a_crash_between_claim_and_effect_executes_once_after_the_lease() {
    let h = H::new("crash-claim").await;
    let provider = Provider::default();
    let key = IdempotencyKey::parse("pay-2").unwrap();
    let lease = Duration::from_millis(200);
    // The claim committed, then the worker died before any effect.
    drop(acquire(&h, &key, lease).await);
    // While the lease lives, a retry is told to wait: nothing runs twice.
    match h.claim(&lease_req(&key, lease)).await {
        LeasedClaim::InFlight { retry_after } => assert!(retry_after > Duration::ZERO),
        other => panic!("expected in flight, got {other:?}"),
    }
    until_lease_lapsed(&h, &key).await;
    let b = acquire(&h, &key, lease).await;
    assert_eq!(b.acquisition(), Acquisition::TakenOver);
    let charge = provider.charge(&b.downstream_key(), 100).await.unwrap();
    b.complete(&paid(&charge)).await.unwrap();
    match h.claim(&lease_req(&key, lease)).await {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid(&charge)),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert_eq!(provider.charge_count(), 1);
}

pub async fn release_frees_the_key_and_a_mismatch_is_reported() {
    let h = H::new("release").await;
    let key = IdempotencyKey::parse("pay-3").unwrap();
    let a = acquire(&h, &key, HOUR).await;
    let mut other = lease_req(&key, HOUR);
    other.fingerprint = FingerprintBuilder::new("acme", "create-payment", "POST", "/payments")
        .body(&json!({"amount": 999}))
        .unwrap()
        .finish();
    assert!(matches!(h.claim(&other).await, LeasedClaim::Mismatch));
    a.release().await.unwrap();
    assert_eq!(h.records().await, 0);
    let again = acquire(&h, &key, HOUR).await;
    assert_eq!(again.acquisition(), Acquisition::New);
    again.complete(&paid("ch_x")).await.unwrap();
    assert!(matches!(h.claim(&other).await, LeasedClaim::Mismatch));
}

// ---- through the attribute and a router ----

#[derive(Clone)]
struct App {
    idem: Idem<Db>,
    provider: Arc<Provider>,
    /// First executions report here and wait for a permit; takeovers do not wait.
    entered: Option<mpsc::UnboundedSender<()>>,
    release: Arc<Semaphore>,
    crash_next: Arc<AtomicBool>,
    /// Lets the handler that blocks its thread go on.
    unblocked: Arc<AtomicBool>,
    retry: RetryPolicy,
}

impl FromRef<App> for Idem<Db> {
    fn from_ref(a: &App) -> Idem<Db> {
        a.idem.clone()
    }
}

#[derive(Deserialize, Serialize)]
struct NewPayment {
    amount_cents: i64,
}

async fn charge_and_answer(app: &App, lease: &Lease<Db>, amount: i64) -> Response {
    let key = lease.downstream_key();
    let attempt = || async { app.provider.charge(&key, amount).await };
    match app
        .retry
        .run(attempt, |e| matches!(e, ProviderError::Unavailable))
        .await
    {
        Ok(charge) => (
            StatusCode::CREATED,
            Json(json!({"charge": charge, "amount_cents": amount})),
        )
            .into_response(),
        Err(ProviderError::TimedOut) => {
            Uncertain::new("the payment provider timed out").into_response()
        }
        Err(ProviderError::Unavailable) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment(
    #[tenant] caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    if app.crash_next.swap(false, Ordering::SeqCst) {
        panic!("simulated crash inside the handler");
    }
    create_payment_body(caller, app, lease, p).await
}

/// The same operation with a lease renewed only up to its ceiling, one lease
/// (the shortest the attribute accepts): a handler that runs past it is a
/// stalled worker.
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "300ms"
)]
async fn create_payment_no_renewal(
    #[tenant] caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    create_payment_body(caller, app, lease, p).await
}

/// The same with a lease long enough for a test to watch its renewals one by
/// one (renewed every 2 s).
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "6s",
    lease_ceiling = "1h"
)]
async fn create_payment_long_lease(
    #[tenant] caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    create_payment_body(caller, app, lease, p).await
}

/// A handler that watches its lease, as a careful one does before it calls
/// downstream: the first execution reports in, waits until its lease is
/// taken as lost, reports again, and charges.
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment_until_lost(
    #[tenant] _caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    if lease.acquisition() == Acquisition::New
        && let Some(entered) = &app.entered
    {
        entered.send(()).ok();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !lease.is_lost() {
            assert!(Instant::now() < deadline, "the lease was never lost");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        entered.send(()).ok();
    }
    charge_and_answer(&app, lease, p.amount_cents).await
}

async fn create_payment_body(
    _caller: Caller,
    app: App,
    lease: &mut Lease<Db>,
    p: NewPayment,
) -> Response {
    if lease.acquisition() == Acquisition::New
        && let Some(entered) = &app.entered
    {
        entered.send(()).ok();
        app.release.acquire().await.unwrap().forget();
    }
    charge_and_answer(&app, lease, p.amount_cents).await
}

/// A handler that charges and returns at once, its body streamed: the first
/// execution reports in as it returns, and its body waits for a permit (a
/// receipt relayed from the provider, say, that takes longer than the lease).
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment_streamed(
    #[tenant] _caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    let answer = charge_and_answer(&app, lease, p.amount_cents).await;
    if lease.acquisition() != Acquisition::New {
        return answer;
    }
    let Some(entered) = &app.entered else {
        return answer;
    };
    entered.send(()).ok();
    let (parts, body) = answer.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let release = app.release.clone();
    let held = futures_util::stream::once(async move {
        release.acquire().await.unwrap().forget();
        Ok::<_, std::convert::Infallible>(bytes)
    });
    Response::from_parts(parts, Body::from_stream(held))
}

/// A handler that reports, on its first poll, before anything else, whether
/// its lease is among those being renewed. It charges nothing (a `503`,
/// which gives the key back) if not.
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment_registered(
    #[tenant] _caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    if app.idem.renewing_leases() == 0 {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the handler ran before its lease was registered for renewal",
        )
            .into_response();
    }
    charge_and_answer(&app, lease, p.amount_cents).await
}

/// A handler that blocks its worker thread (a blocking client called without
/// `spawn_blocking`) from its first poll until the test lets it go; it
/// reports in first when it is gated.
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment_blocking(
    #[tenant] _caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    if let Some(entered) = &app.entered {
        entered.send(()).ok();
    }
    while !app.unblocked.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    charge_and_answer(&app, lease, p.amount_cents).await
}

/// A handler that passes its provider's timeout up as a `504`, as a
/// downstream error sent on with `?` reads, and says how its key was
/// acquired (`x-acquisition`).
#[idempotent(
    operation = "create-payment",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h"
)]
async fn create_payment_timing_out(
    #[tenant] _caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(p): Json<NewPayment>,
) -> Response {
    let acquired = format!("{:?}", lease.acquisition());
    let charged = app
        .provider
        .charge(&lease.downstream_key(), p.amount_cents)
        .await;
    let mut answer = match charged {
        Ok(charge) => (StatusCode::CREATED, Json(json!({"charge": charge}))).into_response(),
        Err(ProviderError::TimedOut) => StatusCode::GATEWAY_TIMEOUT.into_response(),
        Err(ProviderError::Unavailable) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    };
    answer
        .headers_mut()
        .insert("x-acquisition", acquired.parse().unwrap());
    answer
}

pub struct Setup {
    pub h: Arc<H>,
    idem: Idem<Db>,
    pub router: Router,
    pub provider: Arc<Provider>,
    pub entered: mpsc::UnboundedReceiver<()>,
    pub release: Arc<Semaphore>,
    crash_next: Arc<AtomicBool>,
    unblocked: Arc<AtomicBool>,
}

pub async fn setup(test: &str, gate: bool) -> Setup {
    setup_with(test, gate, |idem| idem).await
}

/// As [`setup`], with the service's `Idem` configured by `config`.
pub async fn setup_with(
    test: &str,
    gate: bool,
    config: impl FnOnce(Idem<Db>) -> Idem<Db>,
) -> Setup {
    let h = Arc::new(H::new(test).await);
    let provider = Arc::new(Provider::default());
    let (tx, entered) = mpsc::unbounded_channel();
    let release = Arc::new(Semaphore::new(0));
    let crash_next = Arc::new(AtomicBool::new(false));
    let unblocked = Arc::new(AtomicBool::new(false));
    let idem = config(h.idem());
    let app = App {
        idem: idem.clone(),
        provider: provider.clone(),
        entered: gate.then_some(tx),
        release: release.clone(),
        crash_next: crash_next.clone(),
        unblocked: unblocked.clone(),
        retry: RetryPolicy::new()
            .with_max_attempts(4)
            .with_min_delay(Duration::from_millis(1))
            .with_max_delay(Duration::from_millis(8))
            .with_max_total_delay(Duration::from_millis(50)),
    };
    let router = Router::new()
        .route("/payments", post(create_payment))
        .route("/payments-no-renewal", post(create_payment_no_renewal))
        .route("/payments-long-lease", post(create_payment_long_lease))
        .route("/payments-until-lost", post(create_payment_until_lost))
        .route("/payments-streamed", post(create_payment_streamed))
        .route("/payments-registered", post(create_payment_registered))
        .route("/payments-timing-out", post(create_payment_timing_out))
        .route("/payments-blocking", post(create_payment_blocking))
        .with_state(app);
    Setup {
        h,
        idem,
        router,
        provider,
        entered,
        release,
        crash_next,
        unblocked,
    }
}

/// As [`setup`] (first executions gated), the operation's running limit one
/// execution at a time, one per tenant.
async fn setup_one_slot(test: &str) -> Setup {
    setup_with(test, true, |idem| {
        idem.with_running_limit(
            "create-payment",
            idem_runtime::RunningLimit::new(1).per_tenant(1),
        )
        .unwrap()
    })
    .await
}

/// The first execution of `key` dies in its handler (`500`), its row left
/// `processing`; returns once its lease has lapsed.
async fn crash_then_lapse(s: &Setup, key: &str) -> IdempotencyKey {
    s.crash_next.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&s.router, pay("/payments", key, 100)).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the handler died"
    );
    let key = IdempotencyKey::parse(key).unwrap();
    until_lease_lapsed(&*s.h, &key).await;
    key
}

/// A payment of `key` on `/payments` that runs (`201`, not a replay).
async fn pays_anew(s: &Setup, key: &str) {
    ran(&send(&s.router, pay("/payments", key, 100)).await);
}

/// An answer of an execution that ran: `201`, not a replay.
fn ran((status, headers, body): &(StatusCode, axum::http::HeaderMap, Vec<u8>)) {
    assert_eq!(
        *status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(body)
    );
    assert!(headers.get("idempotent-replayed").is_none());
}

pub fn pay(path: &str, key: &str, amount: i64) -> Request<Body> {
    pay_as("acme", path, key, amount)
}

fn pay_as(tenant: &str, path: &str, key: &str, amount: i64) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", key)
        .body(Body::from(json!({"amount_cents": amount}).to_string()))
        .unwrap()
}

pub async fn send(
    router: &Router,
    req: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
    )
}

/// The lease is registered for renewal before the handler is first polled
/// (the order of that first poll was once left to chance: eight requests).
/// Registered is not yet renewed: a handler that blocks its worker thread
/// may keep the renewal task from running (docs/leased-mode.md).
pub async fn a_handler_is_first_polled_with_its_lease_registered_for_renewal() {
    let s = setup("registered", false).await;
    for i in 0..8 {
        ran(&send(
            &s.router,
            pay("/payments-registered", &format!("registered-{i}"), 100),
        )
        .await);
    }
    assert_eq!(s.provider.calls.load(Ordering::SeqCst), 8);
}

/// A handler that blocks its worker thread is still renewed by the other
/// worker: registering its lease starts the task that sends the batches in
/// the blocked worker's LIFO slot, which the other worker cannot steal, unless
/// the execution yields before it polls the handler. Stamped on a runtime of
/// two workers; the lease (300 ms) must be seen renewed twice while the
/// handler blocks, and the test thread (not a worker) watches the row.
pub async fn a_handler_blocking_its_thread_is_still_renewed() {
    let mut s = setup("blocking", true).await;
    let router = s.router.clone();
    let request =
        tokio::spawn(
            async move { send(&router, pay("/payments-blocking", "blocking-1", 100)).await },
        );
    s.entered.recv().await.unwrap();
    let renewed = renewed_twice(&s.h, "blocking-1", Duration::from_secs(30)).await;
    s.unblocked.store(true, Ordering::SeqCst);
    let (status, _, _) = request.await.unwrap();
    assert!(renewed, "the blocked handler's lease was not renewed");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(s.provider.calls.load(Ordering::SeqCst), 1);
}

/// Renewals are batched: many executions running at once are
/// renewed together, a few statements for many leases, and every lease
/// is still renewed in time (its own deadline moves, none is lost).
/// Deterministic: the executions hold until the test lets them go,
/// after each lease has been seen renewed twice.
pub async fn many_running_executions_are_renewed_together_in_few_statements() {
    const N: usize = 20;
    let mut configured = None;
    let mut s = setup_with("batched", true, |idem| {
        configured = Some(idem.clone());
        idem
    })
    .await;
    let idem = configured.expect("configured");
    // One after the other: a claim that waited long for SQLite's write
    // lock behind the others would start with a lease nearly spent
    // (its deadline counts from the claim's send time).
    let mut tasks = Vec::new();
    for i in 0..N {
        let router = s.router.clone();
        tasks.push(tokio::spawn(async move {
            send(&router, pay("/payments", &format!("batch-{i}"), 100)).await
        }));
        s.entered.recv().await.unwrap();
    }
    let keys: Vec<String> = (0..N).map(|i| format!("batch-{i}")).collect();
    let mut seen: Vec<std::collections::HashSet<_>> = vec![Default::default(); N];
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.iter().any(|s| s.len() < 3) {
        assert!(
            Instant::now() < deadline,
            "some lease was never renewed twice: {:?} values seen, batches and renewals {:?}",
            seen.iter().map(|s| s.len()).collect::<Vec<_>>(),
            idem.renewal_statements()
        );
        for (i, key) in keys.iter().enumerate() {
            seen[i].insert(record(&s.h, key).await.lease_until);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (statements, renewals) = idem.renewal_statements();
    assert!(renewals >= 2 * N as u64, "{renewals} renewals");
    assert!(
        statements * 4 <= renewals,
        "{statements} renewal batches for {renewals} lease renewals"
    );
    s.release.add_permits(N);
    for t in tasks {
        assert_eq!(t.await.unwrap().0, StatusCode::CREATED);
    }
    assert_eq!(
        s.provider.charge_count(),
        N,
        "every execution kept its lease"
    );
}

/// A running limit that lets nothing run is a configuration error that
/// names the operation and what was 0.
pub async fn a_running_limit_of_zero_is_refused_with_a_clear_error() {
    let h = H::new("limit-zero").await;
    for (limit, what) in [
        (idem_runtime::RunningLimit::new(0), "a total of 0"),
        (
            idem_runtime::RunningLimit::new(3).per_tenant(0),
            "a tenant's share of 0",
        ),
    ] {
        let e = h
            .idem()
            .with_running_limit("export", limit)
            .expect_err("refused");
        assert!(
            matches!(e, idem_runtime::ConfigError::ZeroRunningLimit { .. }),
            "{e}"
        );
        let message = e.to_string();
        assert!(message.contains("`export`"), "{message}");
        assert!(message.contains(what), "{message}");
    }
}

/// A running limit (`Idem::with_running_limit`): a new key past the
/// operation's total or its tenant's share is answered `503`
/// `at-capacity` with `Retry-After` and reserves nothing; a retry of a
/// running key is answered as always; a slot is given back when its
/// execution's work ends, a panic included. Deterministic: the
/// executions hold their slots until the test releases them.
pub async fn a_full_running_limit_answers_503_reserves_nothing_and_frees_its_slot_when_the_work_ends()
 {
    let mut s = setup_with("limit", true, |idem| {
        idem.with_running_limit(
            "create-payment",
            idem_runtime::RunningLimit::new(2).per_tenant(1),
        )
        .unwrap()
    })
    .await;
    let refused = |status: StatusCode, headers: &axum::http::HeaderMap, body: &[u8], what: &str| {
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{what}");
        let problem: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(problem["type"], "urn:idem:problem:at-capacity", "{what}");
        // The operation's lease (300 ms), in whole seconds.
        assert_eq!(headers["retry-after"], "1", "{what}");
    };
    let spawn = |tenant: &'static str, key: &'static str| {
        let router = s.router.clone();
        tokio::spawn(async move { send(&router, pay_as(tenant, "/payments", key, 100)).await })
    };
    // acme's execution holds acme's share.
    let first = spawn("acme", "limit-1");
    s.entered.recv().await.unwrap();
    // Bounded: a limit that let them run would hold them at the gate.
    let at_once = Duration::from_secs(30);
    let (status, headers, body) =
        tokio::time::timeout(at_once, send(&s.router, pay("/payments", "limit-2", 100)))
            .await
            .expect("refused at once, not run");
    refused(status, &headers, &body, "past acme's share");
    assert!(
        s.h.record(&IdempotencyKey::parse("limit-2").unwrap())
            .await
            .is_none(),
        "a refused key is not reserved"
    );
    // A retry of the running key needs no slot: in flight, as always.
    let (status, _, _) = send(&s.router, pay("/payments", "limit-1", 100)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    // Another tenant has a share of its own; then the total is full.
    let second = spawn("globex", "limit-3");
    s.entered.recv().await.unwrap();
    let (status, headers, body) = tokio::time::timeout(
        at_once,
        send(&s.router, pay_as("initech", "/payments", "limit-4", 100)),
    )
    .await
    .expect("refused at once, not run");
    refused(status, &headers, &body, "past the total");
    assert_eq!(
        s.provider.calls.load(Ordering::SeqCst),
        0,
        "nothing charged yet"
    );
    // The work ends: its slots come back, and the refused key runs.
    s.release.add_permits(3);
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(second.await.unwrap().0, StatusCode::CREATED);
    let (status, _, _) = send(&s.router, pay("/payments", "limit-2", 100)).await;
    assert_eq!(status, StatusCode::CREATED, "the slot was given back");
    // A panicking execution gives its slot back too.
    s.crash_next.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&s.router, pay("/payments", "limit-5", 100)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    s.release.add_permits(1);
    let (status, _, _) = send(&s.router, pay("/payments", "limit-6", 100)).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the panicked execution's slot was given back"
    );
    assert_eq!(s.provider.charge_count(), 4);
}

/// A takeover refused for the running limit is given back as a takeover:
/// its lease lapses at once (the retry is not held `409` for a lease it
/// never used) and the row stays `processing`, so the next execution is
/// still told it takes over from one that may have charged.
pub async fn a_takeover_refused_for_the_running_limit_lapses_at_once() {
    let mut s = setup_one_slot("limit_takeover").await;
    let key = crash_then_lapse(&s, "tk-1").await;
    // Another key of acme's holds the only slot.
    let router = s.router.clone();
    let holder = tokio::spawn(async move { send(&router, pay("/payments", "tk-2", 100)).await });
    s.entered.recv().await.unwrap();
    let (status, _, body) = send(&s.router, pay("/payments", "tk-1", 100)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:at-capacity");
    let row = record(&s.h, "tk-1").await;
    assert_eq!(
        (row.state.as_str(), row.generation),
        ("processing", 2),
        "taken over, then given back as a takeover"
    );
    assert!(
        s.h.lease_lapsed(&key).await,
        "the refused takeover's lease (300 ms) lapsed at once"
    );
    s.release.add_permits(1);
    assert_eq!(holder.await.unwrap().0, StatusCode::CREATED);
    let (status, headers, _) = send(&s.router, pay("/payments", "tk-1", 100)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(record(&s.h, "tk-1").await.generation, 3, "a takeover again");
    assert_eq!(s.provider.charge_count(), 2);
}

/// A taken-over execution whose handler fails (here the provider is down:
/// `503`) says nothing of the execution it took over from, which may have
/// charged: the key is not released (the next claim would be `New`, and a
/// handler that asks downstream only on a takeover would charge blind), its
/// lease lapses at once and the row stays `processing`, so the retry takes
/// it over again, at once, and is told so.
pub async fn a_failed_takeover_lapses_so_the_retry_is_a_takeover_again() {
    let s = setup("failed_takeover", false).await;
    let key = crash_then_lapse(&s, "ft-1").await;
    s.provider.down.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&s.router, pay("/payments", "ft-1", 100)).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the takeover failed"
    );
    let row =
        s.h.record(&key)
            .await
            .expect("a failed takeover keeps the key's row: it is not released");
    assert_eq!((row.state.as_str(), row.generation), ("processing", 2));
    assert!(s.h.lease_lapsed(&key).await, "its lease lapsed at once");
    s.provider.down.store(false, Ordering::SeqCst);
    pays_anew(&s, "ft-1").await;
    let row = record(&s.h, "ft-1").await;
    assert_eq!(
        (row.state.as_str(), row.generation),
        ("completed", 3),
        "taken over again (a released key would start at generation 1)"
    );
    assert_eq!(s.provider.charge_count(), 1);
}

/// A handler whose provider charged and then timed out answers `504`: its
/// key is not given back (the retry would be told `New`), its lease lapses
/// at once and its row stays `processing`, so the retry takes the key over,
/// is told `TakenOver`, and gets the provider's one charge. A `503` (the
/// provider refused) still gives the key back.
pub async fn a_gateway_timeout_lapses_the_lease_and_the_retry_is_a_takeover() {
    let s = setup("gateway_timeout", false).await;
    s.provider
        .timeout_after_charge
        .store(true, Ordering::SeqCst);
    let (status, _, _) = send(&s.router, pay("/payments-timing-out", "gt-1", 100)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    let key = IdempotencyKey::parse("gt-1").unwrap();
    let row =
        s.h.record(&key)
            .await
            .expect("a gateway timeout keeps the key's row: it is not given back");
    assert_eq!((row.state.as_str(), row.generation), ("processing", 1));
    assert!(s.h.lease_lapsed(&key).await, "its lease lapsed at once");
    let retry = send(&s.router, pay("/payments-timing-out", "gt-1", 100)).await;
    ran(&retry);
    assert_eq!(retry.1["x-acquisition"], "TakenOver");
    assert_eq!(s.provider.charge_count(), 1);
    s.provider.down.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&s.router, pay("/payments-timing-out", "gt-2", 100)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        s.h.record(&IdempotencyKey::parse("gt-2").unwrap())
            .await
            .is_none(),
        "a refusal gives the key back"
    );
}

/// A lease that is lost gives its slot back at once, though its handler
/// is still stalled: the key is free for a takeover, and with a tenant's
/// share of 1 a slot kept by the stalled handler would answer that
/// takeover `503` for as long as the stall lasts.
pub async fn a_lost_lease_gives_back_its_slot_so_its_takeover_runs() {
    let mut s = setup_one_slot("limit_lapse").await;
    let router = s.router.clone();
    let a =
        tokio::spawn(
            async move { send(&router, pay("/payments-no-renewal", "lapse-1", 100)).await },
        );
    s.entered.recv().await.unwrap();
    assert_eq!(s.idem.running("create-payment"), Some(1));
    // While A's lease holds, its slot is taken.
    let (status, _, _) = send(&s.router, pay("/payments", "lapse-2", 100)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "the limit is full");
    // A stalls past its ceiling (one lease): its lease lapses, and the
    // slot comes back though A has not returned.
    let key = IdempotencyKey::parse("lapse-1").unwrap();
    until_lease_lapsed(&*s.h, &key).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.idem.running("create-payment") != Some(0) {
        assert!(Instant::now() < deadline, "a lost lease kept its slot");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!a.is_finished(), "A is still stalled");
    // B, the retry, takes the key over and runs.
    let (status, _, b_body) = send(&s.router, pay("/payments-no-renewal", "lapse-1", 100)).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&b_body)
    );
    assert_eq!(record(&s.h, "lapse-1").await.generation, 2, "taken over");
    s.release.add_permits(1);
    let (status, headers, a_body) = a.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        headers["idempotent-replayed"], "true",
        "A's client gets B's result"
    );
    assert_eq!(a_body, b_body);
    assert_eq!(s.provider.charge_count(), 1);
    assert_eq!(s.idem.running("create-payment"), Some(0));
}

/// A body the handler streams is read under the lease: renewed until the
/// response is in hand, so a duplicate meanwhile finds it in flight, well past
/// the 300 ms lease, and nothing is charged twice.
pub async fn a_streamed_answer_keeps_its_lease_until_it_is_read() {
    let mut s = setup("streamed", true).await;
    let router = s.router.clone();
    let first =
        tokio::spawn(
            async move { send(&router, pay("/payments-streamed", "stream-1", 100)).await },
        );
    s.entered.recv().await.unwrap();
    // The handler has returned; its body waits. See the lease move twice.
    assert!(
        renewed_twice(&s.h, "stream-1", Duration::from_secs(60)).await,
        "the lease was not renewed while the body was read"
    );
    let (status, headers, _) = send(&s.router, pay("/payments-streamed", "stream-1", 100)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.contains_key("retry-after"));
    s.release.add_permits(1);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, replayed) =
        send(&s.router, pay("/payments-streamed", "stream-1", 100)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, body);
    assert_eq!(s.provider.charge_count(), 1);
}

pub async fn a_live_worker_is_renewed_and_not_taken_over() {
    let mut s = setup("live", true).await;
    let router = s.router.clone();
    let first = tokio::spawn(async move { send(&router, pay("/payments", "live-1", 100)).await });
    s.entered.recv().await.unwrap();
    // Renewal moves the lease forward while the handler runs: see it move twice.
    let mut seen = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.len() < 3 {
        seen.insert(record(&s.h, "live-1").await.lease_until);
        assert!(Instant::now() < deadline, "the lease was never renewed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Well past the original 300 ms lease, a duplicate still finds it in flight.
    let (status, headers, _) = send(&s.router, pay("/payments", "live-1", 100)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.contains_key("retry-after"));
    assert_eq!(
        record(&s.h, "live-1").await.generation,
        1,
        "never taken over"
    );
    s.release.add_permits(1);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    // ... and once done, a duplicate replays it.
    let (status, headers, replayed) = send(&s.router, pay("/payments", "live-1", 100)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, body);
    assert_eq!(s.provider.charge_count(), 1);
}

pub async fn a_dead_worker_is_taken_over_after_its_lease() {
    let s = setup("dead", false).await;
    s.crash_next.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&s.router, pay("/payments", "dead-1", 100)).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the handler died"
    );
    assert_eq!(record(&s.h, "dead-1").await.state, "processing");
    // Nobody renews a dead worker's lease: it lapses and the retry takes over.
    until_lease_lapsed(&*s.h, &IdempotencyKey::parse("dead-1").unwrap()).await;
    pays_anew(&s, "dead-1").await;
    assert_eq!(s.provider.charge_count(), 1);
    assert_eq!(record(&s.h, "dead-1").await.generation, 2);
}

pub async fn a_stalled_handler_is_fenced_and_its_client_gets_the_new_owners_result() {
    let mut s = setup("stall", true).await;
    let router = s.router.clone();
    let a =
        tokio::spawn(
            async move { send(&router, pay("/payments-no-renewal", "stall-1", 100)).await },
        );
    s.entered.recv().await.unwrap();
    // A holds its claim past its ceiling (one lease); its lease lapses.
    until_lease_lapsed(&*s.h, &IdempotencyKey::parse("stall-1").unwrap()).await;
    let (status, _, b_body) = send(&s.router, pay("/payments-no-renewal", "stall-1", 100)).await;
    assert_eq!(status, StatusCode::CREATED, "B took over and completed");
    // A resumes, charges (deduplicated by the provider) and tries to publish.
    s.release.add_permits(1);
    let (status, headers, a_body) = a.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        headers["idempotent-replayed"], "true",
        "A's client gets B's stored result"
    );
    assert_eq!(a_body, b_body);
    assert_eq!(s.provider.charge_count(), 1);
    assert_eq!(
        s.provider.calls.load(Ordering::SeqCst),
        2,
        "both called, one charge"
    );
}

struct AskProvider(Arc<Provider>);

impl Reconcile for AskProvider {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        match self.0.find(&outcome.downstream_key) {
            Some(charge) => Resolution::Completed(StoredResponse {
                status: 201,
                // A cookie is never stored, a reconciler's no more than a
                // handler's.
                headers: vec![
                    ("content-type".into(), "application/json".into()),
                    ("Set-Cookie".into(), "session=first-caller".into()),
                ],
                body: serde_json::to_vec(&json!({"charge": charge, "amount_cents": 100}))
                    .unwrap()
                    .into(),
            }),
            None => Resolution::Released,
        }
    }
}

fn reconciler<R: Reconcile>(h: &H, reconcile: R) -> Reconciler<R, Db> {
    Reconciler::on_store(h.store(), reconcile)
}

pub async fn an_uncertain_outcome_is_never_retried_and_is_reconciled() {
    let s = setup("uncertain", false).await;
    s.provider
        .timeout_after_charge
        .store(true, Ordering::SeqCst);
    let (status, headers, body) = send(&s.router, pay("/payments", "unc-1", 100)).await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(record(&s.h, "unc-1").await.state, "uncertain");
    // Retries are answered, never executed: the provider sees no new call.
    // They are told to wait what the first answer said (the lease's length).
    let first_wait = headers["retry-after"].clone();
    for _ in 0..3 {
        let (status, headers, body) = send(&s.router, pay("/payments", "unc-1", 100)).await;
        assert_eq!(status, StatusCode::ACCEPTED);
        assert_eq!(headers["retry-after"], first_wait);
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["type"], "urn:idem:problem:outcome-uncertain");
    }
    assert_eq!(s.provider.calls.load(Ordering::SeqCst), 1);
    // The reconciler asks the provider by the stable key and finds the charge.
    let report = reconciler(&s.h, AskProvider(s.provider.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.completed, 1);
    let (status, headers, body) = send(&s.router, pay("/payments", "unc-1", 100)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["content-type"], "application/json");
    assert!(!headers.contains_key("set-cookie"), "{headers:?}");
    let paid: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(paid["charge"], "ch_0");
    assert_eq!(s.provider.charge_count(), 1);
    assert_eq!(s.provider.calls.load(Ordering::SeqCst), 1);
    // A round with nothing left does nothing.
    let report = reconciler(&s.h, AskProvider(s.provider.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!(report, Default::default());
}

pub async fn an_uncertain_outcome_without_a_charge_is_released() {
    let s = setup("uncertain-none", false).await;
    let key = IdempotencyKey::parse("unc-2").unwrap();
    let lease = acquire(&s.h, &key, HOUR).await;
    lease.mark_uncertain().await.unwrap();
    let report = reconciler(&s.h, AskProvider(s.provider.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.released, 1);
    assert_eq!(s.h.records().await, 0);
    // The key is free: a new execution.
    assert_eq!(
        acquire(&s.h, &key, HOUR).await.acquisition(),
        Acquisition::New
    );
}

pub async fn an_outage_under_load_stays_within_the_retry_bound_and_recovers_exactly_once() {
    let s = setup("outage", false).await;
    let n = 20;
    let max_attempts = 4;
    s.provider.down.store(true, Ordering::SeqCst);
    let round = |router: Router| async move {
        let mut tasks = Vec::new();
        for i in 0..n {
            let router = router.clone();
            tasks.push(tokio::spawn(async move {
                send(&router, pay("/payments", &format!("load-{i}"), 100 + i)).await
            }));
        }
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.unwrap().0);
        }
        statuses
    };
    // During the outage every request fails after its bounded retries, and
    // releases its key.
    let statuses = round(s.router.clone()).await;
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    let calls = s.provider.calls.load(Ordering::SeqCst);
    assert_eq!(
        calls,
        n as usize * max_attempts,
        "each request made exactly its bounded attempts"
    );
    assert_eq!(s.h.records().await, 0);
    // After recovery, the clients' retries complete, each exactly once.
    s.provider.down.store(false, Ordering::SeqCst);
    let statuses = round(s.router.clone()).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::CREATED),
        "{statuses:?}"
    );
    let again = round(s.router.clone()).await;
    assert!(again.iter().all(|s| *s == StatusCode::CREATED));
    assert_eq!(s.provider.charge_count(), n as usize);
    assert_eq!(
        s.provider.calls.load(Ordering::SeqCst),
        calls + n as usize,
        "replays call nobody"
    );
}

/// A downstream whose answer has the given status: a server error, or an
/// interim `1xx`, which is no final answer to replay.
struct Broken(u16);

impl Reconcile for Broken {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, _: &UncertainOutcome) -> Resolution {
        Resolution::Completed(StoredResponse {
            status: self.0,
            headers: vec![],
            body: "bad gateway".into(),
        })
    }
}

pub async fn a_5xx_resolution_is_never_stored() {
    for (status, name) in [(502, "unc-3"), (103, "unc-1xx")] {
        let h = H::new(&format!("resolution-{status}")).await;
        let key = IdempotencyKey::parse(name).unwrap();
        acquire(&h, &key, HOUR)
            .await
            .mark_uncertain()
            .await
            .unwrap();
        let report = reconciler(&h, Broken(status)).run_once().await.unwrap();
        assert_eq!(
            (report.still_uncertain, report.completed),
            (1, 0),
            "{status}"
        );
        assert_eq!(record(&h, name).await.state, "uncertain", "{status}");
        assert_eq!(
            h.uncertain_listed().await,
            1,
            "still listed for the next round"
        );
    }
}

/// A downstream whose answer, told as a gRPC status, is one a live call
/// would roll back (`ABORTED`, as `idem_runtime::grpc::stored_status` writes
/// it: code 10 under idem's status content type).
struct Aborted;

impl Reconcile for Aborted {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, _: &UncertainOutcome) -> Resolution {
        Resolution::Completed(StoredResponse {
            status: 409,
            headers: vec![(
                "content-type".into(),
                "application/vnd.idem.grpc-status+json".into(),
            )],
            body: r#"{"code":10,"message":"conflict","details":""}"#.into(),
        })
    }
}

/// A reconciler's gRPC status that a live call would roll back is not stored
/// (it would be replayed for the whole retention): the row stays uncertain.
pub async fn a_grpc_status_never_stored_is_not_stored_by_a_reconciler() {
    if !cfg!(feature = "grpc") {
        eprintln!("skipped: gRPC's statuses need the feature `grpc`");
        return;
    }
    let h = H::new("resolution-aborted").await;
    let key = IdempotencyKey::parse("unc-ab").unwrap();
    acquire(&h, &key, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let report = reconciler(&h, Aborted).run_once().await.unwrap();
    assert_eq!((report.still_uncertain, report.completed), (1, 0));
    assert_eq!(record(&h, "unc-ab").await.state, "uncertain");
}

/// The provider charged but the answer is too large to store: the key must
/// not be released (a retry would charge again); it becomes uncertain, and
/// the client is told what its retries will be told.
pub async fn an_unstorable_outcome_becomes_uncertain_and_is_never_repeated() {
    let s = setup_with("unstorable", false, |idem| idem.with_max_response_bytes(8)).await;
    let (status, _, body) = send(&s.router, pay("/payments", "big-1", 100)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:outcome-uncertain");
    assert_eq!(record(&s.h, "big-1").await.state, "uncertain");
    assert_eq!(s.h.uncertain_listed().await, 1, "awaits the reconciler");
    let (status, _, _) = send(&s.router, pay("/payments", "big-1", 100)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(
        s.provider.calls.load(Ordering::SeqCst),
        1,
        "never charged again"
    );
    assert_eq!(s.provider.charge_count(), 1);
}

/// Deletes the record while the downstream is asked, as a second
/// reconciler or an operator's purge would, then answers "charged".
struct Racing(Arc<H>, IdempotencyKey);

impl Reconcile for Racing {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, _: &UncertainOutcome) -> Resolution {
        self.0.delete(&self.1).await;
        Resolution::Completed(paid("ch_raced"))
    }
}

pub async fn a_resolution_that_lost_a_race_changes_nothing() {
    let h = Arc::new(H::new("resolution-race").await);
    let key = IdempotencyKey::parse("race-1").unwrap();
    acquire(&h, &key, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let report = reconciler(&h, Racing(h.clone(), key.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!(
        report.completed + report.released + report.errors,
        0,
        "{report:?}"
    );
    assert_eq!(
        h.records().await,
        0,
        "the late answer did not bring the record back"
    );
    assert_eq!(
        h.uncertain_listed().await,
        0,
        "nor its place in the listing"
    );
    assert_eq!(
        acquire(&h, &key, HOUR).await.acquisition(),
        Acquisition::New,
        "the key is free"
    );
}

/// A batch of records whose downstream never answers must not keep a
/// newer one from being asked about: rounds page on from where the last
/// one stopped, and start over after the newest.
pub async fn rows_that_never_resolve_do_not_starve_newer_ones() {
    let h = H::new("starve").await;
    // Created in this order, each on a later instant of the store's clock.
    for k in ["a-stuck-1", "a-stuck-2", "a-stuck-3", "b-fresh"] {
        next_instant(&h).await;
        let key = IdempotencyKey::parse(k).unwrap();
        acquire(&h, &key, HOUR)
            .await
            .mark_uncertain()
            .await
            .unwrap();
    }
    let reconciler = reconciler(&h, Stubborn).with_batch(2);
    let first = reconciler.run_once().await.unwrap();
    assert_eq!(
        (first.still_uncertain, first.completed),
        (2, 0),
        "{first:?}"
    );
    let second = reconciler.run_once().await.unwrap();
    assert_eq!(
        (second.still_uncertain, second.completed),
        (1, 1),
        "{second:?}"
    );
    assert_eq!(
        record(&h, "b-fresh").await.state,
        "completed",
        "the newest record was reached although the oldest never resolve"
    );
    // Past the newest record the rounds start over from the oldest.
    let third = reconciler.run_once().await.unwrap();
    assert_eq!(third.still_uncertain + third.completed, 0, "{third:?}");
    let fourth = reconciler.run_once().await.unwrap();
    assert_eq!(
        (fourth.still_uncertain, fourth.completed),
        (2, 0),
        "{fourth:?}"
    );
}

pub async fn a_row_that_cannot_be_reconciled_does_not_stop_the_others() {
    let s = setup("unreconcilable", false).await;
    let broken = IdempotencyKey::parse("unc-broken").unwrap();
    acquire(&s.h, &broken, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    // A record without its downstream key (written by hand, say): nobody
    // can be asked about it.
    s.h.forget_downstream_key(&broken).await;
    let fine = IdempotencyKey::parse("unc-fine").unwrap();
    acquire(&s.h, &fine, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let report = reconciler(&s.h, AskProvider(s.provider.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.errors, report.released), (1, 1), "{report:?}");
    assert_eq!(
        record(&s.h, "unc-broken").await.state,
        "uncertain",
        "the broken record waits for an operator"
    );
    assert_eq!(s.h.records().await, 1);
}

/// Renewals that cannot get through (the row held elsewhere; on Redis, a
/// record that refuses every script) for a whole lease make the worker
/// take its lease as lost, so it can stop before calling downstream again.
/// Nobody took over, though: what it returns is still stored (the store
/// is fenced by its token, which still holds), not thrown away for a
/// takeover to call downstream again.
pub async fn a_lease_taken_as_lost_but_not_taken_over_still_publishes() {
    let mut s = setup("lost", true).await;
    let router = s.router.clone();
    let first =
        tokio::spawn(
            async move { send(&router, pay("/payments-until-lost", "lost-1", 100)).await },
        );
    s.entered.recv().await.unwrap();
    let key = IdempotencyKey::parse("lost-1").unwrap();
    let blocker = s.h.block_renewals(&key).await;
    // The handler saw its lease lost while renewals could not get through.
    s.entered.recv().await.unwrap();
    s.h.unblock(blocker).await;
    let answer = first.await.unwrap();
    ran(&answer);
    let body = answer.2;
    let r = record(&s.h, "lost-1").await;
    assert_eq!((r.state.as_str(), r.generation), ("completed", 1));
    let (status, headers, replayed) =
        send(&s.router, pay("/payments-until-lost", "lost-1", 100)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, body);
    assert_eq!(
        s.provider.calls.load(Ordering::SeqCst),
        1,
        "downstream called once"
    );
}

/// `is_lost()` turns true no later than the store could hand the
/// execution to another worker: the lease's length after the claim was
/// sent (so at the latest a lease after the claim returned), whatever a
/// renewal that cannot get through does meanwhile; and a renewal that
/// gets through afterwards does not revive it. Deterministic: renewals
/// are blocked from the claim on, and the check runs at a fixed instant.
pub async fn a_lease_is_lost_by_its_deadline_while_renewals_hang() {
    let h = H::new("deadline").await;
    let key = IdempotencyKey::parse("deadline-1").unwrap();
    let length = Duration::from_millis(600);
    let lease = acquire(&h, &key, length).await;
    let returned = tokio::time::Instant::now();
    assert!(!lease.is_lost(), "a fresh lease is not lost");
    let blocker = h.block_renewals(&key).await;
    // A renewal sent now cannot get through (it waits on the held row,
    // or the record refuses it): it must not keep the lease alive.
    let hanging = tokio::time::timeout(length * 2, lease.renew()).await;
    assert!(
        !matches!(hanging, Ok(Ok(()))),
        "a renewal got through while blocked"
    );
    tokio::time::sleep_until(returned + length).await;
    assert!(
        lease.is_lost(),
        "is_lost() was still false a lease after the claim returned"
    );
    h.unblock(blocker).await;
    let _ = lease.renew().await;
    assert!(lease.is_lost(), "a late renewal revived a lost lease");
}

/// Every statement of a stale owner is fenced by its token, not only by the
/// record's state: while the new owner still holds it `processing`, the
/// old ones can neither complete, release nor mark it uncertain.
pub async fn a_stale_owner_cannot_touch_the_row_the_new_owner_holds() {
    let h = H::new("fence").await;
    let key = IdempotencyKey::parse("fence-1").unwrap();
    let lease = Duration::from_millis(200);
    let mut owners = vec![acquire(&h, &key, lease).await];
    for generation in 2..=4 {
        until_lease_lapsed(&h, &key).await;
        let next = acquire(&h, &key, lease).await;
        assert_eq!(next.generation(), generation);
        owners.push(next);
    }
    let current = owners.pop().unwrap();
    let mut stale = owners.into_iter();
    let r = stale.next().unwrap().complete(&paid("stale")).await;
    assert!(
        matches!(r, Err(LeaseError::StaleOwner { generation: 1 })),
        "{r:?}"
    );
    let r = stale.next().unwrap().release().await;
    assert!(
        matches!(r, Err(LeaseError::StaleOwner { generation: 2 })),
        "{r:?}"
    );
    let r = stale.next().unwrap().mark_uncertain().await;
    assert!(
        matches!(r, Err(LeaseError::StaleOwner { generation: 3 })),
        "{r:?}"
    );
    let r = record(&h, "fence-1").await;
    assert_eq!(
        (r.state.as_str(), r.generation),
        ("processing", 4),
        "the new owner's record is untouched"
    );
    current.complete(&paid("ch_4")).await.unwrap();
    match h.claim(&lease_req(&key, lease)).await {
        LeasedClaim::Replay(stored) => assert_eq!(stored, paid("ch_4")),
        other => panic!("expected the new owner's outcome, got {other:?}"),
    }
}

/// Of many concurrent claims of one key, exactly one acquires it.
pub async fn of_concurrent_claims_of_one_key_exactly_one_acquires() {
    let h = Arc::new(H::new("claim-race").await);
    let n = 8;
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (h, barrier) = (h.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let key = IdempotencyKey::parse("race-claim").unwrap();
            barrier.wait().await;
            match h.claim(&lease_req(&key, HOUR)).await {
                LeasedClaim::Acquired(_) => 1,
                LeasedClaim::InFlight { .. }
                | LeasedClaim::Contended { .. }
                | LeasedClaim::Busy { .. } => 0,
                other => panic!("expected acquired, in flight, contended or busy, got {other:?}"),
            }
        }));
    }
    let mut acquired = 0;
    for t in tasks {
        acquired += t.await.unwrap();
    }
    assert_eq!(acquired, 1);
}

/// While the downstream is asked about an uncertain execution, the key is
/// released elsewhere and a new execution of it becomes uncertain, again at
/// generation 1. The late answer ("not charged") must not forget the new one.
struct Reused(Arc<H>);

impl Reconcile for Reused {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, _: &UncertainOutcome) -> Resolution {
        let key = IdempotencyKey::parse("aba-1").unwrap();
        self.0.delete(&key).await;
        match self.0.claim(&lease_req(&key, HOUR)).await {
            LeasedClaim::Acquired(lease) => lease.mark_uncertain().await.unwrap(),
            other => panic!("expected to acquire, got {other:?}"),
        }
        Resolution::Released
    }
}

pub async fn a_late_resolution_never_applies_to_a_later_execution_of_the_key() {
    let h = Arc::new(H::new("aba").await);
    let key = IdempotencyKey::parse("aba-1").unwrap();
    acquire(&h, &key, HOUR)
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let report = reconciler(&h, Reused(h.clone())).run_once().await.unwrap();
    assert_eq!(report.released, 0, "{report:?}");
    let r = record(&h, "aba-1").await;
    assert_eq!(
        (r.state.as_str(), r.generation),
        ("uncertain", 1),
        "the new execution still awaits its own reconciliation"
    );
    assert!(matches!(
        h.claim(&lease_req(&key, HOUR)).await,
        LeasedClaim::Uncertain
    ));
}
