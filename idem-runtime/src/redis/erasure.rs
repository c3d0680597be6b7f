//! Erasing a tenant's records (`RedisLeaseStore::erase_tenant`): found by name
//! (`SCAN .. MATCH`, every master's on a cluster), each deleted with its
//! uncertain index entry by one script that reads its state first.

use super::layout::escape;
use super::{RedisLeaseStore, redis_err};
use crate::model::{InFlightRows, StoreError, TenantErasure};

impl RedisLeaseStore {
    /// Deletes every record of `tenant`, in every operation, with its entry in
    /// the uncertain index, as [`crate::admin::erase_tenant`] does on a SQL
    /// store: a record whose lease is live or whose outcome is uncertain is left
    /// and counted in [`TenantErasure::left`] unless `in_flight` is
    /// [`InFlightRows::Erase`]. The records are found by name with `SCAN`
    /// (on a cluster, on every master), which reads the whole keyspace a page at
    /// a time without blocking the server. A claim's give-up marks (a token, no
    /// data) are left to expire.
    ///
    /// # Errors
    ///
    /// [`StoreError::InvalidRequest`] for an empty tenant id;
    /// [`StoreError::Redis`] when Redis fails, or for a record under the
    /// prefix that is not idem's (left as it was), after the records before it
    /// were erased: erase again.
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
        let member_prefix = format!("{}:", escape(tenant));
        // `P:{O:s}:r:T:D`: the operation and shard are escaped (no `{`, `}` or
        // `:`), so `{*}` is exactly one record's tag; the escaped tenant holds
        // no glob character, the prefix may.
        let pattern = format!(
            "{}:{{*}}:r:{member_prefix}*",
            glob_literal(&self.layout.prefix)
        );
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
            let answer: i64 = self
                .scripts
                .erase
                .key(&name)
                .key(&index)
                .arg(member)
                .arg(all)
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(redis_err)?;
            match answer {
                1 => erased += 1,
                -1 => left += 1,
                _ => {}
            }
        }
        Ok(TenantErasure { erased, left })
    }
}

/// `text` as a `SCAN` pattern that matches it literally: `*`, `?`, `[`, `]`
/// and `\` escaped with a backslash.
fn glob_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::glob_literal;

    #[test]
    fn a_prefix_is_matched_literally() {
        assert_eq!(glob_literal("idem"), "idem");
        assert_eq!(glob_literal("a*b?[c]\\d"), "a\\*b\\?\\[c\\]\\\\d");
    }
}
