//! What the caller learns about a logical request: the answer's provenance, or
//! why the client gave up.

use std::fmt;
use std::time::Duration;

use reqwest::{StatusCode, Url};

use crate::IdempotencyKey;

/// How a logical request went, stored in the extensions of the response the
/// middleware returns. Read it with [`ResponseExt::idem`].
///
/// ```no_run
/// use idem_client::{IdempotencyMiddleware, ResponseExt};
///
/// # async fn run() -> Result<(), reqwest_middleware::Error> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new())
///     .build();
/// let response = client.post("http://127.0.0.1:3000/orders").send().await?;
/// let idem = response.idem().expect("a POST goes through the middleware");
/// println!("attempts {}, replayed {}", idem.attempts, idem.replayed);
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdemOutcome {
    /// The key sent with every attempt (for the caller's logs: the crate never
    /// logs it).
    pub key: IdempotencyKey,
    /// How many times the request was sent, at least 1.
    pub attempts: u32,
    /// The server answered `Idempotent-Replayed: true`: this is the stored answer
    /// of an earlier attempt (or of another caller with the same key), and
    /// nothing ran again. A followed long operation's answer is its stored
    /// result, so replayed.
    pub replayed: bool,
    /// How many `GET`s of a long operation's resource and of its result the
    /// client sent, following a `202 Accepted`
    /// ([`follow_accepted`](crate::IdempotencyMiddleware::follow_accepted));
    /// 0 when it followed none.
    pub polls: u32,
    /// The long operation's resource the client followed (the `202`'s
    /// `Location`, resolved), if it followed one. The response's own `url()`
    /// is then where its answer came from: the operation's result, or the
    /// request's URL when a resend answered. `Debug` shows its origin only
    /// (see [`GaveUp::operation`]).
    pub operation: Option<Url>,
}

/// The key redacted (as its own `Debug` does), and the operation's path.
impl fmt::Debug for IdemOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let IdemOutcome {
            key,
            attempts,
            replayed,
            polls,
            operation,
        } = self;
        f.debug_struct("IdemOutcome")
            .field("key", key)
            .field("attempts", attempts)
            .field("replayed", replayed)
            .field("polls", polls)
            .field("operation", &operation.as_ref().map(Redacted))
            .finish()
    }
}

/// A long operation's URL as this crate's `Debug` shows it: its origin, and
/// not its path. The path names the operation's record, and idem's server
/// puts there the SHA-256 digest of the idempotency key
/// (`/operations/create-export/<digest>`): a key derived from a business id
/// ("pay-invoice-42") is guessed back from its digest in a few tries, and the
/// crate logs nothing that reveals a key. Another server may put the key
/// anywhere in the path or the query, so none of them is shown.
struct Redacted<'a>(&'a Url);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "\"{}/<redacted>\"",
            self.0.origin().ascii_serialization()
        )
    }
}

/// Reads the [`IdemOutcome`] off a response.
///
/// ```
/// use idem_client::ResponseExt;
///
/// // A response that did not go through the middleware has none.
/// let plain = reqwest::Response::from(http::Response::new(""));
/// assert!(plain.idem().is_none());
/// ```
pub trait ResponseExt {
    /// The outcome, when the middleware handled the request.
    fn idem(&self) -> Option<&IdemOutcome>;
}

impl ResponseExt for reqwest::Response {
    fn idem(&self) -> Option<&IdemOutcome> {
        self.extensions().get::<IdemOutcome>()
    }
}

