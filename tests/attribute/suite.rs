//! Every test of the `#[idempotent]` suite, written once against the enclosing
//! database module's `Db`, `TestDb`, `WIDGETS_DDL`, `TENANT_TEXT` and
//! `add_widget`. `tests/attribute.rs` mounts this file in each database's
//! module (the handlers' `Tx<Db>` picks the backend, so it must be concrete)
//! and stamps a `#[tokio::test]` wrapper per test there.

use super::*;

use crate::common::caller::Caller;
use crate::common::gate::Gate;

#[derive(Clone)]
pub struct AppState {
    pub idem: Idem<Db>,
    /// Where the widget handler waits inside its transaction, if set.
    pub gate: Option<Arc<Gate>>,
}

impl FromRef<AppState> for Idem<Db> {
    fn from_ref(s: &AppState) -> Idem<Db> {
        s.idem.clone()
    }
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewWidget {
    name: String,
    #[serde(default)]
    outcome: Option<String>,
}

type ApiError = (StatusCode, String);

#[idempotent(
    operation = "create-widget",
    retention = "1h",
    fingerprint(body, header = "x-color")
)]
pub async fn create_widget(
    #[tenant] caller: Caller,
    State(state): State<AppState>,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let id: i64 = add_widget(tx, &caller.0, &w.name)
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    if let Some(gate) = &state.gate {
        gate.stop().await;
    }
    match w.outcome.as_deref() {
        // An Err rolls back the insert above and frees the key.
        Some("err") => Err((StatusCode::CONFLICT, "refused".into())),
        // A 5xx rolls back too.
        Some("5xx") => Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"retry": true})),
        )),
        // A committed business rejection is stored and replayed.
        Some("reject") => Ok((
            StatusCode::NOT_FOUND,
            Json(json!({"id": id, "rejected": true})),
        )),
        _ => Ok((
            StatusCode::CREATED,
            Json(json!({"id": id, "name": w.name, "tenant": caller.0})),
        )),
    }
}

/// A second operation on the same table, to show operations do not share keys.
#[idempotent(operation = "import-widget", retention = "1h")]
async fn import_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> impl IntoResponse {
    let id: i64 = add_widget(tx, &caller.0, &w.name).await.unwrap();
    (
        StatusCode::CREATED,
        Json(json!({"id": id, "imported": true})),
    )
}

#[derive(Deserialize, Serialize)]
struct Blob {
    size: usize,
}

/// Answers with headers that are and are not stored, and a body of a chosen size.
#[idempotent(operation = "make-blob", retention = "1h")]
async fn make_blob(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(b): Json<Blob>,
) -> impl IntoResponse {
    add_widget(tx, &caller.0, "blob").await.unwrap();
    (
        StatusCode::CREATED,
        [
            // Not ASCII: `http` takes the bytes, so idem stores and replays them.
            ("location", "/blobs/1/café"),
            // What the bytes must be read with (they are not gzip: only the
            // header's round trip is under test).
            ("content-encoding", "gzip"),
            ("set-cookie", "session=secret"),
            ("x-trace", "not-stored"),
        ],
        "x".repeat(b.size),
    )
}

/// A single-tenant operation on a path: `/batches/1` and `/batches/2` are
/// different requests even with the same key and body.
#[idempotent(operation = "close-batch", retention = "1h", single_tenant)]
async fn close_batch(
    axum::extract::Path(id): axum::extract::Path<i64>,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> (StatusCode, String) {
    add_widget(tx, "-", &w.name).await.unwrap();
    (StatusCode::OK, format!("closed batch {id}"))
}

/// Writes one widget in the claimed transaction; its id.
async fn insert_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) -> i64 {
    add_widget(tx, tenant, name).await.unwrap()
}

/// A fallible body: idem answers the rejection before anything is claimed,
/// so the handler's own `Err` arm is never reached (it would answer 418).
#[idempotent(operation = "fallible-widget", retention = "1h")]
async fn fallible_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    w: Result<Json<NewWidget>, JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(w) = w.map_err(|_| (StatusCode::IM_A_TEAPOT, "reached".to_owned()))?;
    let id = insert_widget(tx, &caller.0, &w.name).await;
    Ok((StatusCode::CREATED, Json(json!({"id": id}))))
}

