-- idem: a transactional re-claim of an expired key forgets the downstream key of
-- the leased execution that finished it.
--
-- downstream_key names a leased execution's effect at the provider (the
-- reconciler asks about it). A transactional execution has none; keeping the
-- previous one on the row made the new execution look like it had one. The
-- handler paths (hot_path.rs on PostgreSQL and SQLite) and MySQL's re-claim clear
-- it too. idem_claim as in 20261202000010_key_digest, with that one column more.

CREATE OR REPLACE FUNCTION idem_claim(
    p_tenant text,
    p_operation text,
    p_key bytea,
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
           AND r.key_digest = p_key AND r.expires_at > now()
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
                   (tenant_id, operation, key_digest, fingerprint, state, generation,
                    created_at, expires_at)
            VALUES (p_tenant, p_operation, p_key, p_fingerprint, 'processing', 1,
                    now(), now() + p_retention_ms * interval '1 millisecond')
            ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint,
                   state = 'processing',
                   generation = r.generation + 1,
                   response_status = NULL,
                   response_headers = NULL,
                   response_body = NULL,
                   owner_token = NULL,
                   downstream_key = NULL,
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
           AND r.key_digest = p_key;
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
