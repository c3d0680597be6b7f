//! Every test of the long-operations suite, written once against the
//! enclosing store module's `Db` (its store type) and `backend` (a fresh store
//! for one test). `tests/operations.rs` mounts this file in each store's module
//! and stamps a `#[tokio::test]` wrapper per test there.

use super::*;

/// A fresh store for one test: its `Idem`, the store the reconciler
/// runs on, and what must live as long as the test (a database).
pub struct Backend {
    pub idem: Idem<Db>,
    pub store: <Db as LeaseBackend>::Store,
    pub _keep: Box<dyn std::any::Any + Send>,
}

#[derive(Clone)]
pub struct App {
    idem: Idem<Db>,
    downstream: Arc<Downstream>,
    /// A held job reports here, then waits for a permit.
    entered: mpsc::UnboundedSender<()>,
    pub release: Arc<Semaphore>,
    /// The handler's runs, takeovers included.
    pub runs: Arc<AtomicUsize>,
    /// The next `crash` job dies after its effect.
    crash_next: Arc<AtomicBool>,
}

impl FromRef<App> for Idem<Db> {
    fn from_ref(a: &App) -> Idem<Db> {
        a.idem.clone()
    }
}

#[idempotent(
    operation = "create-export",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h",
    accepted
)]
async fn create_export(
    #[tenant] _caller: Caller,
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(job): Json<Job>,
) -> Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    if job.hold && lease.acquisition() == Acquisition::New {
        app.entered.send(()).ok();
        app.release.acquire().await.unwrap().forget();
    }
    let key = lease.downstream_key();
    match job.kind.as_str() {
        "ok" => (
            StatusCode::CREATED,
            Json(exported(&app.downstream.export(&key))),
        )
            .into_response(),
        "crash" => {
            let id = app.downstream.export(&key);
            if app.crash_next.swap(false, Ordering::SeqCst) {
                panic!("simulated crash after the effect");
            }
            (StatusCode::CREATED, Json(exported(&id))).into_response()
        }
        "refuse" => (StatusCode::PAYMENT_REQUIRED, "over quota").into_response(),
        "uncertain" => {
            app.downstream.export(&key);
            Uncertain::new("the exporter timed out").into_response()
        }
        _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// The same job in a single-tenant service: its rows live under `*`.
#[idempotent(
    operation = "single-export",
    retention = "1h",
    lease = "300ms",
    lease_ceiling = "1h",
    accepted,
    single_tenant
)]
async fn single_export(
    State(app): State<App>,
    lease: &mut Lease<Db>,
    Json(job): Json<Job>,
) -> Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    if job.hold && lease.acquisition() == Acquisition::New {
        app.entered.send(()).ok();
        app.release.acquire().await.unwrap().forget();
    }
    let id = app.downstream.export(&lease.downstream_key());
    (StatusCode::CREATED, Json(exported(&id))).into_response()
}

/// A single-tenant service: its operations' router takes `SingleTenant`
/// as the caller, as tenant.rs documents.
fn single_tenant_router(app: &App) -> Router {
    Router::new()
        .route("/single-exports", post(single_export))
        .nest(
            app.idem.operations_path(),
            operations::router::<idem_runtime::SingleTenant, Db, App>(),
        )
        .with_state(app.clone())
}

pub struct Setup {
    pub router: Router,
    pub app: App,
    store: <Db as LeaseBackend>::Store,
    pub entered: mpsc::UnboundedReceiver<()>,
    pub _keep: Box<dyn std::any::Any + Send>,
}

/// The service's routes over `app`: the export, and the operations.
fn router_for(app: &App) -> Router {
    Router::new()
        .route("/exports", post(create_export))
        .nest(
            app.idem.operations_path(),
            operations::router::<Caller, Db, App>(),
        )
        .with_state(app.clone())
}

