//! The request side of an idempotent handler: the fixed [`OperationSpec`] of
//! its operation, and the [`IdemRequest`] extractor that refuses a request
//! without a usable key before anything is reserved.

use std::time::Duration;

use axum::extract::{FromRef, FromRequestParts, MatchedPath, OriginalUri};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Response};

use crate::config::Idem;
use crate::fingerprint::FingerprintBuilder;
use crate::key::IdempotencyKey;
use crate::lease::LeaseBackend;
use crate::problem::Problem;

/// The fixed description of one idempotent operation, written once per handler.
#[derive(Debug, Clone, Copy)]
pub struct OperationSpec {
    /// The operation's stable name.
    pub operation: &'static str,
    /// How long keys and outcomes are kept.
    pub retention: Duration,
    /// Overrides [`Idem::in_flight_wait`] for this operation.
    pub in_flight_wait: Option<Duration>,
    /// Request headers (lower case) that are part of the fingerprint.
    pub fingerprint_headers: &'static [&'static str],
    /// Leased mode: the lease length (`None` in the transactional mode).
    pub lease: Option<Duration>,
    /// Leased mode: the longest a running handler's lease is renewed; after it a
    /// stuck worker can be taken over. Defaults to ten leases.
    pub lease_ceiling: Option<Duration>,
    /// Leased mode, a long operation: answer `202 Accepted` with the operation
    /// resource at once and keep working (see [`crate::operations`]).
    pub accepted: bool,
}

#[cfg(test)]
impl OperationSpec {
    /// A unit test's operation: `operation`, its keys kept an hour, every other
    /// setting its default (transactional, no fingerprinted header).
    pub(crate) const fn named(operation: &'static str) -> Self {
        OperationSpec {
            operation,
            retention: Duration::from_secs(3600),
            in_flight_wait: None,
            fingerprint_headers: &[],
            lease: None,
            lease_ceiling: None,
            accepted: false,
        }
    }
}

/// The request-side input of an idempotent handler: the validated key, the method,
/// the matched route, the path and query, and the headers the operation
/// fingerprints, plus the [`Idem`] from the router state.
///
/// As an extractor it refuses a request without a usable key with `400`
/// `application/problem+json` before anything is reserved. It copies no header
/// unless `HEADERS` says the operation fingerprints some (the attribute sets it
/// when `fingerprint(header = ...)` names one): the route and URI are shared,
/// not copied.
pub struct IdemRequest<DB: LeaseBackend, const HEADERS: bool = false> {
    pub(super) idem: Idem<DB>,
    pub(super) key: IdempotencyKey,
    method: Method,
    /// The route template, shared with axum's `MatchedPath` (none when the
    /// handler is not behind a router: then the concrete path stands in).
    route: Option<MatchedPath>,
    uri: axum::http::Uri,
    /// The request's headers, when `HEADERS`; else empty (no allocation).
    headers: HeaderMap,
}

/// Redacted: the headers hold credentials and the key, so only names are shown.
impl<DB: LeaseBackend, const HEADERS: bool> std::fmt::Debug for IdemRequest<DB, HEADERS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemRequest")
            .field("key", &self.key)
            .field("method", &self.method)
            .field("route", &self.route())
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<DB: LeaseBackend, const HEADERS: bool> IdemRequest<DB, HEADERS> {
    /// The validated key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The matched route template, else the concrete path.
    fn route(&self) -> &str {
        match &self.route {
            Some(m) => m.as_str(),
            None => self.uri.path(),
        }
    }

    /// A fingerprint builder seeded with the tenant, operation, method, route
    /// template, the concrete path and query string (so `/orders/1/ship` and
    /// `/orders/2/ship` are different requests), and the operation's fingerprint
    /// headers.
    pub fn fingerprint(&self, spec: &OperationSpec, tenant: &str) -> FingerprintBuilder {
        debug_assert!(
            HEADERS || spec.fingerprint_headers.is_empty(),
            "an operation that fingerprints headers extracts IdemRequest<_, true>"
        );
        let mut fp =
            FingerprintBuilder::new(tenant, spec.operation, self.method.as_str(), self.route())
                .extra_static("path", self.uri.path());
        if let Some(q) = self.uri.query() {
            fp = fp.extra_static("query", q);
        }
        for name in spec.fingerprint_headers {
            fp = fp.header(name, &self.headers);
        }
        fp
    }
}

impl<DB: LeaseBackend, const HEADERS: bool> IdemRequest<DB, HEADERS> {
    /// A request that did not come through axum's extractors (a gRPC call):
    /// its path stands for the route, and `headers` are kept only when
    /// `HEADERS` says the operation fingerprints some.
    #[cfg(feature = "grpc")]
    pub(crate) fn from_parts(
        idem: Idem<DB>,
        key: IdempotencyKey,
        method: Method,
        uri: axum::http::Uri,
        headers: impl FnOnce() -> HeaderMap,
    ) -> Self {
        IdemRequest {
            idem,
            key,
            method,
            route: None,
            uri,
            headers: if HEADERS { headers() } else { HeaderMap::new() },
        }
    }
}

impl<S, DB, const HEADERS: bool> FromRequestParts<S> for IdemRequest<DB, HEADERS>
where
    DB: LeaseBackend,
    Idem<DB>: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let key = IdempotencyKey::from_headers(&parts.headers).map_err(|e| {
            let p = if e.is_missing() {
                Problem::missing_key()
            } else {
                Problem::malformed_key(&e)
            };
            p.into_response()
        })?;
        Ok(IdemRequest {
            idem: Idem::from_ref(state),
            key,
            method: parts.method.clone(),
            route: parts.extensions.get::<MatchedPath>().cloned(),
            // The path the client sent: inside `Router::nest` the request's
            // URI has lost the prefix (and the path's values in it), which
            // axum keeps in `OriginalUri`.
            uri: parts
                .extensions
                .get::<OriginalUri>()
                .map_or_else(|| parts.uri.clone(), |original| original.0.clone()),
            headers: if HEADERS {
                parts.headers.clone()
            } else {
                HeaderMap::new()
            },
        })
    }
}
