//! [`Tx`]: the handler's view of the transaction that holds its key.

use std::ops::{Deref, DerefMut};

use sqlx::{PgConnection, Postgres, Transaction};

/// The transaction in which the key was claimed and the outcome will be stored.
///
/// It dereferences to [`PgConnection`], so queries run on it as on a sqlx
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
pub struct Tx {
    inner: Transaction<'static, Postgres>,
}

impl Tx {
    pub(crate) fn new(inner: Transaction<'static, Postgres>) -> Self {
        Tx { inner }
    }

    pub(crate) fn transaction(&mut self) -> &mut Transaction<'static, Postgres> {
        &mut self.inner
    }

    pub(crate) fn into_inner(self) -> Transaction<'static, Postgres> {
        self.inner
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.inner
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.inner
    }
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx { .. }")
    }
}
