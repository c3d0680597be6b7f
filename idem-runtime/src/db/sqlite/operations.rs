//! A long operation's resource on SQLite: one key's row by its primary key, with
//! its lease judged on SQLite's clock.

use super::now_ms;
use crate::db::shared::ms_operation_sql;

pub(super) const OPERATION_STATUS_SQL: &str = ms_operation_sql!(now_ms!(), "NULL");
pub(super) const OPERATION_RESULT_SQL: &str = ms_operation_sql!(now_ms!(), "response_body");