/// The error the middleware returns when every answer it got asked for a retry
/// and it may not try again: the attempts or the deadline are used up.
///
/// The logical request may or may not have run (a lost response looks like an
/// outage): retry it later with the same [`key`](GaveUp::key), never a new one.
/// It arrives as `reqwest_middleware::Error::Middleware`; [`ErrorExt::gave_up`]
/// finds it. Neither its `Display` nor its `Debug` shows the key, nor the path
/// of the [`operation`](GaveUp::operation) (which may reveal it).
///
/// ```no_run
/// use idem_client::{ErrorExt, IdempotencyMiddleware};
///
/// # async fn run() {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new())
///     .build();
/// match client.post("http://127.0.0.1:3000/payments").send().await {
///     Ok(answer) => println!("{}", answer.status()),
///     Err(e) => match e.gave_up() {
///         // keep gave_up.key: the payment may have happened
///         Some(gave_up) => eprintln!("{gave_up}"),
///         None => eprintln!("{e}"),
///     },
/// }
/// # }
/// ```
#[non_exhaustive]
pub struct GaveUp {
    /// The key every attempt carried: retry with it.
    pub key: IdempotencyKey,
    /// How many times the request was sent.
    pub attempts: u32,
    /// How many `GET`s of a long operation's resource (and its result) were sent.
    pub polls: u32,
    /// The long operation's resource the client was following, if any: ask it
    /// later how the work goes, or send the request again with the same key.
    ///
    /// Log it with care: with idem's server its path holds the SHA-256 digest
    /// of the key, from which a guessable key (a business id) is recovered.
    /// This crate's `Debug` shows its origin only.
    pub operation: Option<Url>,
    /// From the first send to giving up.
    pub elapsed: Duration,
    /// Which bound ended the retries.
    pub limit: Limit,
    /// What the last attempt got.
    pub last: LastAnswer,
}

/// The key redacted (as its own `Debug` does), and the operation's path.
impl fmt::Debug for GaveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let GaveUp {
            key,
            attempts,
            polls,
            operation,
            elapsed,
            limit,
            last,
        } = self;
        f.debug_struct("GaveUp")
            .field("key", key)
            .field("attempts", attempts)
            .field("polls", polls)
            .field("operation", &operation.as_ref().map(Redacted))
            .field("elapsed", elapsed)
            .field("limit", limit)
            .field("last", last)
            .finish()
    }
}

/// What ends following a long operation whose resource answered other than
/// about the operation (a `401` once the caller's token expired, a login
/// page, another `404`): the request was accepted, and its work may be
/// running or done, so that answer is no answer to the request. It comes as
/// [`Interrupted::error`], with the key and the operation's resource: ask the
/// resource again, or send the request again with the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PollRefused {
    /// The status the resource answered.
    pub status: StatusCode,
}

impl fmt::Display for PollRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the long operation's resource answered {}, not about the operation: the request \
             was accepted and may have run; ask again, or send it again with the same key",
            self.status
        )
    }
}

impl std::error::Error for PollRefused {}

/// The error the middleware returns when an attempt ends in an error it does
/// not retry, after the request was handed on to be sent: an error of a
/// middleware or layer after it (a token refresher, a rate limiter), a redirect
/// that failed, a body that arrived but cannot be decoded, a request the HTTP
/// client refused to build. The request may have run (a decode error means it
/// did: its answer arrived), so the key goes with the error: retry later with
/// the same [`key`](Interrupted::key), never a new one. The error itself is
/// [`error`](Interrupted::error), and the `source`.
///
/// It arrives as `reqwest_middleware::Error::Middleware`;
/// [`ErrorExt::interrupted`] finds it. Neither its `Display` nor its `Debug`
/// shows the key, nor the path of the [`operation`](Interrupted::operation).
///
/// ```no_run
/// use idem_client::{ErrorExt, IdempotencyMiddleware};
///
/// # async fn run() {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new())
///     .build();
/// if let Err(e) = client.post("http://127.0.0.1:3000/payments").send().await {
///     // Either way the payment may have happened: keep the key.
///     let key = e.gave_up().map(|g| &g.key).or(e.interrupted().map(|i| &i.key));
///     eprintln!("{e}; retry with the key kept: {}", key.is_some());
/// }
/// # }
/// ```
#[non_exhaustive]
pub struct Interrupted {
    /// The key every attempt carried: retry with it.
    pub key: IdempotencyKey,
    /// How many times the request was handed on to be sent, this one included.
    pub attempts: u32,
    /// How many `GET`s of a long operation's resource (and its result) were sent.
    pub polls: u32,
    /// The long operation's resource the client was following, if any. Log
    /// it with care, as [`GaveUp::operation`].
    pub operation: Option<Url>,
    /// From the first send to the error.
    pub elapsed: Duration,
    /// The error that ended the attempt. That of a `GET` of a long operation
    /// comes without its URL, the operation's (see [`GaveUp::operation`]).
    pub error: reqwest_middleware::Error,
}

