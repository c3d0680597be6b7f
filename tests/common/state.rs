//! The router state of the router tests that need only an `Idem` (not in
//! `common`: the CLI's tests share `common` and have no axum).

/// An `Idem` in the router state, handed to idem's extractor through `FromRef`.
#[derive(Clone)]
pub struct AppState {
    pub idem: idem_runtime::Idem<sqlx::Postgres>,
}

impl axum::extract::FromRef<AppState> for idem_runtime::Idem<sqlx::Postgres> {
    fn from_ref(s: &AppState) -> idem_runtime::Idem<sqlx::Postgres> {
        s.idem.clone()
    }
}
