#!/usr/bin/env bash
# The database's share of the hot path (issue 7), without HTTP or Rust: pgbench
# runs each transaction shape of the benchmark against a scratch database with
# idem's migrations, alternating shapes for ROUNDS rounds so drift hits all alike.
#
#   benches/sql_variants.sh                  # 8 clients, 8 s per shape, 2 rounds
#   CLIENTS=8 SECS=10 ROUNDS=3 benches/sql_variants.sh
#
# Shapes (prepared statements, like sqlx):
#   bare          BEGIN; INSERT order; COMMIT                                   (a)
#   idem          BEGIN RC; SELECT idem_claim(...); INSERT; UPDATE complete; COMMIT (b)
#   idem_nosub    the same with a claim function without the EXCEPTION block,
#                 i.e. no subtransaction (proposal M1 in BENCHMARKS.md)
#   idem_noidx    idem, on a copy of the table without the two secondary indexes
#                 (an upper bound for proposal M2: HOT completions)
#   idem_plain    idem with a plain `INSERT ... ON CONFLICT DO NOTHING RETURNING`
#                 instead of idem_claim (what the function costs; no replay/wait logic)
#   idem_pipe     idem with BEGIN + claim and UPDATE + COMMIT each sent as one
#                 pipeline: 5 round trips instead of 7 (proposals R1 and R2)
#   mw            INSERT claim; BEGIN; INSERT; COMMIT; UPDATE complete          (d)
#   pipelined     what #[idempotent] sends now (pgbench -M simple: literals, as in
#                 store::postgres::pipelined): idem_precheck + BEGIN + idem_take in
#                 one message, INSERT, idem_finish + COMMIT + BEGIN in one, and the
#                 ROLLBACK that rides on the release: 4 round trips (simple
#                 mode sends its INSERT unprepared too, unlike sqlx: an overstatement)
# Then the PostgreSQL backend CPU per transaction of the same shapes, executed
# LOOP times by a procedure in one backend (no protocol, no round trips, no other
# clients), read from /proc: the executor and WAL cost alone (CPU time still
# inflates when the machine is busy; compare shapes within one run). The database
# is dropped at the end.
set -euo pipefail

