#!/usr/bin/env bash
# The database's share of the hot path on MySQL / MariaDB (issue 24 item 5), the
# counterpart of benches/sql_variants.sh: without HTTP or Rust, each transaction
# shape runs against a scratch database with idem's MySQL migrations, alternating
# shapes for ROUNDS rounds so drift hits all alike, and each shape's median tps is
# printed as a share of `bare` in the same run.
#
#   CLIENTS=4 SECS=5 ROUNDS=3 bash benches/sql_variants_mysql.sh
#   bash benches/sql_variants_mysql.sh             # 8 clients, 8 s per shape, 2 rounds
#   SHAPES="bare today lookup_optimistic" bash benches/sql_variants_mysql.sh
#   MYSQL_HOST=127.0.0.1 MYSQL_PORT=3306 MYSQL_USER=root MYSQL_PWD=... (the defaults: root, no password)
#
# Shapes (every one a fresh random 32-byte key digest per transaction, drawn by the
# client; `replay` reads a pre-populated one):
#   bare                      START TRANSACTION; INSERT order; COMMIT (the yardstick, = 1; the server's default isolation, like floor)
#   today                     what idem sends now: BEGIN RC (one text message: SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION); SET @idem_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = LOCK_WAIT; SELECT .. FOR UPDATE; INSERT processing claim; SET SESSION innodb_lock_wait_timeout = @idem_saved_lock_wait; INSERT order; UPDATE to completed; COMMIT
#   claim_first_lean          today without the save and the restore of the lock wait (what a per-connection lock wait would save)
#   floor                     START TRANSACTION; INSERT order; plain INSERT of the finished row; COMMIT (no idem can be cheaper)
#   lookup_optimistic         the lookup (non-locking, autocommit, outside the transaction); BEGIN RC; INSERT order; UPSERT; COMMIT
#   lookup_optimistic_bounded the same with the lock wait bounded for the upsert alone: SET STATEMENT innodb_lock_wait_timeout = LOCK_WAIT FOR <UPSERT> (MariaDB only)
#   replay                    the lookup alone, on a pre-populated finished key (the replay path: one prepared statement, no transaction)
#   today_replay              what idem sends now for a replay: BEGIN RC; save and bound the lock wait; SELECT .. FOR UPDATE (a finished row); restore; ROLLBACK
#   session_literal           the lookup and the finished row riding with the messages the transaction sends
#                             anyway, as literal SQL (hex literals, nothing to escape): BEGIN RC \; PROBE (a
#                             select that fails when the key has a row); INSERT order;
#                             UPSERT (MariaDB: bounded by SET STATEMENT) \; TAKEN (an error when the upsert took
#                             nothing: LAST_INSERT_ID() = 0) \; COMMIT. 3 round trips, as bare. The errors are
#                             EXP(1000)'s overflow (1690), which both servers raise at run time.
#   session_prepared          the same with PROBE and UPSERT prepared once per connection by SQL PREPARE and
#                             called by EXECUTE .. USING user variables set in the same message
# Two more, only when named in SHAPES (they split lookup_optimistic's cost):
#   optimistic                BEGIN RC; INSERT order; UPSERT; COMMIT (lookup_optimistic without the lookup)
#   lookup_insert             the lookup; BEGIN RC; INSERT order; plain INSERT of the finished row; COMMIT (an expired row
#                             found by the lookup would take a conditional UPDATE instead, a duplicate-key error means a race)
#
# UPSERT is the finished row's INSERT .. ON DUPLICATE KEY UPDATE that replaces only a
# finished row whose retention ran out (state completed/failed, expires_at <= now)
# and leaves every other row (live finished, processing, uncertain) as it is. Every
# assignment is IF(<that condition>, new, old); MySQL evaluates the assignments left
# to right and a later one reads the columns an earlier one already changed, so the
# two columns the condition reads come last: `state` (its new value is always a
# finished state, so the condition still holds for the next assignment exactly when
# it held at first) and then `expires_at`. The generation taken is reported without
# RETURNING (MySQL has none) and without relying on the affected rows: VALUES(..)
# writes generation LAST_INSERT_ID(1), a replacement LAST_INSERT_ID(generation + 1),
# and a row left alone generation + LAST_INSERT_ID(0); the OK packet's last insert
# id (sqlx: MySqlQueryResult::last_insert_id) is then 1 (inserted), g + 1 (replaced)
# or 0 (left alone). The affected rows alone cannot tell: with CLIENT_FOUND_ROWS off
# they are 1 inserted, 2 replaced, 0 left alone, but sqlx always connects with
# CLIENT_FOUND_ROWS, and then a row left alone counts 1, like an insert. (The
# runtime now binds the execution's generation, LAST_INSERT_ID(?), and replaces at
# LAST_INSERT_ID(VALUES(generation)): the same work, and for the new keys measured
# here the same value, 1.)
#
# MySQL 8 has no SET STATEMENT, and its per-statement hint SET_VAR takes only the
# variables its reference marks "SET_VAR Hint Applies: Yes", InnoDB's not among them
# (Percona Server's extension of SET_VAR exists to add them; no MySQL 8 server was
# at hand to try). A bounded upsert there needs the session variable set around it:
# today's save and restore as two more round trips; or folded into messages already
# sent (the save and the bound after SET TRANSACTION in the BEGIN message, the
# restore sent with the COMMIT), which bounds the handler's statements too; or set
# once per connection (after_connect, but the pool is the application's, not idem's),
# which costs what lookup_optimistic costs. The shape is skipped with a note on a
# server that is not MariaDB. (MariaDB also has SELECT .. FOR UPDATE WAIT n, which
# would bound today's locking read in the statement, though not its INSERT.)
#
# The load: mysqlslap cannot run a shape for a time (it runs a count of statements
# and reports seconds), has no prepared statements, and can only carry one key
# across a transaction's statements in a user variable set by one more statement
# (or by a RAND() in the WHERE clause, which turns the primary-key lookup into a
# scan), so this script brings its own: Python 3 with mysql-connector-python's C
# extension (libmysqlclient), installed with pip into a venv under /tmp when missing.
# CLIENTS client processes (processes, not threads: no GIL between them), each with
# one connection, run the shape in a loop for SECS seconds and count transactions,
# after three warm-up transactions and a barrier. Statements are sent as sqlx sends
# them: whatever idem binds parameters to (and every sqlx::query, with or without
# binds) as a server-side prepared statement, prepared once per connection and then
# executed (COM_STMT_EXECUTE, without the COM_STMT_RESET the connector's cursors
# add before each execute); the BEGIN message, START TRANSACTION and COMMIT as text
# (COM_QUERY), as sqlx's transaction manager does. Round trips per transaction:
# bare 3, session_literal and session_prepared 3, floor 4, replay 1, today_replay 5, optimistic 4, lookup_optimistic,
# lookup_optimistic_bounded and lookup_insert 5, claim_first_lean 6, today 8. The
# load generator's CPU is in the same two cores as the server's, so tps shares
# overstate what a round trip costs next to sqlx; the server's CPU per transaction
# is the steadier comparison. MySQL has no RETURNING: the order
# insert is the INSERT alone (the benches/idem handler reads the row back by
# LAST_INSERT_ID(), one round trip more in every shape alike).
#
# Keys are stored as sha256 digests (migration 20261202000010_key_digest.sql); the
# fingerprint is a constant 32 bytes. REPLAY_KEYS finished rows (key sha256('k' || i),
# i = 1..N, live for a day) are written before the rounds. LOCK_WAIT (seconds, 2:
# the default in_flight_wait rounded up as idem rounds it) is the bound today's shape
# sets. Besides tps, each run reports the server's CPU per transaction (mariadbd's or
# mysqld's utime + stime from /proc, when it runs on this machine: it includes any
# other client's work on that server) and the client's (the load generator's own
# overhead, Python's, far above sqlx's). The database is dropped at the end.
set -euo pipefail

