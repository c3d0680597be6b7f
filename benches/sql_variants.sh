#!/usr/bin/env bash
# The database's share of the hot path (issues 7 and 24), without HTTP or Rust:
# pgbench runs each transaction shape against a scratch database with idem's
# migrations, alternating shapes for ROUNDS rounds so drift hits all alike, and
# prints each shape's median tps as a share of `bare` in the same run.
#
#   benches/sql_variants.sh                  # 8 clients, 8 s per shape, 2 rounds
#   CLIENTS=4 SECS=5 ROUNDS=3 benches/sql_variants.sh
#   SHAPES="bare optimistic lookup_optimistic" benches/sql_variants.sh
#   SYNCHRONOUS_COMMIT=off benches/sql_variants.sh   # commits do not wait for the WAL flush:
#                                                     # round trips and CPU only (slow disks)
#
# Keys are stored as sha256 digests (migration 20261202000010_key_digest.sql): a
# transaction draws k with \set and binds sha256(('k' || :k)::bytea) in the
# statement (the server hashes; the runtime binds the 32 bytes it computed); the
# fingerprint is a constant 32-byte bytea. REPLAY_KEYS finished rows (k = 1..N,
# live for a day) are written before the rounds; the write shapes draw k above N.
#
# Shapes (pgbench -M prepared, like sqlx, unless marked simple):
#   bare              BEGIN; INSERT order; COMMIT (the yardstick, = 1)
#   floor             BEGIN; INSERT order; plain INSERT of the finished row; COMMIT (no idem can be cheaper)
#   optimistic        BEGIN RC; INSERT order; COMPLETE; COMMIT (COMPLETE = the finished row upsert of lookup_optimistic)
#   lookup_optimistic the lookup (outside a transaction); BEGIN RC; SELECT set_config(timeouts); INSERT order; COMPLETE; COMMIT
#   lookup_optimistic_pipe  the same, with BEGIN and the set_config SELECT in one pgbench pipeline (one round trip, prepared)
#   lookup_optimistic_simple  the same, with BEGIN \; set_config SELECT as one line: -M simple (everything unprepared)
#   replay            the lookup alone, on a pre-populated finished key (the replay path: one prepared statement, no transaction)
#   lookup_advisory   BEGIN RC; SELECT pg_advisory_xact_lock(..), (lookup subquery); INSERT order; COMPLETE; COMMIT
#   claim_update      the old shape: BEGIN RC; INSERT processing claim ON CONFLICT DO NOTHING RETURNING; INSERT order; UPDATE to completed; COMMIT
#   pipeline          a pipelining driver: the prepared lookup, BEGIN RC and set_config in one pgbench
#                     pipeline (one round trip); INSERT order; COMPLETE and COMMIT in one pipeline
#   bare_simple (simple) bare, unprepared: the yardstick of the session shape
#   session (simple)  what the runtime sends where sessions are kept (db/postgres/session.rs):
#                     BEGIN RC \; EXECUTE idem_probe_3(.., deadline); INSERT order;
#                     EXECUTE idem_finish_2(..) \; COMMIT, the statements PREPAREd once per
#                     pgbench client (the runtime's COMMIT AND CHAIN, whose empty transaction's
#                     ROLLBACK rides with the pool's release ping, is a plain COMMIT here:
#                     pgbench would give that ROLLBACK a round trip of its own)
#                     (idem_finish_2, the upsert, is what the runtime sends to take over an
#                     expired row; before idem_insert_1 it finished every key)
#   session_insert (simple)  what the runtime sends for a new key: the same, the finish a plain
#                     INSERT (idem_insert_1), its unique violation meaning a race
#   session_insert_untimed (simple)  session_insert without the deadline (the probe's two
#                     set_config calls): what the request deadline costs the server
#   session_insert_unbounded (simple)  session_insert without the in-flight bound (the
#                     insert's lock_timeout saved, set and given back): what that bound costs
#   (the last two change what a request promises; they measure, they are not proposals;
#   not in the default SHAPES)
#   pipelined (simple) what the runtime sent before the one-row path: idem_precheck \; BEGIN \; idem_take; INSERT order; idem_finish \; COMMIT \; BEGIN; ROLLBACK
#                     (literals, 32-byte digest literals; skipped with a note when the database lacks idem_precheck/idem_take/idem_finish)
# pgbench cannot prepare a line holding two statements ("cannot insert multiple
# commands into a prepared statement"), so the runtime's message "BEGIN ISOLATION
# LEVEL READ COMMITTED; SELECT set_config(..)" (one simple query) is approximated
# three ways: two prepared round trips (lookup_optimistic, an overstatement), one
# pipeline (lookup_optimistic_pipe, the closest), one simple-query line in a script
# that is then unprepared throughout (lookup_optimistic_simple, an overstatement of
# the parse cost of the other statements, like pipelined).
# Dropped from the earlier version: idem (idem_claim, the hand-written path),
# idem_nosub, idem_noidx, idem_pipe and mw (idem_plain is now claim_update).
#
# Then the PostgreSQL backend CPU per transaction of the shapes, executed LOOP
# times by a procedure in one backend (no protocol, no round trips, no other
# clients), read from /proc: the executor and WAL cost alone (CPU time still
# inflates when the machine is busy; compare shapes within one run). The lookup
# of lookup_optimistic and replay runs in a transaction of its own there (a
# read-only COMMIT). The database is dropped at the end.
set -euo pipefail

