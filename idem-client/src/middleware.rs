//! The middleware: one key per logical request, retries by the contract.

use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::Extensions;
use http_body_util::BodyExt;
use reqwest::header::{CONTENT_LENGTH, HeaderMap, HeaderValue};
use reqwest::{Method, Request, Response, ResponseBuilderExt, StatusCode, Url};
use reqwest_middleware::{Error, Middleware, Next};
use tokio::time::Instant;

use crate::decide::{Verdict, is_problem, judge, next_wait, problem_type, reads_body, retry_after};
use crate::follow::{Poll, judge_poll, judge_result, operation_of, poll_headers};
use crate::{
    BodyTooLarge, GaveUp, IDEMPOTENCY_KEY, IdemOutcome, IdempotencyKey, Interrupted, InvalidKey,
    LastAnswer, Limit, PollRefused,
};

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
/// * reads the final answer's body before handing it over, so a response cut off
///   mid-body is a lost response too, and returns it with its body in memory, up
///   to [`max_response_body`](IdempotencyMiddleware::max_response_body) (4 MiB;
///   a longer one is the error [`BodyTooLarge`]); or, for a request with the
///   [`StreamFinal`] extension, returns it with its body unread. The body of a
///   `202` or `409` problem document is read in any case: it decides the
///   retry. It is read up to 64 KiB whatever the limit, for five seconds at
///   most, and one cut off or stalled is a lost answer, sent again after its
///   head's `Retry-After`;
/// * never retries a body it cannot decode (a compressed body that does not
///   inflate): the same answer would come again;
/// * retries, after a full-jitter backoff and never before the answer's
///   `Retry-After`: connection errors and timeouts (the lost response), `5xx`
///   but `501`/`505`, `409` with `Retry-After` or the in-flight problem, and
///   `202` with the outcome-uncertain problem. It never retries a `422` (the key
///   was used for another request: a bug to fix, not to repeat) nor any other
///   `4xx` or final answer;
/// * with [`follow_accepted`](IdempotencyMiddleware::follow_accepted), follows
///   a long operation's `202 Accepted` to its final answer;
/// * stops after [`max_attempts`](IdempotencyMiddleware::max_attempts) sends or at
///   the [`deadline`](IdempotencyMiddleware::deadline), with [`GaveUp`];
/// * stores an [`IdemOutcome`] (key, attempts, replayed, polls) in the final
///   response's extensions.
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
///             .deadline(Duration::from_secs(90)),
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
    max_response_body: usize,
    follow_accepted: bool,
}

/// The default deadline, over all the attempts of a logical request: long enough
/// to wait out a server's `Retry-After` of a lease three times and still ask
/// again. idem answers a retry of an uncertain outcome with `202` and a
/// `Retry-After` of the operation's lease, and a duplicate in flight in leased
/// mode with what is left of it: 30 s in the `orders` example.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);

/// The default limit on a body the middleware holds in memory: four times what
/// an idem server stores of an answer by default (1 MiB).
pub(crate) const DEFAULT_MAX_RESPONSE_BODY: usize = 4 * 1024 * 1024;

/// A request extension that asks for the final answer with its body unread:
/// the middleware reads a body only where its retry decision needs it (the
/// problem document of a `202` or of a `409` without `Retry-After`), and hands a
/// final answer over as soon as its head has arrived, whatever its length. The
/// limit on buffered bodies does not apply to it.
///
/// The caller then reads the body, and a body cut off mid-way is the caller's
/// to retry (with the same key, from [`IdemOutcome`]): the middleware retries
/// only a body it reads itself. reqwest applies a request's timeout (or the
/// middleware's [`attempt_timeout`](IdempotencyMiddleware::attempt_timeout)) to
/// reading its body too, and the middleware's deadline ends with the head.
///
/// ```no_run
/// use idem_client::{IdempotencyMiddleware, StreamFinal};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new())
///     .build();
/// let mut export = client
///     .post("http://127.0.0.1:3000/exports")
///     .with_extension(StreamFinal)
///     .send()
///     .await?;
/// while let Some(chunk) = export.chunk().await? {
///     // write the chunk somewhere
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamFinal;

