-- idem: keys are kept as their SHA-256 digests, never as sent (see the PostgreSQL
-- migration of the same name for why). The column is renamed, so that an older
-- version of idem fails closed against it instead of writing raw keys.
--
-- SQLite has no SHA-256 of its own: idem_runtime::migrate converts the existing
-- rows right after this migration, in Rust. A raw key is stored as TEXT, a digest
-- as a BLOB, so `typeof(key_digest) = 'text'` finds exactly the rows still to
-- convert, and the conversion can be repeated after a crash. Whoever applies this
-- file by hand must run idem_runtime::migrate (or `idem migrate`) once after it.

ALTER TABLE idempotency_requests RENAME COLUMN idempotency_key TO key_digest;
ALTER TABLE idempotency_requests ADD COLUMN downstream_key TEXT;
