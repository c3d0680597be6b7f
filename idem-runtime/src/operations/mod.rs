//! Long operations: a leased handler written `#[idempotent(.., lease = "..",
//! accepted)]` answers `202 Accepted` at once and keeps working under its lease;
//! its operation resource, served by [`router()`], tells the client how it goes.
//!
//! ```text
//! POST /exports  Idempotency-Key: k1        -> 202 Accepted, Location: /operations/create-export/<digest>
//!                                              Retry-After: 2, {"status": "running", ...}
//! POST /exports  Idempotency-Key: k1 (again) -> the same 202 while the work runs
//! GET  /operations/create-export/<digest>   -> 200 {"status": "running" | "stalled" | "succeeded"
//!                                                       | "failed" | "uncertain", ...}
//! GET  /operations/create-export/<digest>/result -> the stored answer, as a replay
//! POST /exports  Idempotency-Key: k1 (done)  -> the stored answer, replayed
//! ```
//!
//! **The operation is the key's record.** Its id is the operation's name and the
//! SHA-256 digest of the `Idempotency-Key` (lowercase hex): exactly the primary
//! key idem already keeps, `(tenant, operation, key digest)`, with the tenant
//! taken from the caller. So no index or table is added, retention and the
//! sweeper cover the resource with its key, a takeover after a crash keeps its
//! address, and the key itself never appears (the digest is what the store
//! keeps instead of it; see docs/decisions.md).
//!
//! **What the states mean.**
//!
//! | status | the record | what a client does |
//! | --- | --- | --- |
//! | `running` | `processing`, its lease live | come back after `Retry-After` |
//! | `stalled` | `processing`, its lease lapsed: the worker died, it answered `504` (its downstream call's outcome unknown), or a takeover failed | send the original request again with the same key: it takes the work over (the same downstream key) and answers the same `202` |
//! | `succeeded` | `completed` | read `result`: the stored answer, replayed |
//! | `failed` | `failed` (a 4xx was stored) | likewise |
//! | `uncertain` | `uncertain`: the effect may have happened | wait: the reconciler resolves it |
//!
//! A handler that returns `Err` or a 5xx releases the key as in leased mode (the
//! effect is taken not to have happened): its resource is then gone (`404`),
//! and the original request sent again runs anew. One that answers `504` (its
//! downstream call may have done the work), or had taken the work over (the
//! run before it may have), is not released: it shows `stalled` until the
//! original request sent again takes it over.
//!
//! **Tenants.** [`router()`] extracts the caller the way the handlers do (the
//! `#[tenant]` parameter's type, or [`SingleTenant`](crate::SingleTenant)), and
//! reads the record under that tenant only: another tenant's operation, an
//! unknown or malformed id, an operation that is not `accepted`, and a finished
//! record past its retention all get the same `404`, byte for byte.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # mod demo {
//! use sqlx::Postgres;
//! use axum::Router;
//! use axum::routing::post;
//! use idem_runtime::{Idem, Lease, TenantScope, idempotent, operations};
//! # pub struct Caller(String);
//! # impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
//! #     type Rejection = axum::http::StatusCode;
//! #     async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> { Ok(Caller("acme".into())) }
//! # }
//! # impl TenantScope for Caller { fn tenant_id(&self) -> &str { &self.0 } }
//!
//! // `lease_ceiling`: the longest the work may take; renewals stop there (ten
//! // leases by default), and a retry then takes the work over.
//! #[idempotent(operation = "create-export", retention = "24h", lease = "6s", lease_ceiling = "1h", accepted)]
//! async fn create_export(#[tenant] caller: Caller, lease: &mut Lease<Postgres>) -> String {
//!     // minutes of work; `lease.downstream_key()` names it to anything downstream
//!     "done".to_owned()
//! }
//!
//! pub fn app(idem: Idem<Postgres>) -> Router {
//!     Router::new()
//!         .route("/exports", post(create_export))
//!         // where the `Location`s point (default "/operations")
//!         .nest(idem.operations_path(), operations::router::<Caller, sqlx::Postgres, Idem<Postgres>>())
//!         .with_state(idem)
//! }
//! # }
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::decide::RowState;
use crate::handler::OperationSpec;
use crate::model::OperationRow;

mod address;
mod router;
#[cfg(test)]
mod tests;

pub(crate) use address::Address;
pub use router::router;

/// One `accepted` handler's operation, registered by the attribute from the
/// handler's body, so that [`router`] serves exactly those operations.
#[doc(hidden)]
pub struct AcceptedRegistration {
    spec: &'static OperationSpec,
}

impl AcceptedRegistration {
    /// The handler's operation.
    pub const fn new(spec: &'static OperationSpec) -> Self {
        AcceptedRegistration { spec }
    }
}

inventory::collect!(AcceptedRegistration);

/// Registers an `accepted` handler's operation for [`router`]; the attribute
/// emits it in the generated handler's body.
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_accepted {
    ($spec:expr) => {
        $crate::__private::inventory::submit! {
            $crate::__private::AcceptedRegistration::new($spec)
        }
    };
}

/// Where an operation stands, as its resource says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Status {
    /// The work runs: its worker holds a live lease.
    Running,
    /// Its worker stopped renewing its lease (it died, or stalled past its
    /// renewal ceiling), its run answered `504` (a downstream call's outcome
    /// unknown), or a run that had taken the work over failed.
    /// Sending the original request again with the same key
    /// takes the work over.
    Stalled,
    /// Done: a 2xx or 3xx answer is stored.
    Succeeded,
    /// Done: a 4xx answer is stored (the request was refused, and stays so).
    Failed,
    /// The effect may have happened and is being reconciled; it will not run
    /// again meanwhile.
    Uncertain,
}

impl Status {
    fn of(row: &OperationRow) -> Status {
        match row.state {
            RowState::Processing if row.lease_live => Status::Running,
            RowState::Processing => Status::Stalled,
            RowState::Uncertain => Status::Uncertain,
            RowState::Completed => Status::Succeeded,
            RowState::Failed => Status::Failed,
        }
    }

    fn done(self) -> bool {
        matches!(self, Status::Succeeded | Status::Failed)
    }
}

/// The document of an operation resource: the body of a long operation's
/// `202 Accepted` (`status` `running`) and of `GET` on its resource. It never
/// holds the idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Operation {
    /// `{operation}/{digest}`: the operation's name and the SHA-256 of the key,
    /// in lowercase hex.
    pub id: String,
    /// The operation's name (the attribute's `operation`).
    pub operation: String,
    /// Where it stands.
    pub status: Status,
    /// The resource's path (the `Location` of the `202`).
    pub href: String,
    /// When done: the stored answer's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_status: Option<u16>,
    /// When done: where the stored answer is replayed (`{href}/result`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// While not done: seconds before asking again, as in `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// How often a client is asked to come back to a running operation: a third of
/// its lease (the rhythm at which its worker proves it is alive, so the soonest
/// a death can show as `stalled`), at least one second.
pub(crate) fn poll_interval(spec: &OperationSpec) -> Duration {
    (spec.lease.unwrap_or(Duration::from_secs(30)) / 3).max(Duration::from_secs(1))
}
