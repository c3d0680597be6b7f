//! The service: `CreateOrder` and `CreateRefund` in the transactional mode (the
//! key claimed in the method's own transaction), `CreatePayment` in leased mode
//! (the charge happens at the provider, outside the database), stamped once per
//! database and lease store.

use std::time::Duration;

use tonic::metadata::MetadataMap;
use tonic::{Request, Status};

use crate::auth::Caller;
use crate::pb::CreateOrderRequest;

/// What every stamping of the service shares besides its databases.
#[derive(Debug, Clone)]
pub struct Knobs {
    /// `ORDERS_LATENCY_MS`: slow work inside the transaction, after the insert.
    pub latency: Duration,
    /// `ORDERS_HOLD_FILE`: while this file exists, `CreateOrder` waits inside
    /// its transaction, after the insert (see [`Knobs::held`]).
    pub hold_file: Option<std::path::PathBuf>,
    /// `PAYMENTS_PROVIDER_LATENCY_MS`: the provider's latency per charge.
    pub provider_latency: Duration,
    /// `PAYMENTS_PROVIDER_HOLD_FILE`: while this file exists, a charge is made
    /// and its answer waits (see [`Knobs::provider_held`]).
    pub provider_hold_file: Option<std::path::PathBuf>,
    /// `PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE`: how many of the provider's next
    /// charges time out after they were made (the outcome is then uncertain).
    pub timeouts_after_charge: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Knobs {
    /// Waits while the hold file exists: a test holds a call mid-way (its key
    /// claimed, its transaction open) for as long as it needs, and releases it
    /// by removing the file, with no timing of its own to guess.
    pub async fn held(&self) {
        let Some(path) = &self.hold_file else {
            return;
        };
        wait_while_exists(path).await;
    }

    /// Waits while the provider's hold file exists: a test holds a payment
    /// after its charge, its lease held, and lets it go by removing the file.
    pub async fn provider_held(&self) {
        if let Some(path) = &self.provider_hold_file {
            wait_while_exists(path).await;
        }
    }

    /// Whether this charge's answer is lost: one of the timeouts still due.
    pub fn charge_times_out(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.timeouts_after_charge
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Polls for `path` to be gone (a test's hold on a call, released by
/// removing the file).
async fn wait_while_exists(path: &std::path::Path) {
    while path.exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The order's currency: the `x-currency` metadata entry, three upper-case
/// letters.
pub fn currency(metadata: &MetadataMap) -> Result<String, Status> {
    let value = metadata
        .get("x-currency")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if value.len() == 3 && value.bytes().all(|b| b.is_ascii_uppercase()) {
        Ok(value.to_owned())
    } else {
        Err(Status::invalid_argument(
            "send the order's currency in the `x-currency` metadata entry: three upper-case letters",
        ))
    }
}

/// The message's own rules.
pub fn validate(m: &CreateOrderRequest) -> Result<(), Status> {
    let bad = |why: &str| Err(Status::invalid_argument(why.to_owned()));
    if m.sku.is_empty() || m.sku.chars().count() > 64 || m.sku.contains('\0') {
        return bad("sku must be 1 to 64 characters, without U+0000");
    }
    if m.quantity < 1 {
        return bad("quantity must be at least 1");
    }
    if m.amount_cents < 0 {
        return bad("amount_cents must not be negative");
    }
    if m.note.contains('\0') {
        return bad("note must not contain U+0000");
    }
    Ok(())
}

/// A database error: `INTERNAL`, which rolls back and frees the key.
pub fn internal(e: sqlx::Error) -> Status {
    tracing::error!(error = %e, "grpc-orders: database error");
    Status::internal("the database failed; retry with the same key: it is safe")
}

/// The caller of a method that reads (no key): the interceptor's.
pub fn caller<M>(request: &Request<M>) -> Result<&Caller, Status> {
    request
        .extensions()
        .get::<Caller>()
        .ok_or_else(|| Status::unauthenticated("send `authorization: Bearer <tenant>`"))
}

/// One stamping of the service: `$name` on the database `$db`, its payments'
/// leases on `$lease` (the same database, or Redis with `redis`).
macro_rules! orders_service {
    ($name:ident, $db:ty, $lease:ty $(, redis = $redis:ident)?) => {
        /// The orders service on one database and lease store.
        #[derive(Clone)]
        pub struct $name {
            pub idem: idem_runtime::Idem<$db>,
            pub pool: sqlx::Pool<$db>,
            $(pub $redis: idem_runtime::Idem<idem_runtime::redis::Redis>,)?
            pub knobs: $crate::service::Knobs,
        }

        impl idem_runtime::grpc::FromRef<$name> for idem_runtime::Idem<$db> {
            fn from_ref(s: &$name) -> Self {
                s.idem.clone()
            }
        }

        $(
            impl idem_runtime::grpc::FromRef<$name> for idem_runtime::Idem<idem_runtime::redis::Redis> {
                fn from_ref(s: &$name) -> Self {
                    s.$redis.clone()
                }
            }
        )?

        #[tonic::async_trait]
        impl $crate::pb::orders_server::Orders for $name {
            /// Creates an order in the transaction that holds the key.
            #[idem_runtime::idempotent(
                operation = "create-order",
                retention = "24h",
                key = "metadata",
                fingerprint(body, header = "x-currency")
            )]
            async fn create_order(
                &self,
                #[tenant] caller: idem_runtime::grpc::Extension<$crate::auth::Caller>,
                tx: &mut idem_runtime::Tx<$db>,
                request: tonic::Request<$crate::pb::CreateOrderRequest>,
            ) -> Result<tonic::Response<$crate::pb::Order>, tonic::Status> {
                let currency = $crate::service::currency(request.metadata())?;
                let message = request.get_ref();
                $crate::service::validate(message)?;
                let new = $crate::store::NewOrder {
                    tenant: &caller.tenant,
                    message,
                    currency: &currency,
                };
                let order = <$db as $crate::store::Store>::insert_order(&mut **tx, new)
                    .await
                    .map_err($crate::service::internal)?;
                if !self.knobs.latency.is_zero() {
                    tokio::time::sleep(self.knobs.latency).await;
                }
                self.knobs.held().await;
                Ok(tonic::Response::new(order))
            }

            /// Refunds one of the tenant's orders; `NOT_FOUND` is stored.
            #[idem_runtime::idempotent(
                operation = "create-refund",
                retention = "24h",
                key = "body.request_id"
            )]
            async fn create_refund(
                &self,
                #[tenant] caller: idem_runtime::grpc::Extension<$crate::auth::Caller>,
                tx: &mut idem_runtime::Tx<$db>,
                request: tonic::Request<$crate::pb::CreateRefundRequest>,
            ) -> Result<tonic::Response<$crate::pb::Refund>, tonic::Status> {
                let m = request.get_ref();
                if m.amount_cents < 0 {
                    return Err(tonic::Status::invalid_argument("amount_cents must not be negative"));
                }
                match <$db as $crate::store::Store>::insert_refund(&mut **tx, &caller.tenant, m.order_id, m.amount_cents)
                    .await
                    .map_err($crate::service::internal)?
                {
                    Some(refund) => Ok(tonic::Response::new(refund)),
                    None => Err(tonic::Status::not_found(format!("no order {} for this tenant", m.order_id))),
                }
            }

            /// Charges a card at the provider, holding a lease.
            #[idem_runtime::idempotent(
                operation = "create-payment",
                retention = "24h",
                key = "metadata",
                lease = "30s"
            )]
            async fn create_payment(
                &self,
                #[tenant] caller: idem_runtime::grpc::Extension<$crate::auth::Caller>,
                lease: &mut idem_runtime::Lease<$lease>,
                request: tonic::Request<$crate::pb::CreatePaymentRequest>,
            ) -> Result<tonic::Response<$crate::pb::Payment>, tonic::Status> {
                let amount_cents = request.get_ref().amount_cents;
                if amount_cents < 1 {
                    return Err(tonic::Status::invalid_argument("amount_cents must be at least 1"));
                }
                if amount_cents > 1_000_000 {
                    return Err(tonic::Status::failed_precondition("the card was declined"));
                }
                if !self.knobs.provider_latency.is_zero() {
                    tokio::time::sleep(self.knobs.provider_latency).await;
                }
                // The provider's own idempotency takes the downstream key.
                // The charge's own amount, not the request's: a key given back
                // after a failure that came after the charge (its answer lost)
                // may come again with another amount, and the provider answers
                // with the first charge.
                let (charge_id, amount_cents) = <$db as $crate::store::Store>::charge(
                    &self.pool,
                    &lease.downstream_key(),
                    &caller.tenant,
                    amount_cents,
                )
                .await
                .map_err(|e| {
                    tracing::error!(error = %e, "grpc-orders: the provider failed");
                    tonic::Status::unavailable("the payment provider is unavailable; retry with the same key")
                })?;
                self.knobs.provider_held().await;
                if self.knobs.charge_times_out() {
                    // The charge was made, its answer lost: only the reconciler,
                    // asking the provider, can tell.
                    return Err(idem_runtime::grpc::uncertain(
                        "the payment provider timed out after it may have charged",
                    ));
                }
                Ok(tonic::Response::new($crate::pb::Payment { charge_id, amount_cents }))
            }

            async fn get_order(
                &self,
                request: tonic::Request<$crate::pb::GetOrderRequest>,
            ) -> Result<tonic::Response<$crate::pb::Order>, tonic::Status> {
                let caller = $crate::service::caller(&request)?;
                <$db as $crate::store::Store>::get_order(&self.pool, &caller.tenant, request.get_ref().id)
                    .await
                    .map_err($crate::service::internal)?
                    .map(tonic::Response::new)
                    .ok_or_else(|| tonic::Status::not_found("no such order"))
            }

            async fn count_orders(
                &self,
                request: tonic::Request<$crate::pb::CountOrdersRequest>,
            ) -> Result<tonic::Response<$crate::pb::Counts>, tonic::Status> {
                let caller = $crate::service::caller(&request)?;
                <$db as $crate::store::Store>::counts(&self.pool, &caller.tenant)
                    .await
                    .map(tonic::Response::new)
                    .map_err($crate::service::internal)
            }
        }
    };
}

orders_service!(OnPostgres, sqlx::Postgres, sqlx::Postgres);
orders_service!(OnSqlite, sqlx::Sqlite, sqlx::Sqlite);
orders_service!(OnMySql, sqlx::MySql, sqlx::MySql);
orders_service!(
    OnPostgresRedis,
    sqlx::Postgres,
    idem_runtime::redis::Redis,
    redis = redis
);
orders_service!(
    OnSqliteRedis,
    sqlx::Sqlite,
    idem_runtime::redis::Redis,
    redis = redis
);
orders_service!(
    OnMySqlRedis,
    sqlx::MySql,
    idem_runtime::redis::Redis,
    redis = redis
);
