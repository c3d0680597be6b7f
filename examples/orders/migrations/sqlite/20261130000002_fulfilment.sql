-- Order fulfilment steps (pay, ship) as idempotent state transitions.
ALTER TABLE orders ADD COLUMN status TEXT NOT NULL DEFAULT 'created'
    CHECK (status IN ('created', 'paid', 'shipped'));
ALTER TABLE orders ADD COLUMN version INTEGER NOT NULL DEFAULT 1;

-- Effects of the transitions; deliberately without UNIQUE (order_id): the
-- transition helper, not a constraint, is what keeps them single.
CREATE TABLE order_payments (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id    TEXT    NOT NULL,
    order_id     INTEGER NOT NULL,
    amount_cents INTEGER NOT NULL,
    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE shipments (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id  TEXT    NOT NULL,
    order_id   INTEGER NOT NULL,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
