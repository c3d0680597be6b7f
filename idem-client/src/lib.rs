//! The client half of idem: a [`reqwest_middleware`] middleware that keeps the
//! idempotency contract from the caller's side.
//!
//! A server that honours `Idempotency-Key` runs each logical request at most once
//! and answers every retry of it the same way. That promise only helps a client
//! that sends **one key per logical request and the same key with every retry**,
//! waits out `409` (the first attempt is still running), keeps asking after a
//! `202` outcome-uncertain, and **never retries a `422`** (the key was reused for
//! a different request). [`IdempotencyMiddleware`] does exactly that:
//!
//! | answer | what the middleware does |
//! | --- | --- |
//! | connection error, timeout, body cut off (the lost response) | retry, same key, same bytes (after the head's `Retry-After`, for a problem document cut off or stalled) |
//! | `5xx` (but `501`, `505`) | retry, not before `Retry-After` |
//! | `409` in flight (`urn:idem:problem:request-in-flight`, or any `409` with `Retry-After`) | retry after `Retry-After` |
//! | `202` outcome uncertain (`urn:idem:problem:outcome-uncertain`) | retry after `Retry-After`, until a final answer |
//! | `202 Accepted` with `Location`, with [`follow_accepted`](IdempotencyMiddleware::follow_accepted) | follow the long operation: poll it, resend on `stalled`, return its stored result |
//! | `422` and every other `4xx`; `2xx`, `3xx`; other `409`s | returned at once |
//! | attempts or deadline used up | the error [`GaveUp`], carrying the key to retry with later |
//! | a final answer it must hold over [`max_response_body`](IdempotencyMiddleware::max_response_body) (4 MiB), or a document it reads to judge over 64 KiB (or the limit, if higher) | the error [`BodyTooLarge`], at once |
//! | a body that arrived but cannot be decoded; an error of a middleware after it, of a redirect, of the client; a followed operation's resource answering other than about it (a `401`: [`PollRefused`]) | the error [`Interrupted`], at once, carrying the key (the request may have run) and the error |
//!
//! The final answer comes with its body in memory, or unread for a request with
//! the [`StreamFinal`] extension. By default a logical request may take 120 s:
//! enough to wait out idem's `Retry-After` for an uncertain outcome (the
//! operation's lease, 30 s in the `orders` example) more than once.
//!
//! ```no_run
//! use idem_client::{IdempotencyMiddleware, ResponseExt};
//! use reqwest_middleware::ClientBuilder;
//!
//! # async fn run() -> Result<(), reqwest_middleware::Error> {
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new())
//!     .build();
//! let answer = client
//!     .post("http://127.0.0.1:3000/orders")
//!     .bearer_auth("acme")
//!     .header("x-currency", "EUR")
//!     .json(&serde_json::json!({"sku": "A-1", "quantity": 1, "amount_cents": 100}))
//!     .send()
//!     .await?;
//! let idem = answer.idem().expect("POST goes through the middleware");
//! // idem.key: for your logs; idem.attempts; idem.replayed: nothing ran twice
//! # Ok(()) }
//! ```
//!
//! The crate logs nothing, so never a key, and the `Debug` and `Display` of its
//! outcomes and errors show neither a key nor what reveals one (a followed
//! operation's path, which holds the key's digest with idem's server). It does
//! not depend on idem's server crates: any server that speaks the same
//! contract will do. That contract (the header names, the problem types, the
//! key grammar, `Retry-After`) is `idem-wire`'s, the crate idem's server reads
//! it from too.

#![warn(missing_docs)]

mod decide;
mod follow;
#[cfg(feature = "grpc")]
pub mod grpc;
mod key;
mod middleware;
mod outcome;

pub use decide::{OUTCOME_UNCERTAIN, REQUEST_IN_FLIGHT};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey};
pub use middleware::{IdempotencyMiddleware, StreamFinal};
pub use outcome::{
    BodyTooLarge, ErrorExt, GaveUp, IdemOutcome, Interrupted, LastAnswer, Limit, PollRefused,
    ResponseExt,
};
