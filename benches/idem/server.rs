//! The bench server (child process): the scenarios' routes on PostgreSQL (or
//! SQLite, MySQL; or leased mode's records in Redis, the insert on PostgreSQL).

use super::*;
use sqlx::Postgres;

/// Wakes the running long operations of (k) (`POST /bench/long/release`).
pub static LONG_RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// (k) long operations, stamped into each database's server: one that runs
/// until it is released, accepted with `202` at once, its 6 s lease renewed in
/// the background with the others'; the route that releases them all and waits
/// for their outcomes to be stored; and the server's renewal counters (batches
/// sent, lease renewals they carried).
macro_rules! long_operations {
    ($db:ident, $state:ty) => {
        #[idempotent(
            operation = "bench-export",
            retention = "1h",
            lease = "6s",
            lease_ceiling = "2h",
            accepted
        )]
        async fn long_export(#[tenant] caller: Caller, lease: &mut Lease<$db>) -> StatusCode {
            let _ = (caller, lease);
            crate::server::LONG_RELEASE.notified().await;
            StatusCode::CREATED
        }

        async fn renewals(State(app): State<$state>) -> Json<(u64, u64)> {
            Json(app.idem.renewal_statements())
        }

        /// Ends every running long operation and answers once all of them
        /// have stored their outcomes, so that what is measured next runs
        /// beside none of their work.
        async fn release_long(State(app): State<$state>) -> StatusCode {
            crate::server::LONG_RELEASE.notify_waiters();
            app.idem.executions().drained().await;
            StatusCode::NO_CONTENT
        }
    };
}

long_operations!(Postgres, AppState);

#[derive(Clone)]
pub struct AppState {
    idem: Idem<Postgres>,
    pool: PgPool,
    protocol: Option<Arc<Mutex<proxy::Stats>>>,
    /// The delay the proxy adds to every answer from PostgreSQL (zero: no proxy).
    rtt: Duration,
}

impl FromRef<AppState> for Idem<Postgres> {
    fn from_ref(s: &AppState) -> Idem<Postgres> {
        s.idem.clone()
    }
}

