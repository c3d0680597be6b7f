//! Demo authentication: the `authorization` metadata entry, `Bearer <tenant>`.
//! The interceptor puts the [`Caller`] in the request's extensions, where the
//! methods' `#[tenant] caller: Extension<Caller>` finds it.

use idem_runtime::TenantScope;
use tonic::{Request, Status};

/// The authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: String,
}

impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.tenant
    }
}

/// The interceptor: `UNAUTHENTICATED` without a usable bearer token.
pub fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let tenant = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|t| {
            (1..=64).contains(&t.len())
                && t.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
        .ok_or_else(|| {
            Status::unauthenticated("send `authorization: Bearer <tenant>` ([a-z0-9-]{1,64})")
        })?
        .to_owned();
    request.extensions_mut().insert(Caller { tenant });
    Ok(request)
}
