//! The process's lease renewals, batched: every leased execution an `Idem` (and
//! its clones) runs is renewed by one task per store, a statement (or a Redis
//! pipeline) for all the leases that are due together, instead of a statement
//! per lease every third of its length.
//!
//! Each lease keeps its own schedule and its own [`Deadline`]: it is due a third
//! of its length after its last renewal was sent, and the task wakes at the
//! earliest due lease, not at a shared tick, so a lease never waits for others.
//! What wakes the task renews every lease due within a third of its period from
//! then too (a lease renewed a little early loses nothing), so leases started
//! close together settle into one batch and stay there. A batch is bounded by
//! the time its leases have left and runs on a task of its own, so a hanging
//! statement holds up only its own batch; a row another transaction holds is
//! skipped by the statement, not waited for, and renewed again soon; a lease
//! whose row was skipped (held: a storm of duplicate claims of its key keeps it
//! nearly always held) is renewed next on its own, waiting for the row's lock
//! for at most half the time it has left (a few such renewals at once per
//! store), so that it cannot lapse under a live worker for never being waited
//! for. Each lease
//! learns from the batch's reply whether it was renewed (its deadline moves to
//! the batch's send time plus its length) or taken over (lost at once).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::LeaseBackend;
use super::renewal::{Deadline, Renewer};
use crate::key::KeyDigest;
use crate::model::{Owned, OwnerToken, Renewal, Renewed};
use crate::running::Slot;

/// The most leases one statement renews; a larger batch is sent as several.
const MAX_BATCH: usize = 2000;

/// The renewals of one store, shared by an `Idem` and its clones.
pub(crate) struct Renewals<DB: LeaseBackend> {
    inner: Arc<Inner<DB>>,
}