CLIENTS=${CLIENTS:-8}
SECS=${SECS:-8}
ROUNDS=${ROUNDS:-2}
LOOP=${LOOP:-10000}
REPLAY_KEYS=${REPLAY_KEYS:-100000}
SHAPES=${SHAPES:-bare floor optimistic lookup_optimistic lookup_optimistic_pipe lookup_optimistic_simple pipeline bare_simple session session_insert replay lookup_advisory claim_update pipelined}
case " $SHAPES " in *" bare "*) ;; *) SHAPES="bare $SHAPES" ;; esac
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
SQL
[ -z "${SYNCHRONOUS_COMMIT:-}" ] || psql -d postgres -c "ALTER DATABASE $DB SET synchronous_commit = '$SYNCHRONOUS_COMMIT'"
PIPELINED=$(psql -d "$DB" -c "SELECT to_regprocedure('idem_precheck(text,text,bytea,bytea)') IS NOT NULL
    AND to_regprocedure('idem_take(text,text,bytea,bytea,bigint,bigint)') IS NOT NULL
    AND to_regprocedure('idem_finish(text,text,bytea,bigint,text,smallint,jsonb,bytea,bigint)') IS NOT NULL")

# --- the statements --------------------------------------------------------------
D="sha256(('k' || :k)::bytea)"                                 # the key's digest
FP="'\\x$(printf '0%.0s' {1..64})'::bytea"                     # a constant fingerprint
HEADERS='[["content-type","application/json"],["location","/orders/1"]]'
BODY="'\\x7b226964223a317d'::bytea"
COLS="tenant_id, operation, key_digest, fingerprint, state, generation, response_status, response_headers, response_body, created_at, completed_at, expires_at"
KSET='\set k random('$((REPLAY_KEYS + 1))', 9000000000000)'
ORDER="INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) VALUES ('t', 'A-1', 2, 1999, 'EUR', 'k' || :k) RETURNING id, created_at::text;"
LOOKUP="SELECT fingerprint, state, generation, expires_at > now() AS live, response_status, response_headers, response_body FROM idempotency_requests WHERE tenant_id = 't' AND operation = 'create-order' AND key_digest = $D;"
TIMEOUTS="SELECT set_config('statement_timeout', '31000', true), set_config('idle_in_transaction_session_timeout', '31000', true);"
COMPLETE="INSERT INTO idempotency_requests AS r ($COLS) SELECT 't', 'create-order', $D, $FP, 'completed', 1, 201::smallint, '$HEADERS'::jsonb, $BODY, now(), c.t, c.t + 86400000 * interval '1 millisecond' FROM (SELECT clock_timestamp() AS t, set_config('lock_timeout', '2000ms', true)) c ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, generation = r.generation + 1, response_status = EXCLUDED.response_status, response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body, owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, expires_at = EXCLUDED.expires_at WHERE r.expires_at <= now() AND r.state IN ('completed', 'failed') RETURNING r.generation;"
FINISHED="INSERT INTO idempotency_requests ($COLS) VALUES ('t', 'create-order', $D, $FP, 'completed', 1, 201, '$HEADERS', $BODY, now(), clock_timestamp(), clock_timestamp() + 86400000 * interval '1 millisecond');"
# (no colon in a literal: pgbench takes :name anywhere in a line for a variable)
ADVISORY="SELECT pg_advisory_xact_lock(hashtextextended('t/create-order/' || encode($D, 'hex'), 0)) AS locked, (SELECT (fingerprint, state, generation, expires_at > now(), response_status, response_headers, response_body) FROM idempotency_requests WHERE tenant_id = 't' AND operation = 'create-order' AND key_digest = $D) AS found;"
CLAIM="INSERT INTO idempotency_requests (tenant_id, operation, key_digest, fingerprint, state, created_at, expires_at) VALUES ('t', 'create-order', $D, $FP, 'processing', now(), now() + interval '1 day') ON CONFLICT (tenant_id, operation, key_digest) DO NOTHING RETURNING generation;"
UPDATE="UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '$HEADERS', response_body = $BODY, completed_at = c.t, expires_at = c.t + 86400000 * interval '1 millisecond' FROM (SELECT clock_timestamp() AS t) c WHERE tenant_id = 't' AND operation = 'create-order' AND key_digest = $D AND state = 'processing';"
RC='BEGIN ISOLATION LEVEL READ COMMITTED;'

script() { printf '%s\n' "$@" >"$WORK/$shape.sql"; }
shape=bare;                     script "$KSET" 'BEGIN;' "$ORDER" 'COMMIT;'
shape=floor;                    script "$KSET" 'BEGIN;' "$ORDER" "$FINISHED" 'COMMIT;'
shape=optimistic;               script "$KSET" "$RC" "$ORDER" "$COMPLETE" 'COMMIT;'
# The runtime sends BEGIN and the set_config SELECT as one simple-query message;
# pgbench cannot prepare such a line, hence two round trips here (see the header).
shape=lookup_optimistic;        script "$KSET" "$LOOKUP" "$RC" "$TIMEOUTS" "$ORDER" "$COMPLETE" 'COMMIT;'
shape=lookup_optimistic_pipe;   script "$KSET" "$LOOKUP" '\startpipeline' "$RC" "$TIMEOUTS" '\endpipeline' "$ORDER" "$COMPLETE" 'COMMIT;'
shape=lookup_optimistic_simple; script "$KSET" "$LOOKUP" "${RC%;} \\; $TIMEOUTS" "$ORDER" "$COMPLETE" 'COMMIT;'
shape=replay;                   script "\\set k random(1, $REPLAY_KEYS)" "$LOOKUP"
shape=lookup_advisory;          script "$KSET" "$RC" "$ADVISORY" "$ORDER" "$COMPLETE" 'COMMIT;'
shape=claim_update;             script "$KSET" "$RC" "$CLAIM" "$ORDER" "$UPDATE" 'COMMIT;'
# Literals, as store::postgres::pipelined sent them: k has 13 digits, so 51 zeros
# and k make a 32-byte digest literal (pgbench's simple mode substitutes :k in it).
KL="'t', 'create-order', '\\x$(printf '0%.0s' {1..51}):k'::bytea"
shape=pipelined;                script '\set k random(1000000000000, 8999999999999)' \
    "SELECT idem_precheck($KL, $FP) \\; BEGIN ISOLATION LEVEL READ COMMITTED \\; SELECT idem_take($KL, $FP, 86400000, 2000);" \
    "$ORDER" \
    "SELECT idem_finish($KL, 1, 'completed', 201::smallint, '$HEADERS'::jsonb, $BODY, 86400000) \\; COMMIT \\; BEGIN;" \
    'ROLLBACK;'

shape=pipeline;                 script "$KSET" '\startpipeline' "$LOOKUP" "$RC" "$TIMEOUTS" '\endpipeline' "$ORDER" \
    '\startpipeline' "$COMPLETE" 'COMMIT;' '\endpipeline'
shape=bare_simple;              script "$KSET" 'BEGIN;' "$ORDER" 'COMMIT;'
# The session statements as the runtime prepares them (db/postgres/session.rs;
# keep the two alike), once per pgbench client: its variables persist across
# transactions (-D prepared=0 starts each at 0).
KD="'\\x$(printf '0%.0s' {1..51}):k'::bytea"
shape=session;                  script '\set k random(1000000000000, 8999999999999)' \
    '\if :prepared = 0' \
    "PREPARE idem_probe_3(text, text, bytea, text) AS SELECT set_config('statement_timeout', \$4, true), set_config('idle_in_transaction_session_timeout', \$4, true), (SELECT (r.state || ': idem: the key has a row')::int FROM idempotency_requests r WHERE r.tenant_id = \$1 AND r.operation = \$2 AND r.key_digest = \$3);" \
    "PREPARE idem_finish_2(text, text, bytea, bytea, text, smallint, jsonb, bytea, bigint, text, bigint) AS WITH ins AS (INSERT INTO idempotency_requests AS r ($COLS) SELECT \$1, \$2, \$3, \$4, \$5, \$11, \$6, \$7, \$8, now(), c.t, c.t + \$9 * interval '1 millisecond' FROM (SELECT clock_timestamp() AS t, set_config('idem.lock_timeout', current_setting('lock_timeout'), true) AS saved, set_config('lock_timeout', \$10, true) AS bounded) c ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, generation = EXCLUDED.generation, response_status = EXCLUDED.response_status, response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body, owner_token = NULL, lease_expires_at = NULL, downstream_key = NULL, created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, expires_at = EXCLUDED.expires_at WHERE r.expires_at <= now() AND r.state IN ('completed', 'failed') AND r.generation = EXCLUDED.generation - 1 RETURNING r.generation) SELECT (CASE count(*) WHEN 0 THEN 'idem taken' ELSE '1' END)::int, set_config('lock_timeout', current_setting('idem.lock_timeout'), true) FROM ins;" \
    '\set prepared 1' '\endif' \
    "${RC%;} \\; EXECUTE idem_probe_3('t', 'create-order', $KD, '31000');" \
    "$ORDER" \
    "EXECUTE idem_finish_2('t', 'create-order', $KD, $FP, 'completed', 201, '$HEADERS', $BODY, 86400000, '2000', 1) \\; COMMIT;"
# The same, with the finish of a key the probe found no row for as the runtime
# sends it: a plain insert (idem_insert_1), no ON CONFLICT arbiter, no CTE.
shape=session_insert;           script '\set k random(1000000000000, 8999999999999)' \
    '\if :prepared = 0' \
    "PREPARE idem_probe_3(text, text, bytea, text) AS SELECT set_config('statement_timeout', \$4, true), set_config('idle_in_transaction_session_timeout', \$4, true), (SELECT (r.state || ': idem: the key has a row')::int FROM idempotency_requests r WHERE r.tenant_id = \$1 AND r.operation = \$2 AND r.key_digest = \$3);" \
    "PREPARE idem_insert_1(text, text, bytea, bytea, text, smallint, jsonb, bytea, bigint, text) AS INSERT INTO idempotency_requests ($COLS) SELECT \$1, \$2, \$3, \$4, \$5, 1, \$6, \$7, \$8, now(), c.t, c.t + \$9 * interval '1 millisecond' FROM (SELECT clock_timestamp() AS t, set_config('idem.lock_timeout', current_setting('lock_timeout'), true) AS saved, set_config('lock_timeout', \$10, true) AS bounded) c RETURNING set_config('lock_timeout', current_setting('idem.lock_timeout'), true);" \
    '\set prepared 1' '\endif' \
    "${RC%;} \\; EXECUTE idem_probe_3('t', 'create-order', $KD, '31000');" \
    "$ORDER" \
    "EXECUTE idem_insert_1('t', 'create-order', $KD, $FP, 'completed', 201, '$HEADERS', $BODY, 86400000, '2000') \\; COMMIT;"

# session_insert less one part, to price it (see the header).
PROBE_PREP="PREPARE idem_probe_3(text, text, bytea, text) AS SELECT set_config('statement_timeout', \$4, true), set_config('idle_in_transaction_session_timeout', \$4, true), (SELECT (r.state || ': idem: the key has a row')::int FROM idempotency_requests r WHERE r.tenant_id = \$1 AND r.operation = \$2 AND r.key_digest = \$3);"
INSERT_PREP="PREPARE idem_insert_1(text, text, bytea, bytea, text, smallint, jsonb, bytea, bigint, text) AS INSERT INTO idempotency_requests ($COLS) SELECT \$1, \$2, \$3, \$4, \$5, 1, \$6, \$7, \$8, now(), c.t, c.t + \$9 * interval '1 millisecond' FROM (SELECT clock_timestamp() AS t, set_config('idem.lock_timeout', current_setting('lock_timeout'), true) AS saved, set_config('lock_timeout', \$10, true) AS bounded) c RETURNING set_config('lock_timeout', current_setting('idem.lock_timeout'), true);"
session_minus() { # $1: the probe's PREPARE, $2: the insert's PREPARE
    script '\set k random(1000000000000, 8999999999999)' \
        '\if :prepared = 0' "$1" "$2" '\set prepared 1' '\endif' \
        "${RC%;} \\; EXECUTE idem_probe_3('t', 'create-order', $KD, '31000');" \
        "$ORDER" \
        "EXECUTE idem_insert_1('t', 'create-order', $KD, $FP, 'completed', 201, '$HEADERS', $BODY, 86400000, '2000') \\; COMMIT;"
}
shape=session_insert_untimed;   session_minus \
    "PREPARE idem_probe_3(text, text, bytea, text) AS SELECT (SELECT (r.state || ': idem: the key has a row')::int FROM idempotency_requests r WHERE r.tenant_id = \$1 AND r.operation = \$2 AND r.key_digest = \$3);" \
    "$INSERT_PREP"
shape=session_insert_unbounded; session_minus "$PROBE_PREP" \
    "PREPARE idem_insert_1(text, text, bytea, bytea, text, smallint, jsonb, bytea, bigint, text) AS INSERT INTO idempotency_requests ($COLS) SELECT \$1, \$2, \$3, \$4, \$5, 1, \$6, \$7, \$8, now(), clock_timestamp(), clock_timestamp() + \$9 * interval '1 millisecond';"

# The finished rows replay reads. The table is analysed only once it holds rows:
# an empty ANALYZE makes sessions cache sequential-scan plans for the key lookups
# (see BENCHMARKS.md).
populate() {
    psql -d "$DB" -c "INSERT INTO idempotency_requests ($COLS) SELECT 't', 'create-order', sha256(('k' || i)::bytea), $FP, 'completed', 1, 201, '$HEADERS', $BODY, now(), now(), now() + interval '1 day' FROM generate_series(1, $REPLAY_KEYS) i" \
        -c "ANALYZE idempotency_requests"
}
populate

mode_of() { case "$1" in pipelined | lookup_optimistic_simple | bare_simple | session*) echo simple ;; *) echo prepared ;; esac; }
JOBS=$((CLIENTS < 2 ? CLIENTS : 2))
echo "pgbench -M prepared (pipelined, lookup_optimistic_simple, bare_simple, session: -M simple), $CLIENTS clients, $SECS s per shape, $REPLAY_KEYS finished rows to replay; PostgreSQL $(psql -d "$DB" -c 'SHOW server_version'), synchronous_commit $(psql -d "$DB" -c 'SHOW synchronous_commit'); load $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$PIPELINED" = t ] || echo "pipelined: skipped, the database has no idem_precheck/idem_take/idem_finish over bytea digests"
: >"$WORK/results"
for round in $(seq 1 "$ROUNDS"); do
    for shape in $SHAPES; do
        [ "$shape" = pipelined ] && [ "$PIPELINED" != t ] && continue
        log="$WORK/$shape.$round.log"
        pgbench -h "$HOST" -U postgres -n -M "$(mode_of "$shape")" -D prepared=0 -c "$CLIENTS" -j "$JOBS" -T "$SECS" \
            -f "$WORK/$shape.sql" "$DB" >"$log" 2>&1 || true
        tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$log")
        if [ -z "$tps" ] || grep -q 'error\|aborted' "$log"; then
            printf 'round %d  %-24s    error: %s\n' "$round" "$shape" "$(grep -m1 'error' "$log" || tail -1 "$log")"
            continue
        fi
        printf 'round %d  %-24s %8.0f tps\n' "$round" "$shape" "$tps"
        echo "$shape $tps" >>"$WORK/results"
    done
