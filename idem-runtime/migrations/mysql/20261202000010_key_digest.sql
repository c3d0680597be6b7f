-- idem: keys are kept as their SHA-256 digests, never as sent (see the PostgreSQL
-- migration of the same name for why). Existing rows are converted in place: the
-- downstream key of a leased execution is computed from the raw key first and
-- kept, then the key becomes its 32-byte digest in a column renamed to
-- key_digest. An older version of idem fails closed against the new column name.
--
-- lease::downstream_key is sha256 over length-prefixed parts (8-byte big-endian
-- byte lengths), its first 16 bytes in hex; LENGTH() counts bytes.

ALTER TABLE idempotency_requests
    ADD COLUMN downstream_key VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NULL;

UPDATE idempotency_requests
   SET downstream_key = LEFT(SHA2(CONCAT(
           UNHEX('0000000000000012'), 'idem-downstream-v1',
           UNHEX(LPAD(HEX(LENGTH(tenant_id)), 16, '0')), tenant_id,
           UNHEX(LPAD(HEX(LENGTH(operation)), 16, '0')), operation,
           UNHEX(LPAD(HEX(LENGTH(idempotency_key)), 16, '0')), idempotency_key
       ), 256), 32)
 WHERE owner_token IS NOT NULL OR state = 'uncertain';

UPDATE idempotency_requests SET idempotency_key = UNHEX(SHA2(idempotency_key, 256));

ALTER TABLE idempotency_requests
    CHANGE COLUMN idempotency_key key_digest BINARY(32) NOT NULL,
    ADD CONSTRAINT idempotency_requests_key_digest_len CHECK (length(key_digest) = 32);
