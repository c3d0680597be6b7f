//! The HTTP routes, on each of the three databases. `POST /orders`, `/refunds`,
//! `/payments` and `/exports` (a long operation, with its resources under
//! `/operations`) are made idempotent by key with `#[idempotent]`; `pay` and
//! `ship` are idempotent state transitions; `GET` and `DELETE` are idempotent by
//! nature and need no key.

use std::time::Duration;

use axum::extract::FromRef;
use idem_runtime::Backend;
use idem_runtime::Idem;
use serde::{Deserialize, Serialize};
use sqlx::{FromRow, Pool};

use crate::input::Validate;

/// What every handler shares, for one database (PostgreSQL, SQLite or MySQL).
pub struct AppState<DB: Backend> {
    pub idem: Idem<DB>,
    pub pool: Pool<DB>,
    /// `ORDERS_LATENCY_MS`: slow work inside the transaction, after the claim.
    pub latency: Duration,
    /// `ORDERS_HOLD_FILE`: while this file exists, an order or refund waits
    /// inside its transaction, after the claim (see [`AppState::slow_work`]).
    pub hold_file: Option<std::sync::Arc<std::path::Path>>,
    /// `EXPORTS_DURATION_MS`: how long an export (`POST /exports`) works.
    pub export_duration: Duration,
    /// The simulated payment provider of `POST /payments`.
    pub provider: std::sync::Arc<crate::payments::Provider>,
}

// Derived Clone would ask for `DB: Clone`, which the database markers are not.
impl<DB: Backend> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        AppState {
            idem: self.idem.clone(),
            pool: self.pool.clone(),
            latency: self.latency,
            hold_file: self.hold_file.clone(),
            export_duration: self.export_duration,
            provider: self.provider.clone(),
        }
    }
}

impl<DB: Backend> AppState<DB> {
    /// The slow work inside an order's or a refund's transaction: the latency,
    /// then as long as the hold file exists, so that a test can hold a request
    /// mid-way (its key claimed, its transaction open) for as long as it needs
    /// and let it go by removing the file, with no timing of its own to guess.
    async fn slow_work(&self) {
        slow_work(self.latency).await;
        if let Some(path) = &self.hold_file {
            while path.exists() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

impl<DB: Backend> FromRef<AppState<DB>> for Idem<DB> {
    fn from_ref(s: &AppState<DB>) -> Idem<DB> {
        s.idem.clone()
    }
}

/// `POST /payments` with its leases on Redis (`IDEM_LEASE_STORE`): the same
/// handler as on the database, its lease a `Lease<Redis>`.
pub mod redis_payments {
    use axum::extract::{FromRef, State};
    use idem_runtime::redis::Redis;
    use idem_runtime::{Idem, Lease, idempotent};

    use crate::auth::Caller;
    use crate::input::ValidJson;

    /// What the Redis-leased `POST /payments` needs.
    #[derive(Clone)]
    pub struct PaymentsState {
        pub idem: Idem<Redis>,
        pub provider: std::sync::Arc<crate::payments::Provider>,
    }

    impl FromRef<PaymentsState> for Idem<Redis> {
        fn from_ref(s: &PaymentsState) -> Idem<Redis> {
            s.idem.clone()
        }
    }

    /// Charges a card; the lease lives in Redis, the charge at the provider.
    #[utoipa::path(post, path = "/payments", request_body = crate::payments::NewPayment,
        responses((status = 201, description = "The charge", body = crate::payments::Payment),
            (status = 402, description = "The card was declined (over 1,000,000 cents): problem type `urn:orders:problem:card-declined` (stored, and replayed)"),
            (status = 503, description = "The payment provider stayed unavailable through the retries; this request charged nothing (a retry after a takeover may still find the first execution's charge, under the same downstream key): problem type `urn:orders:problem:provider-unavailable`, with `Retry-After`")))]
    #[idempotent(operation = "create-payment", retention = "24h", lease = "30s")]
    pub async fn create_payment(
        #[tenant] _caller: Caller,
        State(app): State<PaymentsState>,
        lease: &mut Lease<Redis>,
        ValidJson(cmd): ValidJson<crate::payments::NewPayment>,
    ) -> axum::response::Response {
        crate::payments::charge(&app.provider, lease.downstream_key(), cmd).await
    }
}

#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewOrder {
    /// 1 to 64 characters, without U+0000.
    #[schema(min_length = 1, max_length = 64, pattern = r"^[^\x00]*$")]
    sku: String,
    #[serde(deserialize_with = "crate::input::whole")]
    #[schema(minimum = 1)]
    quantity: i32,
    #[serde(deserialize_with = "crate::input::whole")]
    #[schema(minimum = 0)]
    amount_cents: i64,
    /// Without U+0000.
    #[serde(default)]
    #[schema(pattern = r"^[^\x00]*$")]
    note: Option<String>,
}

