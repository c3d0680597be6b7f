//! What a leased handler answers when it cannot know whether its external
//! effect happened.

use std::time::Duration;

/// Marks a leased handler's response: the external effect's outcome is unknown.
#[derive(Debug, Clone, Copy)]
pub struct UncertainMarker;

/// What a leased handler returns when it cannot know whether the external effect
/// happened (the provider timed out after it may have charged). The row becomes
/// `uncertain`; retries get `202` until a reconciler resolves it; the effect is
/// never run again meanwhile. A leased handler's answer only: in a
/// transactional (`Tx`) handler's return type it does not compile, and
/// returned from one behind `into_response()` (its effects commit with the key
/// or not at all) it is rolled back and answered `500`, and nothing is stored.
///
/// ```
/// use idem_runtime::Uncertain;
/// use axum::response::IntoResponse;
///
/// let resp = Uncertain::new("the payment provider timed out").into_response();
/// assert_eq!(resp.status(), 202);
/// ```
#[derive(Debug, Clone)]
pub struct Uncertain {
    detail: String,
}

impl Uncertain {
    /// With a detail for the client (no secrets: it is sent as is).
    pub fn new(detail: impl Into<String>) -> Self {
        Uncertain {
            detail: detail.into(),
        }
    }
}

impl axum::response::IntoResponse for Uncertain {
    fn into_response(self) -> axum::response::Response {
        let mut resp = crate::Problem::uncertain(Duration::from_secs(5))
            .with_detail(self.detail)
            .into_response();
        resp.extensions_mut().insert(UncertainMarker);
        resp
    }
}
