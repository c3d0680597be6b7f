//! Running an HTTP handler under the promise: one pipeline (check the tenant,
//! finish the fingerprint, claim, run the handler, settle its outcome, answer)
//! whose mode is a type: [`Transactional`](transactional::Transactional) (the key is claimed in the handler's
//! own database transaction) or [`Leased`](leased::Leased) (the claim commits at once and the
//! handler runs holding a lease, for effects outside the database).
//!
//! This is what `#[idempotent]` expands to a call of (through `__private`).

mod answers;
mod body;
mod leased;
mod pipeline;
mod request;
mod transactional;

#[cfg(feature = "grpc")]
pub(crate) use body::EffectUnknown;
pub use body::{BoxedBody, BoxedHandler, BoxedLeasedHandler, HandlerOutcome};
pub use pipeline::run;
pub use request::{IdemRequest, OperationSpec};
