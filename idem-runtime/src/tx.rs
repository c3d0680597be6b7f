//! [`Tx`]: the handler's view of the transaction that holds its key.

use std::ops::{Deref, DerefMut};

use sqlx::{Postgres, Transaction};

use crate::store::Backend;

/// The transaction in which the key was claimed and the outcome will be stored.
///
/// It dereferences to the database's connection (`PgConnection`, or
/// `SqliteConnection` for `Tx<Sqlite>`), so queries run on it as on a sqlx
/// transaction:
///
/// ```no_run
/// # async fn demo(tx: &mut idem_runtime::Tx) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO orders (sku) VALUES ($1)")
///     .bind("A-1")
///     .execute(&mut **tx)
///     .await?;
/// # Ok(()) }
/// ```
///
/// It has no `commit` or `rollback`: idem commits after storing the outcome, and
/// rolls back when the handler returns `Err` or a 5xx. Do not send `COMMIT`,
/// `ROLLBACK` or `SET TRANSACTION` yourself: that would separate the effect from its
/// record, the one thing idem exists to prevent.
pub struct Tx<DB: Backend = Postgres> {
    inner: Transaction<'static, DB>,
}

impl<DB: Backend> Tx<DB> {
    pub(crate) fn new(inner: Transaction<'static, DB>) -> Self {
        Tx { inner }
    }

    pub(crate) fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        &mut self.inner
    }

    pub(crate) fn into_inner(self) -> Transaction<'static, DB> {
        self.inner
    }
}

impl<DB: Backend> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.inner
    }
}

impl<DB: Backend> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.inner
    }
}

impl<DB: Backend> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx { .. }")
    }
}
