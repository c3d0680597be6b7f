-- The consumer example's tables.
CREATE TABLE ledger_entries (
    id           bigserial   PRIMARY KEY,
    account      text        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE balances (
    account       text   PRIMARY KEY,
    balance_cents bigint NOT NULL
);