pub async fn setup(test: &str) -> Setup {
    let Backend { idem, store, _keep } = backend(test).await;
    let (tx, entered) = mpsc::unbounded_channel();
    let app = App {
        idem,
        downstream: Arc::new(Downstream::default()),
        entered: tx,
        release: Arc::new(Semaphore::new(0)),
        runs: Arc::new(AtomicUsize::new(0)),
        crash_next: Arc::new(AtomicBool::new(false)),
    };
    let router = router_for(&app);
    Setup {
        router,
        app,
        store,
        entered,
        _keep,
    }
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    fn operation(&self) -> Operation {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    pub fn location(&self) -> String {
        self.headers["location"].to_str().unwrap().to_owned()
    }
}

pub async fn send(router: &Router, req: Request<Body>) -> Answer {
    let resp = router.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes().to_vec(),
    }
}

pub fn export(key: &str, kind: &str, hold: bool) -> Request<Body> {
    export_as("acme", key, kind, hold)
}

fn export_as(tenant: &str, key: &str, kind: &str, hold: bool) -> Request<Body> {
    Request::post("/exports")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", key)
        .body(Body::from(
            json!({ "kind": kind, "hold": hold }).to_string(),
        ))
        .unwrap()
}

pub fn get_as(tenant: &str, path: &str) -> Request<Body> {
    Request::get(path)
        .header("authorization", format!("Bearer {tenant}"))
        .body(Body::empty())
        .unwrap()
}

pub async fn status_of(s: &Setup, location: &str) -> Operation {
    let a = send(&s.router, get_as("acme", location)).await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&a.body)
    );
    a.operation()
}

/// Waits until the resource says `want` (a lease lapses on the store's
/// clock; the resource reads it there).
async fn until_status(s: &Setup, location: &str, want: Status) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = status_of(s, location).await.status;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "never {want:?}; still {got:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The work the `202`s left running, finished.
pub async fn settled(s: &Setup) {
    tokio::time::timeout(Duration::from_secs(60), s.app.idem.executions().drained())
        .await
        .expect("the long operations finished");
}

fn expected_location(key: &str) -> String {
    format!(
        "/operations/create-export/{}",
        crate::common::digest_hex(key)
    )
}