impl<DB: LeaseBackend> Clone for Renewals<DB> {
    fn clone(&self) -> Self {
        Renewals {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<DB: LeaseBackend> {
    store: DB::Store,
    state: Mutex<State>,
    wake: Notify,
    /// Batch statements sent since the start (for tests and the bench).
    statements: AtomicU64,
    /// Lease renewals those statements carried.
    renewals: AtomicU64,
}

#[derive(Default)]
struct State {
    next_id: u64,
    leases: HashMap<u64, Entry>,
    /// Whether the task that sends the batches runs.
    running: bool,
    /// When that task wakes next by itself (`None`: only when woken). A lease
    /// added wakes it only when due sooner: each wake scans every lease, and
    /// thousands of long operations beside a stream of short executions
    /// would otherwise cost a scan of them all for each short one.
    wake_at: Option<Instant>,
    /// Renewals sent alone, waiting for their rows, not answered yet (at most
    /// [`MAX_WAITING`]).
    waiting: usize,
}

struct Entry {
    tenant: String,
    operation: String,
    key: KeyDigest,
    token: OwnerToken,
    lease: Duration,
    every: Duration,
    deadline: Arc<Deadline>,
    due: Instant,
    /// No renewal is sent past this (the lease renewal ceiling).
    ceiling: Instant,
    /// In a batch being sent.
    sending: bool,
    /// Its last renewal answered and found its row held by another
    /// transaction (skipped, not renewed): the next one waits for it.
    held: bool,
}

impl<DB: LeaseBackend> Renewals<DB> {
    pub(crate) fn new(store: DB::Store) -> Self {
        Renewals {
            inner: Arc::new(Inner {
                store,
                state: Mutex::default(),
                wake: Notify::new(),
                statements: AtomicU64::new(0),
                renewals: AtomicU64::new(0),
            }),
        }
    }

    /// Batch statements sent so far, and the lease renewals they carried.
    pub(crate) fn sent(&self) -> (u64, u64) {
        (
            self.inner.statements.load(Ordering::Relaxed),
            self.inner.renewals.load(Ordering::Relaxed),
        )
    }

    /// How many leases are registered for renewal now.
    pub(crate) fn registered(&self) -> usize {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .leases
            .len()
    }

    /// Puts `renewer`'s lease among those renewed, until `ceiling` has passed or
    /// the lease is lost, or the returned [`Registered`] is dropped.
    ///
    /// Starting or waking the task that sends the batches puts it in this
    /// worker's LIFO slot, which tokio's other workers do not steal: the
    /// caller yields once before it polls a handler, so that a handler that
    /// blocks its thread (a blocking client called without `spawn_blocking`)
    /// cannot keep its own lease from being renewed.
    pub(crate) fn register(&self, renewer: Renewer<DB>, ceiling: Duration) -> Registered<DB> {
        let now = Instant::now();
        let deadline = renewer.deadline.clone();
        let every = (renewer.lease / 3).clamp(Duration::from_millis(10), FARTHEST);
        let due = now + next_in(every, &renewer.deadline);
        let entry = Entry {
            tenant: renewer.tenant,
            operation: renewer.operation,
            key: renewer.key,
            token: renewer.token,
            lease: renewer.lease,
            every,
            deadline: renewer.deadline,
            due,
            ceiling: now + ceiling.min(FARTHEST),
            sending: false,
            held: false,
        };
        let (id, wake) = {
            let mut state = self.lock();
            let id = state.next_id;
            state.next_id += 1;
            state.leases.insert(id, entry);
            (id, wake_for(&mut state, due))
        };
        match wake {
            Wake::Start => {
                tokio::spawn(schedule(Stopped(Some(self.inner.clone()))));
            }
            Wake::Sooner => self.inner.wake.notify_one(),
            Wake::No => {}
        }
        Registered {
            inner: self.inner.clone(),
            id,
            deadline,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a lease added asks of the task that sends the batches.
enum Wake {
    /// It is not running: start it.
    Start,
    /// It sleeps past the new lease's due time.
    Sooner,
    /// It wakes in time by itself.
    No,
}

/// What a lease due at `due`, just added, asks of the task that sends the
/// batches; marks it running, and its wake as planned for `due` when sooner.
fn wake_for(state: &mut State, due: Instant) -> Wake {
    if !state.running {
        state.running = true;
        Wake::Start
    } else if state.wake_at.is_none_or(|at| due < at) {
        state.wake_at = Some(due);
        Wake::Sooner
    } else {
        Wake::No
    }
}

/// A lease in the renewals, taken out when dropped (its execution ended).
pub(crate) struct Registered<DB: LeaseBackend> {
    inner: Arc<Inner<DB>>,
    id: u64,
    deadline: Arc<Deadline>,
}

impl<DB: LeaseBackend> Registered<DB> {
    /// Keeps the lease renewed with the others; never returns, so it can be
    /// raced against a handler, and stops renewing when dropped.
    ///
    /// `slot`, the execution's slot of its running limit, is given back as soon
    /// as the lease is lost: from then on the key may be taken over, here or
    /// elsewhere, and a stalled handler must not keep its takeover out.
    pub(crate) async fn hold(self, slot: Option<Slot>) -> std::convert::Infallible {
        if let Some(slot) = slot {
            // Wakes about once a lease, as renewals move the deadline on. A
            // lease found taken over is given back by the time its last
            // renewal would have run out, a margin before it lapsed on the
            // store (`Deadline::margin`).
            loop {
                let left = self.deadline.left();
                if left.is_zero() {
                    break;
                }
                tokio::time::sleep(left).await;
            }
            drop(slot);
        }
        std::future::pending().await
    }
}

impl<DB: LeaseBackend> Drop for Registered<DB> {
    fn drop(&mut self) {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .leases
            .remove(&self.id);
    }
}

/// The farthest the schedule looks ahead: a century, what the attribute
/// allows a lease and its ceiling. A hand-written `OperationSpec` may ask for
/// more (`Duration::MAX` for "no ceiling"), which no `Instant` can hold.
const FARTHEST: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// When to renew a lease from now: after a period, or at half the time it has
/// left if that is sooner (a lease whose claim waited long, or whose last
/// renewals failed, is renewed at once rather than at the next period).
fn next_in(every: Duration, deadline: &Deadline) -> Duration {
    every.min(deadline.left() / 2)
}

/// The most renewals of one store waiting for their rows at once: each holds
/// a connection of the pool the batches and the handlers share. Past it, a
/// lease is skipped with the batch again.
const MAX_WAITING: usize = 8;

/// One lease of a batch being sent.
struct Sending {
    id: u64,
    /// Renewed on its own, waiting for its row (see [`Entry::held`]).
    waiting: bool,
    tenant: String,
    operation: String,
    key: KeyDigest,
    token: OwnerToken,
    lease: Duration,
    deadline: Arc<Deadline>,
}

impl Sending {
    /// Lease `id`'s renewal, from its entry; `waiting`: alone, for its row.
    fn of(id: u64, e: &Entry, waiting: bool) -> Self {
        Sending {
            id,
            waiting,
            tenant: e.tenant.clone(),
            operation: e.operation.clone(),
            key: e.key,
            token: e.token.clone(),
            lease: e.lease,
            deadline: e.deadline.clone(),
        }
    }
}

/// Marks the task that sends the batches as not running when it ends by being
/// dropped, polled or not: its runtime shut down under it (a test's, or one
/// of several a program runs in turn). Otherwise `running` would stay true,
/// and the same `Idem` in another runtime would never start the task again:
/// its leases would lapse under live workers. Made before the task is
/// spawned, and moved into it.
/// (The task's own end marks it under the lock that finds no lease left, and
/// disarms this: marked later, it could undo a new task's start.)
struct Stopped<DB: LeaseBackend>(Option<Arc<Inner<DB>>>);

impl<DB: LeaseBackend> Drop for Stopped<DB> {
    fn drop(&mut self) {
        if let Some(inner) = &self.0 {
            stop(&mut inner.state.lock().unwrap_or_else(PoisonError::into_inner));
        }
    }
}

/// A batch out for renewal. Dropped unanswered (its task dropped with its
/// runtime, polled or not), it gives its leases back to the schedule: not
/// sending, due now, and the places of those waiting alone freed. Otherwise
/// they would stay "sending" and never be renewed again.
struct Outstanding<DB: LeaseBackend> {
    inner: Arc<Inner<DB>>,
    batch: Vec<Sending>,
    answered: bool,
}

impl<DB: LeaseBackend> Outstanding<DB> {
    /// `batch`, not answered yet.
    fn new(inner: Arc<Inner<DB>>, batch: Vec<Sending>) -> Self {
        Outstanding {
            inner,
            batch,
            answered: false,
        }
    }
}

impl<DB: LeaseBackend> Drop for Outstanding<DB> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let now = Instant::now();
        let mut state = self
            .inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let waiting = self.batch.iter().filter(|s| s.waiting).count();
        state.waiting = state.waiting.saturating_sub(waiting);
        for s in &self.batch {
            if let Some(e) = state.leases.get_mut(&s.id) {
                e.sending = false;
                e.due = now;
            }
        }
        drop(state);
        // The schedule planned its next wake without these leases (they were
        // being sent): woken, it sees them due. Gone with its runtime, the
        // permit waits for the next task, which wakes once more than needed.
        self.inner.wake.notify_one();
    }
}

/// The task that sends the batches is not running (nor planning a wake).
fn stop(state: &mut State) {
    state.running = false;
    state.wake_at = None;
}

/// The task that sends the batches: wakes at the earliest due lease (or when a
/// lease is added), sends what is due, and ends when no lease is left.
async fn schedule<DB: LeaseBackend>(mut stopped: Stopped<DB>) {
    let inner = stopped.0.clone().expect("armed when spawned");
    loop {
        let (batch, next) = {
            let mut state = inner.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.leases.is_empty() {
                stop(&mut state);
                stopped.0 = None;
                return;
            }
            let (batch, next) = due_now(&mut state);
            state.wake_at = next;
            (batch, next)
        };
        let (alone, mut batch): (Vec<Sending>, Vec<Sending>) =
            batch.into_iter().partition(|s| s.waiting);
        for s in alone {
            tokio::spawn(send(Outstanding::new(inner.clone(), vec![s])));
        }
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(MAX_BATCH));
            tokio::spawn(send(Outstanding::new(inner.clone(), batch)));
            batch = rest;
        }
        match next {
            Some(at) => {
                let _ = tokio::time::timeout_at(at, inner.wake.notified()).await;
            }
            None => inner.wake.notified().await,
        }
    }
}

/// Takes out the leases that are lost or past their ceiling; when one is due,
/// marks it and every lease due within a third of its period as being sent;
/// says when the next one not sent is due.
fn due_now(state: &mut State) -> (Vec<Sending>, Option<Instant>) {
    let now = Instant::now();
    let mut batch = Vec::new();
    let mut next: Option<Instant> = None;
    state.leases.retain(|_, e| {
        if e.sending {
            return true;
        }
        if e.deadline.is_lost() {
            tracing::warn!(operation = %e.operation, "idem: no renewal for a whole lease; taking the lease as lost");
            return false;
        }
        if now + e.every > e.ceiling {
            tracing::warn!(operation = %e.operation, "idem: lease renewal ceiling reached; the execution may be taken over");
            return false;
        }
        true
    });
    // Only when a lease is due: the task also wakes when a lease added is due
    // before it planned to, and taking every lease that has just come within
    // reach at each such wake would send them one by one, never together.
    let any_due = state.leases.values().any(|e| !e.sending && e.due <= now);
    let State {
        leases, waiting, ..
    } = state;
    for (id, e) in leases {
        if e.sending {
            continue;
        }
        if any_due && e.due <= now + e.every / 3 {
            e.sending = true;
            // Past the cap, a held row is skipped with the batch again.
            let alone = e.held && *waiting < MAX_WAITING;
            *waiting += usize::from(alone);
            batch.push(Sending::of(*id, e, alone));
        } else {
            next = Some(next.map_or(e.due, |n| n.min(e.due)));
        }
    }
    (batch, next)
}

/// How long a batch may take: as long as the lease with the most time left
/// could still use its answer. Not the least time any has left: a short lease
/// taken along would cut a long one's renewal short, again at each retry,
/// until the long one was lost under a live worker. A lease whose own time
/// runs out while the batch is out is lost by its deadline, and a late answer
/// does not revive it ([`Deadline::renewed`]).
fn time_limit(batch: &[Sending]) -> Duration {
    batch
        .iter()
        .map(|s| s.deadline.left())
        .max()
        .unwrap_or_default()
        .max(Duration::from_millis(10))
}

/// Sends one batch, bounded by [`time_limit`], and records what each lease
/// learned.
async fn send<DB: LeaseBackend>(mut out: Outstanding<DB>) {
    let inner = out.inner.clone();
    let batch = &out.batch;
    let limit = time_limit(batch);
    let sent = Instant::now();
    let rows: Vec<Renewal<'_>> = batch
        .iter()
        .map(|s| Renewal {
            row: Owned {
                tenant: &s.tenant,
                operation: &s.operation,
                key: s.key,
                token: &s.token,
            },
            lease: s.lease,
        })
        .collect();
    inner.statements.fetch_add(1, Ordering::Relaxed);
    inner
        .renewals
        .fetch_add(rows.len() as u64, Ordering::Relaxed);
    let renewing = async {
        match (&batch[..], &rows[..]) {
            ([one], [row]) if one.waiting => {
                tracing::debug!(operation = %one.operation, "idem: a lease's row was held at its last renewal; renewing it alone, waiting for the row");
                // Half the time the lease has left: an answer after that
                // would still keep it, with room for the next try.
                let wait = (limit / 2).max(Duration::from_millis(1));
                DB::lease_renew_waiting(&inner.store, row, wait)
                    .await
                    .map(|r| vec![r])
            }
            _ => DB::lease_renew_many(&inner.store, &rows).await,
        }
    };
    let answered = match tokio::time::timeout(limit, renewing).await {
        Ok(Ok(renewed)) if renewed.len() == rows.len() => Some(renewed),
        Ok(Ok(_)) => {
            tracing::warn!(
                "idem: a lease renewal batch answered for another number of leases; retrying"
            );
            None
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, leases = rows.len(), "idem: lease renewal failed; retrying");
            None
        }
        Err(_) => {
            tracing::warn!(
                leases = rows.len(),
                "idem: lease renewal timed out; retrying"
            );
            None
        }
    };
    drop(rows);
    let now = Instant::now();
    let mut state = inner.state.lock().unwrap_or_else(PoisonError::into_inner);
    state.waiting -= batch.iter().filter(|s| s.waiting).count();
    // Answered from here on: given back, as below, not by the guard (which
    // would count the waiting ones off again).
    out.answered = true;
    for (i, s) in batch.iter().enumerate() {
        let outcome = answered.as_ref().map_or(Renewed::Unknown, |r| r[i]);
        match outcome {
            Renewed::Kept => s.deadline.renewed(sent, s.lease),
            Renewed::Lost => s.deadline.lose(),
            Renewed::Unknown => {}
        }
        let Some(e) = state.leases.get_mut(&s.id) else {
            continue;
        };
        if outcome == Renewed::Lost {
            // Said only of a lease still running: one whose execution ended
            // while the batch was out (stored, released, lapsed) is no news.
            tracing::warn!(operation = %s.operation, "idem: lease taken over; this worker's result will not be published");
            state.leases.remove(&s.id);
            continue;
        }
        e.sending = false;
        // Held by another transaction: the batch answered, and neither
        // renewed the row nor found it lost.
        e.held = match (outcome, &answered) {
            (Renewed::Unknown, Some(_)) => true,
            (Renewed::Kept, _) => false,
            _ => e.held,
        };
        e.due = match outcome {
            Renewed::Kept => sent + e.every,
            _ => now + next_in(e.every, &e.deadline),
        };
    }
    drop(state);
    inner.wake.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;

    /// A lease of 6 s (renewed every 2 s, so leases due within 2/3 s of a due
    /// one go along) whose renewal is due `due_in` from `now`.
    fn entry(now: Instant, due_in: Duration, late: bool) -> Entry {
        let lease = Duration::from_secs(6);
        Entry {
            tenant: "t".into(),
            operation: "op".into(),
            key: IdempotencyKey::parse("k").unwrap().digest(),
            token: OwnerToken::from("token".to_owned()),
            lease,
            every: lease / 3,
            deadline: Arc::new(Deadline::new(now, lease)),
            due: if late { now - due_in } else { now + due_in },
            ceiling: now + Duration::from_secs(3600),
            sending: false,
            held: false,
        }
    }

    /// A runtime that shuts down while the task waits drops it: the next
    /// lease, in another runtime, starts it again.
    #[cfg(feature = "sqlite")]
    #[test]
    fn a_task_dropped_with_its_runtime_is_started_again_by_the_next_lease() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        // The pool's own tasks live in a runtime of their own, to the end.
        let pools = runtime();
        let pool = {
            let _in = pools.enter();
            sqlx::sqlite::SqlitePoolOptions::new()
                .connect_lazy("sqlite::memory:")
                .unwrap()
        };
        let renewals = Renewals::<sqlx::Sqlite>::new(pool.clone());
        let renewer = || Renewer::<sqlx::Sqlite> {
            pool: pool.clone(),
            tenant: "t".into(),
            operation: "op".into(),
            key: IdempotencyKey::parse("k").unwrap().digest(),
            token: OwnerToken::from("token".to_owned()),
            lease: Duration::from_secs(3600),
            deadline: Arc::new(Deadline::new(Instant::now(), Duration::from_secs(3600))),
        };
        let running = |r: &Renewals<sqlx::Sqlite>| r.inner.state.lock().unwrap().running;
        let first = runtime();
        let held = first.block_on(async {
            let held = renewals.register(renewer(), Duration::from_secs(7200));
            // The task runs, finds nothing due for 20 minutes, and waits.
            tokio::task::yield_now().await;
            held
        });
        assert!(running(&renewals));
        drop(first);
        assert!(!running(&renewals), "the task went with its runtime");
        drop(held);
        // Dropped before it was ever polled, likewise.
        let second = runtime();
        let held = second.block_on(async {
            let held = renewals.register(renewer(), Duration::from_secs(7200));
            assert!(running(&renewals), "started again");
            held
        });
        drop(second);
        assert!(
            !running(&renewals),
            "the unpolled task went with its runtime"
        );
        drop(held);

        // A batch out for renewal, dropped unanswered (as with its runtime,
        // or a panic in it), gives its leases back: not sending, due, and its
        // waiting place freed.
        let third = runtime();
        let held =
            third.block_on(async { renewals.register(renewer(), Duration::from_secs(7200)) });
        let id = held.id;
        let sending = {
            let mut state = renewals.inner.state.lock().unwrap();
            let e = state.leases.get_mut(&id).unwrap();
            e.sending = true;
            let s = Sending::of(id, e, true);
            state.waiting = 1;
            s
        };
        drop(Outstanding::new(renewals.inner.clone(), vec![sending]));
        let state = renewals.inner.state.lock().unwrap();
        assert_eq!(state.waiting, 0);
        let e = &state.leases[&id];
        assert!(!e.sending && e.due <= Instant::now());
    }

