//! The documented metric names and labels are what the runtime records (a
//! debugging recorder, installed once for this test binary).

mod common;

use axum::Router;
use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use common::TestDb;
use http_body_util::BodyExt;
use idem_runtime::metrics as names;
use idem_runtime::{Idem, Lease, RunningLimit, TenantScope, Tx, idempotent};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use sqlx::Postgres;
use tower::ServiceExt;

struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Caller(
            parts
                .headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("acme")
                .to_owned(),
        ))
    }
}

impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[idempotent(operation = "metered-op", retention = "1h")]
async fn metered(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    body: String,
) -> Result<String, StatusCode> {
    sqlx::query("SELECT 1").execute(&mut **tx).await.unwrap();
    if body == "fail" {
        return Err(StatusCode::CONFLICT);
    }
    Ok(format!("done for {}: {body}", caller.0))
}

#[idempotent(operation = "labelled-op", retention = "1h")]
async fn labelled(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: String) -> String {
    let _ = tx;
    format!("{}:{body}", caller.0)
}

/// The gated handler says it is inside, then waits to be let go.
static ENTERED: tokio::sync::Notify = tokio::sync::Notify::const_new();
static RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[idempotent(operation = "gated-op", retention = "1h")]
async fn gated(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: String) -> String {
    let _ = tx;
    ENTERED.notify_one();
    RELEASE.notified().await;
    format!("{}:{body}", caller.0)
}

/// The leased handler with a running limit says it is inside, then waits.
static LIMITED_ENTERED: tokio::sync::Notify = tokio::sync::Notify::const_new();
static LIMITED_RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[idempotent(operation = "limited-op", retention = "1h", lease = "1s")]
async fn limited(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, body: String) -> String {
    let _ = lease;
    LIMITED_ENTERED.notify_one();
    LIMITED_RELEASE.notified().await;
    format!("{}:{body}", caller.0)
}

/// A long operation that says it is inside, then waits.
static LONG_ENTERED: tokio::sync::Notify = tokio::sync::Notify::const_new();
static LONG_RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[idempotent(operation = "long-op", retention = "1h", lease = "1s", accepted)]
async fn long(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, body: String) -> String {
    let _ = lease;
    LONG_ENTERED.notify_one();
    LONG_RELEASE.notified().await;
    format!("{}:{body}", caller.0)
}

/// The handler both executions of one key run at once (two processes) says
/// it is inside, then waits to be let go (the first to wait goes first).
static TAKEN_ENTERED: tokio::sync::Notify = tokio::sync::Notify::const_new();
static TAKEN_RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[idempotent(operation = "taken-op", retention = "1h")]
async fn taken(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: String) -> String {
    let _ = tx;
    TAKEN_ENTERED.notify_one();
    TAKEN_RELEASE.notified().await;
    format!("{}:{body}", caller.0)
}

/// A handler that panics after its claim executed.
#[idempotent(operation = "panicky-op", retention = "1h")]
async fn panicky(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: String) -> String {
    let _ = (caller, tx, body);
    panic!("the handler panics (on purpose)")
}

/// A long operation that panics in its work, after its `202`.
#[idempotent(operation = "doomed-op", retention = "1h", lease = "1s", accepted)]
async fn doomed(#[tenant] caller: Caller, lease: &mut Lease<Postgres>, body: String) -> String {
    let _ = (caller, lease, body);
    panic!("the long operation panics (on purpose)")
}

/// A handler that never finishes: its request ends at its deadline.
#[idempotent(operation = "stalled-op", retention = "1h")]
async fn stalled(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, body: String) -> String {
    let _ = (caller, tx, body);
    std::future::pending::<String>().await
}