/// Demo auth, as in the example: `Authorization: Bearer <tenant>`.
pub struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| Caller(t.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

type ApiError = (StatusCode, String);

fn db_error(e: sqlx::Error) -> ApiError {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// (a) The business insert in one transaction, no idempotency.
async fn bare(
    caller: Caller,
    State(app): State<AppState>,
    Json(cmd): Json<NewOrder>,
) -> Result<Response, ApiError> {
    let mut tx = app.pool.begin().await.map_err(db_error)?;
    let order = insert_order(&mut *tx, &caller.0, &cmd)
        .await
        .map_err(db_error)?;
    tx.commit().await.map_err(db_error)?;
    Ok(created(order))
}

/// (b), (c), (e): the same insert under `#[idempotent]`, in the claim's transaction.
#[idempotent(operation = "create-order", retention = "24h")]
async fn idem_create(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<Response, ApiError> {
    let order = insert_order(&mut **tx, &caller.0, &cmd)
        .await
        .map_err(db_error)?;
    Ok(created(order))
}

/// (f) Leased mode: the claim commits on its own; the insert runs on the pool,
/// outside any transaction (as a downstream call would).
#[idempotent(operation = "create-order-leased", retention = "24h", lease = "30s")]
async fn leased_create(
    #[tenant] caller: Caller,
    lease: &mut Lease<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<Response, ApiError> {
    let order = insert_order(lease.pool(), &caller.0, &cmd)
        .await
        .map_err(db_error)?;
    Ok(created(order))
}

const MW_OPERATION: &str = "create-order";
const MW_RETENTION_MS: i64 = 24 * 3600 * 1000;
const MW_CLAIM: &str = "INSERT INTO mw_idempotency_requests \
        (tenant_id, operation, key_digest, fingerprint, state, created_at, expires_at) \
     VALUES ($1, $2, $3, $4, 'processing', now(), now() + $5 * interval '1 millisecond') \
     ON CONFLICT (tenant_id, operation, key_digest) DO NOTHING RETURNING generation";
const MW_LOOKUP: &str = "SELECT state, fingerprint, response_status, response_headers, response_body \
     FROM mw_idempotency_requests \
     WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";
const MW_COMPLETE: &str = "UPDATE mw_idempotency_requests \
        SET state = 'completed', response_status = $4, response_headers = $5, response_body = $6, \
            completed_at = clock_timestamp(), \
            expires_at = clock_timestamp() + $7 * interval '1 millisecond' \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 AND state = 'processing'";
const MW_RELEASE: &str = "DELETE FROM mw_idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 AND state = 'processing'";

fn problem(status: StatusCode, what: &str) -> Response {
    (status, what.to_owned()).into_response()
}

/// (d) What most idempotency middlewares do, written by hand with plain sqlx on a
/// table of idem's shape: the key claimed in its own transaction (one autocommit
/// `INSERT ... ON CONFLICT DO NOTHING`), the effect in a second transaction, the
/// completion in a third (one autocommit `UPDATE`). The request is fingerprinted
/// with idem's own builder, so the CPU work besides the database is the same.
/// Lean on purpose: no waiting for a concurrent duplicate, no expiry takeover.
async fn middleware(
    caller: Caller,
    State(app): State<AppState>,
    headers: HeaderMap,
    Json(cmd): Json<NewOrder>,
) -> Response {
    let Ok(key) = IdempotencyKey::from_headers(&headers) else {
        return problem(StatusCode::BAD_REQUEST, "bad key");
    };
    let fingerprint = match FingerprintBuilder::new(&caller.0, MW_OPERATION, "POST", "/mw/orders")
        .extra("path", "/mw/orders")
        .body(&cmd)
    {
        Ok(fp) => fp.finish(),
        Err(e) => return problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    // As idem does, the table holds the key's digest.
    let pk = (caller.0.as_str(), MW_OPERATION, key.digest());

    // 1. The claim, committed on its own.
    let claimed: Result<Option<i64>, _> = sqlx::query_scalar(MW_CLAIM)
        .bind(pk.0)
        .bind(pk.1)
        .bind(pk.2)
        .bind(&fingerprint.as_bytes()[..])
        .bind(MW_RETENTION_MS)
        .fetch_optional(&app.pool)
        .await;
    match claimed {
        Err(e) => return problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        Ok(Some(_)) => {}
        Ok(None) => return mw_existing(&app.pool, pk, fingerprint.as_bytes()).await,
    }

    // 2. The effect, in its own transaction.
    let effect = async {
        let mut tx = app.pool.begin().await?;
        let order = insert_order(&mut *tx, &caller.0, &cmd).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(order)
    }
    .await;
    let order = match effect {
        Ok(o) => o,
        Err(e) => {
            let _ = sqlx::query(MW_RELEASE)
                .bind(pk.0)
                .bind(pk.1)
                .bind(pk.2)
                .execute(&app.pool)
                .await;
            return problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string());
        }
    };

    // 3. The completion, in a third.
    let location = format!("/orders/{}", order.id);
    let body = match serde_json::to_vec(&order) {
        Ok(b) => b,
        Err(e) => return problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    let stored_headers = vec![
        ("content-type".to_owned(), "application/json".to_owned()),
        ("location".to_owned(), location.clone()),
    ];
    let done = sqlx::query(MW_COMPLETE)
        .bind(pk.0)
        .bind(pk.1)
        .bind(pk.2)
        .bind(201_i16)
        .bind(sqlx::types::Json(&stored_headers))
        .bind(&body[..])
        .bind(MW_RETENTION_MS)
        .execute(&app.pool)
        .await;
    if let Err(e) = done {
        // The effect happened and its record did not: the very window that a
        // one-transaction design closes. Answer it anyway, as middlewares do.
        eprintln!("mw: completion failed after the effect: {e}");
    }
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::LOCATION, location),
        ],
        body,
    )
        .into_response()
}

async fn mw_existing(
    pool: &PgPool,
    pk: (&str, &str, idem_runtime::KeyDigest),
    fingerprint: &[u8],
) -> Response {
    let row = sqlx::query(MW_LOOKUP)
        .bind(pk.0)
        .bind(pk.1)
        .bind(pk.2)
        .fetch_optional(pool)
        .await;
    let row = match row {
        Ok(Some(r)) => r,
        Ok(None) => return problem(StatusCode::CONFLICT, "released meanwhile; retry"),
        Err(e) => return problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    };
    let state: String = row.get("state");
    let stored_fp: Vec<u8> = row.get("fingerprint");
    if stored_fp != fingerprint {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "fingerprint mismatch");
    }
    if state != "completed" && state != "failed" {
        let mut r = problem(StatusCode::CONFLICT, "in flight");
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    }
    let status: i16 = row.get("response_status");
    let headers: sqlx::types::Json<Vec<(String, String)>> = row.get("response_headers");
    let body: Vec<u8> = row.get("response_body");
    idem_runtime::test_util::replay(idem_runtime::StoredResponse {
        status: u16::try_from(status).unwrap_or(500),
        headers: headers.0,
        body: body.into(),
    })
}

/// `GET /bench/protocol`: the counting proxy's totals (profile server only).
async fn protocol_handler(State(app): State<AppState>) -> Response {
    match &app.protocol {
        Some(stats) => {
            let snapshot = stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
            Json(snapshot).into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `GET /bench/delay`: how late the delaying proxy released its chunks (a server
/// with `IDEM_BENCH_DB_RTT_US` > 0 only).
async fn delay_handler(State(app): State<AppState>) -> Response {
    if app.rtt.is_zero() {
        return StatusCode::NOT_FOUND.into_response();
    }
    Json(proxy::delay_stats().report(app.rtt)).into_response()
}

/// The server's role: `IDEM_BENCH_BACKEND` picks PostgreSQL (the default) or the
/// SQLite file.
pub async fn main() -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // sqlx's slow-statement warnings (SQLite writers waiting for the lock)
            // would flood the driver's terminal; the latency columns show them.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx::query=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    install_metrics()?;
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let app = match std::env::var("IDEM_BENCH_BACKEND").as_deref() {
        Ok("sqlite") => sqlite::app(&url).await?,
        Ok("mysql") => mysql::app(&url).await?,
        Ok("redis") => redis_leases::app(&url).await?,
        _ => postgres_app(&url).await?,
    };
    serve(app).await
}

/// The PostgreSQL server: every scenario's routes, its pool straight to the
/// database or through the proxy (`IDEM_BENCH_PROXY=1` counts the protocol,
/// `IDEM_BENCH_DB_RTT_US` delays every answer from PostgreSQL).
async fn postgres_app(url: &str) -> Result<Router, String> {
    let pool_size: u32 = env_or("IDEM_BENCH_POOL", 32)?;
    let test_before_acquire: u8 = env_or("IDEM_BENCH_TEST_BEFORE_ACQUIRE", 1)?;
    let rtt = Duration::from_micros(env_or("IDEM_BENCH_DB_RTT_US", 0)?);
    let counting = std::env::var("IDEM_BENCH_PROXY").as_deref() == Ok("1");

    let mut opts: sqlx::postgres::PgConnectOptions = url
        .parse()
        .map_err(|e| format!("DATABASE_URL does not parse: {e}"))?;
    let protocol = counting.then(|| Arc::new(Mutex::new(proxy::Stats::default())));
    if counting || !rtt.is_zero() {
        let upstream = format!("{}:{}", opts.get_host(), opts.get_port());
        let options = proxy::Options {
            stats: protocol.clone(),
            rtt,
        };
        let addr = proxy::start(upstream, options).map_err(|e| format!("proxy: {e}"))?;
        opts = opts
            .host(&addr.ip().to_string())
            .port(addr.port())
            .ssl_mode(sqlx::postgres::PgSslMode::Disable);
    }
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .test_before_acquire(test_before_acquire != 0)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;

    // Replay hints (on by default): (c) replays keys this server finished, so
    // with them on it measures a retry that reaches the process that answered;
    // `IDEM_BENCH_REPLAY_HINTS=2` one that reaches another replica (hints on,
    // no key remembered), `IDEM_BENCH_REPLAY_HINTS=0` one with hints off.
    let replay_hints: u8 = env_or("IDEM_BENCH_REPLAY_HINTS", 1)?;
    // The checkout test (on by default): `IDEM_BENCH_CHECKOUT_TEST=0` measures
    // a first execution whose first message is its connection's test.
    let checkout_test: u8 = env_or("IDEM_BENCH_CHECKOUT_TEST", 1)?;
    let idem = Idem::new(pool.clone())
        .with_replay_hints(replay_hints != 0)
        .with_checkout_test(checkout_test != 0);
    let state = AppState {
        idem: if replay_hints == 2 {
            idem_runtime::test_util::as_another_replica(idem)
        } else {
            idem
        },
        pool,
        protocol,
        rtt,
    };
    // (i): the same handler with the opt-in replay cache. Kept an hour, not the
    // one minute the README suggests, so the keys prepared before the run stay
    // cached through every slice of it.
    let cached = AppState {
        idem: Idem::new(state.pool.clone()).with_replay_cache(ReplayCache::new(
            64 * 1024 * 1024,
            Duration::from_secs(3600),
        )),
        ..state.clone()
    };
    let cached = Router::new()
        .route("/cached/orders", post(idem_create))
        .with_state(cached);
    // (s), (t): (b) and (c) with every answer sealed at rest.
    let ring = idem_runtime::KeyRing::new(
        "bench",
        [("bench", idem_runtime::at_rest::Zeroizing::new(vec![7; 32]))],
    )
    .map_err(|e| format!("key ring: {e}"))?;
    let sealed = AppState {
        idem: Idem::new(state.pool.clone()).with_key_ring(ring),
        ..state.clone()
    };
    let sealed = Router::new()
        .route("/sealed/orders", post(idem_create))
        .with_state(sealed);
    Ok(Router::new()
        .route("/bare/orders", post(bare))
        .route("/idem/orders", post(idem_create))
        .route("/mw/orders", post(middleware))
        .route("/leased/orders", post(leased_create))
        .route("/long/exports", post(long_export))
        .route("/bench/renewals", get(renewals))
        .route("/bench/long/release", post(release_long))
        .merge(peer::routes())
        .route("/bench/protocol", get(protocol_handler))
        .route("/bench/delay", get(delay_handler))
        .with_state(state)
        .merge(cached)
        .merge(sealed))
}

/// `IDEM_BENCH_METRICS`: the Prometheus recorder as a service runs it (upkeep every
/// 5 s, the default), without upkeep, or none.
fn install_metrics() -> Result<(), String> {
    match std::env::var("IDEM_BENCH_METRICS")
        .unwrap_or_default()
        .as_str()
    {
        "off" => {}
        // What examples/orders did before e517087: install_recorder, and nobody
        // drains the histograms unless /metrics is scraped.
        "no-upkeep" => {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .map_err(|e| e.to_string())?;
        }
        "" | "prometheus" => {
            // As the README advises: idem's histograms with fixed buckets (the
            // exporter's default summaries made RSS creep, BENCHMARKS.md "Memory").
            let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Prefix("idem_".to_owned()),
                    idem_runtime::metrics::SECONDS_BUCKETS,
                )
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| e.to_string())?;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    handle.run_upkeep();
                }
            });
        }
        other => {
            return Err(format!(
                "IDEM_BENCH_METRICS={other:?}: off, prometheus or no-upkeep"
            ));
        }
    }
    Ok(())
}