pub async fn a_long_operation_answers_202_at_once_and_replays_its_answer_when_done() {
    let mut s = setup("replay").await;
    let first = send(&s.router, export("k-1", "ok", true)).await;
    assert_eq!(
        first.status,
        StatusCode::ACCEPTED,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(first.location(), expected_location("k-1"));
    assert_eq!(first.headers["retry-after"], "1");
    assert_eq!(first.headers["content-type"], "application/json");
    assert!(first.headers.get("idempotent-replayed").is_none());
    let doc = first.operation();
    assert_eq!(doc.status, Status::Running);
    assert_eq!(doc.href, first.location());
    assert_eq!(doc.retry_after, Some(1));
    // The handler is still at its gate: the answer did not wait for it.
    s.entered.recv().await.unwrap();
    for _ in 0..3 {
        let again = send(&s.router, export("k-1", "ok", true)).await;
        assert_eq!(again.status, StatusCode::ACCEPTED);
        assert_eq!(again.location(), first.location());
        assert_eq!(again.headers["retry-after"], "1");
        assert_eq!(again.body, first.body, "the same 202, byte for byte");
    }
    s.app.release.add_permits(1);
    settled(&s).await;
    let done = send(&s.router, export("k-1", "ok", true)).await;
    assert_eq!(done.status, StatusCode::CREATED);
    assert_eq!(done.headers["idempotent-replayed"], "true");
    assert_eq!(done.json(), exported("exp_0"));
    let again = send(&s.router, export("k-1", "ok", true)).await;
    assert_eq!(again.body, done.body, "a replay, exactly");
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(s.app.downstream.count(), 1);
}

pub async fn the_resource_shows_running_then_succeeded_and_replays_the_result() {
    let mut s = setup("states").await;
    let location = send(&s.router, export("k-2", "ok", true)).await.location();
    s.entered.recv().await.unwrap();
    let running = send(&s.router, get_as("acme", &location)).await;
    assert_eq!(running.status, StatusCode::OK);
    assert_eq!(running.headers["cache-control"], "no-store");
    assert_eq!(running.headers["retry-after"], "1");
    let doc = running.operation();
    assert_eq!(doc.status, Status::Running);
    assert_eq!(doc.operation, "create-export");
    assert_eq!(
        doc.id,
        format!("create-export/{}", crate::common::digest_hex("k-2"))
    );
    assert_eq!((doc.response_status, doc.result), (None, None));
    assert!(
        !String::from_utf8_lossy(&running.body).contains("k-2"),
        "never the key"
    );
    // No result yet.
    let early = send(&s.router, get_as("acme", &format!("{location}/result"))).await;
    assert_eq!(early.status, StatusCode::CONFLICT);
    assert_eq!(early.json()["type"], "urn:idem:problem:request-in-flight");
    assert_eq!(early.location(), location);

    s.app.release.add_permits(1);
    settled(&s).await;
    let done = status_of(&s, &location).await;
    assert_eq!(done.status, Status::Succeeded);
    assert_eq!(done.response_status, Some(201));
    assert_eq!(done.retry_after, None);
    let result = done.result.unwrap();
    assert_eq!(result, format!("{location}/result"));
    let replayed = send(&s.router, get_as("acme", &result)).await;
    assert_eq!(replayed.status, StatusCode::CREATED);
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    // The address is another tenant's too under the same key: no cache keeps it.
    assert_eq!(replayed.headers["cache-control"], "no-store");
    assert_eq!(early.headers["cache-control"], "no-store");
    let retry = send(&s.router, export("k-2", "ok", true)).await;
    assert_eq!(
        replayed.body, retry.body,
        "the result is the retry's replay"
    );
    assert_eq!(
        replayed.headers["content-type"],
        retry.headers["content-type"]
    );
}

pub async fn a_refused_job_is_failed_and_its_4xx_is_the_result() {
    let s = setup("failed").await;
    let location = send(&s.router, export("k-3", "refuse", false))
        .await
        .location();
    settled(&s).await;
    let doc = status_of(&s, &location).await;
    assert_eq!(doc.status, Status::Failed);
    assert_eq!(doc.response_status, Some(402));
    let result = send(&s.router, get_as("acme", &doc.result.unwrap())).await;
    assert_eq!(result.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(result.body, b"over quota");
    let retry = send(&s.router, export("k-3", "refuse", false)).await;
    assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
}

struct AskDownstream(Arc<Downstream>);

impl Reconcile for AskDownstream {
    fn operation(&self) -> &str {
        "create-export"
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        match self.0.find(&outcome.downstream_key) {
            Some(id) => Resolution::Completed(StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: serde_json::to_vec(&exported(&id)).unwrap().into(),
            }),
            None => Resolution::Released,
        }
    }
}

pub async fn an_uncertain_job_is_shown_uncertain_until_the_reconciler_resolves_it() {
    let s = setup("uncertain").await;
    let location = send(&s.router, export("k-4", "uncertain", false))
        .await
        .location();
    settled(&s).await;
    let doc = status_of(&s, &location).await;
    assert_eq!(doc.status, Status::Uncertain);
    assert_eq!(doc.retry_after, Some(1));
    // A retry is told so, with where to look; nothing runs again.
    let retry = send(&s.router, export("k-4", "uncertain", false)).await;
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    assert_eq!(retry.json()["type"], "urn:idem:problem:outcome-uncertain");
    assert_eq!(retry.location(), location);
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
    let report =
        Reconciler::<_, Db>::on_store(s.store.clone(), AskDownstream(s.app.downstream.clone()))
            .run_once()
            .await
            .unwrap();
    assert_eq!(report.completed, 1);
    let doc = status_of(&s, &location).await;
    assert_eq!(doc.status, Status::Succeeded);
    let replay = send(&s.router, export("k-4", "uncertain", false)).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.json(), exported("exp_0"));
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
}

