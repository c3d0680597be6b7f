//! Erasing a tenant's records (`RedisLeaseStore::erase_tenant`): found by name
//! (`SCAN .. MATCH`, every master's on a cluster), each deleted with its
//! uncertain index entry by one script that reads its state first.

use super::layout::member;
use super::{RedisLeaseStore, redis_err};
use crate::model::{InFlightRows, StoreError, TenantErasure};

impl RedisLeaseStore {
    /// Deletes every record of `tenant`, in every operation, with its entry in
    /// the uncertain index, as [`crate::admin::erase_tenant`] does on a SQL
    /// store: a record in flight (its lease live or lapsed) or whose outcome is
    /// uncertain is left
    /// and counted in [`TenantErasure::left`] unless `in_flight` is
    /// [`InFlightRows::Erase`]. The records are found by name with `SCAN`
    /// (on a cluster, on every master), which reads the whole keyspace a page at
    /// a time without blocking the server. A claim's give-up marks (a token, no
    /// data) are left to expire.
    ///
    /// # Errors
    ///
    /// [`StoreError::InvalidRequest`] for an empty tenant id;
    /// [`StoreError::Redis`] when Redis fails, after the records before it
    /// were erased: erase again. A record under the tenant's name that is not
    /// idem's (or spoiled by hand) is left as it is and counted in
    /// [`TenantErasure::left`].
    pub async fn erase_tenant(
        &self,
        tenant: &str,
        in_flight: InFlightRows,
    ) -> Result<TenantErasure, StoreError> {
        if tenant.is_empty() {
            return Err(StoreError::InvalidRequest(
                "an empty tenant id: no record has one".to_owned(),
            ));
        }
        let pattern = self.layout.tenant_records(tenant);
        // `{*}` matches within one tag only if no name holds `}:r:` twice,
        // which idem's never do: each name is checked again by its member.
        let member_prefix = member(tenant, "");
        let names = self.conn.scan_matching(&pattern).await.map_err(redis_err)?;
        let all = if in_flight == InFlightRows::Erase {
            "1"
        } else {
            "0"
        };
        let (mut erased, mut left) = (0, 0);
        for name in names {
            let Some((base, member)) = name.split_once("}:r:") else {
                continue;
            };
            if !member.starts_with(&member_prefix) {
                continue;
            }
            let index = format!("{base}}}:uncertain");
            let answer: Result<i64, _> = self
                .scripts
                .erase
                .key(&name)
                .key(&index)
                .arg(member)
                .arg(all)
                .invoke_async(&mut self.conn.clone())
                .await;
            match answer {
                Ok(1) => erased += 1,
                Ok(-1) => left += 1,
                Ok(_) => {}
                // The script's own refusal of a record that is not idem's (or
                // spoiled by hand): left as it is and counted, so that the
                // erasure goes on past it, and a second one does not stop
                // there again.
                Err(e) if e.code() == Some("idem:") => {
                    tracing::warn!(error = %e, "idem: redis: a record under the tenant's name that is not idem's; left as it is");
                    left += 1;
                }
                Err(e) => return Err(redis_err(e)),
            }
        }
        Ok(TenantErasure { erased, left })
    }
}
