//! Running an HTTP handler under the promise: one pipeline (check the tenant,
//! finish the fingerprint, claim, run the handler, settle its outcome, answer)
//! whose mode is a type: [`Transactional`] (the key is claimed in the handler's
//! own database transaction) or [`Leased`] (the claim commits at once and the
//! handler runs holding a lease, for effects outside the database).
//!
//! This is what `#[idempotent]` expands to a call of (through `__private`).

// The sealed trait's hidden methods speak the crate's internal vocabulary on
// purpose: nothing outside the crate can implement or call them.
#![allow(private_interfaces, private_bounds)]

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::extract::{FromRef, FromRequestParts, MatchedPath};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use crate::config::Idem;
use crate::db::{Backend, DefaultBackend};
use crate::fingerprint::{Fingerprint, FingerprintBuilder, FingerprintError};
use crate::flight::{Joined, Leader};
use crate::key::IdempotencyKey;
use crate::lease::{Lease, LeaseBackend, LeaseError, LeasedClaim, Probe, Renewer, UncertainMarker};
use crate::metrics;
use crate::model::{
    Acquisition, Claim, ClaimRequest, Execution, Finish, LeaseRequest, StoreError, StoredResponse,
};
use crate::problem::{self, Problem};
use crate::response::{self, CaptureError};
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
    /// Leased mode: the lease length (`None` in the transactional mode).
    pub lease: Option<Duration>,
    /// Leased mode: the longest a running handler's lease is renewed; after it a
    /// stuck worker can be taken over. Defaults to ten leases.
    pub lease_ceiling: Option<Duration>,
}

/// The request-side input of an idempotent handler: the validated key, the method,
/// the matched route, the path and query, and the headers the operation
/// fingerprints, plus the [`Idem`] from the router state.
///
/// As an extractor it refuses a request without a usable key with `400`
/// `application/problem+json` before anything is reserved. It copies no header
/// unless `HEADERS` says the operation fingerprints some (the attribute sets it
/// when `fingerprint(header = ...)` names one): the route and URI are shared,
/// not copied.
pub struct IdemRequest<DB: LeaseBackend = DefaultBackend, const HEADERS: bool = false> {
    idem: Idem<DB>,
    key: IdempotencyKey,
    method: Method,
    /// The route template, shared with axum's `MatchedPath` (none when the
    /// handler is not behind a router: then the concrete path stands in).
    route: Option<MatchedPath>,
    uri: axum::http::Uri,
    /// The request's headers, when `HEADERS`; else empty (no allocation).
    headers: HeaderMap,
}

/// Redacted: the headers hold credentials and the key, so only names are shown.
impl<DB: LeaseBackend, const HEADERS: bool> std::fmt::Debug for IdemRequest<DB, HEADERS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemRequest")
            .field("key", &self.key)
            .field("method", &self.method)
            .field("route", &self.route())
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<DB: LeaseBackend, const HEADERS: bool> IdemRequest<DB, HEADERS> {
    /// The validated key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The matched route template, else the concrete path.
    fn route(&self) -> &str {
        match &self.route {
            Some(m) => m.as_str(),
            None => self.uri.path(),
        }
    }

    /// A fingerprint builder seeded with the tenant, operation, method, route
    /// template, the concrete path and query string (so `/orders/1/ship` and
    /// `/orders/2/ship` are different requests), and the operation's fingerprint
    /// headers.
    pub fn fingerprint(&self, spec: &OperationSpec, tenant: &str) -> FingerprintBuilder {
        debug_assert!(
            HEADERS || spec.fingerprint_headers.is_empty(),
            "an operation that fingerprints headers extracts IdemRequest<_, true>"
        );
        let mut fp =
            FingerprintBuilder::new(tenant, spec.operation, self.method.as_str(), self.route())
                .extra("path", self.uri.path());
        if let Some(q) = self.uri.query() {
            fp = fp.extra("query", q);
        }
        for name in spec.fingerprint_headers {
            fp = fp.header(name, &self.headers);
        }
        fp
    }
}

