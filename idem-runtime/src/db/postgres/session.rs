//! idem's statements prepared in the server session (SQL `PREPARE`), so that they
//! can ride in the same simple-query message as `BEGIN` and `COMMIT`, and the
//! encoding of their arguments as SQL text.
//!
//! sqlx sends a statement with bound parameters as a message sequence of its
//! own and waits for its answer: each of idem's statements would cost a round
//! trip. A statement prepared in the session is called by `EXECUTE name(..)`,
//! which is SQL text, so it can follow `BEGIN` (the probe) or precede `COMMIT`
//! (the finished row) in one message, and is planned once per connection rather
//! than parsed from literal SQL each time.
//!
//! * **Values as text.** The arguments travel inside the message, so they are
//!   encoded where nothing can escape them: text as an `E'..'` literal with every
//!   quote and backslash doubled (independent of `standard_conforming_strings`;
//!   a NUL, which PostgreSQL's text cannot hold, is an error), bytes as hex in
//!   such a literal, numbers formatted from integers. [`text_literal`] is held
//!   to a real server by a property test with arbitrary strings.
//! * **Created on first use.** A connection that lacks them reports `26000`
//!   (`invalid_sql_statement_name`) at its first probe; they are prepared then
//!   ([`prepare`]), and the claim begins again. The names carry a version, so a
//!   statement of another idem release in the same session is never called.
//! * **Only where the session stays.** A pooler that runs each transaction on
//!   whichever server is free (PgBouncer in transaction pooling) keeps only
//!   protocol-level prepared statements: there idem keeps the path of bound
//!   parameters. Which path a pool gets is decided once per database target by
//!   the pooler probe ([`uses_session_statements`]), logged, and can be forced
//!   with `Idem::with_session_statements`.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio::sync::OnceCell;

use super::pooler::{self, Sessions};
use crate::model::StoreError;

/// Fails when the key has a row, whatever its state, so that the `BEGIN`
/// message it rides in fails and the claim goes on to read the key (with the
/// driver's prepared lookup, which rides with nothing). The error is
/// a cast of a text that names itself, evaluated per row (a constant would be
/// folded, and fail, at planning): the server's log shows what it is.
///
/// A session is prepared when this probe, the first statement of the set a
/// claim sends, is missing. Its name carries the set's version, so a session
/// that has it has [`INSERT`] and [`FINISH`] too (one an earlier release
/// prepared has `idem_probe_1` and no `INSERT`, or `idem_probe_2` and
/// `idem_finish_1`, which wrote the generation the row had plus one rather than
/// the execution's; both with `idem_lookup_1`; an earlier build's set has
/// these three and `idem_lookup_2`, which is left unused: the key is read with
/// bound parameters now). The probe's text is the same in every version.
pub(crate) const PROBE: &str = "idem_probe_3";

/// The finished row, claiming the key, as the bound-parameter insert writes it,
/// at the execution's generation (its last argument); fails when it claimed
/// nothing (another execution's row holds the key), so that the `COMMIT` after
/// it in the message never runs.
pub(crate) const FINISH: &str = "idem_finish_2";

/// The finished row of a key the probe found no row for (a new key, the common
/// case): a plain insert, without [`FINISH`]'s conflict arbiter and the count
/// over its result. Another execution that claimed the key meanwhile makes it
/// fail with a unique violation ([`is_key_taken`]), so the `COMMIT` after it in
/// the message never runs. `lock_timeout` is bounded and given back as in
/// [`FINISH`].
pub(crate) const INSERT: &str = "idem_insert_1";

/// The text of the error [`PROBE`] raises, inside PostgreSQL's message.
pub(crate) const PROBE_MARKER: &str = "idem: the key has a row";

/// The text of the error [`FINISH`] raises, inside PostgreSQL's message.
pub(crate) const TAKEN_MARKER: &str = "idem: the key was taken by another execution";

/// PostgreSQL's `invalid_text_representation`, the code of both markers' casts.
pub(crate) const MARKER_CODE: &str = "22P02";