impl Default for IdempotencyMiddleware {
    /// [`IdempotencyMiddleware::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyMiddleware {
    /// `POST` and `PATCH`; at most 10 attempts within 120 s; full-jitter backoff
    /// from 100 ms, doubling, capped at 5 s; no attempt timeout beyond the
    /// client's own; bodies held in memory up to 4 MiB; a `202 Accepted`
    /// returned, not followed.
    ///
    /// The deadline outlasts a server's `Retry-After` of 30 s three times over:
    /// idem answers a retry of an uncertain outcome with `202` and a
    /// `Retry-After` as long as the operation's lease (30 s in the `orders`
    /// example), and a deadline no longer than that would give up at the first
    /// such answer instead of waiting for the reconciled one.
    ///
    /// ```
    /// let middleware = idem_client::IdempotencyMiddleware::new();
    /// ```
    pub fn new() -> Self {
        IdempotencyMiddleware {
            methods: vec![Method::POST, Method::PATCH],
            max_attempts: 10,
            deadline: DEFAULT_DEADLINE,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            attempt_timeout: None,
            max_response_body: DEFAULT_MAX_RESPONSE_BODY,
            follow_accepted: false,
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

    /// The total time for a logical request, from its first send: no wait is
    /// begun that would end past it, no attempt starts after it, and an
    /// attempt still waiting for its answer then is cut off (an attempt that
    /// starts just before it may be cut off so, and may have run: the error
    /// carries its key). Default 120 s. Keep it well beyond the longest
    /// `Retry-After` the server gives (idem's: the lease of a leased
    /// operation), or the client gives up at the first such answer.
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
    /// `[0, min(max, base * 2^(n-1))]` (full jitter), after the answer's
    /// `Retry-After` if it has one (so that clients told the same `Retry-After`
    /// do not all come back at the same instant).
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

    /// The longest final answer, in bytes, the middleware holds in memory to
    /// hand it over whole. A longer one is the error [`BodyTooLarge`], at once
    /// and never retried; the body is not read past the limit (nor at all
    /// when its `Content-Length` is over it). A final answer asked for with
    /// [`StreamFinal`] is not held, so not limited.
    ///
    /// What the middleware reads only to decide what comes next is read up
    /// to 64 KiB whatever this says (or up to this limit, if higher): the
    /// problem document of a `202` or of a `409` without `Retry-After`, a
    /// long operation's documents (with
    /// [`follow_accepted`](IdempotencyMiddleware::follow_accepted)), and, for
    /// its problem type, the body of an answer retried anyway (a `503`, say),
    /// otherwise dropped. So a limit below the size of idem's problem
    /// documents (some 300 bytes) still waits out an uncertain `202`. Such a
    /// document that turns out to be the final answer (a business `409`, say)
    /// is then the caller's, and held to this limit; one longer than 64 KiB
    /// cannot be judged, and is [`BodyTooLarge`] too.
    ///
    /// ```
    /// let middleware = idem_client::IdempotencyMiddleware::new().max_response_body(256 * 1024);
    /// ```
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// Follows a long operation to its final answer (off by default): a `202
    /// Accepted` with a `Location` of the request's own origin is not handed
    /// over; the middleware
    ///
    /// * `GET`s the resource at `Location` (resolved against the request's URL)
    ///   with the request's headers but those about its body, its conditions
    ///   (`If-*`) and `Idempotency-Key`, so the caller's `Authorization`,
    ///   cookies and tenant headers go along, and the client's default headers
    ///   are added as on any request;
    /// * waits before each `GET` as before each retry: full jitter, never
    ///   shorter than the answer's `Retry-After` (idem's: a third of the
    ///   operation's lease);
    /// * on `running` or `uncertain` asks again; on `stalled` (the worker
    ///   died) sends the original request again, with the same key and bytes,
    ///   which takes the work over, and follows its `202` again; once done
    ///   (`succeeded`, `failed`), `GET`s its `result` and returns that: the
    ///   stored answer, as the request would have got it had it waited
    ///   (`Idempotent-Replayed: true`), under [`StreamFinal`] too;
    /// * treats a resource that is gone (`404` `operation-not-found`: the work
    ///   failed and freed its key) like a `5xx`: it sends the request again;
    ///   and ends with [`Interrupted`] (its `error` a [`PollRefused`], with the
    ///   key and the resource) at any other answer of the resource's that is
    ///   not about the operation (a `401` once a token expired, say): the
    ///   request was accepted and may have run, so that is no answer to it.
    ///
    /// The [`deadline`](IdempotencyMiddleware::deadline) covers the whole
    /// operation: set it to the longest the work may take, or get [`GaveUp`]
    /// with the resource in [`operation`](GaveUp::operation) and the last state
    /// in [`LastAnswer::Operation`]. `max_attempts` counts the sends of the
    /// request only, not the `GET`s, which only the deadline bounds.
    /// [`IdemOutcome::polls`] and [`IdemOutcome::operation`] say what was
    /// followed. A `Location` of another origin is not followed: the `202` is
    /// returned, and the request's credentials go nowhere else.
    ///
    /// Off by default because a `202` is an answer to a caller that tracks the
    /// operation itself (shows its progress, hands its address on), and
    /// following turns one `send` into minutes of polling.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_client::{IdempotencyMiddleware, ResponseExt};
    ///
    /// # async fn run() -> Result<(), reqwest_middleware::Error> {
    /// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
    ///     .with(
    ///         IdempotencyMiddleware::new()
    ///             .follow_accepted(true)
    ///             .deadline(Duration::from_secs(15 * 60)), // the longest export
    ///     )
    ///     .build();
    /// let export = client
    ///     .post("http://127.0.0.1:3000/exports")
    ///     .bearer_auth("acme")
    ///     .json(&serde_json::json!({"format": "csv"}))
    ///     .send()
    ///     .await?; // 201, once the export is done
    /// println!("{} after {} polls", export.status(), export.idem().unwrap().polls);
    /// # Ok(()) }
    /// ```
    pub fn follow_accepted(mut self, follow: bool) -> Self {
        self.follow_accepted = follow;
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
        let mut value =
            HeaderValue::from_str(key.as_str()).expect("a valid key is a valid header value");
        // A key is as good as a capability: a `Request`'s `Debug` (a logging
        // middleware after this one) prints it as sensitive, as reqwest's
        // `bearer_auth` does, and HTTP/2 never indexes it.
        value.set_sensitive(true);
        req.headers_mut().insert(IDEMPOTENCY_KEY, value);
        buffer_body(&mut req).await?;
        if req.timeout().is_none() {
            *req.timeout_mut() = self.attempt_timeout;
        }

        let mut run = Run {
            key,
            started: Instant::now(),
            attempts: 0,
            polls: 0,
            operation: None,
        };
        // `None`: a deadline the clock cannot hold (`Duration::MAX`), which is none.
        let deadline = run.started.checked_add(self.deadline);
        let remaining = || {
            deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            })
        };
        let stream_final = extensions.get::<StreamFinal>().is_some();
        let mut step = Step::Send;
        loop {
            let (outgoing, reading) = match &step {
                Step::Send => {
                    run.attempts += 1;
                    let attempt = req
                        .try_clone()
                        .expect("a request with a buffered body clones");
                    (
                        attempt,
                        Reading::Answer {
                            stream: stream_final,
                            follow: self.follow_accepted.then_some(req.url()),
                        },
                    )
                }
                Step::Poll(url) => {
                    run.polls += 1;
                    (poll_request(url, &req), Reading::Document)
                }
                Step::Result(url) => {
                    run.polls += 1;
                    (
                        poll_request(url, &req),
                        Reading::Result {
                            stream: stream_final,
                        },
                    )
                }
            };
            let answer = tokio::time::timeout(remaining(), async {
                let response = match next.clone().run(outgoing, extensions).await {
                    Ok(response) => response,
                    Err(Error::Reqwest(e)) if is_lost(&e) => return Ok(Read::Lost(e)),
                    Err(e) => return Err(e),
                };
                read(response, self.max_response_body, reading)
                    .await
                    .map_err(Error::Reqwest)
            })
            .await;
            // A `GET` of a long operation is sent to the operation's URL, whose
            // path may reveal the key (see `GaveUp::operation`); its errors
            // end up in `GaveUp` and `Interrupted`, so in the caller's logs,
            // and go there without it. The request's own URL is the caller's.
            let answer = match step {
                Step::Send => answer,
                Step::Poll(_) | Step::Result(_) => answer.map(|read| {
                    read.map(Read::without_url)
                        .map_err(reqwest_middleware::Error::without_url)
                }),
            };
            // What comes next, whether it waits first, and the answer that led
            // there (for `GaveUp`).
            let (next_step, wait, last) = match answer {
                Err(_cut_off) => {
                    return Err(run.gave_up(Limit::Deadline(self.deadline), LastAnswer::CutOff));
                }
                // Not retried (a retry would meet it again, or it is not
                // the answer's), but the request was handed on: it may have
                // run, and the caller must keep its key.
                Ok(Err(e)) => return Err(run.interrupted(e)),
                // The same step again: a lost answer, or one that asks for a retry.
                Ok(Ok(Read::Lost(e))) => (step, Wait::After(None), LastAnswer::Transport(e)),
                Ok(Ok(Read::TooLarge {
                    status,
                    content_length,
                })) => {
                    return Err(run.too_large(self.max_response_body, status, content_length));
                }
                Ok(Ok(Read::Retry {
                    status,
                    problem_type,
                    retry_after,
                })) => (
                    step,
                    Wait::After(retry_after),
                    LastAnswer::Status {
                        status,
                        problem_type,
                        retry_after,
                    },
                ),
                Ok(Ok(Read::Final(response, body))) => {
                    match self.after_final(
                        &step,
                        &response,
                        body.as_deref().unwrap_or_default(),
                        req.url(),
                    ) {
                        Some((next_step, wait, last)) => {
                            if let Step::Poll(resource) = &next_step {
                                run.operation = Some(resource.clone());
                            }
                            (next_step, wait, last)
                        }
                        // A document read to be judged, up to the floor, is
                        // held to the limit once it is the caller's.
                        None if body
                            .as_ref()
                            .is_some_and(|body| body.len() > self.max_response_body) =>
                        {
                            let content_length = declared_length(response.headers());
                            return Err(run.too_large(
                                self.max_response_body,
                                response.status(),
                                content_length,
                            ));
                        }
                        // A poll's answer that is not about the operation is
                        // no answer to the accepted request: handed over as
                        // one, a `401` would read as the request refused, and
                        // be sent again under a new key.
                        None if matches!(step, Step::Poll(_)) => {
                            let refused = PollRefused {
                                status: response.status(),
                            };
                            return Err(run.interrupted(Error::middleware(refused)));
                        }
                        None => return Ok(run.finish(response)),
                    }
                }
            };
            if matches!(next_step, Step::Send) && run.attempts >= self.max_attempts {
                return Err(run.gave_up(Limit::Attempts(self.max_attempts), last));
            }
            if let Wait::After(retry_after) = wait {
                // The nth wait of the logical request, sends and polls together.
                let wait = next_wait(
                    self.base_delay,
                    self.max_delay,
                    run.attempts + run.polls,
                    retry_after,
                );
                // Compared as durations: a server's `Retry-After` may be far past
                // what an `Instant` can hold.
                if wait >= remaining() {
                    return Err(run.gave_up(Limit::Deadline(self.deadline), last));
                }
                tokio::time::sleep(wait).await;
            }
            step = next_step;
        }
    }
}

