//! The middleware's decisions against tiny in-process servers: a scripted axum
//! app (each request gets the next scripted answer and is recorded), and raw TCP
//! servers for answers axum cannot give (a connection closed mid-way).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_client::{
    ErrorExt, IdempotencyKey, IdempotencyMiddleware, LastAnswer, Limit, OUTCOME_UNCERTAIN,
    PollRefused, REQUEST_IN_FLIGHT, ResponseExt, StreamFinal,
};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One scripted answer.
#[derive(Clone)]
enum Reply {
    /// Status, extra headers, body.
    Answer(u16, Vec<(&'static str, &'static str)>, &'static str),
    /// Never answers (until the client gives up on it).
    Hang,
}

fn status(code: u16) -> Reply {
    Reply::Answer(code, vec![], "")
}

fn problem(code: u16, problem_type: &'static str, retry_after: Option<&'static str>) -> Reply {
    let mut headers = vec![("content-type", "application/problem+json")];
    if let Some(r) = retry_after {
        headers.push(("retry-after", r));
    }
    let body = match problem_type {
        REQUEST_IN_FLIGHT => r#"{"type":"urn:idem:problem:request-in-flight"}"#,
        OUTCOME_UNCERTAIN => r#"{"type":"urn:idem:problem:outcome-uncertain"}"#,
        "urn:idem:problem:fingerprint-mismatch" => {
            r#"{"type":"urn:idem:problem:fingerprint-mismatch"}"#
        }
        _ => r#"{"type":"urn:test:problem:other"}"#,
    };
    Reply::Answer(code, headers, body)
}

fn created(replayed: bool) -> Reply {
    let headers = if replayed {
        vec![("idempotent-replayed", "true")]
    } else {
        vec![]
    };
    Reply::Answer(201, headers, r#"{"id":1}"#)
}

/// What the server saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    headers: HeaderMap,
    key: Option<String>,
    body: Bytes,
}

#[derive(Clone, Default)]
struct Script {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Script {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Serves `replies` in order (then `201`s) and returns the base URL and the record.
async fn scripted(replies: impl IntoIterator<Item = Reply>) -> (String, Script) {
    let script = Script {
        replies: Arc::new(Mutex::new(replies.into_iter().collect())),
        ..Script::default()
    };
    let state = script.clone();
    let app = axum::Router::new().fallback(
        move |method: Method, uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
            let state = state.clone();
            async move {
                state.seen.lock().unwrap().push(Seen {
                    method,
                    path: uri.path().to_owned(),
                    key: headers
                        .get("idempotency-key")
                        .map(|v| v.to_str().unwrap().to_owned()),
                    headers,
                    body,
                });
                let reply = state.replies.lock().unwrap().pop_front();
                match reply.unwrap_or_else(|| created(false)) {
                    Reply::Answer(code, headers, body) => {
                        let mut r: Response = body.into_response();
                        *r.status_mut() = StatusCode::from_u16(code).unwrap();
                        for (k, v) in headers {
                            r.headers_mut().insert(k, v.parse().unwrap());
                        }
                        r
                    }
                    Reply::Hang => {
                        // The client's timeout ends the attempt; this is only a backstop.
                        tokio::time::sleep(Duration::from_secs(600)).await;
                        StatusCode::GATEWAY_TIMEOUT.into_response()
                    }
                }
            }
        },
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, script)
}

/// A client with fast retries, so the tests spend little time backing off.
fn client(middleware: IdempotencyMiddleware) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware.backoff(Duration::from_millis(1), Duration::from_millis(20)))
        .build()
}

fn fast() -> IdempotencyMiddleware {
    IdempotencyMiddleware::new().deadline(Duration::from_secs(60))
}

/// What a logging middleware placed after idem's prints of each request.
struct Printed(Arc<Mutex<Vec<String>>>);

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for Printed {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        self.0.lock().unwrap().push(format!("{req:?}"));
        next.run(req, extensions).await
    }
}

/// The key is sent, and a middleware after idem's that prints the request
/// (a logger) does not print it: the header is marked sensitive.
#[tokio::test]
async fn the_key_is_sent_but_never_printed_by_a_later_middleware() {
    let (base, script) = scripted([created(false)]).await;
    let printed = Arc::new(Mutex::new(Vec::new()));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(fast())
        .with(Printed(printed.clone()))
        .build();
    let r = client.post(format!("{base}/orders")).send().await.unwrap();
    let key = r.idem().unwrap().key.as_str().to_owned();
    assert_eq!(script.seen()[0].key.as_deref(), Some(key.as_str()));
    let printed = printed.lock().unwrap();
    assert_eq!(printed.len(), 1);
    assert!(printed[0].contains("idempotency-key"), "{}", printed[0]);
    assert!(!printed[0].contains(&key), "{}", printed[0]);
}

#[tokio::test]
async fn every_retry_carries_the_same_key_and_the_same_bytes() {
    let (base, script) = scripted([status(503), status(500), created(false)]).await;
    let body: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let r = client(fast())
        .post(format!("{base}/orders"))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let idem = r.idem().unwrap().clone();
    assert_eq!(idem.attempts, 3);
    assert!(!idem.replayed);
    let seen = script.seen();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.key.as_deref(), Some(idem.key.as_str()));
        assert_eq!(s.body, body);
    }
    assert_eq!(
        uuid::Uuid::parse_str(idem.key.as_str())
            .unwrap()
            .get_version_num(),
        4
    );
    assert_eq!(r.bytes().await.unwrap(), r#"{"id":1}"#);
}

#[tokio::test]
async fn a_streaming_body_is_buffered_and_sent_again_byte_for_byte() {
    let (base, script) = scripted([status(503), created(false)]).await;
    let body = Bytes::from_static(b"{\"sku\":\"A-1\"}");
    let streaming = reqwest::Body::wrap(http_body_util::Full::new(body.clone()));
    let r = client(fast())
        .post(format!("{base}/orders"))
        .body(streaming)
        .send()
        .await
        .unwrap();
    assert_eq!(r.idem().unwrap().attempts, 2);
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.body == body));
}

