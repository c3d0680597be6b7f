-- The simulated payment provider's ledger: its charges by idempotency key, kept
-- across restarts as a real provider keeps them (it is written outside idem's
-- transactions, as a provider would be).
CREATE TABLE provider_charges (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL UNIQUE,
    amount_cents    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
