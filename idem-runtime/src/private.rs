//! Support for the code that `#[idempotent]` generates. Not a public API: names
//! and signatures here change without notice.

use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;

use axum::response::IntoResponse;

pub use crate::__idem_accepted;
pub use crate::__idem_item;
pub use crate::__idem_openapi;
pub use crate::db::AnyBackend;
/// What a gRPC method's expansion calls.
#[cfg(feature = "grpc")]
pub use crate::grpc::support as grpc;
pub use crate::handler::{IdemRequest, OperationSpec, run};
/// What `__idem_openapi!` expands to: a handler's registration, collected
/// through inventory, which the user's crate need not depend on.
#[cfg(feature = "openapi")]
pub use crate::openapi::OpenApiRegistration;
/// What `__idem_accepted!` expands to: an `accepted` handler's operation, for
/// `operations::router`.
pub use crate::operations::AcceptedRegistration;
pub use axum::response::Response;
pub use inventory;
pub use std::boxed::Box;
pub use std::time::Duration;

use crate::db::Tx;
use crate::fingerprint::FingerprintBody;
use crate::handler::{BoxedHandler, BoxedLeasedHandler, HandlerOutcome};
use crate::lease::Lease;
use crate::tenant::{SingleTenant, TenantScope};

/// Boxes a handler body for the request's backend: the backend is named once, in
/// the request's type, and inferred here (a wrong transaction type is then
/// reported once, at the parameter).
pub fn handler_for<DB, F, const HEADERS: bool>(
    _: &IdemRequest<DB, HEADERS>,
    f: F,
) -> BoxedHandler<DB>
where
    DB: crate::db::Backend,
    F: for<'t> FnOnce(&'t mut Tx<DB>) -> Pin<Box<dyn Future<Output = HandlerOutcome> + Send + 't>>
        + Send
        + 'static,
{
    Box::new(f)
}

/// Boxes a leased handler body for the request's backend (see [`handler_for`]).
pub fn leased_handler_for<DB, F, const HEADERS: bool>(
    _: &IdemRequest<DB, HEADERS>,
    f: F,
) -> BoxedLeasedHandler<DB>
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

/// The database of a handler's transaction parameter type, which picks the
/// backend of the whole expansion.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not idem's transaction handle",
    label = "the `&mut` parameter of an `#[idempotent]` handler is the transaction that holds the key",
    note = "take `tx: &mut idem_runtime::Tx<Postgres>` (or `Tx<Sqlite>`, `Tx<MySql>`); with `lease = \"...\"`, take `lease: &mut idem_runtime::Lease<Postgres>` (or `Lease<Sqlite>`, `Lease<MySql>`, `Lease<Redis>`)"
)]
pub trait TxHandle {
    /// The backend.
    type Db: crate::db::Backend;
}

impl<DB: crate::db::Backend> TxHandle for Tx<DB> {
    type Db = DB;
}

/// The database of a leased handler's lease parameter type (see [`TxHandle`]).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not idem's lease handle",
    label = "with `lease = \"...\"`, the `&mut` parameter of an `#[idempotent]` handler is the lease",
    note = "take `lease: &mut idem_runtime::Lease<Postgres>` (or `Lease<Sqlite>`, `Lease<MySql>`, `Lease<Redis>`)"
)]
pub trait LeaseHandle {
    /// The backend.
    type Db: crate::lease::LeaseBackend;
}

impl<DB: crate::lease::LeaseBackend> LeaseHandle for Lease<DB> {
    type Db = DB;
}

/// The fingerprint's start: scope, path and headers. An unusable tenant is
/// answered by [`run`] before the fingerprint is looked at.
pub fn start_fingerprint<DB: crate::lease::LeaseBackend, const HEADERS: bool>(
    request: &IdemRequest<DB, HEADERS>,
    spec: &OperationSpec,
    tenant: &Result<String, crate::tenant::TenantError>,
) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
    Ok(request.fingerprint(spec, tenant.as_deref().unwrap_or_default()))
}

/// The tenant id of a `single_tenant` handler.
pub fn single_tenant() -> Result<String, crate::tenant::TenantError> {
    Ok(SingleTenant::ID.to_owned())
}

/// The checked tenant id of the `#[tenant]` parameter. (Past line 99 of this
/// file: the width of its line number sets where rustc trims the source lines
/// of the errors that point here, which idem-macros/tests/ui pins.) Called as
/// `tenant_id::<Ty>` with the parameter's own type tokens, so a type that does not
/// implement [`TenantScope`] is reported at the whole type.
pub fn tenant_id<T: TenantScope>(value: &T) -> Result<String, crate::tenant::TenantError> {
    let id = value.tenant_id();
    crate::tenant::validate_tenant_id(id)?;
    Ok(id.to_owned())
}