#[tokio::test]
async fn each_logical_request_gets_a_fresh_key() {
    let (base, script) = scripted([]).await;
    let client = client(fast());
    let a = client.post(format!("{base}/a")).send().await.unwrap();
    let b = client.patch(format!("{base}/b")).send().await.unwrap();
    assert_ne!(a.idem().unwrap().key, b.idem().unwrap().key);
    let seen = script.seen();
    assert_eq!(seen[0].key.as_deref(), Some(a.idem().unwrap().key.as_str()));
    assert_eq!(seen[1].key.as_deref(), Some(b.idem().unwrap().key.as_str()));
}

#[tokio::test]
async fn the_callers_key_is_used_from_an_extension_or_a_header() {
    let (base, script) = scripted([status(503)]).await;
    let client = client(fast());
    let key = IdempotencyKey::new("invoice-42").unwrap();
    let r = client
        .post(format!("{base}/payments"))
        .with_extension(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.idem().unwrap().key, key);
    assert_eq!(r.idem().unwrap().attempts, 2);
    let r = client
        .post(format!("{base}/payments"))
        .header("idempotency-key", "from-a-header")
        .send()
        .await
        .unwrap();
    assert_eq!(r.idem().unwrap().key.as_str(), "from-a-header");
    // The extension wins over a header.
    let r = client
        .post(format!("{base}/payments"))
        .header("idempotency-key", "from-a-header")
        .with_extension(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.idem().unwrap().key, key);
    let keys: Vec<_> = script.seen().into_iter().map(|s| s.key.unwrap()).collect();
    assert_eq!(
        keys,
        ["invoice-42", "invoice-42", "from-a-header", "invoice-42"]
    );
}

#[tokio::test]
async fn an_invalid_key_in_a_header_is_refused_before_anything_is_sent() {
    let (base, script) = scripted([]).await;
    let e = client(fast())
        .post(format!("{base}/orders"))
        .header("idempotency-key", "\"quoted\"")
        .send()
        .await
        .unwrap_err();
    assert_eq!(e.invalid_key(), Some(&idem_client::InvalidKey::Quoted));
    assert!(script.seen().is_empty());
}

