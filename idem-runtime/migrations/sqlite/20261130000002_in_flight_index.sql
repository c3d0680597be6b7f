-- Rows in flight, for the sweeper's report of stale ones: a partial index, as on
-- PostgreSQL, so the report does not read the whole table.
CREATE INDEX idempotency_requests_in_flight_idx
    ON idempotency_requests (created_at)
    WHERE state IN ('processing', 'uncertain');
