//! `idem purge`: deletes one key, refusing a row whose execution may still be
//! running or whose effect is unknown unless forced.

use idem_runtime::Backend;
use idem_runtime::admin::{self, KeyAddress, PurgeError};
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
