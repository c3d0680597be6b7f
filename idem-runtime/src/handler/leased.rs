//! Leased mode: the claim commits at once and the body runs holding a lease
//! renewed in the background; an outcome that cannot be recorded becomes
//! `uncertain` rather than be repeated by a takeover.

use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use super::answers::{Answer, Step, store_failed};
use super::pipeline::{Decision, Mode, ModeOf, Scope, capture, stored_ok};
use super::{BoxedLeasedHandler, OperationSpec};
use crate::config::Idem;
use crate::lease::{Lease, LeaseBackend, LeaseError, LeasedClaim, Probe, Renewer, UncertainMarker};
use crate::metrics;
use crate::model::{Acquisition, StoreError, StoredResponse};
use crate::operations::Address;
use crate::problem::Problem;
use crate::response;
use crate::running::Slot;

/// Leased mode: the claim commits at once, and the handler runs holding a lease
/// renewed in the background; every later write is fenced by the owner token.
#[derive(Debug, Clone, Copy)]
pub struct Leased;

/// A lease's acquisition, its generation recorded in the request's span before
/// the handler runs.
fn recorded_acquisition<DB: LeaseBackend>(lease: &Lease<DB>) -> Acquisition {
    tracing::Span::current().record("idem.generation", lease.generation());
    lease.acquisition()
}

/// What leased mode keeps of an execution besides the lease: its renewal and
/// the way to read the current outcome once the lease is gone.
#[doc(hidden)]
pub struct LeaseHeld<DB: LeaseBackend> {
    renewer: Renewer<DB>,
    probe: Probe<DB>,
    /// The execution's slot of its operation's running limit, if it has one:
    /// held until the work ends, however it ends, or its lease is lost.
    slot: Option<Slot>,
}

impl<DB: LeaseBackend> ModeOf<DB> for Lease<DB> {
    type Mode = Leased;
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
        let claimed = crate::lease::claim_in::<DB>(
            idem.lease_store(),
            &scope.lease_request(),
            idem.key_ring(),
        )
        .await?;
        Ok(match claimed {
            LeasedClaim::Acquired(lease) => {
                let slot = match idem.running_slots(scope.spec.operation) {
                    None => None,
                    Some(slots) => match slots.take(scope.spec.operation, scope.tenant) {
                        Some(slot) => Some(slot),
                        None => {
                            let wait = slots.limit().wait().unwrap_or(scope.lease_len());
                            give_back(scope.op(), lease).await;
                            return Ok(Decision::Answer(Answer::AtCapacity(wait)));
                        }
                    },
                };
                Decision::Execute {
                    how: match recorded_acquisition(&lease) {
                        Acquisition::New => "executed",
                        Acquisition::Reclaimed => "reclaimed",
                        Acquisition::TakenOver => "taken_over",
                    },
                    held: LeaseHeld {
                        renewer: lease.renewer(),
                        probe: lease.probe(),
                        slot,
                    },
                    handle: lease,
                }
            }
            LeasedClaim::Replay(stored) => Decision::Answer(Answer::Replay {
                stored,
                cached: false,
            }),
            LeasedClaim::Mismatch => Decision::Answer(Answer::Mismatch { cached: false }),
            // A long operation's retry while the work runs gets the first
            // request's `202` again, not `409`.
            LeasedClaim::InFlight { .. } if scope.spec.accepted => {
                Decision::Answer(Answer::Running(address(idem, scope)))
            }
            // A contended claim read nothing of the key, not even whether this
            // request is its first one: a long operation's too is told to
            // retry, never given that operation's `202`.
            LeasedClaim::InFlight { retry_after } | LeasedClaim::Contended { retry_after } => {
                Decision::Answer(Answer::InFlight(retry_after))
            }
            LeasedClaim::Busy { retry_after } => Decision::Answer(Answer::Busy(retry_after)),
            LeasedClaim::Uncertain => Decision::Answer(Answer::Uncertain(
                scope.lease_len(),
                scope.spec.accepted.then(|| address(idem, scope)),
            )),
        })
    }

    async fn execute(
        idem: &Idem<DB>,
        scope: &Scope<'_>,
        held: LeaseHeld<DB>,
        lease: Lease<DB>,
        body: BoxedLeasedHandler<DB>,
        started: Instant,
    ) -> Response {
        let work = Work {
            held,
            lease,
            body,
            started,
        };
        if scope.spec.accepted {
            return accept(idem, scope, work);
        }
        settle(idem, scope, work).await
    }
}

/// An execution that holds its key: what the handler runs with and what
/// settling its outcome needs.
struct Work<DB: LeaseBackend> {
    held: LeaseHeld<DB>,
    lease: Lease<DB>,
    body: BoxedLeasedHandler<DB>,
    started: Instant,
}

/// Gives back a key acquired for an execution that its running limit has no
/// slot for, so that nothing stays reserved (see [`let_go`]).
async fn give_back<DB: LeaseBackend>(op: &'static str, lease: Lease<DB>) {
    if let Err(e) = let_go(lease, false).await {
        // Nothing ran: the key frees itself when the lease lapses.
        tracing::warn!(operation = op, error = %e, "idem: could not give back a key refused for the running limit; it frees itself after its lease");
    }
}

