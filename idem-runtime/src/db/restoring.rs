//! [`Restoring`]: a pooled connection whose session setting idem changed for one
//! step (a lock wait, a busy timeout) and gives back after it.
//!
//! A future can be dropped at any await point (a request deadline, a caller's
//! timeout), including between the change and the give-back. The connection
//! would then go back to the pool with idem's setting on it, and later work on
//! it, the application's included, would run with idem's bound. Held in this
//! guard, such a connection is closed instead: the pool opens a fresh one, with
//! the server's own settings.

use sqlx::Database;
use sqlx::pool::PoolConnection;

/// A pooled connection that is closed, not given back to the pool, unless
/// [`Restoring::restored`] says its session is as it was.
pub(crate) struct Restoring<'c, DB: Database> {
    conn: &'c mut PoolConnection<DB>,
    armed: bool,
}

impl<'c, DB: Database> Restoring<'c, DB> {
    /// Guards `conn` from now until [`Restoring::restored`].
    pub(crate) fn new(conn: &'c mut PoolConnection<DB>) -> Self {
        Restoring { conn, armed: true }
    }

    /// The connection, for the steps in between.
    pub(crate) fn conn(&mut self) -> &mut PoolConnection<DB> {
        self.conn
    }

    /// The session's setting was given back: the connection may return to the
    /// pool.
    pub(crate) fn restored(mut self) {
        self.armed = false;
    }
}

impl<DB: Database> Drop for Restoring<'_, DB> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.close_on_drop();
        }
    }
}