impl IdempotencyMiddleware {
    /// What follows a final answer to `step`: `None` to hand it over, or the
    /// next step of a long operation being followed.
    fn after_final(
        &self,
        step: &Step,
        response: &Response,
        body: &[u8],
        requested: &Url,
    ) -> Option<(Step, Wait, LastAnswer)> {
        let (status, headers) = (response.status(), response.headers());
        let now = SystemTime::now();
        match step {
            Step::Send => {
                if !self.follow_accepted {
                    return None;
                }
                let resource = operation_of(status, headers, response.url(), requested)?;
                let retry_after = retry_after(headers, now);
                let last = LastAnswer::Status {
                    status,
                    problem_type: None,
                    retry_after,
                };
                Some((Step::Poll(resource), Wait::After(retry_after), last))
            }
            Step::Poll(resource) => match judge_poll(status, headers, body, resource, now) {
                Poll::Again { state, retry_after } => Some((
                    Step::Poll(resource.clone()),
                    Wait::After(retry_after),
                    LastAnswer::Operation { state, retry_after },
                )),
                // Done: its answer is there now.
                Poll::Result(result) => Some((
                    Step::Result(result),
                    Wait::No,
                    LastAnswer::Status {
                        status,
                        problem_type: None,
                        retry_after: None,
                    },
                )),
                Poll::Resend { state, retry_after } => {
                    let last = match state {
                        Some(state) => LastAnswer::Operation { state, retry_after },
                        None => LastAnswer::Status {
                            status,
                            problem_type: problem_type(headers, body),
                            retry_after,
                        },
                    };
                    Some((Step::Send, Wait::After(retry_after), last))
                }
                Poll::Final => None,
            },
            Step::Result(_) => match judge_result(status, headers, body) {
                Poll::Final => None,
                _ => Some((
                    Step::Send,
                    Wait::After(None),
                    LastAnswer::Status {
                        status,
                        problem_type: problem_type(headers, body),
                        retry_after: None,
                    },
                )),
            },
        }
    }
}

