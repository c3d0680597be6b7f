//! Support for the code that `#[idempotent]` generates. Not a public API: names
//! and signatures here change without notice.

use std::future::Future;
use std::pin::Pin;

use axum::response::IntoResponse;

pub use crate::fingerprint::FingerprintBody;
pub use crate::handler::{
    BoxedHandler, BoxedLeasedHandler, HandlerOutcome, IdemRequest, OperationSpec, run, run_leased,
};
pub use crate::lease::Lease;
pub use crate::tenant::{SingleTenant, TenantScope};
pub use crate::tx::Tx;
pub use axum::response::Response;
pub use std::boxed::Box;
pub use std::result::Result::Ok;
pub use std::string::String;
pub use std::time::Duration;

/// Boxes a handler body; taking the closure through this bound lets rustc infer
/// its higher-ranked signature.
pub fn handler<DB, F>(f: F) -> BoxedHandler<DB>
where
    DB: crate::store::Backend,
    F: for<'t> FnOnce(&'t mut Tx<DB>) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 't>>
        + Send
        + 'static,
{
    Box::new(f)
}

/// The database of a handler's transaction parameter type, which picks the
/// backend of the whole expansion.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not idem's transaction handle",
    label = "the `&mut` parameter of an `#[idempotent]` handler is the transaction that holds the key",
    note = "take `tx: &mut idem_runtime::Tx` (PostgreSQL) or `tx: &mut idem_runtime::Tx<sqlx::Sqlite>`; with `lease = \"...\"`, take `lease: &mut idem_runtime::Lease`"
)]
pub trait TxHandle {
    /// The backend.
    type Db: crate::store::Backend;
}

impl<DB: crate::store::Backend> TxHandle for Tx<DB> {
    type Db = DB;
}

/// The database of a leased handler's lease parameter type (see [`TxHandle`]).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not idem's lease handle",
    label = "with `lease = \"...\"`, the `&mut` parameter of an `#[idempotent]` handler is the lease",
    note = "take `lease: &mut idem_runtime::Lease` (PostgreSQL) or `lease: &mut idem_runtime::Lease<sqlx::Sqlite>`"
)]
pub trait LeaseHandle {
    /// The backend.
    type Db: crate::lease::LeaseBackend;
}

impl<DB: crate::lease::LeaseBackend> LeaseHandle for Lease<DB> {
    type Db = DB;
}

/// Boxes a leased handler body (see [`handler`]).
pub fn leased_handler<DB, F>(f: F) -> BoxedLeasedHandler<DB>
where
    DB: crate::lease::LeaseBackend,
    F: for<'l> FnOnce(
            &'l mut Lease<DB>,
        ) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 'l>>
        + Send
        + 'static,
{
    Box::new(f)
}

/// The checked tenant id of the `#[tenant]` parameter. Generated with the
/// parameter's type span, so a type that does not implement [`TenantScope`] is
/// reported there.
pub fn tenant_id<T: TenantScope>(value: &T) -> Result<String, crate::tenant::TenantError> {
    let id = value.tenant_id();
    crate::tenant::validate_tenant_id(id)?;
    Ok(id.to_owned())
}

/// The fingerprint's start: scope, path and headers. An unusable tenant is
/// answered by [`run`] before the fingerprint is looked at.
pub fn start_fingerprint<DB: crate::store::Backend>(
    request: &IdemRequest<DB>,
    spec: &OperationSpec,
    tenant: &Result<String, crate::tenant::TenantError>,
) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
    Ok(request.fingerprint(spec, tenant.as_deref().unwrap_or_default()))
}

/// The tenant id of a `single_tenant` handler.
pub fn single_tenant() -> Result<String, crate::tenant::TenantError> {
    Ok(SingleTenant::ID.to_owned())
}

/// Adds the whole typed body to a fingerprint.
///
/// # Errors
///
/// As [`crate::FingerprintBuilder::body`].
pub fn fingerprint_body<B: FingerprintBody>(
    fp: crate::FingerprintBuilder,
    body: &B,
) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
    fp.body(body.fingerprint_value())
}

/// The typed value of a body extractor (see [`FingerprintBody`]).
pub fn body_value<B: FingerprintBody>(body: &B) -> &B::Value {
    body.fingerprint_value()
}

/// Borrows a handler's output to find out, by method resolution, whether it is a
/// `Result` (whose `Err` rolls back) or a plain response.
pub struct KindProbe<'a, T>(pub &'a T);

/// Chosen first: the output is a `Result`.
pub trait ViaResult {
    /// The tag that converts a `Result`.
    fn __idem_kind(&self) -> ResultTag {
        ResultTag
    }
}
impl<T, E> ViaResult for KindProbe<'_, Result<T, E>> {}

/// Chosen otherwise: the output is a plain response.
pub trait ViaPlain {
    /// The tag that converts a plain response.
    fn __idem_kind(&self) -> PlainTag {
        PlainTag
    }
}
impl<T> ViaPlain for &KindProbe<'_, T> {}

/// Converts a `Result` output.
pub struct ResultTag;
impl ResultTag {
    /// `Ok` is stored (unless 5xx), `Err` rolls back.
    pub fn outcome<T: IntoResponse, E: IntoResponse>(self, r: Result<T, E>) -> HandlerOutcome {
        HandlerOutcome::from_result(r)
    }
}

/// Converts a plain output.
pub struct PlainTag;
impl PlainTag {
    /// Stored unless 5xx.
    pub fn outcome<R: IntoResponse>(self, r: R) -> HandlerOutcome {
        HandlerOutcome::ok(r)
    }
}
