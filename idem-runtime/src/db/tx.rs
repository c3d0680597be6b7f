//! [`Tx`]: the handler's view of the transaction that holds its key.
//!
//! This is the one module that drives sqlx's `TransactionManager` (begin on a
//! connection idem already holds, commit, roll back, queue a rollback on drop).
//! sqlx documents that trait as meant for drivers and exempt from semver, so
//! keeping it here keeps a change of it to one file; CI builds `sqlx-core` at its
//! lowest allowed version and at the locked one (docs/decisions.md). Everything
//! else in idem uses sqlx's public API.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, SqlStr};
use sqlx_core::transaction::TransactionManager;

use crate::db::Backend;
use crate::model::{Finish, StoreError};

/// The transaction in which the key was claimed and the outcome will be stored.
///
/// It dereferences to the database's connection (`PgConnection`, or
/// `SqliteConnection` for `Tx<Sqlite>`), so queries run on it as on a sqlx
/// transaction:
///
/// ```no_run
/// # #[cfg(feature = "postgres")] // the example's database is PostgreSQL
/// # async fn demo(tx: &mut idem_runtime::Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO orders (sku) VALUES ($1)")
///     .bind("A-1")
///     .execute(&mut **tx)
///     .await?;
/// # Ok(()) }
/// ```
///
/// A savepoint inside it works as inside any sqlx transaction
/// (`sqlx::Connection::begin(&mut **tx)`): its commit releases the savepoint and
/// its rollback returns to it; neither ends the transaction.
///
/// It has no `commit` or `rollback`: idem commits after storing the outcome, and
/// rolls back when the handler returns `Err` or a 5xx. Do not send `COMMIT`,
/// `ROLLBACK` or `SET TRANSACTION` yourself: that would separate the effect from its
/// record, the one thing idem exists to prevent. Nor change the schema search
/// path (PostgreSQL's `SET LOCAL search_path`, MySQL's `USE`): idem's
/// finished row is written at commit by its table's unqualified name, after
/// the key was read before your statements, so a schema of your own with an
/// `idempotency_requests` of its own would take the row where no retry reads
/// it (qualify your tables instead). On SQLite and MySQL the savepoint
/// `idem_tx` is idem's (it tells idem the transaction is still the handler's):
/// leave it alone.
///
/// A statement of yours that you cancel (a `tokio::time::timeout` around it,
/// say) may still run on the server, inside this transaction: after one,
/// return `Err` or a 5xx, so that the transaction rolls back. Answered with a
/// 2xx or a 4xx, it commits whatever that statement did along with the
/// stored answer.
pub struct Tx<DB: Backend> {
    // A pooled connection rather than a `sqlx::Transaction`: the value outlives
    // the claim's decision (a replay answered on the same connection, with no
    // transaction), and on PostgreSQL the transaction is begun with the request
    // deadline in the same message, which a `sqlx::Transaction` borrowed from its
    // connection cannot hand over by value. The driver's own transaction depth is
    // kept exactly as a `sqlx::Transaction` keeps it, so nested `begin`s are
    // savepoints.
    conn: PoolConnection<DB>,
    /// Whether this value still owes the transaction a rollback when dropped.
    open: bool,
    /// Past this instant the request is abandoned: a drop then closes the
    /// connection rather than queue a rollback on a connection that may be stuck.
    abandon_at: Option<tokio::time::Instant>,
    /// A session setting of idem's is on the connection (see
    /// [`Tx::close_if_dropped`]), or idem's statement is on its way: a drop
    /// closes it.
    closes_if_dropped: bool,
}

