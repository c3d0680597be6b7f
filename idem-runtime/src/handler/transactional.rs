//! The transactional mode: the key is claimed in the handler's own database
//! transaction, after same-process duplicates have queued in the waiting room.

use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};

use super::answers::{Answer, Step, store_failed, taken};
use super::pipeline::{Decision, Mode, ModeOf, Scope, capture, stored_ok};
use super::{BoxedHandler, HandlerOutcome, OperationSpec};
use crate::config::Idem;
use crate::db::Backend;
use crate::db::Tx;
use crate::flight::{Joined, Leader};
use crate::lease::UncertainMarker;
use crate::metrics;
#[cfg(feature = "replay-cache")]
use crate::model::ClaimRequest;
use crate::model::{Claim, Execution, Finish, StoreError};
use crate::problem::Problem;

/// The transactional mode: the key is claimed in the handler's own transaction,
/// and the effect and its record commit together or not at all.
#[derive(Debug, Clone, Copy)]
pub struct Transactional;

impl<DB: Backend> ModeOf<DB> for Tx<DB> {
    type Mode = Transactional;
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
        // The attribute refuses such a retention; a spec written by hand does not.
        crate::model::refuse_under_a_millisecond(req.retention, None)?;
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
                // process; past the in-flight wait, as in the database. Logged so
                // that an operator (and a test holding the first request) can
                // see a burst of retries gathering here.
                tracing::debug!(
                    operation = scope.op(),
                    "idem: duplicate waits for the key's first request"
                );
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
        let mut ctx = idem.claim_context(req.in_flight_wait);
        ctx.ends_at = scope.deadline;
        let (mut tx, claim) = DB::begin_claim(&ctx, &req).await?;
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
                stored: scope.opened(idem.key_ring(), stored)?,
                cached: false,
            }),
            Claim::Mismatch => Decision::Answer(Answer::Mismatch { cached: false }),
            Claim::InFlight { retry_after } => Decision::Answer(Answer::InFlight(retry_after)),
            Claim::Busy { retry_after } => Decision::Answer(Answer::Busy(retry_after)),
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
        let mut outcome = body(&mut tx).await;
        if outcome
            .response
            .extensions()
            .get::<UncertainMarker>()
            .is_some()
        {
            outcome = uncertain_refused(op);
        }
        if outcome.rolls_back() {
            metrics::completion(op, "rolled_back");
            tracing::debug!(
                operation = op,
                status = outcome.response.status().as_u16(),
                "idem: rolled back"
            );
            return rolled_back(idem, scope, &execution, tx, outcome.response).await;
        }
        let (response, stored) = match capture(idem, op, outcome.response).await {
            Ok(r) => r,
            // Not storable (too large, or a body that failed): rolled back,
            // and the key may hold a duplicate's outcome all the same.
            Err(resp) => return rolled_back(idem, scope, &execution, tx, resp).await,
        };
        // Sealed for the row, if a key ring is set; the cache and the metrics
        // keep the clear answer.
        let kept = match crate::at_rest::seal(idem.key_ring(), &execution.row_id(), &stored) {
            Ok(kept) => kept,
            Err(e) => return store_failed(op, None, Step::Complete, &e),
        };
        #[cfg(feature = "replay-cache")]
        let sent = idem
            .replay_cache()
            .map(crate::replay_cache::ReplayCache::sent);
        match DB::finish(
            &idem.claim_context(execution.in_flight_wait),
            tx,
            execution,
            &kept,
        )
        .await
        {
            Finish::Committed =>
            {
                #[cfg(feature = "replay-cache")]
                if let (Some(cache), Some(sent)) = (idem.replay_cache(), sent) {
                    cache.insert(op, &scope.claim_request(idem), &stored, sent);
                }
            }
            // Nothing committed, and a client error reports no effect: it is
            // answered as the handler's `Err` would be, rolled back and not
            // stored (a retry runs the handler again). A success would report
            // an effect that was rolled back: refused below with `503`.
            Finish::NotStored(StoreError::TransactionAborted)
                if response.status().is_client_error() =>
            {
                metrics::completion(op, "rolled_back");
                tracing::info!(
                    operation = op,
                    status = response.status().as_u16(),
                    "idem: a statement of the handler's failed and aborted its transaction; its answer is sent, not stored"
                );
                return response;
            }
            Finish::NotStored(e) => return store_failed(op, None, Step::Complete, &e),
            Finish::Taken(claim) => {
                metrics::completion(op, "rolled_back");
                tracing::debug!(
                    operation = op,
                    "idem: another execution holds the key; rolled back"
                );
                return taken(op, scope, idem.key_ring(), claim);
            }
            Finish::Overtaken(e) => {
                return outcome_unknown(
                    op,
                    &e,
                    "rolled back; the key may hold another execution's outcome, which could not be read",
                );
            }
            // Either way a retry with the same key is safe: it replays or executes.
            Finish::Unknown(e) => {
                return outcome_unknown(op, &e, "commit failed; the outcome is unknown");
            }
        }
        stored_ok(op, &stored, started);
        response
    }
}

