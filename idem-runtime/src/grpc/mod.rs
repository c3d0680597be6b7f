//! gRPC: the same promise for tonic services. `#[idempotent]` on a method of a
//! tonic service (inside its `#[tonic::async_trait] impl`) runs the method at
//! most once per tenant, operation and key, in its own database transaction
//! (or holding a lease), and answers every retry with the stored message or
//! status, with the `idempotent-replayed: true` metadata entry.
//!
//! ```ignore
//! #[tonic::async_trait]
//! impl Orders for OrdersService {
//!     #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
//!     async fn create_order(
//!         &self,
//!         #[tenant] caller: Extension<Caller>,   // set by an interceptor
//!         tx: &mut Tx<Postgres>,                 // the transaction that holds the key
//!         request: Request<CreateOrderRequest>,
//!     ) -> Result<Response<Order>, Status> {
//!         let order = insert_order(&mut **tx, &caller, request.get_ref()).await?;
//!         Ok(Response::new(order))
//!     }
//! }
//! ```
//!
//! The attribute removes `#[tenant]` and `tx` from the signature: tonic calls
//! `create_order(&self, request)` as its trait declares. The service must be
//! `Clone` (the method runs on a task of its own, so that a cancelled call does
//! not stop a half-done operation) and provide the [`Idem`](crate::Idem) through
//! `axum::extract::FromRef`, as a router's state does.
//!
//! * **The key:** `key = "metadata"` reads the `idempotency-key` request
//!   metadata entry ([`KEY_METADATA`]); `key = "body.request_id"` reads a string
//!   field of the request message (AIP-155's `request_id`, AEP-155's
//!   `idempotency_key`), which is then left out of the fingerprint. The key rules
//!   are HTTP's; a missing or malformed key is `INVALID_ARGUMENT` and reserves
//!   nothing.
//! * **The tenant:** a `#[tenant]` parameter whose type implements
//!   [`FromGrpcRequest`] and [`TenantScope`](crate::TenantScope), such as
//!   `axum::Extension<Caller>` inserted by an interceptor; or `single_tenant`.
//! * **The fingerprint:** the request message's canonical encoding (prost
//!   encodes fields in number order and leaves out default values, so two
//!   encodings of one message are one request), with `fingerprint(body.field,
//!   ..)` selecting top-level fields and `header = ".."` adding metadata
//!   entries. Map fields must be generated as `BTreeMap`s (`btree_map(".")` in
//!   tonic-prost-build): a `HashMap` encodes in a random order.
//! * **The answers:** see [`is_stored`] for which statuses the method returns are
//!   stored, and docs/grpc.md for the table of idem's own answers
//!   (`FAILED_PRECONDITION` for another message under a key, `ABORTED` with
//!   `google.rpc.RetryInfo` while it is in flight, `UNAVAILABLE` with
//!   `RetryInfo` when the store is).

mod answer;
mod call;
#[doc(hidden)]
pub mod support;

pub(crate) use answer::status_kept;
pub use answer::{http_status, stored_message, stored_status, uncertain};
/// The value an interceptor inserted, as a method's parameter (re-exported
/// from axum, so that a tonic service need not name it).
pub use axum::Extension;
/// How the service provides its [`Idem`](crate::Idem) (re-exported from axum).
pub use axum::extract::FromRef;
pub use call::FromGrpcRequest;

use tonic::Code;

/// The request metadata entry that carries the key with `key = "metadata"`.
pub const KEY_METADATA: &str = "idempotency-key";

/// The metadata entry a replayed answer carries: `idempotent-replayed: true`,
/// on the response or on the status.
pub const REPLAYED_METADATA: &str = "idempotent-replayed";

/// The `google.rpc.ErrorInfo` domain of the answers idem gives itself.
pub const ERROR_DOMAIN: &str = "idem";

