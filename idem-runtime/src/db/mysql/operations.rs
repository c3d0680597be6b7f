//! A long operation's resource on MySQL / MariaDB: one key's row by its primary
//! key, with its lease judged on the database's clock (SQLite's statement with
//! MySQL's now and placeholders).

use super::now_ms;
use crate::db::dialect::question_marks;
use crate::db::shared::ms_operation_sql;

pub(super) const OPERATION_STATUS_SQL: &str = question_marks!(ms_operation_sql!(now_ms!(), "NULL"));
pub(super) const OPERATION_RESULT_SQL: &str =
    question_marks!(ms_operation_sql!(now_ms!(), "response_body"));