impl Validate for NewOrder {
    fn validate(&self) -> Result<(), String> {
        if self.sku.is_empty() || self.sku.chars().count() > 64 {
            return Err("sku must be 1 to 64 characters".into());
        }
        if self.quantity < 1 {
            return Err("quantity must be at least 1".into());
        }
        if self.amount_cents < 0 {
            return Err("amount_cents must not be negative".into());
        }
        // PostgreSQL's text cannot hold U+0000: refused here, as a client error
        // on both backends, rather than a 500 from the INSERT on one of them.
        if self.sku.contains('\0') || self.note.as_deref().is_some_and(|n| n.contains('\0')) {
            return Err("sku and note must not contain U+0000".into());
        }
        Ok(())
    }
}

#[derive(Debug, Serialize, FromRow, utoipa::ToSchema)]
pub struct Order {
    id: i64,
    sku: String,
    quantity: i32,
    amount_cents: i64,
    currency: String,
    note: Option<String>,
    created_at: String,
}

#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewRefund {
    #[serde(deserialize_with = "crate::input::whole")]
    order_id: i64,
    #[serde(deserialize_with = "crate::input::whole")]
    #[schema(minimum = 0)]
    amount_cents: i64,
}

impl Validate for NewRefund {
    fn validate(&self) -> Result<(), String> {
        if self.amount_cents < 0 {
            return Err("amount_cents must not be negative".into());
        }
        Ok(())
    }
}

#[derive(Debug, Serialize, FromRow, utoipa::ToSchema)]
pub struct Refund {
    id: i64,
    order_id: i64,
    amount_cents: i64,
}

