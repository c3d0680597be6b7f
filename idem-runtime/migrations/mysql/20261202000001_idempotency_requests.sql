-- idem on MySQL 8 and MariaDB 10.11 (InnoDB): the same table as on PostgreSQL
-- and SQLite. Timestamps are Unix milliseconds (BIGINT) from the database's own
-- clock (UTC_TIMESTAMP(3), independent of the session time zone), never the
-- application's.
--
-- The key columns are VARBINARY: they compare byte for byte, with no collation
-- folding case or accents and no PAD SPACE rule making 'k' and 'k ' the same
-- key. 3 x 255 bytes fit InnoDB's 3072-byte index key limit.
--
-- MySQL has no partial indexes: the in-flight index is on (state, created_at),
-- which the in-flight report, the reconciler's scan and the stats read as a range
-- over the two in-flight states.

CREATE TABLE idempotency_requests (
    tenant_id        VARBINARY(255) NOT NULL,
    operation        VARBINARY(255) NOT NULL,
    idempotency_key  VARBINARY(255) NOT NULL,
    fingerprint      VARBINARY(32)  NOT NULL,
    state            VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    response_status  SMALLINT,
    response_headers MEDIUMTEXT CHARACTER SET utf8mb4,
    response_body    LONGBLOB,
    owner_token      VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin,
    generation       BIGINT NOT NULL DEFAULT 1,
    lease_expires_at BIGINT,
    created_at       BIGINT NOT NULL,
    completed_at     BIGINT,
    expires_at       BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, operation, idempotency_key),
    KEY idempotency_requests_expires_at_idx (expires_at),
    KEY idempotency_requests_in_flight_idx (state, created_at),
    CONSTRAINT idempotency_requests_fingerprint_len CHECK (length(fingerprint) = 32),
    CONSTRAINT idempotency_requests_state_ok
        CHECK (state IN ('processing', 'completed', 'failed', 'uncertain')),
    CONSTRAINT idempotency_requests_status_ok CHECK (response_status BETWEEN 100 AND 599),
    CONSTRAINT idempotency_requests_finished_has_status
        CHECK (state NOT IN ('completed', 'failed') OR response_status IS NOT NULL)
) ENGINE = InnoDB;
