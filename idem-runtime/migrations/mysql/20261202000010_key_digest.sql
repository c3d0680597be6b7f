-- idem: keys are kept as their SHA-256 digests, never as sent (see the PostgreSQL
-- migration of the same name for why). Existing rows are converted in place: the
-- downstream key of a leased execution is computed from the raw key and kept,
-- the digest is written beside the raw key, and one last ALTER makes the digest
-- the key and drops the raw column. An older version of idem fails closed
-- against the new column name.
--
-- MySQL commits each DDL statement on its own, so this file is not atomic. It is
-- written so that no step can destroy a key: the raw key stays until the last
-- statement, which swaps the primary key and drops it at once, and the updates
-- only fill what is still empty (a re-run after a failure hashes nothing twice).
--
-- lease::downstream_key is sha256 over length-prefixed parts (8-byte big-endian
-- byte lengths), its first 16 bytes in hex; LENGTH() counts bytes.

ALTER TABLE idempotency_requests
    ADD COLUMN downstream_key VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NULL,
    ADD COLUMN key_digest VARBINARY(32) NULL;

UPDATE idempotency_requests
   SET downstream_key = LEFT(SHA2(CONCAT(
           UNHEX('0000000000000012'), 'idem-downstream-v1',
           UNHEX(LPAD(HEX(LENGTH(tenant_id)), 16, '0')), tenant_id,
           UNHEX(LPAD(HEX(LENGTH(operation)), 16, '0')), operation,
           UNHEX(LPAD(HEX(LENGTH(idempotency_key)), 16, '0')), idempotency_key
       ), 256), 32)
 WHERE (owner_token IS NOT NULL OR state = 'uncertain') AND downstream_key IS NULL;

UPDATE idempotency_requests SET key_digest = UNHEX(SHA2(idempotency_key, 256))
 WHERE key_digest IS NULL;

ALTER TABLE idempotency_requests
    DROP PRIMARY KEY,
    DROP COLUMN idempotency_key,
    MODIFY COLUMN key_digest VARBINARY(32) NOT NULL,
    ADD PRIMARY KEY (tenant_id, operation, key_digest),
    ADD CONSTRAINT idempotency_requests_key_digest_len CHECK (length(key_digest) = 32);
