//! `idem stats`: the table's rows by state and operation, stored bytes, the
//! oldest rows and the sweeper's backlog.

use idem_runtime::Backend;
use sqlx::Pool;

use crate::Failure;
use crate::output::{Table, age, to_json};

pub(super) async fn stats<DB: Backend>(pool: &Pool<DB>, json: bool) -> Result<String, Failure> {
    let s = idem_runtime::stats(pool).await?;
    if json {
        return to_json(&s);
    }
    let mut out = Table::pairs(vec![
        ("taken at", s.taken_at.clone()),
        ("rows", s.rows.to_string()),
        ("  processing", s.by_state.processing.to_string()),
        ("  completed", s.by_state.completed.to_string()),
        ("  failed", s.by_state.failed.to_string()),
        ("  uncertain", s.by_state.uncertain.to_string()),
        ("stored bytes", s.stored_bytes.to_string()),
        (
            "oldest valid row",
            match (&s.oldest_valid_created_at, s.oldest_valid_age_seconds) {
                (Some(at), Some(secs)) => format!("{at} ({} ago)", age(secs)),
                _ => "-".to_owned(),
            },
        ),
        (
            "oldest in flight",
            s.oldest_in_flight_seconds.map_or("-".to_owned(), age),
        ),
        ("expired, not swept", s.expired_unswept.to_string()),
    ])
    .render();
    if !s.by_operation.is_empty() {
        let mut t = Table::new(
            &[
                "OPERATION",
                "ROWS",
                "PROCESSING",
                "COMPLETED",
                "FAILED",
                "UNCERTAIN",
                "EXPIRED",
                "BYTES",
            ],
            &[false, true, true, true, true, true, true, true],
        );
        for op in &s.by_operation {
            t.row(vec![
                op.operation.clone(),
                op.rows.to_string(),
                op.by_state.processing.to_string(),
                op.by_state.completed.to_string(),
                op.by_state.failed.to_string(),
                op.by_state.uncertain.to_string(),
                op.expired_unswept.to_string(),
                op.stored_bytes.to_string(),
            ]);
        }
        out.push('\n');
        out.push_str(&t.render());
    }
    Ok(out)
}
