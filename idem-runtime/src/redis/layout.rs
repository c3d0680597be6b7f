//! Where the records live: key names, the shards of an operation and their
//! uncertain indexes (see `docs/redis.md`, "Data layout").
//!
//! One operation's records are spread over [`SHARDS`] hash tags, `{O:s}` with
//! `s` the first hex digit of the key's digest, so a Redis Cluster places them
//! on up to sixteen slots (and so masters) instead of one. A record and the
//! index shard it enters when uncertain share the tag, so every script's keys
//! are in one slot and each state change stays one atomic script.

use std::sync::Arc;

/// Shards per operation: the hex digits a key's digest may start with.
///
/// Sixteen spreads one operation's records over sixteen cluster slots, which
/// Redis Cluster places on different masters (on three masters, every master
/// takes some unless an operation's sixteen slots all miss one, about one
/// operation in two hundred). More would spread further but multiply what the
/// reconciler reads per round: it reads every shard's index each page.
pub const SHARDS: usize = 16;

const HEX: &[u8; SHARDS] = b"0123456789abcdef";

/// A record's or index's name part: letters, digits, `.`, `_` and `-` as they
/// are, every other byte as `%XX`; so `:`, `{` and `}` never appear and two
/// different (tenant, operation) pairs never share a name.
pub(super) fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A record's entry in its shard's uncertain index.
pub(super) fn member(tenant: &str, digest: &str) -> String {
    format!("{}:{digest}", escape(tenant))
}

/// The shard of a key: the first hex digit of its digest (lower case, as
/// `KeyDigest` prints). Anything else, which idem never writes, goes to `0`.
pub(super) fn shard_of(digest: &str) -> char {
    match digest.as_bytes().first() {
        Some(&c) if HEX.contains(&c) => c as char,
        _ => '0',
    }
}

/// Every shard, in order.
pub(super) fn shards() -> impl Iterator<Item = char> {
    HEX.iter().map(|&c| c as char)
}

/// The names under one prefix.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    pub(super) prefix: Arc<str>,
}

impl Layout {
    /// `P:{O:s}`: what every name of one shard starts with.
    fn shard_base(&self, operation: &str, shard: char) -> String {
        format!("{}:{{{}:{shard}}}", self.prefix, escape(operation))
    }

    /// `P:{O:s}:r:T:D`, the record of a key.
    pub(super) fn record(&self, tenant: &str, operation: &str, digest: &str) -> String {
        self.record_in(operation, shard_of(digest), &member(tenant, digest))
    }

    /// The record an index entry names, in the index's own shard (so a
    /// hand-written entry never names a key of another slot).
    pub(super) fn record_in(&self, operation: &str, shard: char, member: &str) -> String {
        format!("{}:r:{member}", self.shard_base(operation, shard))
    }

    /// `P:{O:s}:uncertain`, one shard's index of uncertain records.
    pub(super) fn index(&self, operation: &str, shard: char) -> String {
        format!("{}:uncertain", self.shard_base(operation, shard))
    }

    /// `P:{O:s}:abandoned:K`, the mark that the claim with owner token `K`
    /// was given up by its caller (its answer never came): in the record's
    /// shard, so the claim's script reads it, and it never runs after that.
    pub(super) fn abandoned(&self, operation: &str, shard: char, token: &str) -> String {
        format!("{}:abandoned:{token}", self.shard_base(operation, shard))
    }

    /// `P:{O:s}:ack`, the mark beside a record (`P:{O:s}:r:T:D`) that a call
    /// awaiting replica acknowledgement writes before its `WAIT` (see
    /// `acks`); `None` for a name that is not a record's.
    pub(super) fn ack_beside(record: &str) -> Option<String> {
        // The member (escaped tenant and digest) holds no `}`: the last
        // `}:r:` ends the shard's tag.
        let end = record.rfind("}:r:")?;
        Some(format!("{}:ack", &record[..=end]))
    }

    /// A `SCAN` pattern for every record under the prefix: `P:{*}:r:*`.
    pub(super) fn all_records(&self) -> String {
        format!("{}:{{*}}:r:*", glob_literal(&self.prefix))
    }

