//! The pipeline both modes share: check the tenant, finish the fingerprint,
//! claim through the [`Mode`], then answer or run the body, on a task of its own
//! and within the mode's deadline; and the steps both modes' settlements use.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use super::answers::{Answer, Step, abandoned, store_failed};
use super::{BoxedBody, IdemRequest, OperationSpec};
use crate::config::Idem;
use crate::db::Backend;
use crate::fingerprint::{Fingerprint, FingerprintBuilder, FingerprintError};
use crate::key::IdempotencyKey;
use crate::lease::LeaseBackend;
use crate::metrics;
use crate::model::{ClaimRequest, LeaseRequest, StoreError, StoredResponse};
use crate::problem::{self, Problem};
use crate::response::{self, CaptureError};
use crate::tenant::TenantError;

/// The checked request: what a claim in either mode needs.
pub struct Scope<'a> {
    pub(super) spec: &'static OperationSpec,
    pub(super) tenant: &'a str,
    pub(super) key: &'a IdempotencyKey,
    fingerprint: Fingerprint,
    /// The tenant as a metric label, when the service asked for it.
    pub(super) tenant_label: Option<&'a str>,
    /// When the request is abandoned (the transactional mode): past it, a
    /// dropped transaction closes its connection instead of giving it back.
    pub(super) deadline: Option<tokio::time::Instant>,
}

impl Scope<'_> {
    pub(super) fn op(&self) -> &'static str {
        self.spec.operation
    }

    pub(super) fn claim_request<DB: Backend>(&self, idem: &Idem<DB>) -> ClaimRequest<'_> {
        ClaimRequest {
            tenant: self.tenant,
            operation: self.spec.operation,
            key: self.key,
            fingerprint: self.fingerprint,
            retention: self.spec.retention,
            in_flight_wait: self
                .spec
                .in_flight_wait
                .unwrap_or(idem.configured_in_flight_wait()),
        }
    }

    /// The answer `stored`, read from this key's row, opened when sealed (see
    /// [`crate::at_rest`]).
    pub(super) fn opened(
        &self,
        ring: Option<&crate::at_rest::KeyRing>,
        stored: StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        crate::at_rest::open_replay(ring, self.tenant, self.spec.operation, self.key, stored)
    }

    pub(super) fn lease_len(&self) -> Duration {
        self.spec.lease.unwrap_or(Duration::from_secs(30))
    }

    pub(super) fn lease_request(&self) -> LeaseRequest<'_> {
        LeaseRequest {
            tenant: self.tenant,
            operation: self.spec.operation,
            key: self.key,
            fingerprint: self.fingerprint,
            retention: self.spec.retention,
            lease: self.lease_len(),
        }
    }
}

/// A [`Scope`] that owns what it borrows, for work that outlives its request
/// (a long operation's, after its `202`).
pub(super) struct OwnedScope {
    spec: &'static OperationSpec,
    tenant: String,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    tenant_label: bool,
}

impl OwnedScope {
    pub(super) fn scope(&self) -> Scope<'_> {
        Scope {
            spec: self.spec,
            tenant: &self.tenant,
            key: &self.key,
            fingerprint: self.fingerprint,
            tenant_label: self.tenant_label.then_some(self.tenant.as_str()),
            deadline: None,
        }
    }
}

impl Scope<'_> {
    /// This scope, owned; without a deadline (only leased work outlives its
    /// request, and leased mode has none).
    pub(super) fn owned(&self) -> OwnedScope {
        OwnedScope {
            spec: self.spec,
            tenant: self.tenant.to_owned(),
            key: self.key.clone(),
            fingerprint: self.fingerprint,
            tenant_label: self.tenant_label.is_some(),
        }
    }
}

/// What a claim decided, in either mode.
pub enum Decision<Held, Handle> {
    /// This request owns the execution: `how` is the metric's outcome label.
    Execute {
        held: Held,
        handle: Handle,
        how: &'static str,
    },
    /// Nothing runs; the answer says why.
    Answer(Answer),
}

