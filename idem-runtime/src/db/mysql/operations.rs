//! A long operation's resource on MySQL / MariaDB: one key's row by its primary
//! key, with its lease judged on the database's clock (SQLite's statement with
//! MySQL's now and placeholders).

use sqlx::MySql;

use super::now_ms;
use super::transactional::stored_from_row;
use crate::db::dialect::question_marks;
use crate::db::shared::{ms_operation_sql, operation_statements};

const OPERATION_STATUS_SQL: &str = question_marks!(ms_operation_sql!(now_ms!(), "NULL"));
const OPERATION_RESULT_SQL: &str = question_marks!(ms_operation_sql!(now_ms!(), "response_body"));

impl crate::db::stores::OperationRows for MySql {
    operation_statements!();
}