/// Listens on `127.0.0.1:0`, tells the driver where (stdout), and serves until the
/// driver closes our stdin (it is done, or died).
async fn serve(app: Router) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{LISTENING} {addr}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 64];
        while let Ok(n) = std::io::stdin().read(&mut buf) {
            if n == 0 {
                break;
            }
        }
        let _ = gone_tx.send(());
    });
    let parent_gone = async {
        let _ = gone_rx.await;
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(parent_gone)
        .await
        .map_err(|e| e.to_string())
}

/// Scenario (g), the peer: `axum-idempotent` on the bare handler (the insert in
/// its own transaction, as (a)), set up as its README shows: direct-key mode on the
/// `Idempotency-Key` header (required), responses cached for 5 minutes, a ruts
/// `SessionLayer` (cookie `session`) over an in-memory `MokaStore`, tower-cookies'
/// `CookieManagerLayer` outermost. The middleware caches only for a request that
/// already carries a session and never creates one, so a client first calls
/// `POST /peer/session` (outside the idempotency layer) for its cookie.
mod peer {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::Ttl;
    use ruts::store::moka::MokaStore;
    use ruts::{CookieOptions, Session, SessionLayer};
    use tower_cookies::CookieManagerLayer;

    use super::*;

    pub fn routes() -> Router<AppState> {
        let store = Arc::new(MokaStore::builder().build());
        let options = IdempotentOptions::default()
            .use_idempotency_key_header(Some("Idempotency-Key"), true)
            .expire_after(60 * 5);
        Router::new()
            .route("/peer/orders", post(bare))
            .layer(IdempotentLayer::<MokaStore>::new(options))
            .route("/peer/session", post(open_session))
            .layer(
                SessionLayer::new(store)
                    .with_cookie_options(CookieOptions::build().name("session")),
            )
            .layer(CookieManagerLayer::new())
    }

