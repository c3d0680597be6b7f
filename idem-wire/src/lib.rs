//! idem's wire contract, written down once: what a server and a client of idem
//! must agree on, and nothing else.
//!
//! * the header names: [`IDEMPOTENCY_KEY`] (the request's key) and
//!   [`IDEMPOTENT_REPLAYED`] (set on an answer that is a replay);
//! * the problem documents: their media type and every `type` URI idem answers
//!   with ([`problem`]);
//! * the grammar of a bare key: [`check_bare_key`], [`MAX_KEY_LEN`];
//! * `Retry-After`: how the server writes it ([`retry_after_seconds`]) and how a
//!   client reads it ([`parse_retry_after`]).
//!
//! `idem-runtime` (the server half), `idem-client` (the client half) and
//! `idem-cli` take these from here, so they cannot drift apart. The crate has no
//! HTTP framework, database or async runtime among its dependencies: a client
//! in any stack may depend on it alone.
//!
//! ```
//! use std::time::{Duration, SystemTime};
//!
//! // A key a client may send bare, and one it may not.
//! assert!(idem_wire::check_bare_key(b"order-42").is_ok());
//! assert!(idem_wire::check_bare_key(b"order 42").is_err());
//!
//! // The server asks for a retry after 1.2 s: it says 2, the client waits 2 s.
//! let secs = idem_wire::retry_after_seconds(Duration::from_millis(1200));
//! assert_eq!(
//!     idem_wire::parse_retry_after(&secs.to_string(), SystemTime::now()),
//!     Some(Duration::from_secs(2))
//! );
//! ```

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod key;
pub mod problem;
mod retry_after;

pub use key::{BareKeyError, MAX_KEY_LEN, check_bare_key};
pub use retry_after::{parse_retry_after, retry_after_seconds};

/// The request header that carries the key (`Idempotency-Key`), in the
/// lower case HTTP/2 and the `http` crate use; header names are case-insensitive.
///
/// ```
/// assert_eq!(idem_wire::IDEMPOTENCY_KEY, "idempotency-key");
/// assert!("Idempotency-Key".eq_ignore_ascii_case(idem_wire::IDEMPOTENCY_KEY));
/// ```
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header that marks a replayed answer (`Idempotent-Replayed: true`):
/// the stored outcome of an earlier execution, not a new one.
///
/// ```
/// assert_eq!(idem_wire::IDEMPOTENT_REPLAYED, "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