CLIENTS=${CLIENTS:-8}
SECS=${SECS:-8}
ROUNDS=${ROUNDS:-2}
LOOP=${LOOP:-10000}
HOST=${PGHOST:-127.0.0.1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DB=idem_bench_$$
WORK=$(mktemp -d)
psql() { command psql -h "$HOST" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }
trap 'psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"; rm -rf "$WORK"' EXIT

psql -d postgres -c "CREATE DATABASE $DB"
for f in "$ROOT"/idem-runtime/migrations/postgres/*.sql; do psql -d "$DB" -f "$f"; done
psql -d "$DB" <<'SQL'
CREATE TABLE orders (
    id bigserial PRIMARY KEY, tenant_id text NOT NULL, sku text NOT NULL,
    quantity integer NOT NULL CHECK (quantity >= 1),
    amount_cents bigint NOT NULL CHECK (amount_cents >= 0),
    currency text NOT NULL, note text, created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX orders_tenant_idx ON orders (tenant_id, id);
CREATE TABLE mw_idempotency_requests (LIKE idempotency_requests INCLUDING ALL);
SQL
# idem_claim without its EXCEPTION block: same statements, no subtransaction. A
# lock timeout then aborts the transaction instead of answering in_flight, which the
# macro's path can take (nothing ran before the claim).
sed -e 's/CREATE FUNCTION idem_claim(/CREATE FUNCTION idem_claim_nosub(/' \
    -e '/^        BEGIN$/d' \
    -e '/^        EXCEPTION WHEN lock_not_available THEN$/,/^        END;$/d' \
    "$ROOT"/idem-runtime/migrations/postgres/20261130000001_idempotency_requests.sql |
    sed -n '/CREATE FUNCTION idem_claim_nosub/,$p' >"$WORK/nosub.sql"
psql -d "$DB" -f "$WORK/nosub.sql"
# A schema whose idempotency_requests has only its primary key.
psql -d "$DB" <<'SQL'
CREATE SCHEMA noidx;
CREATE TABLE noidx.idempotency_requests (LIKE public.idempotency_requests INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE noidx.idempotency_requests ADD PRIMARY KEY (tenant_id, operation, idempotency_key);
SQL
sed -n '/CREATE FUNCTION idem_claim(/,$p' "$ROOT"/idem-runtime/migrations/postgres/20261130000001_idempotency_requests.sql |
    sed -e 's/CREATE FUNCTION idem_claim(/CREATE FUNCTION noidx.idem_claim(/' \
        -e 's/idempotency_requests/noidx.idempotency_requests/g' >"$WORK/noidx.sql"
psql -d "$DB" -f "$WORK/noidx.sql"

FP="'\\x0000000000000000000000000000000000000000000000000000000000000000'::bytea"
INSERT="INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) VALUES ('t', 'A-1', 2, 1999, 'EUR', 'k' || :k) RETURNING id, created_at::text;"
complete() { # $1: table
    echo "UPDATE $1 SET state = 'completed', response_status = 201, response_headers = '[[\"content-type\",\"application/json\"],[\"location\",\"/orders/1\"]]', response_body = '\\x7b226964223a317d'::bytea, completed_at = c.t, expires_at = c.t + 86400000 * interval '1 millisecond' FROM (SELECT clock_timestamp() AS t) c WHERE tenant_id = 't' AND operation = 'create-order' AND idempotency_key = 'k' || :k AND state = 'processing';"
}
idem() { # $1: claim function, $2: table
    printf '%s\n' '\set k random(1, 9000000000000)' 'BEGIN ISOLATION LEVEL READ COMMITTED;' \
        "SELECT outcome, generation FROM $1('t', 'create-order', 'k' || :k, $FP, 86400000, 2000);" \
        "$INSERT" "$(complete "$2")" 'COMMIT;'
}
printf '%s\n' '\set k random(1, 9000000000000)' 'BEGIN;' "$INSERT" 'COMMIT;' >"$WORK/bare.sql"
idem idem_claim idempotency_requests >"$WORK/idem.sql"
idem idem_claim_nosub idempotency_requests >"$WORK/idem_nosub.sql"
idem noidx.idem_claim noidx.idempotency_requests >"$WORK/idem_noidx.sql"
MW_CLAIM="INSERT INTO TABLE (tenant_id, operation, idempotency_key, fingerprint, state, created_at, expires_at) VALUES ('t', 'create-order', 'k' || :k, $FP, 'processing', now(), now() + interval '1 day') ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING RETURNING generation;"
printf '%s\n' '\set k random(1, 9000000000000)' 'BEGIN ISOLATION LEVEL READ COMMITTED;' \
    "${MW_CLAIM/TABLE/idempotency_requests}" "$INSERT" "$(complete idempotency_requests)" 'COMMIT;' >"$WORK/idem_plain.sql"
printf '%s\n' '\set k random(1, 9000000000000)' '\startpipeline' 'BEGIN ISOLATION LEVEL READ COMMITTED;' \
    "SELECT outcome, generation FROM idem_claim('t', 'create-order', 'k' || :k, $FP, 86400000, 2000);" \
    '\endpipeline' "$INSERT" '\startpipeline' "$(complete idempotency_requests)" 'COMMIT;' '\endpipeline' >"$WORK/idem_pipe.sql"
printf '%s\n' '\set k random(1, 9000000000000)' \
    "INSERT INTO mw_idempotency_requests (tenant_id, operation, idempotency_key, fingerprint, state, created_at, expires_at) VALUES ('t', 'create-order', 'k' || :k, $FP, 'processing', now(), now() + interval '1 day') ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING RETURNING generation;" \
    'BEGIN;' "$INSERT" 'COMMIT;' "$(complete mw_idempotency_requests)" >"$WORK/mw.sql"

FPE="E'\\\\x0000000000000000000000000000000000000000000000000000000000000000'::bytea"
KEY="E't', E'create-order', E'k:k'"
printf '%s\n' '\set k random(1, 9000000000000)' \
    "SELECT idem_precheck($KEY, $FPE) \\; BEGIN ISOLATION LEVEL READ COMMITTED \\; SELECT idem_take($KEY, $FPE, 86400000, 2000);" \
    "$INSERT" \
    "SELECT idem_finish($KEY, 1, 'completed', 201::smallint, E'[[\"content-type\",\"application/json\"],[\"location\",\"/orders/1\"]]'::jsonb, E'\\\\x7b226964223a317d'::bytea, 86400000) \\; COMMIT \\; BEGIN;" \
    'ROLLBACK;' >"$WORK/pipelined.sql"

echo "pgbench -M prepared (pipelined: -M simple), $CLIENTS clients, $SECS s per shape; PostgreSQL $(psql -d "$DB" -c 'SHOW server_version'); load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
    for shape in bare idem idem_nosub idem_noidx idem_plain idem_pipe mw pipelined; do
        mode=prepared
        [ "$shape" = pipelined ] && mode=simple
        tps=$(pgbench -h "$HOST" -U postgres -n -M "$mode" -c "$CLIENTS" -j 2 -T "$SECS" \
            -f "$WORK/$shape.sql" "$DB" 2>&1 | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
        printf 'round %d  %-11s %8.0f tps\n' "$round" "$shape" "$tps"
    done
done
echo "completions that were HOT updates: $(psql -d "$DB" -c "SELECT n_tup_hot_upd || ' of ' || n_tup_upd FROM pg_stat_user_tables WHERE relname = 'idempotency_requests' AND schemaname = 'public'")"
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"

# --- backend CPU per transaction, in one backend ---------------------------------
psql -d "$DB" <<'SQL'
TRUNCATE idempotency_requests, orders;
CREATE PROCEDURE run_shape(shape text, n int) LANGUAGE plpgsql AS $$
DECLARE k text; g bigint; o text;
BEGIN
  FOR i IN 1..n LOOP
    k := shape || '-' || i || '-' || random();
    IF shape = 'idem' THEN
      SELECT c.outcome, c.generation INTO o, g FROM idem_claim('t', 'create-order', k,
        '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea, 86400000, 2000) c;
    ELSIF shape = 'idem_nosub' THEN
      SELECT c.outcome, c.generation INTO o, g FROM idem_claim_nosub('t', 'create-order', k,
        '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea, 86400000, 2000) c;
    ELSIF shape = 'idem_plain' THEN
      INSERT INTO idempotency_requests (tenant_id, operation, idempotency_key, fingerprint, state, created_at, expires_at)
      VALUES ('t', 'create-order', k, '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea,
              'processing', now(), now() + interval '1 day')
      ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING RETURNING generation INTO g;
    END IF;
    INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) VALUES ('t', 'A-1', 2, 1999, 'EUR', k);
    IF shape <> 'bare' THEN
      UPDATE idempotency_requests SET state = 'completed', response_status = 201,
             response_headers = '[["content-type","application/json"],["location","/orders/1"]]',
             response_body = '\x7b226964223a317d'::bytea, completed_at = c.t,
             expires_at = c.t + 86400000 * interval '1 millisecond'
        FROM (SELECT clock_timestamp() AS t) c
       WHERE tenant_id = 't' AND operation = 'create-order' AND idempotency_key = k AND state = 'processing';
    END IF;
    COMMIT;
  END LOOP;
END $$;
SQL
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
loop_cpu() { # $1: shape; prints backend CPU microseconds per transaction
    command psql -h "$HOST" -U postgres -qAt -d "$DB" -c "SELECT pg_sleep(1)" \
        -c "CALL run_shape('$1', $LOOP)" -c "SELECT pg_sleep(1.5)" >/dev/null &
    local bg=$! pid t0 q seen=0
    sleep 0.5
    pid=$(psql -d postgres -c "SELECT pid FROM pg_stat_activity WHERE datname = '$DB' AND query LIKE 'SELECT pg_sleep(1)%'")
    t0=$(ticks "$pid")
    while true; do
        q=$(psql -d postgres -c "SELECT query FROM pg_stat_activity WHERE pid = $pid")
        case "$q" in CALL*) seen=1 ;; "SELECT pg_sleep(1.5)") [ $seen = 1 ] && break ;; esac
        sleep 0.05
    done
    echo $((($(ticks "$pid") - t0) * 10000 / LOOP)) # ticks are 10 ms
    wait "$bg"
}
# The table is not analysed while empty: an empty ANALYZE makes sessions cache
# sequential-scan plans for the key lookups (see BENCHMARKS.md).
echo "backend CPU per transaction, $LOOP transactions in one backend:"
for round in 1 2; do
    for shape in bare idem idem_nosub idem_plain; do
        printf 'round %d  %-11s %5d us\n' "$round" "$shape" "$(loop_cpu "$shape")"
    done
done
