-- idem: key_digest holds 32 bytes, as PostgreSQL's CHECK and MySQL's
-- VARBINARY(32) make sure there.
--
-- SQLite cannot add a CHECK constraint to an existing table without rebuilding
-- it, so two triggers refuse a write of any other length. A TEXT value is let
-- through: it is an older release's raw key, which the conversion after the
-- migrations (db/sqlite/digests.rs) turns into its digest; idem itself never
-- writes one (the column was renamed, so an older release cannot either).

CREATE TRIGGER idempotency_requests_key_digest_len_insert
BEFORE INSERT ON idempotency_requests
WHEN typeof(NEW.key_digest) NOT IN ('blob', 'text')
  OR (typeof(NEW.key_digest) = 'blob' AND length(NEW.key_digest) <> 32)
BEGIN
    SELECT RAISE(ABORT, 'idem: key_digest must be the 32-byte SHA-256 of the key');
END;

CREATE TRIGGER idempotency_requests_key_digest_len_update
BEFORE UPDATE OF key_digest ON idempotency_requests
WHEN typeof(NEW.key_digest) NOT IN ('blob', 'text')
  OR (typeof(NEW.key_digest) = 'blob' AND length(NEW.key_digest) <> 32)
BEGIN
    SELECT RAISE(ABORT, 'idem: key_digest must be the 32-byte SHA-256 of the key');
END;
