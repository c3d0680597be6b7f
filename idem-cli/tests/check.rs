//! `idem check`, the binary, against real services over real connections: the
//! `orders` example on PostgreSQL, SQLite and MySQL (every scenario passes, a
//! restart included), a deliberately broken service (it checks for the key,
//! then inserts, with no claim between: the concurrent scenario fails, and the
//! report says so), and the documented refusals of bad arguments.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;

mod out;
use out::Out;

impl Out {
    /// A usage error: exit 2, one line on stderr naming `needle`, nothing on stdout.
    fn assert_usage_error(&self, needle: &str) {
        self.assert_error(2, needle);
    }

    /// The scenario `id` of a JSON report.
    fn scenario(&self, id: &str) -> Value {
        self.json()["scenarios"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id)
            .unwrap_or_else(|| panic!("no scenario {id}: {self:?}"))
            .clone()
    }
}

/// Runs `idem check args...`.
async fn check(args: &[&str]) -> Out {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("check")
        .args(args)
        .env_remove("DATABASE_URL")
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("the idem binary runs");
    Out::of(out)
}

/// A directory of the test's own, removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem_check_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    /// Writes `contents` to `name` in the directory; its path.
    fn file(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path.display().to_string()
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port nobody listens on: bound, then released (the checker is refused).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn bad_arguments_are_usage_errors_that_say_which_and_echo_no_credential() {
    let dir = Dir::new();
    let body = dir.file("order.json", r#"{"sku":"A-1","quantity":2}"#);
    let url = format!("http://127.0.0.1:{}/orders", closed_port());
    let missing = dir.path().join("missing.json").display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--url", "127.0.0.1:3000/orders"], "--url: not a URL"),
        (
            vec!["--url", "ftp://example.com/orders"],
            "not http: or https:",
        ),
        (vec!["--url", &url, "--body", &missing], "--body"),
        (
            vec!["--url", &url, "--other-body", &missing],
            "--other-body",
        ),
        (
            vec!["--url", &url, "-H", "Authorization Bearer s3cret"],
            "no colon",
        ),
        (
            vec!["--url", &url, "-H", "Bad Name: s3cret"],
            "not a header name",
        ),
        (
            vec!["--url", &url, "-H", "Idempotency-Key: k"],
            "makes its own keys",
        ),
        (
            vec!["--url", &url, "--tenant-header", "x"],
            "--tenant-header",
        ),
        (
            vec!["--url", &url, "--effects", "nowhere"],
            "--effects: not a URL",
        ),
        (vec!["--url", &url, "--method", "PO ST"], "--method"),
    ];
    // No time for a request or a restart: refused by the argument parser (in
    // its own words, as any value of the wrong form), not run and reported as
    // the service's failure.
    for args in [
        vec!["--url", &url, "--timeout", "0s"],
        vec![
            "--url",
            &url,
            "--restart-cmd",
            "true",
            "--restart-timeout",
            "0ms",
        ],
    ] {
        let out = check(&args).await;
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stderr.contains("no time at all"), "{out:?}");
        assert!(out.stdout.is_empty(), "{out:?}");
    }
    for (args, needle) in cases {
        let out = check(&args).await;
        out.assert_usage_error(needle);
        assert!(!out.stderr.contains("s3cret"), "{out:?}");
    }

    // An --effects URL that does not count is refused after the plan is
    // printed and before the first request: nobody answers this one.
    let out = check(&["--url", &url, "--body", &body, "--effects", &url]).await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    let last = out.stderr.lines().last().unwrap();
    assert!(
        last.starts_with("idem: error: --effects http://127.0.0.1:")
            && last.contains("cannot connect"),
        "{out:?}"
    );

    // clap's own refusals: exit 2 as well.
    for args in [
        &["--url", &url, "--timeout", "soon"][..],
        // Past a week: it would overflow the run's deadlines (a panic).
        &["--url", &url, "--timeout", "30000000000y", "--dry-run"],
        &["--url", &url, "--after", "300000000000y", "--dry-run"],
        &["--url", &url, "--restart-timeout", "8d", "--dry-run"],
        &["--url", &url, "--concurrency", "1"],
        &["--url", &url, "--format", "xml"],
        &[][..],
    ] {
        let out = check(args).await;
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{out:?}");
    }
}

#[tokio::test]
async fn a_dry_run_prints_the_plan_and_sends_nothing() {
    let dir = Dir::new();
    let body = dir.file("order.json", r#"{"sku":"A-1","quantity":2}"#);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    let out = check(&[
        "--url",
        &url,
        "--body",
        &body,
        "-H",
        "Authorization: Bearer s3cret",
        "--effects",
        &url,
        "--dry-run",
    ])
    .await;
    assert_eq!(out.code, 0, "{out:?}");
    // 1 first + 1 retry + 1 equivalent + 3 other body + 1 missing key + 1 empty
    // key + 4 x 2 malformed keys + 16 OPTIONS + 16 + 1 concurrent + 1 late
    // retry; the count before the run, then two around each scenario but the
    // retry's one (after it).
    assert!(
        out.stdout
            .contains("sends 50 requests to that URL and 24 GETs to"),
        "{out:?}"
    );
    assert!(
        out.stdout.contains(
            "one at a time except 16 at once (after 16 OPTIONS, at once, that open their \
             connections)"
        ),
        "{out:?}"
    );
    assert!(
        out.stdout
            .contains("creates 7 effects when the service keeps the promise"),
        "{out:?}"
    );
    assert!(
        out.stdout
            .contains("first-request 1, other-body 1, malformed-key-too-long 1"),
        "{out:?}"
    );
    for (id, why) in [
        ("other-tenant", "not applicable: no --tenant-header"),
        ("restart", "not applicable: no --restart-cmd"),
    ] {
        let line = out
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with(id))
            .unwrap_or_else(|| panic!("no {id} in {out:?}"));
        assert!(line.ends_with(why), "{line}");
    }
    assert!(!out.stdout.contains("s3cret"), "{out:?}");
    // Whatever the checker had connected is queued on the listener by now: the
    // process has exited.
    assert_eq!(
        listener.accept().map(|_| ()).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "the dry run connected"
    );
}

