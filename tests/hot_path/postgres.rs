//! The handler's path on PostgreSQL (`idem_runtime`'s `db::postgres::hot_path`),
//! beside what `suite.rs` holds every database to: the lookup riding with
//! `BEGIN` and the finished row with `COMMIT` (the round trips of the bare write),
//! or, where the pool keeps no session, a prepared lookup before the transaction;
//! savepoints that stay savepoints, nothing committed when the completion fails,
//! a duplicate whose handler hit the winner's row answered the winner's outcome,
//! connections that go back to the pool clean whatever the answer, no function
//! of idem's on the path, and keys that never travel as SQL text.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use idem_runtime::test_util::Finish;
use idem_runtime::test_util::HandlerPath;
use idem_runtime::test_util::as_another_replica;
use idem_runtime::{Claim, ClaimRequest, StoredResponse};
use idem_runtime::{Fingerprint, FingerprintBuilder, Idem, IdempotencyKey, Tx};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Acquire, PgPool, Postgres, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::TestDb;
use crate::common::caller::Caller;
use crate::common::gate::Gate;
use suite::{Answer, NewWidget, assert_outcome_unknown, refusing_checkouts, request, router, send};

type Db = Postgres;

#[path = "suite.rs"]
mod suite;

stamp!(suite =>
    a_first_execution_writes_one_finished_row_and_a_retry_replays_it,
    a_retry_of_a_finished_key_replays_even_when_the_handler_would_now_fail,
    a_duplicate_that_ran_beside_the_first_rolls_back_and_answers_the_winners_outcome,
    a_duplicate_whose_answer_cannot_be_stored_answers_the_winners_outcome,
    concurrent_duplicates_on_many_processes_make_one_effect_and_one_answer,
    an_expired_key_is_executed_anew_by_the_insert,
    a_nested_transaction_left_open_is_not_committed_and_its_connection_is_closed,
    a_duplicate_that_lost_at_commit_and_cannot_read_the_winner_answers_503_unknown,
);

const WIDGETS: &str =
    "CREATE TABLE widgets (id bigserial PRIMARY KEY, tenant text NOT NULL, name text NOT NULL)";

/// Every finished row past its retention.
const EXPIRE_ALL: &str = "UPDATE idempotency_requests SET expires_at = now() - interval '1 second'";

/// How many processes the storm runs; PostgreSQL's losers wait for the
/// winner's row and never deadlock, so every one answers the winner's outcome.
const STORM: usize = 16;
const STORM_MAY_CONFLICT: bool = false;

async fn insert(conn: &mut sqlx::PgConnection, tenant: &str, name: &str) {
    sqlx::query("INSERT INTO widgets (tenant, name) VALUES ($1, $2)")
        .bind(tenant)
        .bind(name)
        .execute(conn)
        .await
        .unwrap();
}

/// Set by a handler's mode: the pool of
/// `a_key_that_cannot_be_looked_up_after_a_rollback_answers_503_not_the_handlers_answer`
/// then refuses every checkout, so the read after a rollback fails. Only that
/// test's pool reads it.
static LOOKUPS_FAIL: AtomicBool = AtomicBool::new(false);

/// A database with the widgets table and `naturals`, in which the name
/// `taken` is.
async fn widgets_with_a_taken_name() -> TestDb {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    db.exec("CREATE TABLE naturals (nk text UNIQUE)").await;
    db.exec("INSERT INTO naturals (nk) VALUES ('taken')").await;
    db
}

/// Inserts `nk` into `naturals`: whether it was taken (a unique violation,
/// which aborts the transaction).
async fn natural_taken(tx: &mut Tx<Db>, nk: &str) -> bool {
    match sqlx::query("INSERT INTO naturals (nk) VALUES ($1)")
        .bind(nk)
        .execute(&mut **tx)
        .await
    {
        Ok(_) => false,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23505") => true,
        Err(e) => panic!("{e}"),
    }
}

/// Writes one widget in the claimed transaction; its id.
async fn add_widget(tx: &mut Tx<Db>, tenant: &str, name: &str) -> i64 {
    sqlx::query_scalar("INSERT INTO widgets (tenant, name) VALUES ($1, $2) RETURNING id")
        .bind(tenant)
        .bind(name)
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}

/// The widget handler's modes only PostgreSQL's tests use; `None` for a mode it
/// does not know (the handler then writes a widget).
async fn more_modes(tx: &mut Tx<Db>, tenant: &str, name: &str, mode: &str) -> Option<Answer> {
    match mode {
        // A savepoint rolled back, then work after it: only the savepoint's
        // insert is undone.
        "savepoint-rollback" => {
            insert(tx, tenant, "kept").await;
            let mut sp = (&mut **tx).begin().await.unwrap();
            insert(&mut sp, tenant, "undone").await;
            sp.rollback().await.unwrap();
            insert(tx, tenant, "after").await;
        }
        // A savepoint released, then an Err: the release must not have
        // committed anything.
        "savepoint-commit-then-err" => {
            let mut sp = (&mut **tx).begin().await.unwrap();
            insert(&mut sp, tenant, "released").await;
            sp.commit().await.unwrap();
            return Some(Err((StatusCode::CONFLICT, "refused".into())));
        }
        // A temporary table shadows idem's for the rest of the transaction:
        // the completion's insert fails.
        "break-completion" => {
            insert(tx, tenant, "orphan").await;
            sqlx::query("CREATE TEMP TABLE idempotency_requests (x int) ON COMMIT DROP")
                .execute(&mut **tx)
                .await
                .unwrap();
        }
        // A natural key of the application's: a second execution that runs
        // into the first's row answers 409 itself (its transaction is aborted
        // by then); the first run then waits at the widget's gate.
        "natural" => {
            let inserted = sqlx::query("INSERT INTO naturals (nk) VALUES ($1)")
                .bind(name)
                .execute(&mut **tx)
                .await;
            if let Err(sqlx::Error::Database(e)) = &inserted
                && e.code().as_deref() == Some("23505")
            {
                return Some(Ok((StatusCode::CONFLICT, Json(json!({"duplicate": true})))));
            }
            inserted.unwrap();
            let gate = Gate::named(name);
            if gate.first_visit() {
                gate.stop().await;
            }
        }
        // A widget, then a natural key answered `409` when it is taken: the
        // failed insert has aborted the transaction by then.
        "natural-answered" => {
            add_widget(tx, tenant, name).await;
            if natural_taken(tx, name).await {
                return Some(Ok((StatusCode::CONFLICT, Json(json!({"duplicate": true})))));
            }
        }
        // The same, with every later checkout refused (`LOOKUPS_FAIL`).
        "natural-answered-lookups-fail" => {
            add_widget(tx, tenant, name).await;
            LOOKUPS_FAIL.store(true, Ordering::SeqCst);
            if natural_taken(tx, name).await {
                return Some(Ok((StatusCode::CONFLICT, Json(json!({"duplicate": true})))));
            }
        }
        // An `Err` with every later checkout refused.
        "err-lookups-fail" => {
            add_widget(tx, tenant, name).await;
            LOOKUPS_FAIL.store(true, Ordering::SeqCst);
            return Some(Err((StatusCode::CONFLICT, "refused".into())));
        }
        // The same, the failure ignored: a success over an aborted transaction.
        "natural-ignored" => {
            add_widget(tx, tenant, name).await;
            natural_taken(tx, name).await;
        }
        // A code under a deferred unique constraint: checked at COMMIT.
        "deferred" => {
            sqlx::query("INSERT INTO codes (code) VALUES ($1)")
                .bind(name)
                .execute(&mut **tx)
                .await
                .unwrap();
        }
        _ => return None,
    }
    Some(Ok((StatusCode::CREATED, Json(json!({"name": name})))))
}

/// `POST /bare`: the yardstick for round trips.
fn more_routes(router: Router<Idem<Db>>) -> Router<Idem<Db>> {
    router.route("/bare", post(bare_widget))
}

/// The same insert without idem, in a plain sqlx transaction: the yardstick for
/// round trips.
async fn bare_widget(
    State(idem): State<Idem<Db>>,
    caller: Caller,
    Json(w): Json<NewWidget>,
) -> impl IntoResponse {
    let mut tx = idem.pool().begin().await.unwrap();
    insert(&mut tx, &caller.0, &w.name).await;
    tx.commit().await.unwrap();
    (StatusCode::CREATED, Json(json!({"name": w.name})))
}

/// `POST /widgets` with `key` and a widget in `mode` (see `create_widget`).
async fn widget(router: &Router, key: &str, mode: &str) -> (StatusCode, bool, Bytes) {
    send(
        router,
        request("/widgets", key, json!({"name": "x", "mode": mode})),
    )
    .await
}

/// The server-side state of the pool's only connection (`idle`, `idle in
/// transaction`, ...), read from another connection while the pool's is held, so
/// that its release (and any rollback queued for it) is complete.
async fn state_of_the_only_connection(pool: &PgPool, observer: &PgPool) -> String {
    let mut held = pool.acquire().await.unwrap();
    let pid = backend_pid(&mut *held).await;
    sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(observer)
        .await
        .unwrap()
}

/// A database with the widgets table, and a pool of one connection to it
/// (pinging on acquire, sqlx's default).
async fn widgets_on_one_connection() -> (TestDb, PgPool) {
    widgets_on(PgPoolOptions::new().max_connections(1)).await
}

/// The widget routes on the session path with replay hints off: every retry
/// begins with the probe, and every connection is taken through `acquire()`.
fn unhinted(pool: &PgPool) -> Router {
    router(
        Idem::new(pool.clone())
            .with_session_statements(true)
            .with_replay_hints(false),
    )
}

/// A database with the widgets table, and a pool to it made with `options`.
async fn widgets_on(options: PgPoolOptions) -> (TestDb, PgPool) {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let pool = options.connect(&db.url).await.unwrap();
    (db, pool)
}

/// The pool's only connection is idle on the server: no transaction left open.
async fn assert_went_back_clean(pool: &PgPool, db: &TestDb) {
    assert_eq!(
        state_of_the_only_connection(pool, &db.pool).await,
        "idle",
        "the connection went back clean"
    );
}

/// A TCP proxy in front of PostgreSQL that counts round trips: a round trip
/// starts whenever the client sends after the server last spoke. (Counting the
/// server's `ReadyForQuery` messages would count a queued rollback that travels
/// with a ping as two.)
struct RoundTrips {
    addr: SocketAddr,
    count: Arc<AtomicU64>,
    /// The server's `25P01` notices (`ROLLBACK` or `COMMIT` with no transaction
    /// in progress: a warning in the server's log), as the client received them.
    no_transaction: Arc<AtomicU64>,
    /// While true, what the server says is held back (a connection cut
    /// without a word, as the client sees it).
    stall: tokio::sync::watch::Sender<bool>,
    /// While true, a client's write that holds a `ROLLBACK` query is held
    /// back (counted first), and [`RoundTrips::held_rollbacks`] counts it.
    hold_rollbacks: tokio::sync::watch::Sender<bool>,
    held: Arc<AtomicU64>,
    /// While true, the request deadline's `set_config('statement_timeout', ..)`
    /// in a client's write names a setting the server lacks (one letter
    /// changed, so the message keeps its length): a `BEGIN` message that
    /// carries it fails after its `BEGIN`. [`RoundTrips::broken_deadlines`]
    /// counts the writes changed.
    break_deadlines: tokio::sync::watch::Sender<bool>,
    broken: Arc<AtomicU64>,
    /// Once set, the next connection that has sent idem's `PREPARE`s is cut
    /// (both ways, without a word) at its next write, and this is cleared:
    /// lost between preparing its session and the claim's next message.
    /// [`RoundTrips::cut_after_prepare`] counts the connections cut.
    cut_prepared: Arc<AtomicBool>,
    cut: Arc<AtomicU64>,
}

