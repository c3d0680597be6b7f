//! `idem migrate`: applies idem's migrations and lists them, each applied now
//! or already.

use idem_runtime::{Backend, admin};
use serde::Serialize;
use sqlx::Pool;

use crate::Failure;
use crate::output::{Table, to_json};

#[derive(Serialize)]
struct MigrationLine {
    version: i64,
    description: String,
    applied_now: bool,
}

pub(super) async fn migrate<DB: Backend>(pool: &Pool<DB>, json: bool) -> Result<String, Failure> {
    let before = admin::applied_migrations(pool).await?;
    idem_runtime::migrate(pool).await?;
    let after = admin::applied_migrations(pool).await?;
    let m = idem_runtime::migrator::<DB>();
    let lines: Vec<MigrationLine> = m
        .iter()
        .filter(|mig| after.contains(&mig.version))
        .map(|mig| MigrationLine {
            version: mig.version,
            description: mig.description.to_string(),
            applied_now: !before.contains(&mig.version),
        })
        .collect();
    if json {
        return to_json(&serde_json::json!({ "migrations": lines }));
    }
    let mut t = Table::new(&["VERSION", "DESCRIPTION", "STATUS"], &[true, false, false]);
    for l in &lines {
        t.row(vec![
            l.version.to_string(),
            l.description.clone(),
            if l.applied_now {
                "applied now"
            } else {
                "already applied"
            }
            .to_owned(),
        ]);
    }
    let fresh = lines.iter().filter(|l| l.applied_now).count();
    Ok(format!(
        "{}\n{} applied now, {} already applied\n",
        t.render().trim_end(),
        fresh,
        lines.len() - fresh
    ))
}
