//! Running an HTTP handler under the promise: claim, execute, store, commit, answer.
//!
//! This is what `#[idempotent]` expands to a call of, and it can be used by hand
//! (see [`run`]).

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::extract::{FromRef, FromRequestParts, MatchedPath};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::config::Idem;
use crate::fingerprint::{Fingerprint, FingerprintBuilder, FingerprintError};
use crate::key::IdempotencyKey;
use crate::lease::{Acquisition, Lease, LeaseBackend, LeaseError, LeaseRequest, LeasedClaim};
use crate::metrics;
use crate::problem::{self, Problem};
use crate::response::{self, CaptureError};
use crate::store::{Backend, Claim, ClaimRequest, Finish, StoredResponse};
use crate::tenant::TenantError;
use crate::tx::Tx;
use sqlx::Postgres;

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
/// the matched route and the headers, plus the [`Idem`] from the router state.
///
/// As an extractor it refuses a request without a usable key with `400`
/// `application/problem+json` before anything is reserved.
pub struct IdemRequest<DB: Backend = Postgres> {
    idem: Idem<DB>,
    key: IdempotencyKey,
    method: Method,
    route: String,
    path: String,
    query: Option<String>,
    headers: HeaderMap,
}

/// Redacted: the headers hold credentials and the key, so only names are shown.
impl<DB: Backend> std::fmt::Debug for IdemRequest<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemRequest")
            .field("key", &self.key)
            .field("method", &self.method)
            .field("route", &self.route)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> IdemRequest<DB> {
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

impl<S, DB> FromRequestParts<S> for IdemRequest<DB>
where
    DB: Backend,
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
pub type BoxedHandler<DB = Postgres> = Box<
    dyn for<'t> FnOnce(&'t mut Tx<DB>) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 't>>
        + Send,
>;

/// A handler body that runs holding a lease (leased mode).
pub type BoxedLeasedHandler<DB = Postgres> = Box<
    dyn for<'l> FnOnce(
            &'l mut Lease<DB>,
        ) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 'l>>
        + Send,
>;

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

/// Runs `handler` at most once for the request's tenant, operation and key, in
/// the transactional mode.
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
///
/// The work runs on its own task, so a client that disconnects does not cancel it
/// half-way: the outcome is still committed and the client's retry replays it.
pub async fn run<DB: Backend>(
    req: IdemRequest<DB>,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    handler: BoxedHandler<DB>,
) -> Response {
    let (tenant, fingerprint) = match prepare(spec, tenant, fingerprint) {
        Ok(p) => p,
        Err(resp) => return resp,
    };
    detached(
        spec.operation,
        Box::pin(async move {
            let claim = ClaimRequest {
                tenant: &tenant,
                operation: spec.operation,
                key: &req.key,
                fingerprint,
                retention: spec.retention,
                in_flight_wait: spec.in_flight_wait.unwrap_or(req.idem.in_flight_wait()),
            };
            execute(&req.idem, spec.operation, &claim, handler).await
        }),
    )
    .await
}

async fn execute<DB: Backend>(
    idem: &Idem<DB>,
    op: &'static str,
    req: &ClaimRequest<'_>,
    handler: BoxedHandler<DB>,
) -> Response {
    let tenant_label = idem.tenant_label().then_some(req.tenant);
    let started = Instant::now();
    #[cfg(feature = "replay-cache")]
    if let Some(cache) = idem.replay_cache() {
        match cache.get(op, req) {
            Some(crate::replay_cache::Cached::Replay(stored)) => {
                metrics::claim(op, tenant_label, "replayed");
                tracing::debug!(
                    operation = op,
                    status = stored.status,
                    "idem: replay (cached)"
                );
                return response::replay(stored);
            }
            Some(crate::replay_cache::Cached::Mismatch) => {
                metrics::claim(op, tenant_label, "mismatched");
                tracing::info!(operation = op, "idem: fingerprint mismatch (cached)");
                return Problem::mismatch().into_response();
            }
            None => {}
        }
    }
    let (mut tx, claim) = match DB::begin_claim(idem, req).await {
        Ok(c) => c,
        Err(e) => return store_failed(op, tenant_label, "claim", &e),
    };
    metrics::seconds(metrics::CLAIM_SECONDS, op, started.elapsed().as_secs_f64());
    let execution = match claim {
        Claim::Execute(execution) => execution,
        Claim::Replay(stored) => {
            metrics::claim(op, tenant_label, "replayed");
            tracing::debug!(operation = op, status = stored.status, "idem: replay");
            return response::replay(stored);
        }
        Claim::Mismatch => {
            metrics::claim(op, tenant_label, "mismatched");
            tracing::info!(operation = op, "idem: fingerprint mismatch");
            return Problem::mismatch().into_response();
        }
        Claim::InFlight { retry_after } => {
            metrics::claim(op, tenant_label, "in_flight");
            tracing::info!(operation = op, "idem: in flight");
            return Problem::in_flight(retry_after).into_response();
        }
    };
    let reclaimed = execution.generation() > 1;
    metrics::claim(
        op,
        tenant_label,
        if reclaimed { "reclaimed" } else { "executed" },
    );
    tracing::debug!(
        operation = op,
        generation = execution.generation(),
        "idem: execute"
    );

    let outcome = handler(&mut tx).await;
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
                cache.insert(op, req, &stored, sent);
            }
        }
        Finish::NotStored(e) => return store_failed(op, None, "complete", &e),
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