    /// Writes a field, which makes ruts create the session and set its cookie.
    async fn open_session(session: Session<MokaStore>) -> Response {
        let ttl = Ttl::new(3600).expect("a valid TTL");
        match session.set("client", &true, ttl, None).await {
            Ok(()) => StatusCode::NO_CONTENT.into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        }
    }
}

/// The SQLite server, scenarios (a), (b), (c) and (e): the same handlers on a
/// SQLite file in WAL mode, `Idem<Sqlite>` and `Tx<Sqlite>`.
mod sqlite {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    use sqlx::{Sqlite, SqlitePool};

    use super::*;

    #[derive(Clone)]
    struct SqliteState {
        idem: Idem<Sqlite>,
        pool: SqlitePool,
    }

    impl FromRef<SqliteState> for Idem<Sqlite> {
        fn from_ref(s: &SqliteState) -> Idem<Sqlite> {
            s.idem.clone()
        }
    }

    /// `IDEM_BENCH_SQLITE_POOL` (8, as `examples/orders`) connections, WAL, the
    /// example's busy timeout of 5 s.
    pub async fn app(url: &str) -> Result<Router, String> {
        let pool_size: u32 = env_or("IDEM_BENCH_SQLITE_POOL", 8)?;
        let test_before_acquire: u8 = env_or("IDEM_BENCH_TEST_BEFORE_ACQUIRE", 1)?;
        let opts: SqliteConnectOptions = url
            .parse()
            .map_err(|e| format!("DATABASE_URL does not parse: {e}"))?;
        let pool = SqlitePoolOptions::new()
            .max_connections(pool_size)
            .test_before_acquire(test_before_acquire != 0)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(
                opts.journal_mode(SqliteJournalMode::Wal)
                    .busy_timeout(Duration::from_secs(5)),
            )
            .await
            .map_err(|e| format!("cannot open {url}: {e}"))?;
        let state = SqliteState {
            idem: Idem::new(pool.clone()),
            pool,
        };
        Ok(Router::new()
            .route("/bare/orders", post(bare))
            .route("/idem/orders", post(idem_create))
            .route("/long/exports", post(long_export))
            .route("/bench/renewals", get(renewals))
            .route("/bench/long/release", post(release_long))
            .with_state(state))
    }