impl<DB: Backend> Tx<DB> {
    /// Begins a transaction on a connection from `pool` with `statement` (or the
    /// driver's plain `BEGIN`). MySQL's path; PostgreSQL's looks up first, and
    /// SQLite's answers a busy database on the connection it acquired.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) async fn begin(
        pool: &Pool<DB>,
        statement: Option<SqlStr>,
    ) -> Result<Self, sqlx::Error> {
        // Dropped half-way (the request's deadline, a client gone), the
        // connection is closed: MySQL's driver counts the transaction only once
        // the server has answered, so one dropped before then would go back to
        // the pool inside a transaction with nothing queued to end it.
        let mut guard = ClosedIfDropped::new(pool.acquire().await?);
        <DB as Database>::TransactionManager::begin(guard.conn(), statement).await?;
        Ok(Tx {
            conn: guard.release(),
            open: true,
            abandon_at: None,
            closes_if_dropped: false,
        })
    }

    /// Begins a transaction with `statement` on a connection idem already holds
    /// (after a lookup on it, say). On failure the connection comes back with the
    /// error; where the message failed after its `BEGIN`, PostgreSQL's driver has
    /// queued the `ROLLBACK` (sqlx 0.9.1 on), which goes with the connection's
    /// next message (MySQL's and SQLite's callers close a connection whose
    /// `START TRANSACTION; SAVEPOINT ..` or `BEGIN IMMEDIATE; SAVEPOINT ..`
    /// failed, perhaps after its `BEGIN`).
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) async fn begin_on(
        conn: PoolConnection<DB>,
        statement: SqlStr,
    ) -> Result<Self, (PoolConnection<DB>, sqlx::Error)> {
        // Dropped half-way (the request's deadline), where the message stopped
        // is not known: the connection is then closed, never given back to the
        // pool inside a transaction.
        let mut guard = ClosedIfDropped(Some(conn));
        let conn = guard.0.as_mut().expect("held until the end");
        let begun = <DB as Database>::TransactionManager::begin(conn, Some(statement)).await;
        let conn = guard.0.take().expect("held until the end");
        match begun {
            Ok(()) => Ok(Tx {
                conn,
                open: true,
                abandon_at: None,
                closes_if_dropped: false,
            }),
            Err(e) => Err((conn, e)),
        }
    }

    /// Wraps a connection that is not in a transaction (a claim that was answered
    /// without one): dropping it only returns the connection to the pool.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn idle(conn: PoolConnection<DB>) -> Self {
        Tx {
            conn,
            open: false,
            abandon_at: None,
            closes_if_dropped: false,
        }
    }

    /// Whether a drop of this value closes the connection rather than return
    /// it to the pool: on while a session setting of idem's is on it (MySQL's
    /// lock wait, from the change until it is given back), or while one of
    /// idem's statements is on its way before the request's deadline is set
    /// here (a claim before the handler, whose connection may be stalled and
    /// would otherwise wait, in the pool's release ping, for an answer that is
    /// not coming).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn close_if_dropped(&mut self, on: bool) {
        self.closes_if_dropped = on;
    }

    /// Sets when the request is abandoned (see the field).
    pub(crate) fn abandon_at(&mut self, deadline: tokio::time::Instant) {
        self.abandon_at = Some(deadline);
    }

    /// The pooled connection, for idem's own statements.
    pub(crate) fn connection(&mut self) -> &mut PoolConnection<DB> {
        &mut self.conn
    }

    /// Commits with the driver's `COMMIT`.
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        <DB as Database>::TransactionManager::commit(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }

    /// Whether the handler left a transaction of its own open on the
    /// connection (an `sqlx::Transaction` it began and forgot rather than
    /// committed or dropped): the driver's `COMMIT` or `ROLLBACK` would then
    /// end only that savepoint, and leave the handler's transaction open.
    pub(crate) fn nested_left_open(&self) -> bool {
        <DB as Database>::TransactionManager::get_transaction_depth(&self.conn) > 1
    }

    /// Commits the handler's transaction with its outcome's row in it: not
    /// where the handler left a nested transaction open (dropped, the
    /// connection is closed, and the server rolls everything back), and, where
    /// the commit fails on the way, as an outcome that may or may not be stored.
    pub(crate) async fn commit_stored(self) -> Finish {
        if self.nested_left_open() {
            return Finish::NotStored(StoreError::NestedTransactionLeftOpen);
        }
        match self.commit().await {
            Ok(()) => Finish::Committed,
            Err(e) => Finish::Unknown(e.into()),
        }
    }

    /// Ends the handler's path the plain way: after the outcome's store
    /// (`stored`), commit.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) async fn commit_after(self, stored: Result<(), StoreError>) -> Finish {
        if let Err(e) = stored {
            return Finish::NotStored(e);
        }
        self.commit_stored().await
    }

    /// The transaction was committed by idem's own message, which ended with
    /// `COMMIT AND CHAIN`: the driver still counts the committed transaction, and
    /// the server holds a new, empty one. Queuing the driver's rollback settles
    /// both at once: the count drops, and the `ROLLBACK` (of an empty
    /// transaction: no warning, no work) rides with the connection's next message,
    /// the pool's check on release, with no round trip of its own.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn committed_by_message(mut self) {
        if self.nested_left_open() {
            // `COMMIT AND CHAIN` committed the handler's nested transaction
            // with the rest; the driver's queued rollback would end only that
            // savepoint, which the server no longer has. Dropped, it is closed.
            return;
        }
        <DB as Database>::TransactionManager::start_rollback(&mut self.conn);
        self.open = false;
    }

    /// Rolls back and waits for the database to confirm it.
    pub(crate) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        if self.nested_left_open() {
            // A `ROLLBACK` would end only the handler's forgotten nested
            // transaction; dropped, the connection is closed, which ends all
            // of it.
            tracing::warn!(
                "idem: the handler left a nested transaction open; its connection is closed, which rolls everything back"
            );
            return Ok(());
        }
        let rolled_back = <DB as Database>::TransactionManager::rollback(&mut self.conn).await;
        if rolled_back.is_err() {
            // Where the connection stopped is not known.
            self.conn.close_on_drop();
        }
        self.open = false;
        rolled_back
    }

    /// The connection's state is not known (an error mid-way through idem's own
    /// statements): it is closed rather than returned to the pool.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn discard(mut self) {
        self.conn.close_on_drop();
        self.open = false;
    }
}

