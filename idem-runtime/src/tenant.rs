//! Who is asking: the tenant is part of every key's identity.
//!
//! Two callers may well pick the same random key; idem must never hand one of them
//! the other's stored answer. So every claim is scoped by a tenant id that the
//! application's own authentication supplies, through [`TenantScope`].

/// Implemented by the application's auth extractor (or any type that knows the
/// caller) to scope idempotency keys by caller.
///
/// ```
/// use idem_runtime::TenantScope;
///
/// struct Caller { account_id: String }
///
/// impl TenantScope for Caller {
///     fn tenant_id(&self) -> &str { &self.account_id }
/// }
/// ```
///
/// The id must be stable for the caller and non-empty; it is stored verbatim in the
/// `tenant_id` column. A single-tenant service opts out explicitly with
/// `#[idempotent(single_tenant, ...)]` or, through the runtime API, [`SingleTenant`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not identify a tenant",
    label = "this parameter is marked `#[tenant]`, but `{Self}` does not implement `idem_runtime::TenantScope`",
    note = "for a type of your own (your auth extractor), implement `idem_runtime::TenantScope` for it: return the caller's account or organisation id",
    note = "`Extension<T>` works when `T: TenantScope` (a caller your auth middleware inserted), and `Path<String>` takes the tenant from the path; another crate's type cannot implement `TenantScope` (the orphan rule): wrap it in a type of your own",
    note = "a service with a single tenant opts out with `#[idempotent(single_tenant, ...)]` instead"
)]
pub trait TenantScope {
    /// The caller's tenant id: non-empty, at most 255 bytes, stable across retries.
    fn tenant_id(&self) -> &str;
}

impl<T: TenantScope + ?Sized> TenantScope for &T {
    fn tenant_id(&self) -> &str {
        (**self).tenant_id()
    }
}

impl<T: TenantScope + ?Sized> TenantScope for Box<T> {
    fn tenant_id(&self) -> &str {
        (**self).tenant_id()
    }
}

impl<T: TenantScope + ?Sized> TenantScope for std::sync::Arc<T> {
    fn tenant_id(&self) -> &str {
        (**self).tenant_id()
    }
}

/// The caller an auth middleware put in the request's extensions:
/// `#[tenant] Extension(caller): Extension<Caller>`.
impl<T: TenantScope> TenantScope for axum::Extension<T> {
    fn tenant_id(&self) -> &str {
        self.0.tenant_id()
    }
}

/// A tenant named by the route, as in `/orgs/{org}/orders`:
/// `#[tenant] Path(org): Path<String>`. The path is what the client sent: check
/// that the caller belongs to it **before the handler**, in a middleware or an
/// extractor of the handler's: a retry is answered from the stored outcome
/// without running the handler, so a check inside it would let anyone who
/// knows (or guesses) a key of the org read its answer.
impl TenantScope for axum::extract::Path<String> {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

/// The explicit opt-out for a service that has one tenant only.
///
/// Every key of such a service lives in one scope, stored with the tenant id
/// [`SingleTenant::ID`]. Do not use it in a service that has several callers: they
/// would see each other's stored answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SingleTenant;

impl SingleTenant {
    /// The tenant id under which a single-tenant service's keys are stored. It holds
    /// a character (`*`) that tenant validation refuses in real tenant ids, so
    /// the two can never meet.
    pub const ID: &'static str = "*";
}

impl TenantScope for SingleTenant {
    fn tenant_id(&self) -> &str {
        Self::ID
    }
}

/// Always there: the caller of a single-tenant service's
/// [`crate::operations::router`] (`router::<SingleTenant, _, _>()`).
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for SingleTenant {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        _: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(SingleTenant)
    }
}

/// Why a tenant id cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TenantError {
    /// The id is empty.
    #[error("the tenant id is empty")]
    Empty,
    /// The id is longer than 255 bytes.
    #[error("the tenant id is {0} bytes long; at most 255 are allowed")]
    TooLong(usize),
    /// `*` is reserved for [`SingleTenant`].
    #[error("the tenant id `*` is reserved for single-tenant services")]
    Reserved,
    /// The id holds a NUL (U+0000), which PostgreSQL's text cannot hold: every
    /// claim would fail as the database's, and be answered "retry".
    #[error("the tenant id contains a NUL (U+0000)")]
    Nul,
}

/// Checks a tenant id that a [`TenantScope`] returned.
///
/// # Errors
///
/// [`TenantError`] when it is empty, longer than 255 bytes, the reserved `*`,
/// or holds a NUL.
pub(crate) fn validate_tenant_id(id: &str) -> Result<(), TenantError> {
    match id.len() {
        0 => Err(TenantError::Empty),
        n if n > 255 => Err(TenantError::TooLong(n)),
        _ if id == SingleTenant::ID => Err(TenantError::Reserved),
        _ if id.contains('\0') => Err(TenantError::Nul),
        _ => Ok(()),
    }
}

/// The checked tenant id of a caller of type `T`: the reserved
/// [`SingleTenant::ID`] is accepted from [`SingleTenant`] itself, and from no
/// other type, so a caller of a multi-tenant service whose id happens to be `*`
/// never reads the single-tenant scope.
///
/// # Errors
///
/// [`TenantError`] as [`validate_tenant_id`] reports it, for every type but
/// [`SingleTenant`].
pub(crate) fn caller_tenant_id<T: TenantScope + 'static>(caller: &T) -> Result<&str, TenantError> {
    let id = caller.tenant_id();
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<SingleTenant>()
        && id == SingleTenant::ID
    {
        return Ok(id);
    }
    validate_tenant_id(id).map(|()| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_checked() {
        assert_eq!(validate_tenant_id("acme"), Ok(()));
        assert_eq!(validate_tenant_id(""), Err(TenantError::Empty));
        assert_eq!(
            validate_tenant_id(&"x".repeat(256)),
            Err(TenantError::TooLong(256))
        );
        assert_eq!(validate_tenant_id("*"), Err(TenantError::Reserved));
        assert_eq!(validate_tenant_id("a\0b"), Err(TenantError::Nul));
    }

    /// A caller type of the application's own that answers `*`.
    struct Star;

    impl TenantScope for Star {
        fn tenant_id(&self) -> &str {
            "*"
        }
    }

    #[test]
    fn only_single_tenant_itself_may_be_the_reserved_id() {
        assert_eq!(caller_tenant_id(&SingleTenant), Ok("*"));
        assert_eq!(caller_tenant_id(&Star), Err(TenantError::Reserved));
        assert_eq!(
            caller_tenant_id(&Box::new(SingleTenant)),
            Err(TenantError::Reserved)
        );
        assert_eq!(
            caller_tenant_id(&axum::Extension(Star)),
            Err(TenantError::Reserved)
        );
        assert_eq!(
            caller_tenant_id(&axum::Extension(SingleTenant)),
            Err(TenantError::Reserved)
        );
    }
}