/// Ends an execution that failed: a new or re-claimed key is released (free
/// for the retry, as new). Not where an effect may have happened: the
/// execution's own (`effect_unknown`: its answer says a downstream call timed
/// out), or an earlier execution's (the key was taken over from a lapsed
/// lease). A released key would tell the next execution it is new, so the
/// lease lapses now instead, and the retry takes it over at once, told so.
async fn let_go<DB: LeaseBackend>(
    lease: Lease<DB>,
    effect_unknown: bool,
) -> Result<(), LeaseError> {
    match lease.acquisition() {
        Acquisition::TakenOver => lease.lapse().await,
        _ if effect_unknown => lease.lapse().await,
        Acquisition::New | Acquisition::Reclaimed => lease.release().await,
    }
}

/// The resource of the scope's operation.
fn address<DB: LeaseBackend>(idem: &Idem<DB>, scope: &Scope<'_>) -> Address {
    Address::new(idem.operations_path(), scope.spec, &scope.key.digest())
}

/// A long operation: its work goes on, under its lease, on a task of its own,
/// and the request is answered `202` with the operation's resource at once.
///
/// The work is counted among the executions (a graceful shutdown waits for
/// it). If it dies (a panic, the process), its lease lapses and the next
/// request with the key takes it over, at the same address.
fn accept<DB: LeaseBackend>(idem: &Idem<DB>, scope: &Scope<'_>, work: Work<DB>) -> Response {
    let answer = address(idem, scope).accepted();
    let op = scope.op();
    let owned = scope.owned();
    let idem = idem.clone();
    let running = idem.executions().start();
    // A span of its own, not the request's: a span holds its parent open, so
    // work that outlives the `202` inside the request's span would keep the
    // request (a `TraceLayer`'s span, an exported trace) open for as long as
    // the operation runs, and never export it if the process dies first. It
    // follows from the request's, so a trace can still be walked from one to
    // the other.
    let span = tracing::info_span!(
        parent: None,
        "idem.long_operation",
        idem.operation = op,
        idem.mode = "leased",
        idem.generation = work.lease.generation(),
        http.response.status_code = tracing::field::Empty,
    );
    span.follows_from(tracing::Span::current());
    let task = async move {
        let scope = owned.scope();
        settle(&idem, &scope, work).await
    }
    .instrument(span.clone());
    tokio::spawn(
        async move {
            let _running = running;
            // A task of its own, so that a panic is seen (and logged) here.
            match tokio::spawn(task).await {
                Ok(resp) => {
                    // The answer the work settled on (stored for the
                    // retries, or what its failure would have told a client).
                    tracing::Span::current()
                        .record("http.response.status_code", resp.status().as_u16());
                    tracing::debug!(
                        operation = op,
                        status = resp.status().as_u16(),
                        "idem: long operation settled"
                    );
                }
                Err(e) => {
                    metrics::completion(op, "panicked");
                    tracing::error!(operation = op, error = %e, "idem: a long operation's task failed; the next request with its key takes it over after its lease");
                }
            }
        }
        .instrument(span),
    );
    answer
}