/// The shapes of request body the attribute fingerprints: every
/// [`FingerprintBody`] (its typed value), `Bytes` and `RawForm` (byte for byte),
/// and `Option<B>` and `Result<B, E>` of those (`None` adds no body; an `Err` never
/// gets here: the rejection is answered before the claim, by the attribute's
/// `rejected` step or, behind a name it cannot read, by [`BodyShape::screen`]).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be fingerprinted as a request body",
    label = "`#[idempotent]` fingerprints this parameter as the request body",
    note = "the fingerprint takes the body's typed value: `Json<T>` or `Form<T>` (with `T: serde::Serialize`), `String`, or `Bytes` (byte for byte), or an `Option` or `Result` of one of them",
    note = "for an extractor of your own, implement `idem_runtime::FingerprintBody` for it; for another crate's, wrap it in a type of your own",
    note = "to leave the body out of the fingerprint, write `fingerprint(ignore_body)` (with `header = \"...\"` to identify the request by its headers)"
)]
pub trait BodyShape {
    /// What `fingerprint(body.field)` paths start from.
    type Value: ?Sized;
    /// The value, when there is one.
    fn value(&self) -> Option<&Self::Value>;
    /// Adds the whole body.
    ///
    /// # Errors
    ///
    /// As [`crate::FingerprintBuilder::body`].
    fn add(
        &self,
        fp: crate::FingerprintBuilder,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError>;
    /// The body, or the answer instead of a claim: a `Result` body's
    /// rejection (a body behind a name the attribute cannot read, which the
    /// probe screens).
    fn screen(self) -> ControlFlow<Response, Self>
    where
        Self: Sized,
    {
        ControlFlow::Continue(self)
    }
}

impl<B: FingerprintBody> BodyShape for B {
    type Value = B::Value;
    fn value(&self) -> Option<&B::Value> {
        Some(self.fingerprint_value())
    }
    fn add(
        &self,
        fp: crate::FingerprintBuilder,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        fp.body(self.fingerprint_value())
    }
}

impl BodyShape for bytes::Bytes {
    type Value = [u8];
    fn value(&self) -> Option<&[u8]> {
        Some(self)
    }
    fn add(
        &self,
        fp: crate::FingerprintBuilder,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        Ok(fp.raw_body(self))
    }
}

impl BodyShape for axum::extract::RawForm {
    type Value = [u8];
    fn value(&self) -> Option<&[u8]> {
        Some(&self.0)
    }
    fn add(
        &self,
        fp: crate::FingerprintBuilder,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        Ok(fp.raw_body(&self.0))
    }
}

impl<B: BodyShape> BodyShape for Option<B> {
    type Value = B::Value;
    fn value(&self) -> Option<&B::Value> {
        self.as_ref().and_then(B::value)
    }
    fn add(
        &self,
        fp: crate::FingerprintBuilder,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        match self {
            Some(b) => b.add(fp),
            None => Ok(fp),
        }
    }
}

impl<B: BodyShape, E: IntoResponse> BodyShape for Result<B, E> {
    type Value = B::Value;
    fn value(&self) -> Option<&B::Value> {
        self.as_ref().ok().and_then(B::value)
    }
    fn add(
        &self,
        fp: crate::FingerprintBuilder,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        match self {
            Ok(b) => b.add(fp),
            Err(_) => Ok(fp),
        }
    }
    fn screen(self) -> ControlFlow<Response, Self> {
        match self {
            Ok(b) => ControlFlow::Continue(Ok(b)),
            Err(e) => ControlFlow::Break(rejected(e)),
        }
    }
}

/// Adds the whole body to a fingerprint. Called as `fingerprint_body::<Ty>` with
/// the parameter's own type tokens, so an error covers the whole type.
///
/// # Errors
///
/// As [`crate::FingerprintBuilder::body`].
pub fn fingerprint_body<B: BodyShape>(
    fp: crate::FingerprintBuilder,
    body: &B,
) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
    body.add(fp)
}

/// Adds one field of the body (`fingerprint(body.customer.id)`); nothing when
/// there is no body (`None`).
///
/// # Errors
///
/// As [`crate::FingerprintBuilder::body_field`].
pub fn body_field<B, V, F>(
    fp: crate::FingerprintBuilder,
    path: &str,
    body: &B,
    field: F,
) -> Result<crate::FingerprintBuilder, crate::FingerprintError>
where
    B: BodyShape,
    V: serde::Serialize + ?Sized,
    F: for<'a> FnOnce(&'a B::Value) -> &'a V,
{
    match body.value() {
        Some(v) => fp.body_field(path, field(v)),
        None => Ok(fp),
    }
}

