//! The scenarios of the idempotency promise, run in the plan's order against
//! the target, each judged pass, fail or not applicable with what it saw and
//! every request it sent.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::CheckArgs;
use super::plan::Plan;
use super::request::{Answer, BodyKind, Exchange, Target, Tenant};

/// The response headers a replay must repeat: those that describe the
/// representation and where it lives (idem's default stored headers). `Date`,
/// tracing ids and the like may differ.
pub(crate) const MUST_MATCH: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
];

/// A scenario's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Verdict {
    Pass,
    Fail,
    NotApplicable,
}

/// One scenario as it ran.
#[derive(Debug, Serialize)]
pub(crate) struct ScenarioResult {
    pub(crate) id: &'static str,
    pub(crate) title: &'static str,
    pub(crate) verdict: Verdict,
    /// What it saw, in a line.
    pub(crate) saw: String,
    pub(crate) elapsed_ms: u128,
    /// Every request it sent, and what came back.
    pub(crate) exchanges: Vec<Exchange>,
}

/// A whole run.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) method: String,
    pub(crate) url: String,
    pub(crate) run: String,
    pub(crate) elapsed_ms: u128,
    /// Why the check could not judge the service, if it could not: the
    /// request itself does not succeed (no answer, or not a `2xx`), or
    /// `--effects` stopped counting. Not a finding about the promise.
    pub(crate) could_not_run: Option<String>,
    /// A scenario failed before the check could no longer judge the service
    /// (exit code 7 then, whatever came after).
    #[serde(skip)]
    pub(crate) found_breach: bool,
    pub(crate) scenarios: Vec<ScenarioResult>,
}

impl Report {
    pub(crate) fn count(&self, verdict: Verdict) -> usize {
        self.scenarios
            .iter()
            .filter(|s| s.verdict == verdict)
            .count()
    }

    pub(crate) fn failed(&self) -> usize {
        self.count(Verdict::Fail)
    }
}

/// What a scenario found.
struct Found {
    verdict: Verdict,
    saw: String,
    exchanges: Vec<Exchange>,
}

fn pass(saw: impl Into<String>, exchanges: Vec<Exchange>) -> Found {
    Found {
        verdict: Verdict::Pass,
        saw: saw.into(),
        exchanges,
    }
}

fn fail(saw: impl Into<String>, exchanges: Vec<Exchange>) -> Found {
    Found {
        verdict: Verdict::Fail,
        saw: saw.into(),
        exchanges,
    }
}

fn not_applicable(saw: impl Into<String>, exchanges: Vec<Exchange>) -> Found {
    Found {
        verdict: Verdict::NotApplicable,
        saw: saw.into(),
        exchanges,
    }
}

/// The state of a run: the target, the plan and the first request's answer,
/// which most scenarios compare with.
struct Run<'a> {
    args: &'a CheckArgs,
    target: &'a Target,
    plan: &'a Plan,
    first: Option<(Answer, Instant)>,
    /// The effects counted right after the first request.
    first_effects: Option<u64>,
    /// See [`Report::could_not_run`].
    could_not_run: std::cell::RefCell<Option<String>>,
}

/// Runs every scenario of the plan, in order.
pub(crate) async fn run(args: &CheckArgs, target: &Target, plan: &Plan) -> Report {
    let started = Instant::now();
    let mut run = Run {
        args,
        target,
        plan,
        first: None,
        first_effects: None,
        could_not_run: std::cell::RefCell::new(None),
    };
    let mut results = Vec::new();
    // A scenario that failed while the check could still judge the service: a
    // finding, which exit code 8 (the check could not run) must not hide.
    let mut found_breach = false;
    for step in &plan.steps {
        let began = Instant::now();
        let found = if let Err(why) = &step.applies {
            not_applicable(why.clone(), Vec::new())
        } else if step.id != "first-request" && run.first.is_none() {
            not_applicable("not run: the first request did not succeed", Vec::new())
        } else {
            match step.id {
                "first-request" => run.first_request().await,
                "retry" => run.retry().await,
                "equivalent-body" => run.counted(0, run.equivalent_body()).await,
                // The other body alone executes; under the used key, nothing.
                "other-body" => run.counted(1, run.other_body()).await,
                "missing-key" => run.counted(0, run.missing_key()).await,
                "concurrent" => run.concurrent().await,
                // Not counted: `--effects` counts the first tenant's, or
                // every tenant's.
                "other-tenant" => run.other_tenant().await,
                "restart" => run.restart().await,
                "late-retry" => run.counted(0, run.late_retry()).await,
                "problem-documents" => problem_documents(&results),
                "malformed-key-empty" => run.counted(0, run.malformed_key(step.id)).await,
                // The key a lenient parser could have made executes, once.
                malformed => run.counted(1, run.malformed_key(malformed)).await,
            }
        };
        if found.verdict == Verdict::Fail && run.could_not_run.borrow().is_none() {
            found_breach = true;
        }
        results.push(ScenarioResult {
            id: step.id,
            title: step.title,
            verdict: found.verdict,
            saw: found.saw,
            elapsed_ms: began.elapsed().as_millis(),
            exchanges: found.exchanges,
        });
    }
    Report {
        method: target.method.to_string(),
        url: super::redact::url(&target.url),
        run: plan.run.clone(),
        elapsed_ms: started.elapsed().as_millis(),
        could_not_run: run.could_not_run.into_inner(),
        found_breach,
        scenarios: results,
    }
}

