//! Running an HTTP handler under the promise: claim, execute, store, commit, answer.
//!
//! This is what `#[idempotent]` expands to a call of, and it can be used by hand
//! (see [`run`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::extract::{FromRef, FromRequestParts, MatchedPath};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::config::Idem;
use crate::fingerprint::{FingerprintBuilder, FingerprintError};
use crate::key::IdempotencyKey;
use crate::problem::{self, Problem};
use crate::response::{self, CaptureError};
use crate::store::{self, Claim, ClaimRequest};
use crate::tenant::TenantError;
use crate::tx::Tx;

/// The fixed description of one idempotent operation, written once per handler.
#[derive(Debug, Clone, Copy)]
pub struct OperationSpec {
    /// The operation's stable name.
    pub operation: &'static str,
    /// How long keys and outcomes are kept.
    pub retention: Duration,
    /// Overrides [`Idem::in_flight_wait`] for this operation.
    pub in_flight_wait: Option<Duration>,
    /// Request headers (lower case) that are part of the fingerprint.
    pub fingerprint_headers: &'static [&'static str],
}

/// The request-side input of an idempotent handler: the validated key, the method,
/// the matched route and the headers, plus the [`Idem`] from the router state.
///
/// As an extractor it refuses a request without a usable key with `400`
/// `application/problem+json` before anything is reserved.
pub struct IdemRequest {
    idem: Idem,
    key: IdempotencyKey,
    method: Method,
    route: String,
    path: String,
    query: Option<String>,
    headers: HeaderMap,
}

/// Redacted: the headers hold credentials and the key, so only names are shown.
impl std::fmt::Debug for IdemRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemRequest")
            .field("key", &self.key)
            .field("method", &self.method)
            .field("route", &self.route)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl IdemRequest {
    /// The validated key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// A fingerprint builder seeded with the tenant, operation, method, route
    /// template, the concrete path and query string (so `/orders/1/ship` and
    /// `/orders/2/ship` are different requests), and the operation's fingerprint
    /// headers.
    pub fn fingerprint(&self, spec: &OperationSpec, tenant: &str) -> FingerprintBuilder {
        let mut fp =
            FingerprintBuilder::new(tenant, spec.operation, self.method.as_str(), &self.route)
                .extra("path", &self.path);
        if let Some(q) = &self.query {
            fp = fp.extra("query", q);
        }
        for name in spec.fingerprint_headers {
            fp = fp.header(name, &self.headers);
        }
        fp
    }
}

impl<S> FromRequestParts<S> for IdemRequest
where
    Idem: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let key = IdempotencyKey::from_headers(&parts.headers).map_err(|e| {
            let p = if e.is_missing() {
                Problem::missing_key()
            } else {
                Problem::malformed_key(&e)
            };
            p.into_response()
        })?;
        let route = parts
            .extensions
            .get::<MatchedPath>()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_else(|| parts.uri.path().to_owned());
        Ok(IdemRequest {
            idem: Idem::from_ref(state),
            key,
            method: parts.method.clone(),
            route,
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().map(str::to_owned),
            headers: parts.headers.clone(),
        })
    }
}

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

    fn rolls_back(&self) -> bool {
        self.is_err || self.response.status().is_server_error()
    }
}

/// A handler body that runs inside the claimed transaction.
pub type BoxedHandler = Box<
    dyn for<'t> FnOnce(&'t mut Tx) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 't>>
        + Send,
>;