/// Buffers and extracts the stored form of a response, or answers why it cannot.
async fn capture<DB: Backend>(
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

/// Runs `handler` at most once in leased mode: the claim commits on its own, the
/// handler runs holding a [`Lease`] that is renewed in the background while it
/// runs (up to the spec's ceiling), and the outcome is stored only if this worker
/// still owns the execution.
///
/// * An `Err` or a 5xx releases the key (the effect is taken not to have
///   happened); a response built from [`crate::lease::Uncertain`] marks the row
///   `uncertain`; anything else is stored and sent.
/// * A worker whose lease was taken over publishes nothing: its client gets the
///   current owner's stored outcome if there is one, else `409`.
/// * Retries of an uncertain key get `202` with the problem type
///   [`problem::OUTCOME_UNCERTAIN`] until a reconciler resolves it.
pub async fn run_leased<DB: LeaseBackend>(
    req: IdemRequest<DB>,
    spec: &'static OperationSpec,
    tenant: Result<String, TenantError>,
    fingerprint: Result<FingerprintBuilder, FingerprintError>,
    handler: BoxedLeasedHandler<DB>,
) -> Response {
    let (tenant, fingerprint) = match prepare(spec, tenant, fingerprint) {
        Ok(p) => p,
        Err(resp) => return resp,
    };
    detached(
        spec.operation,
        Box::pin(async move {
            let lease_len = spec.lease.unwrap_or(Duration::from_secs(30));
            let claim = LeaseRequest {
                tenant: &tenant,
                operation: spec.operation,
                key: &req.key,
                fingerprint,
                retention: spec.retention,
                lease: lease_len,
            };
            let ceiling = spec.lease_ceiling.unwrap_or(lease_len * 10);
            execute_leased(&req.idem, spec.operation, &claim, ceiling, handler).await
        }),
    )
    .await
}

async fn execute_leased<DB: LeaseBackend>(
    idem: &Idem<DB>,
    op: &'static str,
    req: &LeaseRequest<'_>,
    ceiling: Duration,
    handler: BoxedLeasedHandler<DB>,
) -> Response {
    let tenant_label = idem.tenant_label().then_some(req.tenant);
    let started = Instant::now();
    let claim = match crate::lease::claim_leased(idem.pool(), req).await {
        Ok(c) => c,
        Err(e) => return store_failed(op, tenant_label, "claim", &e),
    };
    metrics::seconds(metrics::CLAIM_SECONDS, op, started.elapsed().as_secs_f64());
    let mut lease = match claim {
        LeasedClaim::Acquired(lease) => lease,
        LeasedClaim::Replay(stored) => {
            metrics::claim(op, tenant_label, "replayed");
            return response::replay(stored);
        }
        LeasedClaim::Mismatch => {
            metrics::claim(op, tenant_label, "mismatched");
            return Problem::mismatch().into_response();
        }
        LeasedClaim::InFlight { retry_after } => {
            metrics::claim(op, tenant_label, "in_flight");
            return Problem::in_flight(retry_after).into_response();
        }
        LeasedClaim::Uncertain => {
            metrics::claim(op, tenant_label, "uncertain");
            return Problem::uncertain(req.lease).into_response();
        }
    };
    let kind = match lease.acquisition() {
        Acquisition::New => "executed",
        Acquisition::Reclaimed => "reclaimed",
        Acquisition::TakenOver => "taken_over",
    };
    metrics::claim(op, tenant_label, kind);
    tracing::debug!(
        operation = op,
        generation = lease.generation(),
        how = kind,
        "idem: leased execution"
    );

    let renewer = lease.renewer();
    let probe = lease.probe();
    let outcome = {
        let mut work = handler(&mut lease);
        tokio::select! {
            outcome = &mut work => outcome,
            never = renewer.run(ceiling) => match never {},
        }
    };
    // A lease believed lost (no renewal got through for a whole lease, or the
    // ceiling passed) may still be this worker's: every statement below is fenced
    // by the owner token, so a worker that really lost it writes nothing and
    // answers as a stale owner, while one that did not publishes its result rather
    // than leave it to a takeover that would call downstream again.
    if outcome
        .response
        .extensions()
        .get::<crate::lease::UncertainMarker>()
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
            Err(LeaseError::StaleOwner { .. }) => stale(op, &probe, req.lease).await,
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
            Err(LeaseError::StaleOwner { .. }) => stale(op, &probe, req.lease).await,
            // The effect did not happen; the key frees itself when the lease lapses.
            Err(LeaseError::Store(e)) => store_failed(op, None, "release", &e),
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
                req.lease,
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
                    req.lease,
                    "the operation ran but its outcome could not be recorded",
                    true,
                )
                .await;
            }
            Err(LeaseError::StaleOwner { .. }) => return stale(op, &probe, req.lease).await,
        }
    }
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
    probe: &crate::lease::Probe<DB>,
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
async fn stale<DB: LeaseBackend>(
    op: &'static str,
    probe: &crate::lease::Probe<DB>,
    lease: Duration,
) -> Response {
    metrics::completion(op, "stale_owner");
    tracing::warn!(
        operation = op,
        "idem: stale owner; its result is not published"
    );
    match probe.current().await {
        Ok(Some(stored)) => response::replay(stored),
        Ok(None) => Problem::in_flight(lease).into_response(),
        Err(e) => store_failed(op, None, "stale", &e),
    }
}

fn store_failed(
    op: &'static str,
    tenant: Option<&str>,
    step: &str,
    e: &dyn std::fmt::Display,
) -> Response {
    if step == "claim" {
        metrics::claim(op, tenant, "error");
    } else {
        metrics::completion(op, "error");
    }
    tracing::error!(operation = op, step, error = %e, "idem: store failed; nothing stored");
    Problem::store_unavailable().into_response()
}