impl Run<'_> {
    fn key(&self, scenario: &str) -> String {
        format!("idem-check-{}-{scenario}", self.plan.run)
    }

    fn body(&self) -> Option<(BodyKind, &[u8])> {
        self.target.body.as_deref().map(|b| (BodyKind::Original, b))
    }

    fn first(&self) -> &Answer {
        &self.first.as_ref().expect("run after the first request").0
    }

    async fn send(&self, key: &str, body: Option<(BodyKind, &[u8])>) -> Exchange {
        self.target
            .send(Some(key.as_bytes()), body, Tenant::First)
            .await
    }

    /// The effects counted now, if `--effects` is given.
    async fn effects(&self) -> Result<Option<u64>, String> {
        let counted = self.count().await;
        if let Err(e) = &counted {
            self.could_not_run
                .borrow_mut()
                .get_or_insert_with(|| e.clone());
        }
        counted
    }

    /// The effects' count, `None` without `--effects`; a failure is only said.
    async fn count(&self) -> Result<Option<u64>, String> {
        if self.target.effects.is_none() {
            return Ok(None);
        }
        self.target
            .count_effects()
            .await
            .map(Some)
            .map_err(|e| format!("--effects: {e}"))
    }

    /// The count after a scenario's answers were judged: where they already
    /// broke the promise, a count that fails is said beside that finding and
    /// does not make the check one that could not run (exit 8 would hide a
    /// double execution the answers showed).
    async fn effects_after(&self, problems: &[String]) -> Result<Option<u64>, String> {
        if problems.is_empty() {
            self.effects().await
        } else {
            self.count().await
        }
    }

    /// Runs `scenario` between two counts of the effects (with `--effects`):
    /// one that passed fails when the count moved by other than `expected`
    /// (an answer of 400 or 422 that came after the operation ran, say); one
    /// not applicable whose requests went out fails when the count moved at
    /// all (the service refused them: none may have run). One that failed is
    /// left as it is: what it sent may not be what `expected` counts.
    async fn counted(&self, expected: i128, scenario: impl Future<Output = Found>) -> Found {
        let before = match self.effects().await {
            Ok(n) => n,
            Err(e) => return fail(e, Vec::new()),
        };
        let mut found = scenario.await;
        let expected = match found.verdict {
            Verdict::Fail => return found,
            Verdict::NotApplicable if found.exchanges.is_empty() => return found,
            Verdict::NotApplicable => 0,
            Verdict::Pass => expected,
        };
        let made = match (before, self.effects().await) {
            (Some(b), Ok(Some(a))) => a as i128 - b as i128,
            (_, Err(e)) => {
                found.saw.push_str(&format!("; {e}"));
                found.verdict = Verdict::Fail;
                return found;
            }
            _ => return found,
        };
        let effects = |n: i128| match n {
            0 => "no effect".to_owned(),
            1 => "1 effect".to_owned(),
            n => format!("{n} effects"),
        };
        if made == expected {
            found.saw.push_str(&format!("; {}", effects(made)));
        } else {
            found
                .saw
                .push_str(&format!("; {}, expected {expected}", effects(made)));
            found.verdict = Verdict::Fail;
        }
        found
    }

    async fn first_request(&mut self) -> Found {
        let before = match self.effects().await {
            Ok(n) => n,
            Err(e) => return fail(e, Vec::new()),
        };
        let ex = self.send(&self.key("first-request"), self.body()).await;
        let Some(answer) = ex.answer().filter(|a| a.is_success()).cloned() else {
            let saw = format!(
                "{}: the request itself does not succeed; fix it (-H, --body, --method, --url) \
                 and run again",
                ex.short()
            );
            *self.could_not_run.get_mut() = Some(saw.clone());
            return fail(saw, vec![ex]);
        };
        if answer.replayed() {
            let saw = format!(
                "{}, marked replayed: a new key's first answer is no replay",
                answer.status
            );
            return fail(saw, vec![ex]);
        }
        let mut saw = format!("{} in {} ms", answer.status, answer.elapsed_ms);
        let after = match self.effects().await {
            Ok(n) => n,
            Err(e) => return fail(e, vec![ex]),
        };
        self.first = Some((answer, Instant::now()));
        self.first_effects = after;
        if let (Some(b), Some(a)) = (before, after) {
            if b.checked_add(1) != Some(a) {
                let saw = format!("{saw}; {} effects, expected 1", a as i128 - b as i128);
                return fail(saw, vec![ex]);
            }
            saw.push_str("; 1 effect");
        }
        pass(saw, vec![ex])
    }

    async fn retry(&self) -> Found {
        let ex = self.send(&self.key("first-request"), self.body()).await;
        let Some(answer) = ex.answer() else {
            return fail(ex.short(), vec![ex]);
        };
        let mut problems = differences(self.first(), answer);
        match self.effects_after(&problems).await {
            Ok(Some(now)) => {
                if let Some(was) = self.first_effects
                    && now != was
                {
                    problems.push(format!("{} new effects", now as i128 - was as i128));
                }
            }
            Ok(None) => {}
            Err(e) => problems.push(e),
        }
        if problems.is_empty() {
            let mut saw = format!(
                "{}, the same body and headers, marked replayed",
                answer.status
            );
            if self.target.effects.is_some() {
                saw.push_str("; no new effect");
            }
            pass(saw, vec![ex])
        } else {
            fail(problems.join("; "), vec![ex])
        }
    }

    async fn equivalent_body(&self) -> Found {
        let Some(eq) = self.plan.equivalent.as_deref() else {
            return not_applicable("the body is not JSON", Vec::new());
        };
        let ex = self
            .send(&self.key("first-request"), Some((BodyKind::Equivalent, eq)))
            .await;
        let Some(answer) = ex.answer() else {
            return fail(ex.short(), vec![ex]);
        };
        if answer.status == 422 {
            let saw = "422: the service compares the bodies' bytes, not their JSON values";
            return if self.args.canonical_json {
                fail(
                    format!("{saw}, and --canonical-json says it should"),
                    vec![ex],
                )
            } else {
                not_applicable(
                    format!("{saw} (allowed; --canonical-json requires a replay)"),
                    vec![ex],
                )
            };
        }
        let problems = differences(self.first(), answer);
        if problems.is_empty() {
            return pass(
                format!("{}, the first answer replayed", answer.status),
                vec![ex],
            );
        }
        let saw = if answer.is_success() && !answer.replayed() {
            format!(
                "{}: executed the same request again ({})",
                answer.status,
                problems.join("; ")
            )
        } else {
            format!("{}: {}", ex.short(), problems.join("; "))
        };
        fail(saw, vec![ex])
    }

    async fn other_body(&self) -> Found {
        let Some(other) = self.plan.other.as_deref() else {
            return not_applicable("no other body", Vec::new());
        };
        let other = Some((BodyKind::Other, other));
        // Alone first: a 422 under the used key proves something only if the
        // other body is valid in itself.
        let alone = self.send(&self.key("other-body"), other).await;
        // A refusal (4xx, or the promise's own busy 503 with Retry-After)
        // makes the scenario moot; no answer, or another 5xx, is the service
        // failing a valid request, which is no premise to skip.
        let Some(a) = alone.answer() else {
            let saw = format!("the other body alone, under a new key: {}", alone.short());
            return fail(saw, vec![alone]);
        };
        let busy = a.status == 503 && a.header("retry-after").is_some();
        if a.status >= 500 && !busy {
            let saw = format!("the other body alone, under a new key, is {}", a.short());
            return fail(saw, vec![alone]);
        }
        if !a.is_success() {
            let saw = format!(
                "the other body alone is {}, so a 422 under the used key would prove \
                 nothing; give one the service accepts with --other-body",
                a.short()
            );
            return not_applicable(saw, vec![alone]);
        }
        if a.replayed() {
            let saw = "the other body alone, under a new key, is marked replayed: a new \
                       key's first answer is no replay";
            return fail(saw, vec![alone]);
        }
        let reused = self.send(&self.key("first-request"), other).await;
        let mut exchanges = vec![alone, reused];
        let Some(answer) = exchanges[1].answer() else {
            let saw = exchanges[1].short();
            return fail(saw, exchanges);
        };
        if answer.status != 422 {
            let saw = if answer.is_success() && answer.replayed() {
                format!(
                    "{}: replayed the first answer for another request",
                    answer.status
                )
            } else if answer.is_success() {
                format!(
                    "{}: executed another request under a used key",
                    answer.status
                )
            } else {
                format!("{}, expected 422", answer.short())
            };
            return fail(saw, exchanges);
        }
        let saw = answer.short();
        let again = self.send(&self.key("first-request"), self.body()).await;
        let problems = match again.answer() {
            Some(a) => differences(self.first(), a),
            None => vec![again.short()],
        };
        exchanges.push(again);
        if problems.is_empty() {
            pass(format!("{saw}; the first body still replays"), exchanges)
        } else {
            fail(
                format!(
                    "{saw}, but then the first body's retry: {}",
                    problems.join("; ")
                ),
                exchanges,
            )
        }
    }

    async fn missing_key(&self) -> Found {
        let ex = self.target.send(None, self.body(), Tenant::First).await;
        let Some(answer) = ex.answer() else {
            return fail(ex.short(), vec![ex]);
        };
        let content_type = answer.header("content-type").unwrap_or("no Content-Type");
        let saw = format!("{} {content_type}", answer.short());
        if answer.is_success() {
            return fail(format!("{saw}: executed without a key"), vec![ex]);
        }
        if answer.status != 400 {
            return fail(format!("{saw}, expected 400"), vec![ex]);
        }
        if !idem_wire::problem::is_problem_content_type(content_type) {
            return fail(format!("{saw}: not application/problem+json"), vec![ex]);
        }
        pass(saw, vec![ex])
    }

    async fn malformed_key(&self, id: &str) -> Found {
        let base = self.key(id);
        // The malformed key, and the valid key a lenient parser could have made
        // of it (truncated, cut at the bad character, unquoted): the 400 must
        // have reserved neither.
        let (bad, then): (Vec<u8>, Option<String>) = match id {
            "malformed-key-empty" => (Vec::new(), None),
            "malformed-key-too-long" => {
                let mut long = base.clone();
                long.push('-');
                while long.len() < idem_wire::MAX_KEY_LEN + 1 {
                    long.push('x');
                }
                (
                    long.as_bytes().to_vec(),
                    Some(long[..idem_wire::MAX_KEY_LEN].to_owned()),
                )
            }
            // HTAB: the one control character an HTTP header value may carry
            // (RFC 9110 field-content); any other is refused by HTTP itself.
            "malformed-key-control" => (format!("{base}\tx").into_bytes(), Some(base)),
            "malformed-key-comma" => (format!("{base},x").into_bytes(), Some(base)),
            // Opens a structured-field string (RFC 8941) and never closes it.
            _ => (format!("\"{base}").into_bytes(), Some(base)),
        };
        let ex = self
            .target
            .send(Some(&bad), self.body(), Tenant::First)
            .await;
        let Some(answer) = ex.answer() else {
            return fail(ex.short(), vec![ex]);
        };
        if answer.status != 400 {
            let saw = if answer.is_success() {
                format!("{}: executed with a malformed key", answer.status)
            } else {
                format!("{}, expected 400", answer.short())
            };
            return fail(saw, vec![ex]);
        }
        let saw = answer.short();
        let Some(then) = then else {
            return pass(saw, vec![ex]);
        };
        let follow = self.send(&then, self.body()).await;
        let verdict = match follow.answer() {
            Some(a) if a.is_success() && !a.replayed() => Ok(format!(
                "{saw}; then the key {} alone executed as new ({})",
                describe_key(&then),
                a.status
            )),
            Some(a) if a.replayed() => Err(format!(
                "{saw}, but then the key {} alone replayed an answer: the malformed key \
                 reserved it",
                describe_key(&then)
            )),
            _ => Err(format!(
                "{saw}, but then the key {} alone is {}: the malformed key reserved it, or the \
                 request does not succeed twice",
                describe_key(&then),
                follow.short()
            )),
        };
        match verdict {
            Ok(saw) => pass(saw, vec![ex, follow]),
            Err(saw) => fail(saw, vec![ex, follow]),
        }
    }

    async fn concurrent(&self) -> Found {
        let before = match self.effects().await {
            Ok(n) => n,
            Err(e) => return fail(e, Vec::new()),
        };
        let key = self.key("concurrent");
        let n = self.args.concurrency as usize;
        // Each duplicate on a connection of its own, opened beforehand: sent
        // together, they reach the service together, where one sent on a
        // kept-alive connection would be served while the others still
        // connect (a round trip or three later, long enough for a handler that
        // checks for the key and then inserts to look like one that claims it).
        let mut targets = Vec::with_capacity(n);
        for _ in 0..n {
            match self.target.on_own_client() {
                Ok(t) => targets.push(Arc::new(t)),
                Err(e) => return fail(e, Vec::new()),
            }
        }
        let mut opening = tokio::task::JoinSet::new();
        for target in &targets {
            let target = target.clone();
            opening.spawn(async move { target.open_connection().await });
        }
        let mut unopened = Vec::new();
        while let Some(opened) = opening.join_next().await {
            match opened {
                Ok(Ok(())) => {}
                Ok(Err(e)) => unopened.push(e),
                Err(e) => unopened.push(e.to_string()),
            }
        }
        // All spawned before any sends: they start together.
        let start = Arc::new(tokio::sync::Barrier::new(n));
        let mut tasks = tokio::task::JoinSet::new();
        for (i, target) in targets.into_iter().enumerate() {
            let (start, key) = (start.clone(), key.clone());
            tasks.spawn(async move {
                start.wait().await;
                let body = target.body.as_deref().map(|b| (BodyKind::Original, b));
                (
                    i,
                    target.send(Some(key.as_bytes()), body, Tenant::First).await,
                )
            });
        }
        let mut answers: Vec<Option<Exchange>> = vec![None; n];
        while let Some(joined) = tasks.join_next().await {
            if let Ok((i, ex)) = joined {
                answers[i] = Some(ex);
            }
        }
        let mut exchanges: Vec<Exchange> = answers.into_iter().flatten().collect();
        let mut problems = Vec::new();
        if exchanges.len() < n {
            problems.push(format!("{} requests were lost", n - exchanges.len()));
        }
        // Distinct successful answers (status and body), those not marked
        // replayed (each an execution of its own), refusals to retry later
        // (a 409, or a 503 that reserved nothing), the rest.
        let mut bodies: Vec<(u16, &[u8])> = Vec::new();
        let mut first_success: Option<&Answer> = None;
        let (mut successes, mut fresh, mut conflicts, mut busy, mut others) =
            (0, 0, 0, 0, Vec::new());
        let mut headers_differ: Vec<&str> = Vec::new();
        let now = SystemTime::now();
        let retry_after = |a: &Answer, problems: &mut Vec<String>| match a.header("retry-after") {
            Some(v) if idem_wire::parse_retry_after(v, now).is_some() => {}
            Some(v) => problems.push(format!("a {} with an invalid Retry-After {v:?}", a.status)),
            None => problems.push(format!("a {} without Retry-After", a.status)),
        };
        for ex in &exchanges {
            match ex.answer() {
                Some(a) if a.is_success() => {
                    successes += 1;
                    if !a.replayed() {
                        fresh += 1;
                    }
                    if !bodies.contains(&(a.status, a.bytes.as_slice())) {
                        bodies.push((a.status, a.bytes.as_slice()));
                    }
                    match first_success {
                        None => first_success = Some(a),
                        Some(first) => {
                            for name in MUST_MATCH {
                                if first.header(name) != a.header(name)
                                    && !headers_differ.contains(name)
                                {
                                    headers_differ.push(name);
                                }
                            }
                        }
                    }
                }
                Some(a) if a.status == 409 => {
                    conflicts += 1;
                    retry_after(a, &mut problems);
                }
                Some(a) if a.status == 503 && a.header("retry-after").is_some() => {
                    busy += 1;
                    retry_after(a, &mut problems);
                }
                _ => others.push(ex.short()),
            }
        }
        let mut saw = format!("{n} at once: {successes}× 2xx");
        if successes > 0 && fresh == 0 {
            saw.push_str(", every one marked replayed");
            problems.push(
                "no answer is the execution's own: every 2xx is marked replayed, the first \
                 execution's included"
                    .to_owned(),
            );
        }
        match bodies.len() {
            0 => {}
            1 => saw.push_str(" with one body"),
            k => {
                saw.push_str(&format!(" with {k} different bodies"));
                problems.push(format!("executed more than once ({k} different answers)"));
            }
        }
        if fresh > 1 {
            saw.push_str(&format!(", {fresh} of them not marked replayed"));
            problems.push(format!(
                "executed more than once ({fresh} answers not marked replayed)"
            ));
        }
        if !headers_differ.is_empty() {
            saw.push_str(&format!(", differing in {}", headers_differ.join(", ")));
            problems.push(format!(
                "executed more than once (answers differing in {})",
                headers_differ.join(", ")
            ));
        }
        saw.push_str(&format!(", {conflicts}× 409"));
        if busy > 0 {
            saw.push_str(&format!(", {busy}× 503 to retry later"));
        }
        if !others.is_empty() {
            others.dedup();
            saw.push_str(&format!(", others: {}", others.join(", ")));
            problems.push(
                "answers that are neither the same answer, nor 409, nor 503 with Retry-After"
                    .to_owned(),
            );
        }
        if successes == 0 {
            problems.push("no request succeeded".to_owned());
        }
        if !unopened.is_empty() {
            let count = unopened.len();
            unopened.sort();
            unopened.dedup();
            saw.push_str(&format!(
                " ({count} of {n} sent on a connection opened as it was sent, so they may not \
                 have arrived together: {})",
                unopened.join(", ")
            ));
        }
        // Once they all answered, a retry gets the one outcome (with several,
        // there is none to compare it with).
        let first = match bodies.as_slice() {
            [(s, b)] => Some((*s, b.to_vec())),
            _ => None,
        };
        let several = bodies.len() > 1;
        let retry = self.send(&key, self.body()).await;
        match (retry.answer(), first) {
            (Some(a), Some((status, body))) => {
                let headers_differ = first_success.is_some_and(|f| {
                    MUST_MATCH
                        .iter()
                        .any(|name| f.header(name) != a.header(name))
                });
                if headers_differ {
                    problems.push(
                        "the retry after them differs from their answer in a header a replay \
                         repeats"
                            .to_owned(),
                    );
                }
                if a.status != status || a.bytes != body || !a.replayed() {
                    problems.push(format!(
                        "the retry after them is {}{}",
                        a.short(),
                        if a.replayed() {
                            ""
                        } else {
                            ", not marked replayed"
                        }
                    ));
                } else {
                    saw.push_str("; a retry after them replayed it");
                }
            }
            (Some(a), None) if several && a.is_success() => {
                saw.push_str(&format!(
                    "; a retry after them: {}{}",
                    a.status,
                    if a.replayed() {
                        ", one of them replayed"
                    } else {
                        ""
                    }
                ));
            }
            _ => problems.push(format!("the retry after them is {}", retry.short())),
        }
        exchanges.push(retry);
        match self.effects_after(&problems).await {
            Ok(Some(after)) => {
                let made = after as i128 - before.unwrap_or(0) as i128;
                saw.push_str(&format!(
                    "; {made} effect{}",
                    if made == 1 { "" } else { "s" }
                ));
                if made != 1 {
                    problems.push(format!("{made} effects, expected 1"));
                }
            }
            Ok(None) => {}
            Err(e) => problems.push(e),
        }
        if problems.is_empty() {
            pass(saw, exchanges)
        } else {
            fail(format!("{saw}: {}", problems.join("; ")), exchanges)
        }
    }

    async fn other_tenant(&self) -> Found {
        let ex = self
            .target
            .send(
                Some(self.key("first-request").as_bytes()),
                self.body(),
                Tenant::Second,
            )
            .await;
        let Some(a) = ex.answer() else {
            return fail(ex.short(), vec![ex]);
        };
        let saw = if a.is_success() && !a.replayed() {
            return pass(
                format!("{}, executed as the other tenant's own request", a.status),
                vec![ex],
            );
        } else if a.replayed() {
            format!(
                "{}: replayed the first tenant's answer: keys are not scoped by tenant",
                a.status
            )
        } else if matches!(a.status, 409 | 422) {
            format!(
                "{}: the key collided with the first tenant's: keys are not scoped by tenant",
                a.short()
            )
        } else if matches!(a.status, 401 | 403) {
            // A mistake in the arguments, as a refused first request is: no
            // finding about the promise.
            let saw = format!(
                "{}: the --tenant-header credentials are refused; give ones the service accepts",
                a.short()
            );
            return not_applicable(saw, vec![ex]);
        } else {
            format!("{}, expected a success of its own", a.short())
        };
        fail(saw, vec![ex])
    }

    async fn restart(&self) -> Found {
        let key = self.key("restart");
        let ex = self.send(&key, self.body()).await;
        let Some(first) = ex.answer().filter(|a| a.is_success()).cloned() else {
            let saw = format!("the request before the restart is {}", ex.short());
            return fail(saw, vec![ex]);
        };
        if first.replayed() {
            let saw = format!(
                "the request before the restart, a new key, is {} marked replayed",
                first.status
            );
            return fail(saw, vec![ex]);
        }
        let before = match self.effects().await {
            Ok(n) => n,
            Err(e) => return fail(e, vec![ex]),
        };
        let started = Instant::now();
        let deadline = started + self.args.restart_timeout;
        if let Err(e) = run_restart_cmd(
            self.args.restart_cmd.as_deref().unwrap_or(""),
            self.args.restart_timeout,
        )
        .await
        {
            return fail(format!("the restart command {e}"), vec![ex]);
        }
        let retry = self
            .target
            .send_when_up(key.as_bytes(), self.body(), deadline)
            .await;
        let exchanges = vec![ex, retry];
        let mut problems = match exchanges[1].answer() {
            Some(a) => differences(&first, a),
            None => vec![format!(
                "the retry after the restart: {}",
                exchanges[1].short()
            )],
        };
        let mut saw = format!(
            "restarted in {} ms; the retry: {}",
            started.elapsed().as_millis(),
            exchanges[1].short()
        );
        match self.effects_after(&problems).await {
            Ok(Some(after)) => {
                let made = after as i128 - before.unwrap_or(0) as i128;
                if made == 0 {
                    saw.push_str("; no new effect");
                } else {
                    problems.push(format!("{made} new effects"));
                }
            }
            Ok(None) => {}
            Err(e) => problems.push(e),
        }
        if problems.is_empty() {
            pass(format!("{saw}, replayed"), exchanges)
        } else {
            fail(format!("{saw}: {}", problems.join("; ")), exchanges)
        }
    }

    async fn late_retry(&self) -> Found {
        let (_, at) = self.first.as_ref().expect("after the first request");
        tokio::time::sleep_until((*at + self.args.after).into()).await;
        let waited = at.elapsed();
        let ex = self.send(&self.key("first-request"), self.body()).await;
        let Some(a) = ex.answer() else {
            return fail(ex.short(), vec![ex]);
        };
        let problems = differences(self.first(), a);
        let saw = format!(
            "{} ms after the first answer: {}",
            waited.as_millis(),
            a.status
        );
        if problems.is_empty() {
            pass(format!("{saw}, replayed"), vec![ex])
        } else {
            fail(format!("{saw}: {}", problems.join("; ")), vec![ex])
        }
    }
}

