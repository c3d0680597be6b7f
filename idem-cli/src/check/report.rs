//! The reports: an aligned table for a person (colour on a terminal only), one
//! JSON document, or JUnit XML for CI. A failure names the scenario, every
//! request it sent (keys shown, credentials redacted) and every answer.

use std::fmt::Write;
use std::io::IsTerminal;

use super::request::{Exchange, Outcome};
use super::scenarios::{Report, ScenarioResult, Verdict};
use crate::Failure;
use crate::output::{Table, terminal_safe, terminal_safe_lines, to_json};

/// How much of an answer's body a table or JUnit report shows.
const BODY_SHOWN: usize = 300;

/// Colour when stdout is a terminal and `NO_COLOR` is unset (no-color.org).
pub(crate) fn colour() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn verdict_word(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "pass",
        Verdict::Fail => "FAIL",
        Verdict::NotApplicable => "n/a",
    }
}

fn painted(v: Verdict, colour: bool) -> String {
    let word = verdict_word(v);
    if !colour {
        return word.to_owned();
    }
    let code = match v {
        Verdict::Pass => "32",
        Verdict::Fail => "1;31",
        Verdict::NotApplicable => "33",
    };
    format!("\x1b[{code}m{word}\x1b[0m")
}

/// The start of a text, on one line, at most `max` characters.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= max {
        return one_line;
    }
    let cut: String = one_line.chars().take(max).collect();
    format!("{cut}... ({} bytes)", text.len())
}

fn summary(report: &Report) -> String {
    let mut line = format!(
        "{} passed, {} failed, {} not applicable ({} ms)",
        report.count(Verdict::Pass),
        report.count(Verdict::Fail),
        report.count(Verdict::NotApplicable),
        report.elapsed_ms
    );
    if let Some(why) = &report.could_not_run {
        line.push_str("; the check could not run: ");
        line.push_str(&terminal_safe(why));
    }
    line
}

/// The table: one row per scenario, then each failure's requests and answers.
pub(crate) fn table(report: &Report, colour: bool) -> String {
    let mut t = Table::new(
        &["SCENARIO", "RESULT", "WHAT IT SAW"],
        &[false, false, false],
    );
    for s in &report.scenarios {
        // The width is the word's: padding counts the escape codes otherwise.
        t.row(vec![
            s.id.to_owned(),
            verdict_word(s.verdict).to_owned(),
            s.saw.clone(),
        ]);
    }
    let mut rendered = t.render();
    if colour {
        rendered = rendered
            .lines()
            .map(|line| {
                for v in [Verdict::Pass, Verdict::Fail, Verdict::NotApplicable] {
                    let word = format!("  {}  ", verdict_word(v));
                    if let Some(at) = line.find(&word) {
                        return format!(
                            "{}  {}  {}",
                            &line[..at],
                            painted(v, true),
                            &line[at + word.len()..]
                        );
                    }
                }
                line.to_owned()
            })
            .collect::<Vec<_>>()
            .join("\n")
            + "\n";
    }
    let mut out = format!(
        "idem check: {} {} (run {})\n\n{rendered}\n{}\n",
        report.method,
        report.url,
        report.run,
        summary(report)
    );
    for s in report
        .scenarios
        .iter()
        .filter(|s| s.verdict == Verdict::Fail)
    {
        let _ = write!(
            out,
            "\n{} {}: {}\n  {}\n",
            painted(Verdict::Fail, colour),
            s.id,
            s.title,
            terminal_safe(&s.saw)
        );
        out.push_str(&exchanges_text(s, "  "));
    }
    out
}

/// A failure's requests and answers, a few lines each; what the service sent
/// (headers, bodies, errors quoting it) escaped as [`terminal_safe`] does.
fn exchanges_text(s: &ScenarioResult, indent: &str) -> String {
    let mut out = String::new();
    for (i, ex) in s.exchanges.iter().enumerate() {
        let _ = writeln!(out, "{indent}request {}: {}", i + 1, request_line(ex));
        match &ex.result {
            Outcome::Answer(a) => {
                let headers: Vec<String> =
                    a.headers.iter().map(|(n, v)| format!("{n}: {v}")).collect();
                let _ = writeln!(
                    out,
                    "{indent}  answer: {} in {} ms; {}",
                    a.status,
                    a.elapsed_ms,
                    headers.join("; ")
                );
                if !a.body.is_empty() {
                    let _ = writeln!(out, "{indent}  body: {}", excerpt(&a.body, BODY_SHOWN));
                }
            }
            Outcome::Error(e) => {
                let _ = writeln!(out, "{indent}  no answer: {e}");
            }
        }
    }
    terminal_safe_lines(&out)
}

fn request_line(ex: &Exchange) -> String {
    let r = &ex.request;
    let mut line = format!("{} {}", r.method, r.url);
    match &r.key {
        Some(k) => {
            // Escaped already: the quotes delimit it.
            let _ = write!(line, "; Idempotency-Key: \"{k}\"");
        }
        None => line.push_str("; no Idempotency-Key"),
    }
    for (n, v) in &r.headers {
        let _ = write!(line, "; {n}: {v}");
    }
    if let Some(b) = &r.body {
        let _ = write!(line, "; {b}");
    }
    line
}