pub async fn another_tenant_gets_the_same_404_as_an_operation_that_never_was() {
    let mut s = setup("tenants").await;
    let location = send(&s.router, export("k-5", "ok", true)).await.location();
    s.entered.recv().await.unwrap();
    let nobody = format!(
        "/operations/create-export/{}",
        crate::common::digest_hex("never-sent")
    );
    let reference = send(&s.router, get_as("acme", &nobody)).await;
    assert_eq!(reference.status, StatusCode::NOT_FOUND);
    assert_eq!(
        reference.json()["type"],
        "urn:idem:problem:operation-not-found"
    );
    let hidden = [
        get_as("globex", &location),
        get_as("globex", &format!("{location}/result")),
        get_as(
            "acme",
            &location
                .to_uppercase()
                .replace("/OPERATIONS/CREATE-EXPORT/", "/operations/create-export/"),
        ),
        get_as("acme", &location.replace("create-export", "create-order")),
        get_as("acme", "/operations/create-export/not-hex"),
        get_as("acme", "/operations/create-export"),
        get_as("acme", &format!("{nobody}/result")),
        // (`/operations/` is the service's own fallback: a nested router
        // cannot match it in axum 0.8.)
        get_as("acme", "/operations"),
        get_as("acme", "/operations/create-export/%FF"),
    ];
    assert_eq!(reference.headers["cache-control"], "no-store");
    for req in hidden {
        let uri = req.uri().to_string();
        let a = send(&s.router, req).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{uri}");
        assert_eq!(a.body, reference.body, "{uri}: nothing hints why");
        assert_eq!(a.headers["cache-control"], "no-store", "{uri}");
        assert_eq!(a.headers.get("location"), None, "{uri}");
        assert_eq!(a.headers.get("retry-after"), None, "{uri}");
    }
    // The owner sees it; the other tenant's POST with the same key is its own.
    assert_eq!(status_of(&s, &location).await.status, Status::Running);
    s.app.release.add_permits(1);
    settled(&s).await;
    let theirs = send(&s.router, export_as("globex", "k-5", "ok", false)).await;
    assert_eq!(theirs.status, StatusCode::ACCEPTED);
    assert_eq!(
        theirs.location(),
        location,
        "the same address, another tenant's record"
    );
    settled(&s).await;
    let a = send(&s.router, get_as("globex", &location)).await;
    assert_eq!(a.operation().status, Status::Succeeded);
    assert_eq!(s.app.downstream.count(), 2, "each tenant's own export");
}

pub async fn a_job_killed_mid_work_is_taken_over_at_the_same_address_with_one_effect() {
    let s = setup("takeover").await;
    s.app.crash_next.store(true, Ordering::SeqCst);
    let first = send(&s.router, export("k-6", "crash", false)).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let location = first.location();
    // The worker died after its effect: nobody renews its lease, and the
    // resource says so once it lapses.
    settled(&s).await;
    until_status(&s, &location, Status::Stalled).await;
    let stalled = send(&s.router, get_as("acme", &location)).await;
    assert_eq!(stalled.headers["retry-after"], "1");
    let result = send(&s.router, get_as("acme", &format!("{location}/result"))).await;
    assert_eq!(result.status, StatusCode::CONFLICT);
    assert!(
        result.json()["detail"]
            .as_str()
            .unwrap()
            .contains("same key")
    );
    // The retry takes the work over, at the same address.
    let retry = send(&s.router, export("k-6", "crash", false)).await;
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    assert_eq!(retry.location(), location);
    assert_eq!(retry.body, first.body);
    settled(&s).await;
    let doc = status_of(&s, &location).await;
    assert_eq!(doc.status, Status::Succeeded);
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 2);
    assert_eq!(
        s.app.downstream.calls.load(Ordering::SeqCst),
        2,
        "called again after the crash..."
    );
    assert_eq!(
        s.app.downstream.count(),
        1,
        "...with the same downstream key: one effect"
    );
    let replay = send(&s.router, export("k-6", "crash", false)).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.json(), exported("exp_0"));
}