#[tokio::test]
async fn other_methods_pass_through_untouched_unless_they_bring_a_key() {
    let (base, script) = scripted([status(503), status(503), status(503)]).await;
    let client = client(fast());
    for method in [Method::GET, Method::PUT, Method::DELETE] {
        let r = client
            .request(method.clone(), format!("{base}/x"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503, "{method}");
        assert!(r.idem().is_none());
    }
    let seen = script.seen();
    assert_eq!(seen.len(), 3, "no retries");
    assert!(seen.iter().all(|s| s.key.is_none()), "no key");
    // A DELETE that brings a key opts in: key and retries.
    let (base, script) = scripted([status(503)]).await;
    let r = client
        .delete(format!("{base}/orders/1"))
        .with_extension(IdempotencyKey::new("delete-1").unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert!(
        script
            .seen()
            .iter()
            .all(|s| s.method == Method::DELETE && s.key.as_deref() == Some("delete-1"))
    );
    // And the configured methods can be changed.
    let (base, script) = scripted([status(503)]).await;
    let put_too = self::client(fast().methods([Method::PUT]));
    assert_eq!(
        put_too
            .put(format!("{base}/x"))
            .send()
            .await
            .unwrap()
            .status(),
        201
    );
    let (base2, script2) = scripted([status(503)]).await;
    assert_eq!(
        put_too
            .post(format!("{base2}/x"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    assert_eq!(script.seen().len(), 2);
    assert_eq!(script2.seen().len(), 1);
}

#[tokio::test]
async fn a_422_is_returned_at_once() {
    let (base, script) = scripted([
        problem(422, "urn:idem:problem:fingerprint-mismatch", Some("1")),
        created(false),
    ])
    .await;
    let r = client(fast())
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    assert_eq!(r.idem().unwrap().attempts, 1);
    assert_eq!(script.seen().len(), 1);
    assert!(
        r.text().await.unwrap().contains("fingerprint-mismatch"),
        "the body is there for the caller"
    );
}

#[tokio::test]
async fn other_4xx_and_a_business_409_are_returned_at_once() {
    let replies = [
        status(400),
        status(401),
        status(404),
        Reply::Answer(429, vec![("retry-after", "1")], ""),
        problem(409, "urn:orders:problem:invalid-transition", None),
        status(501),
    ];
    let n = replies.len();
    let (base, script) = scripted(replies).await;
    let client = client(fast());
    for expected in [400, 401, 404, 429, 409, 501] {
        let r = client.post(format!("{base}/x")).send().await.unwrap();
        assert_eq!(r.status(), expected);
        assert_eq!(r.idem().unwrap().attempts, 1, "{expected}");
    }
    assert_eq!(script.seen().len(), n);
}

#[tokio::test]
async fn an_in_flight_409_is_retried_not_before_its_retry_after() {
    let (base, script) =
        scripted([problem(409, REQUEST_IN_FLIGHT, Some("1")), created(true)]).await;
    let started = std::time::Instant::now();
    let r = client(fast())
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1"
    );
    assert_eq!(r.status(), 201);
    let idem = r.idem().unwrap();
    assert_eq!(idem.attempts, 2);
    assert!(idem.replayed);
    assert_eq!(script.seen().len(), 2);
}

#[tokio::test]
async fn an_uncertain_202_is_retried_until_a_final_answer() {
    let (base, _script) = scripted([
        problem(202, OUTCOME_UNCERTAIN, Some("0")),
        problem(202, OUTCOME_UNCERTAIN, Some("0")),
        created(true),
    ])
    .await;
    let r = client(fast())
        .post(format!("{base}/payments"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 3);
    assert!(r.idem().unwrap().replayed);
    // A plain 202 is an answer.
    let (base, _script) = scripted([status(202)]).await;
    let r = client(fast())
        .post(format!("{base}/jobs"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.idem().unwrap().attempts, 1);
}

#[tokio::test]
async fn attempts_are_bounded() {
    let (base, script) = scripted(std::iter::repeat_n(status(503), 10)).await;
    let e = client(fast().max_attempts(3))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.attempts, 3);
    assert_eq!(gave_up.limit, Limit::Attempts(3));
    assert!(matches!(
        gave_up.last,
        LastAnswer::Status { status, .. } if status == 503
    ));
    assert_eq!(script.seen().len(), 3);
    let shown = e.to_string();
    assert!(shown.contains("3 attempts"), "{shown}");
    assert!(
        !shown.contains(gave_up.key.as_str()),
        "never the key: {shown}"
    );
    let debugged = format!("{e:?}");
    assert!(
        !debugged.contains(gave_up.key.as_str()),
        "never the key: {debugged}"
    );
}

#[tokio::test]
async fn a_retry_after_beyond_the_deadline_gives_up_at_once() {
    let (base, script) = scripted([problem(503, "other", Some("120"))]).await;
    let e = client(fast().deadline(Duration::from_secs(10)))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.attempts, 1);
    assert_eq!(gave_up.limit, Limit::Deadline(Duration::from_secs(10)));
    assert!(
        gave_up.elapsed < Duration::from_secs(10),
        "it does not sleep towards a deadline it cannot make"
    );
    match &gave_up.last {
        LastAnswer::Status {
            retry_after,
            problem_type,
            ..
        } => {
            assert_eq!(*retry_after, Some(Duration::from_secs(120)));
            assert_eq!(problem_type.as_deref(), Some("urn:test:problem:other"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(script.seen().len(), 1);
}

/// A `Retry-After` no clock can hold, and a deadline of `Duration::MAX`, are
/// an answer to give up on and no deadline: never an `Instant` overflow (a panic
/// in the caller's task).
#[tokio::test]
async fn a_retry_after_or_a_deadline_past_the_clock_does_not_panic() {
    let (base, script) = scripted([problem(503, "other", Some("18446744073709551615"))]).await;
    let e = client(fast().deadline(Duration::from_secs(10)))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.limit, Limit::Deadline(Duration::from_secs(10)));
    assert_eq!(script.seen().len(), 1);
    // Past what a u64 holds: the longest wait too, not an absent one (which
    // would be retried at once).
    let (base, script) = scripted([problem(503, "other", Some("99999999999999999999999"))]).await;
    let e = client(fast().deadline(Duration::from_secs(10)))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap_err();
    assert!(e.gave_up().is_some(), "{e}");
    assert_eq!(script.seen().len(), 1);

    let (base, script) = scripted([status(503), created(false)]).await;
    let r = client(fast().deadline(Duration::MAX))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(script.seen().len(), 2);
}

#[tokio::test]
async fn a_response_lost_to_the_attempt_timeout_is_retried_with_the_same_key() {
    let (base, script) = scripted([Reply::Hang, created(true)]).await;
    let r = client(fast().attempt_timeout(Duration::from_millis(300)))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert!(r.idem().unwrap().replayed);
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key);
}

#[tokio::test]
async fn the_deadline_cuts_off_an_attempt_that_waits_for_its_answer() {
    let (base, _script) = scripted([Reply::Hang]).await;
    let e = client(fast().deadline(Duration::from_millis(500)))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.attempts, 1);
    assert!(matches!(gave_up.last, LastAnswer::CutOff));
    assert_eq!(gave_up.limit, Limit::Deadline(Duration::from_millis(500)));
}

#[tokio::test]
async fn a_refused_connection_is_retried_then_a_clear_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let e = client(fast().max_attempts(4))
        .post(format!("http://{addr}/orders"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.attempts, 4);
    match &gave_up.last {
        LastAnswer::Transport(t) => assert!(t.is_connect(), "{t}"),
        other => panic!("{other:?}"),
    }
    assert!(std::error::Error::source(gave_up).is_some());
}

/// A raw HTTP server: connection `i` gets `script[i]` (then a `201`), after the
/// whole request head has arrived. `None` closes the connection without a word.
async fn raw(script: Vec<Option<&'static str>>) -> (String, Arc<Mutex<Vec<String>>>) {
    raw_with(script, false).await
}

/// As [`raw`]; with `hold`, each connection stays open after its answer (an
/// answer shorter than its length then stalls instead of being cut off).
async fn raw_with(
    script: Vec<Option<&'static str>>,
    hold: bool,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        let mut script = script.into_iter();
        let mut held = Vec::new();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let reply = script.next().unwrap_or(Some(
                "HTTP/1.1 201 Created\r\ncontent-length: 8\r\nconnection: close\r\n\r\n{\"id\":1}",
            ));
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                head.extend_from_slice(&buf[..n]);
            }
            seen.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&head).to_lowercase());
            if let Some(reply) = reply {
                socket.write_all(reply.as_bytes()).await.unwrap();
            }
            if hold && reply.is_some() {
                held.push(socket);
            }
            // Dropping the socket closes the connection.
        }
    });
    (base, heads)
}