/// `--body -` reads standard input: a JSON body makes the logically equal
/// body applicable, another is said not to be JSON.
#[tokio::test]
async fn the_body_can_come_from_standard_input() {
    use tokio::io::AsyncWriteExt;
    let url = format!("http://127.0.0.1:{}/orders", closed_port());
    for (stdin, expected) in [
        (
            r#"{"sku":"A-1","quantity":2}"#,
            "1 request   a logically equal body",
        ),
        ("sku=A-1", "not applicable: the body is not JSON"),
        (
            r#"{"sku":"A-1","sku":"B-2"}"#,
            "not applicable: the body names a JSON member twice",
        ),
    ] {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["check", "--url", &url, "--body", "-", "--dry-run"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.as_bytes()).await.unwrap();
        drop(input);
        let out = child.wait_with_output().await.unwrap();
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success(), "{stdout}");
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("equivalent-body"))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.contains(expected), "{line}");
    }
}

#[tokio::test]
async fn an_unreachable_service_fails_the_first_request_and_runs_nothing_else() {
    let url = format!("http://127.0.0.1:{}/orders", closed_port());
    let out = check(&["--url", &url, "--format", "json", "--after", "0s"]).await;
    // Not a finding about the promise: the check could not run (8, not 7).
    assert_eq!(out.code, 8, "{out:?}");
    assert!(
        out.json()["could_not_run"]
            .as_str()
            .unwrap()
            .contains("the request itself does not succeed"),
        "{out:?}"
    );
    let first = out.scenario("first-request");
    assert_eq!(first["verdict"], "fail", "{out:?}");
    assert!(
        first["saw"].as_str().unwrap().contains("cannot connect"),
        "{out:?}"
    );
    assert_eq!(out.scenario("concurrent")["verdict"], "not-applicable");
    assert_eq!(out.json()["failed"], 1, "{out:?}");
    // The plan went to stderr before the first request.
    assert!(out.stderr.contains("sends 45 requests"), "{out:?}");
}

