//! The example's own tables and statements, per database: PostgreSQL and
//! SQLite share their SQL (sqlx takes `$1` on both), MySQL / MariaDB has its
//! own (`?`, and `LAST_INSERT_ID()` rather than `RETURNING`).

use std::future::Future;

use idem_runtime::Backend;
use sqlx::{MySql, Pool, Postgres, Sqlite};

use crate::pb::{Counts, CreateOrderRequest, Order, Refund};

/// A new order's columns, as the service validated them.
pub struct NewOrder<'a> {
    pub tenant: &'a str,
    pub message: &'a CreateOrderRequest,
    pub currency: &'a str,
}

type OrderRow = (i64, String, i32, i64, String, String);

fn order((id, sku, quantity, amount_cents, currency, note): OrderRow) -> Order {
    Order {
        id,
        sku,
        quantity,
        amount_cents,
        currency,
        note,
    }
}

/// What the service stores, on one database.
pub trait Store: Backend {
    /// Creates the tables when they are missing.
    fn create_tables(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Inserts an order in the method's transaction.
    fn insert_order(
        conn: &mut Self::Connection,
        new: NewOrder<'_>,
    ) -> impl Future<Output = Result<Order, sqlx::Error>> + Send;
    /// Inserts a refund of one of the tenant's orders; `None` without one.
    fn insert_refund(
        conn: &mut Self::Connection,
        tenant: &str,
        order_id: i64,
        amount_cents: i64,
    ) -> impl Future<Output = Result<Option<Refund>, sqlx::Error>> + Send;
    /// One of the tenant's orders.
    fn get_order(
        pool: &Pool<Self>,
        tenant: &str,
        id: i64,
    ) -> impl Future<Output = Result<Option<Order>, sqlx::Error>> + Send;
    /// What the tenant has.
    fn counts(
        pool: &Pool<Self>,
        tenant: &str,
    ) -> impl Future<Output = Result<Counts, sqlx::Error>> + Send;
    /// The provider's charge under `key`, if it made one: its id and amount.
    fn find_charge(
        pool: &Pool<Self>,
        key: &str,
    ) -> impl Future<Output = Result<Option<(String, i64)>, sqlx::Error>> + Send;
    /// The simulated provider's charge under `key` (its own idempotency: a
    /// second charge under one key is the first): the charge's id and the
    /// amount it charged, which is the first charge's where there was one.
    fn charge(
        pool: &Pool<Self>,
        key: &str,
        tenant: &str,
        amount_cents: i64,
    ) -> impl Future<Output = Result<(String, i64), sqlx::Error>> + Send;
}

const ORDER_COLUMNS: &str = "id, sku, quantity, amount_cents, currency, note";

const COUNTS: &str = "SELECT (SELECT COUNT(*) FROM grpc_orders WHERE tenant_id = $1), \
     (SELECT COUNT(*) FROM grpc_refunds WHERE tenant_id = $1), \
     (SELECT COUNT(*) FROM grpc_charges WHERE tenant_id = $1)";

/// PostgreSQL and SQLite: the same statements, their own tables' DDL.
macro_rules! dollar_store {
    ($db:ty, $tables:expr) => {
        impl Store for $db {
            async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
                for statement in $tables {
                    sqlx::query(statement).execute(pool).await?;
                }
                Ok(())
            }

            async fn insert_order(
                conn: &mut Self::Connection,
                new: NewOrder<'_>,
            ) -> Result<Order, sqlx::Error> {
                let m = new.message;
                sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO grpc_orders (tenant_id, sku, quantity, amount_cents, currency, note) \
                     VALUES ($1, $2, $3, $4, $5, $6) RETURNING {ORDER_COLUMNS}"
                )))
                .bind(new.tenant)
                .bind(&m.sku)
                .bind(m.quantity)
                .bind(m.amount_cents)
                .bind(new.currency)
                .bind(&m.note)
                .fetch_one(conn)
                .await
                .map(order)
            }

            async fn insert_refund(
                conn: &mut Self::Connection,
                tenant: &str,
                order_id: i64,
                amount_cents: i64,
            ) -> Result<Option<Refund>, sqlx::Error> {
                sqlx::query_as::<_, (i64, i64, i64)>(
                    "INSERT INTO grpc_refunds (tenant_id, order_id, amount_cents) \
                     SELECT $1, o.id, $3 FROM grpc_orders o WHERE o.tenant_id = $1 AND o.id = $2 \
                     RETURNING id, order_id, amount_cents",
                )
                .bind(tenant)
                .bind(order_id)
                .bind(amount_cents)
                .fetch_optional(conn)
                .await
                .map(|r| {
                    r.map(|(id, order_id, amount_cents)| Refund {
                        id,
                        order_id,
                        amount_cents,
                    })
                })
            }

            async fn get_order(
                pool: &Pool<Self>,
                tenant: &str,
                id: i64,
            ) -> Result<Option<Order>, sqlx::Error> {
                sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
                    "SELECT {ORDER_COLUMNS} FROM grpc_orders WHERE tenant_id = $1 AND id = $2"
                )))
                .bind(tenant)
                .bind(id)
                .fetch_optional(pool)
                .await
                .map(|r| r.map(order))
            }

            async fn counts(pool: &Pool<Self>, tenant: &str) -> Result<Counts, sqlx::Error> {
                let (orders, refunds, charges) = sqlx::query_as::<_, (i64, i64, i64)>(COUNTS)
                    .bind(tenant)
                    .fetch_one(pool)
                    .await?;
                Ok(Counts {
                    orders,
                    refunds,
                    charges,
                })
            }

            async fn find_charge(
                pool: &Pool<Self>,
                key: &str,
            ) -> Result<Option<(String, i64)>, sqlx::Error> {
                let row: Option<(i64, i64)> = sqlx::query_as(
                    "SELECT id, amount_cents FROM grpc_charges WHERE charge_key = $1",
                )
                .bind(key)
                .fetch_optional(pool)
                .await?;
                Ok(row.map(|(id, amount)| (format!("ch_{id}"), amount)))
            }

            async fn charge(
                pool: &Pool<Self>,
                key: &str,
                tenant: &str,
                amount_cents: i64,
            ) -> Result<(String, i64), sqlx::Error> {
                sqlx::query(
                    "INSERT INTO grpc_charges (charge_key, tenant_id, amount_cents) VALUES ($1, $2, $3) \
                     ON CONFLICT (charge_key) DO NOTHING",
                )
                .bind(key)
                .bind(tenant)
                .bind(amount_cents)
                .execute(pool)
                .await?;
                let (id, charged): (i64, i64) = sqlx::query_as(
                    "SELECT id, amount_cents FROM grpc_charges WHERE charge_key = $1",
                )
                .bind(key)
                .fetch_one(pool)
                .await?;
                Ok((format!("ch_{id}"), charged))
            }
        }
    };
}