fn key_of(head: &str) -> String {
    head.lines()
        .find_map(|l| l.strip_prefix("idempotency-key: "))
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn a_connection_closed_before_the_answer_is_retried() {
    let (base, heads) = raw(vec![None]).await;
    let r = client(fast())
        .post(format!("{base}/orders"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2);
    assert_eq!(key_of(&heads[0]), key_of(&heads[1]));
}

#[tokio::test]
async fn a_body_cut_off_mid_way_is_retried() {
    cut_off_and_retried("50", fast()).await;
}

/// A `Content-Length` is the server's word, not memory to set aside: one far
/// past what arrives, under a limit lifted to `usize::MAX`, is read as the
/// bytes come (here cut off, so retried) instead of reserved up front, which
/// would abort the process.
#[tokio::test]
async fn a_huge_declared_length_reserves_nothing_up_front() {
    cut_off_and_retried("4611686018427387904", fast().max_response_body(usize::MAX)).await;
}

/// A `201` declaring `length` bytes, cut off after a few, is retried under
/// `middleware` and the second answer handed over.
async fn cut_off_and_retried(length: &str, middleware: IdempotencyMiddleware) {
    let reply = leak(format!(
        "HTTP/1.1 201 Created\r\ncontent-length: {length}\r\n\r\n{{\"id\":"
    ));
    let (base, heads) = raw(vec![Some(reply)]).await;
    let r = client(middleware)
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert_eq!(r.bytes().await.unwrap(), r#"{"id":1}"#);
    assert_eq!(heads.lock().unwrap().len(), 2);
}

/// A `503` whose body is cut off mid-way is still waited out for its
/// `Retry-After` (the body only names its problem), not retried at once as a
/// lost answer.
#[tokio::test]
async fn a_retried_answer_whose_body_is_cut_off_keeps_its_retry_after() {
    let (base, heads) = raw(vec![Some(
        "HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\n\
         content-type: application/problem+json\r\ncontent-length: 50\r\n\r\n{\"type\":",
    )])
    .await;
    let started = std::time::Instant::now();
    let r = client(fast())
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1, after {:?}",
        started.elapsed()
    );
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert_eq!(heads.lock().unwrap().len(), 2);
}

/// A `503` whose body stalls (a length it never sends) is retried after its
/// `Retry-After`: the body, which only names its problem, is read for a
/// second at most, not until the deadline.
#[tokio::test]
async fn a_retried_answer_whose_body_stalls_is_retried_before_the_deadline() {
    let (base, heads) = raw_with(
        vec![Some(
            "HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\n\
             content-type: application/problem+json\r\ncontent-length: 50\r\n\r\n{\"type\":",
        )],
        true,
    )
    .await;
    // A deadline a body read to its end would reach: `GaveUp` then, not 201.
    let started = std::time::Instant::now();
    let r = client(fast().deadline(Duration::from_secs(10)))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1, after {:?}",
        started.elapsed()
    );
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert_eq!(heads.lock().unwrap().len(), 2);
}

/// An uncertain `202` whose problem document is cut off mid-way is still
/// waited out for the `Retry-After` of its head (how long the server said its
/// reconciliation takes), not sent again at once as a lost answer.
#[tokio::test]
async fn an_uncertain_202_whose_body_is_cut_off_keeps_its_retry_after() {
    let (base, heads) = raw(vec![Some(
        "HTTP/1.1 202 Accepted\r\nretry-after: 1\r\n\
         content-type: application/problem+json\r\ncontent-length: 80\r\n\r\n{\"type\":",
    )])
    .await;
    let started = std::time::Instant::now();
    let r = client(fast())
        .post(format!("{base}/payments"))
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1, after {:?}",
        started.elapsed()
    );
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2);
    assert_eq!(key_of(&heads[0]), key_of(&heads[1]));
}

/// An uncertain `202` whose problem document stalls (a length it never
/// sends) is taken for a lost answer after a few seconds, and sent again
/// after its `Retry-After`: not held until the deadline, to end in `GaveUp`.
#[tokio::test]
async fn an_uncertain_202_whose_body_stalls_is_retried_after_its_retry_after() {
    let (base, heads) = raw_with(
        vec![Some(
            "HTTP/1.1 202 Accepted\r\nretry-after: 1\r\n\
             content-type: application/problem+json\r\ncontent-length: 80\r\n\r\n{\"type\":",
        )],
        true,
    )
    .await;
    let started = std::time::Instant::now();
    let r = client(fast().deadline(Duration::from_secs(15)))
        .post(format!("{base}/payments"))
        .send()
        .await
        .unwrap();
    // The stall is given up after 5 s, then the head's Retry-After (1 s) is
    // waited out: a retry at once would come back after about 5 s.
    assert!(
        started.elapsed() >= Duration::from_secs(6),
        "5 s of stall, then Retry-After: 1, after {:?}",
        started.elapsed()
    );
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert_eq!(heads.lock().unwrap().len(), 2);
}

/// Placed after `IdempotencyMiddleware`: the answer's body fails as a
/// decompressing client fails on a body that does not inflate (reqwest's
/// decoders report an `std::io::Error` of their own), every time.
struct UndecodableBody;

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for UndecodableBody {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        use http_body_util::BodyExt;
        let response = next.run(req, extensions).await?;
        let mut corrupt = http::Response::new(reqwest::Body::wrap(
            http_body_util::Limited::new(http_body_util::Full::new(Bytes::from_static(b"\x1f")), 0)
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "corrupt deflate stream")
                }),
        ));
        *corrupt.status_mut() = response.status();
        *corrupt.headers_mut() = response.headers().clone();
        Ok(reqwest::Response::from(corrupt))
    }
}

/// A body that arrives but cannot be decoded would be the same on every retry
/// (the server replays the same answer): the error comes at once, after one
/// send, and is not a `GaveUp`.
#[tokio::test]
async fn an_undecodable_body_is_not_retried() {
    let (base, script) = scripted([created(false), created(false), created(false)]).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            fast()
                .max_attempts(3)
                .backoff(Duration::from_millis(1), Duration::from_millis(20)),
        )
        .with(UndecodableBody)
        .build();
    let e = client
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap_err();
    assert!(e.gave_up().is_none(), "not retried until given up: {e}");
    // The answer arrived (the order was placed): the key comes with the error.
    let interrupted = e.interrupted().expect("Interrupted");
    assert!(interrupted.error.is_decode(), "{e:?}");
    assert_eq!(interrupted.attempts, 1);
    let seen = script.seen();
    assert_eq!(seen.len(), 1, "sent once");
    assert_eq!(
        seen[0].key.as_deref(),
        Some(interrupted.key.as_str()),
        "the key to retry with is the one sent"
    );
    assert!(e.to_string().contains("may have run"), "{e}");
    assert!(!e.to_string().contains(interrupted.key.as_str()), "{e}");
}

/// Placed after `IdempotencyMiddleware`: passes the first request on, and
/// fails every later one before it is sent, as a token refresher that cannot
/// reach its issuer would.
struct FailsAfterFirst(std::sync::atomic::AtomicU32);

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for FailsAfterFirst {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
            return Err(reqwest_middleware::Error::middleware(
                std::io::Error::other("token refresh failed"),
            ));
        }
        next.run(req, extensions).await
    }
}

/// The first attempt's answer is lost (the server may have charged), and a
/// middleware after idem fails the retry before it is sent: the caller gets
/// the key with the error, not an error that reads as "never sent".
#[tokio::test]
async fn an_error_after_a_send_carries_the_key_to_retry_with() {
    let (base, script) = scripted([Reply::Hang]).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            fast()
                .attempt_timeout(Duration::from_millis(300))
                .backoff(Duration::from_millis(1), Duration::from_millis(20)),
        )
        .with(FailsAfterFirst(Default::default()))
        .build();
    let e = client
        .post(format!("{base}/payments"))
        .send()
        .await
        .unwrap_err();
    let interrupted = e.interrupted().expect("Interrupted");
    assert_eq!(interrupted.attempts, 2);
    assert!(
        interrupted
            .error
            .to_string()
            .contains("token refresh failed"),
        "{e}"
    );
    let seen = script.seen();
    assert_eq!(seen.len(), 1, "the retry never left");
    assert_eq!(seen[0].key.as_deref(), Some(interrupted.key.as_str()));
}