    long_operations!(Sqlite, SqliteState);

    /// (a) on SQLite.
    async fn bare(
        caller: Caller,
        State(app): State<SqliteState>,
        Json(cmd): Json<NewOrder>,
    ) -> Result<Response, ApiError> {
        let mut tx = app.pool.begin().await.map_err(db_error)?;
        let order = insert_order_sqlite(&mut *tx, &caller.0, &cmd)
            .await
            .map_err(db_error)?;
        tx.commit().await.map_err(db_error)?;
        Ok(created(order))
    }

    /// (b), (c), (e) on SQLite.
    #[idempotent(operation = "create-order", retention = "24h")]
    async fn idem_create(
        #[tenant] caller: Caller,
        tx: &mut Tx<Sqlite>,
        Json(cmd): Json<NewOrder>,
    ) -> Result<Response, ApiError> {
        let order = insert_order_sqlite(&mut **tx, &caller.0, &cmd)
            .await
            .map_err(db_error)?;
        Ok(created(order))
    }
}

/// The MySQL / MariaDB server, scenarios (a), (b), (c) and (e): the same
/// handlers on InnoDB, `Idem<MySql>` and `Tx<MySql>`.
mod mysql {
    use sqlx::mysql::MySqlPoolOptions;
    use sqlx::{MySql, MySqlPool};