/// The answer to a `Result<B, B::Rejection>` body whose extractor rejected the
/// request: the rejection's own response, before anything is claimed.
pub fn rejected<E: IntoResponse>(rejection: E) -> Response {
    rejection.into_response()
}

/// Asks, by method resolution on `&&&&BodyProbe<T, S>`, whether the handler's
/// last parameter (of a type the attribute cannot place: an alias, an extractor
/// of the application's) reads the body, with `S` the state its handler names
/// (its last `State<S>`, else `()`): [`IsBody`] when it can be fingerprinted,
/// [`ReadsBody`] when it reads the body but cannot, [`NotBody`] when it reads
/// only the request's parts, [`Unplaced`] when it is an extractor for neither
/// (one that needs a state the handler does not name), which does not compile:
/// its body, if it reads one, would be left out of the fingerprint unseen.
pub struct BodyProbe<T, S = ()>(std::marker::PhantomData<(T, S)>);

impl<T, S> BodyProbe<T, S> {
    /// The probe.
    pub const NEW: Self = BodyProbe(std::marker::PhantomData);
}

/// Chosen first: a body idem can fingerprint.
pub trait ProbeIsBody<T> {
    /// The tag.
    fn __idem_body_kind(&self) -> IsBody<T> {
        IsBody(std::marker::PhantomData)
    }
}
impl<T: BodyShape, S> ProbeIsBody<T> for &&&BodyProbe<T, S> {}

/// Chosen second: a body extractor (`FromRequest`, not from the parts).
pub trait ProbeReadsBody<T> {
    /// The tag.
    fn __idem_body_kind(&self) -> ReadsBody<T> {
        ReadsBody(std::marker::PhantomData)
    }
}
impl<T: axum::extract::FromRequest<S>, S> ProbeReadsBody<T> for &&BodyProbe<T, S> {}

/// Chosen third: an extractor of the request's parts.
pub trait ProbeNotBody<T> {
    /// The tag.
    fn __idem_body_kind(&self) -> NotBody<T> {
        NotBody(std::marker::PhantomData)
    }
}
impl<T: axum::extract::FromRequestParts<S>, S> ProbeNotBody<T> for &BodyProbe<T, S> {}

/// Chosen otherwise: not an extractor for the state the handler names.
pub trait ProbeUnplaced<T, S> {
    /// The tag.
    fn __idem_body_kind(&self) -> Unplaced<T, S> {
        Unplaced(std::marker::PhantomData)
    }
}
impl<T, S> ProbeUnplaced<T, S> for BodyProbe<T, S> {}

/// The last parameter is a body that can be fingerprinted.
pub struct IsBody<T>(std::marker::PhantomData<T>);
/// The last parameter reads the body but cannot be fingerprinted.
pub struct ReadsBody<T>(std::marker::PhantomData<T>);
/// The last parameter does not read the body.
pub struct NotBody<T>(std::marker::PhantomData<T>);
/// The last parameter is not an extractor for the handler's state `S`.
pub struct Unplaced<T, S>(std::marker::PhantomData<(T, S)>);

/// Refuses a last parameter of which idem cannot tell whether it reads the body.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` cannot tell whether `{Self}` reads the request body",
    label = "not an extractor for the state `{S}`: if it reads the body, the body would be left out of the fingerprint without a word",
    note = "idem asks the last parameter's type whether it reads the body, with the state the handler names in its last `State<S>` parameter (`()` without one)",
    note = "if it needs your application's state, name that state in the handler, after any sub-state: `State(_): State<AppState>`",
    note = "if it reads only the request's parts, you can also move it before another parameter: axum runs every parameter but the last from the parts",
    note = "if it reads the body, mark it `#[body]` and implement `idem_runtime::FingerprintBody` for it"
)]
pub trait PlacedExtractor<S> {}

/// Refuses `fingerprint(body)` where the last parameter reads only the request's
/// parts: there is no body to take (never implemented).
#[diagnostic::on_unimplemented(
    message = "`fingerprint(body)` finds no body: `{Self}` reads only the request's parts",
    label = "the last parameter, which `fingerprint(body)` takes as the request body",
    note = "axum reads the body only in the last parameter; this one is an extractor of the request's parts",
    note = "if the handler reads a body, take it as the last parameter, after this one (`Json<T>`, `Form<T>`, `Bytes`, `String`)",
    note = "if it reads none, remove `body` from `fingerprint(...)`"
)]
pub trait BodyNamed {}

