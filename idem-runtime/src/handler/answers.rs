//! The answers a request gets without its handler's response: the outcome of
//! a claim that runs nothing (replay, mismatch, in flight, uncertain), and the
//! failures of a store step or of the request's deadline.

use std::time::Duration;

use axum::response::{IntoResponse, Response};

use super::pipeline::Scope;
use crate::at_rest::KeyRing;
use crate::metrics;
use crate::model::{Claim, StoreError, StoredResponse};
use crate::operations::Address;
use crate::problem::Problem;
use crate::response;

/// The answers that need no execution.
pub enum Answer {
    /// The stored outcome; `cached` when the replay cache answered.
    Replay {
        stored: StoredResponse,
        cached: bool,
    },
    /// The key holds another request; `cached` as for a replay.
    Mismatch { cached: bool },
    /// Another execution of the key is running.
    InFlight(Duration),
    /// The database was locked by writers of other keys past the wait.
    Busy(Duration),
    /// The operation's running limit had no slot; nothing was reserved.
    AtCapacity(Duration),
    /// An earlier execution's effect is unknown (leased mode); a long
    /// operation's answer says where its resource is.
    Uncertain(Duration, Option<Address>),
    /// A long operation's execution of the key is running: its `202`.
    Running(Address),
}

impl Answer {
    pub(super) fn cached(&self) -> bool {
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
            // A long operation's retry is its `202`, never a `409`: counted
            // apart so that the in-flight ratio (and its alert) is `409`s.
            Answer::Running(_) => "running",
            Answer::Busy(_) => "busy",
            Answer::AtCapacity(_) => "at_capacity",
            Answer::Uncertain(..) => "uncertain",
        }
    }

    /// The claim's answer, counted as the claim's outcome.
    pub(super) fn respond(self, op: &'static str, tenant_label: Option<&str>) -> Response {
        metrics::claim(op, tenant_label, self.outcome());
        self.send(op)
    }

    /// The answer, its outcome on the request's span. Not counted: a claim
    /// counts once, and one that executed and then found its key taken was
    /// counted `executed`, its completion `rolled_back` ([`taken`]).
    fn send(self, op: &'static str) -> Response {
        let outcome = self.outcome();
        let span = tracing::Span::current();
        span.record("idem.outcome", outcome);
        span.record("idem.replayed", matches!(self, Answer::Replay { .. }));
        match self {
            Answer::Replay { stored, cached } => {
                tracing::debug!(
                    operation = op,
                    status = stored.status,
                    cached,
                    "idem: replay"
                );
                response::replay(stored)
            }
            Answer::Mismatch { cached } => {
                tracing::info!(operation = op, cached, "idem: fingerprint mismatch");
                Problem::mismatch().into_response()
            }
            Answer::InFlight(retry_after) => {
                tracing::info!(operation = op, "idem: in flight");
                Problem::in_flight(retry_after).into_response()
            }
            Answer::Busy(retry_after) => {
                tracing::warn!(
                    operation = op,
                    "idem: the database stayed locked by other writers; nothing reserved"
                );
                Problem::busy(retry_after).into_response()
            }
            Answer::AtCapacity(retry_after) => {
                tracing::warn!(
                    operation = op,
                    "idem: the operation's running limit is full; nothing reserved"
                );
                Problem::at_capacity(retry_after).into_response()
            }
            Answer::Uncertain(retry_after, address) => {
                tracing::info!(
                    operation = op,
                    "idem: outcome uncertain; not executed again"
                );
                let mut resp = Problem::uncertain(retry_after).into_response();
                if let Some(address) = address {
                    address.locate(&mut resp);
                }
                resp
            }
            Answer::Running(address) => {
                tracing::info!(operation = op, "idem: long operation running");
                address.accepted()
            }
        }
    }
}

/// The store step that failed, for the metric and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Claiming the key: nothing ran.
    Claim,
    /// Storing the outcome (and committing): rolled back.
    Complete,
    /// Releasing a leased key after a failure (or, where the execution took
    /// the key over, lapsing its lease): this execution's effect did not
    /// happen.
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

/// The answer of a request whose execution rolled back because another
/// execution holds its key.
pub(super) fn taken(
    op: &'static str,
    scope: &Scope<'_>,
    ring: Option<&KeyRing>,
    claim: Claim,
) -> Response {
    let answer = match claim {
        Claim::Replay(stored) => match scope.opened(ring, stored) {
            Ok(stored) => Answer::Replay {
                stored,
                cached: false,
            },
            // Counted already (its claim executed, its completion rolled
            // back): only answered.
            Err(e) => return failed_response(op, Step::Claim, &e),
        },
        Claim::Mismatch => Answer::Mismatch { cached: false },
        Claim::InFlight { retry_after } => Answer::InFlight(retry_after),
        Claim::Busy { retry_after } => Answer::Busy(retry_after),
        // Never decided after an execution (`decide::after_execution`).
        Claim::Execute(_) => Answer::InFlight(Duration::from_secs(1)),
    };
    answer.send(op)
}

/// The answer for a request that did not finish by its deadline: its work was
/// dropped, its transaction rolled back with its connection closed (or, if its
/// `COMMIT` had been sent, committed: a retry then replays). On PostgreSQL's
/// session path the finished row travels in the `COMMIT`'s message, so a
/// deadline that struck while that row waited for another holder of the key
/// counts too.
pub(super) fn abandoned(
    op: &'static str,
    tenant: Option<&str>,
    claimed: bool,
    deadline: tokio::time::Instant,
) -> Response {
    // Struck before the claim was decided, it is the claim's one outcome: no
    // execution began, and none completes.
    if claimed {
        metrics::completion(op, "deadline");
    } else {
        metrics::claim(op, tenant, "deadline");
    }
    tracing::error!(
        operation = op,
        late_ms = deadline.elapsed().as_millis() as u64,
        "idem: request deadline passed; the request was abandoned (its transaction rolls back, unless its COMMIT had been sent: then it may still commit, and a retry replays it)"
    );
    Problem::store_unavailable()
        .with_detail(
            "the request did not finish within its deadline and was abandoned; \
             retrying with the same key is safe",
        )
        .into_response()
}

pub(super) fn store_failed(
    op: &'static str,
    tenant: Option<&str>,
    step: Step,
    e: &StoreError,
) -> Response {
    if step == Step::Claim {
        metrics::claim(op, tenant, "error");
    } else {
        metrics::completion(op, "error");
    }
    failed_response(op, step, e)
}

/// [`store_failed`]'s log line and answer, without its count.
fn failed_response(op: &'static str, step: Step, e: &StoreError) -> Response {
    // Where the key holds an outcome that cannot be read (a stored answer
    // sealed with a key the ring lacks, or changed), or a stale worker's
    // effect ran under a lease another took over, "nothing was stored" would
    // be false. (A seal that fails while storing is a rollback: nothing was.)
    let unread = step == Step::Stale
        || (step == Step::Claim
            && matches!(
                e,
                StoreError::SealKeyMissing { .. }
                    | StoreError::SealBroken
                    // A claim's `Corrupt` is about the key's row: it is
                    // there. (A column that does not decode may be a schema
                    // out of date for every key, rows or not.)
                    | StoreError::Corrupt(_)
            ));
    if unread {
        tracing::error!(operation = op, step = step.as_str(), error = %e, "idem: the key's outcome could not be read");
        return Problem::outcome_unreadable().into_response();
    }
    tracing::error!(operation = op, step = step.as_str(), error = %e, "idem: store failed; nothing stored");
    Problem::store_unavailable().into_response()
}
