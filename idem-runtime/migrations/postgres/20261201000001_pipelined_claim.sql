-- idem: the pipelined claim and completion of the macro's hot path.
--
-- A handler under #[idempotent] sends its claim in the same simple query as its
-- BEGIN, and its completion in the same simple query as its COMMIT:
--
--     SELECT idem_precheck(...); BEGIN ISOLATION LEVEL READ COMMITTED; SELECT idem_take(...)
--     ... the handler's own statements ...
--     SELECT idem_finish(...); COMMIT; BEGIN
--
-- so that idem adds no round trip to the handler's transaction. A statement that
-- travels with BEGIN cannot hand rows back (the driver reads only whether the
-- transaction began), so every outcome other than "claimed" is an error with its
-- own SQLSTATE, and the runtime takes it from there:
--
--   IDEM4  idem_precheck: a finished, unexpired outcome with the same fingerprint
--          (a replay; raised before BEGIN, so the connection is left idle)
--   IDEM5  idem_precheck: the same, with another fingerprint (a mismatch)
--   IDEM6  idem_take: the key exists in any other state (a concurrent request that
--          committed first, an expired outcome, a leased execution); the runtime
--          rolls back and claims with idem_claim, which handles every case
--   55P03  idem_take: a concurrent request held the key past the in-flight wait
--   IDEM3  idem_finish: the execution no longer holds its key; nothing commits
--
-- None of these needs a subtransaction: a failed take aborts a transaction that has
-- done nothing else yet. Hand-written callers keep idem_claim (see the first
-- migration), whose wait leaves their transaction usable.

CREATE FUNCTION idem_precheck(
    p_tenant text,
    p_operation text,
    p_key text,
    p_fingerprint bytea
) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_fingerprint bytea;
BEGIN
    -- A finished, unexpired outcome is immutable, so this read needs no lock.
    SELECT r.fingerprint INTO v_fingerprint FROM idempotency_requests r
     WHERE r.tenant_id = p_tenant AND r.operation = p_operation
       AND r.idempotency_key = p_key AND r.expires_at > now()
       AND r.state IN ('completed', 'failed');
    IF FOUND THEN
        IF v_fingerprint = p_fingerprint THEN
            RAISE EXCEPTION 'idem: replay of a stored outcome (not a failure)'
                USING ERRCODE = 'IDEM4';
        END IF;
        RAISE EXCEPTION 'idem: the key was used for another request'
            USING ERRCODE = 'IDEM5';
    END IF;
END;
$$;

CREATE FUNCTION idem_take(
    p_tenant text,
    p_operation text,
    p_key text,
    p_fingerprint bytea,
    p_retention_ms bigint,
    p_wait_ms bigint
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_saved_timeout text := current_setting('lock_timeout');
BEGIN
    -- A concurrent, uncommitted insert of the same key makes this wait for its
    -- transaction; lock_timeout bounds the wait (0 would mean forever).
    PERFORM set_config('lock_timeout', greatest(p_wait_ms, 1)::text || 'ms', true);
    INSERT INTO idempotency_requests
           (tenant_id, operation, idempotency_key, fingerprint, state, generation,
            created_at, expires_at)
    VALUES (p_tenant, p_operation, p_key, p_fingerprint, 'processing', 1,
            now(), now() + p_retention_ms * interval '1 millisecond')
    ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem: the key is taken; claiming the long way'
            USING ERRCODE = 'IDEM6';
    END IF;
    PERFORM set_config('lock_timeout', v_saved_timeout, true);
END;
$$;

CREATE FUNCTION idem_finish(
    p_tenant text,
    p_operation text,
    p_key text,
    p_generation bigint,
    p_state text,
    p_status smallint,
    p_headers jsonb,
    p_body bytea,
    p_retention_ms bigint
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    -- Retention runs from completion, on the database's clock.
    v_now timestamptz := clock_timestamp();
BEGIN
    UPDATE idempotency_requests
       SET state = p_state, response_status = p_status, response_headers = p_headers,
           response_body = p_body, completed_at = v_now,
           expires_at = v_now + p_retention_ms * interval '1 millisecond'
     WHERE tenant_id = p_tenant AND operation = p_operation
       AND idempotency_key = p_key AND generation = p_generation
       AND state = 'processing';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem: the execution no longer holds its key (generation %)', p_generation
            USING ERRCODE = 'IDEM3';
    END IF;
END;
$$;