/// The handlers that touch the database, written once and stamped per backend:
/// `#[idempotent]` handlers are concrete (the transaction's type picks the store),
/// so each backend gets its own copy, with the few SQL spellings that differ
/// passed in.
///
/// * `order_columns`: the `SELECT` list of an [`Order`].
macro_rules! backend_routes {
    // PostgreSQL and SQLite: `$n` placeholders and `RETURNING`.
    (db = $db:ty, order_columns = $order_columns:expr $(,)?) => {
        backend_routes!(@ db = $db, order_columns = $order_columns, statements = {
            async fn insert_order(
                tx: &mut Tx<Db>,
                tenant: &str,
                cmd: &NewOrder,
                currency: &str,
            ) -> Result<Order, sqlx::Error> {
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) \
                     VALUES ($1, $2, $3, $4, $5, $6) RETURNING {ORDER_COLUMNS}"
                )))
                .bind(tenant)
                .bind(&cmd.sku)
                .bind(cmd.quantity)
                .bind(cmd.amount_cents)
                .bind(currency)
                .bind(&cmd.note)
                .fetch_one(&mut **tx)
                .await
            }

            async fn insert_refund(
                tx: &mut Tx<Db>,
                tenant: &str,
                cmd: &NewRefund,
            ) -> Result<Option<Refund>, sqlx::Error> {
                sqlx::query_as(
                    "INSERT INTO refunds (tenant_id, order_id, amount_cents) \
                     SELECT $1, o.id, $3 FROM orders o WHERE o.tenant_id = $1 AND o.id = $2 \
                     RETURNING id, order_id, amount_cents",
                )
                .bind(tenant)
                .bind(cmd.order_id)
                .bind(cmd.amount_cents)
                .fetch_optional(&mut **tx)
                .await
            }

            const SELECT_ORDERS: &str = "WHERE tenant_id = $1 ORDER BY id";
            const COUNT_ORDERS: &str = "SELECT count(*) FROM orders WHERE tenant_id = $1";
            const SELECT_ORDER: &str = "WHERE tenant_id = $1 AND id = $2";
            const DELETE_ORDER: &str = "DELETE FROM orders WHERE tenant_id = $1 AND id = $2";
            // Bound: the order's id, then its tenant.
            const PAY_EFFECT: &str = "INSERT INTO order_payments (tenant_id, order_id, amount_cents) \
                 SELECT tenant_id, id, amount_cents FROM orders WHERE id = $1 AND tenant_id = $2";
            const SHIP_EFFECT: &str = "INSERT INTO shipments (tenant_id, order_id) VALUES ($2, $1)";
        });
    };
    // A database with its own statements (MySQL: `?` placeholders bound in the
    // order they appear, no `RETURNING`).
    (@ db = $db:ty, order_columns = $order_columns:expr, statements = { $($statements:item)* }) => {
        use axum::extract::State;
        use axum::http::{StatusCode, header};
        use axum::response::IntoResponse;
        use axum::routing::{get, post};
        use axum::{Json, Router};
        use idem_runtime::{Lease, Tx, idempotent, operations};

        use super::*;
        use crate::auth::Caller;
        use crate::fulfilment::OrderStatus;
        use crate::input::{Currency, OrderId, ValidJson};
        use crate::problems::ApiError;

        type Db = $db;
        const ORDER_COLUMNS: &str = $order_columns;

        $($statements)*

        /// The service's routes on this backend.
        /// The service's routes on this backend; `POST /payments` on the Redis
        /// lease store when `payments` is given (`IDEM_LEASE_STORE`).
        pub fn router(
            state: AppState<Db>,
            payments: Option<super::redis_payments::PaymentsState>,
        ) -> Router {
            let create_payment = match payments {
                Some(on_redis) => post(super::redis_payments::create_payment).with_state(on_redis),
                None => post(create_payment),
            };
            Router::new()
                .route("/orders", post(create_order).get(list_orders))
                .route("/orders/{id}", get(get_order).delete(delete_order))
                .route("/orders/{id}/pay", post(pay))
                .route("/orders/{id}/ship", post(ship))
                .route("/refunds", post(create_refund))
                .route("/payments", create_payment)
                .route("/exports", post(create_export))
                // The resources of long operations (`POST /exports`), at the path
                // their `Location` names, for the caller's tenant only.
                .nest(
                    state.idem.operations_path(),
                    operations::router::<Caller, Db, AppState<Db>>(),
                )
                .route("/provider", get(crate::payments::provider_summary))
                .route("/openapi.json", get(openapi_json))
                .with_state(state)
        }

        /// The service's OpenAPI document: the routes' own `#[utoipa::path]`s,
        /// then what every route answers around its handler (`OrdersAnswers`:
        /// authentication, input errors, a database out of reach), then what
        /// idem answers on the idempotent ones (`IdemOpenApi`), in that order.
        /// The document is the same on every backend.
        // utoipa's `modifiers(&Name)` takes a name, not a path: hence the `use`s.
        use idem_runtime::openapi::IdemOpenApi;
        use crate::openapi::OrdersAnswers;
        #[derive(utoipa::OpenApi)]
        #[openapi(
            info(title = "orders", description = "The idem example service: orders, refunds and payments that are safe to retry."),
            paths(create_order, list_orders, get_order, delete_order, pay, ship, create_refund, create_payment, create_export),
            modifiers(&OrdersAnswers, &IdemOpenApi),
        )]
        pub struct ApiDoc;

        /// `GET /openapi.json`.
        async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
            use utoipa::OpenApi as _;
            Json(ApiDoc::openapi())
        }

        /// Creates an order. A retry with the same key gets the same 201 back.
        // `#[utoipa::path]` above `#[idempotent]`: utoipa reads the handler as written.
        #[utoipa::path(post, path = "/orders", request_body = NewOrder,
            params(("X-Currency" = String, Header, pattern = "^[A-Z]{3}$",
                description = "The order's currency: three upper-case letters (part of the request's identity).")),
            responses((status = 201, description = "The order, created", body = Order,
                headers(("Location" = String, description = "The order's URL")))))]
        #[idempotent(
            operation = "create-order",
            retention = "24h",
            fingerprint(body, header = "x-currency")
        )]
        async fn create_order(
            #[tenant] caller: Caller,
            Currency(currency): Currency,
            State(app): State<AppState<Db>>,
            tx: &mut Tx<Db>,
            ValidJson(cmd): ValidJson<NewOrder>,
        ) -> Result<impl IntoResponse, ApiError> {
            let order = insert_order(tx, &caller.tenant, &cmd, &currency).await?;
            app.slow_work().await;
            let location = format!("/orders/{}", order.id);
            Ok((
                StatusCode::CREATED,
                [(header::LOCATION, location)],
                Json(order),
            ))
        }

        /// Refunds an order. An order this tenant does not have is a committed
        /// business rejection: the 404 is stored and replayed like a success.
        #[utoipa::path(post, path = "/refunds", request_body = NewRefund,
            responses((status = 201, description = "The refund", body = Refund),
                (status = 404, description = "No such order for this tenant (stored, and replayed): problem type `urn:orders:problem:not-found`")))]
        #[idempotent(operation = "create-refund", retention = "24h")]
        async fn create_refund(
            #[tenant] caller: Caller,
            State(app): State<AppState<Db>>,
            tx: &mut Tx<Db>,
            ValidJson(cmd): ValidJson<NewRefund>,
        ) -> Result<axum::response::Response, ApiError> {
            let refund = insert_refund(tx, &caller.tenant, &cmd).await?;
            app.slow_work().await;
            Ok(match refund {
                Some(r) => (StatusCode::CREATED, Json(r)).into_response(),
                // Ok, not Err: the rejection is the operation's result, and is kept.
                None => ApiError::not_found("order").into_response(),
            })
        }

        /// The tenant's orders.
        #[utoipa::path(get, path = "/orders", responses((status = 200, description = "The orders", body = Vec<Order>)))]
        async fn list_orders(
            caller: Caller,
            State(app): State<AppState<Db>>,
        ) -> Result<Json<Vec<Order>>, ApiError> {
            let orders = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {ORDER_COLUMNS} FROM orders {SELECT_ORDERS}"
            )))
            .bind(&caller.tenant)
            .fetch_all(&app.pool)
            .await?;
            Ok(Json(orders))
        }

        /// One order.
        #[utoipa::path(get, path = "/orders/{id}", params(("id" = i64, Path, description = "The order's id")),
            responses((status = 200, description = "The order", body = Order),
                (status = 404, description = "No such order for this tenant: problem type `urn:orders:problem:not-found`")))]
        async fn get_order(
            caller: Caller,
            State(app): State<AppState<Db>>,
            OrderId(id): OrderId,
        ) -> Result<Json<Order>, ApiError> {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {ORDER_COLUMNS} FROM orders {SELECT_ORDER}"
            )))
            .bind(&caller.tenant)
            .bind(id)
            .fetch_optional(&app.pool)
            .await?
            .map(Json)
            .ok_or_else(|| ApiError::not_found("order"))
        }

        /// Deletes an order; idempotent by nature, no key needed.
        #[utoipa::path(delete, path = "/orders/{id}", params(("id" = i64, Path, description = "The order's id")),
            responses((status = 204, description = "Deleted"),
                (status = 404, description = "No such order for this tenant: problem type `urn:orders:problem:not-found`")))]
        async fn delete_order(
            caller: Caller,
            State(app): State<AppState<Db>>,
            OrderId(id): OrderId,
        ) -> Result<StatusCode, ApiError> {
            let done = sqlx::query(DELETE_ORDER)
                .bind(&caller.tenant)
                .bind(id)
                .execute(&app.pool)
                .await?;
            if done.rows_affected() == 0 {
                return Err(ApiError::not_found("order"));
            }
            Ok(StatusCode::NO_CONTENT)
        }

        /// Charges a card. Leased: the claim commits before the provider is called,
        /// which is given the lease's downstream key (see `payments`).
        #[utoipa::path(post, path = "/payments", request_body = crate::payments::NewPayment,
            responses((status = 201, description = "The charge", body = crate::payments::Payment),
                (status = 402, description = "The card was declined (over 1,000,000 cents): problem type `urn:orders:problem:card-declined` (stored, and replayed)"),
                (status = 503, description = "The payment provider stayed unavailable through the retries; this request charged nothing (a retry after a takeover may still find the first execution's charge, under the same downstream key): problem type `urn:orders:problem:provider-unavailable`, with `Retry-After`")))]
        #[idempotent(operation = "create-payment", retention = "24h", lease = "30s")]
        async fn create_payment(
            #[tenant] _caller: Caller,
            State(app): State<AppState<Db>>,
            lease: &mut Lease<Db>,
            ValidJson(cmd): ValidJson<crate::payments::NewPayment>,
        ) -> axum::response::Response {
            crate::payments::charge(&app.provider, lease.downstream_key(), cmd).await
        }

        /// Exports the tenant's orders: a long operation. Answered `202` at once
        /// with `Location` of the operation's resource; the export works on for
        /// `EXPORTS_DURATION_MS` under its lease, and its `201` is stored and
        /// replayed to retries (and at the resource's `result`) once done.
        #[utoipa::path(post, path = "/exports", request_body = crate::exports::NewExport,
            responses((status = 201, description = "The export", body = crate::exports::Export)))]
        #[idempotent(
            operation = "create-export",
            retention = "24h",
            lease = "6s",
            lease_ceiling = "2h",
            accepted
        )]
        async fn create_export(
            #[tenant] caller: Caller,
            State(app): State<AppState<Db>>,
            lease: &mut Lease<Db>,
            ValidJson(cmd): ValidJson<crate::exports::NewExport>,
        ) -> Result<impl IntoResponse, ApiError> {
            slow_work(app.export_duration).await;
            let orders: i64 = sqlx::query_scalar(COUNT_ORDERS)
                .bind(&caller.tenant)
                .fetch_one(&app.pool)
                .await?;
            Ok((
                StatusCode::CREATED,
                Json(crate::exports::Export {
                    id: lease.downstream_key(),
                    format: cmd.format,
                    orders,
                }),
            ))
        }

        /// Pays an order; paying a paid order again changes nothing.
        #[utoipa::path(post, path = "/orders/{id}/pay", params(("id" = i64, Path, description = "The order's id")),
            responses((status = 200, description = "The order's fulfilment state", body = crate::fulfilment::Step),
                (status = 404, description = "No such order for this tenant: problem type `urn:orders:problem:not-found`"),
                (status = 409, description = "The order is not in a state this step follows: problem type `urn:orders:problem:invalid-transition`"),
                (status = 503, description = "The order could not be locked in time; nothing changed: problem type `urn:orders:problem:busy`, with `Retry-After`")))]
        async fn pay(
            caller: Caller,
            State(app): State<AppState<Db>>,
            OrderId(id): OrderId,
        ) -> Result<Json<serde_json::Value>, ApiError> {
            step(&app, &caller, id, OrderStatus::Paid).await
        }

        /// Ships a paid order; shipping a shipped order again changes nothing.
        #[utoipa::path(post, path = "/orders/{id}/ship", params(("id" = i64, Path, description = "The order's id")),
            responses((status = 200, description = "The order's fulfilment state", body = crate::fulfilment::Step),
                (status = 404, description = "No such order for this tenant: problem type `urn:orders:problem:not-found`"),
                (status = 409, description = "The order is not in a state this step follows: problem type `urn:orders:problem:invalid-transition`"),
                (status = 503, description = "The order could not be locked in time; nothing changed: problem type `urn:orders:problem:busy`, with `Retry-After`")))]
        async fn ship(
            caller: Caller,
            State(app): State<AppState<Db>>,
            OrderId(id): OrderId,
        ) -> Result<Json<serde_json::Value>, ApiError> {
            step(&app, &caller, id, OrderStatus::Shipped).await
        }

        /// One fulfilment step as an idempotent transition (see `fulfilment`).
        async fn step(
            app: &AppState<Db>,
            caller: &Caller,
            id: i64,
            to: OrderStatus,
        ) -> Result<Json<serde_json::Value>, ApiError> {
            use idem_runtime::Backend;
            use idem_runtime::transition::transition;

            for _ in 0..crate::fulfilment::ATTEMPTS {
                let mut tx = <Db as Backend>::begin(&app.pool).await?;
                let tenant = caller.tenant.clone();
                let outcome = transition(
                    &mut tx,
                    &crate::fulfilment::ORDERS,
                    id,
                    Some(&caller.tenant),
                    to,
                    move |conn| {
                        Box::pin(async move {
                            let effect = match to {
                                OrderStatus::Paid => PAY_EFFECT,
                                OrderStatus::Shipped => SHIP_EFFECT,
                                OrderStatus::Created => return Ok(()),
                            };
                            sqlx::query(effect)
                                .bind(id)
                                .bind(&tenant)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(())
                        })
                    },
                )
                .await;
                // None: another step moved the order first; the dropped transaction
                // rolls the effect back and the next attempt sees the new state.
                if let Some(answer) = crate::fulfilment::answer(id, to, outcome)? {
                    tx.commit().await?;
                    return Ok(Json(answer));
                }
            }
            Err(ApiError::internal("the order kept changing concurrently"))
        }
    };
}