    /// The operation and key digest a record's name holds (`P:{O:s}:r:T:D`),
    /// if it is one of idem's.
    pub(super) fn record_of(&self, name: &str) -> Option<(String, crate::key::KeyDigest)> {
        let rest = name.strip_prefix(&*self.prefix)?.strip_prefix(":{")?;
        let (tag, member) = rest.split_once("}:r:")?;
        let (operation, _shard) = tag.rsplit_once(':')?;
        let (_tenant, digest) = member.rsplit_once(':')?;
        Some((
            unescape(operation)?,
            crate::key::KeyDigest::from_hex(digest).ok()?,
        ))
    }

    /// A `SCAN` pattern for every record of `tenant`, in every operation and
    /// shard: `P:{*}:r:T:*`. The operation and shard are escaped (no `{`, `}`
    /// or `:`), so `{*}` is exactly one record's tag; the escaped tenant holds
    /// no glob character, the prefix may, and is matched literally.
    pub(super) fn tenant_records(&self, tenant: &str) -> String {
        format!(
            "{}:{{*}}:r:{}:*",
            glob_literal(&self.prefix),
            escape(tenant)
        )
    }
}

/// The inverse of [`escape`]; `None` for text `escape` never writes.
pub(super) fn unescape(part: &str) -> Option<String> {
    let mut out = Vec::with_capacity(part.len());
    let mut bytes = part.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next()?, bytes.next()?];
            out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
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
    use super::*;

    #[test]
    fn names_escape_separators_and_never_hold_the_raw_key() {
        assert_eq!(escape("acme"), "acme");
        assert_eq!(escape("a:b"), "a%3Ab");
        assert_eq!(escape("{x}"), "%7Bx%7D");
        assert_ne!(member("a:b", "d"), member("a", "b:d"));
    }

    #[test]
    fn a_record_name_gives_back_its_operation_and_digest() {
        let l = Layout {
            prefix: "p:x".into(),
        };
        let digest = "c0ffee".repeat(10) + "c0ff";
        let name = l.record("a:b", "pay/now {1}", &digest);
        let (operation, key) = l.record_of(&name).unwrap();
        assert_eq!(operation, "pay/now {1}");
        assert_eq!(key.to_string(), digest);
        assert_eq!(unescape(&escape("ü %2F:")).as_deref(), Some("ü %2F:"));
        assert_eq!(unescape("%4"), None);
        assert_eq!(l.record_of("p:x:{op:0}:abandoned:t"), None);
    }

    #[test]
    fn a_tenant_pattern_matches_the_prefix_literally() {
        assert_eq!(glob_literal("idem"), "idem");
        assert_eq!(glob_literal("a*b?[c]\\d"), "a\\*b\\?\\[c\\]\\\\d");
        let l = Layout {
            prefix: "p*".into(),
        };
        assert_eq!(l.tenant_records("a:b"), "p\\*:{*}:r:a%3Ab:*");
    }

    #[test]
    fn a_record_and_its_index_shard_share_one_hash_tag() {
        let l = Layout {
            prefix: "idem".into(),
        };
        let digest = "c0ffee";
        assert_eq!(
            l.record("acme", "create-payment", digest),
            "idem:{create-payment:c}:r:acme:c0ffee"
        );
        assert_eq!(
            l.index("create-payment", shard_of(digest)),
            "idem:{create-payment:c}:uncertain"
        );
        assert_eq!(
            l.abandoned("create-payment", shard_of(digest), "0a1b"),
            "idem:{create-payment:c}:abandoned:0a1b"
        );
        let record = l.record("a}:r:b", "create-payment", digest);
        assert_eq!(
            Layout::ack_beside(&record).as_deref(),
            Some("idem:{create-payment:c}:ack")
        );
        assert_eq!(
            Layout::ack_beside("idem:{create-payment:c}:uncertain"),
            None
        );
        assert_eq!(shards().count(), SHARDS);
        assert_eq!(shard_of(""), '0');
        assert_eq!(shard_of("Z"), '0');
    }
}