done
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print 0; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
BARE=$(awk '$1 == "bare" { print $2 }' "$WORK/results" | median)
echo "median of $ROUNDS rounds, as a share of bare (ms: the time a client spends per transaction, CLIENTS / tps):"
for shape in $SHAPES; do
    grep -q "^$shape " "$WORK/results" || continue
    m=$(awk -v s="$shape" '$1 == s { print $2 }' "$WORK/results" | median)
    awk -v s="$shape" -v m="$m" -v b="$BARE" -v c="$CLIENTS" 'BEGIN { printf "  %-24s %8.0f tps  %5.2f of bare  %6.3f ms\n", s, m, (b > 0 ? m / b : 0), (m > 0 ? c * 1000 / m : 0) }'
done
echo "completions that were HOT updates: $(psql -d "$DB" -c "SELECT n_tup_hot_upd || ' of ' || n_tup_upd FROM pg_stat_user_tables WHERE relname = 'idempotency_requests' AND schemaname = 'public'")"
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"

# --- backend CPU per transaction, in one backend ---------------------------------
psql -d "$DB" -c "TRUNCATE idempotency_requests, orders"
populate
psql -d "$DB" <<SQL
CREATE PROCEDURE run_shape(shape text, n int, replay_keys int) LANGUAGE plpgsql AS \$\$
DECLARE k text; d bytea; g bigint; rec record; fp bytea := $FP;
BEGIN
  FOR i IN 1..n LOOP
    k := shape || '-' || i || '-' || random();
    IF shape = 'replay' THEN
      k := 'k' || (1 + floor(random() * replay_keys))::int;
    END IF;
    d := sha256(convert_to(k, 'UTF8'));
    IF shape IN ('lookup_optimistic', 'replay') THEN
      SELECT fingerprint, state, generation, expires_at > now() AS live, response_status, response_headers, response_body
        INTO rec FROM idempotency_requests WHERE tenant_id = 't' AND operation = 'create-order' AND key_digest = d;
      COMMIT;
      CONTINUE WHEN shape = 'replay';
      PERFORM set_config('statement_timeout', '31000', true), set_config('idle_in_transaction_session_timeout', '31000', true);
    ELSIF shape = 'lookup_advisory' THEN
      SELECT pg_advisory_xact_lock(hashtextextended('t/create-order/' || encode(d, 'hex'), 0)) AS locked,
             (SELECT (q.fingerprint, q.state, q.generation, q.expires_at > now(), q.response_status, q.response_headers, q.response_body)
                FROM idempotency_requests q WHERE q.tenant_id = 't' AND q.operation = 'create-order' AND q.key_digest = d) AS found
        INTO rec;
    ELSIF shape = 'claim_update' THEN
      INSERT INTO idempotency_requests (tenant_id, operation, key_digest, fingerprint, state, created_at, expires_at)
      VALUES ('t', 'create-order', d, fp, 'processing', now(), now() + interval '1 day')
      ON CONFLICT (tenant_id, operation, key_digest) DO NOTHING RETURNING generation INTO g;
    ELSIF shape = 'pipelined' THEN
      PERFORM idem_precheck('t', 'create-order', d, fp);
      PERFORM idem_take('t', 'create-order', d, fp, 86400000, 2000);
    END IF;
    INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) VALUES ('t', 'A-1', 2, 1999, 'EUR', k);
    IF shape = 'floor' THEN
      INSERT INTO idempotency_requests ($COLS)
      VALUES ('t', 'create-order', d, fp, 'completed', 1, 201, '$HEADERS', $BODY, now(), clock_timestamp(),
              clock_timestamp() + 86400000 * interval '1 millisecond');
    ELSIF shape IN ('optimistic', 'lookup_optimistic', 'lookup_advisory') THEN
      INSERT INTO idempotency_requests AS r ($COLS)
      SELECT 't', 'create-order', d, fp, 'completed', 1, 201::smallint, '$HEADERS'::jsonb, $BODY, now(), c.t,
             c.t + 86400000 * interval '1 millisecond'
        FROM (SELECT clock_timestamp() AS t, set_config('lock_timeout', '2000ms', true)) c
      ON CONFLICT (tenant_id, operation, key_digest) DO UPDATE
         SET fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state, generation = r.generation + 1,
             response_status = EXCLUDED.response_status, response_headers = EXCLUDED.response_headers,
             response_body = EXCLUDED.response_body, owner_token = NULL, lease_expires_at = NULL,
             downstream_key = NULL, created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at,
             expires_at = EXCLUDED.expires_at
       WHERE r.expires_at <= now() AND r.state IN ('completed', 'failed')
      RETURNING r.generation INTO g;
    ELSIF shape = 'claim_update' THEN
      UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '$HEADERS',
             response_body = $BODY, completed_at = c.t, expires_at = c.t + 86400000 * interval '1 millisecond'
        FROM (SELECT clock_timestamp() AS t) c
       WHERE tenant_id = 't' AND operation = 'create-order' AND key_digest = d AND state = 'processing';
    ELSIF shape = 'pipelined' THEN
      PERFORM idem_finish('t', 'create-order', d, 1, 'completed', 201::smallint, '$HEADERS'::jsonb, $BODY, 86400000);
    END IF;
    COMMIT;
  END LOOP;
