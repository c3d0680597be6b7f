//! What the commands print: aligned text tables, short ages, and JSON
//! documents.

use serde::Serialize;

use crate::Failure;

pub(crate) fn to_json<T: Serialize>(value: &T) -> Result<String, Failure> {
    let mut s = serde_json::to_string_pretty(value)
        .map_err(|e| Failure::Other(format!("cannot encode JSON: {e}")))?;
    s.push('\n');
    Ok(s)
}

/// An aligned text table: two spaces between columns, numbers right-aligned,
/// every cell [`terminal_safe`] (a stored value, a tenant id or a key id may
/// hold what would drive the operator's terminal).
pub(crate) struct Table {
    header: Option<Vec<String>>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(header: &[&str], right: &[bool]) -> Self {
        Table {
            header: Some(header.iter().map(|h| terminal_safe(h)).collect()),
            right: right.to_vec(),
            rows: Vec::new(),
        }
    }

    /// A two-column list of labels and values, without a header.
    pub(crate) fn pairs(items: Vec<(&str, String)>) -> Self {
        Table {
            header: None,
            right: vec![false, false],
            rows: items
                .into_iter()
                .map(|(k, v)| vec![terminal_safe(k), terminal_safe(&v)])
                .collect(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows
            .push(cells.iter().map(|cell| terminal_safe(cell)).collect());
    }

    pub(crate) fn render(&self) -> String {
        let all: Vec<&Vec<String>> = self.header.iter().chain(self.rows.iter()).collect();
        let columns = all.iter().map(|r| r.len()).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                all.iter()
                    .filter_map(|r| r.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in all {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
                let pad = widths[c] - cell.chars().count();
                if self.right.get(c).copied().unwrap_or(false) {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// A short human age: "42s", "3m 5s", "2h 0m", "4d 1h".
pub(crate) fn age(secs: f64) -> String {
    let s = secs.max(0.0).floor() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// `text` with every control character (and every character that reorders
/// text) escaped as Rust writes it (`\u{1b}`): a stored answer or header
/// that echoed a client's input must not drive the operator's terminal (clear
/// it, set its title, hide what follows) or reorder what it shows.
pub(crate) fn terminal_safe(text: &str) -> String {
    escape(text, |_| false)
}

/// [`terminal_safe`], keeping line breaks and tabs: a body's layout.
pub(crate) fn terminal_safe_lines(text: &str) -> String {
    escape(text, |c| c == '\n' || c == '\t')
}

fn escape(text: &str, keep: impl Fn(char) -> bool) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let reorders = matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if (c.is_control() || reorders) && !keep(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_trim() {
        let mut t = Table::new(&["NAME", "N"], &[false, true]);
        t.row(vec!["a".into(), "100".into()]);
        t.row(vec!["long-name".into(), "2".into()]);
        assert_eq!(
            t.render(),
            "NAME         N\na          100\nlong-name    2\n"
        );
    }

    #[test]
    fn ages_read_well() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(185.0), "3m 5s");
        assert_eq!(age(7205.0), "2h 0m");
        assert_eq!(age(90000.0), "1d 1h");
        assert_eq!(age(-3.0), "0s");
    }
}
