//! `idem show`: one key's row; its stored headers' values and body only when
//! asked for.

use idem_runtime::Backend;
use idem_runtime::admin::{self, KeyAddress, KeyRecord};
use serde::Serialize;
use sqlx::Pool;

use super::not_found;
use crate::Failure;
use crate::output::{Table, to_json};

#[derive(Debug, Serialize)]
struct Shown {
    tenant: String,
    operation: String,
    key_digest: String,
    state: String,
    generation: i64,
    fingerprint: String,
    created_at: String,
    completed_at: Option<String>,
    expires_at: String,
    expired: bool,
    lease_expires_at: Option<String>,
    response_status: Option<i64>,
    body_bytes: Option<i64>,
    header_names: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<Vec<(String, String)>>,
    /// The body as text, when it is UTF-8 (only with --body).
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    /// The body in hex, when it is not UTF-8 (only with --body).
    #[serde(skip_serializing_if = "Option::is_none")]
    body_hex: Option<String>,
}

pub(super) async fn show<DB: Backend>(
    pool: &Pool<DB>,
    json: bool,
    key: &KeyAddress<'_>,
    with_body: bool,
) -> Result<String, Failure> {
    let KeyRecord {
        state,
        generation,
        fingerprint,
        created_at,
        completed_at,
        expires_at,
        expired,
        lease_expires_at,
        response_status,
        body_bytes,
        response_headers,
        body,
        ..
    } = admin::show(pool, key, with_body)
        .await?
        .ok_or_else(|| not_found(key))?;
    // The header text as each database gives it (jsonb's or SQLite's): the same
    // JSON either way.
    let headers: Vec<(String, String)> = match response_headers {
        // serde_json's message quotes what it did not expect, which may be a
        // header's value: only where it stopped is said, never what is there.
        Some(text) => serde_json::from_str(&text).map_err(|e| {
            Failure::Other(format!(
                "stored headers unreadable: not a list of [name, value] pairs (line {}, column {})",
                e.line(),
                e.column()
            ))
        })?,
        None => Vec::new(),
    };
    let (body_text, body_hex) = match body {
        Some(b) => match String::from_utf8(b) {
            Ok(text) => (Some(text), None),
            Err(e) => (None, Some(hex(e.as_bytes()))),
        },
        None => (None, None),
    };
    let shown = Shown {
        tenant: key.tenant.to_owned(),
        operation: key.operation.to_owned(),
        key_digest: key.digest.to_string(),
        state,
        generation,
        fingerprint,
        created_at,
        completed_at,
        expires_at,
        expired,
        lease_expires_at,
        response_status,
        body_bytes,
        header_names: headers.iter().map(|(n, _)| n.clone()).collect(),
        headers: with_body.then_some(headers),
        body: body_text,
        body_hex,
    };
    if json {
        return to_json(&shown);
    }
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
    let mut pairs = vec![
        ("tenant", shown.tenant.clone()),
        ("operation", shown.operation.clone()),
        ("key digest", shown.key_digest.clone()),
        ("state", shown.state.clone()),
        ("generation", shown.generation.to_string()),
        ("fingerprint", shown.fingerprint.clone()),
        ("created at", shown.created_at.clone()),
        ("completed at", dash(&shown.completed_at)),
        (
            "expires at",
            format!(
                "{}{}",
                shown.expires_at,
                if shown.expired { " (expired)" } else { "" }
            ),
        ),
        ("lease expires at", dash(&shown.lease_expires_at)),
        (
            "status",
            shown
                .response_status
                .map_or("-".to_owned(), |s| s.to_string()),
        ),
        (
            "body bytes",
            shown.body_bytes.map_or("-".to_owned(), |b| b.to_string()),
        ),
    ];
    match &shown.headers {
        Some(hs) => {
            for (name, value) in hs {
                pairs.push(("header", format!("{name}: {value}")));
            }
        }
        None if !shown.header_names.is_empty() => {
            pairs.push(("headers", shown.header_names.join(", ")));
        }
        None => pairs.push(("headers", "-".to_owned())),
    }
    let mut out = Table::pairs(pairs).render();
    if let Some(text) = &shown.body {
        out.push_str("\n--- body ---\n");
        out.push_str(&crate::output::terminal_safe_lines(text));
        if !text.ends_with('\n') {
            out.push('\n');
        }
    } else if let Some(h) = &shown.body_hex {
        out.push_str("\n--- body (not UTF-8, hex) ---\n");
        out.push_str(h);
        out.push('\n');
    }
    Ok(out)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