/// An optional body: no body and a body are different requests.
#[idempotent(operation = "optional-widget", retention = "1h")]
async fn optional_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    w: Option<Json<NewWidget>>,
) -> (StatusCode, Json<Value>) {
    let name = w.map(|Json(w)| w.name).unwrap_or_else(|| "default".into());
    let id = insert_widget(tx, &caller.0, &name).await;
    (StatusCode::CREATED, Json(json!({"id": id, "name": name})))
}

type WidgetBody = Json<NewWidget>;

/// A body behind an alias the attribute cannot see into: still fingerprinted.
#[idempotent(operation = "alias-widget", retention = "1h")]
async fn alias_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    w: WidgetBody,
) -> (StatusCode, Json<Value>) {
    let id = insert_widget(tx, &caller.0, &w.0.name).await;
    (StatusCode::CREATED, Json(json!({"id": id})))
}

/// A fallible body behind an alias: its rejection is answered before the
/// claim as well (the handler's own `Err` arm would answer 418).
#[idempotent(operation = "fallible-alias-widget", retention = "1h")]
async fn fallible_alias_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    w: Result<WidgetBody, JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(w) = w.map_err(|_| (StatusCode::IM_A_TEAPOT, "reached".to_owned()))?;
    let id = insert_widget(tx, &caller.0, &w.name).await;
    Ok((StatusCode::CREATED, Json(json!({"id": id}))))
}

/// Raw bytes, fingerprinted byte for byte.
#[idempotent(operation = "raw-widget", retention = "1h")]
async fn raw_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    body: axum::body::Bytes,
) -> (StatusCode, Json<Value>) {
    let id = insert_widget(tx, &caller.0, &String::from_utf8_lossy(&body)).await;
    (StatusCode::CREATED, Json(json!({"id": id})))
}

/// The body left out on purpose: the header alone identifies the request.
#[idempotent(
    operation = "tagged-widget",
    retention = "1h",
    fingerprint(header = "x-color", ignore_body)
)]
async fn tagged_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> (StatusCode, Json<Value>) {
    let id = insert_widget(tx, &caller.0, &w.name).await;
    (StatusCode::CREATED, Json(json!({"id": id, "name": w.name})))
}

/// The tenant named by the path.
#[idempotent(operation = "org-widget", retention = "1h")]
async fn org_widget(
    #[tenant] org: axum::extract::Path<String>,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> (StatusCode, Json<Value>) {
    let id = insert_widget(tx, &org, &w.name).await;
    (StatusCode::CREATED, Json(json!({"id": id})))
}

/// `Uncertain`, a leased handler's answer, from a transaction: as `Ok` or as
/// `Err`, after writing a widget. As a response, which the attribute cannot
/// see into (named in the return type, it does not compile).
#[idempotent(operation = "uncertain-widget", retention = "1h")]
async fn uncertain_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> Result<axum::response::Response, axum::response::Response> {
    insert_widget(tx, &caller.0, &w.name).await;
    let uncertain = idem_runtime::Uncertain::new("the provider timed out").into_response();
    match w.outcome.as_deref() {
        Some("err") => Err(uncertain),
        _ => Ok(uncertain),
    }
}

pub struct App {
    pub db: TestDb,
    pub router: Router,
}

pub async fn app(gate: Option<Arc<Gate>>, wait: Duration) -> App {
    let db = TestDb::new().await;
    db.exec(WIDGETS_DDL).await;
    let state = AppState {
        idem: Idem::new(db.pool.clone())
            .with_in_flight_wait(wait)
            .with_max_response_bytes(1000),
        gate,
    };
    let router = Router::new()
        .route("/widgets", post(create_widget))
        .route("/imports", post(import_widget))
        .route("/blobs", post(make_blob))
        .route("/batches/{id}", post(close_batch))
        .route("/fallible", post(fallible_widget))
        .route("/fallible-alias", post(fallible_alias_widget))
        .route("/optional", post(optional_widget))
        .route("/alias", post(alias_widget))
        .route("/raw", post(raw_widget))
        .route("/tagged", post(tagged_widget))
        .route("/orgs/{org}/widgets", post(org_widget))
        .route("/uncertain", post(uncertain_widget))
        .nest(
            "/stores/{store}",
            Router::new().route("/widgets", post(create_widget)),
        )
        .with_state(state);
    App { db, router }
}