/// A first request the service refuses stops the check, its problem document
/// included: a refusal is a mistake in the arguments, and the document it came
/// with is not judged either (docs/check.md: everything else not applicable).
#[tokio::test]
async fn a_refused_first_request_leaves_even_its_problem_document_unjudged() {
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post(|| async {
            (
                axum::http::StatusCode::UNAUTHORIZED,
                [("content-type", "application/problem+json")],
                r#"{"status":403}"#,
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let out = check(&["--url", &url, "--format", "json", "--after", "0s"]).await;
    assert_eq!(out.code, 8, "{out:?}");
    assert_eq!(out.scenario("first-request")["verdict"], "fail", "{out:?}");
    assert_eq!(
        out.scenario("problem-documents")["verdict"],
        "not-applicable",
        "{out:?}"
    );
    assert_eq!(out.json()["failed"], 1, "{out:?}");
}

// The services below need the databases (tests/common/db.rs builds with both
// drivers), as the README's test command builds the CLI.
#[cfg(all(feature = "postgres", feature = "sqlite"))]
#[path = "../../tests/common/db.rs"]
mod common;
#[cfg(all(feature = "postgres", feature = "sqlite"))]
#[path = "../../tests/common/orders.rs"]
mod orders;

#[cfg(all(feature = "postgres", feature = "sqlite"))]
mod services {
    use super::*;
    use crate::common;
    use crate::orders::Server;

    /// `orders` on a fixed port, started again whenever it exits: the
    /// restart command kills it and waits until it is gone, and the checker
    /// then finds the next one on the same port.
    struct Supervised {
        base: String,
        /// The first process's id (the restart command kills it).
        pid: u32,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Supervised {
        fn drop(&mut self) {
            // The task owns the server, which is killed when dropped.
            self.task.abort();
        }
    }

    impl Supervised {
        async fn start(database_url: &str) -> Supervised {
            let addr = format!("127.0.0.1:{}", closed_port());
            let spawn = {
                let (database_url, addr) = (database_url.to_owned(), addr.clone());
                move || {
                    let mut cmd = tokio::process::Command::new(common::example_binary("orders"));
                    cmd.env("DATABASE_URL", &database_url);
                    let addr = addr.clone();
                    async move { Server::spawn(cmd, &[("IDEM_ADDR", &addr)]).await }
                }
            };
            let first = spawn().await;
            let pid = first.child.id().expect("running");
            let base = first.base.clone();
            let task = tokio::spawn(async move {
                let mut server = first;
                loop {
                    let _ = server.child.wait().await;
                    server = spawn().await;
                }
            });
            Supervised { base, pid, task }
        }

        /// The restart command: a crash (SIGKILL), returning once the process
        /// is gone, so that no retry reaches it.
        fn restart_cmd(&self) -> String {
            format!(
                "kill -KILL {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.05; done",
                pid = self.pid
            )
        }
    }

    const ORDER: &str = r#"{"sku":"CHECK-1","quantity":2,"amount_cents":1250}"#;

    /// Every option that makes a scenario applicable, against `orders`.
    async fn check_orders(service: &Supervised, dir: &Dir, format: &str) -> Out {
        let body = dir.file("order.json", ORDER);
        let url = format!("{}/orders", service.base);
        let restart = service.restart_cmd();
        check(&[
            "--url",
            &url,
            "--body",
            &body,
            "-H",
            "Authorization: Bearer checker-first",
            "-H",
            "X-Currency: EUR",
            "--tenant-header",
            "Authorization: Bearer checker-second",
            "--effects",
            &url,
            "--canonical-json",
            "--after",
            "1s",
            "--restart-cmd",
            &restart,
            "--format",
            format,
        ])
        .await
    }

    /// Every scenario passes, each says what it saw, and no credential is in
    /// the report.
    fn assert_all_pass(out: &Out) {
        assert_eq!(out.code, 0, "{out:?}");
        let report = out.json();
        let scenarios = report["scenarios"].as_array().unwrap();
        assert_eq!(scenarios.len(), 15, "{out:?}");
        for s in scenarios {
            assert_eq!(s["verdict"], "pass", "{}: {}", s["id"], s["saw"]);
        }
        assert_eq!(report["passed"], 15);
        assert!(
            out.scenario("concurrent")["saw"]
                .as_str()
                .unwrap()
                .ends_with("; 1 effect"),
            "{out:?}"
        );
        assert!(
            out.scenario("restart")["saw"]
                .as_str()
                .unwrap()
                .contains("no new effect"),
            "{out:?}"
        );
        assert!(!out.stdout.contains("checker-first"), "{out:?}");
        assert!(!out.stdout.contains("checker-second"), "{out:?}");
        assert!(out.stdout.contains("\"authorization\""), "{out:?}");
    }

    #[tokio::test]
    async fn orders_on_postgres_keeps_every_promise() {
        let db = common::TestDb::new().await;
        let service = Supervised::start(&db.url).await;
        let dir = Dir::new();
        assert_all_pass(&check_orders(&service, &dir, "json").await);
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn orders_on_mysql_keeps_every_promise() {
        let db = common::MySqlDb::new().await;
        let service = Supervised::start(&db.url).await;
        let dir = Dir::new();
        assert_all_pass(&check_orders(&service, &dir, "json").await);
    }

    /// On SQLite, also the other two reports of a passing run.
    #[tokio::test]
    async fn orders_on_sqlite_keeps_every_promise_in_every_format() {
        let db = common::SqliteDb::new().await;
        let service = Supervised::start(&format!("sqlite://{}", db.path.display())).await;
        let dir = Dir::new();
        assert_all_pass(&check_orders(&service, &dir, "json").await);

        let table = check_orders(&service, &dir, "table").await;
        assert_eq!(table.code, 0, "{table:?}");
        assert!(
            table
                .stdout
                .contains("15 passed, 0 failed, 0 not applicable"),
            "{table:?}"
        );
        let row = table
            .stdout
            .lines()
            .find(|l| l.starts_with("concurrent "))
            .unwrap();
        assert_eq!(row.split_whitespace().nth(1), Some("pass"), "{table:?}");
        assert!(
            row.contains("16 at once: 16× 2xx with one body"),
            "{table:?}"
        );
        assert!(!table.stdout.contains('\x1b'), "no colour off a terminal");

        let junit = check_orders(&service, &dir, "junit").await;
        assert_eq!(junit.code, 0, "{junit:?}");
        assert!(
            junit.stdout.contains(
                "<testsuites name=\"idem check\" tests=\"15\" failures=\"0\" skipped=\"0\""
            ),
            "{junit:?}"
        );
        assert_eq!(junit.stdout.matches("<testcase ").count(), 15);
        assert!(!junit.stdout.contains("<failure"), "{junit:?}");
    }

    /// A service that looks the key up, then executes and stores the answer,
    /// with no claim in between: sequential retries replay, but concurrent
    /// duplicates all find nothing and all execute.
    mod broken {
        use std::collections::HashMap;
        use std::sync::{Arc, Mutex};

        use axum::Router;
        use axum::body::Bytes;
        use axum::extract::State;
        use axum::http::{HeaderMap, StatusCode, header};
        use axum::response::{IntoResponse, Response};
        use axum::routing::{get, post};
        use sqlx::PgPool;
        use tokio::sync::watch;

        #[derive(Clone)]
        struct App {
            pool: PgPool,
            /// Per key, how many requests found it unused. A request that
            /// found it unused waits here until a second one has too, so
            /// that the race the service leaves open is taken every time:
            /// both then execute. Only the checker's concurrent scenario
            /// (its keys end in `-concurrent`) sends duplicates at once, so
            /// only its keys wait; a lone request must not.
            seen_unused: Arc<Mutex<HashMap<String, watch::Sender<usize>>>>,
            /// `/flaky-effects` calls so far.
            counted: Arc<std::sync::atomic::AtomicUsize>,
            /// `/gateway` requests with the restart scenario's key so far.
            restart_seen: Arc<std::sync::atomic::AtomicUsize>,
        }

        fn problem(status: StatusCode, kind: &str) -> Response {
            (
                status,
                [(header::CONTENT_TYPE, "application/problem+json")],
                serde_json::json!({"type": format!("urn:broken:{kind}"), "title": kind, "status": status.as_u16()})
                    .to_string(),
            )
                .into_response()
        }

        async fn create(
            State(app): State<App>,
            uri: axum::http::Uri,
            headers: HeaderMap,
            body: Bytes,
        ) -> Response {
            // `/fixed` answers every execution with the same body, so that
            // only the replay marker tells a replay from a second execution;
            // `/marked` does too, and marks every answer replayed.
            let fixed = matches!(uri.path(), "/fixed" | "/marked");
            let marked = uri.path() == "/marked";
            // `/sloppy` runs the operation before it refuses a request
            // without a key or with another body under a used key.
            // `/sloppy-bytes` does too, and compares bodies byte for byte.
            let sloppy = matches!(uri.path(), "/sloppy" | "/sloppy-bytes");
            // `/racy` leaves the race open for 100 ms, with no help: only
            // duplicates that arrive together take it.
            let racy = uri.path() == "/racy";
            // `/crashy` fails the body the check derives as the other one
            // (the first integer plus one) with a 500.
            if uri.path() == "/crashy" && body.as_ref() == br#"{"name":"a","size":3}"# {
                return problem(StatusCode::INTERNAL_SERVER_ERROR, "crash");
            }
            let effect = |tenant: String| {
                let pool = app.pool.clone();
                async move {
                    sqlx::query_scalar::<_, i64>(
                        "INSERT INTO effects (tenant) VALUES ($1) RETURNING id",
                    )
                    .bind(tenant)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
                }
            };
            let Some(tenant) = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_owned)
            else {
                return problem(StatusCode::UNAUTHORIZED, "unauthorized");
            };
            let key = match idem_runtime::IdempotencyKey::from_headers(&headers) {
                Ok(k) => k.as_str().to_owned(),
                Err(e) if e.is_missing() => {
                    if sloppy {
                        effect(tenant).await;
                    }
                    return problem(StatusCode::BAD_REQUEST, "missing-key");
                }
                Err(_) => return problem(StatusCode::BAD_REQUEST, "malformed-key"),
            };
            // `/gateway` answers the retry after a restart with a proxy's
            // `502` once, as a gateway does while the service starts.
            if uri.path() == "/gateway"
                && key.ends_with("-restart")
                && app
                    .restart_seen
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                    == 1
            {
                return (StatusCode::BAD_GATEWAY, "upstream starting").into_response();
            }
            let Ok(value) = serde_json::from_slice::<serde_json::Value>(&body) else {
                return problem(StatusCode::BAD_REQUEST, "not-json");
            };
            let fingerprint = if uri.path() == "/sloppy-bytes" {
                String::from_utf8_lossy(&body).into_owned()
            } else {
                value.to_string()
            };
            // The check.
            let stored: Option<(String, String)> = sqlx::query_as(
                "SELECT fingerprint, body FROM answers WHERE tenant = $1 AND key = $2",
            )
            .bind(&tenant)
            .bind(&key)
            .fetch_optional(&app.pool)
            .await
            .unwrap();
            if let Some((stored_fingerprint, stored_body)) = stored {
                if stored_fingerprint != fingerprint {
                    if sloppy {
                        effect(tenant).await;
                    }
                    return problem(StatusCode::UNPROCESSABLE_ENTITY, "fingerprint-mismatch");
                }
                return (
                    StatusCode::CREATED,
                    [
                        (header::CONTENT_TYPE, "application/json"),
                        (
                            header::HeaderName::from_static("idempotent-replayed"),
                            "true",
                        ),
                    ],
                    stored_body,
                )
                    .into_response();
            }
            if racy {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            } else if key.ends_with("-concurrent") {
                let mut unused = {
                    let mut seen = app.seen_unused.lock().unwrap();
                    let counter = seen
                        .entry(format!("{tenant}\n{key}"))
                        .or_insert_with(|| watch::channel(0).0);
                    counter.send_modify(|n| *n += 1);
                    counter.subscribe()
                };
                unused.wait_for(|n| *n >= 2).await.unwrap();
            }
            // The insert, unguarded.
            let id = effect(tenant.clone()).await;
            let answer = if fixed {
                r#"{"ok":true}"#.to_owned()
            } else {
                serde_json::json!({"id": id}).to_string()
            };
            sqlx::query(
                "INSERT INTO answers (tenant, key, fingerprint, body) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(&tenant)
            .bind(&key)
            .bind(&fingerprint)
            .bind(&answer)
            .execute(&app.pool)
            .await
            .unwrap();
            let mut response = (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, "application/json")],
                answer,
            )
                .into_response();
            if marked {
                response.headers_mut().insert(
                    header::HeaderName::from_static("idempotent-replayed"),
                    header::HeaderValue::from_static("true"),
                );
            }
            response
        }

        /// `/effects` for its first three calls, then `500`: a count that
        /// stops answering during a run.
        async fn flaky_effects(State(app): State<App>, headers: HeaderMap) -> Response {
            effects_until(3, app, headers).await
        }

        /// `/effects` for its first 22 calls, then `500`: with `--after`, the
        /// count stops answering at the late retry, after `concurrent`.
        async fn late_flaky_effects(State(app): State<App>, headers: HeaderMap) -> Response {
            effects_until(22, app, headers).await
        }

        /// `/effects` for its first 21 calls, then `500`: the count stops
        /// answering at `concurrent`'s second count, after its answers.
        async fn mid_flaky_effects(State(app): State<App>, headers: HeaderMap) -> Response {
            effects_until(21, app, headers).await
        }

        async fn effects_until(calls: usize, app: App, headers: HeaderMap) -> Response {
            let made = app
                .counted
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if made >= calls {
                return problem(StatusCode::INTERNAL_SERVER_ERROR, "count-down");
            }
            effects(State(app), headers).await
        }

        /// A count stuck at the top of `u64`'s range, which no effect can
        /// move: a first request's effect cannot show in it.
        async fn full_effects() -> Response {
            u64::MAX.to_string().into_response()
        }

        /// An `OPTIONS` answer that closes its connection.
        async fn closing() -> Response {
            (StatusCode::NO_CONTENT, [(header::CONNECTION, "close")]).into_response()
        }

        async fn effects(State(app): State<App>, headers: HeaderMap) -> Response {
            let tenant = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or_default()
                .to_owned();
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE tenant = $1")
                .bind(tenant)
                .fetch_one(&app.pool)
                .await
                .unwrap();
            n.to_string().into_response()
        }

        /// A listener that lets each connection wait its delay before it is
        /// served, one after the other, as a far service's handshakes would:
        /// a request sent on a new connection arrives that much later than
        /// one on a connection already open.
        struct SlowAccept(tokio::net::TcpListener, std::time::Duration);

        impl axum::serve::Listener for SlowAccept {
            type Io = tokio::net::TcpStream;
            type Addr = std::net::SocketAddr;

            async fn accept(&mut self) -> (Self::Io, Self::Addr) {
                let accepted = axum::serve::Listener::accept(&mut self.0).await;
                tokio::time::sleep(self.1).await;
                accepted
            }

            fn local_addr(&self) -> std::io::Result<Self::Addr> {
                self.0.local_addr()
            }
        }

        /// Serves it on a port of its own over `pool`; its base URL.
        pub(super) async fn serve(pool: PgPool) -> String {
            serve_accepting(pool, None).await
        }

        /// Serves it with each new connection served `delay` after the one
        /// before it (see `SlowAccept`).
        pub(super) async fn serve_accepting(
            pool: PgPool,
            delay: Option<std::time::Duration>,
        ) -> String {
            sqlx::raw_sql(
                "CREATE TABLE effects (id bigserial PRIMARY KEY, tenant text NOT NULL);
                 CREATE TABLE answers (tenant text, key text, fingerprint text NOT NULL,
                     body text NOT NULL, PRIMARY KEY (tenant, key));",
            )
            .execute(&pool)
            .await
            .unwrap();
            let app = App {
                pool,
                seen_unused: Arc::default(),
                counted: Arc::default(),
                restart_seen: Arc::default(),
            };
            let router = Router::new()
                .route("/things", post(create))
                .route("/fixed", post(create))
                .route("/marked", post(create))
                .route("/sloppy", post(create))
                .route("/sloppy-bytes", post(create))
                .route("/racy", post(create))
                .route("/crashy", post(create))
                .route("/gateway", post(create))
                .route("/closing", post(create).options(closing))
                .route("/effects", get(effects))
                .route("/flaky-effects", get(flaky_effects))
                .route("/late-flaky-effects", get(late_flaky_effects))
                .route("/mid-flaky-effects", get(mid_flaky_effects))
                .route("/full-effects", get(full_effects))
                .with_state(app);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            match delay {
                None => tokio::spawn(async move { axum::serve(listener, router).await.unwrap() }),
                Some(delay) => tokio::spawn(async move {
                    axum::serve(SlowAccept(listener, delay), router)
                        .await
                        .unwrap()
                }),
            };
            base
        }
    }

    /// `idem check` of a broken service's route `path` as the first tenant,
    /// the late retry left out (unless `more` gives `--after`), a JSON report, with `more` arguments.
    async fn check_broken(path: &str, more: &[&str]) -> Out {
        check_broken_accepting(None, path, more).await
    }

    /// As [`check_broken`], each new connection served `delay` after the one
    /// before it; `{effects}` in `more` stands for the service's count URL.
    async fn check_broken_accepting(
        delay: Option<std::time::Duration>,
        path: &str,
        more: &[&str],
    ) -> Out {
        let db = common::TestDb::new().await;
        let base = broken::serve_accepting(db.pool.clone(), delay).await;
        let effects = format!("{base}/effects");
        let more: Vec<String> = more
            .iter()
            .map(|a| a.replace("{effects}", &effects).replace("{base}", &base))
            .collect();
        let more: Vec<&str> = more.iter().map(String::as_str).collect();
        let more = more.as_slice();
        let dir = Dir::new();
        let body = dir.file("thing.json", r#"{"name":"a","size":2}"#);
        let url = format!("{base}{path}");
        let mut args = vec![
            "--url",
            &url,
            "--body",
            &body,
            "-H",
            "Authorization: Bearer first",
            "--format",
            "json",
        ];
        if !more.contains(&"--after") {
            args.extend_from_slice(&["--after", "0s"]);
        }
        args.extend_from_slice(more);
        check(&args).await
    }

    /// Every scenario of a run against the broken service passes but
    /// `concurrent` (and the two its arguments leave out).
    fn only_concurrent_fails(out: &Out) {
        for s in out.json()["scenarios"].as_array().unwrap() {
            let expected = match s["id"].as_str().unwrap() {
                "concurrent" => "fail",
                "restart" | "late-retry" => "not-applicable",
                _ => "pass",
            };
            assert_eq!(s["verdict"], expected, "{}: {}", s["id"], s["saw"]);
        }
    }

    /// The verdict of every scenario, by id, is `expected`'s (`pass` for
    /// those it leaves out).
    fn verdicts_are(out: &Out, expected: &[(&str, &str)]) {
        for s in out.json()["scenarios"].as_array().unwrap() {
            let id = s["id"].as_str().unwrap();
            let want = expected
                .iter()
                .find(|(e, _)| *e == id)
                .map_or("pass", |(_, v)| *v);
            assert_eq!(s["verdict"], want, "{id}: {}", s["saw"]);
        }
    }

    /// Duplicates sent together reach the service together, though the
    /// service serves a new connection only 300 ms after the one before it:
    /// each is sent on a connection opened beforehand. Sent on connections
    /// opened as they went, the first (on the connection the earlier
    /// scenarios left open) would be answered and stored before the second
    /// arrived, and the service's open race (100 ms between its check and
    /// its insert) would never be taken.
    #[tokio::test]
    async fn duplicates_reach_a_far_service_together_and_its_race_fails_the_check() {
        let out = check_broken_accepting(
            Some(std::time::Duration::from_millis(300)),
            "/racy",
            &["--effects", "{effects}"],
        )
        .await;
        assert_eq!(out.code, 7, "{out:?}");
        let saw = out.scenario("concurrent")["saw"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(saw.contains("executed more than once"), "{saw}");
        assert!(!saw.contains("opened as it was sent"), "{saw}");
        verdicts_are(
            &out,
            &[
                ("concurrent", "fail"),
                ("other-tenant", "not-applicable"),
                ("restart", "not-applicable"),
                ("late-retry", "not-applicable"),
            ],
        );
    }

    /// With `--effects`, a service that runs the operation and only then
    /// refuses the request (`400` without a key, `422` for another body
    /// under a used key) fails those scenarios: their answers alone are right.
    #[tokio::test]
    async fn an_operation_run_before_a_refusal_fails_with_effects_counted() {
        let out = check_broken("/sloppy", &["--effects", "{effects}"]).await;
        assert_eq!(out.code, 7, "{out:?}");
        for id in ["missing-key", "other-body"] {
            let saw = out.scenario(id)["saw"].as_str().unwrap().to_owned();
            assert!(saw.contains("expected"), "{id}: {saw}");
        }
        assert!(
            out.scenario("missing-key")["saw"]
                .as_str()
                .unwrap()
                .ends_with("; 1 effect, expected 0"),
            "{out:?}"
        );
        verdicts_are(
            &out,
            &[
                ("missing-key", "fail"),
                ("other-body", "fail"),
                ("concurrent", "fail"),
                ("other-tenant", "not-applicable"),
                ("restart", "not-applicable"),
                ("late-retry", "not-applicable"),
            ],
        );
        // Without the count, the answers are all the check sees.
        let out = check_broken("/sloppy", &[]).await;
        assert_eq!(out.scenario("missing-key")["verdict"], "pass", "{out:?}");
        assert_eq!(out.scenario("other-body")["verdict"], "pass", "{out:?}");
    }

    /// A count that cannot go up (it is at `u64::MAX`) is a first request
    /// whose effect did not show, said as such, not an overflow.
    #[tokio::test]
    async fn a_count_at_the_top_of_its_range_fails_the_first_request() {
        let out = check_broken("/things", &["--effects", "{base}/full-effects"]).await;
        assert_eq!(out.code, 7, "{out:?}");
        let saw = out.scenario("first-request")["saw"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(saw.ends_with("; 0 effects, expected 1"), "{saw}");
    }

    /// A scenario that failed before the count stopped answering is a
    /// finding: the run exits 7, not 8, and still says why it stopped.
    #[tokio::test]
    async fn a_breach_found_before_the_check_could_not_go_on_still_exits_7() {
        let out = check_broken(
            "/things",
            &["--effects", "{base}/late-flaky-effects", "--after", "1s"],
        )
        .await;
        assert_eq!(out.code, 7, "{out:?}");
        assert_eq!(out.scenario("concurrent")["verdict"], "fail", "{out:?}");
        assert_eq!(out.scenario("late-retry")["verdict"], "fail", "{out:?}");
        assert!(
            out.json()["could_not_run"]
                .as_str()
                .unwrap()
                .starts_with("--effects: GET answered 500"),
            "{out:?}"
        );
    }

    /// The retry after a restart goes on past a gateway's `502` (the proxy in
    /// front of a service still starting) and replays.
    #[tokio::test]
    async fn the_retry_after_a_restart_waits_out_a_gateways_502() {
        let out = check_broken("/gateway", &["--concurrency", "2", "--restart-cmd", "true"]).await;
        let restart = out.scenario("restart");
        assert_eq!(restart["verdict"], "pass", "{out:?}");
        let exchanges = restart["exchanges"].as_array().unwrap();
        assert_eq!(exchanges[1]["answer"]["status"], 201, "{out:?}");
    }

    /// Where an `OPTIONS` answer closes its connection, the duplicates go out
    /// on connections opened as they are sent, and the report says so.
    #[tokio::test]
    async fn duplicates_on_connections_not_opened_beforehand_are_reported() {
        let out = check_broken("/closing", &["--concurrency", "2"]).await;
        let saw = out.scenario("concurrent")["saw"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            saw.contains("(2 of 2 sent on a connection opened as it was sent"),
            "{saw}"
        );
        assert!(saw.contains("closes its connection"), "{saw}");
    }

    /// A service that fails the other body with a 500 fails `other-body`:
    /// only a refusal (4xx) of that body makes the scenario not applicable.
    #[tokio::test]
    async fn a_5xx_for_the_other_body_alone_fails_the_scenario() {
        let out = check_broken("/crashy", &[]).await;
        let other = out.scenario("other-body");
        assert_eq!(other["verdict"], "fail", "{out:?}");
        assert_eq!(
            other["saw"], "the other body alone, under a new key, is 500 urn:broken:crash",
            "{out:?}"
        );
    }

    /// A count that stops answering during the run is no finding about the
    /// service's promise: the check could not run (exit 8), and says why.
    #[tokio::test]
    async fn effects_that_stop_counting_mean_the_check_could_not_run() {
        let out = check_broken("/things", &["--effects", "{base}/flaky-effects"]).await;
        assert_eq!(out.code, 8, "{out:?}");
        let why = out.json()["could_not_run"].as_str().unwrap().to_owned();
        assert!(why.starts_with("--effects: GET answered 500"), "{why}");
    }

    /// A count that stops answering after a scenario's answers showed a
    /// double execution does not hide it: the finding stands (exit 7), the
    /// failed count said beside it, and the check could not run past it.
    #[tokio::test]
    async fn a_count_that_fails_after_a_breach_the_answers_showed_hides_nothing() {
        let out = check_broken("/things", &["--effects", "{base}/mid-flaky-effects"]).await;
        assert_eq!(out.code, 7, "{out:?}");
        let concurrent = out.scenario("concurrent");
        assert_eq!(concurrent["verdict"], "fail", "{out:?}");
        let saw = concurrent["saw"].as_str().unwrap();
        assert!(saw.contains("executed more than once"), "{saw}");
        assert!(saw.contains("--effects: GET answered 500"), "{saw}");
    }

    /// A scenario not applicable after its request went out still has its
    /// effects counted: a byte-comparing service's `422` for the reordered
    /// body is allowed, but not after it ran the operation.
    #[tokio::test]
    async fn a_refusal_after_the_operation_ran_fails_even_a_scenario_not_applicable() {
        let out = check_broken("/sloppy-bytes", &["--effects", "{effects}"]).await;
        let equivalent = out.scenario("equivalent-body");
        assert_eq!(equivalent["verdict"], "fail", "{out:?}");
        let saw = equivalent["saw"].as_str().unwrap();
        assert!(
            saw.starts_with("422: the service compares the bodies' bytes"),
            "{saw}"
        );
        assert!(saw.ends_with("; 1 effect, expected 0"), "{saw}");
        // Without the count, the 422 is allowed.
        let out = check_broken("/sloppy-bytes", &[]).await;
        assert_eq!(
            out.scenario("equivalent-body")["verdict"],
            "not-applicable",
            "{out:?}"
        );
    }

    /// A new key's first answer marked replayed is no replay: the first
    /// request fails (and with it the run).
    #[tokio::test]
    async fn a_first_answer_marked_replayed_fails_the_first_request() {
        let out = check_broken("/marked", &[]).await;
        assert_eq!(
            out.code, 7,
            "a finding, not a check that could not run: {out:?}"
        );
        assert!(out.json()["could_not_run"].is_null(), "{out:?}");
        let first = out.scenario("first-request");
        assert_eq!(first["verdict"], "fail", "{out:?}");
        assert!(
            first["saw"].as_str().unwrap().contains("marked replayed"),
            "{out:?}"
        );
    }

    /// A restart command that starts the service in the background (its
    /// output still open) is done when `sh` exits, not when that output ends.
    #[tokio::test]
    async fn a_restart_command_that_leaves_a_process_running_is_done_when_it_exits() {
        let dir = Dir::new();
        let alive = dir.path().join("alive");
        // Writes on stderr once the check has stopped waiting for the command,
        // then leaves a mark: a process whose stderr were a pipe nobody read
        // would die of that write (SIGPIPE) and leave none.
        let cmd = format!(
            "(sleep 1; echo still serving >&2; touch '{}'; sleep 30) &",
            alive.display()
        );
        let out = check_broken(
            "/things",
            &[
                "--concurrency",
                "2",
                "--restart-cmd",
                &cmd,
                "--restart-timeout",
                "20s",
            ],
        )
        .await;
        let restart = out.scenario("restart");
        assert_eq!(restart["verdict"], "pass", "{out:?}");
        assert!(restart["elapsed_ms"].as_u64().unwrap() < 20_000, "{out:?}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !alive.exists() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(
            alive.exists(),
            "the process the command started outlived its writes on stderr"
        );
    }

    /// A restart command that fails fails its scenario, with its exit status
    /// and what it said on stderr.
    #[tokio::test]
    async fn a_failing_restart_command_fails_the_restart_scenario() {
        let out = check_broken(
            "/things",
            &[
                "--concurrency",
                "2",
                "--restart-cmd",
                "echo no such service >&2; exit 3",
            ],
        )
        .await;
        assert_eq!(out.code, 7, "{out:?}");
        let restart = out.scenario("restart");
        assert_eq!(restart["verdict"], "fail", "{out:?}");
        let saw = restart["saw"].as_str().unwrap();
        assert!(
            saw.starts_with("the restart command exited with exit status: 3: no such service"),
            "{saw}"
        );
        // The request before it was sent; no retry after it.
        assert_eq!(restart["exchanges"].as_array().unwrap().len(), 1);
    }

    /// The same service answering every execution with one body: without
    /// `--effects`, the answers not marked replayed show that each duplicate
    /// executed, though status and body all agree.
    #[tokio::test]
    async fn duplicates_that_execute_with_one_body_fail_the_concurrent_scenario() {
        let out = check_broken(
            "/fixed",
            &["--tenant-header", "Authorization: Bearer second"],
        )
        .await;
        assert_eq!(out.code, 7, "{out:?}");
        let concurrent = out.scenario("concurrent");
        assert_eq!(concurrent["verdict"], "fail", "{out:?}");
        let saw = concurrent["saw"].as_str().unwrap();
        assert!(saw.contains("16× 2xx with one body"), "{saw}");
        assert!(saw.contains(" of them not marked replayed"), "{saw}");
        assert!(saw.contains("answers not marked replayed"), "{saw}");
        only_concurrent_fails(&out);
    }

    /// Second-tenant credentials the service refuses (`401`) are a mistake in
    /// the arguments, as a refused first request is: `other-tenant` is not
    /// applicable, not a finding.
    #[tokio::test]
    async fn refused_tenant_credentials_make_other_tenant_not_applicable() {
        let out = check_broken(
            "/things",
            &["--tenant-header", "Authorization: Basic second"],
        )
        .await;
        let other = out.scenario("other-tenant");
        assert_eq!(other["verdict"], "not-applicable", "{out:?}");
        let saw = other["saw"].as_str().unwrap();
        assert!(saw.contains("credentials are refused"), "{saw}");
    }

    #[tokio::test]
    async fn a_check_then_insert_service_fails_the_concurrent_scenario_and_only_it() {
        let db = common::TestDb::new().await;
        let base = broken::serve(db.pool.clone()).await;
        let dir = Dir::new();
        let body = dir.file("thing.json", r#"{"name":"a","size":2}"#);
        let url = format!("{base}/things");
        let effects = format!("{base}/effects");
        let args = |format: &'static str, with_effects: bool| {
            let mut args = vec![
                "--url".to_owned(),
                url.clone(),
                "--body".into(),
                body.clone(),
                "-H".into(),
                "Authorization: Bearer first".into(),
                "--tenant-header".into(),
                "Authorization: Bearer second".into(),
                "--after".into(),
                "0s".into(),
                "--format".into(),
                format.into(),
            ];
            if with_effects {
                args.extend(["--effects".into(), effects.clone()]);
            }
            args
        };
        let run = |args: Vec<String>| async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            check(&args).await
        };

        // Counted by --effects: more than one.
        let out = run(args("json", true)).await;
        assert_eq!(out.code, 7, "{out:?}");
        let concurrent = out.scenario("concurrent");
        assert_eq!(concurrent["verdict"], "fail", "{out:?}");
        let saw = concurrent["saw"].as_str().unwrap();
        assert!(saw.contains("executed more than once"), "{saw}");
        assert!(saw.contains("effects, expected 1"), "{saw}");
        // The failure carries its requests (keys shown) and answers.
        let exchanges = concurrent["exchanges"].as_array().unwrap();
        assert_eq!(exchanges.len(), 17, "16 at once and the retry after them");
        assert!(
            exchanges[0]["request"]["key"]
                .as_str()
                .unwrap()
                .ends_with("-concurrent")
        );
        assert_eq!(exchanges[0]["answer"]["status"], 201);
        // Everything else the service does right.
        only_concurrent_fails(&out);
        assert_eq!(out.json()["failed"], 1);

        // Without --effects, by the answers: different bodies. (The report is
        // printed for `--nocapture`: docs/check.md quotes one.)
        let out = run(args("table", false)).await;
        println!("{}", out.stdout);
        assert_eq!(out.code, 7, "{out:?}");
        let row = out
            .stdout
            .lines()
            .find(|l| l.starts_with("concurrent "))
            .unwrap();
        assert_eq!(row.split_whitespace().nth(1), Some("FAIL"), "{out:?}");
        assert!(row.contains("16 at once: 16× 2xx with "), "{out:?}");
        assert!(row.contains("different bodies"), "{out:?}");
        assert!(
            out.stdout
                .contains("FAIL concurrent: concurrent duplicates execute once"),
            "{out:?}"
        );
        assert!(
            out.stdout.contains("Idempotency-Key: \"idem-check-"),
            "{out:?}"
        );
        assert!(out.stdout.contains("authorization: <redacted>"), "{out:?}");
        assert!(!out.stdout.contains("Bearer first"), "{out:?}");

        // JUnit: the one failure, with its message.
        let out = run(args("junit", false)).await;
        assert_eq!(out.code, 7, "{out:?}");
        assert!(out.stdout.contains("failures=\"1\""), "{out:?}");
        assert_eq!(out.stdout.matches("<failure ").count(), 1, "{out:?}");
        assert!(
            out.stdout
                .contains("<testcase classname=\"idem.check\" name=\"concurrent: "),
            "{out:?}"
        );
    }
}
