//! What differs between the databases' spelling of one statement, where the
//! statement is otherwise the same: placeholders. PostgreSQL and SQLite take
//! numbered `$n`; MySQL takes `?`, bound in the order they appear. A statement
//! written once with `$1, $2, ...` in the order they appear (each once) is
//! turned into MySQL's at compile time by [`question_marks!`]; a statement that
//! does not number its placeholders so fails to compile, rather than bind the
//! wrong values at run time.
//!
//! The other differences are not spelling: PostgreSQL keeps time as
//! `timestamptz` and SQLite and MySQL as Unix milliseconds (each with its own
//! now-expression, `sqlite_now_ms!` and `mysql_now_ms!`), and the column types
//! of the owner token and the headers differ; statements over those stay each
//! database's own, but every database binds their parameters in the same order,
//! so the code around them is shared (`leases`, and `shared`'s macros).
#![cfg_attr(
    not(feature = "mysql"),
    allow(dead_code, unused_macros, unused_imports)
)]

/// `sql` with each `$n` placeholder replaced by `?`, padded with spaces to its
/// length (SQL ignores them). Panics, which in a constant is a compile error,
/// unless the placeholders read `$1, $2, ...` in order, each once: the order
/// MySQL binds `?` in.
pub(crate) const fn to_question_marks<const N: usize>(sql: &str) -> [u8; N] {
    let bytes = sql.as_bytes();
    assert!(bytes.len() == N, "the length is the statement's");
    let mut out = [b' '; N];
    let (mut i, mut o, mut next) = (0, 0, 1u32);
    while i < N {
        if bytes[i] == b'$' && i + 1 < N && bytes[i + 1].is_ascii_digit() {
            i += 1;
            let mut n = 0u32;
            while i < N && bytes[i].is_ascii_digit() {
                n = n * 10 + (bytes[i] - b'0') as u32;
                i += 1;
            }
            assert!(
                n == next,
                "MySQL binds `?` in order: number the placeholders $1, $2, ... as they appear, each once"
            );
            next += 1;
            out[o] = b'?';
        } else {
            out[o] = bytes[i];
            i += 1;
        }
        o += 1;
    }
    out
}

/// MySQL's spelling of a constant statement written with `$n` placeholders (see
/// [`to_question_marks`]), as a `&'static str` built at compile time.
macro_rules! question_marks {
    ($sql:expr) => {{
        const SQL: &str = $sql;
        const BYTES: [u8; SQL.len()] = $crate::db::dialect::to_question_marks(SQL);
        match ::core::str::from_utf8(&BYTES) {
            Ok(sql) => sql,
            Err(_) => panic!("a statement is UTF-8"),
        }
    }};
}
pub(crate) use question_marks;

/// `(?, ?, ..), (?, ?, ..), ..`: `rows` tuples of `arity` placeholders, for a
/// row-value `IN (..)` over a batch (sent unprepared: its text depends on the
/// batch's size).
pub(crate) fn placeholder_rows(arity: usize, rows: usize) -> String {
    let tuple = format!("({})", vec!["?"; arity].join(", "));
    vec![tuple; rows].join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn placeholder_rows_are_as_many_tuples_as_rows() {
        assert_eq!(super::placeholder_rows(3, 2), "(?, ?, ?), (?, ?, ?)");
        assert_eq!(super::placeholder_rows(1, 1), "(?)");
        assert_eq!(super::placeholder_rows(4, 0), "");
    }

    use super::*;

    const FORGET: &str = question_marks!("DELETE FROM t WHERE a = $1 AND b = $2 AND c = $3");

    #[test]
    fn placeholders_become_question_marks_in_order() {
        assert_eq!(
            to_question_marks::<34>("SELECT $1, $2 FROM t WHERE x = '$'"),
            *b"SELECT ?, ? FROM t WHERE x = '$'  "
        );
    }

    #[test]
    #[should_panic(expected = "number the placeholders")]
    fn placeholders_out_of_order_are_refused() {
        to_question_marks::<17>("SELECT $2, $1 + 1");
    }

    #[test]
    #[should_panic(expected = "number the placeholders")]
    fn a_placeholder_used_twice_is_refused() {
        to_question_marks::<17>("SELECT $1, $1 + 1");
    }

    #[test]
    fn the_macro_builds_a_constant() {
        assert_eq!(FORGET, "DELETE FROM t WHERE a = ? AND b = ? AND c = ?   ");
    }

    #[test]
    fn numbers_past_nine_are_read_whole() {
        let sql = "VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10)";
        let out = to_question_marks::<39>(sql);
        assert_eq!(&out[..28], b"VALUES (?,?,?,?,?,?,?,?,?,?)");
    }
}