/// One logical request so far.
struct Run {
    key: IdempotencyKey,
    started: Instant,
    attempts: u32,
    polls: u32,
    operation: Option<Url>,
}

impl Run {
    fn gave_up(self, limit: Limit, last: LastAnswer) -> Error {
        Error::middleware(GaveUp {
            key: self.key,
            attempts: self.attempts,
            polls: self.polls,
            operation: self.operation,
            elapsed: self.started.elapsed(),
            limit,
            last,
        })
    }

    fn too_large(self, limit: usize, status: StatusCode, content_length: Option<u64>) -> Error {
        Error::middleware(BodyTooLarge {
            limit,
            status,
            content_length,
            key: self.key,
            attempts: self.attempts,
        })
    }

    fn interrupted(self, error: Error) -> Error {
        Error::middleware(Interrupted {
            key: self.key,
            attempts: self.attempts,
            polls: self.polls,
            operation: self.operation,
            elapsed: self.started.elapsed(),
            error,
        })
    }

    fn finish(self, mut response: Response) -> Response {
        let replayed = response
            .headers()
            .get(idem_wire::IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        response.extensions_mut().insert(IdemOutcome {
            key: self.key,
            attempts: self.attempts,
            replayed,
            polls: self.polls,
            operation: self.operation,
        });
        response
    }
}

/// What the middleware sends next.
enum Step {
    /// The request itself: same key, same bytes.
    Send,
    /// `GET` a long operation's resource.
    Poll(Url),
    /// `GET` a long operation's stored answer.
    Result(Url),
}

/// Whether the next step waits.
enum Wait {
    /// This `Retry-After`, if any, then the backoff.
    After(Option<Duration>),
    /// At once: the answer said where to go now (a done operation's result).
    No,
}

/// A `GET` of a long operation's `url`, carrying what the caller's request
/// carried for it: its headers but those about its body and its key, its
/// timeout, its HTTP version.
fn poll_request(url: &Url, original: &Request) -> Request {
    let mut get = Request::new(Method::GET, url.clone());
    *get.headers_mut() = poll_headers(original.headers());
    *get.timeout_mut() = original.timeout().copied();
    *get.version_mut() = original.version();
    get
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

/// One answer, judged, with as much of its body read as the judgement needs.
enum Read {
    /// Hand it to the caller: its body in memory (and here too, to judge), or
    /// unread (`StreamFinal`).
    Final(Response, Option<Bytes>),
    /// Send the request again, not before `retry_after`: the answer asks for
    /// it, or its body, read to judge it, was cut off or stalled.
    Retry {
        status: StatusCode,
        problem_type: Option<String>,
        retry_after: Option<Duration>,
    },
    /// The answer was lost: the connection failed or timed out, or the body of
    /// a final answer was cut off (or timed out) mid-way.
    Lost(reqwest::Error),
    /// A body the middleware had to hold is over the limit.
    TooLarge {
        status: StatusCode,
        content_length: Option<u64>,
    },
}

impl Read {
    /// The same, with the URL taken off a lost answer's error.
    fn without_url(self) -> Read {
        match self {
            Read::Lost(e) => Read::Lost(e.without_url()),
            other => other,
        }
    }
}

/// What a step asks for, and so how much of its answer's body is read.
#[derive(Debug, Clone, Copy)]
enum Reading<'a> {
    /// The request's own answer: held whole as a final answer, or handed over
    /// unread with `stream` (`StreamFinal`). With `follow` (the request's URL,
    /// under [`follow_accepted`](IdempotencyMiddleware::follow_accepted)) a
    /// `202` that names an operation the middleware follows is that
    /// operation's first document, to be followed rather than handed over, so
    /// it is read as a document; any other `202` is a final answer.
    Answer {
        stream: bool,
        follow: Option<&'a Url>,
    },
    /// A long operation's document: it decides the next step, whatever its
    /// status, so it is always read.
    Document,
    /// A long operation's stored result: a final answer as the request's own
    /// is, but that idem's `404` `operation-not-found` (the record is gone)
    /// sends the request again.
    Result { stream: bool },
}

impl Reading<'_> {
    /// Whether the answer is a document, read to decide what comes next
    /// rather than only to be handed over: read whatever `StreamFinal` says,
    /// up to [`JUDGED_BODY_FLOOR`] and for [`JUDGED_BODY_READ`] at most, and
    /// held to the limit only once it is judged final.
    fn judges(self, response: &Response) -> bool {
        let (status, headers) = (response.status(), response.headers());
        reads_body(status, headers)
            || match self {
                Reading::Answer { follow, .. } => follow.is_some_and(|requested| {
                    operation_of(status, headers, response.url(), requested).is_some()
                }),
                Reading::Document => true,
                Reading::Result { .. } => status == StatusCode::NOT_FOUND && is_problem(headers),
            }
    }