/// PostgreSQL's `invalid_sql_statement_name`: the session lacks a statement.
pub(crate) const MISSING_STATEMENT: &str = "26000";

/// PostgreSQL's `unique_violation`.
const UNIQUE_VIOLATION: &str = "23505";

/// The primary key of `idempotency_requests`, (tenant, operation, key digest).
const KEY_CONSTRAINT: &str = "idempotency_requests_pkey";

/// PostgreSQL's `duplicate_prepared_statement`: the session has it already.
const DUPLICATE_STATEMENT: &str = "42P05";

/// The three statements, by name, with their `PREPARE` texts.
const STATEMENTS: [(&str, &str); 3] = [
    (
        PROBE,
        // The request deadline ($4, milliseconds) is set here too, saving the
        // `BEGIN` message a statement of its own: it bounds the statements after
        // this one, as a separate `SELECT set_config(..)` would.
        "PREPARE idem_probe_3(text, text, bytea, text) AS \
         SELECT set_config('statement_timeout', $4, true), \
                set_config('idle_in_transaction_session_timeout', $4, true), \
                (SELECT (r.state || ': idem: the key has a row')::int \
                   FROM idempotency_requests r \
                  WHERE r.tenant_id = $1 AND r.operation = $2 AND r.key_digest = $3)",
    ),
    (
        FINISH,
        // The bound path's upsert, and then a cast that fails when it returned
        // no row. The final select gives `lock_timeout` back.
        concat!(
            "PREPARE idem_finish_2(text, text, bytea, bytea, text, smallint, jsonb, bytea, \
                                   bigint, text, bigint) AS WITH ins AS ( ",
            finished_row_insert!("$11"),
            take_over_expired!(),
            " RETURNING r.generation) \
             SELECT (CASE count(*) WHEN 0 THEN 'idem: the key was taken by another execution' \
                     ELSE '1' END)::int, ",
            restore_lock_timeout!(),
            " FROM ins"
        ),
    ),
    (
        INSERT,
        concat!(
            "PREPARE idem_insert_1(text, text, bytea, bytea, text, smallint, jsonb, bytea, \
                                   bigint, text) AS ",
            finished_row_insert!("1"),
            " RETURNING ",
            restore_lock_timeout!()
        ),
    ),
];