/// Refuses a body that `fingerprint(header = "...")` would leave out silently.
#[diagnostic::on_unimplemented(
    message = "`{Self}` reads the request body, which this `fingerprint(...)` leaves out",
    label = "the request body: without it in the fingerprint, a retry with the same key and another body replays the first answer",
    note = "add `body` to `fingerprint(...)` to make the body part of the request's identity, or add `ignore_body` if it does not identify the request"
)]
pub trait BodyLeftOut {}

impl<T: BodyShape> IsBody<T> {
    /// See [`BodyShape::screen`].
    pub fn screen(self, body: T) -> ControlFlow<Response, T> {
        body.screen()
    }
    /// Without `fingerprint(...)`: the whole body.
    ///
    /// # Errors
    ///
    /// As [`crate::FingerprintBuilder::body`].
    pub fn default_print(
        self,
        fp: crate::FingerprintBuilder,
        body: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        body.add(fp)
    }
    /// With `fingerprint(body)`: as without it.
    ///
    /// # Errors
    ///
    /// As [`crate::FingerprintBuilder::body`].
    pub fn named_print(
        self,
        fp: crate::FingerprintBuilder,
        body: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        self.default_print(fp, body)
    }
    /// With `fingerprint(header = ..)` only: refused.
    pub fn left_out(self)
    where
        T: BodyLeftOut,
    {
    }
}

impl<T> ReadsBody<T> {
    /// Not screened: refused where it is fingerprinted.
    pub fn screen(self, body: T) -> ControlFlow<Response, T> {
        ControlFlow::Continue(body)
    }
    /// Without `fingerprint(...)`: the body must be fingerprinted, and cannot.
    ///
    /// # Errors
    ///
    /// As [`crate::FingerprintBuilder::body`].
    pub fn default_print(
        self,
        fp: crate::FingerprintBuilder,
        body: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError>
    where
        T: BodyShape,
    {
        body.add(fp)
    }
    /// With `fingerprint(body)`: as without it, it must be fingerprinted.
    ///
    /// # Errors
    ///
    /// As [`crate::FingerprintBuilder::body`].
    pub fn named_print(
        self,
        fp: crate::FingerprintBuilder,
        body: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError>
    where
        T: BodyShape,
    {
        self.default_print(fp, body)
    }
    /// With `fingerprint(header = ..)` only: refused.
    pub fn left_out(self)
    where
        T: BodyLeftOut,
    {
    }
}

impl<T> NotBody<T> {
    /// Not a body: passes unchanged.
    pub fn screen(self, body: T) -> ControlFlow<Response, T> {
        ControlFlow::Continue(body)
    }
    /// Not a body: nothing to add.
    ///
    /// # Errors
    ///
    /// Never.
    pub fn default_print(
        self,
        fp: crate::FingerprintBuilder,
        _: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError> {
        Ok(fp)
    }
    /// With `fingerprint(body)`: refused, there is no body to take.
    ///
    /// # Errors
    ///
    /// Never: it does not compile.
    pub fn named_print(
        self,
        fp: crate::FingerprintBuilder,
        _: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError>
    where
        T: BodyNamed,
    {
        Ok(fp)
    }
    /// Not a body: nothing is left out.
    pub fn left_out(self) {}
}

impl<T, S> Unplaced<T, S> {
    /// Not screened: refused where it is fingerprinted.
    pub fn screen(self, body: T) -> ControlFlow<Response, T> {
        ControlFlow::Continue(body)
    }
    /// Refused: whether it is a body is unknown.
    ///
    /// # Errors
    ///
    /// Never: it does not compile.
    pub fn default_print(
        self,
        fp: crate::FingerprintBuilder,
        _: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError>
    where
        T: PlacedExtractor<S>,
    {
        Ok(fp)
    }
    /// Refused likewise.
    ///
    /// # Errors
    ///
    /// Never: it does not compile.
    pub fn named_print(
        self,
        fp: crate::FingerprintBuilder,
        _: &T,
    ) -> Result<crate::FingerprintBuilder, crate::FingerprintError>
    where
        T: PlacedExtractor<S>,
    {
        Ok(fp)
    }
    /// Refused likewise.
    pub fn left_out(self)
    where
        T: PlacedExtractor<S>,
    {
    }
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

/// Emits its input unchanged: `#[idempotent(crate = "path")]` emits the handler
/// through `path::__private::__idem_item!`, so that a wrong path is reported
/// there, not at each of the handler's uses of it.
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_item {
    ($($item:tt)*) => { $($item)* };
}

/// Without the feature `openapi`, a handler registers nothing (see
/// `crate::openapi`, where the other definition lives).
#[cfg(not(feature = "openapi"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_openapi {
    ($handler:expr, $spec:expr) => {};
}