/// The mode a handler's `&mut` parameter picks: [`Tx`](crate::Tx), the
/// transactional mode; [`Lease`](crate::Lease), leased mode.
pub trait ModeOf<DB: LeaseBackend>: Send + 'static {
    /// The mode whose handle this is.
    type Mode: Mode<DB, Handle = Self>;
}

/// How a mode claims a key and settles an execution; the rest of the pipeline
/// is the same for both. Implemented by [`Transactional`](super::transactional::Transactional)
/// and [`Leased`](super::leased::Leased) only.
pub trait Mode<DB: LeaseBackend>: Send + 'static {
    /// What the handler gets: [`Tx`](crate::Tx) or [`Lease`](crate::Lease).
    type Handle: Send + 'static;
    /// What the mode keeps of an execution besides the handle.
    #[doc(hidden)]
    type Held: Send;

    /// How long a request may take from its claim to its commit, if the mode
    /// bounds it.
    #[doc(hidden)]
    fn deadline(idem: &Idem<DB>, spec: &OperationSpec) -> Option<Duration>;

    /// Claims the scope's key.
    #[doc(hidden)]
    fn claim(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
    ) -> impl Future<Output = Result<Decision<Self::Held, Self::Handle>, StoreError>> + Send;

    /// Runs the handler body and settles its outcome: stores it, or rolls back,
    /// releases or marks it uncertain, and answers.
    #[doc(hidden)]
    fn execute(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
        held: Self::Held,
        handle: Self::Handle,
        body: BoxedBody<Self::Handle>,
        started: Instant,
    ) -> impl Future<Output = Response> + Send;
}

/// A `500` problem of `kind`: the service, not the request, is at fault.
fn server_fault(kind: &'static str, title: &'static str) -> Response {
    Problem::new(kind, StatusCode::INTERNAL_SERVER_ERROR, title).into_response()
}

/// Checks the tenant and finishes the fingerprint, or answers why not.
// The error is the answer to send; boxing it would only move the allocation.
#[allow(clippy::result_large_err)]
fn prepare(
    spec: &OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
) -> Result<(String, Fingerprint), Response> {
    let op = spec.operation;
    let tenant = tenant.map_err(|e| {
        tracing::error!(operation = op, error = %e, "idem: unusable tenant id");
        server_fault(problem::INVALID_TENANT, "Unusable tenant id")
    })?;
    let fingerprint = fingerprint.map_err(|e| {
        tracing::error!(operation = op, error = %e, "idem: cannot fingerprint the request");
        server_fault(
            problem::FINGERPRINT_FAILED,
            "The request could not be fingerprinted",
        )
    })?;
    Ok((tenant, fingerprint.finish()))
}

/// Runs the claimed work on its own task, so a client that disconnects does not
/// cancel it half-way: the outcome is still recorded and the retry replays it.
///
/// The work is boxed before it is spawned: its future is large (about 10 KB), and
/// by value it would be copied into the caller's future, into `spawn` and into the
/// task cell (a tenth of the request's CPU under callgrind, see BENCHMARKS.md).
async fn detached(
    operation: &'static str,
    work: Pin<Box<dyn Future<Output = Response> + Send + 'static>>,
    decided: &AtomicBool,
) -> Response {
    match tokio::spawn(work).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::error!(operation, error = %e, "idem: handler task failed; its transaction rolled back, or its lease is taken over once it lapses");
            // A claim that executed counts one completion, this one too.
            if decided.load(Ordering::Relaxed) {
                metrics::completion(operation, "panicked");
            }
            // Not "nothing happened": a leased handler may have called
            // downstream before it failed. Either way the same key is the retry
            // (a leased one runs again under the same downstream key once the
            // lease lapses); a new key could repeat the effect.
            Problem::new(
                problem::HANDLER_PANICKED,
                StatusCode::INTERNAL_SERVER_ERROR,
                "The handler failed",
            )
            .with_detail("its outcome was not recorded; retry with the same key, not a new one")
            .into_response()
        }
    }
}