dollar_store!(
    Postgres,
    [
        "CREATE TABLE IF NOT EXISTS grpc_orders (id bigserial PRIMARY KEY, tenant_id text NOT NULL, \
         sku text NOT NULL, quantity integer NOT NULL, amount_cents bigint NOT NULL, \
         currency text NOT NULL, note text NOT NULL)",
        "CREATE TABLE IF NOT EXISTS grpc_refunds (id bigserial PRIMARY KEY, tenant_id text NOT NULL, \
         order_id bigint NOT NULL, amount_cents bigint NOT NULL)",
        "CREATE TABLE IF NOT EXISTS grpc_charges (id bigserial PRIMARY KEY, charge_key text NOT NULL UNIQUE, \
         tenant_id text NOT NULL, amount_cents bigint NOT NULL)",
    ]
);

dollar_store!(
    Sqlite,
    [
        "CREATE TABLE IF NOT EXISTS grpc_orders (id INTEGER PRIMARY KEY AUTOINCREMENT, \
         tenant_id TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL, \
         amount_cents INTEGER NOT NULL, currency TEXT NOT NULL, note TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS grpc_refunds (id INTEGER PRIMARY KEY AUTOINCREMENT, \
         tenant_id TEXT NOT NULL, order_id INTEGER NOT NULL, amount_cents INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS grpc_charges (id INTEGER PRIMARY KEY AUTOINCREMENT, \
         charge_key TEXT NOT NULL UNIQUE, tenant_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
    ]
);

