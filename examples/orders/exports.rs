//! `POST /exports`: a long operation. The request is answered `202 Accepted`
//! at once with the operation's resource (`/operations/...`), while the export
//! runs for `EXPORTS_DURATION_MS` under its lease; its answer is stored and
//! replayed, as any idempotent answer is.

use serde::{Deserialize, Serialize};

use crate::input::Validate;

/// What to export: the tenant's orders, in a format.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewExport {
    /// `csv` or `json`.
    pub format: String,
}

impl Validate for NewExport {
    fn validate(&self) -> Result<(), String> {
        match self.format.as_str() {
            "csv" | "json" => Ok(()),
            _ => Err("format must be \"csv\" or \"json\"".into()),
        }
    }
}

/// A finished export.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Export {
    /// The export's id: the lease's downstream key, the same for every worker
    /// that takes the export over, so a takeover names the same export.
    pub id: String,
    pub format: String,
    /// How many of the tenant's orders it holds.
    pub orders: i64,
}
