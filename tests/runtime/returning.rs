//! A payment's insert on the databases with `INSERT ... RETURNING`
//! (PostgreSQL and SQLite), mounted in their modules of `tests/runtime.rs`;
//! MySQL's module writes its own (`?` placeholders, no `RETURNING`).

use super::*;

pub async fn pay(tx: &mut Transaction<'static, Db>, tenant: &str, amount: i64) -> i64 {
    sqlx::query_scalar("INSERT INTO payments (tenant, amount) VALUES ($1, $2) RETURNING id")
        .bind(tenant)
        .bind(amount)
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}