impl RoundTrips {
    async fn start() -> RoundTrips {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicU64::new(0));
        let counted = count.clone();
        let no_transaction = Arc::new(AtomicU64::new(0));
        let warned = no_transaction.clone();
        let (stall, stalled) = tokio::sync::watch::channel(false);
        let (hold_rollbacks, holding) = tokio::sync::watch::channel(false);
        let held = Arc::new(AtomicU64::new(0));
        let holds = held.clone();
        let (break_deadlines, breaking) = tokio::sync::watch::channel(false);
        let broken = Arc::new(AtomicU64::new(0));
        let breaks = broken.clone();
        let cut_prepared = Arc::new(AtomicBool::new(false));
        let cutting = cut_prepared.clone();
        let cut = Arc::new(AtomicU64::new(0));
        let cuts = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counted = counted.clone();
                let warned = warned.clone();
                let mut stalled = stalled.clone();
                let mut holding = holding.clone();
                let holds = holds.clone();
                let breaking = breaking.clone();
                let breaks = breaks.clone();
                let cutting = cutting.clone();
                let cuts = cuts.clone();
                tokio::spawn(async move {
                    let server = TcpStream::connect("127.0.0.1:5432").await.unwrap();
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    // true once the server has spoken since the client last sent
                    let answered = Arc::new(AtomicBool::new(true));
                    let heard = answered.clone();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        let mut prepared = false;
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if prepared
                                && cutting
                                    .compare_exchange(
                                        true,
                                        false,
                                        Ordering::SeqCst,
                                        Ordering::SeqCst,
                                    )
                                    .is_ok()
                            {
                                // Dropping both halves ends the connection
                                // both ways: the server's side reads its
                                // end, and the client's read sees it closed.
                                cuts.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            prepared |= buf[..n]
                                .windows(b"PREPARE idem_".len())
                                .any(|w| w == b"PREPARE idem_");
                            if heard.swap(false, Ordering::SeqCst) {
                                counted.fetch_add(1, Ordering::SeqCst);
                            }
                            // A simple query that is exactly `ROLLBACK` (sqlx's
                            // queued rollback): its type, length and text.
                            const ROLLBACK: &[u8] = b"Q\0\0\0\x0dROLLBACK\0";
                            const DEADLINE: &[u8] = b"SELECT set_config('statement_timeout'";
                            if *breaking.borrow()
                                && let Some(at) =
                                    buf[..n].windows(DEADLINE.len()).position(|w| w == DEADLINE)
                            {
                                // `statement_timeouz`: the same length.
                                buf[at + DEADLINE.len() - 2] = b'z';
                                breaks.fetch_add(1, Ordering::SeqCst);
                            }
                            if *holding.borrow()
                                && buf[..n].windows(ROLLBACK.len()).any(|w| w == ROLLBACK)
                            {
                                holds.fetch_add(1, Ordering::SeqCst);
                                if holding.wait_for(|h| !h).await.is_err() {
                                    break;
                                }
                            }
                            if sw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    });
                    // The notice's SQLSTATE field; the last bytes of each read are
                    // kept in front of the next, so a field cut in two is found.
                    const NO_TRANSACTION: &[u8] = b"C25P01\0";
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut tail: Vec<u8> = Vec::new();
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        tail.extend_from_slice(&buf[..n]);
                        let found = tail
                            .windows(NO_TRANSACTION.len())
                            .filter(|w| *w == NO_TRANSACTION)
                            .count();
                        warned.fetch_add(found as u64, Ordering::SeqCst);
                        let keep = tail.len().min(NO_TRANSACTION.len() - 1);
                        tail.drain(..tail.len() - keep);
                        if stalled.wait_for(|s| !s).await.is_err() {
                            break;
                        }
                        // Marked before forwarding: the client cannot send its
                        // next message before it has this answer.
                        answered.store(true, Ordering::SeqCst);
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        RoundTrips {
            addr,
            count,
            no_transaction,
            stall,
            hold_rollbacks,
            held,
            break_deadlines,
            broken,
            cut_prepared,
            cut,
        }
    }

    /// How many connections [`RoundTrips::cut_prepared`] has cut so far.
    fn cut_after_prepare(&self) -> u64 {
        self.cut.load(Ordering::SeqCst)
    }

    /// How many writes [`RoundTrips::break_deadlines`] has changed so far.
    fn broken_deadlines(&self) -> u64 {
        self.broken.load(Ordering::SeqCst)
    }

    /// How many writes holding a `ROLLBACK` have been held back so far.
    fn held_rollbacks(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    fn now(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// How many `25P01` warnings the server has sent so far.
    fn no_transaction_warnings(&self) -> u64 {
        self.no_transaction.load(Ordering::SeqCst)
    }
}

/// A database with the widgets table, a counting proxy in front of it, and a
/// pool of up to `size` connections through the proxy, pinging on acquire if
/// `ping` (sqlx's default). Without the ping, every round trip in a window is one
/// the request made (plus the release ping that every window has once).
async fn widgets_through(ping: bool, size: u32) -> (TestDb, RoundTrips, PgPool) {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let proxy = RoundTrips::start().await;
    let opts = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(proxy.addr.port())
        .username("postgres")
        .database(&db.name)
        .ssl_mode(PgSslMode::Disable);
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .test_before_acquire(ping)
        .connect_with(opts)
        .await
        .unwrap();
    (db, proxy, pool)
}

/// Waits until `holds` says so, checking every millisecond (what it waits for
/// happens on a task of the pool's or in the server, which announce nothing);
/// after 10 s the test fails with `what`.
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut holds: impl FnMut() -> F) {
    for _ in 0..10_000 {
        if holds().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("never: {what}");
}

/// Waits until `pool`'s only connection is idle in it: a released connection
/// goes back after its release ping, on a task of its own, and until then it
/// cannot be taken as it is (`Pool::try_acquire`).
async fn until_idle(pool: &PgPool) {
    until("the pool's connection came back", || async {
        pool.num_idle() > 0
    })
    .await;
}

/// Ends `pool`'s only connection from the server's side while it is idle in
/// the pool (as a restart, a pooler or a network in between would), and
/// answers its backend's pid.
async fn end_the_idle_connection(pool: &PgPool, db: &TestDb) -> i32 {
    let pid = backend_pid(pool).await;
    // Back in the pool before it is ended (ended during its release ping, the
    // pool would close it itself).
    until_idle(pool).await;
    end_backend(db, pid).await;
    assert_eq!(
        pool.num_idle(),
        1,
        "the dropped connection is idle in the pool"
    );
    pid
}

/// Ends the server process `pid` of `db` and waits until it is gone.
async fn end_backend(db: &TestDb, pid: i32) {
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(terminated, "the connection was ended by the server");
    until_gone(db, pid, "the backend ended").await;
}

/// Waits until the server process `pid` of `db` is gone.
async fn until_gone(db: &TestDb, pid: i32, what: &str) {
    until(what, || async {
        let alive: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        alive == 0
    })
    .await;
}

/// The server process behind `on` (a connection, or the pool's next one).
async fn backend_pid<'e>(on: impl sqlx::PgExecutor<'e>) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(on)
        .await
        .unwrap()
}

/// Uses every statement a window counts once (the bare write's, a first
/// execution's and a replay's), so that none is prepared inside the window:
/// the first use of a statement on a connection prepares it (a round trip of
/// its own), and idem's session statements are prepared when the first one a
/// claim sends is missing.
async fn warm_up(r: &Router) {
    for (path, key) in [("/bare", "w1"), ("/widgets", "w2"), ("/widgets", "w2")] {
        let (status, _, _) = send(r, request(path, key, json!({"name": "w"}))).await;
        assert!(status.is_success());
    }
}

/// Round trips of `req` between two points where the pool's one connection is
/// back in the pool.
async fn round_trips(
    proxy: &RoundTrips,
    pool: &PgPool,
    router: &Router,
    req: Request<Body>,
) -> u64 {
    // Holding the only connection, nothing is in flight; its release ping is
    // counted in every window alike.
    let held = pool.acquire().await.unwrap();
    let before = proxy.now();
    drop(held);
    until_idle(pool).await;
    let (status, _, body) = send(router, req).await;
    assert!(status.is_success(), "{status}: {body:?}");
    // Acquiring the only connection waits until the request's release is done.
    let held = pool.acquire().await.unwrap();
    let after = proxy.now();
    drop(held);
    after - before
}

/// A database behind a round-trip counting proxy, and the counts of a bare
/// write, a first execution and its replay, with the session path on or off.
struct Counted {
    db: TestDb,
    proxy: RoundTrips,
    pool: PgPool,
    bare: u64,
    first: u64,
    replay: u64,
}

impl Counted {
    async fn measure(session: bool) -> Counted {
        let (db, proxy, pool) = widgets_through(false, 1).await;
        let r = router(Idem::new(pool.clone()).with_session_statements(session));
        warm_up(&r).await;
        let mut counted = Counted {
            db,
            proxy,
            pool,
            bare: 0,
            first: 0,
            replay: 0,
        };
        counted.bare = counted.count(&r, "/bare", "b1").await;
        counted.first = counted.count(&r, "/widgets", "k1").await;
        counted.replay = counted.count(&r, "/widgets", "k1").await;
        // BEGIN, INSERT, COMMIT and the release ping, plus the window's own ping.
        assert_eq!(counted.bare, 5, "the yardstick changed");
        counted
    }

    async fn count(&self, r: &Router, path: &str, key: &str) -> u64 {
        round_trips(
            &self.proxy,
            &self.pool,
            r,
            request(path, key, json!({"name": "a"})),
        )
        .await
    }
}

#[tokio::test]
async fn a_first_execution_takes_the_round_trips_of_the_bare_write() {
    let c = Counted::measure(true).await;
    // The probe rides with BEGIN, the finished row with COMMIT (and the empty
    // transaction's ROLLBACK with the release ping).
    assert_eq!(c.first, c.bare, "a first execution");
    // This process finished the key: its retry reads it first, one message,
    // no transaction.
    assert_eq!(c.replay, 3, "a replay where the key was finished");
    assert_eq!(c.db.count("SELECT count(*) FROM widgets").await, 4);
    assert_eq!(
        c.db.count("SELECT count(*) FROM idempotency_requests")
            .await,
        2
    );
}

/// A retry that reaches a process which has not seen its key finished (another
/// replica, or hints turned off) begins with the probe: its `BEGIN` fails, and
/// with no other connection idle (the pool's only one is the probe's) the
/// driver's queued `ROLLBACK` goes, then the lookup, no transaction after it.
/// Once it has replayed the key, that process reads the key first too.
#[tokio::test]
async fn a_replay_elsewhere_begins_with_the_probe_once() {
    let c = Counted::measure(true).await;
    for (name, idem, second) in [
        ("another process", Idem::new(c.pool.clone()), 3),
        (
            "hints off",
            Idem::new(c.pool.clone()).with_replay_hints(false),
            5,
        ),
    ] {
        let elsewhere = router(idem.with_session_statements(true));
        assert_eq!(c.count(&elsewhere, "/widgets", "k1").await, 5, "{name}");
        // Remembered once replayed, unless hints are off.
        assert_eq!(
            c.count(&elsewhere, "/widgets", "k1").await,
            second,
            "{name}"
        );
    }
    assert_eq!(c.db.count("SELECT count(*) FROM widgets").await, 4);
    // The failed probes' transactions, and the first one's (the session had no
    // statements yet, so they were prepared after it), were each rolled back
    // once: no `ROLLBACK` reached the server outside a transaction.
    assert_eq!(c.proxy.no_transaction_warnings(), 0);
}

/// Opens a second connection in `pool` (of two, its first idle) with idem's
/// session statements, as the first has them: a claim on it while the first is
/// held (a new key, `key`, which `r` remembers). Then each connection, alone
/// idle, reads that key once (a replay), so that both have the driver's
/// prepared lookup too: a read on either is one round trip. Both are idle
/// after it.
async fn a_second_session(pool: &PgPool, r: &Router, key: &str) {
    let widget = || request("/widgets", key, json!({"name": "b"}));
    until_idle(pool).await;
    let first = pool.acquire().await.unwrap();
    let (status, _, body) = send(r, widget()).await;
    assert!(status.is_success(), "{status}: {body:?}");
    until_idle(pool).await;
    let second = pool.acquire().await.unwrap();
    let replay_on = |alone_idle| async move {
        drop(alone_idle);
        until_idle(pool).await;
        let (status, replayed, body) = send(r, widget()).await;
        assert!(status.is_success() && replayed, "{status}: {body:?}");
        until_idle(pool).await;
    };
    replay_on(first).await;
    let first = pool.acquire().await.unwrap();
    replay_on(second).await;
    drop(first);
    until("both connections are idle", || async {
        pool.num_idle() == 2
    })
    .await;
}

/// A retry that reaches a process without its key's hint, where another
/// connection is idle: the key is read there, and the probe's connection goes
/// back with the driver's queued `ROLLBACK`, which rides with its release
/// ping. The retry is answered while that `ROLLBACK` is held back (so it did
/// not wait for it): it waited for the probe and the read, two round trips of
/// the four the window counts (the probe, the read, and each connection's
/// release). No `ROLLBACK` reached the server outside a transaction.
#[tokio::test]
async fn a_replay_elsewhere_reads_on_an_idle_connection_without_waiting_for_the_rollback() {
    reads_on_an_idle_connection_after_the_probe(as_another_replica).await;
}