/// Prepares idem's statements in a session that lacks them. The connection must
/// be outside any transaction (a failed `PREPARE` there would abort it). A new
/// session has none: all three go in one message. A session that has some (one
/// was deallocated) is asked which, and gets the others.
pub(crate) async fn prepare(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let all: String = STATEMENTS
        .iter()
        .map(|(_, text)| format!("{text};"))
        .collect();
    match sqlx::raw_sql(AssertSqlSafe(all)).execute(&mut *conn).await {
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(DUPLICATE_STATEMENT) => {}
        done => return done.map(drop),
    }
    let names: Vec<&str> = STATEMENTS.iter().map(|(name, _)| *name).collect();
    let present: Vec<String> =
        sqlx::query_scalar("SELECT name FROM pg_prepared_statements WHERE name = ANY($1)")
            .bind(&names)
            .fetch_all(&mut *conn)
            .await?;
    let mut sql = String::new();
    for (name, text) in STATEMENTS {
        if !present.iter().any(|p| p == name) {
            sql.push_str(text);
            sql.push(';');
        }
    }
    if !sql.is_empty() {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// Appends `value` as a SQL text literal that holds for every string: `E'..'`
/// with each `'` and `\` doubled, so neither ends the literal nor escapes
/// anything, whatever `standard_conforming_strings` says. Every other character,
/// any Unicode included, stands for itself (sqlx's sessions speak UTF-8).
///
/// # Errors
///
/// [`StoreError::Corrupt`] for a NUL, which PostgreSQL's text cannot hold.
pub(crate) fn text_literal(sql: &mut String, value: &str) -> Result<(), StoreError> {
    if value.contains('\0') {
        return Err(StoreError::Corrupt(
            "a NUL character in a tenant id, operation or stored header: PostgreSQL's text \
             cannot hold it"
                .to_owned(),
        ));
    }
    sql.reserve(value.len() + 3);
    sql.push_str("E'");
    push_escaped(sql, value);
    sql.push('\'');
    Ok(())
}

/// Appends `value`'s JSON as a SQL text literal, as [`text_literal`] would
/// append `serde_json::to_string(value)`, written straight into `sql` (the
/// stored headers on every first execution: no string of their own).
///
/// # Errors
///
/// [`StoreError::Corrupt`] when `value` has no JSON form. (JSON escapes every
/// control character, so it never holds a NUL.)
pub(crate) fn json_literal(
    sql: &mut String,
    value: &impl serde::Serialize,
) -> Result<(), StoreError> {
    /// Doubles quotes and backslashes as they are written. serde_json writes
    /// whole characters (escapes, punctuation, and runs of a string cut at an
    /// ASCII byte), so each write is UTF-8 on its own; one that is not is an
    /// error, never a character cut in two.
    struct Escaping<'a>(&'a mut String);

    impl std::io::Write for Escaping<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let text = std::str::from_utf8(buf)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            push_escaped(self.0, text);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    sql.push_str("E'");
    serde_json::to_writer(Escaping(sql), value)
        .map_err(|e| StoreError::Corrupt(format!("stored headers: {e}")))?;
    sql.push('\'');
    Ok(())
}

/// Appends `value` with each `'` and `\` doubled. Searched as bytes (a char
/// pattern decodes every character): in UTF-8 neither byte occurs inside
/// another character, so each one found is a character boundary.
fn push_escaped(sql: &mut String, value: &str) {
    let mut rest = value;
    while let Some(at) = rest.bytes().position(|b| b == b'\'' || b == b'\\') {
        sql.push_str(&rest[..at]);
        sql.push_str(if rest.as_bytes()[at] == b'\'' {
            "''"
        } else {
            "\\\\"
        });
        rest = &rest[at + 1..];
    }
    sql.push_str(rest);
}

/// Appends `bytes` as a `bytea` literal in hex (`E'\\x..'`): only hex digits
/// travel. (Written through a table, in chunks: a response body is encoded on
/// every first execution, and the formatting machinery, or a `String::push` a
/// digit, costs several times as many instructions a byte.)
pub(crate) fn bytea_literal(sql: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2 + 6);
    sql.push_str("E'\\\\x");
    let mut chunk = [0u8; 256];
    for part in bytes.chunks(chunk.len() / 2) {
        let hex = &mut chunk[..part.len() * 2];
        for (pair, b) in hex.chunks_exact_mut(2).zip(part) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0x0f)];
        }
        sql.push_str(std::str::from_utf8(hex).expect("hex digits are ASCII"));
    }
    sql.push('\'');
}

/// Whether the error is `marker`'s, raised by one of idem's casts.
pub(crate) fn is_marker(e: &sqlx::Error, marker: &str) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().as_deref() == Some(MARKER_CODE) && db.message().contains(marker)
        }
        _ => false,
    }
}

/// Whether a plain insert of the finished row ([`INSERT`], or its bound form)
/// found the key claimed by another execution: a unique violation of the key's
/// primary key, which no statement of the handler's can raise.
pub(crate) fn is_key_taken(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().as_deref() == Some(UNIQUE_VIOLATION)
                && db.constraint() == Some(KEY_CONSTRAINT)
        }
        _ => false,
    }
}

/// Whether the session lacked one of idem's statements.
pub(crate) fn is_missing_statement(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(MISSING_STATEMENT))
}

/// What the pooler probe decided, per database target (host, port or socket,
/// database, user): probed once, by the first claim or by `migrate` /
/// `check_pooler` at start.
static CHOICES: LazyLock<Mutex<HashMap<String, Arc<OnceCell<bool>>>>> =
    LazyLock::new(Mutex::default);

fn target(options: &PgConnectOptions) -> String {
    format!(
        "{}|{}|{:?}|{:?}|{}",
        options.get_host(),
        options.get_port(),
        options.get_socket(),
        options.get_database(),
        options.get_username()
    )
}

fn cell(options: &PgConnectOptions) -> Arc<OnceCell<bool>> {
    let mut choices = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
    choices.entry(target(options)).or_default().clone()
}