/// Runs `body` at most once for the request's tenant, operation and key, in the
/// mode `M`: check the tenant id, finish the fingerprint, claim, and then either
/// answer without running (replay, mismatch `422`, in flight `409`, uncertain
/// `202`) or run the body and settle its outcome (see [`run`]).
///
/// The work runs on its own task, so a client that disconnects does not cancel it
/// half-way: the outcome is still recorded and the client's retry replays it.
async fn run_in<DB: LeaseBackend, M: Mode<DB>, const HEADERS: bool>(
    req: IdemRequest<DB, HEADERS>,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    body: BoxedBody<M::Handle>,
) -> Response {
    let (tenant, fingerprint) = match prepare(spec, tenant, fingerprint) {
        Ok(p) => p,
        Err(resp) => return resp,
    };
    // Counted from before the task is spawned, so that a shutdown waiting for
    // the executions cannot miss one that is spawned but not yet running.
    let running = req.idem.executions().start();
    // A child of the caller's span (a `TraceLayer`'s request span, say), and
    // the span of the spawned work: the handler's own events stay inside the
    // request's span. Never the key.
    let span = tracing::info_span!(
        "idem",
        idem.operation = spec.operation,
        idem.mode = if spec.lease.is_some() {
            "leased"
        } else {
            "transactional"
        },
        idem.outcome = tracing::field::Empty,
        idem.replayed = tracing::field::Empty,
        idem.generation = tracing::field::Empty,
        idem.wait_ms = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    let recorded = span.clone();
    // Set once the claim is decided: a deadline before then is the claim's
    // outcome, after it the completion's; and a panic after it is the
    // completion's too.
    let decided = Arc::new(AtomicBool::new(false));
    let decided_here = decided.clone();
    let response = detached(
        spec.operation,
        Box::pin(
            async move {
                let decided = decided_here;
                let _running = running;
                let scope = Scope {
                    spec,
                    tenant: &tenant,
                    key: &req.key,
                    fingerprint,
                    tenant_label: req.idem.tenant_label().then_some(tenant.as_str()),
                    // A deadline past what the clock can hold is no deadline.
                    deadline: M::deadline(&req.idem, spec)
                        .and_then(|d| tokio::time::Instant::now().checked_add(d)),
                };
                let Some(deadline) = scope.deadline else {
                    return pipeline::<DB, M>(&req.idem, &scope, body, &decided).await;
                };
                let work = pipeline::<DB, M>(&req.idem, &scope, body, &decided);
                match tokio::time::timeout_at(deadline, work).await {
                    Ok(resp) => resp,
                    Err(_) => {
                        tracing::Span::current().record("idem.outcome", "deadline");
                        let claimed = decided.load(Ordering::Relaxed);
                        abandoned(spec.operation, scope.tenant_label, claimed, deadline)
                    }
                }
            }
            .instrument(span),
        ),
        &decided,
    )
    .await;
    recorded.record("http.response.status_code", response.status().as_u16());
    response
}

async fn pipeline<DB: LeaseBackend, M: Mode<DB>>(
    idem: &Idem<DB>,
    scope: &Scope<'_>,
    body: BoxedBody<M::Handle>,
    decided: &AtomicBool,
) -> Response {
    let op = scope.op();
    let started = Instant::now();
    let claimed = M::claim(idem, scope).await;
    decided.store(true, Ordering::Relaxed);
    let decision = match claimed {
        Ok(d) => d,
        Err(e) => return store_failed(op, scope.tenant_label, Step::Claim, &e),
    };
    match decision {
        Decision::Answer(answer) => {
            if !answer.cached() {
                metrics::seconds(metrics::CLAIM_SECONDS, op, started.elapsed().as_secs_f64());
            }
            answer.respond(op, scope.tenant_label)
        }
        Decision::Execute { held, handle, how } => {
            metrics::seconds(metrics::CLAIM_SECONDS, op, started.elapsed().as_secs_f64());
            metrics::claim(op, scope.tenant_label, how);
            tracing::Span::current().record("idem.outcome", how);
            tracing::debug!(operation = op, how, "idem: execute");
            M::execute(idem, scope, held, handle, body, started).await
        }
    }
}

/// Runs `handler` at most once, in the mode its `&mut` parameter picks
/// (`Tx` the transactional mode, `Lease` leased mode).
///
/// Transactional mode (the handler takes [`Tx`](crate::Tx)): check the tenant
/// id, finish the fingerprint, begin a transaction (READ COMMITTED), claim the
/// key, and then
///
/// * on [`Claim::Execute`]: run `handler` with the transaction; an `Err` or a 5xx
///   rolls back and is answered as it is; anything else is buffered, stored in the
///   same transaction and committed, then sent;
/// * on [`Claim::Replay`]: answer the stored outcome with `Idempotent-Replayed: true`;
/// * on [`Claim::Mismatch`]: `422` problem; on [`Claim::InFlight`]: `409` problem
///   with `Retry-After`.
///
/// Leased mode (the handler takes [`Lease`]): the claim commits on its own, the
/// handler runs holding the lease, renewed in the background while it runs (up
/// to the spec's ceiling), and the outcome is stored only if this worker still
/// owns the execution.
///
/// * An `Err` or a 5xx releases the key (the effect is taken not to have
///   happened), or, for a `504` (a downstream call that may have done its
///   work) and where the execution took the key over, lapses its lease at once
///   (an effect may have happened: the retry takes the key over, told so); a response built from [`crate::Uncertain`] marks the row
///   `uncertain`; anything else is stored and sent.
/// * A worker whose lease was taken over publishes nothing: its client gets the
///   current owner's stored outcome if there is one, else `409`.
/// * Retries of an uncertain key get `202` with the problem type
///   [`problem::OUTCOME_UNCERTAIN`] until a reconciler resolves it.
///
/// [`Claim::Execute`]: crate::Claim::Execute
/// [`Claim::Replay`]: crate::Claim::Replay
/// [`Claim::Mismatch`]: crate::Claim::Mismatch
/// [`Claim::InFlight`]: crate::Claim::InFlight
/// [`Lease`]: crate::Lease
pub async fn run<DB: LeaseBackend, H: ModeOf<DB>, const HEADERS: bool>(
    req: IdemRequest<DB, HEADERS>,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    handler: BoxedBody<H>,
) -> Response {
    run_in::<DB, H::Mode, HEADERS>(req, spec, tenant, fingerprint, handler).await
}

/// Buffers and extracts the stored form of a response, or answers why it cannot.
pub(super) async fn capture<DB: LeaseBackend>(
    idem: &Idem<DB>,
    op: &'static str,
    resp: Response,
) -> Result<(Response, StoredResponse), Response> {
    response::capture(resp, idem.stored_headers(), idem.max_response_bytes())
        .await
        .map_err(|e| {
            tracing::error!(operation = op, error = %e, "idem: response not storable");
            let type_uri = match e {
                CaptureError::TooLarge { .. } => {
                    metrics::completion(op, "too_large");
                    problem::RESPONSE_TOO_LARGE
                }
                _ => {
                    metrics::completion(op, "error");
                    problem::STORE_UNAVAILABLE
                }
            };
            Problem::new(
                type_uri,
                StatusCode::INTERNAL_SERVER_ERROR,
                "The response could not be stored",
            )
            .with_detail(format!("{e}; the operation was rolled back"))
            .into_response()
        })
}

pub(super) fn stored_ok(op: &'static str, stored: &StoredResponse, started: Instant) {
    metrics::completion(op, "stored");
    metrics::seconds(
        metrics::COMPLETION_SECONDS,
        op,
        started.elapsed().as_secs_f64(),
    );
    metrics::stored_bytes(op, stored.body.len() as u64);
}