CLIENTS=${CLIENTS:-8}
SECS=${SECS:-8}
ROUNDS=${ROUNDS:-2}
REPLAY_KEYS=${REPLAY_KEYS:-100000}
LOCK_WAIT=${LOCK_WAIT:-2}
SHAPES=${SHAPES:-bare today claim_first_lean floor lookup_optimistic lookup_optimistic_bounded session_literal session_prepared replay today_replay}
case " $SHAPES " in *" bare "*) ;; *) SHAPES="bare $SHAPES" ;; esac
MYSQL_HOST=${MYSQL_HOST:-127.0.0.1}
MYSQL_PORT=${MYSQL_PORT:-3306}
MYSQL_USER=${MYSQL_USER:-root}
VENV=${VENV:-/tmp/idem-sql-variants-venv}
CONNECTOR=${CONNECTOR:-mysql-connector-python==26.10.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DB=idem_bench_$$
WORK=$(mktemp -d)
CLI=$(command -v mariadb || command -v mysql) || { echo "no mariadb or mysql client" >&2; exit 1; }
[ -z "${MYSQL_PWD:-}" ] || export MYSQL_PWD
sql() { "$CLI" -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u "$MYSQL_USER" --batch --skip-column-names "$@"; }
trap 'sql -e "DROP DATABASE IF EXISTS $DB" || true; rm -rf "$WORK"' EXIT

if ! "$VENV/bin/python" -c 'import _mysql_connector, mysql.connector' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "$CONNECTOR"
fi

sql -e "CREATE DATABASE $DB"
for f in "$ROOT"/idem-runtime/migrations/mysql/*.sql; do sql "$DB" <"$f"; done
sql "$DB" <<'SQL'
CREATE TABLE orders (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant_id    VARCHAR(255) NOT NULL,
    sku          VARCHAR(255) NOT NULL,
    quantity     INT NOT NULL CHECK (quantity >= 1),
    amount_cents BIGINT NOT NULL CHECK (amount_cents >= 0),
    currency     CHAR(3) NOT NULL,
    note         TEXT,
    created_at   DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    KEY orders_tenant_idx (tenant_id, id)
) ENGINE = InnoDB;
SQL

# --- the statements (idem's clock: Unix milliseconds from UTC_TIMESTAMP(3)) -------
NOW="(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)"
HEADERS='[["content-type","application/json"],["location","/orders/1"]]'
COLS="tenant_id, operation, key_digest, fingerprint, state, generation, response_status, response_headers, response_body, created_at, completed_at, expires_at"
# The finished rows replay reads: i = 1..REPLAY_KEYS from six digit columns.
DIGITS="(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)"
sql "$DB" -e "INSERT INTO idempotency_requests ($COLS)
    SELECT 't', 'create-order', UNHEX(SHA2(CONCAT('k', n), 256)), REPEAT(X'00', 32), 'completed', 1, 201, '$HEADERS', X'7b226964223a317d', $NOW, $NOW, $NOW + 86400000
      FROM (SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * g.d AS n
              FROM $DIGITS a, $DIGITS b, $DIGITS c, $DIGITS e, $DIGITS f, $DIGITS g) i
     WHERE n <= $REPLAY_KEYS;
    ANALYZE TABLE idempotency_requests;" >/dev/null

cat >"$WORK/load.py" <<'PY'
"""One run of one shape: CLIENTS processes for SECS seconds; prints
`tps server_us_per_tx client_us_per_tx errors first_error`."""
# The wheel's C extension links the libssl and libcrypto it ships (mysql/vendor),
# newer than the system's: imported after hashlib or ssl, which load the system's,
# it fails to load, so it comes first.
import _mysql_connector  # noqa: F401, I001

import hashlib, multiprocessing as mp, os, random, sys, time  # noqa: E401, E402
import mysql.connector  # noqa: E402

shape, clients, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
DB, LOCK_WAIT, REPLAY_KEYS = os.environ["DB"], int(os.environ["LOCK_WAIT"]), int(os.environ["REPLAY_KEYS"])
MARIADB = os.environ.get("MARIADB") == "t"
NOW = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)"
T, OP, FP, STATE, STATUS = "t", "create-order", bytes(32), "completed", 201
HEADERS, BODY, RETENTION = '[["content-type","application/json"],["location","/orders/1"]]', b'{"id":1}', 86400000

# What store::mysql::transactional prepares (READ_SQL, INSERT_SQL, COMPLETE_SQL) and
# bound_lock_wait / restore_lock_wait.
SAVE_BOUND = f"SET @idem_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = {LOCK_WAIT}"
RESTORE = "SET SESSION innodb_lock_wait_timeout = @idem_saved_lock_wait"
READ = (f"SELECT fingerprint, state, generation, expires_at, response_status, response_headers, response_body, {NOW} AS now "
        "FROM idempotency_requests WHERE tenant_id = ? AND operation = ? AND key_digest = ? FOR UPDATE")
CLAIM = ("INSERT INTO idempotency_requests (tenant_id, operation, key_digest, fingerprint, state, generation, created_at, expires_at) "
         f"VALUES (?, ?, ?, ?, 'processing', 1, {NOW}, {NOW} + ?)")
COMPLETE = (f"UPDATE idempotency_requests SET state = ?, response_status = ?, response_headers = ?, response_body = ?, "
            f"completed_at = {NOW}, expires_at = {NOW} + ? "
            "WHERE tenant_id = ? AND operation = ? AND key_digest = ? AND generation = ? AND state = 'processing'")
ORDER = "INSERT INTO orders (tenant_id, sku, quantity, amount_cents, currency, note) VALUES (?, ?, ?, ?, ?, ?)"
FINISHED = ("INSERT INTO idempotency_requests (tenant_id, operation, key_digest, fingerprint, state, generation, "
            "response_status, response_headers, response_body, created_at, completed_at, expires_at) "
            f"VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, {NOW}, {NOW}, {NOW} + ?)")
LOOKUP = (f"SELECT fingerprint, state, generation, expires_at > {NOW} AS live, response_status, response_headers, response_body "
          "FROM idempotency_requests WHERE tenant_id = ? AND operation = ? AND key_digest = ?")
TAKE = f"expires_at <= {NOW} AND state IN ('completed', 'failed')"
UPSERT = ("INSERT INTO idempotency_requests (tenant_id, operation, key_digest, fingerprint, state, generation, "
          "response_status, response_headers, response_body, created_at, completed_at, expires_at) "
          f"VALUES (?, ?, ?, ?, ?, LAST_INSERT_ID(1), ?, ?, ?, {NOW}, {NOW}, {NOW} + ?) "
          "ON DUPLICATE KEY UPDATE "
          f"fingerprint = IF({TAKE}, VALUES(fingerprint), fingerprint), "
          f"generation = IF({TAKE}, LAST_INSERT_ID(generation + 1), generation + LAST_INSERT_ID(0)), "
          f"response_status = IF({TAKE}, VALUES(response_status), response_status), "
          f"response_headers = IF({TAKE}, VALUES(response_headers), response_headers), "
          f"response_body = IF({TAKE}, VALUES(response_body), response_body), "
          f"owner_token = IF({TAKE}, NULL, owner_token), "
          f"lease_expires_at = IF({TAKE}, NULL, lease_expires_at), "
          f"downstream_key = IF({TAKE}, NULL, downstream_key), "
          f"created_at = IF({TAKE}, VALUES(created_at), created_at), "
          f"completed_at = IF({TAKE}, VALUES(completed_at), completed_at), "
          f"state = IF({TAKE}, VALUES(state), state), "
          f"expires_at = IF({TAKE}, VALUES(expires_at), expires_at)")
UPSERT_BOUNDED = f"SET STATEMENT innodb_lock_wait_timeout = {LOCK_WAIT} FOR {UPSERT}"
BEGIN_RC = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION"


def text(c, q):
    """A text message of one or more statements; every result read (an error raises)."""
    c.cmd_query(q)
    while True:
        if c.unread_result:
            c.get_rows()
        if not c.next_result():
            break


def run(c, h, *params):
    """Execute a prepared statement: (rows, status) for a result set, else the OK status."""
    r = c.cmd_stmt_execute(h, *params)
    if h.have_result_set:
        return c.get_rows(prep_stmt=h)[0]
    return r


def order(c, s, k):
    run(c, s[ORDER], T, "A-1", 2, 1999, "EUR", k[:8].hex())


def expect(cond, what):
    if not cond:
        raise RuntimeError(what)


def bare(c, s, k):
    text(c, "START TRANSACTION")
    order(c, s, k)
    text(c, "COMMIT")


def floor(c, s, k):
    text(c, "START TRANSACTION")
    order(c, s, k)
    run(c, s[FINISHED], T, OP, k, FP, STATE, STATUS, HEADERS, BODY, RETENTION)
    text(c, "COMMIT")


def claim_first(c, s, k, bound):
    text(c, BEGIN_RC)
    if bound:
        run(c, s[SAVE_BOUND])
    expect(run(c, s[READ], T, OP, k) == [], "the locking read found a row")
    run(c, s[CLAIM], T, OP, k, FP, RETENTION)
    if bound:
        run(c, s[RESTORE])
    order(c, s, k)
    done = run(c, s[COMPLETE], STATE, STATUS, HEADERS, BODY, RETENTION, T, OP, k, 1)
    expect(done["affected_rows"] == 1, f"the completion matched {done['affected_rows']} rows")
    text(c, "COMMIT")


def lookup_optimistic(c, s, k, upsert=UPSERT):
    expect(run(c, s[LOOKUP], T, OP, k) == [], "the lookup found a row")
    text(c, BEGIN_RC)
    order(c, s, k)
    took = run(c, s[upsert], T, OP, k, FP, STATE, STATUS, HEADERS, BODY, RETENTION)
    expect(took["insert_id"] == 1, f"the upsert took generation {took['insert_id']}")
    text(c, "COMMIT")


def lookup_insert(c, s, k):
    expect(run(c, s[LOOKUP], T, OP, k) == [], "the lookup found a row")
    text(c, BEGIN_RC)
    order(c, s, k)
    run(c, s[FINISHED], T, OP, k, FP, STATE, STATUS, HEADERS, BODY, RETENTION)
    text(c, "COMMIT")


def optimistic(c, s, k):
    text(c, BEGIN_RC)
    order(c, s, k)
    took = run(c, s[UPSERT], T, OP, k, FP, STATE, STATUS, HEADERS, BODY, RETENTION)
    expect(took["insert_id"] == 1, f"the upsert took generation {took['insert_id']}")
    text(c, "COMMIT")


# EXP(1000) overflows a DOUBLE: error 1690 on MySQL and MariaDB alike, evaluated per
# row (a column or LAST_INSERT_ID() in it: never folded at parse time).
PROBE_SQL = ("SELECT EXP(1000 * (generation > 0)) AS held FROM idempotency_requests "
             "WHERE tenant_id = {t} AND operation = {o} AND key_digest = {d}")
TAKEN = "SELECT EXP(1000 * (LAST_INSERT_ID() = 0)) AS took"


def hexlit(b):
    return "X'" + b.hex() + "'"


def textlit(s):
    # Text as the hex of its UTF-8 bytes: no quote or backslash to escape, whatever sql_mode says.
    return "CONVERT(" + hexlit(s.encode()) + " USING utf8mb4)"


def upsert_literal(k):
    q = UPSERT
    for v in (textlit(T), textlit(OP), hexlit(k), hexlit(FP), textlit(STATE), str(STATUS), textlit(HEADERS), hexlit(BODY), str(RETENTION)):
        q = q.replace("?", v, 1)
    return q


def bounded(q):
    return f"SET STATEMENT innodb_lock_wait_timeout = {LOCK_WAIT} FOR {q}" if MARIADB else q


def session_literal(c, s, k):
    text(c, f"{BEGIN_RC}; " + PROBE_SQL.format(t=textlit(T), o=textlit(OP), d=hexlit(k)))
    order(c, s, k)
    text(c, f"{bounded(upsert_literal(k))}; {TAKEN}; COMMIT")


PREPARES = [
    "PREPARE idem_probe FROM '" + PROBE_SQL.format(t="?", o="?", d="?") + "'",
    "PREPARE idem_finish FROM '" + bounded(UPSERT).replace("'", "''") + "'",
]


def session_prepared(c, s, k):
    if not s.get("prepared"):
        for q in PREPARES:
            text(c, q)
        s["prepared"] = True
    text(c, f"{BEGIN_RC}; SET @idem_t = {textlit(T)}, @idem_o = {textlit(OP)}, @idem_d = {hexlit(k)}; "
            "EXECUTE idem_probe USING @idem_t, @idem_o, @idem_d")
    order(c, s, k)
    text(c, f"SET @idem_f = {hexlit(FP)}, @idem_s = {textlit(STATE)}, @idem_st = {STATUS}, "
            f"@idem_h = {textlit(HEADERS)}, @idem_b = {hexlit(BODY)}, @idem_r = {RETENTION}; "
            "EXECUTE idem_finish USING @idem_t, @idem_o, @idem_d, @idem_f, @idem_s, @idem_st, @idem_h, @idem_b, @idem_r; "
            f"{TAKEN}; COMMIT")


def replay_key():
    return hashlib.sha256(b"k%d" % random.randint(1, REPLAY_KEYS)).digest()


def replay(c, s, _k):
    rows = run(c, s[LOOKUP], T, OP, replay_key())
    expect(len(rows) == 1 and rows[0][1] == STATE, "no finished row to replay")


def today_replay(c, s, _k):
    text(c, BEGIN_RC)
    run(c, s[SAVE_BOUND])
    rows = run(c, s[READ], T, OP, replay_key())
    expect(len(rows) == 1 and rows[0][1] == STATE, "no finished row to replay")
    run(c, s[RESTORE])
    text(c, "ROLLBACK")


SHAPES = {
    "bare": (bare, [ORDER]),
    "floor": (floor, [ORDER, FINISHED]),
    "today": (lambda c, s, k: claim_first(c, s, k, True), [SAVE_BOUND, READ, CLAIM, RESTORE, ORDER, COMPLETE]),
    "claim_first_lean": (lambda c, s, k: claim_first(c, s, k, False), [READ, CLAIM, ORDER, COMPLETE]),
    "lookup_optimistic": (lookup_optimistic, [LOOKUP, ORDER, UPSERT]),
    "lookup_optimistic_bounded": (lambda c, s, k: lookup_optimistic(c, s, k, UPSERT_BOUNDED), [LOOKUP, ORDER, UPSERT_BOUNDED]),
    "replay": (replay, [LOOKUP]),
    "today_replay": (today_replay, [SAVE_BOUND, READ, RESTORE]),
    "optimistic": (optimistic, [ORDER, UPSERT]),
    "lookup_insert": (lookup_insert, [LOOKUP, ORDER, FINISHED]),
    "session_literal": (session_literal, [ORDER]),
    "session_prepared": (session_prepared, [ORDER]),
}


def client(barrier, out):
    try:
        c = mysql.connector.connect(host=os.environ["MYSQL_HOST"], port=int(os.environ["MYSQL_PORT"]),
                                    user=os.environ["MYSQL_USER"], password=os.environ.get("MYSQL_PWD", ""),
                                    database=DB, autocommit=True)
        fn, stmts = SHAPES[shape]
        s = {q: c.cmd_stmt_prepare(q.encode()) for q in stmts}
        for _ in range(3):
            fn(c, s, os.urandom(32))
    except Exception as e:  # noqa: BLE001 - reported, the run fails
        barrier.abort()
        out.put((0, 1.0, 0.0, 1, f"setup: {e}"))
        return
    try:
        barrier.wait()
    except Exception:  # noqa: BLE001 - another client failed to set up
        out.put((0, 1.0, 0.0, 1, "another client failed to set up"))
        return
    n = errors = 0
    first = ""
    cpu0, t0 = time.process_time(), time.monotonic()
    end = t0 + secs
    while time.monotonic() < end:
        try:
            fn(c, s, os.urandom(32))
            n += 1
        except Exception as e:  # noqa: BLE001
            errors += 1
            first = first or str(e)
            try:
                c.rollback()
            except Exception:  # noqa: BLE001
                pass
    out.put((n, time.monotonic() - t0, time.process_time() - cpu0, errors, first))


def server_ticks():
    pid = os.environ.get("SERVER_PID", "")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    mp.set_start_method("fork")
    barrier, out = mp.Barrier(clients + 1), mp.Queue()
    procs = [mp.Process(target=client, args=(barrier, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=120)
    except Exception:  # noqa: BLE001 - a client failed to set up: collect its report
        pass
    ticks0 = server_ticks()
    results = [out.get() for _ in procs]
    ticks1 = server_ticks()
    for p in procs:
        p.join()
    tps = sum(n / el for n, el, _, _, _ in results if el > 0)
    total = sum(r[0] for r in results)
    errors = sum(r[3] for r in results)
    first = next((r[4] for r in results if r[4]), "")
    cli_us = 1e6 * sum(r[2] for r in results) / total if total else 0
    srv_us = 1e6 * (ticks1 - ticks0) / os.sysconf("SC_CLK_TCK") / total if total and ticks0 is not None and ticks1 is not None else -1
    print(f"{tps:.1f} {srv_us:.0f} {cli_us:.0f} {errors} {first}".strip())
PY

VERSION=$(sql -e "SELECT VERSION()")
MARIADB=f; case "$VERSION" in *MariaDB*) MARIADB=t ;; esac
SERVER_PID=$(pidof mariadbd 2>/dev/null || pidof mysqld 2>/dev/null || true)
SERVER_PID=${SERVER_PID%% *}
echo "$CLIENTS client processes (Python, mysql-connector-python's C extension, server-side prepared statements), $SECS s per shape, $REPLAY_KEYS finished rows to replay, lock wait $LOCK_WAIT s; $VERSION, innodb_flush_log_at_trx_commit $(sql -e 'SELECT @@innodb_flush_log_at_trx_commit'), log_bin $(sql -e 'SELECT @@log_bin'); load $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$MARIADB" = t ] || echo "lookup_optimistic_bounded: skipped, not MariaDB (MySQL 8 has no SET STATEMENT; see the header)"
[ -n "$SERVER_PID" ] || echo "server CPU: not measured (no mariadbd or mysqld process on this machine)"
export DB LOCK_WAIT REPLAY_KEYS MYSQL_HOST MYSQL_PORT MYSQL_USER SERVER_PID MARIADB
: >"$WORK/results"
for round in $(seq 1 "$ROUNDS"); do
    for shape in $SHAPES; do
        [ "$shape" = lookup_optimistic_bounded ] && [ "$MARIADB" != t ] && continue
        line=$("$VENV/bin/python" "$WORK/load.py" "$shape" "$CLIENTS" "$SECS" 2>&1 | tail -1) || true
        read -r tps srv cli errors first <<<"$line" || true
        if ! [[ "${errors:-}" =~ ^[0-9]+$ ]] || [ "$errors" -gt 0 ]; then
            printf 'round %d  %-26s    error: %s\n' "$round" "$shape" "${first:-$line}"
            continue
        fi
        printf 'round %d  %-26s %8.0f tps  server %5s us/tx  client %5s us/tx\n' "$round" "$shape" "$tps" "$srv" "$cli"
        echo "$shape $tps $srv $cli" >>"$WORK/results"
    done
done
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print 0; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
col() { awk -v s="$1" -v c="$2" '$1 == s { print $c }' "$WORK/results" | median; }
BARE=$(col bare 2)
echo "median of $ROUNDS rounds, as a share of bare (ms: the time a client spends per transaction, CLIENTS / tps; server and client CPU per transaction):"
for shape in $SHAPES; do
    grep -q "^$shape " "$WORK/results" || continue
    awk -v s="$shape" -v m="$(col "$shape" 2)" -v b="$BARE" -v c="$CLIENTS" -v srv="$(col "$shape" 3)" -v cli="$(col "$shape" 4)" \
        'BEGIN { printf "  %-26s %8.0f tps  %5.2f of bare  %6.3f ms  server %5s us/tx  client %5s us/tx\n", s, m, (b > 0 ? m / b : 0), (m > 0 ? c * 1000 / m : 0), srv, cli }'
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