pub fn request(path: &str, tenant: Option<&str>, key: Option<&str>, body: &str) -> Request<Body> {
    let mut r = Request::post(path).header("content-type", "application/json");
    if let Some(t) = tenant {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.body(Body::from(body.to_owned())).unwrap()
}

pub struct Answer {
    pub status: StatusCode,
    headers: axum::http::HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
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

pub const WAIT: Duration = Duration::from_secs(2);

pub async fn retry_replays_the_stored_answer() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"bolt"}"#;
    let first = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    // Reordered white space is the same logical request.
    let again = send(
        &a.router,
        request(
            "/widgets",
            Some("acme"),
            Some("k1"),
            r#"{ "name" : "bolt" }"#,
        ),
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn a_changed_body_or_header_is_a_mismatch() {
    let a = app(None, WAIT).await;
    let first = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), r#"{"name":"bolt"}"#),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), r#"{"name":"nut"}"#),
    )
    .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.headers["content-type"], "application/problem+json");
    assert_eq!(
        other.json()["type"],
        "urn:idem:problem:fingerprint-mismatch"
    );
    let mut with_header = request("/widgets", Some("acme"), Some("k1"), r#"{"name":"bolt"}"#);
    with_header
        .headers_mut()
        .insert("x-color", "red".parse().unwrap());
    let other = send(&a.router, with_header).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn missing_and_malformed_keys_are_400_problems() {
    let a = app(None, WAIT).await;
    let missing = send(
        &a.router,
        request("/widgets", Some("acme"), None, r#"{"name":"bolt"}"#),
    )
    .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.headers["content-type"], "application/problem+json");
    assert_eq!(
        missing.json()["type"],
        "urn:idem:problem:missing-idempotency-key"
    );
    let long = "k".repeat(256);
    for bad in ["\"unterminated", long.as_str(), "a b"] {
        let r = send(
            &a.router,
            request("/widgets", Some("acme"), Some(bad), r#"{"name":"bolt"}"#),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(
            r.json()["type"],
            "urn:idem:problem:malformed-idempotency-key"
        );
        assert!(!String::from_utf8_lossy(&r.body).contains(bad));
    }
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        0
    );
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 0);
}

pub async fn extractor_rejections_reserve_nothing() {
    let a = app(None, WAIT).await;
    let no_auth = send(
        &a.router,
        request("/widgets", None, Some("k1"), r#"{"name":"bolt"}"#),
    )
    .await;
    assert_eq!(no_auth.status, StatusCode::UNAUTHORIZED);
    let bad_json = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), r#"{"name":"#),
    )
    .await;
    assert_eq!(bad_json.status, StatusCode::BAD_REQUEST);
    let unknown_field = send(
        &a.router,
        request(
            "/widgets",
            Some("acme"),
            Some("k1"),
            r#"{"name":"x","zzz":1}"#,
        ),
    )
    .await;
    assert_eq!(unknown_field.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        0
    );
    // The same key then executes, with a different body than the rejected ones.
    let ok = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), r#"{"name":"bolt"}"#),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
}

pub async fn tenants_and_operations_are_isolated() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"bolt"}"#;
    let acme = send(
        &a.router,
        request("/widgets", Some("acme"), Some("same"), body),
    )
    .await;
    let globex = send(
        &a.router,
        request("/widgets", Some("globex"), Some("same"), body),
    )
    .await;
    let import = send(
        &a.router,
        request("/imports", Some("acme"), Some("same"), body),
    )
    .await;
    for r in [&acme, &globex, &import] {
        assert_eq!(r.status, StatusCode::CREATED);
        assert!(!r.replayed());
    }
    assert_eq!(acme.json()["tenant"], "acme");
    assert_eq!(globex.json()["tenant"], "globex");
    assert_eq!(import.json()["imported"], true);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 3);
    // Each tenant's retry gets its own answer back.
    let acme2 = send(
        &a.router,
        request("/widgets", Some("acme"), Some("same"), body),
    )
    .await;
    assert_eq!(acme2.body, acme.body);
    let globex2 = send(
        &a.router,
        request("/widgets", Some("globex"), Some("same"), body),
    )
    .await;
    assert_eq!(globex2.body, globex.body);
}

