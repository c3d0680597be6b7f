//! Re-sealing stored answers under a key ring's active key on Redis
//! (`RedisLeaseStore::rekey`), as `admin::rekey` does on a SQL store: the
//! records found by name (`SCAN .. MATCH`, every master's on a cluster), each
//! finished one re-sealed by a script that writes only over what was read.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use super::{RedisLeaseStore, redis_err};
use crate::at_rest::{KeyRing, RowId, opened_to_reseal, sealed_with};
use crate::model::{KeyUse, RekeyOptions, RekeyReport, StoreError};

impl RedisLeaseStore {
    /// Re-seals every finished answer under this store's prefix that is not
    /// sealed with `ring`'s active key (and, with
    /// [`RekeyOptions::seal_clear`], every answer stored in clear), as
    /// [`crate::admin::rekey`] does on a SQL store, with the same guarantees:
    /// each answer is written back by one script only over the same finished
    /// execution's same bytes (changed meanwhile: counted in
    /// [`RekeyReport::changed`], left), killed at any point it loses nothing,
    /// and answers under a key the ring lacks are counted by key and left. The
    /// records keep their expiry. `progress` is told the report after each
    /// [`RekeyOptions::batch`] records; `ControlFlow::Break` stops there.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis fails; what was re-sealed before
    /// stays re-sealed.
    pub async fn rekey(
        &self,
        ring: &KeyRing,
        options: RekeyOptions,
        mut progress: impl FnMut(&RekeyReport) -> ControlFlow<()>,
    ) -> Result<RekeyReport, StoreError> {
        let names = self
            .conn
            .scan_matching(&self.layout.all_records())
            .await
            .map_err(redis_err)?;
        let mut report = RekeyReport::default();
        let batch = usize::try_from(options.batch.max(1)).unwrap_or(usize::MAX);
        let mut pages = names.chunks(batch).peekable();
        while let Some(page) = pages.next() {
            for name in page {
                let Some((operation, key)) = self.layout.record_of(name) else {
                    continue;
                };
                let found = match self.finished(name, "tenant").await {
                    Ok(Some(found)) => found,
                    Ok(None) => continue,
                    // A record that does not read (spoiled by hand) is its own
                    // loss, counted as broken, not the whole run's.
                    Err(StoreError::Corrupt(_)) => {
                        report.broken += 1;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let needed = match sealed_with(&found.stored) {
                    Some(id) => id != ring.active_id(),
                    None => options.seal_clear,
                };
                if !needed {
                    continue;
                }
                let old_body = found.stored.body.clone();
                let Some(clear) = opened_to_reseal(
                    ring,
                    &found.field,
                    &operation,
                    &key,
                    found.stored,
                    &mut report,
                )?
                else {
                    continue;
                };
                let at = RowId {
                    tenant: &found.field,
                    operation: &operation,
                    key: &key,
                    generation: found.generation,
                };
                let sealed = ring.seal(&at, &clear)?;
                let headers = serde_json::to_string(&sealed.headers)
                    .map_err(|e| StoreError::Corrupt(format!("headers: {e}")))?;
                let wrote: i64 = self
                    .scripts
                    .rekey
                    .key(name)
                    .arg(found.generation)
                    .arg(&old_body[..])
                    .arg(headers)
                    .arg(&sealed.body[..])
                    .arg(&found.created)
                    .invoke_async(&mut self.conn.clone())
                    .await
                    .map_err(redis_err)?;
                match wrote {
                    1 => report.resealed += 1,
                    _ => report.changed += 1,
                }
            }
            report.pages += 1;
            if progress(&report).is_break() {
                report.stopped = pages.peek().is_some();
                break;
            }
        }
        Ok(report)
    }

    /// How many finished records under this store's prefix hold an answer
    /// sealed with each key, and in clear (`key_id` `None`), clear first, as
    /// [`crate::admin::keys_in_use`] counts a SQL store's rows.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis fails.
    pub async fn keys_in_use(&self) -> Result<Vec<KeyUse>, StoreError> {
        let names = self
            .conn
            .scan_matching(&self.layout.all_records())
            .await
            .map_err(redis_err)?;
        let mut by_key: BTreeMap<Option<String>, u64> = BTreeMap::new();
        for name in &names {
            if self.layout.record_of(name).is_none() {
                continue;
            }
            match self.finished(name, "tenant").await {
                Ok(Some(found)) => {
                    let key_id = sealed_with(&found.stored).map(str::to_owned);
                    *by_key.entry(key_id).or_default() += 1;
                }
                // Not an answer any key holds (spoiled by hand).
                Ok(None) | Err(StoreError::Corrupt(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(by_key
            .into_iter()
            .map(|(key_id, rows)| KeyUse { key_id, rows })
            .collect())
    }
}
