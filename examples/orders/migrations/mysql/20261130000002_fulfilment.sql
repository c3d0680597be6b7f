-- Order fulfilment steps (pay, ship) as idempotent state transitions.
ALTER TABLE orders
    ADD COLUMN status  VARCHAR(16) CHARACTER SET ascii NOT NULL DEFAULT 'created'
        CHECK (status IN ('created', 'paid', 'shipped')),
    ADD COLUMN version BIGINT NOT NULL DEFAULT 1;

-- Effects of the transitions; deliberately without UNIQUE (order_id): the
-- transition helper, not a constraint, is what keeps them single.
CREATE TABLE order_payments (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant_id    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_id     BIGINT       NOT NULL,
    amount_cents BIGINT       NOT NULL,
    created_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB;

CREATE TABLE shipments (
    id         BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant_id  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_id   BIGINT       NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB;
