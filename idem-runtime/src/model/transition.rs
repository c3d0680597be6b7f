//! A state transition of the application's own rows (used by
//! `crate::transition`).

/// Where a resource's state lives. The names are trusted SQL identifiers (write
/// them as literals; they are not escaped).
#[derive(Debug, Clone, Copy)]
pub struct Resource {
    /// The table.
    pub table: &'static str,
    /// The primary key column (a `bigint`).
    pub id_column: &'static str,
    /// The state column (`text`).
    pub state_column: &'static str,
    /// The version column (`bigint`), incremented by every transition.
    pub version_column: &'static str,
    /// An extra `column = $2` condition that scopes the row (such as a tenant), or
    /// `None`.
    pub scope_column: Option<&'static str>,
}

/// The fenced update of one transition: the new state if the version is still
/// the one the locking read saw.
#[derive(Debug, Clone, Copy)]
pub struct FencedWrite<'a> {
    pub(crate) resource: &'a Resource,
    pub(crate) id: i64,
    pub(crate) scope: Option<&'a str>,
    /// The state the locking read saw.
    pub(crate) from: &'static str,
    pub(crate) to: &'static str,
    /// The version the locking read saw.
    pub(crate) version: i64,
}
