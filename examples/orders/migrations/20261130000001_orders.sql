-- The orders example's own tables (its application migrations, in _sqlx_migrations;
-- idem's table lives in _idem_migrations beside them).
CREATE TABLE orders (
    id           bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    sku          text        NOT NULL,
    quantity     integer     NOT NULL CHECK (quantity >= 1),
    amount_cents bigint      NOT NULL CHECK (amount_cents >= 0),
    currency     char(3)     NOT NULL,
    note         text,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX orders_tenant_idx ON orders (tenant_id, id);

CREATE TABLE refunds (
    id           bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    order_id     bigint      NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents >= 0),
    created_at   timestamptz NOT NULL DEFAULT now()
);
