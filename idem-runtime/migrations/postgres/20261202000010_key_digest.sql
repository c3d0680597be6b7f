-- idem: keys are kept as their SHA-256 digests, never as sent.
--
-- A key bound or stored in clear shows up in the database's slow-query and error
-- logs, in pg_stat_activity and in every backup. From this migration on, idem
-- binds and stores sha256(key) (32 bytes, idem_runtime::IdempotencyKey::digest)
-- in a column renamed to key_digest, and the functions take it as bytea.
--
-- Existing rows are converted in place: their key becomes its digest, and the
-- downstream key of a leased execution (derived from the raw key, which is about
-- to be gone) is computed first and kept in the new downstream_key column, so
-- that the reconciler can still ask the provider about an uncertain execution.
--
-- Older versions of idem fail closed against the converted table (the column and
-- the text-key functions they use are gone: they answer 503), rather than write
-- raw keys that this version would not find.

ALTER TABLE idempotency_requests ADD COLUMN downstream_key text;

-- lease::downstream_key: sha256 over length-prefixed parts, first 16 bytes, hex.
UPDATE idempotency_requests
   SET downstream_key = encode(substring(sha256(
           int8send(18) || convert_to('idem-downstream-v1', 'UTF8')
           || int8send(octet_length(convert_to(tenant_id, 'UTF8'))::bigint) || convert_to(tenant_id, 'UTF8')
           || int8send(octet_length(convert_to(operation, 'UTF8'))::bigint) || convert_to(operation, 'UTF8')
           || int8send(octet_length(convert_to(idempotency_key, 'UTF8'))::bigint) || convert_to(idempotency_key, 'UTF8')
       ) FROM 1 FOR 16), 'hex')
 WHERE owner_token IS NOT NULL OR state = 'uncertain';

ALTER TABLE idempotency_requests RENAME COLUMN idempotency_key TO key_digest;
ALTER TABLE idempotency_requests
    ALTER COLUMN key_digest TYPE bytea USING sha256(convert_to(key_digest, 'UTF8'));
ALTER TABLE idempotency_requests
    ADD CONSTRAINT idempotency_requests_key_digest_len CHECK (octet_length(key_digest) = 32);

DROP FUNCTION idem_claim(text, text, text, bytea, bigint, bigint);
DROP FUNCTION idem_claim_leased(text, text, text, bytea, bigint, bigint);
DROP FUNCTION idem_precheck(text, text, text, bytea);
DROP FUNCTION idem_take(text, text, text, bytea, bigint, bigint);
DROP FUNCTION idem_finish(text, text, text, bigint, text, smallint, jsonb, bytea, bigint);

-- The functions as before, over key_digest; what each answers is documented in
-- the migration that first created it. idem_claim_leased also records the
-- downstream key of the execution it hands out.

CREATE FUNCTION idem_claim(
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

CREATE FUNCTION idem_claim_leased(
    p_tenant text,
    p_operation text,
    p_key bytea,
    p_fingerprint bytea,
    p_retention_ms bigint,
    p_lease_ms bigint,
    p_downstream_key text
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
               AND r.key_digest = p_key
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
                   (tenant_id, operation, key_digest, fingerprint, state, generation,
                    owner_token, lease_expires_at, created_at, expires_at, downstream_key)
            VALUES (p_tenant, p_operation, p_key, p_fingerprint, 'processing', 1,
                    gen_random_uuid(), v_now + p_lease_ms * interval '1 millisecond',
                    v_now, v_now + p_retention_ms * interval '1 millisecond', p_downstream_key)
            ON CONFLICT (tenant_id, operation, key_digest) DO NOTHING
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
                   owner_token = gen_random_uuid(), downstream_key = p_downstream_key,
                   lease_expires_at = v_now + p_lease_ms * interval '1 millisecond',
                   response_status = NULL, response_headers = NULL, response_body = NULL,
                   created_at = v_now, completed_at = NULL,
                   expires_at = v_now + p_retention_ms * interval '1 millisecond'
             WHERE r.tenant_id = p_tenant AND r.operation = p_operation AND r.key_digest = p_key
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
               downstream_key = p_downstream_key,
               lease_expires_at = v_now + p_lease_ms * interval '1 millisecond'
         WHERE r.tenant_id = p_tenant AND r.operation = p_operation AND r.key_digest = p_key
        RETURNING * INTO v_row;
        RETURN QUERY SELECT 'taken_over'::text, v_row.generation, v_row.owner_token::text,
            v_row.lease_expires_at, NULL::bigint, NULL::smallint, NULL::jsonb, NULL::bytea;
        RETURN;
    END LOOP;
    RAISE EXCEPTION 'idem: the key kept changing under the claim' USING ERRCODE = 'IDEM2';
END;
$$;

CREATE FUNCTION idem_precheck(
    p_tenant text,
    p_operation text,
    p_key bytea,
    p_fingerprint bytea
) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_fingerprint bytea;
BEGIN
    -- A finished, unexpired outcome is immutable, so this read needs no lock.
    SELECT r.fingerprint INTO v_fingerprint FROM idempotency_requests r
     WHERE r.tenant_id = p_tenant AND r.operation = p_operation
       AND r.key_digest = p_key AND r.expires_at > now()
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
    p_key bytea,
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
           (tenant_id, operation, key_digest, fingerprint, state, generation,
            created_at, expires_at)
    VALUES (p_tenant, p_operation, p_key, p_fingerprint, 'processing', 1,
            now(), now() + p_retention_ms * interval '1 millisecond')
    ON CONFLICT (tenant_id, operation, key_digest) DO NOTHING;
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
    p_key bytea,
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
       AND key_digest = p_key AND generation = p_generation
       AND state = 'processing';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem: the execution no longer holds its key (generation %)', p_generation
            USING ERRCODE = 'IDEM3';
    END IF;
END;
$$;
