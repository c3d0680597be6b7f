//! Demo authentication: `Authorization: Bearer <tenant>`. The tenant is the
//! idempotency scope, so two tenants may use the same keys safely.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use idem_runtime::{Problem, TenantScope};

use crate::problems::ApiError;

/// The authenticated caller.
pub struct Caller {
    pub tenant: String,
}

impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.tenant
    }
}

fn valid_tenant(t: &str) -> bool {
    (1..=64).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let unauthorized = |detail: &str| {
            ApiError(
                Problem::new(
                    "urn:orders:problem:unauthorized",
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                )
                .with_detail(detail),
            )
        };
        let header = parts
            .headers
            .get("authorization")
            .ok_or_else(|| unauthorized("send `Authorization: Bearer <tenant>`"))?;
        let tenant = header
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .filter(|t| valid_tenant(t))
            .ok_or_else(|| unauthorized("the bearer token must match [a-z0-9-]{1,64}"))?;
        Ok(Caller {
            tenant: tenant.to_owned(),
        })
    }
}