/// With replay hints off but the checkout test off too, a first execution
/// already takes its connection as it is, without the pool's test: the read
/// after the probe is made on an idle connection as with hints on.
#[tokio::test]
async fn without_the_checkout_test_an_unhinted_replay_reads_on_an_idle_connection() {
    reads_on_an_idle_connection_after_the_probe(|idem| {
        idem.with_replay_hints(false).with_checkout_test(false)
    })
    .await;
}

/// A retry, through a process that `elsewhere` makes from the first one's
/// settings, of a key the first finished: read on the other idle connection
/// while the probe's `ROLLBACK` is held back (see
/// `a_replay_elsewhere_reads_on_an_idle_connection_without_waiting_for_the_rollback`).
async fn reads_on_an_idle_connection_after_the_probe(elsewhere: fn(Idem<Db>) -> Idem<Db>) {
    let (db, proxy, pool) = widgets_through(false, 2).await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let elsewhere = router(elsewhere(
        Idem::new(pool.clone()).with_session_statements(true),
    ));
    let (status, _, first) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success(), "{status}: {first:?}");
    a_second_session(&pool, &r, "k0").await;

    let before = proxy.now();
    proxy.hold_rollbacks.send_replace(true);
    let replay = send(&elsewhere, request("/widgets", "k1", json!({"name": "a"})));
    let (status, replayed, body) = tokio::time::timeout(std::time::Duration::from_secs(10), replay)
        .await
        .expect("the replay waited for the probe's ROLLBACK");
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    until("the probe's connection sent its ROLLBACK", || async {
        proxy.held_rollbacks() == 1
    })
    .await;
    until("the read's connection is back", || async {
        pool.num_idle() == 1
    })
    .await;
    assert_eq!(
        proxy.now() - before,
        4,
        "the probe, the read and two releases"
    );
    proxy.hold_rollbacks.send_replace(false);
    until("both connections are back", || async {
        pool.num_idle() == 2
    })
    .await;
    assert_eq!(proxy.now() - before, 4, "nothing more after the ROLLBACK");
    assert_eq!(proxy.no_transaction_warnings(), 0);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND state <> 'idle' \
           AND pid <> pg_backend_pid()",
    )
    .bind(&db.name)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(open, 0, "both connections went back clean");
}

/// The pids of the connections a pool's `before_acquire` has seen since the
/// list was last cleared.
type Tested = Arc<std::sync::Mutex<Vec<i32>>>;

/// A database whose widgets record the backend that wrote them, and a pool of
/// `size` connections whose `before_acquire` records the backends it sees
/// (how many checkouts it saw is the list's length).
async fn widgets_with_their_backends(size: u32) -> (TestDb, PgPool, Tested) {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    db.exec("ALTER TABLE widgets ADD COLUMN pid int NOT NULL DEFAULT pg_backend_pid()")
        .await;
    let tested = Tested::default();
    let seen = tested.clone();
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .before_acquire(move |conn, _| {
            let seen = seen.clone();
            Box::pin(async move {
                let pid = backend_pid(conn).await;
                seen.lock().unwrap().push(pid);
                Ok(true)
            })
        })
        .connect(&db.url)
        .await
        .unwrap();
    (db, pool, tested)
}

/// Sends `req` once both of `pool`'s connections are open and idle, with
/// `tested` cleared: it then holds the checkouts of this request alone.
async fn send_with_both_idle(
    r: &Router,
    req: Request<Body>,
    pool: &PgPool,
    tested: &Tested,
) -> (StatusCode, bool, Bytes) {
    let (first, second) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    drop((first, second));
    until("both connections are idle", || async {
        pool.num_idle() == 2
    })
    .await;
    tested.lock().unwrap().clear();
    send(r, req).await
}

/// A retry elsewhere whose key's row has expired: the read on the idle
/// connection decides to execute, and the handler's transaction begins on the
/// probe's connection, the one the pool tested, with no second probe.
#[tokio::test]
async fn a_replay_elsewhere_of_an_expired_key_executes_on_the_tested_connection() {
    let (db, pool, tested) = widgets_with_their_backends(2).await;
    let r = router(as_another_replica(
        Idem::new(pool.clone()).with_session_statements(true),
    ));
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, _, _) = send(&r, widget()).await;
    assert!(status.is_success(), "{status}");
    db.exec(EXPIRE_ALL).await;
    let (status, replayed, body) = send_with_both_idle(&r, widget(), &pool, &tested).await;
    assert!(status.is_success() && !replayed, "{status}: {body:?}");
    let wrote: i32 = sqlx::query_scalar("SELECT pid FROM widgets ORDER BY id DESC LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        *tested.lock().unwrap(),
        [wrote],
        "the handler's transaction ran on the one connection the pool tested"
    );
    let read = readers(&db).await;
    assert_eq!(read.len(), 1, "one read, after the probe: {read:?}");
    assert_ne!(read[0], wrote, "the read was made on the idle connection");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2
    );
}

/// The backends of `db` whose last statement was idem's lookup of a key.
async fn readers(db: &TestDb) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 \
            AND query LIKE 'SELECT fingerprint, state, generation, expires_at > now() AS live,%'",
    )
    .bind(&db.name)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// With replay hints off (and the checkout test on), no connection is taken
/// without the pool's test: a replay's read after the probe waits for the
/// driver's `ROLLBACK` on the probe's connection, the one `before_acquire` saw,
/// even with another connection idle.
#[tokio::test]
async fn with_replay_hints_off_the_read_after_the_probe_is_on_the_tested_connection() {
    let (db, pool, tested) = widgets_with_their_backends(2).await;
    let r = unhinted(&pool);
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, _, first) = send(&r, widget()).await;
    assert!(status.is_success(), "{status}: {first:?}");
    let (status, replayed, body) = send_with_both_idle(&r, widget(), &pool, &tested).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    let tested = tested.lock().unwrap().clone();
    assert_eq!(tested.len(), 1, "one checkout: {tested:?}");
    assert_eq!(readers(&db).await, tested, "the read was on the tested one");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A retry elsewhere whose idle connection turns out dropped (ended while it
/// was idle, as a restart or a pooler in between would end it): the read is
/// made again on the probe's connection, and the retry gets the stored answer.
#[tokio::test]
async fn a_replay_elsewhere_whose_idle_connection_was_dropped_reads_on_the_probes() {
    // No acquire ping, so that the dropped connection is found by idem's read,
    // not by the pool.
    let (db, pool) = widgets_on(
        PgPoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false),
    )
    .await;
    let r = router(as_another_replica(
        Idem::new(pool.clone()).with_session_statements(true),
    ));
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, _, first) = send(&r, widget()).await;
    assert!(status.is_success(), "{status}: {first:?}");

    // Two idle connections, the one to be dropped behind the other in the
    // pool's queue (which hands out the longest idle first): the probe gets
    // the live one, the read the dropped one.
    until_idle(&pool).await;
    let mut live = pool.acquire().await.unwrap();
    let mut doomed = pool.acquire().await.unwrap();
    let live_pid = backend_pid(&mut *live).await;
    drop(live);
    until_idle(&pool).await;
    let doomed_pid = backend_pid(&mut *doomed).await;
    drop(doomed);
    until("both connections are idle", || async {
        pool.num_idle() == 2
    })
    .await;
    end_backend(&db, doomed_pid).await;

    let (status, replayed, body) = send(&r, widget()).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    until("the dropped connection was closed", || async {
        pool.size() == 1 && pool.num_idle() == 1
    })
    .await;
    assert_eq!(backend_pid(&pool).await, live_pid, "the live one is kept");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A retry of a key this process has seen finished is read on an idle
/// connection as it is, without the pool's acquire ping (sqlx's default): the
/// request waits for one round trip where a first execution waits for the
/// bare write's four, ping included.
#[tokio::test]
async fn a_remembered_keys_read_takes_no_acquire_ping() {
    let (db, proxy, pool) = widgets_through(true, 1).await;
    let hinted = router(Idem::new(pool.clone()).with_session_statements(true));
    let unhinted = unhinted(&pool);
    warm_up(&hinted).await;
    let count = |r: &Router, path: &'static str, key: &'static str| {
        let r = r.clone();
        let (proxy, pool) = (&proxy, &pool);
        async move { round_trips(proxy, pool, &r, request(path, key, json!({"name": "a"}))).await }
    };
    // The held connection's release ping, the acquire ping, BEGIN, INSERT,
    // COMMIT, the release ping and the window's own acquire ping.
    let bare = count(&hinted, "/bare", "b1").await;
    assert_eq!(bare, 7, "the yardstick changed");
    assert_eq!(
        count(&hinted, "/widgets", "k1").await,
        bare,
        "a first execution"
    );
    // The lookup alone between the window's pings and the release ping.
    assert_eq!(
        count(&hinted, "/widgets", "k1").await,
        4,
        "a remembered key's replay"
    );
    // Unremembered: the acquire ping, the failed probe, the driver's queued
    // `ROLLBACK`, then the lookup.
    assert_eq!(
        count(&unhinted, "/widgets", "k1").await,
        7,
        "a replay elsewhere"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 4);
}

/// A claim's untested connection lost right after idem prepared its session
/// begins again on a new connection, which has not met idem either: it is
/// prepared in turn, and the first execution runs once, not a `503`.
#[tokio::test]
async fn a_connection_lost_after_its_prepare_is_replaced_and_the_next_prepared_too() {
    let (db, proxy, pool) = widgets_through(false, 2).await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    proxy.cut_prepared.store(true, Ordering::SeqCst);
    let (status, replayed, body) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success() && !replayed, "{status}: {body:?}");
    assert_eq!(
        proxy.cut_after_prepare(),
        1,
        "the prepared connection was cut"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    let (status, replayed, again) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success() && replayed, "{status}: {again:?}");
    assert_eq!(again, body, "the stored answer");
}

/// The acquire ping is there to find a connection the server has dropped: a
/// remembered key's read on such a connection is made again on one the pool
/// tested, and the retry still gets the stored answer.
#[tokio::test]
async fn a_remembered_keys_read_on_a_dropped_connection_is_made_again() {
    let (db, pool) = widgets_on_one_connection().await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let (status, replayed, first) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success() && !replayed, "{status}: {first:?}");

    let pid = end_the_idle_connection(&pool, &db).await;

    let (status, replayed, body) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    let now = backend_pid(&pool).await;
    assert_ne!(now, pid, "the dropped connection was replaced");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A server that ends idle sessions (`idle_session_timeout`, PostgreSQL 14 on)
/// answers the next message on one with `57P05`: a lost connection as much as
/// an administrator's termination is, so a remembered key's read on it is made
/// again on a tested connection rather than answered `503`.
#[tokio::test]
async fn a_remembered_keys_read_on_a_session_the_server_timed_out_is_made_again() {
    let (db, pool) = widgets_on_one_connection().await;
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if version < 140_000 {
        eprintln!("skipped: idle_session_timeout is PostgreSQL 14's");
        return;
    }
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let (status, replayed, first) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success() && !replayed, "{status}: {first:?}");

    // The setting on the pool's one connection, which the server then ends
    // once it has been idle that long (well after its release ping).
    let pid = {
        let mut conn = pool.acquire().await.unwrap();
        sqlx::query("SET idle_session_timeout = 500")
            .execute(&mut *conn)
            .await
            .unwrap();
        backend_pid(&mut *conn).await
    };
    until_idle(&pool).await;
    until_gone(&db, pid, "the server ended the idle session").await;
    assert_eq!(pool.num_idle(), 1, "the ended session is idle in the pool");

    let (status, replayed, body) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    assert_ne!(
        backend_pid(&pool).await,
        pid,
        "the ended session was replaced"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// Only an answer is decided on a connection taken without the pool's test:
/// a remembered key that is to execute again (its row purged) runs its
/// handler's transaction on a connection the pool's `before_acquire` saw.
#[tokio::test]
async fn a_remembered_key_executes_on_a_connection_the_pool_tested() {
    let (db, pool, tested) = widgets_with_their_backends(1).await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, _, _) = send(&r, widget()).await;
    assert!(status.is_success(), "{status}");
    until_idle(&pool).await;
    let before = tested.lock().unwrap().len();

    let (status, replayed, _) = send(&r, widget()).await;
    assert!(status.is_success() && replayed, "{status}");
    assert_eq!(
        tested.lock().unwrap().len(),
        before,
        "a replay's read is untested"
    );

    db.exec("DELETE FROM idempotency_requests").await;
    until_idle(&pool).await;
    let (status, replayed, _) = send(&r, widget()).await;
    assert!(status.is_success() && !replayed, "{status}");
    assert!(
        tested.lock().unwrap().len() > before,
        "the handler's transaction began on a tested connection"
    );
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
    assert_went_back_clean(&pool, &db).await;
}

