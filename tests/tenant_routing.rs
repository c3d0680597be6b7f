//! Every statement idem sends on a request's path names the tenant, so that a
//! tenant-distributed PostgreSQL (Citus, `idempotency_requests` distributed by
//! `tenant_id` and co-located with the application's tenant tables) can route
//! it to the one shard that holds the tenant, in the same transaction as the
//! handler's own statements (ARCHITECTURE.md, "A tenant-distributed
//! PostgreSQL").
//!
//! No distributed PostgreSQL can be installed here, so the check is made over
//! what idem actually sends: a proxy in front of PostgreSQL records the text of
//! every statement (the simple-query `Query` messages and the extended
//! protocol's `Parse` messages), while requests run every path a request can
//! take: the handler's path claiming at commit and claiming first, a replay, a
//! mismatch, a leased first execution and its replay, a long operation and the
//! reads of its resource, and the lease API by hand (claim, renew, store, mark
//! uncertain, release).

mod common;

use sqlx::Postgres;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idem_runtime::{
    FingerprintBuilder, Idem, IdempotencyKey, Lease, LeaseRequest, LeasedClaim, StoredResponse, Tx,
    claim_leased, idempotent,
};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use common::TestDb;
use common::caller::Caller;

/// A TCP proxy in front of PostgreSQL that keeps the SQL text of every
/// statement the clients send.
struct Recorder {
    port: u16,
    statements: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let statements = Arc::new(Mutex::new(Vec::new()));
        let kept = statements.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let server = TcpStream::connect("127.0.0.1:5432").await.unwrap();
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    tokio::spawn(async move {
                        let mut frames = Frames::default();
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            let sql = frames.feed(&buf[..n]);
                            kept.lock().unwrap().extend(sql);
                            if sw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    });
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
            }
        });
        Recorder { port, statements }
    }

    /// A pool whose connections go through the proxy.
    async fn pool(&self, db: &TestDb) -> PgPool {
        let opts = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database(&db.name)
            .ssl_mode(PgSslMode::Disable);
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .unwrap()
    }

    fn statements(&self) -> Vec<String> {
        self.statements.lock().unwrap().clone()
    }
}

/// The client's side of the PostgreSQL protocol, cut into messages: the first
/// is the untyped startup message, every later one a type byte and a length.
#[derive(Default)]
struct Frames {
    pending: Vec<u8>,
    started: bool,
}

impl Frames {
    /// The SQL texts of the `Query` and `Parse` messages completed by `bytes`.
    fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut sql = Vec::new();
        loop {
            let (kind, header) = if self.started {
                match self.pending.first() {
                    Some(&k) => (Some(k), 1),
                    None => break,
                }
            } else {
                (None, 0)
            };
            if self.pending.len() < header + 4 {
                break;
            }
            let len = u32::from_be_bytes(self.pending[header..header + 4].try_into().unwrap());
            let total = header + len as usize;
            if self.pending.len() < total {
                break;
            }
            let body = &self.pending[header + 4..total];
            match kind {
                // Query: the text, NUL-terminated.
                Some(b'Q') => sql.push(c_str(body)),
                // Parse: the statement's name, then its text.
                Some(b'P') => {
                    let name_end = body.iter().position(|&b| b == 0).unwrap();
                    sql.push(c_str(&body[name_end + 1..]));
                }
                _ => {}
            }
            self.started = true;
            self.pending.drain(..total);
        }
        sql
    }
}