    use super::*;

    #[derive(Clone)]
    struct MySqlState {
        idem: Idem<MySql>,
        pool: MySqlPool,
    }

    impl FromRef<MySqlState> for Idem<MySql> {
        fn from_ref(s: &MySqlState) -> Idem<MySql> {
            s.idem.clone()
        }
    }

    /// `IDEM_BENCH_POOL` (32) connections, as on PostgreSQL.
    pub async fn app(url: &str) -> Result<Router, String> {
        let pool_size: u32 = env_or("IDEM_BENCH_POOL", 32)?;
        let test_before_acquire: u8 = env_or("IDEM_BENCH_TEST_BEFORE_ACQUIRE", 1)?;
        let pool = MySqlPoolOptions::new()
            .max_connections(pool_size)
            .test_before_acquire(test_before_acquire != 0)
            .acquire_timeout(Duration::from_secs(30))
            .connect(url)
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        let state = MySqlState {
            idem: Idem::new(pool.clone()),
            pool,
        };
        Ok(Router::new()
            .route("/bare/orders", post(bare))
            .route("/idem/orders", post(idem_create))
            .route("/long/exports", post(long_export))
            .route("/bench/renewals", get(renewals))
            .route("/bench/long/release", post(release_long))
            .with_state(state))
    }

    long_operations!(MySql, MySqlState);

    /// (a) on MySQL: the server's default isolation (REPEATABLE READ), as an
    /// application's plain transaction would have it.
    async fn bare(
        caller: Caller,
        State(app): State<MySqlState>,
        Json(cmd): Json<NewOrder>,
    ) -> Result<Response, ApiError> {
        let mut tx = app.pool.begin().await.map_err(db_error)?;
        let order = insert_order_mysql(&mut tx, &caller.0, &cmd)
            .await
            .map_err(db_error)?;
        tx.commit().await.map_err(db_error)?;
        Ok(created(order))
    }