/// The JSON report: the run, a summary, and every scenario with its requests
/// and answers.
pub(crate) fn json(report: &Report) -> Result<String, Failure> {
    #[derive(serde::Serialize)]
    struct Doc<'a> {
        passed: usize,
        failed: usize,
        not_applicable: usize,
        #[serde(flatten)]
        report: &'a Report,
    }
    to_json(&Doc {
        passed: report.count(Verdict::Pass),
        failed: report.count(Verdict::Fail),
        not_applicable: report.count(Verdict::NotApplicable),
        report,
    })
}

/// JUnit XML: one test suite, one test case per scenario; a failure's message
/// is what it saw, its text the requests and answers; not applicable is skipped.
pub(crate) fn junit(report: &Report) -> String {
    let seconds = |ms: u128| format!("{:.3}", ms as f64 / 1000.0);
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let name = format!("idem check {} {}", report.method, report.url);
    let _ = writeln!(
        out,
        "<testsuites name=\"idem check\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" errors=\"0\" time=\"{}\">",
        report.scenarios.len(),
        report.count(Verdict::Fail),
        report.count(Verdict::NotApplicable),
        seconds(report.elapsed_ms)
    );
    let _ = writeln!(
        out,
        "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" errors=\"0\" time=\"{}\">",
        xml_escape(&name),
        report.scenarios.len(),
        report.count(Verdict::Fail),
        report.count(Verdict::NotApplicable),
        seconds(report.elapsed_ms)
    );
    let _ = writeln!(
        out,
        "    <properties><property name=\"run\" value=\"{}\"/></properties>",
        xml_escape(&report.run)
    );
    for s in &report.scenarios {
        let _ = write!(
            out,
            "    <testcase classname=\"idem.check\" name=\"{}: {}\" time=\"{}\"",
            xml_escape(s.id),
            xml_escape(s.title),
            seconds(s.elapsed_ms)
        );
        match s.verdict {
            Verdict::Pass => {
                let _ = writeln!(
                    out,
                    ">\n      <system-out>{}</system-out>\n    </testcase>",
                    xml_escape(&s.saw)
                );
            }
            Verdict::NotApplicable => {
                let _ = writeln!(
                    out,
                    ">\n      <skipped message=\"{}\"/>\n    </testcase>",
                    xml_escape(&s.saw)
                );
            }
            Verdict::Fail => {
                let _ = writeln!(
                    out,
                    ">\n      <failure message=\"{}\" type=\"idempotency\">{}</failure>\n    </testcase>",
                    xml_escape(&s.saw),
                    xml_escape(&format!("{}\n{}", s.saw, exchanges_text(s, "")))
                );
            }
        }
    }
    out.push_str("  </testsuite>\n</testsuites>\n");
    out
}

/// Text as XML character data or an attribute value: the five special
/// characters escaped, line breaks and tabs as character references (an
/// attribute would turn them into spaces), and the characters XML 1.0 cannot
/// hold at all (other controls, U+FFFE, U+FFFF) replaced by U+FFFD.
pub(crate) fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' => out.push_str("&#9;"),
            '\n' => out.push_str("&#10;"),
            '\r' => out.push_str("&#13;"),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_escaping_keeps_every_character_safe() {
        assert_eq!(
            xml_escape("a<b>&\"c\"'d'\te\nf\u{1}g\u{FFFF}é"),
            "a&lt;b&gt;&amp;&quot;c&quot;&apos;d&apos;&#9;e&#10;f\u{FFFD}g\u{FFFD}é"
        );
    }

    /// What a checked service chose (a problem's `type`, a header, a body)
    /// reaches the table escaped: it cannot drive the operator's terminal.
    #[test]
    fn a_services_control_characters_reach_the_table_escaped() {
        use super::super::request::{Answer, Exchange, Outcome, Sent};
        use super::super::scenarios::{Report, ScenarioResult, Verdict};
        const TITLE: &str = "\u{1b}]0;x\u{7}\u{1b}[2J";
        let answer = Answer {
            status: 422,
            headers: vec![("x-title".to_owned(), format!("a\u{9b}2J{TITLE}"))],
            body: format!("{{\"type\":\"{TITLE}\u{202e}\"}}"),
            bytes: vec![],
            elapsed_ms: 1,
        };
        let report = Report {
            method: "POST".to_owned(),
            url: "http://127.0.0.1/orders".to_owned(),
            run: "r".to_owned(),
            elapsed_ms: 1,
            could_not_run: Some(format!("422 {TITLE}")),
            found_breach: true,
            scenarios: vec![ScenarioResult {
                id: "missing-key",
                title: "a request without a key",
                verdict: Verdict::Fail,
                saw: format!("422 {TITLE}"),
                elapsed_ms: 1,
                exchanges: [
                    Outcome::Answer(answer),
                    Outcome::Error(format!("lost: {TITLE}")),
                ]
                .into_iter()
                .map(|result| Exchange {
                    request: Sent {
                        method: "POST".to_owned(),
                        url: "http://127.0.0.1/orders".to_owned(),
                        key: None,
                        headers: vec![],
                        body: None,
                    },
                    result,
                })
                .collect(),
            }],
        };
        for colour in [false, true] {
            let shown = table(&report, colour);
            // The only escape codes are the verdict's own colour.
            let shown = shown.replace(&painted(Verdict::Fail, colour), "FAIL");
            assert!(
                !shown
                    .chars()
                    .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
                "{shown:?}"
            );
            assert!(shown.contains("\\u{1b}]0;x"), "{shown}");
        }
    }

    #[test]
    fn excerpts_are_one_short_line() {
        assert_eq!(excerpt("a\nb", 10), "a b");
        assert_eq!(excerpt("abcdef", 3), "abc... (6 bytes)");
    }
}