pub async fn handler_err_and_5xx_roll_back_and_free_the_key() {
    let a = app(None, WAIT).await;
    let err = send(
        &a.router,
        request(
            "/widgets",
            Some("acme"),
            Some("k1"),
            r#"{"name":"a","outcome":"err"}"#,
        ),
    )
    .await;
    assert_eq!(err.status, StatusCode::CONFLICT);
    let five = send(
        &a.router,
        request(
            "/widgets",
            Some("acme"),
            Some("k2"),
            r#"{"name":"a","outcome":"5xx"}"#,
        ),
    )
    .await;
    assert_eq!(five.status, StatusCode::SERVICE_UNAVAILABLE);
    // The handler's own inserts were rolled back, and nothing was stored.
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 0);
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        0
    );
    // The keys are free: a retry (here with a corrected body) executes.
    let ok = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), r#"{"name":"a"}"#),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn an_uncertain_answer_from_a_transaction_rolls_back_as_500() {
    let a = app(None, WAIT).await;
    for (key, body) in [
        ("k1", r#"{"name":"a"}"#),
        ("k2", r#"{"name":"a","outcome":"err"}"#),
    ] {
        let r = send(
            &a.router,
            request("/uncertain", Some("acme"), Some(key), body),
        )
        .await;
        // Not the 202 that would promise a reconciliation nothing performs.
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{key}");
        let problem: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(problem["type"], "about:blank", "{key}");
        assert!(
            problem["detail"].as_str().unwrap().contains("rolled back"),
            "{problem}"
        );
    }
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 0);
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        0
    );
    // Nothing was stored: a retry runs the handler again (and is refused again).
    let again = send(
        &a.router,
        request("/uncertain", Some("acme"), Some("k1"), r#"{"name":"a"}"#),
    )
    .await;
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!again.replayed());
}

