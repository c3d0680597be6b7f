//! What a handler body is to the pipeline: a boxed closure over the mode's
//! handle, and the [`HandlerOutcome`] it returns.

use std::future::Future;
use std::pin::Pin;

use axum::response::{IntoResponse, Response};

use crate::db::Tx;
use crate::lease::Lease;

/// What a handler produced, and whether its transaction must be rolled back.
#[derive(Debug)]
pub struct HandlerOutcome {
    /// The response the handler built.
    pub response: Response,
    /// `true` for an `Err` return: roll back, store nothing.
    pub is_err: bool,
}

impl HandlerOutcome {
    /// An `Ok` (or plain) response: stored unless it is a 5xx.
    pub fn ok(response: impl IntoResponse) -> Self {
        HandlerOutcome {
            response: response.into_response(),
            is_err: false,
        }
    }

    /// An `Err` response: always rolled back, never stored.
    pub fn err(response: impl IntoResponse) -> Self {
        HandlerOutcome {
            response: response.into_response(),
            is_err: true,
        }
    }

    /// From a handler's `Result`.
    pub fn from_result<T: IntoResponse, E: IntoResponse>(r: Result<T, E>) -> Self {
        match r {
            Ok(v) => Self::ok(v),
            Err(e) => Self::err(e),
        }
    }

    pub(crate) fn rolls_back(&self) -> bool {
        self.is_err || self.response.status().is_server_error()
    }

    /// Whether the answer says the handler does not know what its downstream
    /// did: a `504 Gateway Timeout`, or a gRPC method's `DEADLINE_EXCEEDED`,
    /// `UNKNOWN` or `CANCELLED` ([`EffectUnknown`]), as a downstream call's
    /// error passed up with `?` reads. Leased mode does not take such an answer
    /// for "nothing happened".
    pub(crate) fn effect_unknown(&self) -> bool {
        self.response.status() == axum::http::StatusCode::GATEWAY_TIMEOUT
            || self.response.extensions().get::<EffectUnknown>().is_some()
    }
}

/// Marks a handler's answer as one that leaves its downstream effect unknown
/// (see [`HandlerOutcome::effect_unknown`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EffectUnknown;

/// A handler body, boxed: it runs with the mode's handle (`Tx` or `Lease`).
pub type BoxedBody<H> = Box<
    dyn for<'h> FnOnce(&'h mut H) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 'h>>
        + Send,
>;

/// A handler body that runs inside the claimed transaction.
pub type BoxedHandler<DB> = BoxedBody<Tx<DB>>;

/// A handler body that runs holding a lease (leased mode).
pub type BoxedLeasedHandler<DB> = BoxedBody<Lease<DB>>;