    /// A lease and a ceiling past what an `Instant` can hold (a hand-written
    /// spec's `Duration::MAX`, "no ceiling") are renewed as the longest the
    /// attribute allows, not a panic after the claim committed.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_ceiling_or_lease_no_instant_can_hold_is_a_century() {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_lazy("sqlite::memory:")
            .unwrap();
        let renewals = Renewals::<sqlx::Sqlite>::new(pool.clone());
        let now = Instant::now();
        let held = renewals.register(
            Renewer::<sqlx::Sqlite> {
                pool,
                tenant: "t".into(),
                operation: "op".into(),
                key: IdempotencyKey::parse("k").unwrap().digest(),
                token: OwnerToken::from("token".to_owned()),
                lease: Duration::MAX,
                deadline: Arc::new(Deadline::new(now, Duration::MAX)),
            },
            Duration::MAX,
        );
        let state = renewals.inner.state.lock().unwrap();
        let e = &state.leases[&held.id];
        assert_eq!(e.every, FARTHEST);
        assert!(e.ceiling >= now + FARTHEST && e.ceiling <= Instant::now() + FARTHEST);
        assert!(e.due > now && e.due <= Instant::now() + FARTHEST);
    }

    #[test]
    fn a_lease_added_wakes_the_task_only_when_due_before_it_planned_to_wake() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let mut state = State::default();
        assert!(matches!(wake_for(&mut state, now + ms(500)), Wake::Start));
        assert!(state.running);
        // Running, and waiting without a time of its own: woken.
        assert!(matches!(wake_for(&mut state, now + ms(500)), Wake::Sooner));
        assert_eq!(state.wake_at, Some(now + ms(500)));
        // Due later than the planned wake: that wake sees it, no scan now.
        assert!(matches!(wake_for(&mut state, now + ms(2000)), Wake::No));
        assert!(matches!(wake_for(&mut state, now + ms(500)), Wake::No));
        assert_eq!(state.wake_at, Some(now + ms(500)));
        // Due sooner: woken, and the plan moves.
        assert!(matches!(wake_for(&mut state, now + ms(100)), Wake::Sooner));
        assert_eq!(state.wake_at, Some(now + ms(100)));
    }

    #[test]
    fn nothing_is_sent_before_a_lease_is_due_and_a_due_one_takes_the_near_ones_along() {
        let now = Instant::now();
        let mut state = State::default();
        let ms = Duration::from_millis;
        for (id, due_in) in [(0, ms(300)), (1, ms(500)), (2, ms(1500))] {
            state.leases.insert(id, entry(now, due_in, false));
        }
        // Woken early (a lease was added): nothing is due, nothing is sent,
        // although two leases are within reach of the first.
        let (batch, next) = due_now(&mut state);
        assert!(batch.is_empty(), "sent {} before any was due", batch.len());
        assert_eq!(next, Some(now + ms(300)));
        // The first comes due: it goes with the one due 200 ms later, not with
        // the one due a second later.
        state.leases.insert(0, entry(now, ms(1), true));
        let (batch, next) = due_now(&mut state);
        let mut sent: Vec<u64> = batch.iter().map(|s| s.id).collect();
        sent.sort_unstable();
        assert_eq!(sent, [0, 1]);
        assert_eq!(next, Some(now + ms(1500)));
        assert!(state.leases[&0].sending && state.leases[&1].sending);
        assert!(!state.leases[&2].sending);
    }

    /// A 300 ms lease due now takes a 6 s lease along: the batch may take as
    /// long as the 6 s lease has left, not the 300 ms lease's few milliseconds.
    #[test]
    fn a_short_lease_taken_along_does_not_cut_a_long_ones_renewal_short() {
        let now = Instant::now();
        let mut state = State::default();
        // About 0.7 s left of 3 s: the test has that long before the short
        // lease is taken as lost (and out of the batch), a slow machine too.
        let mut short = entry(now, Duration::from_millis(1), true);
        short.lease = Duration::from_secs(3);
        short.every = short.lease / 3;
        short.deadline = Arc::new(Deadline::new(
            now - Duration::from_millis(2300),
            short.lease,
        ));
        state.leases.insert(0, short);
        state
            .leases
            .insert(1, entry(now, Duration::from_millis(400), false));
        let (batch, _) = due_now(&mut state);
        assert_eq!(batch.len(), 2, "the long lease goes along");
        let limit = time_limit(&batch);
        assert!(
            limit > Duration::from_secs(5),
            "the batch is cut at {limit:?}, the short lease's time"
        );
    }

    #[test]
    fn held_rows_wait_alone_up_to_the_cap_and_the_rest_go_with_the_batch() {
        let now = Instant::now();
        let mut state = State::default();
        for id in 0..(MAX_WAITING as u64 + 2) {
            let mut e = entry(now, Duration::from_millis(1), true);
            e.held = true;
            state.leases.insert(id, e);
        }
        state
            .leases
            .insert(99, entry(now, Duration::from_millis(1), true));
        let (batch, _) = due_now(&mut state);
        let alone: Vec<u64> = batch.iter().filter(|s| s.waiting).map(|s| s.id).collect();
        assert_eq!(alone.len(), MAX_WAITING);
        assert!(!alone.contains(&99), "a row not held goes with the batch");
        assert_eq!(state.waiting, MAX_WAITING);
        assert_eq!(batch.len(), MAX_WAITING + 3);
    }
}
