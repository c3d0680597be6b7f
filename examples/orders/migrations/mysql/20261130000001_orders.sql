-- The orders example's own tables on MySQL / MariaDB (the same shape as the
-- PostgreSQL migrations two directories up). Text that identifies (tenants) is
-- compared byte for byte (utf8mb4_bin), as PostgreSQL compares text; created_at is
-- UTC from the database's clock, written by the INSERT (a DEFAULT would take the
-- session's time zone).
CREATE TABLE orders (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant_id    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    sku          VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    quantity     INT          NOT NULL CHECK (quantity >= 1),
    amount_cents BIGINT       NOT NULL CHECK (amount_cents >= 0),
    currency     CHAR(3)      CHARACTER SET ascii NOT NULL,
    note         MEDIUMTEXT   CHARACTER SET utf8mb4,
    created_at   DATETIME(6)  NOT NULL,
    KEY orders_tenant_idx (tenant_id, id)
) ENGINE = InnoDB;

CREATE TABLE refunds (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant_id    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_id     BIGINT       NOT NULL,
    amount_cents BIGINT       NOT NULL CHECK (amount_cents >= 0),
    created_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB;