/// Without the checkout test, a first execution takes an idle connection as
/// it is, and the probe riding with `BEGIN` is its test: one round trip fewer
/// than the bare write, whose connection the pool pings. A replay is as with
/// the test.
#[tokio::test]
async fn without_the_checkout_test_a_first_execution_saves_the_acquire_ping() {
    let (db, proxy, pool) = widgets_through(true, 1).await;
    let r = router(
        Idem::new(pool.clone())
            .with_session_statements(true)
            .with_checkout_test(false),
    );
    warm_up(&r).await;
    let count = |path: &'static str, key: &'static str| {
        let (r, proxy, pool) = (r.clone(), &proxy, &pool);
        async move { round_trips(proxy, pool, &r, request(path, key, json!({"name": "a"}))).await }
    };
    // As in `a_remembered_keys_read_takes_no_acquire_ping`.
    let bare = count("/bare", "b1").await;
    assert_eq!(bare, 7, "the yardstick changed");
    assert_eq!(count("/widgets", "k1").await, bare - 1, "a first execution");
    assert_eq!(count("/widgets", "k1").await, 4, "a replay");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 4);
}

/// What the checkout test is there to find, the claim's first message finds
/// without it: a first execution on a connection the server has dropped
/// begins again on a connection the pool tested, runs its handler once, and
/// its retry replays.
#[tokio::test]
async fn without_the_checkout_test_a_claim_on_a_dropped_connection_begins_again() {
    let (db, pool) = widgets_on_one_connection().await;
    let r = router(
        Idem::new(pool.clone())
            .with_session_statements(true)
            .with_checkout_test(false),
    );
    let widget = |key: &str| request("/widgets", key, json!({"name": "a"}));
    // The session prepared, so the claim below fails on its connection alone.
    let (status, _, _) = send(&r, widget("k0")).await;
    assert!(status.is_success(), "{status}");
    let pid = end_the_idle_connection(&pool, &db).await;

    let (status, replayed, first) = send(&r, widget("k1")).await;
    assert!(status.is_success() && !replayed, "{status}: {first:?}");
    let now = backend_pid(&pool).await;
    assert_ne!(now, pid, "the dropped connection was replaced");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
    let (status, replayed, body) = send(&r, widget("k1")).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
    assert_went_back_clean(&pool, &db).await;
}

/// The checkout test is the pool's: on (the default), a first execution's
/// connection passes the pool's `before_acquire`; off, an idle one does not
/// (what `Idem::with_checkout_test` warns of). So does a remembered key's
/// execution anew (its row purged): on, it begins on a tested connection; off,
/// on the one its read used.
#[tokio::test]
async fn the_checkout_test_runs_the_pools_before_acquire_for_a_first_execution() {
    let (db, pool, tested) = widgets_with_their_backends(1).await;
    let idem = Idem::new(pool.clone()).with_session_statements(true);
    for (checkout_test, key, hook_runs) in [(true, "k1", 1), (false, "k2", 0)] {
        let r = router(idem.clone().with_checkout_test(checkout_test));
        for execution in ["first", "anew, remembered"] {
            until_idle(&pool).await;
            let before = tested.lock().unwrap().len();
            let (status, replayed, _) =
                send(&r, request("/widgets", key, json!({"name": "a"}))).await;
            assert!(status.is_success() && !replayed, "{status}");
            assert_eq!(
                tested.lock().unwrap().len() - before,
                hook_runs,
                "before_acquire runs with the checkout test {checkout_test}: {execution}"
            );
            db.exec("DELETE FROM idempotency_requests").await;
        }
    }
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 4);
    assert_went_back_clean(&pool, &db).await;
}

/// A pool that does not ping its checkouts (`test_before_acquire(false)`)
/// still runs its `before_acquire` on a first execution's connection, and the
/// claim's first message is the test the ping would have been: after a server
/// restart every idle connection is dropped, and the claim closes each as it
/// finds it so and begins on a new one, running its handler once, with the
/// hook seeing every idle connection it was given. So does a remembered key's
/// read: its retry replays after the next restart.
#[tokio::test]
async fn without_the_pools_ping_a_claim_and_a_replay_get_past_every_dropped_connection() {
    let hooked = Arc::new(AtomicU64::new(0));
    let counted = hooked.clone();
    // The hook only counts: one that queried would test the connection itself.
    let (db, pool) = widgets_on(
        PgPoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .before_acquire(move |_, _| {
                counted.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(true) })
            }),
    )
    .await;
    let hook_runs = || hooked.load(Ordering::SeqCst);
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let ended = end_both_connections(&pool, &db).await;
    let before = hook_runs();

    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, replayed, first) = send(&r, widget()).await;
    assert!(status.is_success() && !replayed, "{status}: {first:?}");
    // The new connection is `after_connect`'s: `before_acquire` sees idle ones.
    assert_eq!(
        hook_runs() - before,
        2,
        "the hook saw both dropped connections"
    );
    let now = backend_pid(&pool).await;
    assert!(
        !ended.contains(&now),
        "the dropped connections were replaced"
    );

    end_both_connections(&pool, &db).await;
    let (status, replayed, body) = send(&r, widget()).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// Opens `pool`'s two connections, lets them go back idle, then ends both
/// from the server's side (as a restart would): their backends' pids.
async fn end_both_connections(pool: &PgPool, db: &TestDb) -> [i32; 2] {
    let (mut a, mut b) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    let ended = [backend_pid(&mut *a).await, backend_pid(&mut *b).await];
    drop((a, b));
    until("both connections came back", || async {
        pool.num_idle() == 2
    })
    .await;
    for pid in ended {
        end_backend(db, pid).await;
    }
    ended
}

/// A session's plan for idem's key lookups stays on the primary key while the
/// table is young: PostgreSQL builds a prepared statement's generic plan once
/// (at its sixth execution) and keeps it until the table's statistics change,
/// so one built after an ANALYZE of a tiny table is a sequential scan that the
/// session keeps as the table grows. The migration holds the first automatic
/// ANALYZE back until the table is past that size; before any ANALYZE the
/// planner takes the key, which the probe's plan after seven first executions
/// shows.
#[tokio::test]
async fn the_probes_plan_keeps_to_the_key_until_the_table_is_analysed() {
    let (db, pool) = widgets_on_one_connection().await;
    let options: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE oid = 'idempotency_requests'::regclass",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        options.contains(&"autovacuum_analyze_threshold=1000".to_owned()),
        "{options:?}"
    );
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    for i in 0..7 {
        let (status, _, _) = send(
            &r,
            request("/widgets", &format!("k{i}"), json!({"name": "a"})),
        )
        .await;
        assert!(status.is_success(), "{status}");
    }
    let plan: Vec<String> = sqlx::raw_sql(
        "EXPLAIN EXECUTE idem_probe_3('acme', 'create-widget', '\\x00'::bytea, '1000')",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .iter()
    .map(|row| row.get(0))
    .collect();
    assert!(
        plan.iter()
            .any(|l| l.contains("Index Scan using idempotency_requests_pkey")),
        "{plan:#?}"
    );
}

/// A row for the table's rules: `digest` and `fingerprint` bytes long, in
/// `state`, with `status` (SQL: a number or `NULL`).
fn rule_row(key: &str, digest: usize, fingerprint: usize, state: &str, status: &str) -> String {
    format!(
        "INSERT INTO idempotency_requests \
            (tenant_id, operation, key_digest, fingerprint, state, response_status, expires_at) \
         VALUES ('acme', 'op', substring(sha256('{key}') || sha256('x') from 1 for {digest}), \
                 substring(sha256('f') || sha256('g') from 1 for {fingerprint}), '{state}', \
                 {status}, now() + interval '1 hour')"
    )
}

/// The table's five rules are one CHECK constraint, since PostgreSQL prepares
/// each constraint anew for every statement that writes the table: a schema an
/// earlier release left, with a finished row in it, is upgraded to the one
/// constraint, validated, and each rule still refuses what it refused.
#[tokio::test]
async fn the_tables_rules_hold_as_one_validated_constraint_after_an_upgrade() {
    let db = TestDb::migrated_before(20261205000002).await;
    db.exec(&rule_row("kept", 32, 32, "completed", "201")).await;
    idem_runtime::migrate(&db.pool).await.unwrap();
    let checks: Vec<(String, bool)> = sqlx::query_as(
        "SELECT conname::text, convalidated FROM pg_constraint \
          WHERE conrelid = 'idempotency_requests'::regclass AND contype = 'c'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        checks,
        [("idempotency_requests_row_check".to_owned(), true)],
        "one constraint, validated"
    );
    for (what, row) in [
        (
            "a 31-byte digest",
            rule_row("a", 31, 32, "completed", "201"),
        ),
        (
            "a 33-byte fingerprint",
            rule_row("b", 32, 33, "completed", "201"),
        ),
        ("a state of no name", rule_row("c", 32, 32, "done", "201")),
        (
            "a status past 599",
            rule_row("d", 32, 32, "completed", "600"),
        ),
        ("a status under 100", rule_row("e", 32, 32, "failed", "99")),
        (
            "finished without a status",
            rule_row("f", 32, 32, "failed", "NULL"),
        ),
    ] {
        let err = sqlx::raw_sql(sqlx::AssertSqlSafe(row))
            .execute(&db.pool)
            .await
            .expect_err(what);
        let db_err = err.as_database_error().expect(what);
        assert_eq!(db_err.code().as_deref(), Some("23514"), "{what}: {err}");
        assert_eq!(
            db_err.constraint(),
            Some("idempotency_requests_row_check"),
            "{what}"
        );
    }
    // What the rules allow still goes in: in flight without a status.
    db.exec(&rule_row("g", 32, 32, "processing", "NULL")).await;
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        2
    );
}

/// A read of a remembered key that stalls (the connection cut without a
/// word) ends with the request's deadline, and its connection is closed, not
/// given back to wait in its release ping for an answer that is not coming:
/// the pool's only slot is free for the next request.
#[tokio::test]
async fn a_stalled_read_of_a_remembered_key_frees_its_pool_slot() {
    let (_db, proxy, pool) = widgets_through(false, 1).await;
    let r = router(
        Idem::new(pool.clone())
            .with_session_statements(true)
            .with_in_flight_wait(std::time::Duration::from_millis(100))
            .with_request_deadline(std::time::Duration::from_secs(1)),
    );
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, _, first) = send(&r, widget()).await;
    assert!(status.is_success(), "{status}: {first:?}");
    until_idle(&pool).await;

    proxy.stall.send_replace(true);
    let (status, _, body) = send(&r, widget()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    until("the stalled connection gave up the pool's slot", || async {
        pool.size() == 0
    })
    .await;
    proxy.stall.send_replace(false);
    let (status, replayed, body) = send(&r, widget()).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer, on a new connection");
}

/// The same where the pool keeps no session (the path of bound parameters): a
/// first execution's read of its key before the transaction stalls, ends with
/// the request's deadline, and its connection is closed; the key executes
/// once the connection is back.
#[tokio::test]
async fn a_stalled_read_before_the_transaction_frees_its_pool_slot() {
    let (db, proxy, pool) = widgets_through(false, 1).await;
    let r = router(
        Idem::new(pool.clone())
            .with_session_statements(false)
            .with_in_flight_wait(std::time::Duration::from_millis(100))
            .with_request_deadline(std::time::Duration::from_secs(1)),
    );
    let widget = |key: &str| request("/widgets", key, json!({"name": "a"}));
    let (status, _, body) = send(&r, widget("k0")).await;
    assert!(status.is_success(), "{status}: {body:?}");
    until_idle(&pool).await;

    proxy.stall.send_replace(true);
    let (status, _, body) = send(&r, widget("k1")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    until("the stalled connection gave up the pool's slot", || async {
        pool.size() == 0
    })
    .await;
    proxy.stall.send_replace(false);
    let (status, replayed, body) = send(&r, widget("k1")).await;
    assert!(status.is_success() && !replayed, "{status}: {body:?}");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
}

/// A session that kept an earlier build's set (the probe, the inserts, and a
/// lookup named `idem_lookup_2`, here one that would answer nonsense) answers
/// a retry after the probe finds the key's row from the driver's lookup, never
/// that statement, and keeps its statements as they were.
#[tokio::test]
async fn a_session_with_an_earlier_lookup_replays_after_the_probe() {
    let (db, pool) = widgets_on_one_connection().await;
    let r = unhinted(&pool);
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, _, first) = send(&r, widget()).await;
    assert!(status.is_success(), "{status}: {first:?}");
    sqlx::raw_sql("PREPARE idem_lookup_2(text, text, bytea) AS SELECT 1")
        .execute(&pool)
        .await
        .unwrap();
    let statements = || async {
        sqlx::query_as::<_, (String, String)>(
            "SELECT name, statement FROM pg_prepared_statements \
              WHERE name LIKE 'idem\\_%' ORDER BY name",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let before = statements().await;
    let names: Vec<&str> = before.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "idem_finish_2",
            "idem_insert_1",
            "idem_lookup_2",
            "idem_probe_3"
        ]
    );
    let (status, replayed, body) = send(&r, widget()).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, first, "the stored answer");
    assert_eq!(statements().await, before, "nothing prepared again");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
    assert_went_back_clean(&pool, &db).await;
}