async fn slow_work(latency: Duration) {
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
}

/// The routes on PostgreSQL, the reference backend.
pub mod postgres {
    backend_routes!(
        db = sqlx::Postgres,
        order_columns = "id, sku, quantity, amount_cents, currency::text AS currency, note, \
            to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS created_at",
    );
}

/// The routes on MySQL / MariaDB: `created_at` is a UTC `DATETIME(6)`, answered in
/// PostgreSQL's shape.
pub mod mysql {
    backend_routes!(@
        db = sqlx::MySql,
        order_columns = "id, sku, quantity, amount_cents, currency, note, \
            DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ') AS created_at",
        statements = {
            async fn insert_order(
                tx: &mut Tx<Db>,
                tenant: &str,
                cmd: &NewOrder,
                currency: &str,
            ) -> Result<Order, sqlx::Error> {
                sqlx::query(
                    "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note, created_at) \
                     VALUES (?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))",
                )
                .bind(tenant)
                .bind(&cmd.sku)
                .bind(cmd.quantity)
                .bind(cmd.amount_cents)
                .bind(currency)
                .bind(&cmd.note)
                .execute(&mut **tx)
                .await?;
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT {ORDER_COLUMNS} FROM orders WHERE id = LAST_INSERT_ID()"
                )))
                .fetch_one(&mut **tx)
                .await
            }

            async fn insert_refund(
                tx: &mut Tx<Db>,
                tenant: &str,
                cmd: &NewRefund,
            ) -> Result<Option<Refund>, sqlx::Error> {
                let done = sqlx::query(
                    "INSERT INTO refunds (tenant_id, order_id, amount_cents) \
                     SELECT o.tenant_id, o.id, ? FROM orders o WHERE o.tenant_id = ? AND o.id = ?",
                )
                .bind(cmd.amount_cents)
                .bind(tenant)
                .bind(cmd.order_id)
                .execute(&mut **tx)
                .await?;
                if done.rows_affected() == 0 {
                    return Ok(None);
                }
                sqlx::query_as(
                    "SELECT id, order_id, amount_cents FROM refunds WHERE id = LAST_INSERT_ID()",
                )
                .fetch_optional(&mut **tx)
                .await
            }

            const SELECT_ORDERS: &str = "WHERE tenant_id = ? ORDER BY id";
            const COUNT_ORDERS: &str = "SELECT count(*) FROM orders WHERE tenant_id = ?";
            const SELECT_ORDER: &str = "WHERE tenant_id = ? AND id = ?";
            const DELETE_ORDER: &str = "DELETE FROM orders WHERE tenant_id = ? AND id = ?";
            // Bound: the order's id, then its tenant, in the order of the `?`s.
            const PAY_EFFECT: &str = "INSERT INTO order_payments (tenant_id, order_id, amount_cents) \
                 SELECT tenant_id, id, amount_cents FROM orders WHERE id = ? AND tenant_id = ?";
            const SHIP_EFFECT: &str = "INSERT INTO shipments (order_id, tenant_id) VALUES (?, ?)";
        }
    );
}

/// The routes on the embedded SQLite file (`created_at` is stored as text there).
pub mod sqlite {
    backend_routes!(
        db = sqlx::Sqlite,
        order_columns = "id, sku, quantity, amount_cents, currency, note, created_at",
    );
}
