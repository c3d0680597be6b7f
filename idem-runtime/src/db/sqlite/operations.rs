//! A long operation's resource on SQLite: one key's row by its primary key, with
//! its lease judged on SQLite's clock.

use sqlx::Sqlite;

use super::now_ms;
use super::transactional::stored_from_row;
use crate::db::shared::{ms_operation_sql, operation_statements};

const OPERATION_STATUS_SQL: &str = ms_operation_sql!(now_ms!(), "NULL");
const OPERATION_RESULT_SQL: &str = ms_operation_sql!(now_ms!(), "response_body");

impl crate::db::stores::OperationRows for Sqlite {
    operation_statements!();
}