/// A row idem cannot read (its stored headers rewritten by hand into
/// something that is not a list of pairs) fails its retry, and leaves the
/// connection that read it as it was: the read's answer came in whole, so the
/// connection goes back to the pool rather than being closed and opened again
/// for every retry of that key.
#[tokio::test]
async fn an_unreadable_row_fails_its_retry_and_keeps_the_connection() {
    let (db, pool) = widgets_on_one_connection().await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, replayed, first) = send(&r, widget()).await;
    assert!(status.is_success() && !replayed, "{status}: {first:?}");
    db.exec("UPDATE idempotency_requests SET response_headers = '{\"a\": 1}'::jsonb")
        .await;
    let pid = backend_pid(&pool).await;
    for _ in 0..2 {
        until_idle(&pool).await;
        let (status, replayed, body) = send(&r, widget()).await;
        assert!(status.is_server_error() && !replayed, "{status}: {body:?}");
        // Not "nothing was stored": the key holds an outcome, and a client
        // that believed otherwise might pay again under a new key.
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .starts_with("this key's outcome could not be read"),
            "{problem}"
        );
    }
    until_idle(&pool).await;
    assert_eq!(backend_pid(&pool).await, pid, "the connection was kept");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// A key this process remembers as finished is still decided by the database:
/// its row gone (purged behind the process's back), the retry executes anew; a
/// session that lost idem's statements still reads it (the read needs none);
/// another request under the key is refused; its row expired, it is taken
/// over, the statements prepared again by the probe that claim begins with.
#[tokio::test]
async fn a_remembered_key_is_decided_by_the_database() {
    let (db, pool) = widgets_on_one_connection().await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let widget = |name: &str| request("/widgets", "k1", json!({ "name": name }));
    let (status, replayed, _) = send(&r, widget("a")).await;
    assert!(status.is_success() && !replayed, "{status}");

    db.exec("DELETE FROM idempotency_requests").await;
    let (status, replayed, anew) = send(&r, widget("a")).await;
    assert!(status.is_success(), "{status}: {anew:?}");
    assert!(!replayed, "a key without a row executes anew");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);

    sqlx::raw_sql(DEALLOCATE_IDEMS)
        .execute(&pool)
        .await
        .unwrap();
    // Idle, so that the read takes it as it is (untested).
    until_idle(&pool).await;
    let (status, replayed, body) = send(&r, widget("a")).await;
    assert!(status.is_success() && replayed, "{status}: {body:?}");
    assert_eq!(body, anew, "the stored answer of the second execution");

    let (status, _, _) = send(&r, widget("b")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);

    // Expired, its row still there, in that session (still without idem's
    // statements): the set is prepared again and the key taken over.
    db.exec(EXPIRE_ALL).await;
    until_idle(&pool).await;
    let (status, replayed, body) = send(&r, widget("b")).await;
    assert!(status.is_success() && !replayed, "{status}: {body:?}");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 3);
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2
    );
    assert_went_back_clean(&pool, &db).await;
}

/// What ends idem's session statements in a session (a pooler's
/// `DEALLOCATE`, or an administrator's), leaving the driver's own.
const DEALLOCATE_IDEMS: &str =
    "DEALLOCATE idem_probe_3; DEALLOCATE idem_insert_1; DEALLOCATE idem_finish_2";

/// A remembered key whose idle connection turns out dropped is read on a new
/// one from `acquire()`, a session that has none of idem's statements (the
/// read needs none): found expired there, its claim begins with the probe,
/// which prepares them, and the key is taken over, not failed at `COMMIT` for
/// a statement the session lacks.
#[tokio::test]
async fn a_remembered_key_read_on_a_new_session_executes_again() {
    let (db, pool) = widgets_on_one_connection().await;
    let r = router(Idem::new(pool.clone()).with_session_statements(true));
    let widget = || request("/widgets", "k1", json!({"name": "a"}));
    let (status, replayed, first) = send(&r, widget()).await;
    assert!(status.is_success() && !replayed, "{status}: {first:?}");

    db.exec(EXPIRE_ALL).await;
    let pid = end_the_idle_connection(&pool, &db).await;
    let (status, replayed, body) = send(&r, widget()).await;
    assert!(status.is_success() && !replayed, "{status}: {body:?}");
    assert_ne!(backend_pid(&pool).await, pid, "a new session");
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2
    );
    assert_went_back_clean(&pool, &db).await;
}

/// Where sessions are not kept (or the session path is turned off), each of
/// idem's statements is sent with bound parameters, a round trip each.
#[tokio::test]
async fn without_session_statements_a_first_execution_adds_two_round_trips() {
    let c = Counted::measure(false).await;
    let bare = c.bare;
    // The lookup before BEGIN (which carries the deadline in the same message)
    // and the row's insert before COMMIT.
    assert_eq!(c.first, bare + 2, "a first execution");
    // The lookup alone, no transaction.
    assert_eq!(c.replay, 3, "a replay");

    // Claiming before the handler: idem_claim instead of the lookup, and an
    // UPDATE instead of the insert; the same count, each row written twice.
    // The session path does not apply to it.
    let off = router(
        Idem::new(c.pool.clone())
            .with_claims_at_commit(false)
            .with_session_statements(true),
    );
    // (Its statements are prepared by their first use: two more.)
    assert_eq!(c.count(&off, "/widgets", "k2").await, bare + 2 + 2);
    assert_eq!(c.count(&off, "/widgets", "k3").await, bare + 2);
    assert_eq!(c.db.count("SELECT count(*) FROM widgets").await, 6);
}

#[tokio::test]
async fn a_savepoint_in_the_handler_stays_a_savepoint() {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()));

    let (status, _, _) = widget(&r, "k1", "savepoint-rollback").await;
    assert_eq!(status, StatusCode::CREATED);
    let names: Vec<String> = sqlx::query_scalar("SELECT name FROM widgets ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(names, ["kept", "after"]);
    let (status, replayed, _) = widget(&r, "k1", "savepoint-rollback").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));

    // Releasing a savepoint commits nothing: the handler's Err still rolls back
    // everything, and the key stays free.
    let (status, _, _) = widget(&r, "k2", "savepoint-commit-then-err").await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(
        db.count("SELECT count(*) FROM widgets WHERE name = 'released'")
            .await,
        0
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM idempotency_requests WHERE key_digest = {}",
            db.key("k2")
        ))
        .await,
        0
    );
}

#[tokio::test]
async fn a_completion_that_fails_commits_nothing() {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()));
    let (status, _, body) = widget(&r, "k1", "break-completion").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:store-unavailable");
    // Neither the effect nor a record committed, and the key is free.
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    let (status, replayed, _) = widget(&r, "k1", "plain").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
}

/// The three ways a first execution stores its answer on PostgreSQL: idem's
/// statements in the session (the default on a direct connection), with bound
/// parameters (behind a pooler that keeps no session), and the key claimed
/// before the handler.
fn every_store_path(pool: &PgPool) -> [(&'static str, Idem<Db>); 3] {
    [
        (
            "session",
            Idem::new(pool.clone()).with_session_statements(true),
        ),
        (
            "bound",
            Idem::new(pool.clone()).with_session_statements(false),
        ),
        (
            "claimed-first",
            Idem::new(pool.clone()).with_claims_at_commit(false),
        ),
    ]
}

/// A handler whose statement failed (a unique violation), which aborts the
/// whole transaction on PostgreSQL, and which answered `409` rather than
/// returning it as its `Err`: idem's row cannot be written in that
/// transaction, so the `409` is sent as an `Err`'s would be, nothing of it is
/// stored, nothing committed (the widget written before it is gone), and the
/// retry runs the handler again.
#[tokio::test]
async fn a_client_error_answered_after_a_failed_statement_is_sent_not_stored() {
    let db = widgets_with_a_taken_name().await;
    for (how, idem) in every_store_path(&db.pool) {
        let r = router(idem);
        let key = format!("k-{how}");
        let body = json!({"name": "taken", "mode": "natural-answered"});
        let (status, replayed, answered) = send(&r, request("/widgets", &key, body.clone())).await;
        assert_eq!(
            (status, replayed),
            (StatusCode::CONFLICT, false),
            "{how}: {}",
            String::from_utf8_lossy(&answered)
        );
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&answered).unwrap(),
            json!({"duplicate": true}),
            "{how}"
        );
        assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0, "{how}");
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0,
            "{how}"
        );
        // The name freed, the retry runs the handler, which now succeeds and
        // takes the name again for the next path.
        db.exec("DELETE FROM naturals").await;
        let (status, replayed, _) = send(&r, request("/widgets", &key, body)).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false), "{how}");
        db.exec("DELETE FROM widgets").await;
        db.exec("DELETE FROM idempotency_requests").await;
    }
}

/// After a rollback on a path that claims at commit (the handler's `Err`, or a
/// client error answered over an aborted transaction), idem reads the key to
/// see whether another execution finished it meanwhile (a duplicate on
/// another process, whose committed row the handler's error may be about).
/// Where that read fails, the key's outcome is not known: the answer is a
/// `503` that says so and asks for the same key, never the handler's own
/// answer, which could contradict a stored success. Nothing committed.
#[tokio::test]
async fn a_key_that_cannot_be_looked_up_after_a_rollback_answers_503_not_the_handlers_answer() {
    let db = widgets_with_a_taken_name().await;
    let pool = refusing_checkouts(&LOOKUPS_FAIL)
        .connect(&db.url)
        .await
        .unwrap();
    for (how, idem) in every_store_path(&pool).into_iter().take(2) {
        let r = router(idem);
        for mode in ["natural-answered-lookups-fail", "err-lookups-fail"] {
            LOOKUPS_FAIL.store(false, Ordering::SeqCst);
            let answered = send(
                &r,
                request(
                    "/widgets",
                    &format!("k-{how}-{mode}"),
                    json!({"name": "taken", "mode": mode}),
                ),
            )
            .await;
            LOOKUPS_FAIL.store(false, Ordering::SeqCst);
            assert_outcome_unknown(&answered, &format!("{how}, {mode}"));
            assert_eq!(
                db.count("SELECT count(*) FROM widgets").await,
                0,
                "{how}, {mode}"
            );
            assert_eq!(
                db.count("SELECT count(*) FROM idempotency_requests").await,
                0,
                "{how}, {mode}"
            );
        }
    }
}

/// The same failed statement ignored, and a `201` answered: what it reports
/// was rolled back, so it is refused with `503` on every path, and nothing is
/// stored or committed.
#[tokio::test]
async fn a_success_answered_after_a_failed_statement_is_refused() {
    let db = widgets_with_a_taken_name().await;
    for (how, idem) in every_store_path(&db.pool) {
        let r = router(idem);
        let (status, replayed, answered) = send(
            &r,
            request(
                "/widgets",
                &format!("k-{how}"),
                json!({"name": "taken", "mode": "natural-ignored"}),
            ),
        )
        .await;
        assert_eq!(
            (status, replayed),
            (StatusCode::SERVICE_UNAVAILABLE, false),
            "{how}"
        );
        let problem: serde_json::Value = serde_json::from_slice(&answered).unwrap();
        assert_eq!(
            problem["type"], "urn:idem:problem:store-unavailable",
            "{how}"
        );
        assert_eq!(db.count("SELECT count(*) FROM widgets").await, 0, "{how}");
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0,
            "{how}"
        );
    }
}