impl<S, DB, const HEADERS: bool> FromRequestParts<S> for IdemRequest<DB, HEADERS>
where
    DB: LeaseBackend,
    Idem<DB>: FromRef<S>,
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
        Ok(IdemRequest {
            idem: Idem::from_ref(state),
            key,
            method: parts.method.clone(),
            route: parts.extensions.get::<MatchedPath>().cloned(),
            uri: parts.uri.clone(),
            headers: if HEADERS {
                parts.headers.clone()
            } else {
                HeaderMap::new()
            },
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

/// A handler body, boxed: it runs with the mode's handle (`Tx` or `Lease`).
pub type BoxedBody<H> = Box<
    dyn for<'h> FnOnce(&'h mut H) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 'h>>
        + Send,
>;

/// A handler body that runs inside the claimed transaction.
pub type BoxedHandler<DB = DefaultBackend> = BoxedBody<Tx<DB>>;

/// A handler body that runs holding a lease (leased mode).
pub type BoxedLeasedHandler<DB = DefaultBackend> = BoxedBody<Lease<DB>>;

/// The checked request: what a claim in either mode needs.
struct Scope<'a> {
    spec: &'static OperationSpec,
    tenant: &'a str,
    key: &'a IdempotencyKey,
    fingerprint: Fingerprint,
    /// The tenant as a metric label, when the service asked for it.
    tenant_label: Option<&'a str>,
    /// When the request is abandoned (the transactional mode): past it, a
    /// dropped transaction closes its connection instead of giving it back.
    deadline: Option<tokio::time::Instant>,
}

impl Scope<'_> {
    fn op(&self) -> &'static str {
        self.spec.operation
    }

    fn claim_request<DB: Backend>(&self, idem: &Idem<DB>) -> ClaimRequest<'_> {
        ClaimRequest {
            tenant: self.tenant,
            operation: self.spec.operation,
            key: self.key,
            fingerprint: self.fingerprint,
            retention: self.spec.retention,
            in_flight_wait: self.spec.in_flight_wait.unwrap_or(idem.in_flight_wait()),
        }
    }

    fn lease_len(&self) -> Duration {
        self.spec.lease.unwrap_or(Duration::from_secs(30))
    }

    fn lease_request(&self) -> LeaseRequest<'_> {
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

/// What a claim decided, in either mode.
enum Decision<Held, Handle> {
    /// This request owns the execution: `how` is the metric's outcome label.
    Execute {
        held: Held,
        handle: Handle,
        how: &'static str,
    },
    /// Nothing runs; the answer says why.
    Answer(Answer),
}

/// The answers that need no execution.
enum Answer {
    /// The stored outcome; `cached` when the replay cache answered.
    Replay {
        stored: StoredResponse,
        cached: bool,
    },
    /// The key holds another request; `cached` as for a replay.
    Mismatch { cached: bool },
    /// Another execution of the key is running.
    InFlight(Duration),
    /// An earlier execution's effect is unknown (leased mode).
    Uncertain(Duration),
}

impl Answer {
    fn cached(&self) -> bool {
        matches!(
            self,
            Answer::Replay { cached: true, .. } | Answer::Mismatch { cached: true }
        )
    }

    /// The outcome's name in metrics and in the request's span.
    fn outcome(&self) -> &'static str {
        match self {
            Answer::Replay { .. } => "replayed",
            Answer::Mismatch { .. } => "mismatched",
            Answer::InFlight(_) => "in_flight",
            Answer::Uncertain(_) => "uncertain",
        }
    }

    fn respond(self, op: &'static str, tenant_label: Option<&str>) -> Response {
        let span = tracing::Span::current();
        span.record("idem.outcome", self.outcome());
        span.record("idem.replayed", matches!(self, Answer::Replay { .. }));
        match self {
            Answer::Replay { stored, cached } => {
                metrics::claim(op, tenant_label, "replayed");
                tracing::debug!(
                    operation = op,
                    status = stored.status,
                    cached,
                    "idem: replay"
                );
                response::replay(stored)
            }
            Answer::Mismatch { cached } => {
                metrics::claim(op, tenant_label, "mismatched");
                tracing::info!(operation = op, cached, "idem: fingerprint mismatch");
                Problem::mismatch().into_response()
            }
            Answer::InFlight(retry_after) => {
                metrics::claim(op, tenant_label, "in_flight");
                tracing::info!(operation = op, "idem: in flight");
                Problem::in_flight(retry_after).into_response()
            }
            Answer::Uncertain(retry_after) => {
                metrics::claim(op, tenant_label, "uncertain");
                tracing::info!(
                    operation = op,
                    "idem: outcome uncertain; not executed again"
                );
                Problem::uncertain(retry_after).into_response()
            }
        }
    }
}