/// Runs the restart command (`sh -c`), at most `limit`; `Err` says what went wrong.
///
/// It is done when `sh` exits, whatever it started. Its standard output is
/// dropped and its standard error goes to a file (the first 64 KiB are read
/// for a failure's report), never to a pipe: a service the command starts in
/// the background (`./srv &`) keeps both for as long as it runs, and would
/// hold the check waiting for the pipe's end, or be killed (`SIGPIPE`) by its
/// next write once the check stopped reading.
async fn run_restart_cmd(cmd: &str, limit: Duration) -> Result<(), String> {
    let path = std::env::temp_dir().join(format!(
        "idem-check-restart-{}-{:016x}.stderr",
        std::process::id(),
        fastrand::u64(..)
    ));
    let file = std::fs::File::create(&path)
        .map_err(|e| format!("did not start: cannot create {}: {e}", path.display()))?;
    let spawned = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(file)
        .kill_on_drop(true)
        .spawn();
    let status = match spawned {
        Ok(mut child) => tokio::time::timeout(limit, child.wait()).await,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(format!("did not start: {e}"));
        }
    };
    // Read, then unlinked: a background process keeps writing to a file no
    // name reaches, and nothing breaks.
    let stderr = {
        use std::io::Read as _;
        let mut held = Vec::new();
        if let Ok(f) = std::fs::File::open(&path) {
            let _ = f.take(64 << 10).read_to_end(&mut held);
        }
        let _ = std::fs::remove_file(&path);
        String::from_utf8_lossy(&held).trim().to_owned()
    };
    let said = |stderr: &str| {
        if stderr.is_empty() {
            String::new()
        } else {
            format!(": {}", super::report::excerpt(stderr, 300))
        }
    };
    match status {
        Err(_) => Err(format!(
            "did not finish within {}{}",
            humantime::format_duration(limit),
            said(&stderr)
        )),
        Ok(Err(e)) => Err(format!("failed: {e}")),
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(format!("exited with {status}{}", said(&stderr))),
    }
}