/// A key just read and decided to execute (its row expired), whose `BEGIN`
/// message then fails after its `BEGIN` (the proxy breaks the request
/// deadline's `set_config`): the driver's queued `ROLLBACK` is sent before the
/// connection goes back, inside the aborted transaction (no warning), and
/// nothing is claimed: the answer is a 503 and the retry executes. Both ways to
/// that read: a key this process remembers (read first), and one read after
/// the probe (replay hints off).
#[tokio::test]
async fn a_begin_that_fails_after_the_read_is_rolled_back_before_the_connection_goes_back() {
    let (db, proxy, pool) = widgets_through(false, 1).await;
    for (n, (how, idem, key)) in [
        ("remembered", Idem::new(pool.clone()), "k1"),
        (
            "after the probe",
            Idem::new(pool.clone()).with_replay_hints(false),
            "k2",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let r = router(idem.with_session_statements(true));
        let (status, _, body) = widget(&r, key, "plain").await;
        assert_eq!(status, StatusCode::CREATED, "{how}: {body:?}");
        // Replayed once, so that a process with hints remembers the key.
        let (status, replayed, _) = widget(&r, key, "plain").await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true), "{how}");
        db.exec(EXPIRE_ALL).await;
        let widgets = db.count("SELECT count(*) FROM widgets").await;

        proxy.break_deadlines.send_replace(true);
        let (status, _, body) = widget(&r, key, "plain").await;
        proxy.break_deadlines.send_replace(false);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{how}: {body:?}");
        assert_eq!(
            proxy.broken_deadlines(),
            n as u64 + 1,
            "{how}: one BEGIN broken"
        );
        assert_eq!(
            proxy.no_transaction_warnings(),
            0,
            "{how}: the ROLLBACK ran inside the aborted transaction"
        );
        assert_went_back_clean(&pool, &db).await;
        assert_eq!(
            db.count("SELECT count(*) FROM widgets").await,
            widgets,
            "{how}: no effect"
        );

        // Nothing was claimed: the retry executes, at the next generation.
        let (status, replayed, body) = widget(&r, key, "plain").await;
        assert_eq!(
            (status, replayed),
            (StatusCode::CREATED, false),
            "{how}: {body:?}"
        );
        assert_eq!(
            db.count("SELECT count(*) FROM widgets").await,
            widgets + 1,
            "{how}"
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests WHERE generation = 2")
            .await,
        2,
        "each key taken over once"
    );
}

/// A duplicate on another process whose handler ran into the first's own row
/// (the application's unique key) and answered a 4xx itself: its transaction is
/// aborted, so its outcome cannot be stored, and the key holds the first's
/// outcome by then: it answers that (replayed), not a 503.
#[tokio::test]
async fn a_duplicate_whose_handler_hit_the_winners_row_replays_the_winner() {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    db.exec("CREATE TABLE naturals (nk text UNIQUE)").await;
    let here = router(Idem::new(db.pool.clone()));
    let there = router(Idem::new(db.pool.clone()));
    let observer = PgPool::connect(&db.url).await.unwrap();
    let body = json!({"name": "nat-1", "mode": "natural"});
    let gate = Gate::named("nat-1");
    let first = {
        let (here, body) = (here.clone(), body.clone());
        tokio::spawn(async move { send(&here, request("/widgets", "k-nat", body)).await })
    };
    gate.arrival().await;
    let second = {
        let (there, body) = (there.clone(), body.clone());
        tokio::spawn(async move { send(&there, request("/widgets", "k-nat", body)).await })
    };
    // Until the second's insert waits for the first's uncommitted row.
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock' \
                    AND strpos(query, 'INSERT INTO naturals') > 0",
            )
            .fetch_one(&observer)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the second waits on the first's row");
    gate.open(1);
    let (status, replayed, won) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, answered) = second.await.unwrap();
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, true),
        "{:?}",
        String::from_utf8_lossy(&answered)
    );
    assert_eq!(answered, won);
    assert_eq!(db.count("SELECT count(*) FROM naturals").await, 1);
}

/// The claim's `lock_timeout` (the in-flight wait) bounds idem's insert only:
/// the `COMMIT` after it, which checks the handler's deferred constraints, waits
/// for a conflicting transaction as long as it would without idem, and commits
/// when that one rolls back.
#[tokio::test]
async fn the_commit_waits_for_deferred_checks_without_the_in_flight_bound() {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    db.exec("CREATE TABLE codes (code text UNIQUE DEFERRABLE INITIALLY DEFERRED)")
        .await;
    let observer = PgPool::connect(&db.url).await.unwrap();
    let mut holder = observer.begin().await.unwrap();
    sqlx::query("INSERT INTO codes (code) VALUES ('c-1')")
        .execute(&mut *holder)
        .await
        .unwrap();
    let r = router(
        Idem::new(db.pool.clone()).with_in_flight_wait(std::time::Duration::from_millis(50)),
    );
    let request_task = {
        let r = r.clone();
        tokio::spawn(async move {
            send(
                &r,
                request(
                    "/widgets",
                    "k-deferred",
                    json!({"name": "c-1", "mode": "deferred"}),
                ),
            )
            .await
        })
    };
    // Until the request's COMMIT waits for the holder's row (or it ended).
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock' \
                    AND query ~ 'COMMIT'",
            )
            .fetch_one(&observer)
            .await
            .unwrap();
            if waiting == 1 || request_task.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the COMMIT reached the holder's row");
    // Until the COMMIT has waited six times the in-flight wait, by the
    // server's clock: a COMMIT bounded by that wait would have given up.
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            let long: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock' \
                    AND query ~ 'COMMIT' AND now() - query_start >= interval '300 milliseconds'",
            )
            .fetch_one(&observer)
            .await
            .unwrap();
            if long == 1 || request_task.is_finished() {
                break;
            }
            // A poll interval: what is awaited is the condition above.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the COMMIT kept waiting or ended");
    assert!(
        !request_task.is_finished(),
        "the COMMIT gave up at the in-flight wait: {:?}",
        request_task.await
    );
    holder.rollback().await.unwrap();
    let (status, replayed, _) = request_task.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(db.count("SELECT count(*) FROM codes").await, 1);
}

#[tokio::test]
async fn the_connection_goes_back_clean_after_every_answer() {
    let db = TestDb::with_pool_size(1).await;
    db.exec(WIDGETS).await;
    let r = router(Idem::new(db.pool.clone()));
    let cases = [
        ("k1", json!({"name": "a"}), StatusCode::CREATED),
        // replay
        ("k1", json!({"name": "a"}), StatusCode::CREATED),
        // mismatch
        ("k1", json!({"name": "b"}), StatusCode::UNPROCESSABLE_ENTITY),
        // the handler's Err rolls back
        (
            "k2",
            json!({"name": "a", "mode": "savepoint-commit-then-err"}),
            StatusCode::CONFLICT,
        ),
        // the completion fails
        (
            "k3",
            json!({"name": "a", "mode": "break-completion"}),
            StatusCode::SERVICE_UNAVAILABLE,
        ),
    ];
    let observer = PgPool::connect(&db.url).await.unwrap();
    // A key held by an open transaction elsewhere: the insert waits out its
    // bound, its transaction aborts and rolls back, and the answer is 409.
    let impatient = router(
        Idem::new(db.pool.clone()).with_in_flight_wait(std::time::Duration::from_millis(50)),
    );
    let mut holder = observer.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_requests (tenant_id, operation, key_digest, fingerprint, \
                                           state, expires_at) \
         VALUES ('acme', 'create-widget', sha256('held'::bytea), decode(repeat('00', 32), 'hex'), \
                 'processing', now() + interval '1 hour')",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let (status, _, _) = send(
        &impatient,
        request("/widgets", "held", json!({"name": "a"})),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(
        state_of_the_only_connection(&db.pool, &observer).await,
        "idle",
        "the 409 left its connection inside a transaction"
    );
    holder.rollback().await.unwrap();
    for (key, body, expected) in cases {
        let (status, _, text) = send(&r, request("/widgets", key, body.clone())).await;
        assert_eq!(status, expected, "{key} {body}: {text:?}");
        assert_eq!(
            state_of_the_only_connection(&db.pool, &observer).await,
            "idle",
            "{key} {body} left its connection inside a transaction"
        );
    }
}

#[tokio::test]
async fn a_role_that_is_not_read_committed_still_claims_at_read_committed() {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    db.exec(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.name
    ))
    .await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    let idem = Idem::new(pool);
    let r = router(idem.clone());
    let (status, _, _) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, replayed, _) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 1);
}

/// Random text that SQL text would have to escape (the path binds it; this keeps
/// it honest): quotes, backslashes, dollar quotes, comment markers, semicolons
/// and non-ASCII, printed with the seed.
fn awkward_text(rng: &mut fastrand::Rng, ascii_only: bool) -> String {
    const PIECES: &[&str] = &[
        "'", "''", "\\", "\\'", "E'", "$$", "$x$", "--", "/*", "*/", ";", "\"", "%", "_", " ", "a",
        "Z", "9", "\\x00", "\\\\",
    ];
    const WIDE: &[&str] = &["é", "ß", "漢", "🦀", "\u{2028}", "\t", "\n"];
    let n = rng.usize(1..24);
    let mut s = String::new();
    for _ in 0..n {
        if !ascii_only && rng.u8(..) < 40 {
            s.push_str(WIDE[rng.usize(..WIDE.len())]);
        } else {
            s.push_str(PIECES[rng.usize(..PIECES.len())]);
        }
    }
    if ascii_only {
        // Keys are visible ASCII without surrounding white space, and bare ones hold no comma.
        s = s.trim().replace(['\t', '\n'], "-");
        if s.is_empty() {
            s.push('k');
        }
    }
    s
}

#[tokio::test]
async fn awkward_tenants_and_keys_are_stored_and_replayed_exactly() {
    let seed = std::env::var("IDEM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("seed {seed} (IDEM_TEST_SEED={seed} repeats this run)");
    let mut rng = fastrand::Rng::with_seed(seed);
    let db = TestDb::new().await;
    let idem: Idem<Postgres> = Idem::new(db.pool.clone());
    for i in 0..60 {
        let tenant = awkward_text(&mut rng, false);
        let key_text = awkward_text(&mut rng, true);
        let Ok(key) = IdempotencyKey::parse(format!("\"{}\"", sf_escape(&key_text))) else {
            panic!("seed {seed}: key {key_text:?} was refused");
        };
        let fingerprint: Fingerprint =
            FingerprintBuilder::new(&tenant, "op", "POST", "/x").finish();
        let req = ClaimRequest {
            tenant: &tenant,
            operation: "op",
            key: &key,
            fingerprint,
            retention: std::time::Duration::from_secs(3600),
            in_flight_wait: std::time::Duration::from_secs(2),
        };
        let (tx, claim) = Postgres::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, req.in_flight_wait),
            &req,
        )
        .await
        .unwrap();
        let Claim::Execute(execution) = claim else {
            panic!("seed {seed}, case {i}: {tenant:?}/{key_text:?} did not execute: {claim:?}");
        };
        let stored = StoredResponse {
            status: 201,
            headers: vec![("location".into(), format!("/x/{}", tenant.escape_default()))],
            body: Bytes::from(format!("{tenant}|{key_text}").into_bytes()),
        };
        assert!(
            matches!(
                Postgres::finish(
                    &idem_runtime::test_util::claim_context(&idem, Default::default()),
                    tx,
                    execution,
                    &stored
                )
                .await,
                Finish::Committed
            ),
            "seed {seed}, case {i}"
        );
        let row: (String, Vec<u8>) = sqlx::query_as(
            "SELECT tenant_id, key_digest FROM idempotency_requests \
              WHERE tenant_id = $1 AND key_digest = $2",
        )
        .bind(&tenant)
        .bind(key.digest().as_bytes().as_slice())
        .fetch_one(&db.pool)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}, case {i}: row not found: {e}"));
        assert_eq!(
            row,
            (tenant.clone(), key.digest().as_bytes().to_vec()),
            "seed {seed}"
        );
        let (_, again) = Postgres::begin_claim(
            &idem_runtime::test_util::claim_context(&idem, req.in_flight_wait),
            &req,
        )
        .await
        .unwrap();
        match again {
            Claim::Replay(r) => assert_eq!(r, stored, "seed {seed}, case {i}"),
            other => panic!("seed {seed}, case {i}: {other:?}"),
        }
    }
    assert!(idem.claims_at_commit());
}

