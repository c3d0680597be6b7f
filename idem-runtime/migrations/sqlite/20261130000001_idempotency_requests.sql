-- idem on SQLite: the same table as on PostgreSQL. Timestamps are Unix
-- milliseconds taken from SQLite's own clock (julianday('now')), never the
-- application's. The claim is two statements in Rust (idem_runtime::store::sqlite):
-- SQLite has no stored procedures, and it serialises writers, so the
-- INSERT ... ON CONFLICT waits for a concurrent writer through the busy timeout.

CREATE TABLE idempotency_requests (
    tenant_id        TEXT    NOT NULL,
    operation        TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    state            TEXT    NOT NULL
                     CHECK (state IN ('processing', 'completed', 'failed', 'uncertain')),
    response_status  INTEGER CHECK (response_status BETWEEN 100 AND 599),
    response_headers TEXT,
    response_body    BLOB,
    owner_token      TEXT,
    generation       INTEGER NOT NULL DEFAULT 1,
    lease_expires_at INTEGER,
    created_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    expires_at       INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, operation, idempotency_key),
    CHECK (state NOT IN ('completed', 'failed') OR response_status IS NOT NULL)
);

CREATE INDEX idempotency_requests_expires_at_idx ON idempotency_requests (expires_at);