/// The key redacted (as its own `Debug` does), and the operation's path.
impl fmt::Debug for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Interrupted {
            key,
            attempts,
            polls,
            operation,
            elapsed,
            error,
        } = self;
        f.debug_struct("Interrupted")
            .field("key", key)
            .field("attempts", attempts)
            .field("polls", polls)
            .field("operation", &operation.as_ref().map(Redacted))
            .field("elapsed", elapsed)
            .field("error", error)
            .finish()
    }
}

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "attempt {} of the request ended in an error that is not retried: {}; \
             the request may have run: retry it with the same Idempotency-Key",
            self.attempts, self.error
        )
    }
}

/// Its source is the error that ended the attempt.
impl std::error::Error for Interrupted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The bound that ended the retries of a [`GaveUp`].
///
/// ```
/// use std::time::Duration;
/// use idem_client::Limit;
///
/// assert_eq!(Limit::Attempts(3).to_string(), "3 attempts");
/// assert_eq!(Limit::Deadline(Duration::from_secs(30)).to_string(), "the 30s deadline");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Limit {
    /// The configured maximum of attempts was reached.
    Attempts(u32),
    /// The next attempt (or its `Retry-After`) would end past the deadline, or
    /// the deadline passed while an attempt was still waiting for its answer.
    Deadline(Duration),
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::Attempts(n) => write!(f, "{n} attempts"),
            Limit::Deadline(d) => write!(f, "the {d:?} deadline"),
        }
    }
}

/// What the last attempt of a [`GaveUp`] got.
///
/// ```
/// use idem_client::LastAnswer;
///
/// let last = LastAnswer::CutOff;
/// assert_eq!(last.to_string(), "no answer before the deadline");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum LastAnswer {
    /// An answer that asks for a retry: a 5xx, the contract's `409` (request in
    /// flight) or `202` (outcome uncertain); or a long operation's `202
    /// Accepted`, being followed; or an answer whose body the middleware
    /// reads to judge it (a `202` or `409` problem document, an operation's
    /// document) that was cut off or stalled mid-way, then without its
    /// `problem_type`.
    Status {
        /// Its status.
        status: StatusCode,
        /// Its problem type (`application/problem+json` `type`), if any.
        problem_type: Option<String>,
        /// Its `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// No answer: the connection failed, or timed out, or a final answer's
    /// body was cut off mid-way (the lost response). The error of a `GET` of
    /// a long operation comes without its URL, the operation's (see
    /// [`GaveUp::operation`]).
    Transport(reqwest::Error),
    /// A long operation's resource said the work is not done: `running`,
    /// `uncertain` or `stalled` (a resend with the key resumes it).
    Operation {
        /// The document's `status`.
        state: String,
        /// Its `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// The deadline passed while the attempt was waiting for its answer.
    CutOff,
}

impl fmt::Display for LastAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LastAnswer::Status {
                status,
                problem_type,
                ..
            } => {
                write!(f, "{status}")?;
                if let Some(t) = problem_type {
                    write!(f, " ({t})")?;
                }
                Ok(())
            }
            LastAnswer::Transport(e) => write!(f, "no answer: {e}"),
            LastAnswer::Operation { state, .. } => {
                write!(f, "the long operation is {state}")
            }
            LastAnswer::CutOff => f.write_str("no answer before the deadline"),
        }
    }
}

impl fmt::Display for GaveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no final answer within {} ({} attempt{}",
            self.limit,
            self.attempts,
            if self.attempts == 1 { "" } else { "s" },
        )?;
        if self.polls > 0 {
            write!(
                f,
                " and {} poll{} of a long operation",
                self.polls,
                if self.polls == 1 { "" } else { "s" }
            )?;
        }
        write!(
            f,
            " in {:.1?}); the last: {}; \
             the request may have run: retry it with the same Idempotency-Key",
            self.elapsed, self.last
        )
    }
}

/// Its source is the last transport error, if the last attempt had no answer.
impl std::error::Error for GaveUp {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.last {
            LastAnswer::Transport(e) => Some(e),
            _ => None,
        }
    }
}