    /// Whether a final answer goes to the caller with its body unread.
    fn streams(self) -> bool {
        match self {
            Reading::Answer { stream, .. } | Reading::Result { stream } => stream,
            Reading::Document => false,
        }
    }
}

/// Judges an answer, reading its body only where needed: a document the
/// verdict depends on, a final answer the caller gets whole (so that a body
/// cut off mid-way counts as a lost response), and (for its problem type, up
/// to the limit) an answer that is retried anyway. An error it returns is one
/// that a retry would meet again (a body the client cannot decode).
async fn read(mut response: Response, limit: usize, reading: Reading<'_>) -> reqwest::Result<Read> {
    let status = response.status();
    let judged = reading.judges(&response);
    // What is read only to judge is read up to the floor; what is handed
    // over, to the limit (checked on a judged body once it is final).
    let judging_limit = limit.max(JUDGED_BODY_FLOOR);
    if !reads_body(status, response.headers()) {
        match judge(status, response.headers(), b"") {
            Verdict::Final if reading.streams() && !judged => {
                return Ok(Read::Final(response, None));
            }
            Verdict::Final => {}
            Verdict::Retry { retry_after } => {
                // Only for `LastAnswer`: what the body says is nice to have,
                // so it is read for a second at most, and a body that stalls
                // or is cut off still leaves the answer's wait, where it
                // would have taken the deadline, or the `Retry-After` with it.
                let problem_type = match tokio::time::timeout(
                    RETRIED_BODY_READ,
                    read_body(&mut response, judging_limit),
                )
                .await
                {
                    Ok(Ok(Some(body))) => problem_type(response.headers(), &body),
                    _ => None,
                };
                return Ok(Read::Retry {
                    status,
                    problem_type,
                    retry_after,
                });
            }
        }
    }
    let limit = if judged { judging_limit } else { limit };
    let content_length = response.content_length();
    if content_length.is_some_and(|n| n > limit as u64) {
        return Ok(Read::TooLarge {
            status,
            content_length,
        });
    }
    // A document is bounded in time, a final answer's body only by the
    // request's timeout and the deadline: see `JUDGED_BODY_READ`.
    let body = if judged {
        match tokio::time::timeout(JUDGED_BODY_READ, read_body(&mut response, limit)).await {
            Ok(body) => body,
            Err(_stalled) => return Ok(document_lost(status, response.headers())),
        }
    } else {
        read_body(&mut response, limit).await
    };
    let body = match body {
        Ok(Some(body)) => body,
        Ok(None) => {
            return Ok(Read::TooLarge {
                status,
                content_length,
            });
        }
        Err(e) if body_error_is_lost(&e) && judged => {
            return Ok(document_lost(status, response.headers()));
        }
        Err(e) if body_error_is_lost(&e) => return Ok(Read::Lost(e)),
        Err(e) => return Err(e),
    };
    if judged && let Verdict::Retry { retry_after } = judge(status, response.headers(), &body) {
        return Ok(Read::Retry {
            status,
            problem_type: problem_type(response.headers(), &body),
            retry_after,
        });
    }
    Ok(Read::Final(with_body(response, body.clone()), Some(body)))
}