/// How a retry's answer differs from the first; empty when it is a faithful replay.
pub(crate) fn differences(first: &Answer, again: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    if again.status != first.status {
        out.push(format!(
            "status {} where the first was {}",
            again.short(),
            first.status
        ));
    }
    if again.bytes != first.bytes {
        let at = again
            .bytes
            .iter()
            .zip(&first.bytes)
            .position(|(a, b)| a != b)
            .unwrap_or(again.bytes.len().min(first.bytes.len()));
        out.push(format!(
            "the body differs from byte {at} ({} bytes, the first {})",
            again.bytes.len(),
            first.bytes.len()
        ));
    }
    for name in MUST_MATCH {
        let (a, b) = (first.header(name), again.header(name));
        if a != b {
            out.push(format!(
                "{name} is {}, the first was {}",
                b.map_or("absent".to_owned(), |v| format!("{v:?}")),
                a.map_or("absent".to_owned(), |v| format!("{v:?}"))
            ));
        }
    }
    if !again.replayed() {
        out.push("not marked Idempotent-Replayed: true".to_owned());
    }
    out
}

/// A key as a sentence names it: in full, or its start and length when long.
fn describe_key(key: &str) -> String {
    if key.len() > 60 {
        format!("{}... ({} characters)", &key[..40], key.len())
    } else {
        key.to_owned()
    }
}

