-- The simulated payment provider's ledger (as in the PostgreSQL migration two
-- directories up): its charges by idempotency key, kept across restarts.
CREATE TABLE provider_charges (
    id              BIGINT AUTO_INCREMENT PRIMARY KEY,
    idempotency_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL UNIQUE,
    amount_cents    BIGINT       NOT NULL,
    created_at      DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB;