impl Store for MySql {
    async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        for statement in [
            "CREATE TABLE IF NOT EXISTS grpc_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             tenant_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             sku VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL, quantity INT NOT NULL, \
             amount_cents BIGINT NOT NULL, currency CHAR(3) NOT NULL, \
             note MEDIUMTEXT CHARACTER SET utf8mb4 NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS grpc_refunds (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             tenant_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS grpc_charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             charge_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL UNIQUE, \
             tenant_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             amount_cents BIGINT NOT NULL) ENGINE = InnoDB",
        ] {
            sqlx::query(statement).execute(pool).await?;
        }
        Ok(())
    }

    async fn insert_order(
        conn: &mut Self::Connection,
        new: NewOrder<'_>,
    ) -> Result<Order, sqlx::Error> {
        let m = new.message;
        let id = sqlx::query(
            "INSERT INTO grpc_orders (tenant_id, sku, quantity, amount_cents, currency, note) \
             VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(new.tenant)
        .bind(&m.sku)
        .bind(m.quantity)
        .bind(m.amount_cents)
        .bind(new.currency)
        .bind(&m.note)
        .execute(&mut *conn)
        .await?
        .last_insert_id();
        Ok(Order {
            id: i64::try_from(id).unwrap_or(i64::MAX),
            sku: m.sku.clone(),
            quantity: m.quantity,
            amount_cents: m.amount_cents,
            currency: new.currency.to_owned(),
            note: m.note.clone(),
        })
    }

    async fn insert_refund(
        conn: &mut Self::Connection,
        tenant: &str,
        order_id: i64,
        amount_cents: i64,
    ) -> Result<Option<Refund>, sqlx::Error> {
        let done = sqlx::query(
            "INSERT INTO grpc_refunds (tenant_id, order_id, amount_cents) \
             SELECT ?, o.id, ? FROM grpc_orders o WHERE o.tenant_id = ? AND o.id = ?",
        )
        .bind(tenant)
        .bind(amount_cents)
        .bind(tenant)
        .bind(order_id)
        .execute(&mut *conn)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        Ok(Some(Refund {
            id: i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX),
            order_id,
            amount_cents,
        }))
    }

    async fn get_order(
        pool: &Pool<Self>,
        tenant: &str,
        id: i64,
    ) -> Result<Option<Order>, sqlx::Error> {
        sqlx::query_as::<_, OrderRow>(
            "SELECT id, sku, quantity, amount_cents, currency, note FROM grpc_orders \
             WHERE tenant_id = ? AND id = ?",
        )
        .bind(tenant)
        .bind(id)
        .fetch_optional(pool)
        .await
        .map(|r| r.map(order))
    }

    async fn counts(pool: &Pool<Self>, tenant: &str) -> Result<Counts, sqlx::Error> {
        let (orders, refunds, charges) = sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT (SELECT COUNT(*) FROM grpc_orders WHERE tenant_id = ?), \
             (SELECT COUNT(*) FROM grpc_refunds WHERE tenant_id = ?), \
             (SELECT COUNT(*) FROM grpc_charges WHERE tenant_id = ?)",
        )
        .bind(tenant)
        .bind(tenant)
        .bind(tenant)
        .fetch_one(pool)
        .await?;
        Ok(Counts {
            orders,
            refunds,
            charges,
        })
    }

    async fn find_charge(
        pool: &Pool<Self>,
        key: &str,
    ) -> Result<Option<(String, i64)>, sqlx::Error> {
        let row: Option<(i64, i64)> =
            sqlx::query_as("SELECT id, amount_cents FROM grpc_charges WHERE charge_key = ?")
                .bind(key)
                .fetch_optional(pool)
                .await?;
        Ok(row.map(|(id, amount)| (format!("ch_{id}"), amount)))
    }

    async fn charge(
        pool: &Pool<Self>,
        key: &str,
        tenant: &str,
        amount_cents: i64,
    ) -> Result<(String, i64), sqlx::Error> {
        sqlx::query("INSERT IGNORE INTO grpc_charges (charge_key, tenant_id, amount_cents) VALUES (?, ?, ?)")
            .bind(key)
            .bind(tenant)
            .bind(amount_cents)
            .execute(pool)
            .await?;
        let (id, charged): (i64, i64) =
            sqlx::query_as("SELECT id, amount_cents FROM grpc_charges WHERE charge_key = ?")
                .bind(key)
                .fetch_one(pool)
                .await?;
        Ok((format!("ch_{id}"), charged))
    }
}