/// A document (see [`Reading::judges`]) whose body was cut off or stalled:
/// lost, and asked for again (the request with the same key, or the `GET`),
/// but not before the `Retry-After` its head carried. The head arrived whole,
/// and says when the server may have a better answer (idem's uncertain `202`:
/// once its reconciliation may be done, the operation's lease; an operation's
/// document: when to look again): asked at once, it would say the same again.
fn document_lost(status: StatusCode, headers: &HeaderMap) -> Read {
    Read::Retry {
        status,
        problem_type: None,
        retry_after: retry_after(headers, SystemTime::now()),
    }
}

/// How long the body of a document (see [`Reading::judges`]) is read, once its
/// head has arrived, before the answer counts as lost. Such a body is small:
/// a problem document (`application/problem+json`, a few hundred bytes from
/// idem) or a long operation's document, which its server writes at once
/// with its head. Five seconds carry far more than that on a slow link,
/// while a body that stalls would otherwise hold the logical request until
/// its deadline (120 s by default, minutes when following an operation), to
/// end in `GaveUp` where a retry would have had its answer. Taking a slow
/// body for a lost one costs one more send with the same key (or one more
/// `GET`), which the server answers the same way.
///
/// A final answer's body is not bounded so: it may be of any length, and no
/// fixed time fits every length; the request's own timeout (or
/// [`attempt_timeout`](IdempotencyMiddleware::attempt_timeout)) and the
/// deadline bound it, as the caller chose.
const JUDGED_BODY_READ: Duration = Duration::from_secs(5);

