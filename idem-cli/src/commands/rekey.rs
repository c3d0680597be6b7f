//! `idem rekey`: re-seals stored answers under the key ring's active key
//! (`idem_runtime::admin::rekey`), then says how many rows each key seals.

use std::io::Write as _;
use std::ops::ControlFlow;
use std::path::Path;

use idem_runtime::admin::{self, KeyUse, RekeyOptions, RekeyReport};
use idem_runtime::{Backend, KeyRing};
use serde::Serialize;
use sqlx::Pool;

use crate::Failure;
use crate::output::{Table, to_json};

#[derive(Debug, Serialize)]
struct Rekeyed {
    active_key: String,
    resealed: u64,
    changed: u64,
    unreadable: std::collections::BTreeMap<String, u64>,
    broken: u64,
    /// Message consumers' records, left in clear: they hold no answer.
    messages: u64,
    /// Finished rows by key id (`null`: in clear), after the run.
    rows_by_key: Vec<KeyRows>,
}

#[derive(Debug, Serialize)]
struct KeyRows {
    key_id: Option<String>,
    rows: u64,
}

/// The ring of `file`, or of the environment.
pub(super) fn ring(file: Option<&Path>) -> Result<KeyRing, Failure> {
    match file {
        Some(path) => {
            let ring = KeyRing::from_file(path).map_err(|e| Failure::Usage(e.to_string()))?;
            // The file names its active key; an environment that names
            // another would be silently overruled, and an operator who
            // rotated there would re-seal under the key they meant to retire.
            let var = idem_runtime::at_rest::ACTIVE_KEY_VAR;
            if let Ok(active) = std::env::var(var)
                && let active = active.trim()
                && !active.is_empty()
                && active != ring.active_id()
            {
                // Quoted only where it is one of the ring's ids: a key pasted
                // where its id belongs must not reach a log.
                let named = if ring.ids().any(|id| id == active) {
                    format!("{active:?}")
                } else {
                    "a key id the key file does not hold".to_owned()
                };
                return Err(Failure::Usage(format!(
                    "{var} names {named} but the key file's active key is {:?}: \
                     unset {var}, or make the file's `active` line agree",
                    ring.active_id()
                )));
            }
            Ok(ring)
        }
        None => KeyRing::from_env()
            .map_err(|e| Failure::Usage(format!("IDEM_KEY_RING: {e}")))?
            .ok_or_else(|| {
                Failure::Usage(
                    "idem rekey needs the key ring: set IDEM_KEY_RING (and IDEM_ACTIVE_KEY with \
                     several keys), or give --key-ring-file"
                        .to_owned(),
                )
            }),
    }
}

/// What the rekey does with answers stored in clear.
pub(super) struct Clear {
    /// Seal them (`--seal-clear`).
    pub(super) seal: bool,
    /// Refuse them, as a ring that refuses clear answers does
    /// (`--refuse-clear`): counted as broken, never sealed.
    pub(super) refuse: bool,
}

/// Re-seals every answer that is not under the active key, one line of
/// progress on stderr per page; rows left unreadable or broken are a refusal
/// (exit 4) that names them, after the rest is re-sealed.
pub(super) async fn rekey<DB: Backend>(
    pool: &Pool<DB>,
    json: bool,
    batch_size: u32,
    clear: Clear,
    ring: KeyRing,
) -> Result<String, Failure> {
    let ring = if clear.refuse {
        ring.refusing_clear_answers()
    } else {
        ring
    };
    let mut options = RekeyOptions::default();
    options.batch = batch_size;
    // Refused clear answers are read to be counted: a rekey with a refusing
    // ring leaves each one in clear, as broken.
    options.seal_clear = clear.seal || clear.refuse;
    let report = admin::rekey(pool, &ring, options, |so_far| {
        // Progress only: a standard error that was closed (a reader that
        // quit) must not stop a rotation half-way, as `eprintln!` would,
        // with a panic and no report.
        let _ = writeln!(
            std::io::stderr().lock(),
            "rekey: page {}: {} re-sealed, {} changed meanwhile, {} unreadable, {} broken",
            so_far.pages,
            so_far.resealed,
            so_far.changed,
            so_far.unreadable.values().sum::<u64>(),
            so_far.broken
        );
        ControlFlow::Continue(())
    })
    .await?;
    let used = admin::keys_in_use(pool).await?;
    let result = Rekeyed {
        active_key: ring.active_id().to_owned(),
        resealed: report.resealed,
        changed: report.changed,
        unreadable: report.unreadable.clone(),
        broken: report.broken,
        messages: report.messages,
        rows_by_key: used
            .into_iter()
            .map(|KeyUse { key_id, rows, .. }| KeyRows { key_id, rows })
            .collect(),
    };
    if !report.complete() {
        return Err(Failure::refused_after(left(&report), json, || {
            to_json(&result)
        }));
    }
    if json {
        return to_json(&result);
    }
    let labels: Vec<String> = result
        .rows_by_key
        .iter()
        .map(|used| match &used.key_id {
            Some(id) => format!("rows under key {id}"),
            None => "rows in clear".to_owned(),
        })
        .collect();
    let mut pairs = vec![
        ("active key", result.active_key.clone()),
        ("re-sealed", result.resealed.to_string()),
        ("changed meanwhile", result.changed.to_string()),
    ];
    if result.messages > 0 {
        pairs.push((
            "message records (left in clear)",
            result.messages.to_string(),
        ));
    }
    for (label, used) in labels.iter().zip(&result.rows_by_key) {
        pairs.push((label.as_str(), used.rows.to_string()));
    }
    Ok(Table::pairs(pairs).render())
}

/// What a run that could not re-seal everything says.
fn left(report: &RekeyReport) -> String {
    let mut parts = Vec::new();
    for (key_id, rows) in &report.unreadable {
        parts.push(format!(
            "{rows} sealed with key {key_id:?}, which the ring lacks (add it and run again)"
        ));
    }
    if report.broken > 0 {
        parts.push(format!(
            "{} that do not open for their row, or are in clear and refused (changed in the table; they are never replayed)",
            report.broken
        ));
    }
    format!(
        "re-sealed {} answers; left {}",
        report.resealed,
        parts.join("; ")
    )
}