/// Escapes `"` and `\` for an RFC 8941 string.
fn sf_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// No function of idem's runs on the handler's path: with every one of them
/// dropped, a first execution, a replay, a mismatch and an expired key work.
#[tokio::test]
async fn the_handlers_path_needs_no_function_of_idems() {
    let db = TestDb::new().await;
    db.exec(WIDGETS).await;
    let functions = "SELECT count(*) FROM pg_proc WHERE proname LIKE 'idem\\_%'";
    assert_eq!(
        db.count(functions).await,
        2,
        "idem_claim and idem_claim_leased"
    );
    db.exec("DROP FUNCTION idem_claim, idem_claim_leased").await;
    let r = router(Idem::new(db.pool.clone()));
    let (status, _, _) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, replayed, _) = send(&r, request("/widgets", "k1", json!({"name": "a"}))).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    let (status, _, _) = send(&r, request("/widgets", "k1", json!({"name": "b"}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    db.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second'")
        .await;
    let (status, replayed, _) = send(&r, request("/widgets", "k1", json!({"name": "b"}))).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(db.count("SELECT count(*) FROM widgets").await, 2);
}

/// A claim of `key` for tenant `acme`, operation `op`, waiting `in_flight_wait`.
fn acme_op(key: &IdempotencyKey, in_flight_wait: std::time::Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        tenant: "acme",
        operation: "op",
        key,
        fingerprint: FingerprintBuilder::new("acme", "op", "POST", "/x").finish(),
        retention: std::time::Duration::from_secs(3600),
        in_flight_wait,
    }
}

/// What the server sees of a session (its logs print the same text,
/// pg_stat_activity shows it) never holds the key. On the bound-parameter path
/// it holds neither the key nor its digest, for the lookup and `BEGIN` nor for
/// the completion; on the session path the digest travels as hex inside
/// `EXECUTE` (a one-way hash of the key, the row's primary key), the key never.
#[tokio::test]
async fn statements_carry_neither_the_key_nor_its_digest() {
    let (texts, digest) = statements_seen(false).await;
    assert!(texts[1].contains("$3"), "{}", texts[1]);
    for text in &texts {
        assert!(!text.contains("SECRET"), "{text}");
        assert!(!text.contains(&digest), "{text}");
    }
}

#[tokio::test]
async fn session_statements_carry_the_digest_never_the_key() {
    let (texts, digest) = statements_seen(true).await;
    assert!(texts[0].contains("EXECUTE idem_probe_3("), "{}", texts[0]);
    assert!(
        texts[1].starts_with("EXECUTE idem_insert_1("),
        "{}",
        texts[1]
    );
    assert!(texts[1].contains(&digest), "{}", texts[1]);
    for text in &texts {
        assert!(!text.contains("SECRET"), "{text}");
    }
}

/// The texts the server shows for a claim's `BEGIN` and for its completion (held
/// on a lock while looked at), and the key's digest in hex.
async fn statements_seen(session: bool) -> (Vec<String>, String) {
    let db = TestDb::new().await;
    let idem: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(session);
    let key = IdempotencyKey::parse("sk_live_SECRET_77").unwrap();
    let req = acme_op(&key, std::time::Duration::from_secs(2));
    let observer = PgPool::connect(&db.url).await.unwrap();
    let digest = key.digest().to_string();
    let sessions = || {
        let observer = observer.clone();
        async move {
            let texts: Vec<String> = sqlx::query_scalar(
                "SELECT query FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_all(&observer)
            .await
            .unwrap();
            texts
        }
    };
    // The completion (an INSERT) will run into a trigger that waits for a lock
    // the observer holds, so that its statement is the session's current one
    // while looked at.
    db.exec(
        "CREATE FUNCTION test_hold() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$; \
         CREATE TRIGGER test_hold BEFORE INSERT ON idempotency_requests \
         FOR EACH ROW EXECUTE FUNCTION test_hold()",
    )
    .await;

    let (tx, claim) = Postgres::begin_claim(
        &idem_runtime::test_util::claim_context(&idem, req.in_flight_wait),
        &req,
    )
    .await
    .unwrap();
    let Claim::Execute(execution) = claim else {
        panic!("a new key executes: {claim:?}");
    };
    let begun = sessions()
        .await
        .into_iter()
        .find(|q| q.starts_with("BEGIN ISOLATION LEVEL READ COMMITTED"))
        .expect("the claim's BEGIN");

    let mut holder = observer.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let stored = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"ok"),
    };
    let finishing = {
        let idem = idem.clone();
        tokio::spawn(async move {
            Postgres::finish(
                &idem_runtime::test_util::claim_context(&idem, Default::default()),
                tx,
                execution,
                &stored,
            )
            .await
        })
    };
    // Until the completion waits on the lock (the timeout only turns a hang
    // into a failure).
    let inserting = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            let waiting: Vec<String> = sqlx::query_scalar(
                "SELECT query FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock' \
                    AND (strpos(query, 'INSERT INTO idempotency_requests') > 0 \
                         OR strpos(query, 'EXECUTE idem_insert_1') > 0)",
            )
            .fetch_all(&observer)
            .await
            .unwrap();
            if let Some(q) = waiting.into_iter().next() {
                break q;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the completion reached the trigger");
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *holder)
        .await
        .unwrap();
    assert!(matches!(finishing.await.unwrap(), Finish::Committed));
    (vec![begun, inserting], digest)
}

/// A request's own in-flight wait past `lock_timeout`'s ceiling (`i32::MAX` ms)
/// is that ceiling at the completion's insert too, not a claim that always fails.
#[tokio::test]
async fn a_claim_at_commit_with_an_in_flight_wait_past_the_ceiling_commits() {
    let db = TestDb::new().await;
    let idem: Idem<Postgres> = Idem::new(db.pool.clone());
    let key = IdempotencyKey::parse("k-long-wait").unwrap();
    let req = acme_op(&key, std::time::Duration::from_secs(30 * 24 * 3600));
    let (tx, claim) = Postgres::begin_claim(
        &idem_runtime::test_util::claim_context(&idem, req.in_flight_wait),
        &req,
    )
    .await
    .unwrap();
    let Claim::Execute(execution) = claim else {
        panic!("{claim:?}");
    };
    let stored = StoredResponse {
        status: 200,
        headers: vec![],
        body: Bytes::new(),
    };
    assert!(matches!(
        Postgres::finish(
            &idem_runtime::test_util::claim_context(&idem, Default::default()),
            tx,
            execution,
            &stored
        )
        .await,
        Finish::Committed
    ));
}

/// The session path's SQL text holds every tenant id, operation and stored
/// header exactly: a seeded property test against the server with strings made
/// of what could end or escape a literal (quotes, backslashes, `E'`, dollar
/// quotes, comments, semicolons), control characters and any Unicode. Each is
/// claimed, stored, read back through bound parameters, and replayed once the
/// session probe, its text holding the same strings, has found the row (replay
/// hints off, so that the retry takes the probe); a NUL is a clear error that
/// reserves nothing.
/// `IDEM_TEST_SEED=<seed>` repeats a run, `IDEM_TEST_CASES` runs more cases.
#[tokio::test]
async fn session_text_holds_any_tenant_and_operation() {
    const PIECES: &[&str] = &[
        "a", "Z", "0", " ", "'", "''", "\\", "\\'", "E'", "$$", "$x$", ";", "--", "/*", "*/", "\n",
        "\r", "\t", "\u{1}", "\u{7f}", "é", "€", "𝄞", "\u{2028}", "\u{feff}", "%", "_", ")", "(",
        ",", "\"", "\\x41", "\\\\",
    ];
    let seed = std::env::var("IDEM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("session text: seed {seed} (IDEM_TEST_SEED={seed} repeats it)");
    let mut rng = fastrand::Rng::with_seed(seed);
    let cases: usize = std::env::var("IDEM_TEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let text = |rng: &mut fastrand::Rng| -> String {
        let n = rng.usize(1..=12);
        (0..n).map(|_| PIECES[rng.usize(..PIECES.len())]).collect()
    };

    let db = TestDb::new().await;
    let idem: Idem<Postgres> = Idem::new(db.pool.clone())
        .with_session_statements(true)
        .with_replay_hints(false);
    let wait = std::time::Duration::from_secs(2);
    for case in 0..cases {
        let tenant = text(&mut rng);
        let operation = text(&mut rng);
        let header = text(&mut rng);
        let body: Vec<u8> = (0..rng.usize(0..64)).map(|_| rng.u8(..)).collect();
        let key = IdempotencyKey::parse(format!("k-{case}").as_str()).unwrap();
        let req = ClaimRequest {
            tenant: &tenant,
            operation: &operation,
            key: &key,
            fingerprint: FingerprintBuilder::new(&tenant, &operation, "POST", "/x").finish(),
            retention: std::time::Duration::from_secs(3600),
            in_flight_wait: wait,
        };
        let (tx, claim) =
            Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                .await
                .unwrap_or_else(|e| panic!("{tenant:?} / {operation:?}: {e}"));
        let Claim::Execute(execution) = claim else {
            panic!("{tenant:?} / {operation:?}: a new key executes: {claim:?}");
        };
        let stored = StoredResponse {
            status: 201,
            headers: vec![("x-note".to_owned(), header.clone())],
            body: Bytes::from(body.clone()),
        };
        let finished = Postgres::finish(
            &idem_runtime::test_util::claim_context(&idem, wait),
            tx,
            execution,
            &stored,
        )
        .await;
        assert!(
            matches!(finished, Finish::Committed),
            "{tenant:?} / {operation:?}: {finished:?}"
        );
        let (t, o, b): (String, String, Vec<u8>) = sqlx::query_as(
            "SELECT tenant_id, operation, response_body FROM idempotency_requests \
              WHERE key_digest = $1",
        )
        .bind(&key.digest().as_bytes()[..])
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            (t.as_str(), o.as_str()),
            (tenant.as_str(), operation.as_str())
        );
        assert_eq!(b, body);
        let (_, again) =
            Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                .await
                .unwrap();
        match again {
            Claim::Replay(replayed) => assert_eq!(replayed, stored, "{tenant:?}"),
            other => panic!("{tenant:?} / {operation:?}: a retry replays: {other:?}"),
        }
    }
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        cases as i64
    );

    // A NUL cannot be held by PostgreSQL's text: a clear error, nothing reserved.
    let key = IdempotencyKey::parse("k-nul").unwrap();
    let req = ClaimRequest {
        tenant: "acme\0evil",
        ..acme_op(&key, wait)
    };
    let Err(err) =
        Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req).await
    else {
        panic!("a NUL is refused");
    };
    assert!(err.to_string().contains("NUL"), "{err}");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        cases as i64
    );
}