/// A connection that is closed if dropped while still held: one in the middle
/// of a message whose answer may never come (the request's deadline on a
/// stalled connection), or whose server state is not known.
pub(crate) struct ClosedIfDropped<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> ClosedIfDropped<DB> {
    /// Holds `conn` until [`ClosedIfDropped::release`].
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        ClosedIfDropped(Some(conn))
    }

    /// The connection, while held.
    pub(crate) fn conn(&mut self) -> &mut PoolConnection<DB> {
        self.0.as_mut().expect("held until released")
    }

    /// The connection back, in a known state: dropping it returns it to the pool.
    pub(crate) fn release(mut self) -> PoolConnection<DB> {
        self.0.take().expect("held until released")
    }
}

impl<DB: Database> Drop for ClosedIfDropped<DB> {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

impl<DB: Backend> Drop for Tx<DB> {
    fn drop(&mut self) {
        if self.closes_if_dropped {
            self.conn.close_on_drop();
            return;
        }
        if !self.open {
            return;
        }
        if self.nested_left_open() {
            // The one place a forgotten nested transaction is dealt with (the
            // commit, the rollback and the session path's message leave it
            // here): a `ROLLBACK` would end only that savepoint, and the pool
            // would hand the connection on inside the handler's transaction.
            self.conn.close_on_drop();
            return;
        }
        if self
            .abandon_at
            .is_some_and(|at| tokio::time::Instant::now() >= at)
        {
            // Dropped by the deadline, maybe in the middle of a statement on a
            // stalled connection: close it. The database rolls the transaction
            // back when the session ends (on PostgreSQL at the latest after
            // `idle_in_transaction_session_timeout`, which idem sets).
            self.conn.close_on_drop();
        } else {
            // Queued, sent with the connection's release: as a dropped
            // `sqlx::Transaction` does.
            <DB as Database>::TransactionManager::start_rollback(&mut self.conn);
        }
    }
}

impl<DB: Backend> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Backend> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

impl<DB: Backend> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx { .. }")
    }
}
