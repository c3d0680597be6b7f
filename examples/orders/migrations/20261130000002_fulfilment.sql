-- Order fulfilment steps (pay, ship) as idempotent state transitions.
ALTER TABLE orders
    ADD COLUMN status  text   NOT NULL DEFAULT 'created'
        CHECK (status IN ('created', 'paid', 'shipped')),
    ADD COLUMN version bigint NOT NULL DEFAULT 1;

-- Effects of the transitions; deliberately without UNIQUE (order_id): the
-- transition helper, not a constraint, is what keeps them single.
CREATE TABLE order_payments (
    id           bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    order_id     bigint      NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE shipments (
    id         bigserial   PRIMARY KEY,
    tenant_id  text        NOT NULL,
    order_id   bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
