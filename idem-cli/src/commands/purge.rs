//! `idem purge`: deletes one key, refusing a row whose execution may still be
//! running or whose effect is unknown unless forced; with `--tenant`, erases
//! every row of a tenant, leaving those in flight unless forced.

use idem_runtime::Backend;
use std::time::{Duration, Instant};

use idem_runtime::admin::{self, InFlightRows, KeyAddress, PurgeError};
use serde::Serialize;
use sqlx::Pool;

use super::not_found;
use crate::output::{Table, to_json};
use crate::{Failure, PURGE_LOCK_WAIT};

#[derive(Debug, Serialize)]
struct Purged {
    purged: bool,
    tenant: String,
    operation: String,
    key_digest: String,
    state: String,
    generation: i64,
}

pub(super) async fn purge<DB: Backend>(
    pool: &Pool<DB>,
    json: bool,
    key: &KeyAddress<'_>,
    force: bool,
) -> Result<String, Failure> {
    // Decided inside the backend's transaction, with the row (or the database)
    // locked, so that the state checked is the state deleted.
    let allow = |state: &str| {
        if matches!(state, "processing" | "uncertain") && !force {
            return Err(Failure::Refused(format!(
                "the key is {state}: its execution may still be running or its effect is unknown, \
                 and purging it lets a retry execute again; nothing was purged (use --force to purge anyway)"
            )));
        }
        Ok(())
    };
    let (state, generation) = admin::purge(pool, key, PURGE_LOCK_WAIT, allow)
        .await
        .map_err(|e| match e {
            PurgeError::Locked(what) => locked(what),
            PurgeError::Refused(failure) => failure,
            PurgeError::Store(e) => e.into(),
            other => Failure::Other(format!("purge failed: {other}")),
        })?
        .ok_or_else(|| not_found(key))?;
    let purged = Purged {
        purged: true,
        tenant: key.tenant.to_owned(),
        operation: key.operation.to_owned(),
        key_digest: key.digest.to_string(),
        state,
        generation,
    };
    if json {
        return to_json(&purged);
    }
    Ok(Table::pairs(vec![
        ("purged", "yes".to_owned()),
        ("tenant", purged.tenant),
        ("operation", purged.operation),
        ("key digest", purged.key_digest),
        (
            "was",
            format!("{} (generation {})", purged.state, generation),
        ),
    ])
    .render())
}

/// The message of a purge refused because a running request holds what it needs.
fn locked(what: &str) -> Failure {
    Failure::Refused(format!(
        "{what} (waited {} s); nothing was purged, try again when it has finished",
        PURGE_LOCK_WAIT.as_secs()
    ))
}

#[derive(Debug, Serialize)]
struct Erased {
    tenant: String,
    erased: u64,
    left: u64,
}

/// Erases every row of `tenant` (`idem_runtime::admin::erase_tenant`). Rows in
/// flight are left unless `force`; for `wait` seconds the erasure is repeated,
/// a second apart, as they finish. Rows still left are a refusal (exit 4) that
/// says how many, after the rest is erased.
pub(super) async fn erase_tenant<DB: Backend>(
    pool: &Pool<DB>,
    json: bool,
    tenant: &str,
    force: bool,
    wait: u64,
) -> Result<String, Failure> {
    let in_flight = if force {
        InFlightRows::Erase
    } else {
        InFlightRows::Keep
    };
    let until = Instant::now()
        .checked_add(Duration::from_secs(wait))
        .ok_or_else(|| Failure::Usage(format!("--wait {wait}: too long a wait")))?;
    let mut erased = 0;
    let left = loop {
        let done = admin::erase_tenant(pool, tenant, admin::ERASE_BATCH, in_flight)
            .await
            .map_err(|e| erased_before(Failure::from(e), erased))?;
        erased += done.erased;
        if done.left == 0 || Instant::now() >= until {
            break done.left;
        }
        tokio::time::sleep(Duration::from_secs(1).min(until - Instant::now())).await;
    };
    let report = Erased {
        tenant: tenant.to_owned(),
        erased,
        left,
    };
    if left > 0 {
        return Err(Failure::refused_after(
            format!(
                "erased {erased} rows of tenant {tenant:?}; {left} were left: executions in flight \
             (a lease, live or lapsed, an uncertain outcome), rows a running request holds, or \
             rows the tenant's traffic wrote meanwhile (stop it first). Run again when they have finished (--wait SECS waits for them; a lapsed lease \
             finishes only when a retry of its key takes it over), or --force to erase them \
             too (their effects may happen twice)"
            ),
            json,
            || to_json(&report),
        ));
    }
    if json {
        return to_json(&report);
    }
    Ok(Table::pairs(vec![
        ("tenant", report.tenant),
        ("erased", report.erased.to_string()),
        ("left", report.left.to_string()),
    ])
    .render())
}

/// A database error after earlier passes erased rows: says how many, which
/// were committed (each pass commits its own), so that a record of the
/// erasure is not left at nothing done. Running it again is safe.
fn erased_before(failure: Failure, erased: u64) -> Failure {
    match failure {
        Failure::Database(e) if erased > 0 => Failure::Database(format!(
            "{e} (after erasing {erased} rows in earlier passes, which stay erased; run it again \
             to erase the rest)"
        )),
        other => other,
    }
}
