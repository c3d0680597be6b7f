-- The simulated payment provider's ledger (as in the PostgreSQL migration one
-- directory up): its charges by idempotency key, kept across restarts.
CREATE TABLE provider_charges (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    idempotency_key TEXT    NOT NULL UNIQUE,
    amount_cents    INTEGER NOT NULL,
    created_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
