//! The middleware: one key per logical request, retries by the contract.

use std::time::Duration;

use bytes::Bytes;
use http::Extensions;
use http_body_util::BodyExt;
use reqwest::header::HeaderValue;
use reqwest::{Method, Request, Response, ResponseBuilderExt};
use reqwest_middleware::{Error, Middleware, Next};
use tokio::time::Instant;

use crate::decide::{Verdict, full_jitter, judge, problem_type};
use crate::{GaveUp, IDEMPOTENCY_KEY, IdemOutcome, IdempotencyKey, InvalidKey, LastAnswer, Limit};

/// The `reqwest-middleware` middleware that makes a client keep the idempotency
/// contract: one `Idempotency-Key` per logical request, the same key and the same
/// bytes for every retry of it, and retries only where the answer allows them.
///
/// For the methods it handles (`POST` and `PATCH` unless
/// [`methods`](IdempotencyMiddleware::methods) says otherwise) and for any request
/// that carries an [`IdempotencyKey`] extension, it
///
/// * takes the key from the extension, else from an `Idempotency-Key` header the
///   caller set, else makes a fresh UUID v4;
/// * buffers the request body, so every attempt sends it byte for byte;
/// * reads each answer's body before judging it, so a response cut off mid-body is
///   a lost response too, and returns the final answer with its body in memory;
/// * retries, after a full-jitter backoff and never before the answer's
///   `Retry-After`: connection errors and timeouts (the lost response), `5xx`
///   but `501`/`505`, `409` with `Retry-After` or the in-flight problem, and
///   `202` with the outcome-uncertain problem. It never retries a `422` (the key
///   was used for another request: a bug to fix, not to repeat) nor any other
///   `4xx` or final answer;
/// * stops after [`max_attempts`](IdempotencyMiddleware::max_attempts) sends or at
///   the [`deadline`](IdempotencyMiddleware::deadline), with [`GaveUp`];
/// * stores an [`IdemOutcome`] (key, attempts, replayed) in the final response's
///   extensions.
///
/// Other requests pass through untouched. It logs nothing, and so never a key.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_client::{IdempotencyKey, IdempotencyMiddleware, ResponseExt};
/// use reqwest_middleware::ClientBuilder;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(
///         IdempotencyMiddleware::new()
///             .attempt_timeout(Duration::from_secs(2))
///             .deadline(Duration::from_secs(20)),
///     )
///     .build();
///
/// // A fresh key for this logical request, kept for its retries.
/// let order = client
///     .post("http://127.0.0.1:3000/orders")
///     .bearer_auth("acme")
///     .header("x-currency", "EUR")
///     .json(&serde_json::json!({"sku": "A-1", "quantity": 2, "amount_cents": 1999}))
///     .send()
///     .await?;
/// let idem = order.idem().unwrap();
/// println!("{} after {} attempt(s), replayed: {}", order.status(), idem.attempts, idem.replayed);
///
/// // A key derived from a business id: the same even if this process restarts.
/// let payment = client
///     .post("http://127.0.0.1:3000/payments")
///     .bearer_auth("acme")
///     .with_extension(IdempotencyKey::new("pay-invoice-42")?)
///     .json(&serde_json::json!({"amount_cents": 500}))
///     .send()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyMiddleware {
    methods: Vec<Method>,
    max_attempts: u32,
    deadline: Duration,
    base_delay: Duration,
    max_delay: Duration,
    attempt_timeout: Option<Duration>,
}

impl Default for IdempotencyMiddleware {
    /// [`IdempotencyMiddleware::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyMiddleware {
    /// `POST` and `PATCH`; at most 10 attempts within 30 s; full-jitter backoff
    /// from 100 ms, doubling, capped at 5 s; no attempt timeout beyond the
    /// client's own.
    ///
    /// ```
    /// let middleware = idem_client::IdempotencyMiddleware::new();
    /// ```
    pub fn new() -> Self {
        IdempotencyMiddleware {
            methods: vec![Method::POST, Method::PATCH],
            max_attempts: 10,
            deadline: Duration::from_secs(30),
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            attempt_timeout: None,
        }
    }

