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
    pub format: Format,
}

/// An export's format.
// An enum rather than a string checked in `validate`, so that the document
// lists the two values; any other is `422`, as it was.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Csv,
    Json,
}

impl Validate for NewExport {
    fn validate(&self) -> Result<(), String> {
        // Its type is the whole rule: the format parsed, or it was 422.
        Ok(())
    }
}

/// A finished export.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Export {
    /// The export's id: the lease's downstream key, the same for every worker
    /// that takes the export over, so a takeover names the same export.
    pub id: String,
    pub format: Format,
    /// How many of the tenant's orders it holds.
    pub orders: i64,
}