/// A `'static` text made at run time, for the scripts.
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// A final answer whose body is over the limit is the typed error, naming the
/// limit (never the body or the key), after one send: the same answer would
/// come again. A body exactly at the limit is handed over whole.
#[tokio::test]
async fn a_final_body_over_the_limit_is_a_typed_error_naming_the_limit_and_not_retried() {
    let big = leak("x".repeat(2000));
    let (base, script) = scripted([Reply::Answer(201, vec![], big), created(false)]).await;
    let e = client(fast().max_response_body(1000))
        .post(format!("{base}/reports"))
        .send()
        .await
        .unwrap_err();
    let too_large = e.body_too_large().expect("BodyTooLarge");
    assert_eq!(too_large.limit, 1000);
    assert_eq!(too_large.status, 201);
    assert_eq!(too_large.content_length, Some(2000));
    assert_eq!(too_large.attempts, 1);
    assert!(e.gave_up().is_none());
    assert_eq!(script.seen().len(), 1, "not retried");
    assert_eq!(
        script.seen()[0].key.as_deref(),
        Some(too_large.key.as_str()),
        "the key to ask again with"
    );
    let shown = e.to_string();
    assert!(shown.contains("1000 bytes"), "names the limit: {shown}");
    assert!(!shown.contains("xxx"), "never the body: {shown}");
    assert!(
        !shown.contains(too_large.key.as_str()),
        "never the key: {shown}"
    );
    assert!(!format!("{e:?}").contains(too_large.key.as_str()));

    let exact = leak("y".repeat(1000));
    let (base, _script) = scripted([Reply::Answer(201, vec![], exact)]).await;
    let r = client(fast().max_response_body(1000))
        .post(format!("{base}/reports"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap(), exact);
}

/// A body with no `Content-Length` (chunked) is read up to the limit and no
/// further: the same error, with no length to report.
#[tokio::test]
async fn a_chunked_body_over_the_limit_is_stopped_at_the_limit() {
    let chunk = "z".repeat(600);
    let reply = leak(format!(
        "HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         258\r\n{chunk}\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    ));
    let (base, heads) = raw(vec![Some(reply)]).await;
    let e = client(fast().max_response_body(1000))
        .post(format!("{base}/reports"))
        .send()
        .await
        .unwrap_err();
    let too_large = e.body_too_large().expect("BodyTooLarge");
    assert_eq!(too_large.limit, 1000);
    assert_eq!(too_large.content_length, None);
    assert_eq!(heads.lock().unwrap().len(), 1, "not retried");
}

/// idem's uncertain `202`, as its server words it: some 300 bytes.
const IDEM_UNCERTAIN: &str = r#"{"type":"urn:idem:problem:outcome-uncertain","title":"The outcome of this request is being confirmed","status":202,"detail":"an earlier attempt may have taken effect; it is being reconciled and will not run twice. Retry later with the same key","retry_after":1}"#;

/// A limit under the size of idem's problem documents is the caller's on what
/// it is handed, not on what the middleware reads to judge: the uncertain
/// `202` and the in-flight `409` are still read, and retried, and the small
/// final answer handed over.
#[tokio::test]
async fn a_small_limit_still_reads_an_uncertain_202_and_retries_it() {
    assert!(IDEM_UNCERTAIN.len() > 250);
    let in_flight = leak(format!(
        r#"{{"type":"{REQUEST_IN_FLIGHT}","title":"A request with this key is in flight","detail":"{}"}}"#,
        "d".repeat(200)
    ));
    let (base, script) = scripted([
        Reply::Answer(
            202,
            vec![
                ("content-type", "application/problem+json"),
                ("retry-after", "0"),
            ],
            IDEM_UNCERTAIN,
        ),
        Reply::Answer(
            409,
            vec![("content-type", "application/problem+json")],
            in_flight,
        ),
        created(true),
    ])
    .await;
    let r = client(fast().max_response_body(100))
        .post(format!("{base}/payments"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 3);
    assert_eq!(script.seen().len(), 3);
    assert_eq!(r.bytes().await.unwrap(), r#"{"id":1}"#);
}

/// The same for a long operation's documents (the `202 Accepted` and what its
/// resource says), which are followed, not handed over.
#[tokio::test]
async fn a_small_limit_still_follows_a_long_operation() {
    let (base, script) = scripted([
        accepted("0"),
        document(
            "0",
            r#"{"status":"running","detail":"the export is being written"}"#,
        ),
        document(
            "0",
            r#"{"status":"succeeded","result":"/operations/create-export/ab12/result"}"#,
        ),
        created(true),
    ])
    .await;
    let r = client(following().max_response_body(40))
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().polls, 3);
    assert_eq!(script.seen().len(), 4);
}

/// What the middleware reads to judge is still bounded (a document past the
/// floor cannot be judged), and a document judged final is the caller's,
/// so held to the limit like any final answer; a retry that the status
/// decides alone is not stopped by a long body (it is only dropped).
#[tokio::test]
async fn the_limit_holds_for_a_judged_answer_handed_over_and_past_the_floor() {
    let conflict = leak(format!(
        r#"{{"type":"urn:orders:problem:invalid-transition","detail":"{}"}}"#,
        "d".repeat(2000)
    ));
    let (base, script) = scripted([Reply::Answer(
        409,
        vec![("content-type", "application/problem+json")],
        conflict,
    )])
    .await;
    let e = client(fast().max_response_body(1000))
        .post(format!("{base}/orders/1/cancel"))
        .send()
        .await
        .unwrap_err();
    let too_large = e.body_too_large().expect("BodyTooLarge");
    assert_eq!(too_large.status, 409);
    assert_eq!(too_large.limit, 1000);
    assert_eq!(too_large.content_length, Some(conflict.len() as u64));
    assert_eq!(script.seen().len(), 1);

    let past_the_floor = leak(format!(
        r#"{{"type":"urn:idem:problem:outcome-uncertain","detail":"{}"}}"#,
        "d".repeat(70 * 1024)
    ));
    let (base, script) = scripted([Reply::Answer(
        202,
        vec![
            ("content-type", "application/problem+json"),
            ("retry-after", "0"),
        ],
        past_the_floor,
    )])
    .await;
    let e = client(fast().max_response_body(1000))
        .post(format!("{base}/payments"))
        .send()
        .await
        .unwrap_err();
    assert_eq!(e.body_too_large().expect("BodyTooLarge").status, 202);
    assert_eq!(script.seen().len(), 1);

    let long_503 = leak("e".repeat(2000));
    let (base, script) = scripted([Reply::Answer(503, vec![], long_503), created(false)]).await;
    let r = client(fast().max_response_body(1000))
        .post(format!("{base}/orders"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    assert_eq!(script.seen().len(), 2);
}

/// With `StreamFinal` the final answer is handed over as soon as its head has
/// arrived: the server holds the rest of its body back until the caller has
/// the response in hand (were the middleware reading it, `send` would never
/// return), and the body, far over the limit on buffered bodies, is then read
/// by the caller.
#[tokio::test]
async fn stream_final_hands_over_the_final_answer_before_its_body_has_arrived() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let chunk = "s".repeat(16 * 1024);
    let server = tokio::spawn({
        let chunk = chunk.clone();
        async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request head");
                head.extend_from_slice(&buf[..n]);
            }
            let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
            socket
                .write_all(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            socket.write_all(framed.as_bytes()).await.unwrap();
            released.await.unwrap();
            for _ in 0..3 {
                socket.write_all(framed.as_bytes()).await.unwrap();
            }
            socket.write_all(b"0\r\n\r\n").await.unwrap();
        }
    });
    let r = client(fast().max_response_body(1024))
        .post(format!("{base}/exports"))
        .with_extension(StreamFinal)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 1);
    release.send(()).unwrap();
    let body = r.bytes().await.unwrap();
    assert_eq!(body.len(), 4 * chunk.len());
    server.await.unwrap();
}

/// With `follow_accepted`, a `202` that names no operation to follow (no
/// `Location` here) is a final answer like any other: under `StreamFinal` it is
/// handed over unread, its body far over the limit on buffered bodies, not
/// read as a document (nor refused as `BodyTooLarge`).
#[tokio::test]
async fn a_202_that_names_no_operation_is_final_under_follow_accepted() {
    let report = leak(format!(
        "HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
        100 * 1024,
        "r".repeat(100 * 1024)
    ));
    let (base, heads) = raw(vec![Some(report)]).await;
    let r = client(fast().follow_accepted(true).max_response_body(1024))
        .post(format!("{base}/batches"))
        .with_extension(StreamFinal)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.idem().unwrap().attempts, 1);
    assert_eq!(heads.lock().unwrap().len(), 1);
    assert_eq!(r.bytes().await.unwrap().len(), 100 * 1024);
}

/// `StreamFinal` changes nothing before the final answer: the problem documents
/// of an uncertain `202` and an in-flight `409` are still read and retried, a
/// `503` too, and the final answer's body is the caller's to read.
#[tokio::test]
async fn stream_final_still_retries_what_the_contract_retries() {
    let (base, script) = scripted([
        problem(202, OUTCOME_UNCERTAIN, Some("0")),
        problem(409, REQUEST_IN_FLIGHT, None),
        status(503),
        created(true),
    ])
    .await;
    let r = client(fast())
        .post(format!("{base}/payments"))
        .with_extension(StreamFinal)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let idem = r.idem().unwrap().clone();
    assert_eq!(idem.attempts, 4);
    assert!(idem.replayed);
    assert_eq!(script.seen().len(), 4);
    assert_eq!(r.bytes().await.unwrap(), r#"{"id":1}"#);
}

// --- Following a long operation (`follow_accepted`) ----------------------------

const OPERATION: &str = "/operations/create-export/ab12";

fn accepted(retry_after: &'static str) -> Reply {
    Reply::Answer(
        202,
        vec![
            ("content-type", "application/json"),
            ("location", OPERATION),
            ("retry-after", retry_after),
        ],
        r#"{"status":"running","href":"/operations/create-export/ab12"}"#,
    )
}

/// An operation document saying `body`, with `Retry-After`.
fn document(retry_after: &'static str, body: &'static str) -> Reply {
    Reply::Answer(
        200,
        vec![
            ("content-type", "application/json"),
            ("retry-after", retry_after),
        ],
        body,
    )
}

fn following() -> IdempotencyMiddleware {
    fast().follow_accepted(true)
}

/// The whole walk: `202`, `running`, `stalled` (the original request again,
/// same key and bytes, its `202` followed again), `succeeded`, the result. The
/// `GET`s carry the caller's credentials, never the key or the body's headers.
#[tokio::test]
async fn a_followed_202_ends_with_the_stored_result_through_a_stall() {
    let (base, script) = scripted([
        accepted("0"),
        document("0", r#"{"status":"running"}"#),
        document("0", r#"{"status":"stalled"}"#),
        accepted("0"),
        document(
            "0",
            r#"{"status":"succeeded","response_status":201,"result":"/operations/create-export/ab12/result"}"#,
        ),
        created(true),
    ])
    .await;
    let r = client(following())
        .post(format!("{base}/exports"))
        .bearer_auth("acme")
        .header("x-tenant", "acme")
        .json(&serde_json::json!({"format": "csv"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let idem = r.idem().unwrap().clone();
    assert_eq!((idem.attempts, idem.polls), (2, 4));
    assert!(idem.replayed);
    assert_eq!(
        idem.operation.as_ref().map(|u| u.as_str().to_owned()),
        Some(format!("{base}{OPERATION}"))
    );
    assert_eq!(r.url().path(), "/operations/create-export/ab12/result");
    assert_eq!(r.bytes().await.unwrap(), r#"{"id":1}"#);
    let seen = script.seen();
    let walk: Vec<_> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.path.as_str()))
        .collect();
    assert_eq!(
        walk,
        [
            ("POST", "/exports"),
            ("GET", OPERATION),
            ("GET", OPERATION),
            ("POST", "/exports"),
            ("GET", OPERATION),
            ("GET", "/operations/create-export/ab12/result"),
        ]
    );
    for s in &seen {
        assert_eq!(s.headers["authorization"], "Bearer acme");
        assert_eq!(s.headers["x-tenant"], "acme");
        if s.method == Method::POST {
            assert_eq!(s.key.as_deref(), Some(idem.key.as_str()));
            assert_eq!(s.body, r#"{"format":"csv"}"#);
        } else {
            assert_eq!(s.key, None);
            assert!(s.headers.get("content-type").is_none());
            assert!(s.body.is_empty());
        }
    }
}

/// Off by default: the `202` is the answer. And with it on, a `Location` on
/// another origin is not followed (the request's credentials stay home).
#[tokio::test]
async fn a_202_is_followed_only_when_asked_and_only_at_home() {
    let (base, script) = scripted([accepted("0")]).await;
    let r = client(fast())
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(
        (r.idem().unwrap().polls, r.idem().unwrap().operation.clone()),
        (0, None)
    );
    assert_eq!(script.seen().len(), 1);

    let elsewhere = Reply::Answer(
        202,
        vec![("location", "http://127.0.0.1:1/operations/x/ab")],
        "",
    );
    let (base, script) = scripted([elsewhere]).await;
    let r = client(following())
        .post(format!("{base}/exports"))
        .bearer_auth("acme")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.idem().unwrap().polls, 0);
    assert_eq!(script.seen().len(), 1);
}

/// The deadline ends the following: `GaveUp`, naming the resource and what it
/// said last; a `Retry-After` past the deadline is not waited out.
#[tokio::test]
async fn the_deadline_ends_the_following_with_the_operation_named() {
    let (base, script) = scripted([
        accepted("0"),
        document("600", r#"{"status":"running","retry_after":600}"#),
    ])
    .await;
    let e = client(following())
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert_eq!(gave_up.limit, Limit::Deadline(Duration::from_secs(60)));
    assert_eq!((gave_up.attempts, gave_up.polls), (1, 1));
    assert_eq!(
        gave_up.operation.as_ref().map(|u| u.path().to_owned()),
        Some(OPERATION.to_owned())
    );
    match &gave_up.last {
        LastAnswer::Operation { state, retry_after } => {
            assert_eq!(state, "running");
            assert_eq!(*retry_after, Some(Duration::from_secs(600)));
        }
        other => panic!("{other:?}"),
    }
    let shown = e.to_string();
    assert!(shown.contains("1 poll of a long operation"), "{shown}");
    assert!(shown.contains("the long operation is running"), "{shown}");
    assert_eq!(script.seen().len(), 2);
}

/// What idem's server puts in an operation's path: the SHA-256 digest of the
/// key (here of "test"), from which a guessable key is recovered.
const DIGEST: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// A `202 Accepted` naming the operation `/operations/create-export/{DIGEST}`.
fn accepted_at_digest() -> Reply {
    let location = leak(format!("/operations/create-export/{DIGEST}"));
    Reply::Answer(202, vec![("location", location), ("retry-after", "0")], "")
}

/// Neither `GaveUp`'s `Debug` nor its `Display` shows the operation's path,
/// which holds the key's digest: its origin only. The field itself keeps
/// the whole URL, for the caller to ask it later.
#[tokio::test]
async fn a_gave_up_shows_the_operations_origin_not_its_path() {
    let (base, _script) = scripted([
        accepted_at_digest(),
        document("600", r#"{"status":"running"}"#),
    ])
    .await;
    let e = client(following())
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert!(gave_up.operation.as_ref().unwrap().path().ends_with(DIGEST));
    for shown in [
        format!("{gave_up:?}"),
        format!("{e:?}"),
        format!("{gave_up}"),
        format!("{e}"),
    ] {
        assert!(!shown.contains(DIGEST), "the key's digest: {shown}");
        assert!(!shown.contains(gave_up.key.as_str()), "the key: {shown}");
    }
    let debugged = format!("{gave_up:?}");
    assert!(
        debugged.contains(&format!("{base}/<redacted>")),
        "the origin: {debugged}"
    );
}

/// `IdemOutcome`'s `Debug` neither: a followed operation's answer may be
/// logged whole.
#[tokio::test]
async fn an_outcome_shows_the_operations_origin_not_its_path() {
    let result = leak(format!(
        r#"{{"status":"succeeded","result":"/operations/create-export/{DIGEST}/result"}}"#
    ));
    let (base, _script) =
        scripted([accepted_at_digest(), document("0", result), created(true)]).await;
    let r = client(following())
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap();
    let idem = r.idem().unwrap();
    assert!(idem.operation.as_ref().unwrap().path().ends_with(DIGEST));
    let debugged = format!("{idem:?}");
    assert!(!debugged.contains(DIGEST), "the key's digest: {debugged}");
    assert!(
        debugged.contains(&format!("{base}/<redacted>")),
        "{debugged}"
    );
}

/// An error of a `GET` of the operation carries the operation's URL, and
/// comes without it: an error that ends the following (here a redirect the
/// client refuses) in `Interrupted`, and a lost answer in `GaveUp`'s last.
#[tokio::test]
async fn an_error_of_a_poll_shows_no_operation_path() {
    let redirected = Reply::Answer(302, vec![("location", "/elsewhere")], "");
    let (base, script) = scripted([accepted_at_digest(), redirected]).await;
    let refusing = ClientBuilder::new(
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::custom(|attempt| {
                attempt.error("redirects refused")
            }))
            .build()
            .unwrap(),
    )
    .with(following().backoff(Duration::from_millis(1), Duration::from_millis(20)))
    .build();
    let e = refusing
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap_err();
    let interrupted = e.interrupted().expect("Interrupted");
    assert_eq!((interrupted.attempts, interrupted.polls), (1, 1));
    assert!(interrupted.error.is_redirect(), "{e:?}");
    assert!(
        interrupted
            .operation
            .as_ref()
            .unwrap()
            .path()
            .ends_with(DIGEST)
    );
    for shown in [format!("{interrupted:?}"), format!("{e:?}"), format!("{e}")] {
        assert!(!shown.contains(DIGEST), "the key's digest: {shown}");
    }
    assert_eq!(script.seen().len(), 2);

    // Polls that get no answer, until the deadline: the last is (but for an
    // attempt the deadline cuts off) the transport error of a poll.
    let (base, _heads) = raw(vec![Some(leak(format!(
        "HTTP/1.1 202 Accepted\r\nlocation: /operations/create-export/{DIGEST}\r\n\
         retry-after: 0\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )))]
    .into_iter()
    .chain(std::iter::repeat_n(None, 100))
    .collect())
    .await;
    let e = ClientBuilder::new(reqwest::Client::new())
        .with(
            following()
                .deadline(Duration::from_secs(2))
                .backoff(Duration::from_millis(200), Duration::from_secs(10)),
        )
        .build()
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap_err();
    let gave_up = e.gave_up().expect("GaveUp");
    assert!(gave_up.polls >= 1);
    if let LastAnswer::Transport(t) = &gave_up.last {
        assert!(t.url().is_none(), "{t:?}");
    }
    for shown in [format!("{gave_up:?}"), format!("{e:?}"), format!("{e}")] {
        assert!(!shown.contains(DIGEST), "the key's digest: {shown}");
    }
}

/// A resource that is gone (the work failed and freed its key) is like a `5xx`:
/// the request is sent again. Any other answer of the resource's that is not
/// about the operation (a `401` once a token expired) ends the following with
/// `Interrupted`, its key and resource, never handed over as the request's
/// answer; `max_attempts` counts the sends only.
#[tokio::test]
async fn a_gone_operation_is_sent_again_a_refused_poll_is_interrupted() {
    let gone = Reply::Answer(
        404,
        vec![("content-type", "application/problem+json")],
        r#"{"type":"urn:idem:problem:operation-not-found"}"#,
    );
    let refused = Reply::Answer(401, vec![], "who are you");
    let (base, script) = scripted([
        accepted("0"),
        gone,
        accepted("0"),
        document("0", r#"{"status":"running"}"#),
        document("0", r#"{"status":"uncertain"}"#),
        status(503),
        refused,
    ])
    .await;
    let e = client(following().max_attempts(2))
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap_err();
    let interrupted = e.interrupted().expect("Interrupted, not an answer");
    assert_eq!((interrupted.attempts, interrupted.polls), (2, 5));
    assert_eq!(
        interrupted.operation.as_ref().map(|u| u.path()),
        Some(OPERATION)
    );
    assert_eq!(
        Some(interrupted.key.as_str()),
        script.seen()[0].key.as_deref(),
        "the key to send again with"
    );
    let reqwest_middleware::Error::Middleware(error) = &interrupted.error else {
        panic!("{interrupted:?}")
    };
    let refused = error.downcast_ref::<PollRefused>().expect("a PollRefused");
    assert_eq!(refused.status, 401);
    let methods: Vec<_> = script.seen().iter().map(|s| s.method.clone()).collect();
    assert_eq!(
        methods,
        [
            Method::POST,
            Method::GET,
            Method::POST,
            Method::GET,
            Method::GET,
            Method::GET,
            Method::GET
        ]
    );
}

/// Under `StreamFinal` too, a result that is gone (idem's `404`
/// `operation-not-found` between the poll and the result's `GET`) sends the
/// request again, as without it: it is not handed over as the request's
/// answer, which would read as "not found" for an operation that ran.
#[tokio::test]
async fn a_gone_result_is_sent_again_under_stream_final() {
    let gone = Reply::Answer(
        404,
        vec![("content-type", "application/problem+json")],
        r#"{"type":"urn:idem:problem:operation-not-found"}"#,
    );
    let done = r#"{"status":"succeeded","result":"/operations/create-export/ab12/result"}"#;
    let (base, script) = scripted([
        accepted("0"),
        document("0", done),
        gone,
        accepted("0"),
        document("0", done),
        created(true),
    ])
    .await;
    let r = client(following())
        .post(format!("{base}/exports"))
        .with_extension(StreamFinal)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().attempts, 2);
    let methods: Vec<_> = script.seen().iter().map(|s| s.method.clone()).collect();
    assert_eq!(
        methods,
        [
            Method::POST,
            Method::GET,
            Method::GET,
            Method::POST,
            Method::GET,
            Method::GET
        ]
    );
}

/// A long operation's document cut off mid-way is asked for again, but not
/// before the `Retry-After` of its head: the server's word on when to look.
#[tokio::test]
async fn an_operation_document_cut_off_keeps_its_retry_after() {
    let (base, heads) = raw(vec![
        Some(
            "HTTP/1.1 202 Accepted\r\nlocation: /operations/create-export/ab12\r\n\
             retry-after: 0\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        ),
        Some(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
             content-length: 80\r\n\r\n{\"status\":",
        ),
        Some(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 71\r\n\
             connection: close\r\n\r\n\
             {\"status\":\"succeeded\",\"result\":\"/operations/create-export/ab12/result\"}",
        ),
    ])
    .await;
    let started = std::time::Instant::now();
    let r = client(following())
        .post(format!("{base}/exports"))
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1, after {:?}",
        started.elapsed()
    );
    assert_eq!(r.status(), 201);
    assert_eq!(
        (r.idem().unwrap().attempts, r.idem().unwrap().polls),
        (1, 3)
    );
    let heads = heads.lock().unwrap().clone();
    let walk: Vec<_> = heads
        .iter()
        .map(|h| h.lines().next().unwrap().to_owned())
        .collect();
    assert_eq!(
        walk,
        [
            "post /exports http/1.1",
            "get /operations/create-export/ab12 http/1.1",
            "get /operations/create-export/ab12 http/1.1",
            "get /operations/create-export/ab12/result http/1.1",
        ]
    );
}

/// `StreamFinal` applies to the result: handed over unread.
#[tokio::test]
async fn the_result_is_streamed_under_stream_final() {
    let (base, _script) = scripted([
        accepted("0"),
        document(
            "0",
            r#"{"status":"succeeded","result":"/operations/create-export/ab12/result"}"#,
        ),
        created(true),
    ])
    .await;
    let mut r = client(following())
        .post(format!("{base}/exports"))
        .with_extension(StreamFinal)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.idem().unwrap().polls, 2);
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    assert_eq!(body, br#"{"id":1}"#);
}
