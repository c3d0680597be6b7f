-- idem: the idempotency table and its claim function.
--
-- Copy this file into your own sqlx migrations directory if you manage the schema
-- yourself; otherwise `idem_runtime::migrate(&pool)` applies it, tracked in its own
-- table `_idem_migrations` so that it never meets your application's history.

CREATE TABLE idempotency_requests (
    tenant_id        text        NOT NULL,
    operation        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    -- SHA-256 of the logical request (idem_runtime::fingerprint)
    fingerprint      bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    state            text        NOT NULL
                     CHECK (state IN ('processing', 'completed', 'failed', 'uncertain')),
    -- the stored outcome, set when state is completed or failed
    response_status  smallint    CHECK (response_status BETWEEN 100 AND 599),
    response_headers jsonb,
    response_body    bytea,
    -- leased mode: who owns the execution and until when; generation fences
    -- completions by a worker whose claim was taken over
    owner_token      uuid,
    generation       bigint      NOT NULL DEFAULT 1,
    lease_expires_at timestamptz,
    -- all timestamps come from the database clock
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, operation, idempotency_key),
    CHECK (state NOT IN ('completed', 'failed') OR response_status IS NOT NULL)
);

-- The sweeper deletes by expiry; stats look for old in-flight rows.
CREATE INDEX idempotency_requests_expires_at_idx ON idempotency_requests (expires_at);
CREATE INDEX idempotency_requests_in_flight_idx ON idempotency_requests (created_at)
    WHERE state IN ('processing', 'uncertain');

-- Claims a key inside the caller's transaction, in one round trip.
--
-- outcome is one of:
--   execute    the caller owns the key (new, or a finished outcome whose retention
--              had passed); generation
--              identifies this execution for idem_complete
--   replay     a stored outcome with the same fingerprint; response_* hold it
--   mismatch   the key is in use for a different request
--   in_flight  another transaction holds the key and did not finish within p_wait_ms,
--              or a leased execution is running
--
-- A concurrent duplicate blocks on the first transaction's uncommitted row for at
-- most p_wait_ms (lock_timeout). The wait runs inside a subtransaction (the
-- EXCEPTION block), so a timeout leaves the caller's transaction usable and its
-- lock_timeout as it was.
CREATE FUNCTION idem_claim(
    p_tenant text,
    p_operation text,
    p_key text,
    p_fingerprint bytea,
    p_retention_ms bigint,
    p_wait_ms bigint
) RETURNS TABLE (
    outcome text,
    generation bigint,
    response_status smallint,
    response_headers jsonb,
    response_body bytea,
    wait_seconds double precision
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_saved_timeout text := current_setting('lock_timeout');
    v_wait_start timestamptz;
    v_wait double precision := 0;
    v_generation bigint;
    v_row idempotency_requests%ROWTYPE;
BEGIN
    -- ON CONFLICT under REPEATABLE READ or SERIALIZABLE raises serialization
    -- failures instead of waiting and re-reading; the contract needs READ COMMITTED.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'idem: claims need READ COMMITTED isolation, this transaction runs at %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'IDEM1';
    END IF;

    FOR attempt IN 1..3 LOOP
        -- Fast path: a finished, unexpired outcome is immutable, so a replay or a
        -- mismatch needs no lock.
        SELECT * INTO v_row FROM idempotency_requests r
         WHERE r.tenant_id = p_tenant AND r.operation = p_operation
           AND r.idempotency_key = p_key AND r.expires_at > now()
           AND r.state IN ('completed', 'failed');
        IF FOUND THEN
            IF v_row.fingerprint <> p_fingerprint THEN
                RETURN QUERY SELECT 'mismatch'::text, v_row.generation, NULL::smallint, NULL::jsonb, NULL::bytea, v_wait;
            ELSE
                RETURN QUERY SELECT 'replay'::text, v_row.generation, v_row.response_status,
                                    v_row.response_headers, v_row.response_body, v_wait;
            END IF;
            RETURN;
        END IF;

        v_generation := NULL;
        v_wait_start := clock_timestamp();
        BEGIN
            -- lock_timeout = 0 would mean "wait forever": one millisecond is the floor.
            PERFORM set_config('lock_timeout', greatest(p_wait_ms, 1)::text || 'ms', true);
            INSERT INTO idempotency_requests AS r
                   (tenant_id, operation, idempotency_key, fingerprint, state, generation,
                    created_at, expires_at)
            VALUES (p_tenant, p_operation, p_key, p_fingerprint, 'processing', 1,
                    now(), now() + p_retention_ms * interval '1 millisecond')
            ON CONFLICT (tenant_id, operation, idempotency_key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint,
                   state = 'processing',
                   generation = r.generation + 1,
                   response_status = NULL,
                   response_headers = NULL,
                   response_body = NULL,
                   owner_token = NULL,
                   lease_expires_at = NULL,
                   created_at = now(),
                   completed_at = NULL,
                   expires_at = EXCLUDED.expires_at
             -- Only a finished outcome is forgotten at expiry; an execution that is
             -- still processing (leased) or uncertain is never taken over silently.
             WHERE r.expires_at <= now() AND r.state IN ('completed', 'failed')
            RETURNING r.generation INTO v_generation;
            PERFORM set_config('lock_timeout', v_saved_timeout, true);
            v_wait := extract(epoch FROM clock_timestamp() - v_wait_start);
        EXCEPTION WHEN lock_not_available THEN
            v_wait := extract(epoch FROM clock_timestamp() - v_wait_start);
            RETURN QUERY SELECT 'in_flight'::text, NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea, v_wait;
            RETURN;
        END;

        IF v_generation IS NOT NULL THEN
            RETURN QUERY SELECT 'execute'::text, v_generation, NULL::smallint, NULL::jsonb, NULL::bytea, v_wait;
            RETURN;
        END IF;

        -- The key is held by a committed, unexpired row that ON CONFLICT locked.
        SELECT * INTO v_row FROM idempotency_requests r
         WHERE r.tenant_id = p_tenant AND r.operation = p_operation
           AND r.idempotency_key = p_key;
        IF FOUND THEN
            IF v_row.fingerprint <> p_fingerprint THEN
                RETURN QUERY SELECT 'mismatch'::text, v_row.generation, NULL::smallint, NULL::jsonb, NULL::bytea, v_wait;
            ELSIF v_row.state IN ('completed', 'failed') THEN
                RETURN QUERY SELECT 'replay'::text, v_row.generation, v_row.response_status,
                                    v_row.response_headers, v_row.response_body, v_wait;
            ELSE
                RETURN QUERY SELECT 'in_flight'::text, v_row.generation, NULL::smallint, NULL::jsonb, NULL::bytea, v_wait;
            END IF;
            RETURN;
        END IF;
        -- Deleted between the two statements (a purge): claim again.
    END LOOP;
    RAISE EXCEPTION 'idem: the key kept changing under the claim' USING ERRCODE = 'IDEM2';
END;
$$;
