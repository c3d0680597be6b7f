//! # idem: at most once, for every retry
//!
//! A client that times out cannot know whether its `POST` charged the card. It
//! retries with the same `Idempotency-Key`, and idem makes sure the operation runs
//! at most once and every retry gets the same answer.
//!
//! For one tenant, one operation and one key, within the retention window, the
//! service executes at most one accepted logical request, and every retry gets a
//! stable representation of that request's result. The key is claimed **inside
//! the handler's own database transaction**, so the effect and its record commit
//! together or not at all.
//!
//! ```ignore
//! use idem_runtime::{idempotent, Tx};
//!
//! #[idempotent(operation = "create-order", retention = "24h", fingerprint(body, header = "x-currency"))]
//! async fn create_order(#[tenant] caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>)
//!     -> Result<(StatusCode, Json<Order>), ApiError> { /* ... */ }
//! ```
//!
//! ## The attribute path
//!
//! What a service on Axum and sqlx uses, in this order:
//!
//! 1. [`migrate`] at start (idem's table, in its own migrations table);
//! 2. an [`Idem`] built from your pool, in your router state (`FromRef`);
//! 3. a caller type that implements [`TenantScope`] (the key's tenant), marked
//!    `#[tenant]` in the handler;
//! 4. [`idempotent`] on the handler, which writes its effects through `tx: &mut`
//!    [`Tx`] (the transaction that holds the key; `Tx<Sqlite>`, `Tx<MySql>` on
//!    those databases) or, for effects outside the database, `lease: &mut`
//!    [`Lease`] with `lease = "30s"`;
//! 5. a [`Sweeper`] spawned beside the server (retention).
//!
//! **idem's types name their database**, as sqlx's do: `Idem<Postgres>`,
//! `Tx<Postgres>`, `Lease<Sqlite>`, `Tx<MySql>`. There is no default: Cargo
//! features add up over the whole build, so a default that followed them would
//! change what a bare `Tx` means when any dependency enabled another database.
//! A bare `Tx` or `Lease` in a handler is the attribute's compile error.
//!
//! ## By hand
//!
//! Without the macro, the same promise is three calls: [`claim`] in your
//! transaction, do the work, [`Execution::complete`], commit:
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::{claim, Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, StoredResponse};
//!
//! # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let key = IdempotencyKey::parse("order-42")?;
//! let mut tx = pool.begin().await?;
//! let req = ClaimRequest {
//!     tenant: "acme",
//!     operation: "create-order",
//!     key: &key,
//!     fingerprint: FingerprintBuilder::new("acme", "create-order", "JOB", "orders")
//!         .body(&serde_json::json!({"sku": "A-1"}))?
//!         .finish(),
//!     retention: Duration::from_secs(24 * 3600),
//!     in_flight_wait: Duration::from_secs(2),
//! };
//! match claim(&mut tx, &req).await? {
//!     Claim::Execute(execution) => {
//!         sqlx::query("INSERT INTO orders (sku) VALUES ('A-1')").execute(&mut *tx).await?;
//!         let outcome = StoredResponse { status: 201, headers: vec![], body: "created".into() };
//!         execution.complete(&mut tx, &outcome).await?;
//!         tx.commit().await?;
//!     }
//!     Claim::Replay(stored) => println!("already done: {}", stored.status),
//!     Claim::Mismatch => println!("key reused for another request"),
//!     Claim::InFlight { .. } => println!("still running elsewhere; retry later"),
//!     // `Claim` can grow: whatever else it says, nothing ran; retry later.
//!     _ => println!("not executed; retry later"),
//! }
//! # Ok(()) }
//! ```
//!
//! ## Requirements
//!
//! * A database, chosen by cargo feature as in sqlx: `postgres` (the default),
//!   `sqlite` (`Idem<Sqlite>`, `Tx<Sqlite>`) or `mysql` (MySQL 8 and MariaDB
//!   10.11: `Idem<MySql>`, `Tx<MySql>`), any of them together; with idem's table:
//!   call [`migrate`] at start, or copy `migrations/` into your own migration
//!   history. Leased handlers may keep their records in Redis instead (feature
//!   `redis`, the module `idem_runtime::redis`).
//! * A `Json<T>` or `Form<T>` body is fingerprinted as its typed value, so `T`
//!   implements `serde::Serialize` as well as `Deserialize` (unless the handler
//!   says `fingerprint(ignore_body)`).
//! * On PostgreSQL, claims run at READ COMMITTED, its default; another isolation
//!   level is refused with [`StoreError::Isolation`].
//! * Timestamps come from the database clock, never the application's.
//!
//! ## What is where
//!
//! The attribute ([`idempotent`]) and its runtime ([`Idem`], [`Tx`], [`Lease`]);
//! by hand: [`claim`] and [`claim_leased`]; around them: [`Sweeper`] (retention),
//! [`stats()`], [`Reconciler`] (uncertain outcomes), [`consumer`] (messages),
//! [`transition`] (state machines of your own rows), [`admin`] (one key at a
//! time, for tools), [`metrics`] (the names), [`operations`] (long operations:
//! `202 Accepted` and the operation resource). Every database's statements live
//! in one private module each, behind the sealed [`Backend`] trait.

#![forbid(unsafe_code)]
#![deny(missing_docs)]
// docs.rs (`--cfg docsrs`, see Cargo.toml): each feature-gated item shows the
// feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
pub mod at_rest;
mod config;
pub mod consumer;
mod db;
mod decide;
mod executions;
pub mod fingerprint;
mod flight;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
mod handler;
pub mod key;
pub mod lease;
pub mod metrics;
mod model;
#[cfg(feature = "openapi")]
#[cfg_attr(docsrs, doc(cfg(feature = "openapi")))]
pub mod openapi;
pub mod operations;
pub mod problem;
#[cfg(feature = "postgres")]
mod recent;
pub mod reconcile;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "replay-cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay-cache")))]
pub mod replay_cache;
mod response;
pub mod retry;
mod running;
pub mod stats;
pub mod store;
pub mod sweeper;
pub mod tenant;
pub mod transition;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod test_util;

pub use at_rest::{KeyRing, KeyRingError};
pub use config::{ConfigError, DEFAULT_STORED_HEADERS, Idem, NEVER_STORED_HEADERS};
pub use db::Tx;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use db::postgres::pooler::check_pooler;
pub use db::{Backend, MIGRATIONS_TABLE};
pub use executions::Executions;
pub use fingerprint::{Fingerprint, FingerprintBody, FingerprintBuilder, FingerprintError};
pub use key::{DigestParseError, IdempotencyKey, KeyDigest, KeyError};
pub use lease::{
    Lease, LeaseError, LeaseRequest, LeasedClaim, Uncertain, claim_leased,
    claim_leased_with_key_ring,
};
pub use model::{Claim, ClaimRequest, Execution, StoreError, StoredResponse};
pub use problem::Problem;
pub use reconcile::Reconciler;
#[cfg(feature = "replay-cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay-cache")))]
pub use replay_cache::ReplayCache;
pub use response::REPLAYED_HEADER;
pub use running::RunningLimit;
pub use stats::{OperationStats, StateCounts, Stats, stats};
pub use store::{claim, claim_with_key_ring, migrate, migrator};
pub use sweeper::{SweepReport, Sweeper};
pub use tenant::{SingleTenant, TenantError, TenantScope};

pub use idem_macros::idempotent;