/// Whether the promise makes this answer a problem document: the refusals the
/// scenarios provoke.
fn expects_problem(scenario: &str, status: u16) -> bool {
    match scenario {
        "missing-key" => status == 400,
        s if s.starts_with("malformed-key-") => status == 400,
        "other-body" | "equivalent-body" => status == 422,
        "concurrent" => status == 409,
        _ => false,
    }
}

/// Every problem document received, and every refusal that should have been
/// one, against RFC 9457.
fn problem_documents(results: &[ScenarioResult]) -> Found {
    let mut checked = 0;
    let mut defects = Vec::new();
    for r in results {
        // A scenario the service's own refusal made moot (the other body
        // alone refused as invalid, say) provoked no refusal of the promise's:
        // its answers are checked only where they say they are problems.
        let provoked = r.verdict != Verdict::NotApplicable;
        for ex in &r.exchanges {
            let Some(a) = ex.answer() else { continue };
            let content_type = a.header("content-type").unwrap_or("");
            let is_problem = idem_wire::problem::is_problem_content_type(content_type);
            let refusal = provoked && expects_problem(r.id, a.status);
            if !(is_problem || refusal) {
                continue;
            }
            checked += 1;
            let mut these = Vec::new();
            if !is_problem {
                these.push(format!(
                    "Content-Type is {}, not application/problem+json",
                    if content_type.is_empty() {
                        "absent"
                    } else {
                        content_type
                    }
                ));
            } else {
                these.extend(problem_defects(a));
            }
            if !these.is_empty() {
                defects.push(format!("{} ({}): {}", r.id, a.status, these.join(", ")));
            }
        }
    }
    if checked == 0 {
        return not_applicable("no problem document was received", Vec::new());
    }
    if defects.is_empty() {
        pass(format!("{checked} answers, all well-formed"), Vec::new())
    } else {
        defects.dedup();
        fail(
            format!(
                "{} of {checked} answers: {}",
                defects.len(),
                defects.join("; ")
            ),
            Vec::new(),
        )
    }
}