/// Runs the handler under its lease, renewed in the background, and settles
/// its outcome: stores it, marks it uncertain, or lets the key go (see
/// [`let_go`]); the answer
/// for the request (or, for a long operation, for the log).
async fn settle<DB: LeaseBackend>(idem: &Idem<DB>, scope: &Scope<'_>, work: Work<DB>) -> Response {
    let Work {
        held,
        mut lease,
        body,
        started,
    } = work;
    let op = scope.op();
    let lease_len = scope.lease_len();
    let ceiling = scope
        .spec
        .lease_ceiling
        .unwrap_or(lease_len.saturating_mul(10));
    let LeaseHeld {
        renewer,
        probe,
        slot,
    } = held;
    // Renewed (and its running slot held) until the response is in hand: a
    // body the handler streams is read below, and a lease that lapsed while
    // it was would let another worker take over and call downstream again.
    // Registered before the handler is first polled, so that it is in every
    // batch whatever the handler does then.
    let registered = idem.renewals().register(renewer, ceiling);
    // The task that sends the batches may now wait in this worker's LIFO
    // slot, which no other worker steals: it runs before a handler that
    // blocks this thread could keep it from running.
    tokio::task::yield_now().await;
    // Boxed rather than pinned in place, so that it can be dropped (renewals
    // stop, the slot is freed) as soon as the response is in hand.
    let mut renewing = Box::pin(registered.hold(slot));
    let outcome = {
        let mut work = body(&mut lease);
        tokio::select! {
            never = &mut renewing => match never {},
            outcome = &mut work => outcome,
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
        // Renewals end before the lease is settled: one racing the mark would
        // find the row no longer this worker's and log a takeover.
        drop(renewing);
        // Tried as hard as an unrecorded effect's mark: a row left `processing`
        // is taken over after its lease, and downstream called again.
        return match mark_uncertain(op, &lease).await {
            Ok(()) => {
                metrics::completion(op, "uncertain");
                tracing::warn!(
                    operation = op,
                    "idem: outcome uncertain; awaiting reconciliation"
                );
                // `Uncertain` cannot know the lease; its retries are told the
                // lease's length, and so is this first answer.
                let mut response = outcome.response;
                response.headers_mut().insert(
                    axum::http::header::RETRY_AFTER,
                    idem_wire::retry_after_seconds(lease_len).into(),
                );
                response
            }
            Err(LeaseError::StaleOwner { .. }) => stale(op, &probe, lease_len).await,
            Err(LeaseError::Store(_)) => {
                // The effect may have happened: never answer "nothing was stored".
                metrics::completion(op, "error");
                tracing::error!(
                    operation = op,
                    "idem: could not mark the outcome uncertain; the row stays processing and is taken over after its lease"
                );
                outcome.response
            }
        };
    }
    if outcome.rolls_back() {
        drop(renewing);
        if outcome.effect_unknown() {
            tracing::warn!(
                operation = op,
                status = outcome.response.status().as_u16(),
                "idem: the handler's answer leaves its downstream effect unknown; its lease lapses and the retry takes the key over"
            );
        }
        return match let_go(lease, outcome.effect_unknown()).await {
            Ok(()) => {
                metrics::completion(op, "rolled_back");
                outcome.response
            }
            Err(LeaseError::StaleOwner { .. }) => stale(op, &probe, lease_len).await,
            // The key frees itself, or is taken over, when the lease lapses.
            Err(LeaseError::Store(e)) => store_failed(op, None, Step::Release, &e),
        };
    }
    let captured = tokio::select! {
        captured = capture(idem, op, outcome.response) => captured,
        never = &mut renewing => match never {},
    };
    drop(renewing);
    let (response, stored) = match captured {
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
                None,
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
                    Some(Sent {
                        stored: &stored,
                        response,
                        started,
                    }),
                )
                .await;
            }
            Err(LeaseError::StaleOwner { .. }) => return stale(op, &probe, lease_len).await,
        }
    }
}

/// An outcome whose stores all failed: what was sent, and the answer that goes
/// with it.
struct Sent<'a> {
    stored: &'a StoredResponse,
    response: Response,
    started: Instant,
}

/// The answer after an effect whose outcome could not be stored: the row is
/// marked `uncertain` for reconciliation (never released: a retry would repeat
/// the effect), and the client is told what its retries will be told, `202`, not
/// that nothing happened. If even marking fails, the row stays `processing` and a
/// retry takes it over after the lease, calling downstream with the same
/// downstream key.
///
/// `sent` is the outcome whose stores failed (`None`: it could not be
/// captured, and that completion is counted already). A store that failed may
/// still have committed, its answer lost, with the retries after it failing
/// on their own: the mark then finds the row finished, not this execution's
/// to mark, as it would for a stale owner. The store sent once more tells the
/// two apart (it matches only the row finished under this execution's token),
/// and where it matches, the answer is the handler's own, stored, not a replay.
async fn effect_unrecorded<DB: LeaseBackend>(
    op: &'static str,
    lease: &Lease<DB>,
    probe: &Probe<DB>,
    lease_len: Duration,
    detail: &str,
    sent: Option<Sent<'_>>,
) -> Response {
    match mark_uncertain(op, lease).await {
        Ok(()) if sent.is_some() => metrics::completion(op, "uncertain"),
        Ok(()) | Err(LeaseError::Store(_)) => {}
        Err(LeaseError::StaleOwner { .. }) => {
            if let Some(sent) = sent {
                match lease.store_outcome(sent.stored).await {
                    Ok(()) => {
                        tracing::warn!(
                            operation = op,
                            "idem: a store reported as failed had stored the outcome (its answer was lost)"
                        );
                        stored_ok(op, sent.stored, sent.started);
                        return sent.response;
                    }
                    Err(LeaseError::StaleOwner { .. }) => {}
                    // Not told apart: the row may be this execution's own,
                    // finished; what is stored there is answered, as a stale
                    // owner's.
                    Err(LeaseError::Store(e)) => tracing::warn!(
                        operation = op,
                        error = %e,
                        "idem: the store sent again, to tell this execution's finished row from a takeover, failed"
                    ),
                }
            }
            return stale(op, probe, lease_len).await;
        }
    }
    Problem::uncertain(lease_len)
        .with_detail(format!(
            "{detail}; its outcome is being confirmed. Retry later with the same key"
        ))
        .into_response()
}

/// Marks the row `uncertain`, three attempts 100 and 200 ms apart: the last
/// store error (each is logged), or the lease lost.
async fn mark_uncertain<DB: LeaseBackend>(
    op: &'static str,
    lease: &Lease<DB>,
) -> Result<(), LeaseError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match lease.record_uncertain().await {
            Err(LeaseError::Store(e)) => {
                tracing::error!(operation = op, attempt, error = %e, "idem: marking the outcome uncertain failed");
                if attempt == 3 {
                    return Err(LeaseError::Store(e));
                }
                tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
            }
            done => return done,
        }
    }
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