fn c_str(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Whether a statement of idem's routes by the tenant: its `WHERE` pins
/// `tenant_id` to a parameter, or it inserts a row with its `tenant_id` (also in
/// a data-modifying `WITH`), or it calls one of idem's functions, whose first
/// argument is the tenant (Citus delegates such a call to the tenant's shard
/// once the function is distributed by that argument, co-located with the
/// table). A statement prepared in the session is judged by its body: each
/// `EXECUTE` of it passes the tenant as its first parameter.
fn names_the_tenant(sql: &str) -> bool {
    let s = sql.to_ascii_lowercase();
    let s = match s.strip_prefix("prepare ").or(s.strip_prefix("idem_")) {
        Some(rest) => rest.split_once(") as ").map_or(rest, |(_, body)| body),
        None => &s,
    };
    let s = s.strip_prefix("with ins as ( ").unwrap_or(s);
    s.match_indices("tenant_id = $")
        .any(|(at, m)| s[at + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
        || (s.starts_with("insert into idempotency_requests") && s.contains("(tenant_id,"))
        || s.contains("from idem_claim($1,")
        || s.contains("from idem_claim_leased($1,")
}

/// Whether a statement touches idem's table or calls one of its functions (the
/// handler's own statements, `BEGIN`, `COMMIT` and the transaction's settings do
/// neither).
fn is_idems(sql: &str) -> bool {
    let s = sql.to_ascii_lowercase();
    s.contains("idempotency_requests") || s.contains("idem_claim")
}

#[idempotent(operation = "create-widget", retention = "1h")]
async fn create_widget(
    #[tenant] caller: Caller,
    State(_): State<Idem<Postgres>>,
    tx: &mut Tx<Postgres>,
    axum::Json(w): axum::Json<serde_json::Value>,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    sqlx::query("INSERT INTO widgets (tenant, name) VALUES ($1, $2)")
        .bind(&caller.0)
        .bind(w["name"].as_str().unwrap_or_default())
        .execute(&mut **tx)
        .await
        .unwrap();
    (StatusCode::CREATED, axum::Json(json!({"name": w["name"]})))
}

#[idempotent(operation = "create-payment", retention = "1h", lease = "1s")]
async fn create_payment(
    #[tenant] _caller: Caller,
    State(_): State<Idem<Postgres>>,
    _lease: &mut Lease<Postgres>,
    axum::Json(p): axum::Json<serde_json::Value>,
) -> Response {
    (
        StatusCode::CREATED,
        axum::Json(json!({"paid": p["amount"]})),
    )
        .into_response()
}

#[idempotent(operation = "create-export", retention = "1h", lease = "1s", accepted)]
async fn create_export(
    #[tenant] _caller: Caller,
    State(_): State<Idem<Postgres>>,
    _lease: &mut Lease<Postgres>,
    axum::Json(e): axum::Json<serde_json::Value>,
) -> Response {
    (StatusCode::CREATED, axum::Json(e)).into_response()
}

fn request(path: &str, key: &str, body: serde_json::Value) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", key)
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn send(router: &Router, req: Request<Body>) -> StatusCode {
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    resp.into_body().collect().await.unwrap();
    status
}

fn created() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: "{}".into(),
    }
}

#[tokio::test]
async fn every_statement_idem_sends_on_a_requests_path_names_the_tenant() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE widgets (id bigserial PRIMARY KEY, tenant text NOT NULL, name text NOT NULL)",
    )
    .await;
    let recorder = Recorder::start().await;
    let pool = recorder.pool(&db).await;

    // Claims at commit on both PostgreSQL paths (statements prepared in the
    // session, and bound parameters), and claims first.
    for (at_commit, session) in [(true, true), (true, false), (false, true)] {
        let idem = Idem::new(pool.clone())
            .with_claims_at_commit(at_commit)
            .with_session_statements(session);
        let router = Router::new()
            .route("/widgets", post(create_widget))
            .route("/payments", post(create_payment))
            .route("/exports", post(create_export))
            .nest(
                "/operations",
                idem_runtime::operations::router::<Caller, sqlx::Postgres, Idem<Postgres>>(),
            )
            .with_state(idem.clone());
        let key = format!("w-{at_commit}-{session}");
        let first = send(&router, request("/widgets", &key, json!({"name": "a"}))).await;
        assert_eq!(first, StatusCode::CREATED);
        let replay = send(&router, request("/widgets", &key, json!({"name": "a"}))).await;
        assert_eq!(replay, StatusCode::CREATED);
        let other = send(&router, request("/widgets", &key, json!({"name": "b"}))).await;
        assert_eq!(other, StatusCode::UNPROCESSABLE_ENTITY);
        let key = format!("p-{at_commit}-{session}");
        for _ in 0..2 {
            let paid = send(&router, request("/payments", &key, json!({"amount": 5}))).await;
            assert_eq!(paid, StatusCode::CREATED);
        }
        // A long operation, and its resource read while it runs and when done.
        let key = format!("e-{at_commit}-{session}");
        let accepted = send(&router, request("/exports", &key, json!({"n": 1}))).await;
        assert_eq!(accepted, StatusCode::ACCEPTED);
        idem.executions().drained().await;
        let digest = IdempotencyKey::parse(&key).unwrap().digest();
        for path in ["", "/result"] {
            let get = Request::get(format!("/operations/create-export/{digest}{path}"))
                .header("authorization", "Bearer acme")
                .body(Body::empty())
                .unwrap();
            assert_eq!(
                send(&router, get).await,
                if path.is_empty() {
                    StatusCode::OK
                } else {
                    StatusCode::CREATED
                }
            );
        }
    }

    // The lease API by hand: renew, store, mark uncertain, release.
    let fingerprint = FingerprintBuilder::new("acme", "by-hand", "POST", "/x").finish();
    for (raw, end) in [("h-1", "store"), ("h-2", "uncertain"), ("h-3", "release")] {
        let key = IdempotencyKey::parse(raw).unwrap();
        let req = LeaseRequest {
            tenant: "acme",
            operation: "by-hand",
            key: &key,
            fingerprint,
            retention: Duration::from_secs(3600),
            lease: Duration::from_secs(5),
        };
        let LeasedClaim::Acquired(lease) = claim_leased(&pool, &req).await.unwrap() else {
            panic!("a new key is acquired");
        };
        lease.renew().await.unwrap();
        assert!(lease.current_outcome().await.unwrap().is_none());
        match end {
            "store" => lease.complete(&created()).await.unwrap(),
            "uncertain" => lease.mark_uncertain().await.unwrap(),
            _ => lease.release().await.unwrap(),
        }
    }

    // The session statements are prepared several to a message: one each.
    let statements: Vec<String> = recorder
        .statements()
        .iter()
        .flat_map(|s| s.split(";PREPARE ").map(str::to_owned).collect::<Vec<_>>())
        .collect();
    for sent in [
        "EXECUTE idem_probe_3(E'acme'",
        "EXECUTE idem_insert_1(E'acme'",
    ] {
        assert!(
            statements.iter().any(|s| s.contains(sent)),
            "no message with {sent:?}"
        );
    }
    let idems: Vec<&String> = statements.iter().filter(|s| is_idems(s)).collect();
    // The paths above sent what they are known to send: the test cannot pass
    // by having seen nothing.
    for expected in [
        "SELECT fingerprint, state, generation, expires_at > now() AS live",
        "idem_probe_3(text, text, bytea, text) AS SELECT",
        "idem_insert_1(text, text, bytea, bytea, text, smallint, jsonb, bytea, bigint, text) AS INSERT",
        "idem_finish_2(text, text, bytea, bytea, text, smallint, jsonb, bytea, bigint, text, bigint) AS WITH",
        "WITH ins AS ( INSERT INTO idempotency_requests AS r",
        "INSERT INTO idempotency_requests AS r",
        "bounded) c RETURNING set_config(",
        "FROM idem_claim($1,",
        "FROM idem_claim_leased($1,",
        "AS lease_live",
        "UPDATE idempotency_requests",
        "DELETE FROM idempotency_requests",
    ] {
        assert!(
            idems.iter().any(|s| s.contains(expected)),
            "no statement with {expected:?} among {idems:#?}"
        );
    }
    let unrouted: Vec<&&String> = idems.iter().filter(|s| !names_the_tenant(s)).collect();
    assert!(
        unrouted.is_empty(),
        "statements on a request's path that do not name the tenant: {unrouted:#?}"
    );
}

