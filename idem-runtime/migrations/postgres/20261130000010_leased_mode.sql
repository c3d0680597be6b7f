-- idem: leased mode, for operations whose effect lives outside the database.
--
-- The claim commits on its own with an owner token and a lease. Completion is
-- fenced by the token (UPDATE ... WHERE owner_token = $), so a worker whose lease
-- was taken over can never publish. See idem_runtime::lease.
--
-- outcome is one of:
--   acquired    a new key; the caller owns it
--   reclaimed   a finished outcome whose retention had passed; executed anew
--   taken_over  an execution whose lease had lapsed (its worker died or stalled);
--               the caller owns it now, with a new token and generation
--   replay      a stored outcome with the same fingerprint
--   mismatch    the key is in use for a different request
--   in_flight   another worker holds a live lease (lease_expires_at says until when)
--   uncertain   an earlier execution's effect is unknown; it awaits reconciliation
CREATE FUNCTION idem_claim_leased(
    p_tenant text,
    p_operation text,
    p_key text,
    p_fingerprint bytea,
    p_retention_ms bigint,
    p_lease_ms bigint
) RETURNS TABLE (
    outcome text,
    generation bigint,
    owner_token text,
    lease_expires_at timestamptz,
    retry_after_ms bigint,
    response_status smallint,
    response_headers jsonb,
    response_body bytea
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_saved_timeout text := current_setting('lock_timeout');
    v_row idempotency_requests%ROWTYPE;
    v_now timestamptz;
BEGIN
    -- Claimers hold the row lock for a moment only; a longer holder (a slow
    -- statement elsewhere) is answered "in flight" rather than waited for, so a
    -- retry never parks a connection.
    FOR attempt IN 1..3 LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '200ms', true);
            SELECT * INTO v_row FROM idempotency_requests r
             WHERE r.tenant_id = p_tenant AND r.operation = p_operation
               AND r.idempotency_key = p_key
               FOR UPDATE;
            PERFORM set_config('lock_timeout', v_saved_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            RETURN QUERY SELECT 'in_flight'::text, NULL::bigint, NULL::text, NULL::timestamptz,
                1000::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
            RETURN;
        END;
        v_now := clock_timestamp();

        IF v_row.tenant_id IS NULL THEN
            INSERT INTO idempotency_requests AS r
                   (tenant_id, operation, idempotency_key, fingerprint, state, generation,
                    owner_token, lease_expires_at, created_at, expires_at)
            VALUES (p_tenant, p_operation, p_key, p_fingerprint, 'processing', 1,
                    gen_random_uuid(), v_now + p_lease_ms * interval '1 millisecond',
                    v_now, v_now + p_retention_ms * interval '1 millisecond')
            ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING
            RETURNING * INTO v_row;
            IF FOUND THEN
                RETURN QUERY SELECT 'acquired'::text, v_row.generation, v_row.owner_token::text,
                    v_row.lease_expires_at, NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
                RETURN;
            END IF;
            CONTINUE; -- inserted by someone else just now: look again
        END IF;

        IF v_row.state IN ('completed', 'failed') AND v_row.expires_at <= v_now THEN
            UPDATE idempotency_requests r
               SET fingerprint = p_fingerprint, state = 'processing', generation = r.generation + 1,
                   owner_token = gen_random_uuid(),
                   lease_expires_at = v_now + p_lease_ms * interval '1 millisecond',
                   response_status = NULL, response_headers = NULL, response_body = NULL,
                   created_at = v_now, completed_at = NULL,
                   expires_at = v_now + p_retention_ms * interval '1 millisecond'
             WHERE r.tenant_id = p_tenant AND r.operation = p_operation AND r.idempotency_key = p_key
            RETURNING * INTO v_row;
            RETURN QUERY SELECT 'reclaimed'::text, v_row.generation, v_row.owner_token::text,
                v_row.lease_expires_at, NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
            RETURN;
        END IF;

        IF v_row.fingerprint <> p_fingerprint THEN
            RETURN QUERY SELECT 'mismatch'::text, v_row.generation, NULL::text, NULL::timestamptz,
                NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
            RETURN;
        END IF;

        IF v_row.state IN ('completed', 'failed') THEN
            RETURN QUERY SELECT 'replay'::text, v_row.generation, NULL::text, NULL::timestamptz,
                NULL::bigint, v_row.response_status, v_row.response_headers, v_row.response_body;
            RETURN;
        END IF;

        IF v_row.state = 'uncertain' THEN
            RETURN QUERY SELECT 'uncertain'::text, v_row.generation, NULL::text, NULL::timestamptz,
                NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
            RETURN;
        END IF;

        -- processing: a live lease (or a transactional execution) keeps it
        IF v_row.lease_expires_at IS NULL OR v_row.lease_expires_at > v_now THEN
            RETURN QUERY SELECT 'in_flight'::text, v_row.generation, NULL::text, v_row.lease_expires_at,
                greatest(1, ceil(extract(epoch FROM (coalesce(v_row.lease_expires_at, v_now) - v_now)) * 1000))::bigint,
                NULL::smallint, NULL::jsonb, NULL::bytea;
            RETURN;
        END IF;

        -- the lease lapsed: take the execution over, fencing the old owner out
        UPDATE idempotency_requests r
           SET owner_token = gen_random_uuid(), generation = r.generation + 1,
               lease_expires_at = v_now + p_lease_ms * interval '1 millisecond'
         WHERE r.tenant_id = p_tenant AND r.operation = p_operation AND r.idempotency_key = p_key
        RETURNING * INTO v_row;
        RETURN QUERY SELECT 'taken_over'::text, v_row.generation, v_row.owner_token::text,
            v_row.lease_expires_at, NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
        RETURN;
    END LOOP;
    RAISE EXCEPTION 'idem: the key kept changing under the claim' USING ERRCODE = 'IDEM2';
END;
$$;
