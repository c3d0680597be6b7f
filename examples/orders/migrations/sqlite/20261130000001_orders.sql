-- The orders example's own tables on SQLite (the same shape as the PostgreSQL
-- migrations one directory up; idem's table lives in _idem_migrations beside them).
-- created_at is stored as the text the API answers with, from SQLite's clock, in
-- the same shape as PostgreSQL's answer (microseconds; SQLite keeps milliseconds).
CREATE TABLE orders (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id    TEXT    NOT NULL,
    sku          TEXT    NOT NULL,
    quantity     INTEGER NOT NULL CHECK (quantity >= 1),
    amount_cents INTEGER NOT NULL CHECK (amount_cents >= 0),
    currency     TEXT    NOT NULL CHECK (length(currency) = 3),
    note         TEXT,
    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z')
);
CREATE INDEX orders_tenant_idx ON orders (tenant_id, id);

CREATE TABLE refunds (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id    TEXT    NOT NULL,
    order_id     INTEGER NOT NULL,
    amount_cents INTEGER NOT NULL CHECK (amount_cents >= 0),
    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