/// The check itself: a statement without the tenant is caught, and the
/// recorder cuts messages split across reads.
#[test]
fn the_check_refuses_a_statement_without_the_tenant() {
    assert!(!names_the_tenant(
        "SELECT state FROM idempotency_requests WHERE operation = $1 AND key_digest = $2"
    ));
    assert!(!names_the_tenant(
        "DELETE FROM idempotency_requests WHERE expires_at <= now()"
    ));
    assert!(names_the_tenant(
        "DELETE FROM idempotency_requests WHERE tenant_id = $1 AND operation = $2"
    ));
    assert!(!names_the_tenant(
        "PREPARE idem_x_1(text, bytea) AS SELECT 1 FROM idempotency_requests WHERE key_digest = $2"
    ));
    assert!(names_the_tenant(
        "PREPARE idem_x_1(text, bytea) AS SELECT 1 FROM idempotency_requests WHERE tenant_id = $1"
    ));
    let mut frames = Frames::default();
    let startup = [0u8, 0, 0, 8, 0, 3, 0, 0];
    let mut query = vec![b'Q'];
    let text = b"SELECT 1\0";
    query.extend_from_slice(&(4 + text.len() as u32).to_be_bytes());
    query.extend_from_slice(text);
    let mut parse = vec![b'P'];
    let body = b"s1\0SELECT 2\0\0\0";
    parse.extend_from_slice(&(4 + body.len() as u32).to_be_bytes());
    parse.extend_from_slice(body);
    let all: Vec<u8> = [&startup[..], &query, &parse].concat();
    let (a, b) = all.split_at(11);
    let mut seen = frames.feed(a);
    seen.extend(frames.feed(b));
    assert_eq!(seen, ["SELECT 1", "SELECT 2"]);
}
