//! `idem sweep`: one run of the retention sweeper.

use std::time::Duration;

use idem_runtime::{Backend, Sweeper};
use sqlx::Pool;

use crate::Failure;
use crate::output::{Table, age, to_json};

/// One pass of the sweeper with the command's settings, and its report.
pub(super) async fn sweep<DB: Backend>(
    pool: Pool<DB>,
    json: bool,
    batch_size: u32,
    max_batches: u32,
    stale_after_secs: u64,
) -> Result<String, Failure> {
    let sweeper = Sweeper::new(pool)
        .with_batch_size(batch_size)
        .with_max_batches(max_batches)
        .with_stale_after(Duration::from_secs(stale_after_secs));
    let report = sweeper.sweep_once().await?;
    if json {
        return to_json(&report);
    }
    Ok(Table::pairs(vec![
        ("deleted", report.deleted.to_string()),
        ("batches", report.batches.to_string()),
        ("backlog", report.backlog.to_string()),
        ("stale in flight", report.stale_in_flight.to_string()),
        (
            "oldest in flight",
            report
                .oldest_in_flight
                .map_or("-".to_owned(), |d| age(d.as_secs_f64())),
        ),
    ])
    .render())
}