END \$\$;
SQL
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
loop_cpu() { # $1: shape; prints backend CPU microseconds per transaction
    command psql -h "$HOST" -U postgres -v ON_ERROR_STOP=1 -qAt -d "$DB" -c "SELECT pg_sleep(1)" \
        -c "CALL run_shape('$1', $LOOP, $REPLAY_KEYS)" -c "SELECT pg_sleep(1.5)" >/dev/null &
    local bg=$! pid t0 q
    sleep 0.5
    pid=$(psql -d postgres -c "SELECT pid FROM pg_stat_activity WHERE datname = '$DB' AND query LIKE 'SELECT pg_sleep(1)%'")
    t0=$(ticks "$pid")
    while true; do # the last statement shows once the CALL is over, however short
        q=$(psql -d postgres -c "SELECT query FROM pg_stat_activity WHERE pid = $pid")
        case "$q" in "SELECT pg_sleep(1.5)") break ;; "") wait "$bg"; return 1 ;; esac
        sleep 0.05
    done
    echo $((($(ticks "$pid") - t0) * 10000 / LOOP)) # ticks are 10 ms
    wait "$bg"
}
CPU_SHAPES=${CPU_SHAPES:-"bare floor optimistic lookup_optimistic replay lookup_advisory claim_update"}
[ "$PIPELINED" = t ] && CPU_SHAPES="$CPU_SHAPES pipelined"
echo "backend CPU per transaction, $LOOP transactions in one backend (replay: one lookup; lookup_optimistic: its lookup commits on its own):"
for round in 1 2; do
    for shape in $CPU_SHAPES; do
        cpu=$(loop_cpu "$shape") || cpu=error
        printf 'round %d  %-24s %5s us\n' "$round" "$shape" "$cpu"
    done
done
