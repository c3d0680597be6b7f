//! Every test of the replay cache, written once against the enclosing
//! database module's `Db` (its sqlx database), `TestDb` (a fresh database of
//! that kind), `WIDGETS_DDL` and `INSERT_WIDGET` (the widgets table and its
//! insert in that database's SQL). `tests/replay_cache.rs` mounts this file in
//! each database's module and stamps a `#[tokio::test]` wrapper per test there.

use super::*;

#[derive(Clone)]
struct AppState {
    idem: Idem<Db>,
}

impl FromRef<AppState> for Idem<Db> {
    fn from_ref(s: &AppState) -> Idem<Db> {
        s.idem.clone()
    }
}

async fn insert_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) {
    sqlx::query(INSERT_WIDGET)
        .bind(tenant)
        .bind(name)
        .execute(&mut **tx)
        .await
        .unwrap();
}

#[idempotent(operation = "create-widget", retention = "1h")]
async fn create_widget(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> impl IntoResponse {
    insert_widget(tx, &caller.0, &w.name).await;
    (
        StatusCode::CREATED,
        [("location", "/widgets/1")],
        format!("{}:{}", w.name, "x".repeat(w.size)),
    )
}

/// Kept for 300 ms: long enough for a request to finish on a loaded
/// machine, short enough to wait out.
#[idempotent(operation = "create-brief", retention = "300ms")]
async fn create_brief(
    #[tenant] caller: Caller,
    tx: &mut Tx<Db>,
    Json(w): Json<NewWidget>,
) -> impl IntoResponse {
    insert_widget(tx, &caller.0, &w.name).await;
    (StatusCode::CREATED, w.name)
}

struct App {
    db: TestDb,
    router: Router,
    idem: Idem<Db>,
}

async fn app(cache: Option<ReplayCache>) -> App {
    let db = TestDb::new().await;
    db.exec(WIDGETS_DDL).await;
    let mut idem = Idem::new(db.pool.clone());
    if let Some(cache) = cache {
        idem = idem.with_replay_cache(cache);
    }
    let router = Router::new()
        .route("/widgets", post(create_widget))
        .route("/briefs", post(create_brief))
        .with_state(AppState { idem: idem.clone() });
    App { db, router, idem }
}

fn cache() -> ReplayCache {
    ReplayCache::new(1024 * 1024, Duration::from_secs(60))
}

async fn send(
    app: &App,
    path: &str,
    key: &str,
    name: &str,
    size: usize,
) -> (StatusCode, bool, axum::http::HeaderMap, Bytes) {
    let body = serde_json::to_string(&NewWidget {
        name: name.into(),
        size,
    })
    .unwrap();
    let req = Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap();
    let resp = app.router.clone().oneshot(req).await.unwrap();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        replayed,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

/// `k1` answered, then replayed (from the cache, which now holds it).
async fn answer_and_replay_k1(a: &App) {
    assert_eq!(
        send(a, "/widgets", "k1", "bolt", 0).await.0,
        StatusCode::CREATED
    );
    let replayed = send(a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!((replayed.0, replayed.1), (StatusCode::CREATED, true));
}

async fn forget_every_key(app: &App) {
    app.db.exec("DELETE FROM idempotency_requests").await;
}

pub async fn a_cached_replay_needs_no_row_and_is_byte_identical() {
    let a = app(Some(cache())).await;
    let first = send(&a, "/widgets", "k1", "bolt", 10).await;
    assert_eq!(first.0, StatusCode::CREATED);
    // What the database would have answered, before the row goes.
    let from_db = send(&a, "/widgets", "k1", "bolt", 10).await;
    forget_every_key(&a).await;
    let cached = send(&a, "/widgets", "k1", "bolt", 10).await;
    assert_eq!((cached.0, cached.1), (StatusCode::CREATED, true));
    assert_eq!(cached.3, first.3);
    assert_eq!(cached.3, from_db.3);
    assert_eq!(
        cached.2, from_db.2,
        "headers differ from the database's replay"
    );
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

/// After the database lost outcomes (a failover with asynchronous
/// replication, modelled by deleting the rows), a cleared cache stops
/// replaying them: the next request asks the database and executes.
pub async fn a_cleared_cache_answers_from_the_database_again() {
    let a = app(Some(cache())).await;
    assert_eq!(
        send(&a, "/widgets", "k1", "bolt", 0).await.0,
        StatusCode::CREATED
    );
    forget_every_key(&a).await;
    let cached = send(&a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!((cached.0, cached.1), (StatusCode::CREATED, true));
    a.idem.clear_replay_cache();
    let again = send(&a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!((again.0, again.1), (StatusCode::CREATED, false));
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}

/// Erasing the tenant through `Idem::erase_tenant` deletes its rows and
/// forgets this process's cached answers with them: the next request under a
/// key it had answered executes anew, from neither the cache nor the database.
pub async fn erasing_the_tenant_forgets_its_cached_answers() {
    let a = app(Some(cache())).await;
    answer_and_replay_k1(&a).await;
    let erased = a.idem.erase_tenant("acme").await.unwrap();
    assert_eq!((erased.erased, erased.left), (1, 0));
    let again = send(&a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!((again.0, again.1), (StatusCode::CREATED, false));
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}

/// An erasure dropped part-way (a request timeout around an admin endpoint)
/// has committed the batches it ran: the answers they deleted must not stay in
/// the cache, or a retry would be replayed here and executed elsewhere. The
/// erasure is stepped by hand and dropped the moment its batch has committed
/// (it still has its count of what is left to run).
pub async fn an_erasure_dropped_part_way_leaves_no_cached_answer() {
    let a = app(Some(cache())).await;
    answer_and_replay_k1(&a).await;
    let rows = "SELECT count(*) FROM idempotency_requests";
    {
        let mut erasure = std::pin::pin!(a.idem.erase_tenant("acme"));
        while a.db.count(rows).await > 0 {
            let step = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(erasure.as_mut().poll(cx).is_ready())
            })
            .await;
            assert!(!step, "the erasure ended before its batch was seen");
            tokio::task::yield_now().await;
        }
    }
    let again = send(&a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!(
        (again.0, again.1),
        (StatusCode::CREATED, false),
        "a cached answer outlived its erased row"
    );
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}

pub async fn a_cached_key_refuses_another_request() {
    let a = app(Some(cache())).await;
    assert_eq!(
        send(&a, "/widgets", "k1", "bolt", 0).await.0,
        StatusCode::CREATED
    );
    forget_every_key(&a).await;
    let other = send(&a, "/widgets", "k1", "nut", 0).await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 1);
}

pub async fn without_a_cache_every_answer_comes_from_the_database() {
    let a = app(None).await;
    assert_eq!(
        send(&a, "/widgets", "k1", "bolt", 0).await.0,
        StatusCode::CREATED
    );
    forget_every_key(&a).await;
    let again = send(&a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!((again.0, again.1), (StatusCode::CREATED, false));
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}

pub async fn an_answer_too_large_for_the_cache_is_not_kept() {
    let a = app(Some(ReplayCache::new(8 * 1024, Duration::from_secs(60)))).await;
    assert_eq!(
        send(&a, "/widgets", "big", "bolt", 2000).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&a, "/widgets", "small", "nut", 10).await.0,
        StatusCode::CREATED
    );
    forget_every_key(&a).await;
    let big = send(&a, "/widgets", "big", "bolt", 2000).await;
    assert!(!big.1, "a 2 KB answer was cached in an 8 KB cache");
    let small = send(&a, "/widgets", "small", "nut", 10).await;
    assert!(small.1, "a small answer was not cached");
}

pub async fn a_purge_elsewhere_is_seen_once_max_age_has_passed() {
    // Long enough that the first retry below comes well inside it, on a slow
    // machine too.
    let max_age = Duration::from_secs(3);
    let a = app(Some(ReplayCache::new(1024 * 1024, max_age))).await;
    let started = std::time::Instant::now();
    assert_eq!(
        send(&a, "/widgets", "k1", "bolt", 0).await.0,
        StatusCode::CREATED
    );
    forget_every_key(&a).await;
    // The row is gone: a replay now can only be the cache's.
    let first = send(&a, "/widgets", "k1", "bolt", 0).await;
    assert_eq!(
        (first.0, first.1),
        (StatusCode::CREATED, true),
        "not cached"
    );
    // Replayed from the cache until max_age passes (bounded wait), then the
    // key is free again and executes anew.
    loop {
        let r = send(&a, "/widgets", "k1", "bolt", 0).await;
        assert_eq!(r.0, StatusCode::CREATED);
        if !r.1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the purged key was still replayed long after max_age"
        );
        // A poll interval: what is awaited is the condition above.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        started.elapsed() >= max_age,
        "the cache forgot before max_age"
    );
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}

pub async fn a_cached_answer_never_outlives_its_rows_retention() {
    let a = app(Some(cache())).await;
    assert_eq!(
        send(&a, "/briefs", "k1", "a", 0).await.0,
        StatusCode::CREATED
    );
    // Wait (bounded) until the database itself takes the row as expired.
    let expired = TestDb::expired_sql();
    let mut waited = Duration::ZERO;
    while a.db.count(expired).await == 0 {
        assert!(waited < Duration::from_secs(10), "the row never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    }
    // The cache must not answer any more: the key executes anew.
    let again = send(&a, "/briefs", "k1", "a", 0).await;
    assert_eq!((again.0, again.1), (StatusCode::CREATED, false));
    assert_eq!(a.db.count("SELECT count(*) FROM widgets").await, 2);
}