/// The `google.rpc.ErrorInfo` reasons of idem's own answers.
pub mod reason {
    /// `INVALID_ARGUMENT`: the call carries no key.
    pub const KEY_MISSING: &str = "IDEMPOTENCY_KEY_MISSING";
    /// `INVALID_ARGUMENT`: the key breaks the key rules.
    pub const KEY_MALFORMED: &str = "IDEMPOTENCY_KEY_MALFORMED";
    /// `FAILED_PRECONDITION`: the key belongs to another request.
    pub const KEY_REUSED: &str = "IDEMPOTENCY_KEY_REUSED";
    /// `ABORTED` with `RetryInfo`: another call with the key is running.
    pub const IN_FLIGHT: &str = "IN_FLIGHT";
    /// `ABORTED` with `RetryInfo`: an earlier execution's effect is unknown
    /// (leased mode) until a reconciler settles it.
    pub const OUTCOME_UNCERTAIN: &str = "OUTCOME_UNCERTAIN";
    /// `UNAVAILABLE` with `RetryInfo`: the store could not be reached or is
    /// busy, or the operation's running limit is full; nothing was stored
    /// (or the key's stored outcome could not be read: it does not run again).
    pub const STORE_UNAVAILABLE: &str = "STORE_UNAVAILABLE";
    /// `INTERNAL`: the service failed before or after the method (a tenant
    /// id it cannot use, an answer too large to store); nothing was stored.
    pub const SERVICE_FAULT: &str = "SERVICE_FAULT";
    /// `UNKNOWN` with `RetryInfo`: the method panicked. Its transaction was
    /// rolled back; in leased mode it may have called downstream, and its lease
    /// is taken over once it lapses. Retry with the same key, never a new one
    /// (a new key could repeat the effect).
    pub const HANDLER_PANICKED: &str = "HANDLER_PANICKED";
}

/// Whether a status the method returns is stored and replayed (`true`) or
/// rolls back and frees the key (`false`), as an HTTP handler's 4xx and 5xx
/// are.
///
/// | code | HTTP | the method's effect and answer |
/// | --- | --- | --- |
/// | `OK` | 200 | committed, stored, replayed |
/// | `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `OUT_OF_RANGE` | 400 | committed, stored, replayed |
/// | `UNAUTHENTICATED` | 401 | committed, stored, replayed |
/// | `PERMISSION_DENIED` | 403 | committed, stored, replayed |
/// | `NOT_FOUND` | 404 | committed, stored, replayed |
/// | `ALREADY_EXISTS` | 409 | committed, stored, replayed |
/// | `ABORTED` | 409 | rolled back, key freed: a retry runs again |
/// | `RESOURCE_EXHAUSTED` | 429 | rolled back, key freed |
/// | `CANCELLED` | 499 | rolled back, key freed (leased: lease lapsed) |
/// | `UNKNOWN` | 500 | rolled back, key freed (leased: lease lapsed) |
/// | `INTERNAL`, `DATA_LOSS` | 500 | rolled back, key freed |
/// | `UNIMPLEMENTED` | 501 | rolled back, key freed |
/// | `UNAVAILABLE` | 503 | rolled back, key freed |
/// | `DEADLINE_EXCEEDED` | 504 | rolled back, key freed (leased: lease lapsed) |
///
/// A decision is stored; a condition that may pass is not. `ABORTED` and
/// `RESOURCE_EXHAUSTED` roll back although their HTTP codes are 4xx: gRPC
/// clients retry them, and a stored one would answer every retry with a
/// conflict or a quota that has since passed. In leased mode "rolled back"
/// means the key is released (the effect is taken not to have happened), or,
/// for `DEADLINE_EXCEEDED`, `UNKNOWN` and `CANCELLED` (a downstream call that
/// may have done its work) and for an execution that took the key over, that
/// its lease lapses at once so that the retry takes it over, told
/// `TakenOver`; a status made with [`uncertain`] marks the outcome uncertain
/// instead.
///
/// ```
/// use idem_runtime::grpc::is_stored;
/// use tonic::Code;
///
/// assert!(is_stored(Code::NotFound));
/// assert!(!is_stored(Code::Unavailable));
/// ```
pub fn is_stored(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unauthenticated
            | Code::PermissionDenied
            | Code::NotFound
            | Code::AlreadyExists
    )
}