async fn send(router: &Router, key: &str, tenant: &str, body: &str) -> (StatusCode, Vec<u8>) {
    let resp = router
        .clone()
        .oneshot(
            Request::post(if body.starts_with("label") {
                "/labelled"
            } else if body.starts_with("gated") {
                "/gated"
            } else if body.starts_with("limited") {
                "/limited"
            } else if body.starts_with("taken") {
                "/taken"
            } else if body.starts_with("stalled") {
                "/stalled"
            } else if body.starts_with("long") {
                "/long"
            } else if body.starts_with("panicky") {
                "/panicky"
            } else if body.starts_with("doomed") {
                "/doomed"
            } else {
                "/metered"
            })
            .header("idempotency-key", key)
            .header("x-tenant", tenant)
            .body(Body::from(body.to_owned()))
            .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status();
    (
        status,
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
}

type Labels = Vec<(String, String)>;

fn entries(snap: &Snapshotter) -> Vec<(String, Labels, DebugValue)> {
    snap.snapshot()
        .into_vec()
        .into_iter()
        .map(|(ck, _, _, v)| {
            let key = ck.key();
            let labels = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (key.name().to_owned(), labels, v)
        })
        .collect()
}

fn gauge(all: &[(String, Labels, DebugValue)], name: &str, operation: &str) -> f64 {
    let values: Vec<f64> = all
        .iter()
        .filter(|(n, labels, _)| {
            n == name && labels == &[("operation".to_owned(), operation.to_owned())]
        })
        .map(|(_, _, v)| match v {
            DebugValue::Gauge(g) => g.into_inner(),
            other => panic!("{name} is not a gauge: {other:?}"),
        })
        .collect();
    assert_eq!(values.len(), 1, "one {name} series for {operation}");
    values[0]
}

fn counter(all: &[(String, Labels, DebugValue)], name: &str, want: &[(&str, &str)]) -> u64 {
    all.iter()
        .filter(|(n, labels, _)| {
            n == name
                && want.len() == labels.len()
                && want
                    .iter()
                    .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, _, v)| match v {
            DebugValue::Counter(c) => *c,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .sum()
}

#[tokio::test]
async fn claims_and_completions_are_recorded_with_the_documented_names() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");

    let db = TestDb::new().await;
    let idem = Idem::new(db.pool.clone());
    let router = Router::new()
        .route("/metered", post(metered))
        .with_state(idem.clone())
        .merge(
            Router::new()
                .route("/labelled", post(labelled))
                .with_state(idem.clone().with_tenant_label(true)),
        )
        .merge(
            Router::new()
                .route("/gated", post(gated))
                .with_state(idem.clone()),
        )
        .merge(
            Router::new()
                .route("/long", post(long))
                .with_state(idem.clone()),
        )
        .merge(
            Router::new()
                .route("/panicky", post(panicky))
                .route("/doomed", post(doomed))
                .with_state(idem.clone()),
        )
        .merge(
            Router::new().route("/limited", post(limited)).with_state(
                idem.clone()
                    .with_running_limit("limited-op", RunningLimit::new(1))
                    .unwrap(),
            ),
        );

    let secret_key = "sk-very-secret-key";
    assert_eq!(
        send(&router, secret_key, "acme", "a").await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&router, secret_key, "acme", "a").await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&router, secret_key, "acme", "b").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        send(&router, "k2", "acme", "fail").await.0,
        StatusCode::CONFLICT
    );
    let (_, body) = send(&router, "k3", "acme", "c").await;
    assert_eq!(
        send(&router, "k4", "globex", "label").await.0,
        StatusCode::OK
    );

    let all = entries(&snap);
    let op = ("operation", "metered-op");
    assert_eq!(
        counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", "executed")]),
        3
    );
    assert_eq!(
        counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", "replayed")]),
        1
    );
    assert_eq!(
        counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", "mismatched")]),
        1
    );
    assert_eq!(
        counter(&all, names::COMPLETIONS_TOTAL, &[op, ("outcome", "stored")]),
        2
    );
    assert_eq!(
        counter(
            &all,
            names::COMPLETIONS_TOTAL,
            &[op, ("outcome", "rolled_back")]
        ),
        1
    );
    let stored = counter(&all, names::STORED_BYTES_TOTAL, &[op]);
    assert_eq!(stored, ("done for acme: a".len() + body.len()) as u64);
    for histogram in [names::CLAIM_SECONDS, names::COMPLETION_SECONDS] {
        assert!(
            all.iter().any(|(n, l, v)| n == histogram
                && l.contains(&("operation".into(), "metered-op".into()))
                && matches!(v, DebugValue::Histogram(h) if !h.is_empty())),
            "{histogram} recorded"
        );
    }
    // The tenant is a label only where the service asked for it.
    assert_eq!(
        counter(
            &all,
            names::CLAIMS_TOTAL,
            &[
                ("operation", "labelled-op"),
                ("outcome", "executed"),
                ("tenant", "globex")
            ]
        ),
        1
    );
    assert!(all.iter().all(|(n, l, _)| n != names::CLAIMS_TOTAL
        || l.iter().all(|(k, _)| k != "tenant")
        || l.contains(&("operation".into(), "labelled-op".into()))));
    // A duplicate that waited in the waiting room records its wait, as a
    // claim that waited in the database does.
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "w1", "acme", "gated").await }
    });
    ENTERED.notified().await;
    let duplicate = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "w1", "acme", "gated").await }
    });
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while idem.waiting_duplicates() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the duplicate waits in the waiting room");
    RELEASE.notify_one();
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!((first.0, duplicate.0), (StatusCode::OK, StatusCode::OK));
    assert_eq!(first.1, duplicate.1, "the duplicate replays the first");
    let all = entries(&snap);
    assert!(
        all.iter().any(|(n, l, v)| n == names::CLAIM_WAIT_SECONDS
            && l.contains(&("operation".into(), "gated-op".into()))
            && matches!(v, DebugValue::Histogram(h) if !h.is_empty())),
        "{} recorded for the waiting room",
        names::CLAIM_WAIT_SECONDS
    );

    // A running limit: the running count and the limit are gauges by
    // operation, and a refused first request is the claim outcome at_capacity.
    let running = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "l1", "acme", "limited").await }
    });
    LIMITED_ENTERED.notified().await;
    let all = entries(&snap);
    assert_eq!(gauge(&all, names::RUNNING_EXECUTIONS, "limited-op"), 1.0);
    assert_eq!(gauge(&all, names::RUNNING_LIMIT, "limited-op"), 1.0);
    assert_eq!(
        send(&router, "l2", "acme", "limited").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    LIMITED_RELEASE.notify_one();
    assert_eq!(running.await.unwrap().0, StatusCode::OK);
    let all = entries(&snap);
    assert_eq!(gauge(&all, names::RUNNING_EXECUTIONS, "limited-op"), 0.0);
    assert_eq!(
        counter(
            &all,
            names::CLAIMS_TOTAL,
            &[("operation", "limited-op"), ("outcome", "at_capacity")]
        ),
        1
    );

    // A long operation's retry while it runs is its `202`, counted as
    // `running`: the `in_flight` outcome is the `409`s alone.
    assert_eq!(
        send(&router, "o1", "acme", "long").await.0,
        StatusCode::ACCEPTED
    );
    LONG_ENTERED.notified().await;
    assert_eq!(
        send(&router, "o1", "acme", "long").await.0,
        StatusCode::ACCEPTED
    );
    LONG_RELEASE.notify_one();
    let all = entries(&snap);
    let op = ("operation", "long-op");
    let claims = |outcome| counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", outcome)]);
    assert_eq!(
        (claims("executed"), claims("running"), claims("in_flight")),
        (1, 1, 0)
    );

    // A handler that panics: its claim executed, and its completion is
    // counted as what it was.
    assert_eq!(
        send(&router, "p1", "acme", "panicky").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let all = entries(&snap);
    let op = ("operation", "panicky-op");
    assert_eq!(
        counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", "executed")]),
        1
    );
    assert_eq!(
        counter(
            &all,
            names::COMPLETIONS_TOTAL,
            &[op, ("outcome", "panicked")]
        ),
        1
    );
    // So does a long operation's work, after its `202`.
    assert_eq!(
        send(&router, "p2", "acme", "doomed").await.0,
        StatusCode::ACCEPTED
    );
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        idem.executions().drained(),
    )
    .await
    .expect("the work ends");
    let all = entries(&snap);
    assert_eq!(
        counter(
            &all,
            names::COMPLETIONS_TOTAL,
            &[("operation", "doomed-op"), ("outcome", "panicked")]
        ),
        1
    );

    // Two processes (two `Idem`s: no shared waiting room) execute one key at
    // once; the second finds it finished at commit, rolls back, and is
    // answered the first's outcome. Its claim counts once (executed), its
    // completion once (rolled back).
    let here = Router::new()
        .route("/taken", post(taken))
        .with_state(idem.clone());
    let there = Router::new()
        .route("/taken", post(taken))
        .with_state(Idem::new(db.pool.clone()));
    let first = tokio::spawn(async move { send(&here, "t1", "acme", "taken").await });
    TAKEN_ENTERED.notified().await;
    let second = tokio::spawn(async move { send(&there, "t1", "acme", "taken").await });
    TAKEN_ENTERED.notified().await;
    TAKEN_RELEASE.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.0, StatusCode::OK);
    TAKEN_RELEASE.notify_one();
    assert_eq!(
        second.await.unwrap(),
        first,
        "the second answers the first's outcome"
    );
    let all = entries(&snap);
    let op = ("operation", "taken-op");
    let claims = |outcome| counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", outcome)]);
    assert_eq!((claims("executed"), claims("replayed")), (2, 0));
    let completions =
        |outcome| counter(&all, names::COMPLETIONS_TOTAL, &[op, ("outcome", outcome)]);
    assert_eq!((completions("stored"), completions("rolled_back")), (1, 1));

    // The request deadline (a second: the in-flight wait of none, plus the
    // second it is never less than). Struck while the claim waits for a
    // connection (the pool's only one is held), it is the claim's outcome and
    // no completion; struck while the handler runs, the completion's.
    let small = TestDb::with_pool_size(1).await;
    let stalling = Router::new().route("/stalled", post(stalled)).with_state(
        Idem::new(small.pool.clone())
            .with_in_flight_wait(std::time::Duration::ZERO)
            .with_request_deadline(std::time::Duration::from_secs(1)),
    );
    let held = small.pool.acquire().await.unwrap();
    assert_eq!(
        send(&stalling, "d1", "acme", "stalled").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    drop(held);
    assert_eq!(
        send(&stalling, "d2", "acme", "stalled").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let all = entries(&snap);
    let op = ("operation", "stalled-op");
    let claims = |outcome| counter(&all, names::CLAIMS_TOTAL, &[op, ("outcome", outcome)]);
    assert_eq!((claims("deadline"), claims("executed")), (1, 1));
    let completions =
        |outcome| counter(&all, names::COMPLETIONS_TOTAL, &[op, ("outcome", outcome)]);
    assert_eq!(completions("deadline"), 1, "the claimed one only");

    // Never the raw key.
    assert!(
        all.iter()
            .all(|(_, l, _)| l.iter().all(|(_, v)| !v.contains(secret_key)))
    );
}