/// The session path never gives a connection back inside a transaction, with
/// one of idem's settings left on it, or with a message half-read: after every
/// outcome (a first execution, a replay, a key taken by another execution, a
/// lock wait past the bound, a session that lost idem's statements, a handler
/// that never finished) the pool's one connection is outside any transaction
/// with the server's own settings.
#[tokio::test]
async fn session_path_connections_return_clean_from_every_outcome() {
    let db = TestDb::new().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let idem: Idem<Postgres> = Idem::new(pool.clone()).with_session_statements(true);
    let other: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(true);
    let wait = std::time::Duration::from_millis(200);
    let stored = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"ok"),
    };
    let clean = |what: &'static str| {
        let pool = pool.clone();
        async move {
            // A simple query: a transaction begun by it starts with it.
            let row = sqlx::raw_sql(
                "SELECT now() = statement_timestamp() AS fresh, \
                        current_setting('lock_timeout') AS lock, \
                        current_setting('statement_timeout') AS statement",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            let fresh: bool = row.get("fresh");
            let (lock, statement): (String, String) = (row.get("lock"), row.get("statement"));
            assert!(
                fresh,
                "{what}: the connection came back inside a transaction"
            );
            assert_eq!((lock.as_str(), statement.as_str()), ("0", "0"), "{what}");
        }
    };
    let execute = |idem: Idem<Postgres>, key: &'static str| {
        let stored = stored.clone();
        async move {
            let key = IdempotencyKey::parse(key).unwrap();
            let req = acme_op(&key, wait);
            let (tx, claim) =
                Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                    .await
                    .unwrap();
            let Claim::Execute(execution) = claim else {
                panic!("{claim:?}")
            };
            Postgres::finish(
                &idem_runtime::test_util::claim_context(&idem, wait),
                tx,
                execution,
                &stored,
            )
            .await
        }
    };

    assert!(matches!(
        execute(idem.clone(), "k1").await,
        Finish::Committed
    ));
    clean("a first execution").await;

    let key = IdempotencyKey::parse("k1").unwrap();
    let (tx, claim) = Postgres::begin_claim(
        &idem_runtime::test_util::claim_context(&idem, wait),
        &acme_op(&key, wait),
    )
    .await
    .unwrap();
    assert!(matches!(claim, Claim::Replay(_)), "{claim:?}");
    drop(tx);
    clean("a replay").await;

    // Another execution finishes the key while this one runs its handler.
    let key = IdempotencyKey::parse("k2").unwrap();
    let req = acme_op(&key, wait);
    let (tx, claim) =
        Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
            .await
            .unwrap();
    let Claim::Execute(execution) = claim else {
        panic!("{claim:?}")
    };
    assert!(matches!(
        execute(other.clone(), "k2").await,
        Finish::Committed
    ));
    let lost = Postgres::finish(
        &idem_runtime::test_util::claim_context(&idem, wait),
        tx,
        execution,
        &stored,
    )
    .await;
    assert!(matches!(lost, Finish::Taken(Claim::Replay(_))), "{lost:?}");
    clean("a key taken by another execution").await;

    // Another transaction holds the key past the in-flight bound.
    let key = IdempotencyKey::parse("k3").unwrap();
    let req = acme_op(&key, wait);
    let (tx, claim) =
        Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
            .await
            .unwrap();
    let Claim::Execute(execution) = claim else {
        panic!("{claim:?}")
    };
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_requests \
                (tenant_id, operation, key_digest, fingerprint, state, response_status, expires_at) \
         VALUES ('acme', 'op', $1, $2, 'completed', 201, now() + interval '1 hour')",
    )
    .bind(&key.digest().as_bytes()[..])
    .bind(&req.fingerprint.as_bytes()[..])
    .execute(&mut *holder)
    .await
    .unwrap();
    let held = Postgres::finish(
        &idem_runtime::test_util::claim_context(&idem, wait),
        tx,
        execution,
        &stored,
    )
    .await;
    assert!(
        matches!(held, Finish::Taken(Claim::InFlight { .. })),
        "{held:?}"
    );
    holder.rollback().await.unwrap();
    clean("a lock wait past the bound").await;

    // A session that lost idem's statements prepares them again.
    sqlx::raw_sql("DEALLOCATE idem_probe_3; DEALLOCATE idem_insert_1")
        .execute(&pool)
        .await
        .unwrap();
    assert!(matches!(
        execute(idem.clone(), "k4").await,
        Finish::Committed
    ));
    clean("statements prepared again").await;

    // A handler that never finished: its transaction is dropped.
    let key = IdempotencyKey::parse("k5").unwrap();
    let (tx, claim) = Postgres::begin_claim(
        &idem_runtime::test_util::claim_context(&idem, wait),
        &acme_op(&key, wait),
    )
    .await
    .unwrap();
    assert!(matches!(claim, Claim::Execute(_)), "{claim:?}");
    drop(tx);
    clean("a dropped transaction").await;
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        3
    );
}

/// A finished row whose insert waited for another holder of the key longer
/// than its retention still commits with its retention left: the wait's bound
/// is added to the expiry (docs/decisions.md, "Retention"). Deterministic: the
/// holder's uncommitted row keeps the insert waiting (seen waiting on the lock)
/// for longer than the retention, then rolls back.
#[tokio::test]
async fn a_row_that_waited_longer_than_its_retention_commits_live() {
    for session in [true, false] {
        row_that_waited_commits_live(session).await;
    }
}

async fn row_that_waited_commits_live(session: bool) {
    let db = TestDb::new().await;
    let idem: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(session);
    let wait = std::time::Duration::from_secs(5);
    let key = IdempotencyKey::parse("short-retention").unwrap();
    let req = ClaimRequest {
        retention: std::time::Duration::from_millis(300),
        ..acme_op(&key, wait)
    };
    let (tx, claim) =
        Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
            .await
            .unwrap();
    let Claim::Execute(execution) = claim else {
        panic!("{claim:?}")
    };
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_requests \
                (tenant_id, operation, key_digest, fingerprint, state, response_status, expires_at) \
         VALUES ('acme', 'op', $1, $2, 'completed', 201, now() + interval '1 hour')",
    )
    .bind(&key.digest().as_bytes()[..])
    .bind(&req.fingerprint.as_bytes()[..])
    .execute(&mut *holder)
    .await
    .unwrap();
    let stored = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"ok"),
    };
    let finishing = {
        let idem = idem.clone();
        tokio::spawn(async move {
            Postgres::finish(
                &idem_runtime::test_util::claim_context(&idem, wait),
                tx,
                execution,
                &stored,
            )
            .await
        })
    };
    let observer = PgPool::connect(&db.url).await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&observer)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the insert waits for the holder");
    // The insert is seen waiting: wall time now passes the retention.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    holder.rollback().await.unwrap();
    let finished = finishing.await.unwrap();
    assert!(matches!(finished, Finish::Committed), "{finished:?}");
    let live: bool = sqlx::query_scalar(
        "SELECT expires_at > now() FROM idempotency_requests WHERE key_digest = $1",
    )
    .bind(&key.digest().as_bytes()[..])
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(live, "session {session}: the row committed already expired");
    let (_, again) =
        Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
            .await
            .unwrap();
    assert!(
        matches!(again, Claim::Replay(_)),
        "session {session}: a retry replays: {again:?}"
    );
}

/// Whichever shape the finished row takes, a key another execution finished
/// while this one ran its handler is lost, never overwritten: a new key's plain
/// insert meets the other's row as a unique violation of the key, an expired
/// row's takeover (the insert with `ON CONFLICT .. WHERE <expired>`) finds the
/// row live again and claims nothing. Both answer the winner's outcome and roll
/// back, on the session path and on the bound-parameter path, and the other's
/// row stays as it committed.
#[tokio::test]
async fn a_key_finished_meanwhile_is_lost_by_a_new_or_an_expired_keys_insert() {
    for session in [true, false] {
        for expired in [false, true] {
            key_finished_meanwhile_is_lost(session, expired).await;
        }
    }
}

async fn key_finished_meanwhile_is_lost(session: bool, expired: bool) {
    let case = format!("session {session}, expired row {expired}");
    let db = TestDb::new().await;
    let idem: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(session);
    let other: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(session);
    let wait = std::time::Duration::from_millis(500);
    let key = IdempotencyKey::parse("taken-meanwhile").unwrap();
    let req = acme_op(&key, wait);
    let stored = |body: &'static [u8]| StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(body),
    };
    let claim = |idem: Idem<Postgres>| {
        let req = req.clone();
        async move {
            let (tx, claim) =
                Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                    .await
                    .unwrap();
            let Claim::Execute(execution) = claim else {
                panic!("{claim:?}")
            };
            (idem, tx, execution)
        }
    };
    let finish = |(idem, tx, execution), body| async move {
        Postgres::finish(
            &idem_runtime::test_util::claim_context(&idem, wait),
            tx,
            execution,
            &stored(body),
        )
        .await
    };
    if expired {
        let first = claim(idem.clone()).await;
        assert!(matches!(finish(first, b"old").await, Finish::Committed));
        db.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second'")
            .await;
    }
    // Both decide to execute; the other commits first.
    let mine = claim(idem.clone()).await;
    let theirs = claim(other.clone()).await;
    assert!(
        matches!(finish(theirs, b"theirs").await, Finish::Committed),
        "{case}"
    );
    let lost = finish(mine, b"mine").await;
    let Finish::Taken(Claim::Replay(replayed)) = lost else {
        panic!("{case}: {lost:?}")
    };
    assert_eq!(&replayed.body[..], b"theirs", "{case}");
    let (generation, body): (i64, Vec<u8>) =
        sqlx::query_as("SELECT generation, response_body FROM idempotency_requests")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (generation, &body[..]),
        (if expired { 2 } else { 1 }, &b"theirs"[..]),
        "{case}"
    );
    // The loser's connection went back outside any transaction.
    let in_tx: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
          WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(in_tx, 0, "{case}");
}

/// A takeover writes the generation its execution decided on, bound, on both
/// paths (here with clear answers; tests/sealed_answers swaps in sealed ones):
/// an expired row swept between the lookup and the insert leaves a plain insert
/// at that generation (2, not 1). And it replaces only the row it decided on: an
/// expired row at another generation (taken over by another execution at the
/// same generation 2, finished and expired again meanwhile; or any other) is
/// left as it is, and the execution, whose handler has run, answers in flight
/// and rolls back, so that the retry decides afresh.
#[tokio::test]
async fn a_takeover_writes_its_executions_generation_over_the_row_it_decided_on() {
    for session in [true, false] {
        for meanwhile in ["swept", "taken over at 2", "at 5"] {
            let case = format!("session {session}, the expired row {meanwhile}");
            let db = TestDb::new().await;
            let idem: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(session);
            let wait = std::time::Duration::from_millis(200);
            let key = IdempotencyKey::parse("generation").unwrap();
            let req = acme_op(&key, wait);
            let ctx = idem_runtime::test_util::claim_context(&idem, wait);
            let stored = |body: &'static [u8]| StoredResponse {
                status: 201,
                headers: vec![],
                body: Bytes::from_static(body),
            };
            let (tx, claim) = Postgres::begin_claim(&ctx, &req).await.unwrap();
            let Claim::Execute(first) = claim else {
                panic!("{case}: {claim:?}")
            };
            let done = Postgres::finish(&ctx, tx, first, &stored(b"old")).await;
            assert!(matches!(done, Finish::Committed), "{case}: {done:?}");
            db.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second'")
                .await;
            let (tx, claim) = Postgres::begin_claim(&ctx, &req).await.unwrap();
            let Claim::Execute(anew) = claim else {
                panic!("{case}: {claim:?}")
            };
            match meanwhile {
                "swept" => db.exec("DELETE FROM idempotency_requests").await,
                "taken over at 2" => {
                    db.exec("UPDATE idempotency_requests SET generation = 2")
                        .await
                }
                _ => {
                    db.exec("UPDATE idempotency_requests SET generation = 5")
                        .await
                }
            }
            let done = Postgres::finish(&ctx, tx, anew, &stored(b"new")).await;
            let (generation, body): (i64, Vec<u8>) =
                sqlx::query_as("SELECT generation, response_body FROM idempotency_requests")
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            if meanwhile == "swept" {
                assert!(matches!(done, Finish::Committed), "{case}: {done:?}");
                assert_eq!((generation, &body[..]), (2, &b"new"[..]), "{case}");
            } else {
                assert!(
                    matches!(done, Finish::Taken(Claim::InFlight { .. })),
                    "{case}: {done:?}"
                );
                let left = if meanwhile == "at 5" { 5 } else { 2 };
                assert_eq!((generation, &body[..]), (left, &b"old"[..]), "{case}");
            }
        }
    }
}

/// A new key that a leased execution took while this one ran its handler: the
/// plain insert meets the leased row as a unique violation of the key, which is
/// a lost race (the key is in flight: `409` with `Retry-After`), not a failure
/// of the store. On both paths, the loser's transaction rolled back.
#[tokio::test]
async fn a_new_key_taken_by_a_leased_execution_meanwhile_is_in_flight() {
    for session in [true, false] {
        let db = TestDb::new().await;
        let idem: Idem<Postgres> = Idem::new(db.pool.clone()).with_session_statements(session);
        let wait = std::time::Duration::from_millis(200);
        let key = IdempotencyKey::parse("leased-meanwhile").unwrap();
        let req = acme_op(&key, wait);
        let (tx, claim) =
            Postgres::begin_claim(&idem_runtime::test_util::claim_context(&idem, wait), &req)
                .await
                .unwrap();
        let Claim::Execute(execution) = claim else {
            panic!("session {session}: {claim:?}")
        };
        sqlx::query(
            "INSERT INTO idempotency_requests \
                    (tenant_id, operation, key_digest, fingerprint, state, owner_token, \
                     lease_expires_at, expires_at) \
             VALUES ('acme', 'op', $1, $2, 'processing', gen_random_uuid(), \
                     now() + interval '1 hour', now() + interval '1 hour')",
        )
        .bind(&key.digest().as_bytes()[..])
        .bind(&req.fingerprint.as_bytes()[..])
        .execute(&db.pool)
        .await
        .unwrap();
        let stored = StoredResponse {
            status: 201,
            headers: vec![],
            body: Bytes::from_static(b"mine"),
        };
        let finished = Postgres::finish(
            &idem_runtime::test_util::claim_context(&idem, wait),
            tx,
            execution,
            &stored,
        )
        .await;
        assert!(
            matches!(finished, Finish::Taken(Claim::InFlight { .. })),
            "session {session}: {finished:?}"
        );
        let state: String = sqlx::query_scalar("SELECT state FROM idempotency_requests")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(
            state, "processing",
            "session {session}: the leased row stays"
        );
    }
}