/// How much of a body the middleware reads to judge it (a document, see
/// [`Reading::judges`]) or to name a retried answer's problem, whatever
/// [`max_response_body`](IdempotencyMiddleware::max_response_body) says.
/// That limit is the caller's on what they are handed, and set low (to a few
/// hundred bytes, for answers known to be small) it would be under idem's
/// uncertain `202` problem document (some 300 bytes): the middleware would
/// answer `BodyTooLarge` where the contract says to wait and ask again. The
/// documents it judges are small (problem documents, operation documents),
/// so 64 KiB holds any of them with room to spare, and still bounds the
/// memory a server that sends a long one can take. A document judged final
/// is then held to the limit like any final answer.
const JUDGED_BODY_FLOOR: usize = 64 * 1024;

/// How long the body of an answer already judged a retry is read, only to
/// name its problem in `LastAnswer`.
const RETRIED_BODY_READ: Duration = Duration::from_secs(1);

/// The most of a declared length [`read_body`] reserves before the bytes come.
const RESERVED_UP_FRONT: usize = 1024 * 1024;

/// The body, or `None` once it is longer than `limit` (it is not read further).
async fn read_body(response: &mut Response, limit: usize) -> reqwest::Result<Option<Bytes>> {
    // The declared length sizes the buffer only up to a bound: it is the
    // server's word, and a limit lifted to `usize::MAX` must not turn a huge
    // one into an allocation made before a byte has arrived.
    let expected = response.content_length().unwrap_or(0);
    let reserved = usize::try_from(expected)
        .unwrap_or(usize::MAX)
        .min(limit)
        .min(RESERVED_UP_FRONT);
    let mut body = BytesMut::with_capacity(reserved);
    while let Some(chunk) = response.chunk().await? {
        if chunk.len() > limit - body.len() {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body.freeze()))
}