pub async fn another_request_under_the_key_is_422_while_running_and_when_done() {
    let mut s = setup("mismatch").await;
    send(&s.router, export("k-7", "ok", true)).await;
    s.entered.recv().await.unwrap();
    let other = send(&s.router, export("k-7", "refuse", true)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.json()["type"],
        "urn:idem:problem:fingerprint-mismatch"
    );
    s.app.release.add_permits(1);
    settled(&s).await;
    let other = send(&s.router, export("k-7", "refuse", true)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
}

pub async fn concurrent_duplicates_all_see_one_operation_and_one_effect() {
    let mut s = setup("duplicates").await;
    let first = send(&s.router, export("k-8", "ok", true)).await;
    s.entered.recv().await.unwrap();
    let duplicates: Vec<_> = (0..8)
        .map(|_| {
            let router = s.router.clone();
            tokio::spawn(async move { send(&router, export("k-8", "ok", true)).await })
        })
        .collect();
    for d in duplicates {
        let a = d.await.unwrap();
        assert_eq!(
            a.status,
            StatusCode::ACCEPTED,
            "{}",
            String::from_utf8_lossy(&a.body)
        );
        assert_eq!(a.location(), first.location());
        assert_eq!(a.body, first.body);
    }
    s.app.release.add_permits(1);
    settled(&s).await;
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1, "one execution");
    assert_eq!(
        s.app.downstream.calls.load(Ordering::SeqCst),
        1,
        "one effect"
    );
    assert_eq!(
        status_of(&s, &first.location()).await.status,
        Status::Succeeded
    );
}

/// Racing from the first request on: every one of them is answered the
/// same `202`, and one execution runs.
pub async fn concurrent_first_requests_start_one_operation() {
    let s = setup("first-race").await;
    let racers: Vec<_> = (0..8)
        .map(|_| {
            let router = s.router.clone();
            tokio::spawn(async move { send(&router, export("k-9", "ok", true)).await })
        })
        .collect();
    let mut bodies = Vec::new();
    for r in racers {
        let a = r.await.unwrap();
        // A racer whose claim could not read the key's row in time (on a
        // loaded database, twice) is told to retry, and given nothing else.
        if a.status == StatusCode::CONFLICT {
            assert_eq!(a.json()["type"], "urn:idem:problem:request-in-flight");
            assert!(!a.headers.contains_key("location"));
            continue;
        }
        assert_eq!(
            a.status,
            StatusCode::ACCEPTED,
            "{}",
            String::from_utf8_lossy(&a.body)
        );
        assert_eq!(a.location(), expected_location("k-9"));
        bodies.push(a.body);
    }
    assert!(!bodies.is_empty(), "the first is accepted");
    bodies.dedup();
    assert_eq!(bodies.len(), 1, "one answer for all that were accepted");
    s.app.release.add_permits(1);
    settled(&s).await;
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(s.app.downstream.count(), 1);
}