/// `503` [`OUTCOME_UNKNOWN`], counted as an error and logged as `what`.
fn outcome_unknown(op: &'static str, e: &StoreError, what: &str) -> Response {
    metrics::completion(op, "error");
    tracing::error!(operation = op, error = %e, "idem: {what}");
    unknown()
}

/// The `503` of [`OUTCOME_UNKNOWN`].
fn unknown() -> Response {
    Problem::store_unavailable()
        .with_detail(OUTCOME_UNKNOWN)
        .into_response()
}

/// The detail of a `503` whose request may have been overtaken by another
/// execution of the key (or committed itself): a retry with the same key
/// learns which.
const OUTCOME_UNKNOWN: &str = "the outcome is unknown; retry with the same key: it is safe";

/// Rolls `tx` back and answers `own` (the handler's answer, or why its answer
/// could not be stored), unless another execution finished the key while this
/// one ran, as a key claimed at commit allows: that outcome is the key's
/// answer, not `own`.
async fn rolled_back<DB: Backend>(
    idem: &Idem<DB>,
    scope: &Scope<'_>,
    execution: &Execution,
    tx: Tx<DB>,
    own: Response,
) -> Response {
    let op = scope.op();
    // Dropping the transaction rolls it back; say so explicitly to free the
    // connection before the response is sent.
    if let Err(e) = tx.rollback().await {
        tracing::warn!(operation = op, error = %e, "idem: rollback failed; the connection is discarded");
    }
    match DB::taken_since(&idem.claim_context(execution.in_flight_wait), execution).await {
        Ok(Some(claim)) => taken(op, scope, idem.key_ring(), claim),
        Ok(None) => own,
        // Another execution may have finished the key (a duplicate on
        // another process, whose committed row this handler's error may be
        // about): its answer is not known, and `own` could contradict it, a
        // declined payment that was made.
        Err(e) => {
            // Counted already, as the rollback it follows.
            tracing::error!(operation = op, error = %e, "idem: could not look the key up after a rollback; the key's outcome is unknown");
            unknown()
        }
    }
}

/// A transactional handler that answered [`crate::Uncertain`] (as `Ok` or
/// `Err`): that answer is a leased handler's, whose effect is elsewhere and may
/// have happened. A transaction's effects commit with the key or not at all, so
/// its `202` would promise a reconciliation that nothing performs (stored), or
/// that the request will not run twice when its rollback freed the key (not
/// stored). Rolled back and answered `500` instead, as gRPC answers `Unknown`;
/// a retry with the same key runs the handler again.
fn uncertain_refused(op: &str) -> HandlerOutcome {
    tracing::error!(
        operation = op,
        "idem: a transactional handler answered `Uncertain`, which only a leased handler can; rolled back, nothing stored"
    );
    HandlerOutcome::err(
        Problem::new(
            "about:blank",
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "Internal Server Error",
        )
        .with_detail(
            "the handler's outcome was uncertain, which its transaction cannot be: it was rolled back and nothing was stored; a retry with the same key runs it again",
        ),
    )
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