/// Runs `handler` at most once for the request's tenant, operation and key.
///
/// In order: check the tenant id, finish the fingerprint, begin a transaction,
/// claim the key, and then
///
/// * on [`Claim::Execute`]: run `handler` with the transaction; an `Err` or a 5xx
///   rolls back and is answered as it is; anything else is buffered, stored in the
///   same transaction and committed, then sent;
/// * on [`Claim::Replay`]: answer the stored outcome with `Idempotent-Replayed: true`;
/// * on [`Claim::Mismatch`]: `422` problem; on [`Claim::InFlight`]: `409` problem
///   with `Retry-After`.
///
/// The work runs on its own task, so a client that disconnects does not cancel it
/// half-way: the outcome is still committed and the client's retry replays it.
pub async fn run(
    req: IdemRequest,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    handler: BoxedHandler,
) -> Response {
    let tenant = match tenant {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(operation = spec.operation, error = %e, "idem: unusable tenant id");
            return Problem::new(
                problem::INVALID_TENANT,
                StatusCode::INTERNAL_SERVER_ERROR,
                "Unusable tenant id",
            )
            .into_response();
        }
    };
    let fingerprint = match fingerprint {
        Ok(fp) => fp.finish(),
        Err(e) => {
            tracing::error!(operation = spec.operation, error = %e, "idem: cannot fingerprint the request");
            return Problem::new(
                problem::FINGERPRINT_FAILED,
                StatusCode::INTERNAL_SERVER_ERROR,
                "The request could not be fingerprinted",
            )
            .into_response();
        }
    };
    let task = tokio::spawn(async move {
        let claim = ClaimRequest {
            tenant: &tenant,
            operation: spec.operation,
            key: &req.key,
            fingerprint,
            retention: spec.retention,
            in_flight_wait: spec.in_flight_wait.unwrap_or(req.idem.in_flight_wait()),
        };
        execute(&req.idem, &claim, handler).await
    });
    match task.await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::error!(operation = spec.operation, error = %e, "idem: handler task failed; its transaction was rolled back");
            Problem::new(
                problem::HANDLER_PANICKED,
                StatusCode::INTERNAL_SERVER_ERROR,
                "The handler failed",
            )
            .with_detail("nothing was stored; retrying with the same key is safe")
            .into_response()
        }
    }
}

async fn execute(idem: &Idem, req: &ClaimRequest<'_>, handler: BoxedHandler) -> Response {
    let op = req.operation;
    // Explicit, so a server or role whose default isolation is stricter still
    // gets the READ COMMITTED that claims need.
    let tx = match idem
        .pool()
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
    {
        Ok(tx) => tx,
        Err(e) => return store_failed(op, "begin", &e),
    };
    let mut tx = Tx::new(tx);
    let claim = match store::claim(tx.transaction(), req).await {
        Ok(c) => c,
        Err(e) => return store_failed(op, "claim", &e),
    };
    let execution = match claim {
        Claim::Execute(execution) => execution,
        Claim::Replay(stored) => {
            tracing::debug!(operation = op, status = stored.status, "idem: replay");
            return response::replay(stored);
        }
        Claim::Mismatch => {
            tracing::info!(operation = op, "idem: fingerprint mismatch");
            return Problem::mismatch().into_response();
        }
        Claim::InFlight { retry_after } => {
            tracing::info!(operation = op, "idem: in flight");
            return Problem::in_flight(retry_after).into_response();
        }
    };
    tracing::debug!(
        operation = op,
        generation = execution.generation(),
        "idem: execute"
    );

    let outcome = handler(&mut tx).await;
    if outcome.rolls_back() {
        // Dropping the transaction rolls it back; say so explicitly to free the
        // connection before the response is sent.
        if let Err(e) = tx.into_inner().rollback().await {
            tracing::warn!(operation = op, error = %e, "idem: rollback failed; the connection is discarded");
        }
        tracing::debug!(
            operation = op,
            status = outcome.response.status().as_u16(),
            "idem: rolled back"
        );
        return outcome.response;
    }
    let (response, stored) = match response::capture(
        outcome.response,
        idem.stored_headers(),
        idem.max_response_bytes(),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(operation = op, error = %e, "idem: response not storable; rolled back");
            let type_uri = match e {
                CaptureError::TooLarge { .. } => problem::RESPONSE_TOO_LARGE,
                _ => problem::STORE_UNAVAILABLE,
            };
            return Problem::new(
                type_uri,
                StatusCode::INTERNAL_SERVER_ERROR,
                "The response could not be stored",
            )
            .with_detail(format!("{e}; the operation was rolled back"))
            .into_response();
        }
    };
    if let Err(e) = execution.complete(tx.transaction(), &stored).await {
        return store_failed(op, "complete", &e);
    }
    if let Err(e) = tx.into_inner().commit().await {
        // The commit may or may not have happened; either way a retry with the
        // same key is safe: it replays or executes.
        tracing::error!(operation = op, error = %e, "idem: commit failed; the outcome is unknown");
        return Problem::store_unavailable()
            .with_detail("the outcome is unknown; retry with the same key: it is safe")
            .into_response();
    }
    response
}

fn store_failed(op: &str, step: &str, e: &dyn std::fmt::Display) -> Response {
    tracing::error!(operation = op, step, error = %e, "idem: store failed; nothing stored");
    Problem::store_unavailable().into_response()
}