/// The error the middleware returns when an answer it would hold in memory has a
/// body longer than [`max_response_body`](crate::IdempotencyMiddleware::max_response_body)
/// allows: it stops reading there, never retries (the same answer would come
/// again), and names the limit, never the body.
///
/// The middleware holds a body in memory to hand over a final answer whole (so
/// that a body cut off mid-way is retried like a lost response), and that body
/// is held to the limit. A document it reads only to judge it (a `202` or `409`
/// problem document, a long operation's document) is read up to 64 KiB
/// whatever the limit, and is this error only when it is longer than that (or
/// than the limit, if higher), or when, judged final, it would be handed over.
/// A final answer asked for with the [`StreamFinal`](crate::StreamFinal)
/// extension is handed over unread instead, whatever its length.
///
/// When [`status`](BodyTooLarge::status) is a final answer (a `2xx`, say), the
/// request has run: send it again with the same [`key`](BodyTooLarge::key) and
/// `StreamFinal` (or a larger limit) to read its answer, which an idempotent
/// server replays. It arrives as `reqwest_middleware::Error::Middleware`;
/// [`ErrorExt::body_too_large`] finds it. Its `Display` never shows the key.
///
/// ```no_run
/// use idem_client::{ErrorExt, IdempotencyMiddleware, StreamFinal};
///
/// # async fn run() -> Result<(), reqwest_middleware::Error> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new().max_response_body(64 * 1024))
///     .build();
/// let url = "http://127.0.0.1:3000/reports";
/// let report = match client.post(url).send().await {
///     Err(e) if e.body_too_large().is_some() => {
///         let key = e.body_too_large().unwrap().key.clone();
///         // The same request, its answer read as a stream.
///         client.post(url).with_extension(key).with_extension(StreamFinal).send().await?
///     }
///     other => other?,
/// };
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct BodyTooLarge {
    /// The limit, in bytes.
    pub limit: usize,
    /// The answer's status.
    pub status: StatusCode,
    /// Its `Content-Length`, when it declared one. Nothing of the body was then
    /// read, unless it is a document the middleware read to judge it, and
    /// judged final.
    pub content_length: Option<u64>,
    /// The key the request carried.
    pub key: IdempotencyKey,
    /// How many times the request was sent, this one included.
    pub attempts: u32,
}

impl fmt::Display for BodyTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} answer's body is longer than the limit of {} bytes on a buffered body",
            self.status, self.limit
        )?;
        if let Some(n) = self.content_length {
            write!(f, " (Content-Length: {n})")?;
        }
        f.write_str(
            "; it was not handed over: raise IdempotencyMiddleware::max_response_body, or send the \
             request again with the same Idempotency-Key and StreamFinal to read the answer \
             unbuffered",
        )
    }
}

impl std::error::Error for BodyTooLarge {}

/// Finds idem-client's own errors inside a `reqwest_middleware::Error`.
///
/// ```
/// use idem_client::{ErrorExt, InvalidKey};
///
/// let e = reqwest_middleware::Error::middleware(InvalidKey::Empty);
/// assert!(e.gave_up().is_none());
/// assert!(e.body_too_large().is_none());
/// assert!(e.interrupted().is_none());
/// assert_eq!(e.invalid_key(), Some(&InvalidKey::Empty));
/// ```
pub trait ErrorExt {
    /// The [`GaveUp`], when the retries ran out.
    fn gave_up(&self) -> Option<&GaveUp>;
    /// The [`InvalidKey`](crate::InvalidKey), when an `Idempotency-Key` header the caller set is not
    /// a valid key (nothing was sent).
    fn invalid_key(&self) -> Option<&crate::InvalidKey>;
    /// The [`BodyTooLarge`], when an answer's body was over the limit on
    /// buffered bodies.
    fn body_too_large(&self) -> Option<&BodyTooLarge>;
    /// The [`Interrupted`], when an attempt ended in an error that is not
    /// retried (the request may have run). `None` by default, so that an
    /// implementation of this trait written before it still builds.
    fn interrupted(&self) -> Option<&Interrupted> {
        None
    }
}

impl ErrorExt for reqwest_middleware::Error {
    fn gave_up(&self) -> Option<&GaveUp> {
        match self {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    fn invalid_key(&self) -> Option<&crate::InvalidKey> {
        match self {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    fn body_too_large(&self) -> Option<&BodyTooLarge> {
        match self {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    fn interrupted(&self) -> Option<&Interrupted> {
        match self {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}