/// The `Content-Length` an answer declared (a decoded body has none).
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// An equivalent response holding `body`.
fn with_body(mut response: Response, body: Bytes) -> Response {
    let url = response.url().clone();
    let status = response.status();
    let version = response.version();
    let headers = std::mem::take(response.headers_mut());
    let extensions = std::mem::take(response.extensions_mut());
    let mut rebuilt = http::Response::builder()
        .status(status)
        .version(version)
        .url(url)
        .body(body)
        .expect("parts of a valid response make a valid response");
    *rebuilt.headers_mut() = headers;
    rebuilt.extensions_mut().extend(extensions);
    Response::from(rebuilt)
}

/// Errors of a send after which the request may or may not have reached the
/// server, and the answer never arrived: a retry with the same key is how to
/// find out. Not: building the request, redirects, upgrades, nor a decode
/// error, which (before any body is read) is a redirect the client cannot
/// follow, the same on every attempt.
fn is_lost(e: &reqwest::Error) -> bool {
    e.is_timeout() || e.is_connect() || e.is_request() || e.is_body()
}

/// Whether an error reading a body is the answer lost on its way (the
/// connection closed or failed mid-body, a timeout), to retry; or a body that
/// arrived and cannot be decoded (a compressed body that does not inflate),
/// which every retry would get again: reqwest reports both as decode errors,
/// and tells them apart by their cause. A decoder's failure is an
/// `std::io::Error` of its own; the connection's failures come from hyper
/// (whose errors carry any I/O error as their cause, never as the error) and
/// timeouts from reqwest.
fn body_error_is_lost(e: &reqwest::Error) -> bool {
    if e.is_timeout() {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.is::<reqwest::Error>() {
            cause = c.source();
            continue;
        }
        return !c.is::<std::io::Error>();
    }
    // No cause at all: nothing says the body was undecodable.
    true
}
