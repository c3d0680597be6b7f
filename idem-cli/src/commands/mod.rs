//! The commands, one module each, each written once over
//! `idem_runtime::Backend`; and what `show` and `purge` share: the key's address
//! and the answer for a key that has no row.

mod migrate;
mod purge;
mod rekey;
mod show;
mod stats;
mod sweep;

use idem_runtime::admin::KeyAddress;
use idem_runtime::{Backend, IdempotencyKey, KeyDigest};
use sqlx::Pool;

use crate::Failure;
use crate::cli::Command;

/// Runs one command, the same way on every backend.
pub(crate) async fn execute<DB: Backend>(
    pool: Pool<DB>,
    command: Command,
    json: bool,
    checked: Checked,
) -> Result<String, Failure> {
    match command {
        Command::Migrate => migrate::migrate(&pool, json).await,
        Command::Stats => stats::stats(&pool, json).await,
        Command::Show {
            tenant,
            operation,
            key,
            digest,
            body,
        } => {
            let key = address(&tenant, &operation, &key, digest)?;
            show::show(&pool, json, &key, body).await
        }
        Command::Purge {
            whole_tenant: Some(tenant),
            force,
            wait,
            ..
        } => purge::erase_tenant(&pool, json, &tenant, force, wait.unwrap_or(0)).await,
        Command::Purge {
            tenant,
            operation,
            key,
            digest,
            force,
            wait,
            ..
        } => {
            let (tenant, operation, key) = one_key(tenant, operation, key, wait)?;
            let key = address(&tenant, &operation, &key, digest)?;
            purge::purge(&pool, json, &key, force).await
        }
        Command::Sweep {
            once: _,
            batch_size,
            max_batches,
            stale_after_secs,
        } => sweep::sweep(pool, json, batch_size, max_batches, stale_after_secs).await,
        Command::Rekey {
            batch_size,
            seal_clear,
            refuse_clear,
            ..
        } => {
            let clear = rekey::Clear {
                seal: seal_clear,
                refuse: refuse_clear,
            };
            let ring = checked.ring.ok_or_else(|| {
                Failure::Other("idem rekey's key ring was not read before connecting".to_owned())
            })?;
            rekey::rekey(&pool, json, batch_size, clear, ring).await
        }
        // `run` answers it without a database.
        Command::Check(_) => Err(Failure::Other(
            "idem check needs no database; it was routed to one".to_owned(),
        )),
    }
}

/// Refuses, before anything connects, what [`execute`] would refuse without
/// the database: a usage error is exit 2 whether the database is up or not,
/// and says so at once rather than after the connect timeout.
pub(crate) fn check_arguments(command: &Command) -> Result<Checked, Failure> {
    let mut checked = Checked { ring: None };
    match command {
        Command::Show {
            tenant,
            operation,
            key,
            digest,
            ..
        } => {
            address(tenant, operation, key, *digest)?;
        }
        Command::Purge {
            whole_tenant: None,
            tenant,
            operation,
            key,
            digest,
            wait,
            ..
        } => {
            let (tenant, operation, key) =
                one_key(tenant.clone(), operation.clone(), key.clone(), *wait)?;
            address(&tenant, &operation, &key, *digest)?;
        }
        Command::Rekey { key_ring_file, .. } => {
            checked.ring = Some(rekey::ring(key_ring_file.as_deref())?);
        }
        _ => {}
    }
    Ok(checked)
}

/// What [`check_arguments`] read that the command needs: the key ring (a
/// file, or the environment), read once.
pub(crate) struct Checked {
    ring: Option<idem_runtime::KeyRing>,
}

/// A one-key purge's tenant, operation and key (clap requires all three
/// without `--tenant`), which waits for no execution.
fn one_key(
    tenant: Option<String>,
    operation: Option<String>,
    key: Option<String>,
    wait: Option<u64>,
) -> Result<(String, String, String), Failure> {
    if wait.is_some() {
        return Err(Failure::Usage(
            "--wait goes with --tenant: one key's purge waits for no execution".to_owned(),
        ));
    }
    match (tenant, operation, key) {
        (Some(tenant), Some(operation), Some(key)) => Ok((tenant, operation, key)),
        _ => Err(Failure::Usage(
            "purge takes TENANT OPERATION KEY, or --tenant TENANT".to_owned(),
        )),
    }
}

/// The row's address: the key as a client sends it (either spelling the header
/// allows), digested here as idem does, or with `--digest` the digest itself.
/// Neither is echoed in an error: a key may be a secret.
fn address<'a>(
    tenant: &'a str,
    operation: &'a str,
    key: &str,
    is_digest: bool,
) -> Result<KeyAddress<'a>, Failure> {
    if !is_digest {
        let key = IdempotencyKey::parse(key)
            .map_err(|e| Failure::Usage(format!("not a valid key: {e}")))?;
        return Ok(KeyAddress::of(tenant, operation, &key));
    }
    let digest = KeyDigest::from_hex(key).map_err(|e| Failure::Usage(format!("--digest: {e}")))?;
    Ok(KeyAddress {
        tenant,
        operation,
        digest,
    })
}

fn not_found(key: &KeyAddress<'_>) -> Failure {
    Failure::NotFound(format!(
        "no row for tenant {:?}, operation {:?}, key digest {} \
         (never claimed, swept after its retention, or not committed yet)",
        key.tenant, key.operation, key.digest
    ))
}
