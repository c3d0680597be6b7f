//! The demo auth extractor of the router tests (not in `common`: the CLI's tests
//! share `common` and have no axum).

/// Demo auth for router tests: `Authorization: Bearer <tenant>`; missing → 401.
pub struct Caller(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = axum::http::StatusCode;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| Caller(t.to_owned()))
            .ok_or(axum::http::StatusCode::UNAUTHORIZED)
    }
}

impl idem_runtime::TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}