/// What makes a problem document's body break RFC 9457: not a JSON object, or
/// a standard member of the wrong type (`status` must also be the answer's).
pub(crate) fn problem_defects(a: &Answer) -> Vec<String> {
    let doc: serde_json::Value = match serde_json::from_slice(&a.bytes) {
        Ok(v) => v,
        Err(_) => return vec!["the body is not JSON".to_owned()],
    };
    let Some(members) = doc.as_object() else {
        return vec!["the body is not a JSON object".to_owned()];
    };
    let mut out = Vec::new();
    for name in ["type", "title", "detail", "instance"] {
        if let Some(v) = members.get(name)
            && !v.is_string()
        {
            out.push(format!("\"{name}\" is not a string"));
        }
    }
    match members.get("status") {
        None => {}
        Some(s) if s.as_u64() == Some(u64::from(a.status)) => {}
        Some(s) => out.push(format!("\"status\" is {s}, the answer's is {}", a.status)),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::request::{Outcome, Sent};

    fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Answer {
        Answer {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.to_owned(),
            bytes: body.as_bytes().to_vec(),
            elapsed_ms: 1,
        }
    }

    #[test]
    fn a_faithful_replay_has_no_differences() {
        let first = answer(
            201,
            &[
                ("content-type", "application/json"),
                ("location", "/orders/1"),
            ],
            "{\"id\":1}",
        );
        let mut again = first.clone();
        again
            .headers
            .push(("idempotent-replayed".into(), "true".into()));
        again.headers.push(("date".into(), "later".into()));
        assert!(differences(&first, &again).is_empty());

        let other = answer(
            201,
            &[
                ("content-type", "application/json"),
                ("location", "/orders/2"),
            ],
            "{\"id\":2}",
        );
        let d = differences(&first, &other);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(d[0].starts_with("the body differs from byte 6"), "{d:?}");
        assert!(d[1].starts_with("location is \"/orders/2\""), "{d:?}");
        assert!(d[2].contains("not marked"), "{d:?}");
    }

    #[test]
    fn problem_documents_are_checked_against_rfc_9457() {
        let ct = [("content-type", "application/problem+json")];
        assert!(
            problem_defects(&answer(
                400,
                &ct,
                r#"{"type":"urn:x","title":"t","status":400}"#
            ))
            .is_empty()
        );
        assert!(
            problem_defects(&answer(400, &ct, r#"{}"#)).is_empty(),
            "every member is optional"
        );
        assert_eq!(
            problem_defects(&answer(400, &ct, "oops")),
            ["the body is not JSON"]
        );
        assert_eq!(
            problem_defects(&answer(400, &ct, "[1]")),
            ["the body is not a JSON object"]
        );
        let d = problem_defects(&answer(409, &ct, r#"{"type":1,"status":400}"#));
        assert_eq!(
            d,
            [
                "\"type\" is not a string",
                "\"status\" is 400, the answer's is 409"
            ]
        );
    }

    /// The other body alone refused by the service's own validation, as a
    /// plain `422 application/json`: `other-body` is not applicable, and that
    /// answer is no refusal of the promise's for `problem-documents` to fail.
    /// The same answer to the other body under the used key is one.
    #[test]
    fn a_moot_scenarios_own_refusal_is_not_a_problem_document_defect() {
        let refused = Exchange {
            request: Sent {
                method: "POST".into(),
                url: "http://127.0.0.1/orders".into(),
                key: Some("k".into()),
                headers: Vec::new(),
                body: None,
            },
            result: Outcome::Answer(answer(
                422,
                &[("content-type", "application/json")],
                r#"{"error":"invalid"}"#,
            )),
        };
        let result = |verdict| ScenarioResult {
            id: "other-body",
            title: "other body",
            verdict,
            saw: String::new(),
            elapsed_ms: 1,
            exchanges: vec![refused.clone()],
        };
        let moot = problem_documents(&[result(Verdict::NotApplicable)]);
        assert_eq!(moot.verdict, Verdict::NotApplicable, "{}", moot.saw);
        let provoked = problem_documents(&[result(Verdict::Pass)]);
        assert_eq!(provoked.verdict, Verdict::Fail, "{}", provoked.saw);
        assert!(
            provoked.saw.contains("not application/problem+json"),
            "{}",
            provoked.saw
        );
    }

    #[test]
    fn the_headers_that_must_match_are_what_idem_stores_by_default() {
        assert_eq!(MUST_MATCH, idem_runtime::DEFAULT_STORED_HEADERS);
    }
}