/// The store step that failed, for the metric and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Claiming the key: nothing ran.
    Claim,
    /// Storing the outcome (and committing): rolled back.
    Complete,
    /// Releasing a leased key after a failure: the effect did not happen.
    Release,
    /// Reading the current outcome for a stale owner.
    Stale,
}

impl Step {
    fn as_str(self) -> &'static str {
        match self {
            Step::Claim => "claim",
            Step::Complete => "complete",
            Step::Release => "release",
            Step::Stale => "stale",
        }
    }
}

/// How a mode claims a key and settles an execution; the rest of the pipeline
/// is the same for both. Implemented by [`Transactional`] and [`Leased`] only.
pub trait Mode<DB: LeaseBackend>: Send + 'static {
    /// What the handler gets: [`Tx`] or [`Lease`].
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

/// The transactional mode: the key is claimed in the handler's own transaction,
/// and the effect and its record commit together or not at all.
#[derive(Debug, Clone, Copy)]
pub struct Transactional;

/// Leased mode: the claim commits at once, and the handler runs holding a lease
/// renewed in the background; every later write is fenced by the owner token.
#[derive(Debug, Clone, Copy)]
pub struct Leased;

/// Checks the tenant and finishes the fingerprint, or answers why not.
// The error is the answer to send; boxing it would only move the allocation.
#[allow(clippy::result_large_err)]
fn prepare(
    spec: &OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
) -> Result<(String, Fingerprint), Response> {
    let tenant = tenant.map_err(|e| {
        tracing::error!(operation = spec.operation, error = %e, "idem: unusable tenant id");
        Problem::new(
            problem::INVALID_TENANT,
            StatusCode::INTERNAL_SERVER_ERROR,
            "Unusable tenant id",
        )
        .into_response()
    })?;
    let fingerprint = fingerprint.map_err(|e| {
        tracing::error!(operation = spec.operation, error = %e, "idem: cannot fingerprint the request");
        Problem::new(
            problem::FINGERPRINT_FAILED,
            StatusCode::INTERNAL_SERVER_ERROR,
            "The request could not be fingerprinted",
        )
        .into_response()
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
) -> Response {
    match tokio::spawn(work).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::error!(operation, error = %e, "idem: handler task failed; its work was rolled back or released at lease expiry");
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

/// Runs `body` at most once for the request's tenant, operation and key, in the
/// mode `M`: check the tenant id, finish the fingerprint, claim, and then either
/// answer without running (replay, mismatch `422`, in flight `409`, uncertain
/// `202`) or run the body and settle its outcome (see [`run`] and
/// [`run_leased`]).
///
/// The work runs on its own task, so a client that disconnects does not cancel it
/// half-way: the outcome is still recorded and the client's retry replays it.
pub async fn run_in<DB: LeaseBackend, M: Mode<DB>, const HEADERS: bool>(
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
    let response = detached(
        spec.operation,
        Box::pin(
            async move {
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
                    return pipeline::<DB, M>(&req.idem, &scope, body).await;
                };
                match tokio::time::timeout_at(deadline, pipeline::<DB, M>(&req.idem, &scope, body))
                    .await
                {
                    Ok(resp) => resp,
                    Err(_) => {
                        tracing::Span::current().record("idem.outcome", "deadline");
                        abandoned(spec.operation, deadline)
                    }
                }
            }
            .instrument(span),
        ),
    )
    .await;
    recorded.record("http.response.status_code", response.status().as_u16());
    response
}

async fn pipeline<DB: LeaseBackend, M: Mode<DB>>(
    idem: &Idem<DB>,
    scope: &Scope<'_>,
    body: BoxedBody<M::Handle>,
) -> Response {
    let op = scope.op();
    let started = Instant::now();
    let decision = match M::claim(idem, scope).await {
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

/// Runs `handler` at most once in the transactional mode.
///
/// In order: check the tenant id, finish the fingerprint, begin a transaction
/// (READ COMMITTED), claim the key, and then
///
/// * on [`Claim::Execute`]: run `handler` with the transaction; an `Err` or a 5xx
///   rolls back and is answered as it is; anything else is buffered, stored in the
///   same transaction and committed, then sent;
/// * on [`Claim::Replay`]: answer the stored outcome with `Idempotent-Replayed: true`;
/// * on [`Claim::Mismatch`]: `422` problem; on [`Claim::InFlight`]: `409` problem
///   with `Retry-After`.
pub async fn run<DB: Backend, const HEADERS: bool>(
    req: IdemRequest<DB, HEADERS>,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    handler: BoxedHandler<DB>,
) -> Response {
    run_in::<DB, Transactional, HEADERS>(req, spec, tenant, fingerprint, handler).await
}

/// Runs `handler` at most once in leased mode: the claim commits on its own, the
/// handler runs holding a [`Lease`] that is renewed in the background while it
/// runs (up to the spec's ceiling), and the outcome is stored only if this worker
/// still owns the execution.
///
/// * An `Err` or a 5xx releases the key (the effect is taken not to have
///   happened); a response built from [`crate::Uncertain`] marks the row
///   `uncertain`; anything else is stored and sent.
/// * A worker whose lease was taken over publishes nothing: its client gets the
///   current owner's stored outcome if there is one, else `409`.
/// * Retries of an uncertain key get `202` with the problem type
///   [`problem::OUTCOME_UNCERTAIN`] until a reconciler resolves it.
pub async fn run_leased<DB: LeaseBackend, const HEADERS: bool>(
    req: IdemRequest<DB, HEADERS>,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    handler: BoxedLeasedHandler<DB>,
) -> Response {
    run_in::<DB, Leased, HEADERS>(req, spec, tenant, fingerprint, handler).await
}

impl<DB: Backend> Mode<DB> for Transactional {
    type Handle = Tx<DB>;
    /// The execution, and the key's flight in this process when this request
    /// leads it: dropped after the commit or rollback, which wakes the
    /// duplicates waiting for it.
    type Held = (Execution, Option<Leader>);

    /// The request deadline, and never shorter than the in-flight wait plus a
    /// second, so that a duplicate's wait ends before its request is abandoned.
    fn deadline(idem: &Idem<DB>, spec: &OperationSpec) -> Option<Duration> {
        Some(idem.deadline_with_wait(spec.in_flight_wait.unwrap_or(idem.in_flight_wait())))
    }

    async fn claim(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
    ) -> Result<Decision<Self::Held, Tx<DB>>, StoreError> {
        let mut req = scope.claim_request(idem);
        #[cfg(feature = "replay-cache")]
        if let Some(answer) = cached(idem, scope, &req) {
            return Ok(Decision::Answer(answer));
        }
        let in_flight = Answer::InFlight(req.in_flight_wait.max(Duration::from_secs(1)));
        let leader = match idem
            .flights()
            .join(scope.tenant, scope.op(), &scope.key.digest())
        {
            Joined::Leader(leader) => Some(leader),
            Joined::Full => {
                tracing::info!(
                    operation = scope.op(),
                    "idem: too many duplicates waiting; answered in flight at once"
                );
                return Ok(Decision::Answer(in_flight));
            }
            Joined::Follower(mut waiter) => {
                // Waits without a connection for the key's first request in this
                // process; past the in-flight wait, as in the database.
                let started = tokio::time::Instant::now();
                let finished = tokio::time::timeout(req.in_flight_wait, waiter.finished()).await;
                // The wait for a concurrent holder, as the databases' claims record it.
                let waited = started.elapsed();
                metrics::seconds(
                    metrics::CLAIM_WAIT_SECONDS,
                    scope.op(),
                    waited.as_secs_f64(),
                );
                tracing::Span::current().record(
                    "idem.wait_ms",
                    u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                );
                if finished.is_err() {
                    return Ok(Decision::Answer(in_flight));
                }
                drop(waiter);
                #[cfg(feature = "replay-cache")]
                if let Some(answer) = cached(idem, scope, &req) {
                    return Ok(Decision::Answer(answer));
                }
                // The first request committed (the claim below replays) or rolled
                // back (the duplicates then claim in the database: where the key
                // is claimed before the handler, one executes and the others wait
                // for what is left of the bound; where it is claimed at commit,
                // each runs its handler and one commits, the others replay it or,
                // past what is left of the bound, answer in flight). No flight of
                // its own: joining one while holding the key in the database could
                // wait on itself.
                req.in_flight_wait = req.in_flight_wait.saturating_sub(started.elapsed());
                None
            }
        };
        let (mut tx, claim) = DB::begin_claim(idem, &req).await?;
        if let Some(deadline) = scope.deadline {
            tx.abandon_at(deadline);
        }
        Ok(match claim {
            Claim::Execute(execution) => Decision::Execute {
                how: recorded_how(&execution),
                held: (execution, leader),
                handle: tx,
            },
            Claim::Replay(stored) => Decision::Answer(Answer::Replay {
                stored,
                cached: false,
            }),
            Claim::Mismatch => Decision::Answer(Answer::Mismatch { cached: false }),
            Claim::InFlight { retry_after } => Decision::Answer(Answer::InFlight(retry_after)),
        })
    }

    async fn execute(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
        (execution, _flight): Self::Held,
        mut tx: Tx<DB>,
        body: BoxedHandler<DB>,
        started: Instant,
    ) -> Response {
        let op = scope.op();
        let outcome = body(&mut tx).await;
        if outcome.rolls_back() {
            // Dropping the transaction rolls it back; say so explicitly to free the
            // connection before the response is sent.
            if let Err(e) = tx.rollback().await {
                tracing::warn!(operation = op, error = %e, "idem: rollback failed; the connection is discarded");
            }
            metrics::completion(op, "rolled_back");
            tracing::debug!(
                operation = op,
                status = outcome.response.status().as_u16(),
                "idem: rolled back"
            );
            // A key claimed at commit may have been finished by another execution
            // while this one ran: its outcome is the key's answer, not this error.
            match DB::taken_since(idem, &execution).await {
                Ok(Some(claim)) => return taken(op, scope, claim),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(operation = op, error = %e, "idem: could not look the key up after a rollback; answering the handler's own response");
                }
            }
            return outcome.response;
        }
        let (response, stored) = match capture(idem, op, outcome.response).await {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        #[cfg(feature = "replay-cache")]
        let sent = Instant::now();
        match DB::finish(idem, tx, execution, &stored).await {
            Finish::Committed =>
            {
                #[cfg(feature = "replay-cache")]
                if let Some(cache) = idem.replay_cache() {
                    cache.insert(op, &scope.claim_request(idem), &stored, sent);
                }
            }
            Finish::NotStored(e) => return store_failed(op, None, Step::Complete, &e),
            Finish::Taken(claim) => {
                metrics::completion(op, "rolled_back");
                tracing::debug!(
                    operation = op,
                    "idem: another execution holds the key; rolled back"
                );
                return taken(op, scope, claim);
            }
            Finish::Unknown(e) => {
                // Either way a retry with the same key is safe: it replays or executes.
                metrics::completion(op, "error");
                tracing::error!(operation = op, error = %e, "idem: commit failed; the outcome is unknown");
                return Problem::store_unavailable()
                    .with_detail("the outcome is unknown; retry with the same key: it is safe")
                    .into_response();
            }
        }
        stored_ok(op, &stored, started);
        response
    }
}

/// How a transactional execution came to run, its generation recorded in the
/// request's span before the handler runs (so the handler's events see it).
fn recorded_how(execution: &Execution) -> &'static str {
    tracing::Span::current().record("idem.generation", execution.generation());
    if execution.generation() > 1 {
        "reclaimed"
    } else {
        "executed"
    }
}

/// A lease's acquisition, its generation recorded in the request's span before
/// the handler runs.
fn recorded_acquisition<DB: LeaseBackend>(lease: &Lease<DB>) -> Acquisition {
    tracing::Span::current().record("idem.generation", lease.generation());
    lease.acquisition()
}

/// The answer of a request whose execution rolled back because another
/// execution holds its key.
fn taken(op: &'static str, scope: &Scope<'_>, claim: Claim) -> Response {
    let answer = match claim {
        Claim::Replay(stored) => Answer::Replay {
            stored,
            cached: false,
        },
        Claim::Mismatch => Answer::Mismatch { cached: false },
        Claim::InFlight { retry_after } => Answer::InFlight(retry_after),
        // Never decided after an execution (`decide::after_execution`).
        Claim::Execute(_) => Answer::InFlight(Duration::from_secs(1)),
    };
    answer.respond(op, scope.tenant_label)
}

/// The replay cache's answer for `req`, if it has one.
#[cfg(feature = "replay-cache")]
fn cached<DB: Backend>(
    idem: &Idem<DB>,
    scope: &Scope<'_>,
    req: &ClaimRequest<'_>,
) -> Option<Answer> {
    match idem.replay_cache()?.get(scope.op(), req)? {
        crate::replay_cache::Cached::Replay(stored) => Some(Answer::Replay {
            stored,
            cached: true,
        }),
        crate::replay_cache::Cached::Mismatch => Some(Answer::Mismatch { cached: true }),
    }
}

/// What leased mode keeps of an execution besides the lease: its renewal and
/// the way to read the current outcome once the lease is gone.
#[doc(hidden)]
pub struct LeaseHeld<DB: LeaseBackend> {
    renewer: Renewer<DB>,
    probe: Probe<DB>,
}

impl<DB: LeaseBackend> Mode<DB> for Leased {
    type Handle = Lease<DB>;
    type Held = LeaseHeld<DB>;

    /// None: a leased handler's effect happens outside, where cutting it short
    /// would leave its outcome unknown; its lease and renewal ceiling bound it.
    fn deadline(_: &Idem<DB>, _: &OperationSpec) -> Option<Duration> {
        None
    }

    async fn claim(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
    ) -> Result<Decision<LeaseHeld<DB>, Lease<DB>>, StoreError> {
        Ok(
            match crate::lease::claim_in::<DB>(idem.lease_store(), &scope.lease_request()).await? {
                LeasedClaim::Acquired(lease) => Decision::Execute {
                    how: match recorded_acquisition(&lease) {
                        Acquisition::New => "executed",
                        Acquisition::Reclaimed => "reclaimed",
                        Acquisition::TakenOver => "taken_over",
                    },
                    held: LeaseHeld {
                        renewer: lease.renewer(),
                        probe: lease.probe(),
                    },
                    handle: lease,
                },
                LeasedClaim::Replay(stored) => Decision::Answer(Answer::Replay {
                    stored,
                    cached: false,
                }),
                LeasedClaim::Mismatch => Decision::Answer(Answer::Mismatch { cached: false }),
                LeasedClaim::InFlight { retry_after } => {
                    Decision::Answer(Answer::InFlight(retry_after))
                }
                LeasedClaim::Uncertain => Decision::Answer(Answer::Uncertain(scope.lease_len())),
            },
        )
    }

    async fn execute(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
        held: LeaseHeld<DB>,
        mut lease: Lease<DB>,
        body: BoxedLeasedHandler<DB>,
        started: Instant,
    ) -> Response {
        let op = scope.op();
        let lease_len = scope.lease_len();
        let ceiling = scope
            .spec
            .lease_ceiling
            .unwrap_or(lease_len.saturating_mul(10));
        let LeaseHeld { renewer, probe } = held;
        let outcome = {
            let mut work = body(&mut lease);
            tokio::select! {
                outcome = &mut work => outcome,
                never = renewer.run(ceiling) => match never {},
            }
        };
        // A lease believed lost (no renewal got through for a whole lease, or the
        // ceiling passed) may still be this worker's: every statement below is
        // fenced by the owner token, so a worker that really lost it writes nothing
        // and answers as a stale owner, while one that did not publishes its
        // result rather than leave it to a takeover that would call downstream
        // again.
        if outcome
            .response
            .extensions()
            .get::<UncertainMarker>()
            .is_some()
        {
            return match lease.mark_uncertain().await {
                Ok(()) => {
                    metrics::completion(op, "uncertain");
                    tracing::warn!(
                        operation = op,
                        "idem: outcome uncertain; awaiting reconciliation"
                    );
                    outcome.response
                }
                Err(LeaseError::StaleOwner { .. }) => stale(op, &probe, lease_len).await,
                Err(LeaseError::Store(e)) => {
                    // The effect may have happened: never answer "nothing was stored".
                    metrics::completion(op, "error");
                    tracing::error!(operation = op, error = %e, "idem: could not mark the outcome uncertain; the row stays processing and is taken over after its lease");
                    outcome.response
                }
            };
        }
        if outcome.rolls_back() {
            return match lease.release().await {
                Ok(()) => {
                    metrics::completion(op, "rolled_back");
                    outcome.response
                }
                Err(LeaseError::StaleOwner { .. }) => stale(op, &probe, lease_len).await,
                // The effect did not happen; the key frees itself when the lease lapses.
                Err(LeaseError::Store(e)) => store_failed(op, None, Step::Release, &e),
            };
        }
        let (response, stored) = match capture(idem, op, outcome.response).await {
            Ok(r) => r,
            Err(_rolled_back) => {
                // The transactional answer ("rolled back") would be false here.
                // `capture` counted this completion already.
                return effect_unrecorded(
                    op,
                    &lease,
                    &probe,
                    lease_len,
                    "the operation ran but its response could not be stored",
                    false,
                )
                .await;
            }
        };
        // The effect happened: try hard to record it before the lease lapses, and
        // fall back to `uncertain` rather than let a takeover repeat it.
        let mut attempt = 0;
        loop {
            attempt += 1;
            match lease.store_outcome(&stored).await {
                Ok(()) => {
                    stored_ok(op, &stored, started);
                    return response;
                }
                Err(LeaseError::Store(e)) if attempt < 3 => {
                    tracing::warn!(operation = op, attempt, error = %e, "idem: storing a leased outcome failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                }
                Err(LeaseError::Store(e)) => {
                    tracing::error!(operation = op, error = %e, "idem: storing a leased outcome failed");
                    return effect_unrecorded(
                        op,
                        &lease,
                        &probe,
                        lease_len,
                        "the operation ran but its outcome could not be recorded",
                        true,
                    )
                    .await;
                }
                Err(LeaseError::StaleOwner { .. }) => return stale(op, &probe, lease_len).await,
            }
        }
    }
}

/// Buffers and extracts the stored form of a response, or answers why it cannot.
async fn capture<DB: LeaseBackend>(
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

fn stored_ok(op: &'static str, stored: &StoredResponse, started: Instant) {
    metrics::completion(op, "stored");
    metrics::seconds(
        metrics::COMPLETION_SECONDS,
        op,
        started.elapsed().as_secs_f64(),
    );
    ::metrics::counter!(metrics::STORED_BYTES_TOTAL, "operation" => op)
        .increment(stored.body.len() as u64);
}

/// The answer after an effect whose outcome could not be stored: the row is
/// marked `uncertain` for reconciliation (never released: a retry would repeat
/// the effect), and the client is told what its retries will be told, `202`, not
/// that nothing happened. If even marking fails, the row stays `processing` and a
/// retry takes it over after the lease, calling downstream with the same
/// downstream key.
async fn effect_unrecorded<DB: LeaseBackend>(
    op: &'static str,
    lease: &Lease<DB>,
    probe: &Probe<DB>,
    lease_len: Duration,
    detail: &str,
    count: bool,
) -> Response {
    for attempt in 1..=3u64 {
        match lease.record_uncertain().await {
            Ok(()) => {
                if count {
                    metrics::completion(op, "uncertain");
                }
                break;
            }
            Err(LeaseError::StaleOwner { .. }) => return stale(op, probe, lease_len).await,
            Err(LeaseError::Store(e)) => {
                tracing::error!(operation = op, attempt, error = %e, "idem: marking the outcome uncertain failed");
                if attempt < 3 {
                    tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                }
            }
        }
    }
    Problem::uncertain(lease_len)
        .with_detail(format!(
            "{detail}; its outcome is being confirmed. Retry later with the same key"
        ))
        .into_response()
}

/// The answer for a worker that lost its lease: never its own result.
async fn stale<DB: LeaseBackend>(op: &'static str, probe: &Probe<DB>, lease: Duration) -> Response {
    metrics::completion(op, "stale_owner");
    tracing::warn!(
        operation = op,
        "idem: stale owner; its result is not published"
    );
    match probe.current().await {
        Ok(Some(stored)) => response::replay(stored),
        Ok(None) => Problem::in_flight(lease).into_response(),
        Err(e) => store_failed(op, None, Step::Stale, &e),
    }
}

/// The answer for a request that did not finish by its deadline: its work was
/// dropped, its transaction rolled back with its connection closed (or, if the
/// deadline struck during the commit, committed: a retry then replays).
fn abandoned(op: &'static str, deadline: tokio::time::Instant) -> Response {
    metrics::completion(op, "deadline");
    tracing::error!(
        operation = op,
        late_ms = deadline.elapsed().as_millis() as u64,
        "idem: request deadline passed; the request was abandoned and its transaction rolled back"
    );
    Problem::store_unavailable()
        .with_detail(
            "the request did not finish within its deadline and was abandoned; \
             retrying with the same key is safe",
        )
        .into_response()
}

fn store_failed(
    op: &'static str,
    tenant: Option<&str>,
    step: Step,
    e: &dyn std::fmt::Display,
) -> Response {
    if step == Step::Claim {
        metrics::claim(op, tenant, "error");
    } else {
        metrics::completion(op, "error");
    }
    tracing::error!(operation = op, step = step.as_str(), error = %e, "idem: store failed; nothing stored");
    Problem::store_unavailable().into_response()
}
