//! Idempotent state transitions for resources with a state column and a version.
//!
//! Multi-step workflows (pay, then ship) are retried step by step. Declare the
//! allowed transitions once; then [`transition`]:
//!
//! * to the state the resource is already in: succeeds as a no-op without running
//!   its action ([`Transitioned::AlreadyThere`]) — a retried `pay` pays nothing;
//! * along an allowed edge: runs the action and moves the state, in the caller's
//!   transaction, fenced by the version (optimistic locking);
//! * along any other edge: [`TransitionError::Invalid`] — `ship` before `pay`;
//! * concurrently with another transition of the same resource: the row is
//!   locked before the action runs, so the second waits for the first to commit
//!   and then sees its state (a no-op, or `Invalid`): the action never runs
//!   twice, not even an effect outside the database. The version still fences
//!   the update ([`TransitionError::Conflict`]) against writers that bypass the
//!   lock; roll back then, and retry.
//!
//! How the row is held: on PostgreSQL `SELECT ... FOR UPDATE`; on SQLite, which
//! has no row locks, a no-op `UPDATE ... RETURNING` that takes the database's
//! write lock (it fires the table's `UPDATE` triggers even when the transition
//! turns out to be a no-op). On SQLite make the transition the transaction's
//! first statement (or begin with `BEGIN IMMEDIATE`): a transaction that read
//! before it cannot take the write lock once another writer has committed.
//!
//! ```
//! use idem_runtime::transition::States;
//!
//! #[derive(Debug, Clone, Copy, PartialEq, Eq)]
//! enum OrderState { Created, Paid, Shipped }
//!
//! impl States for OrderState {
//!     const ALL: &'static [Self] = &[Self::Created, Self::Paid, Self::Shipped];
//!     const TRANSITIONS: &'static [(Self, Self)] = &[(Self::Created, Self::Paid), (Self::Paid, Self::Shipped)];
//!     fn name(self) -> &'static str {
//!         match self { Self::Created => "created", Self::Paid => "paid", Self::Shipped => "shipped" }
//!     }
//! }
//! assert!(OrderState::allows(OrderState::Created, OrderState::Paid));
//! assert!(!OrderState::allows(OrderState::Created, OrderState::Shipped));
//! ```

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;

use sqlx::Transaction;

use crate::db::Backend;

pub(crate) use crate::model::FencedWrite;
pub use crate::model::Resource;

/// The states of a resource and the edges between them.
pub trait States: Copy + Eq + Debug + Send + Sync + 'static {
    /// Every state.
    const ALL: &'static [Self];
    /// The allowed `(from, to)` transitions.
    const TRANSITIONS: &'static [(Self, Self)];
    /// The state's name as stored in the state column.
    fn name(self) -> &'static str;

    /// The state stored under `name`.
    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|s| s.name() == name)
    }

    /// Whether `from -> to` is allowed.
    fn allows(from: Self, to: Self) -> bool {
        Self::TRANSITIONS.contains(&(from, to))
    }
}

/// What a successful transition did.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transitioned<T> {
    /// The action ran and the state moved; `version` is the new version.
    Applied {
        /// The action's result.
        value: T,
        /// The resource's version after the transition.
        version: i64,
    },
    /// The resource was already in the target state: nothing ran.
    AlreadyThere {
        /// The resource's current version.
        version: i64,
    },
}

/// Why a transition did not happen. Roll back the transaction in every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError<S: Debug, E> {
    /// No such resource (in this scope).
    #[error("no such resource")]
    NotFound,
    /// The resource's state does not allow this transition.
    #[error("cannot go from {from:?} to {to:?}")]
    Invalid {
        /// The current state.
        from: S,
        /// The requested state.
        to: S,
    },
    /// Another transaction moved the resource first; the action's writes must be
    /// rolled back. A retry sees the new state.
    #[error("the resource changed concurrently; roll back and retry")]
    Conflict,
    /// The scope does not fit the resource: a scope given for a resource without a
    /// scope column, or none for one with it. A programming error, reported
    /// rather than answered as [`TransitionError::NotFound`].
    #[error("the resource {table} is {scoped}, but the transition {given} a scope")]
    ScopeMismatch {
        /// The resource's table.
        table: &'static str,
        /// "scoped" or "not scoped".
        scoped: &'static str,
        /// "was given" or "was not given".
        given: &'static str,
    },
    /// The stored state is not one of the declared states.
    #[error("the stored state {0:?} is not a declared state")]
    UnknownState(String),
    /// The action failed.
    #[error("the transition's action failed: {0}")]
    Action(E),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// The action of a transition, run in the caller's transaction.
pub type Action<'c, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>;

/// Moves resource `id` (in `scope`, if the resource has a scope column) to `to`,
/// running `action` first, all in `tx` (the caller's transaction, PostgreSQL or
/// SQLite). See the module docs for the outcomes and how each database holds the
/// row.
///
/// # Errors
///
/// [`TransitionError`]: roll the transaction back.
pub async fn transition<DB, S, T, E, F>(
    tx: &mut Transaction<'_, DB>,
    resource: &Resource,
    id: i64,
    scope: Option<&str>,
    to: S,
    action: F,
) -> Result<Transitioned<T>, TransitionError<S, E>>
where
    DB: Backend,
    S: States,
    F: for<'c> FnOnce(&'c mut DB::Connection) -> Action<'c, T, E>,
{
    if resource.scope_column.is_some() != scope.is_some() {
        return Err(TransitionError::ScopeMismatch {
            table: resource.table,
            scoped: if resource.scope_column.is_some() {
                "scoped"
            } else {
                "not scoped"
            },
            given: if scope.is_some() {
                "was given"
            } else {
                "was not given"
            },
        });
    }
    let conn: &mut DB::Connection = tx;
    let (current, version) = DB::lock_state(&mut *conn, resource, id, scope)
        .await?
        .ok_or(TransitionError::NotFound)?;
    let from = S::from_name(&current).ok_or(TransitionError::UnknownState(current))?;
    if from == to {
        return Ok(Transitioned::AlreadyThere { version });
    }
    if !S::allows(from, to) {
        return Err(TransitionError::Invalid { from, to });
    }
    let value = action(&mut *conn).await.map_err(TransitionError::Action)?;
    let write = FencedWrite {
        resource,
        id,
        scope,
        from: from.name(),
        to: to.name(),
        version,
    };
    match DB::write_state(conn, write).await? {
        Some(version) => Ok(Transitioned::Applied { value, version }),
        None => Err(TransitionError::Conflict),
    }
}