    /// (b), (c), (e) on MySQL.
    #[idempotent(operation = "create-order", retention = "24h")]
    async fn idem_create(
        #[tenant] caller: Caller,
        tx: &mut Tx<MySql>,
        Json(cmd): Json<NewOrder>,
    ) -> Result<Response, ApiError> {
        let order = insert_order_mysql(tx, &caller.0, &cmd)
            .await
            .map_err(db_error)?;
        Ok(created(order))
    }
}

/// Leased mode with its records in Redis (scenarios (f) and (j)): one server
/// (`IDEM_BENCH_REDIS_URL`) or a Redis Cluster (`IDEM_BENCH_REDIS_CLUSTER`,
/// `host:port,...`), optionally with `WAIT` after each state change
/// (`IDEM_BENCH_REDIS_ACKS=<replicas>:<ms>`), every key under
/// `IDEM_BENCH_REDIS_PREFIX`. The insert runs on PostgreSQL (`DATABASE_URL`,
/// RTT 0), outside any transaction, as in (f).
mod redis_leases {
    use idem_runtime::redis::{Redis, RedisLeaseStore};

    use super::*;

    #[derive(Clone)]
    struct RedisState {
        idem: Idem<Redis>,
        pool: PgPool,
    }

    impl FromRef<RedisState> for Idem<Redis> {
        fn from_ref(s: &RedisState) -> Idem<Redis> {
            s.idem.clone()
        }
    }

    pub async fn app(pg_url: &str) -> Result<Router, String> {
        let pool_size: u32 = env_or("IDEM_BENCH_POOL", 32)?;
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            .acquire_timeout(Duration::from_secs(30))
            .connect(pg_url)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let prefix: String = env_or("IDEM_BENCH_REDIS_PREFIX", "idem-bench".to_owned())?;
        let cluster: String = env_or("IDEM_BENCH_REDIS_CLUSTER", String::new())?;
        let mut store = if cluster.is_empty() {
            let url: String = env_or("IDEM_BENCH_REDIS_URL", "redis://127.0.0.1:6379".to_owned())?;
            RedisLeaseStore::connect_with_prefix(&url, &prefix).await
        } else {
            let nodes: Vec<String> = cluster
                .split(',')
                .map(|n| format!("redis://{}", n.trim()))
                .collect();
            RedisLeaseStore::connect_cluster_with_prefix(nodes, &prefix).await
        }
        .map_err(|e| format!("redis: {e}"))?;
        let acks: String = env_or("IDEM_BENCH_REDIS_ACKS", String::new())?;
        if let Some((replicas, ms)) = acks.split_once(':') {
            let replicas = replicas
                .parse()
                .map_err(|_| format!("IDEM_BENCH_REDIS_ACKS={acks:?}: <replicas>:<ms>"))?;
            let ms = ms
                .parse()
                .map_err(|_| format!("IDEM_BENCH_REDIS_ACKS={acks:?}: <replicas>:<ms>"))?;
            store = store
                .with_replica_acks(replicas, Duration::from_millis(ms))
                .map_err(|e| e.to_string())?;
        }
        let state = RedisState {
            idem: store.idem(),
            pool,
        };
        Ok(Router::new()
            .route("/leased/orders", post(leased_create))
            .route("/long/exports", post(long_export))
            .route("/bench/renewals", get(renewals))
            .route("/bench/long/release", post(release_long))
            .with_state(state))
    }

    long_operations!(Redis, RedisState);

    /// (f), (j) with the lease in Redis: the same insert as (f), on the pool (the
    /// lease is only held: an insert needs no downstream key).
    #[idempotent(operation = "create-order-leased", retention = "24h", lease = "30s")]
    async fn leased_create(
        #[tenant] caller: Caller,
        State(app): State<RedisState>,
        _lease: &mut Lease<Redis>,
        Json(cmd): Json<NewOrder>,
    ) -> Result<Response, ApiError> {
        let order = insert_order(&app.pool, &caller.0, &cmd)
            .await
            .map_err(db_error)?;
        Ok(created(order))
    }
}