/// Records what the pooler probe saw of `pool` (`migrate` and `check_pooler`
/// run it at start), so that the first claim does not probe again.
pub(crate) fn record(pool: &PgPool, sessions: Sessions) {
    let options = pool.connect_options();
    let _ = cell(&options).set(decide(&options, sessions));
}

/// Whether claims on `pool` use the session's statements: `forced` if set
/// (`Idem::with_session_statements`), else what the pooler probe says (run
/// once per target; a probe that fails is tried again by the next claim, which
/// meanwhile takes the bound-parameter path).
/// `decided` is the `Idem`'s own memory of the answer: once set, a claim
/// neither builds the target's name nor takes the map's lock.
pub(crate) async fn uses_session_statements(
    pool: &PgPool,
    forced: Option<bool>,
    decided: &std::sync::OnceLock<bool>,
) -> bool {
    if let Some(forced) = forced {
        return forced;
    }
    if let Some(on) = decided.get() {
        return *on;
    }
    let options = pool.connect_options();
    let cell = cell(&options);
    let on = match cell.get() {
        Some(on) => Some(*on),
        None => cell
            .get_or_try_init(|| async {
                pooler::probe(pool)
                    .await
                    .map(|sessions| decide(&options, sessions))
            })
            .await
            .ok()
            .copied(),
    };
    match on {
        Some(on) => *decided.get_or_init(|| on),
        // The probe failed: the bound-parameter path, and the next claim asks again.
        None => false,
    }
}

fn decide(options: &PgConnectOptions, sessions: Sessions) -> bool {
    let on = sessions == Sessions::Kept;
    tracing::info!(
        host = options.get_host(),
        port = options.get_port(),
        database = options.get_database().unwrap_or_default(),
        sessions = ?sessions,
        "idem: PostgreSQL claims {}",
        if on {
            "use statements prepared in the session (lookup with BEGIN, finished row with COMMIT)"
        } else {
            "use bound parameters (the pool does not keep a session across transactions)"
        }
    );
    on
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_literals_double_quotes_and_backslashes() {
        let mut sql = String::new();
        text_literal(&mut sql, r"a'b\c").unwrap();
        assert_eq!(sql, r"E'a''b\\c'");
    }

    #[test]
    fn a_nul_is_an_error() {
        let mut sql = String::new();
        assert!(matches!(
            text_literal(&mut sql, "a\0b"),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn bytes_are_hex() {
        let mut sql = String::new();
        bytea_literal(&mut sql, &[0, 0xab, 0xff]);
        assert_eq!(sql, r"E'\\x00abff'");
    }

    /// Every length around the chunk size, every byte value.
    #[test]
    fn bytes_of_any_length_are_hex() {
        for len in [0, 1, 127, 128, 129, 255, 256, 257, 1000] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            let mut sql = String::new();
            bytea_literal(&mut sql, &bytes);
            assert_eq!(sql, format!(r"E'\\x{}'", hex::encode(&bytes)), "{len}");
        }
    }

    /// The JSON written straight into the literal is the literal of the JSON
    /// text, for values that need JSON's escapes and SQL's.
    #[test]
    fn json_literals_equal_the_text_literal_of_the_json() {
        let headers = vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            (
                "x-note".to_owned(),
                "it's \"quoted\" \\ back\u{7}slashed, é€𝄞".to_owned(),
            ),
            ("x-empty".to_owned(), String::new()),
        ];
        let mut direct = String::new();
        json_literal(&mut direct, &headers).unwrap();
        let mut via_text = String::new();
        text_literal(&mut via_text, &serde_json::to_string(&headers).unwrap()).unwrap();
        assert_eq!(direct, via_text);
    }

    /// Quotes and backslashes beside characters of every UTF-8 length.
    #[test]
    fn text_literals_keep_multibyte_characters_whole() {
        let mut sql = String::new();
        text_literal(&mut sql, "é'€\\𝄞'ü").unwrap();
        assert_eq!(sql, "E'é''€\\\\𝄞''ü'");
    }
}