/// A single-tenant service reads its own long operations: running,
/// then succeeded, then the result (the caller is `*`, the id its
/// handlers stored the rows under).
pub async fn a_single_tenant_service_reads_its_operations() {
    let mut s = setup("single").await;
    let router = single_tenant_router(&s.app);
    let request = || {
        Request::post("/single-exports")
            .header("content-type", "application/json")
            .header("idempotency-key", "s-1")
            .body(Body::from(
                json!({ "kind": "ok", "hold": true }).to_string(),
            ))
            .unwrap()
    };
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let first = send(&router, request()).await;
    assert_eq!(
        first.status,
        StatusCode::ACCEPTED,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let location = first.location();
    assert_eq!(
        location,
        format!(
            "/operations/single-export/{}",
            crate::common::digest_hex("s-1")
        )
    );
    s.entered.recv().await.unwrap();
    let running = send(&router, get(&location)).await;
    assert_eq!(
        running.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&running.body)
    );
    assert_eq!(running.operation().status, Status::Running);
    let early = send(&router, get(&format!("{location}/result"))).await;
    assert_eq!(
        early.status,
        StatusCode::CONFLICT,
        "{}",
        String::from_utf8_lossy(&early.body)
    );

    s.app.release.add_permits(1);
    settled(&s).await;
    let done = send(&router, get(&location)).await;
    assert_eq!(
        done.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&done.body)
    );
    let doc = done.operation();
    assert_eq!(doc.status, Status::Succeeded);
    assert_eq!(doc.response_status, Some(201));
    let result = send(&router, get(&doc.result.unwrap())).await;
    assert_eq!(
        result.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&result.body)
    );
    assert_eq!(result.headers["idempotent-replayed"], "true");
    assert_eq!(result.json(), exported("exp_0"));
    let retry = send(&router, request()).await;
    assert_eq!(result.body, retry.body, "the result is the retry's replay");
    // A multi-tenant caller never sees the single-tenant scope.
    let other = send(&s.router, get_as("acme", &location)).await;
    assert_eq!(other.status, StatusCode::NOT_FOUND);
    let star = send(&s.router, get_as("*", &location)).await;
    assert_eq!(
        star.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "a caller named `*` is refused"
    );
    assert_eq!(star.json()["type"], "urn:idem:problem:invalid-tenant");
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
}

pub async fn a_failed_job_frees_its_key_and_its_resource_is_gone() {
    let s = setup("released").await;
    let location = send(&s.router, export("k-10", "error", false))
        .await
        .location();
    settled(&s).await;
    let gone = send(&s.router, get_as("acme", &location)).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    // The key is free: the request sent again runs anew, at the same address.
    let again = send(&s.router, export("k-10", "error", false)).await;
    assert_eq!(again.status, StatusCode::ACCEPTED);
    assert_eq!(again.location(), location);
    settled(&s).await;
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 2);
}

/// A key ring of one key, `id`, of 32 bytes `byte`.
fn ring(id: &str, byte: u8) -> idem_runtime::at_rest::KeyRing {
    idem_runtime::at_rest::KeyRing::new(
        id,
        [(id, idem_runtime::at_rest::Zeroizing::new(vec![byte; 32]))],
    )
    .unwrap()
}

/// A finished operation whose result is sealed with a key the service's ring
/// lacks: `GET .../result` is `503` "could not be read", never "nothing was
/// stored" (the operation ran: a client told otherwise might send it anew
/// under a new key), while its status still says it succeeded.
pub async fn a_result_that_cannot_be_opened_never_says_nothing_was_stored() {
    let mut s = setup("unreadable").await;
    s.app.idem = s.app.idem.clone().with_key_ring(ring("k1", 7));
    s.router = router_for(&s.app);
    let location = send(&s.router, export("k-13", "ok", false))
        .await
        .location();
    settled(&s).await;
    let mut lacking = s.app.clone();
    lacking.idem = lacking.idem.with_key_ring(ring("k2", 9));
    let lacking = router_for(&lacking);
    let result = send(&lacking, get_as("acme", &format!("{location}/result"))).await;
    assert_eq!(result.status, StatusCode::SERVICE_UNAVAILABLE);
    let body = String::from_utf8_lossy(&result.body).into_owned();
    assert!(
        body.contains("could not be read") && !body.contains("nothing was stored"),
        "{body}"
    );
    let status = send(&lacking, get_as("acme", &location)).await;
    assert_eq!(status.json()["status"], "succeeded");
}