    /// The methods that get a key and retries. A request of another method still
    /// does when it carries an [`IdempotencyKey`] extension.
    ///
    /// ```
    /// use reqwest::Method;
    ///
    /// let middleware = idem_client::IdempotencyMiddleware::new()
    ///     .methods([Method::POST, Method::PATCH, Method::DELETE]);
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// At most this many sends per logical request (1 means no retry; 0 counts
    /// as 1).
    ///
    /// ```
    /// let middleware = idem_client::IdempotencyMiddleware::new().max_attempts(5);
    /// ```
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The total time for a logical request, from its first send: no attempt
    /// starts, and no wait is begun, that would end past it, and an attempt still
    /// waiting for its answer then is cut off.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let middleware = idem_client::IdempotencyMiddleware::new().deadline(Duration::from_secs(60));
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The backoff between attempts: the `n`th retry waits a random time in
    /// `[0, min(max, base * 2^(n-1))]` (full jitter), or the answer's
    /// `Retry-After` if that is longer.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let middleware = idem_client::IdempotencyMiddleware::new()
    ///     .backoff(Duration::from_millis(50), Duration::from_secs(2));
    /// ```
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_delay = base;
        self.max_delay = max;
        self
    }

    /// How long one attempt may take, headers and body, before it counts as a lost
    /// response and is retried; for requests that set no timeout of their own
    /// (`RequestBuilder::timeout`). Without it, only the client's own timeout and
    /// the deadline bound an attempt.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let middleware = idem_client::IdempotencyMiddleware::new()
    ///     .attempt_timeout(Duration::from_secs(5));
    /// ```
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    fn handles(&self, req: &Request, extensions: &Extensions) -> bool {
        extensions.get::<IdempotencyKey>().is_some() || self.methods.contains(req.method())
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        if !self.handles(&req, extensions) {
            return next.run(req, extensions).await;
        }
        let key = key_for(&req, extensions).map_err(Error::middleware)?;
        req.headers_mut().insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_str(key.as_str()).expect("a valid key is a valid header value"),
        );
        buffer_body(&mut req).await?;
        if req.timeout().is_none() {
            *req.timeout_mut() = self.attempt_timeout;
        }

        let started = Instant::now();
        // `None`: a deadline the clock cannot hold (`Duration::MAX`), which is none.
        let deadline = started.checked_add(self.deadline);
        let remaining = || {
            deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            })
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            let attempt = req
                .try_clone()
                .expect("a request with a buffered body clones");
            let answer = tokio::time::timeout(remaining(), async {
                let response = next.clone().run(attempt, extensions).await?;
                buffer_response(response).await.map_err(Error::Reqwest)
            })
            .await;
            let give_up = |limit, last| {
                Error::middleware(GaveUp {
                    key: key.clone(),
                    attempts,
                    elapsed: started.elapsed(),
                    limit,
                    last,
                })
            };
            let (retry_after, last) = match answer {
                Err(_cut_off) => {
                    return Err(give_up(Limit::Deadline(self.deadline), LastAnswer::CutOff));
                }
                Ok(Err(Error::Reqwest(e))) if is_lost(&e) => (None, LastAnswer::Transport(e)),
                Ok(Err(e)) => return Err(e),
                Ok(Ok((mut response, body))) => {
                    match judge(response.status(), response.headers(), &body) {
                        Verdict::Final => {
                            let replayed = response
                                .headers()
                                .get("idempotent-replayed")
                                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
                            response.extensions_mut().insert(IdemOutcome {
                                key,
                                attempts,
                                replayed,
                            });
                            return Ok(response);
                        }
                        Verdict::Retry { retry_after } => (
                            retry_after,
                            LastAnswer::Status {
                                status: response.status(),
                                problem_type: problem_type(response.headers(), &body),
                                retry_after,
                            },
                        ),
                    }
                }
            };
            if attempts >= self.max_attempts {
                return Err(give_up(Limit::Attempts(self.max_attempts), last));
            }
            let backoff = full_jitter(self.base_delay, self.max_delay, attempts);
            let wait = backoff.max(retry_after.unwrap_or_default());
            // Compared as durations: a server's `Retry-After` may be far past
            // what an `Instant` can hold.
            if wait >= remaining() {
                return Err(give_up(Limit::Deadline(self.deadline), last));
            }
            tokio::time::sleep(wait).await;
        }
    }
}

/// The key of this logical request: the extension, else the caller's header,
/// else a fresh one.
fn key_for(req: &Request, extensions: &Extensions) -> Result<IdempotencyKey, InvalidKey> {
    if let Some(key) = extensions.get::<IdempotencyKey>() {
        return Ok(key.clone());
    }
    match req.headers().get(IDEMPOTENCY_KEY) {
        Some(value) => match value.to_str() {
            Ok(s) => IdempotencyKey::new(s),
            Err(_) => Err(InvalidKey::NotVisibleAscii {
                position: value
                    .as_bytes()
                    .iter()
                    .position(|b| !b.is_ascii())
                    .unwrap_or(0),
            }),
        },
        None => Ok(IdempotencyKey::random()),
    }
}

/// Makes the body replayable: a streaming body is read into memory once.
async fn buffer_body(req: &mut Request) -> reqwest_middleware::Result<()> {
    if req.try_clone().is_some() {
        return Ok(());
    }
    if let Some(body) = req.body_mut().take() {
        let bytes = body.collect().await?.to_bytes();
        *req.body_mut() = Some(bytes.into());
    }
    Ok(())
}

/// Reads the answer's body (so that a body cut off counts as a lost response) and
/// gives back an equivalent response holding it.
async fn buffer_response(mut response: Response) -> reqwest::Result<(Response, Bytes)> {
    let url = response.url().clone();
    let status = response.status();
    let version = response.version();
    let headers = response.headers().clone();
    let extensions = std::mem::take(response.extensions_mut());
    let body = response.bytes().await?;
    let mut rebuilt = http::Response::builder()
        .status(status)
        .version(version)
        .url(url)
        .body(body.clone())
        .expect("parts of a valid response make a valid response");
    *rebuilt.headers_mut() = headers;
    rebuilt.extensions_mut().extend(extensions);
    Ok((Response::from(rebuilt), body))
}

/// Errors after which the request may or may not have reached the server, and the
/// answer never arrived: a retry with the same key is how to find out. Not:
/// building the request, redirects, upgrades.
fn is_lost(e: &reqwest::Error) -> bool {
    e.is_timeout() || e.is_connect() || e.is_request() || e.is_body() || e.is_decode()
}