pub async fn a_committed_4xx_business_rejection_is_replayed() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"a","outcome":"reject"}"#;
    let first = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert_eq!(first.status, StatusCode::NOT_FOUND);
    let again = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    let state: String = sqlx::query_scalar("SELECT state FROM idempotency_requests")
        .fetch_one(&a.db.pool)
        .await
        .unwrap();
    assert_eq!(state, "failed");
    // The business write of a committed rejection stays, exactly once.
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn a_duplicate_in_flight_gets_409_with_retry_after() {
    let gate = Gate::new();
    let wait = Duration::from_millis(300);
    let a = app(Some(gate.clone()), wait).await;
    let body = r#"{"name":"slow"}"#;
    let router = a.router.clone();
    let first = tokio::spawn(async move {
        send(&router, request("/widgets", Some("acme"), Some("k1"), body)).await
    });
    // The first request holds the key inside its open transaction now.
    gate.arrival().await;
    let started = Instant::now();
    let dup = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    let waited = started.elapsed();
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(dup.headers["retry-after"], "1");
    assert_eq!(dup.json()["type"], "urn:idem:problem:request-in-flight");
    // It waited for the bound (the lock timeout), not less.
    assert!(
        waited >= wait,
        "answered after {waited:?}, before the {wait:?} bound"
    );
    gate.open(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let after = send(
        &a.router,
        request("/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert!(after.replayed());
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn concurrent_duplicates_through_the_router_execute_once() {
    let a = app(None, Duration::from_secs(5)).await;
    let body = r#"{"name":"race"}"#;
    let barrier = Arc::new(tokio::sync::Barrier::new(20));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let router = a.router.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(
                &router,
                request("/widgets", Some("acme"), Some("race"), body),
            )
            .await
        }));
    }
    let mut originals = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            StatusCode::CREATED if !r.replayed() => originals += 1,
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert!(r.headers.contains_key("retry-after")),
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    assert_eq!(originals, 1);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn replays_carry_only_stored_headers_and_never_set_cookie() {
    let a = app(None, WAIT).await;
    let first = send(
        &a.router,
        request("/blobs", Some("acme"), Some("b1"), r#"{"size":10}"#),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The first answer goes out as the handler built it.
    assert_eq!(first.headers["set-cookie"], "session=secret");
    assert_eq!(first.headers["x-trace"], "not-stored");
    let again = send(
        &a.router,
        request("/blobs", Some("acme"), Some("b1"), r#"{"size":10}"#),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["location"], "/blobs/1/café");
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    assert_eq!(
        again.headers["content-encoding"], "gzip",
        "a replay's bytes are unreadable without it"
    );
    assert!(again.headers.get("set-cookie").is_none());
    assert!(again.headers.get("x-trace").is_none());
}

pub async fn a_response_over_the_limit_is_rolled_back_not_lost() {
    let a = app(None, WAIT).await;
    let big = send(
        &a.router,
        request("/blobs", Some("acme"), Some("b1"), r#"{"size":1001}"#),
    )
    .await;
    assert_eq!(big.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(big.json()["type"], "urn:idem:problem:response-too-large");
    // Neither the effect nor a half-stored key remains.
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 0);
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        0
    );
    // At the limit it is stored.
    let ok = send(
        &a.router,
        request("/blobs", Some("acme"), Some("b2"), r#"{"size":1000}"#),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(ok.body.len(), 1000);
}

pub async fn single_tenant_handlers_run_and_replay() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"b"}"#;
    let first = send(&a.router, request("/batches/1", None, Some("k1"), body)).await;
    assert_eq!(
        first.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(first.body, b"closed batch 1");
    let again = send(&a.router, request("/batches/1", None, Some("k1"), body)).await;
    assert!(again.replayed());
    let tenant: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {TENANT_TEXT} FROM idempotency_requests"
    )))
    .fetch_one(&a.db.pool)
    .await
    .unwrap();
    assert_eq!(tenant, "*");
}

pub async fn the_concrete_path_and_query_are_part_of_the_request() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"b"}"#;
    let one = send(&a.router, request("/batches/1", None, Some("k1"), body)).await;
    assert_eq!(one.status, StatusCode::OK);
    // Same key and body on another path: a different request, not batch 1's answer.
    let two = send(&a.router, request("/batches/2", None, Some("k1"), body)).await;
    assert_eq!(two.status, StatusCode::UNPROCESSABLE_ENTITY);
    let query = send(
        &a.router,
        request("/batches/1?dry_run=1", None, Some("k1"), body),
    )
    .await;
    assert_eq!(query.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// Inside `Router::nest` the handler's URI has lost the prefix, and with it
/// the path's values; the client's path (axum's `OriginalUri`) is what is
/// fingerprinted, so the same key and body for another store is a mismatch,
/// not the first store's answer.
pub async fn a_nested_routes_full_path_is_part_of_the_request() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"n"}"#;
    let one = send(
        &a.router,
        request("/stores/1/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert_eq!(one.status, StatusCode::CREATED);
    let again = send(
        &a.router,
        request("/stores/1/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert!(again.replayed(), "a retry of the same path replays");
    let two = send(
        &a.router,
        request("/stores/2/widgets", Some("acme"), Some("k1"), body),
    )
    .await;
    assert_eq!(two.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn a_rejected_fallible_body_is_answered_before_the_claim() {
    let a = app(None, WAIT).await;
    // Spelled out, and behind an alias the attribute cannot read.
    for (n, route) in ["/fallible", "/fallible-alias"].into_iter().enumerate() {
        let bad = send(
            &a.router,
            request(route, Some("acme"), Some("k1"), r#"{"name":"#),
        )
        .await;
        // axum's own answer to the rejection, not the handler's (418).
        assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{route}");
        let no_json = send(&a.router, {
            let mut r = request(route, Some("acme"), Some("k1"), r#"{"name":"a"}"#);
            r.headers_mut().remove("content-type");
            r
        })
        .await;
        assert_eq!(
            no_json.status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{route}"
        );
        assert_eq!(
            a.db.count("SELECT count(*) FROM idempotency_requests")
                .await,
            n as i64,
            "{route}"
        );
        // Nothing was reserved: the corrected request with the same key executes,
        // and its retry replays.
        let ok = send(
            &a.router,
            request(route, Some("acme"), Some("k1"), r#"{"name":"a"}"#),
        )
        .await;
        assert_eq!(ok.status, StatusCode::CREATED, "{route}");
        assert!(!ok.replayed());
        let again = send(
            &a.router,
            request(route, Some("acme"), Some("k1"), r#"{ "name" : "a" }"#),
        )
        .await;
        assert!(again.replayed());
        assert_eq!(again.body, ok.body);
        assert_eq!(
            a.db.count("SELECT count(*) FROM widgets").await,
            n as i64 + 1
        );
    }
}

pub async fn an_optional_body_absent_and_present_are_different_requests() {
    let a = app(None, WAIT).await;
    let none = || {
        let mut r = request("/optional", Some("acme"), Some("k1"), "");
        r.headers_mut().remove("content-type");
        r
    };
    let first = send(&a.router, none()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.json()["name"], "default");
    assert!(send(&a.router, none()).await.replayed());
    let with_body = send(
        &a.router,
        request("/optional", Some("acme"), Some("k1"), r#"{"name":"a"}"#),
    )
    .await;
    assert_eq!(with_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    // With a body, the body's value identifies the request.
    let a1 = send(
        &a.router,
        request("/optional", Some("acme"), Some("k2"), r#"{"name":"a"}"#),
    )
    .await;
    assert_eq!(a1.status, StatusCode::CREATED);
    let b = send(
        &a.router,
        request("/optional", Some("acme"), Some("k2"), r#"{"name":"b"}"#),
    )
    .await;
    assert_eq!(b.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}

pub async fn a_body_behind_an_alias_is_fingerprinted() {
    let a = app(None, WAIT).await;
    let first = send(
        &a.router,
        request("/alias", Some("acme"), Some("k1"), r#"{"name":"a"}"#),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let same = send(
        &a.router,
        request("/alias", Some("acme"), Some("k1"), r#"{ "name": "a" }"#),
    )
    .await;
    assert!(same.replayed());
    let other = send(
        &a.router,
        request("/alias", Some("acme"), Some("k1"), r#"{"name":"b"}"#),
    )
    .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn a_bytes_body_is_fingerprinted_byte_for_byte() {
    let a = app(None, WAIT).await;
    let first = send(&a.router, request("/raw", Some("acme"), Some("k1"), "abc")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        send(&a.router, request("/raw", Some("acme"), Some("k1"), "abc"))
            .await
            .replayed()
    );
    // Bytes have no typed value: white space is a different request.
    let other = send(&a.router, request("/raw", Some("acme"), Some("k1"), "abc ")).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn ignore_body_leaves_the_body_out_as_written() {
    let a = app(None, WAIT).await;
    let tagged = |body: &str, color: &str| {
        let mut r = request("/tagged", Some("acme"), Some("k1"), body);
        r.headers_mut().insert("x-color", color.parse().unwrap());
        r
    };
    let first = send(&a.router, tagged(r#"{"name":"a"}"#, "red")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Another body, same header: the same request, by the handler's choice.
    let other_body = send(&a.router, tagged(r#"{"name":"b"}"#, "red")).await;
    assert!(other_body.replayed());
    assert_eq!(other_body.json()["name"], "a");
    let other_header = send(&a.router, tagged(r#"{"name":"a"}"#, "blue")).await;
    assert_eq!(other_header.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A tenant id holding a NUL (`%00` in a path tenant) is refused before the
/// claim as an invalid tenant (`500`, never "retry": every retry would fail
/// the same way), and nothing is written.
pub async fn a_tenant_id_with_a_nul_is_refused_before_the_claim() {
    let a = app(None, WAIT).await;
    let refused = send(
        &a.router,
        request("/orgs/a%00b/widgets", None, Some("k1"), r#"{"name":"a"}"#),
    )
    .await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(refused.json()["type"], "urn:idem:problem:invalid-tenant");
    assert!(refused.headers.get("retry-after").is_none());
    assert_eq!(
        a.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        0
    );
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 0);
}

pub async fn a_path_tenant_scopes_the_key() {
    let a = app(None, WAIT).await;
    let body = r#"{"name":"a"}"#;
    let acme = send(
        &a.router,
        request("/orgs/acme/widgets", None, Some("k1"), body),
    )
    .await;
    let globex = send(
        &a.router,
        request("/orgs/globex/widgets", None, Some("k1"), body),
    )
    .await;
    assert_eq!(acme.status, StatusCode::CREATED);
    assert_eq!(globex.status, StatusCode::CREATED);
    assert!(!globex.replayed());
    let tenants: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {TENANT_TEXT} FROM idempotency_requests ORDER BY tenant_id"
    )))
    .fetch_all(&a.db.pool)
    .await
    .unwrap();
    assert_eq!(tenants, ["acme", "globex"]);
}
