//! What a rollout is judged on: the figures of each version over the
//! current step (a `Window`), the gates worked out from them, and the
//! verdict. A gate short of samples is inconclusive; it never passes for
//! lack of data.

use super::candidate::Candidate;
use super::field::{FieldFigures, FieldSeen, adjusted, field_worse};
use crate::config::{RolloutMode, RolloutPolicy};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// One answer a version gave while it was on trial (or stable beside it).
#[derive(Debug, Clone)]
pub struct Seen {
    pub model: String,
    pub version: String,
    /// The config version it was answered with.
    pub config: String,
    /// The step it was routed in (`Candidate::step_id`).
    pub step_id: u64,
    /// From the queue to the outputs: what the version costs a request.
    pub latency: Duration,
    /// It failed (`internal`, a full queue, a deadline).
    pub failed: bool,
    /// With a cloud tier: whether the answer fell below the threshold.
    pub escalates: Option<bool>,
    /// For a comparison run: whether both versions gave the same label.
    pub compared: Compared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compared {
    /// The answer was not run on the other version.
    No,
    Agreed,
    Disagreed,
    /// Run on both, but neither version gives labels to compare.
    Unlabelled,
    /// A comparison run that failed: nothing to compare.
    Failed,
}

impl Compared {
    /// Two versions' labels for one input. A label on one side only is a
    /// disagreement (a candidate that lost its labels must not pass the
    /// gate on error rate and latency alone); unlabelled only when neither
    /// version gives one.
    pub fn labels(answered: Option<&str>, other: Option<&str>) -> Compared {
        match (answered, other) {
            (None, None) => Compared::Unlabelled,
            (Some(a), Some(b)) if a == b => Compared::Agreed,
            _ => Compared::Disagreed,
        }
    }
}

struct Figures {
    answers: u64,
    errors: u64,
    escalations: u64,
    /// Answers whose escalation is known (a cloud tier is on).
    escalation_known: u64,
    latency_us: Histogram<u64>,
}

impl Default for Figures {
    fn default() -> Self {
        let latency_us = Histogram::new_with_bounds(1, 600_000_000, 2).expect("valid bounds");
        Figures { answers: 0, errors: 0, escalations: 0, escalation_known: 0, latency_us }
    }
}

impl Figures {
    fn record(&mut self, seen: &Seen) {
        self.answers += 1;
        self.errors += u64::from(seen.failed);
        if let Some(escalates) = seen.escalates {
            self.escalation_known += 1;
            self.escalations += u64::from(escalates);
        }
        if !seen.failed {
            self.latency_us.saturating_record(seen.latency.as_micros().max(1) as u64);
        }
    }

    fn error_rate(&self) -> Option<f64> {
        (self.answers > 0).then(|| self.errors as f64 / self.answers as f64)
    }

    fn p99_ms(&self) -> Option<f64> {
        (!self.latency_us.is_empty()).then(|| self.latency_us.value_at_quantile(0.99) as f64 / 1000.0)
    }

    fn escalation_rate(&self) -> Option<f64> {
        (self.escalation_known > 0).then(|| self.escalations as f64 / self.escalation_known as f64)
    }

    fn summary(&self) -> VersionFigures {
        VersionFigures {
            answers: self.answers,
            errors: self.errors,
            error_rate: self.error_rate(),
            p99_ms: self.p99_ms(),
            escalation_rate: self.escalation_rate(),
        }
    }
}

/// The figures of one version over the step, as the status shows them:
/// its own runs (a cache hit is neither version's run, and not counted).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionFigures {
    pub answers: u64,
    pub errors: u64,
    pub error_rate: Option<f64>,
    pub p99_ms: Option<f64>,
    pub escalation_rate: Option<f64>,
}

/// Every gate, in the order `Window::gates` judges them.
pub const GATES: [&str; 6] =
    ["error_rate", "agreement", "field_accuracy", "field_outcome", "latency", "escalation"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateResult {
    Pass,
    Fail,
    /// Too few samples to say.
    Inconclusive,
    /// Not judged here (no cloud tier for `escalation`; no labels for
    /// `agreement`).
    Off,
}

impl GateResult {
    pub const ALL: [GateResult; 4] =
        [GateResult::Pass, GateResult::Fail, GateResult::Inconclusive, GateResult::Off];

    pub fn as_str(self) -> &'static str {
        match self {
            GateResult::Pass => "pass",
            GateResult::Fail => "fail",
            GateResult::Inconclusive => "inconclusive",
            GateResult::Off => "off",
        }
    }
}

/// One gate's judgement, with the figures it was taken on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gate {
    /// `error_rate`, `latency`, `agreement` or `escalation`.
    pub gate: String,
    pub result: GateResult,
    /// The figure judged (a rate, a p99 in ms, a share) for each version.
    pub candidate: Option<f64>,
    pub stable: Option<f64>,
    /// What the policy allows.
    pub limit: String,
    /// The samples behind it, and how many it needs.
    pub samples: u64,
    pub needed: u64,
}

impl Gate {
    fn describe(&self) -> String {
        let show = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.4}"));
        format!(
            "{} {} (candidate {}, stable {}; allowed {}; {} of {} samples)",
            self.gate,
            self.result.as_str(),
            show(self.candidate),
            show(self.stable),
            self.limit,
            self.samples,
            self.needed
        )
    }
}

/// One version's figures as they travel between the nodes of a site: the
/// counts, and the latency histogram as (value, count) pairs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FiguresWire {
    pub answers: u64,
    pub errors: u64,
    pub escalations: u64,
    pub escalation_known: u64,
    pub latency_us: Vec<(u64, u64)>,
}

/// A step's figures on one node, as the judge of a site pools them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowWire {
    pub stable: FiguresWire,
    pub candidate: FiguresWire,
    pub compared: u64,
    pub agreed: u64,
    pub unlabelled: u64,
    /// Field feedback per version (absent from nodes older than it).
    #[serde(default)]
    pub field: [FieldFigures; 2],
}

/// Beyond it a wire histogram is cut: a peer's message cannot grow one
/// without bound (two significant figures over 1 µs .. 600 s has ~1,000).
const MAX_WIRE_BUCKETS: usize = 4096;

impl Figures {
    fn to_wire(&self) -> FiguresWire {
        FiguresWire {
            answers: self.answers,
            errors: self.errors,
            escalations: self.escalations,
            escalation_known: self.escalation_known,
            latency_us: self
                .latency_us
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        }
    }

    fn add_wire(&mut self, wire: &FiguresWire) {
        self.answers += wire.answers;
        self.errors += wire.errors;
        self.escalations += wire.escalations;
        self.escalation_known += wire.escalation_known;
        for &(value, count) in wire.latency_us.iter().take(MAX_WIRE_BUCKETS) {
            let _ = self.latency_us.record_n(value.clamp(1, 600_000_000), count);
        }
    }
}

impl Window {
    pub fn to_wire(&self) -> WindowWire {
        WindowWire {
            stable: self.stable.to_wire(),
            candidate: self.candidate.to_wire(),
            compared: self.compared,
            agreed: self.agreed,
            unlabelled: self.unlabelled,
            field: self.field.clone(),
        }
    }

    /// Adds another node's figures of the same step.
    pub fn add_wire(&mut self, wire: &WindowWire) {
        self.stable.add_wire(&wire.stable);
        self.candidate.add_wire(&wire.candidate);
        self.compared += wire.compared;
        self.agreed += wire.agreed;
        self.unlabelled += wire.unlabelled;
        for (mine, theirs) in self.field.iter_mut().zip(&wire.field) {
            mine.add(theirs);
        }
    }
}

/// Both versions' figures since the step began.
#[derive(Default)]
pub struct Window {
    stable: Figures,
    candidate: Figures,
    compared: u64,
    agreed: u64,
    /// Comparisons made on a model without labels.
    unlabelled: u64,
    /// Field feedback: stable's, then the candidate's.
    field: [FieldFigures; 2],
}

impl Window {
    pub fn record(&mut self, seen: &Seen, is_candidate: bool) {
        if is_candidate { &mut self.candidate } else { &mut self.stable }.record(seen);
        match seen.compared {
            Compared::Agreed | Compared::Disagreed => {
                self.compared += 1;
                self.agreed += u64::from(seen.compared == Compared::Agreed);
            }
            Compared::Unlabelled => self.unlabelled += 1,
            Compared::No | Compared::Failed => {}
        }
    }

    pub fn record_field(&mut self, field: &FieldSeen, is_candidate: bool) {
        self.field[usize::from(is_candidate)].record(field);
    }

    /// The two field gates: off with `min_feedback = 0` or while neither
    /// version has feedback of the kind in this step; inconclusive while
    /// either has fewer than `min_feedback`; failed when the candidate is
    /// worse than stable by more than the allowed drop at
    /// `field_confidence` (`field_worse`); else passed.
    fn field_gates(&self, policy: &RolloutPolicy) -> [Gate; 2] {
        let [s, c] = &self.field;
        let need = policy.min_feedback;
        // The samples are effective ones (Kish): one message of a huge
        // weight is one sample, not a thousand.
        let judge = |counts: [u64; 2], effective: f64, worse: Option<bool>| match (need, counts, worse) {
            (0, ..) | (_, [0, 0], _) => GateResult::Off,
            _ if effective < need as f64 - 1e-9 => GateResult::Inconclusive,
            (_, _, Some(true)) => GateResult::Fail,
            _ => GateResult::Pass,
        };
        let effective = |a: Option<f64>, b: Option<f64>| a.unwrap_or(0.0).min(b.unwrap_or(0.0));
        let labels_n = effective(c.accuracy().map(|a| a.1), s.accuracy().map(|a| a.1));
        let outcomes_n = effective(c.outcome().map(|o| o.2), s.outcome().map(|o| o.2));
        let confidence = policy.field_confidence;
        let accuracy_worse = match (c.accuracy(), s.accuracy()) {
            (Some((pc, nc)), Some((ps, ns))) => {
                Some(field_worse(adjusted(pc, nc), adjusted(ps, ns), policy.max_accuracy_drop, confidence))
            }
            _ => None,
        };
        let outcome_worse = match (c.outcome(), s.outcome()) {
            (Some(co), Some(so)) => Some(field_worse(co, so, policy.max_outcome_drop, confidence)),
            _ => None,
        };
        let at = |drop: f64| format!("stable - {drop}, at {confidence} confidence");
        [
            Gate {
                gate: "field_accuracy".into(),
                result: judge([c.labels, s.labels], labels_n, accuracy_worse),
                candidate: c.accuracy().map(|a| a.0),
                stable: s.accuracy().map(|a| a.0),
                limit: at(policy.max_accuracy_drop),
                samples: labels_n.floor() as u64,
                needed: need,
            },
            Gate {
                gate: "field_outcome".into(),
                result: judge([c.outcomes, s.outcomes], outcomes_n, outcome_worse),
                candidate: c.outcome().map(|o| o.0),
                stable: s.outcome().map(|o| o.0),
                limit: at(policy.max_outcome_drop),
                samples: outcomes_n.floor() as u64,
                needed: need,
            },
        ]
    }

    /// Every gate on these figures under `policy`, the answers' correctness
    /// first: when several fail, the first is the reason given.
    pub fn gates(&self, policy: &RolloutPolicy) -> Vec<Gate> {
        let need = policy.min_requests;
        let (c, s) = (&self.candidate, &self.stable);
        let both = c.answers.min(s.answers);
        let judged = |samples: u64, fails: bool| match (samples >= need, fails) {
            (false, _) => GateResult::Inconclusive,
            (true, true) => GateResult::Fail,
            (true, false) => GateResult::Pass,
        };
        let error_fails = match (c.error_rate(), s.error_rate()) {
            (Some(c), Some(s)) => c > s + policy.max_error_rate_increase,
            _ => false,
        };
        let (cp, sp) = (c.p99_ms(), s.p99_ms());
        let latency_fails = match (cp, sp) {
            (Some(c), Some(s)) => c > s * policy.max_p99_ratio && c > s + policy.p99_slack_ms,
            _ => false,
        };
        let latency_samples = c.latency_us.len().min(s.latency_us.len());
        let agreement = (self.compared > 0).then(|| self.agreed as f64 / self.compared as f64);
        let agreement_result = if self.compared == 0 && self.unlabelled > 0 {
            GateResult::Off
        } else {
            judged(self.compared, agreement.is_some_and(|a| a < policy.min_agreement))
        };
        let [field_accuracy, field_outcome] = self.field_gates(policy);
        let (ce, se) = (c.escalation_rate(), s.escalation_rate());
        let escalation_result = if c.escalation_known + s.escalation_known == 0 {
            GateResult::Off
        } else {
            let fails = matches!((ce, se), (Some(c), Some(s)) if c > s + policy.max_escalation_increase);
            judged(c.escalation_known.min(s.escalation_known), fails)
        };
        vec![
            Gate {
                gate: "error_rate".into(),
                result: judged(both, error_fails),
                candidate: c.error_rate(),
                stable: s.error_rate(),
                limit: format!("stable + {}", policy.max_error_rate_increase),
                samples: both,
                needed: need,
            },
            Gate {
                gate: "agreement".into(),
                result: agreement_result,
                candidate: agreement,
                stable: None,
                limit: format!("at least {} of compared answers", policy.min_agreement),
                samples: self.compared,
                needed: need,
            },
            field_accuracy,
            field_outcome,
            Gate {
                gate: "latency".into(),
                result: judged(latency_samples, latency_fails),
                candidate: cp,
                stable: sp,
                limit: format!(
                    "p99 within {}x of stable's or {} ms above it",
                    policy.max_p99_ratio, policy.p99_slack_ms
                ),
                samples: latency_samples,
                needed: need,
            },
            Gate {
                gate: "escalation".into(),
                result: escalation_result,
                candidate: ce,
                stable: se,
                limit: format!("stable + {}", policy.max_escalation_increase),
                samples: c.escalation_known.min(s.escalation_known),
                needed: need,
            },
        ]
    }

    pub fn trial(&self, model: &str, candidate: &Candidate) -> Trial {
        let mut gates = self.gates(&candidate.policy);
        // Devices see no answer of the candidate in shadow mode, and none of
        // stable at a canary's 100% step: feedback cannot compare the two
        // there, so the field gates wait on nothing (a failure found on the
        // feedback that still comes in stands).
        if candidate.mode == RolloutMode::Shadow || candidate.share() == 100 {
            for g in gates.iter_mut().filter(|g| g.gate.starts_with("field_") && g.result != GateResult::Fail)
            {
                g.result = GateResult::Off;
            }
        }
        Trial {
            model: model.into(),
            version: candidate.version.clone(),
            mode: candidate.mode,
            share: candidate.share(),
            step: candidate.step + 1,
            steps: if candidate.mode == RolloutMode::Canary { candidate.policy.steps.len() } else { 1 },
            step_started_s: candidate.step_started_s,
            held: candidate.held.clone(),
            gates,
            stable: self.stable.summary(),
            candidate: self.candidate.summary(),
            compared: self.compared,
            agreed: self.agreed,
        }
    }
}

/// A rollout's step as the status shows it: the gates and each version's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trial {
    pub model: String,
    pub version: String,
    pub mode: RolloutMode,
    /// The percentage of devices the candidate answers.
    pub share: u8,
    /// Which step (from 1) of how many.
    pub step: usize,
    pub steps: usize,
    pub step_started_s: u64,
    pub held: Option<String>,
    pub gates: Vec<Gate>,
    pub stable: VersionFigures,
    pub candidate: VersionFigures,
    /// Answers run on both versions, and how many of them agreed.
    pub compared: u64,
    pub agreed: u64,
}

/// What the gates say about a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Not yet: the step bakes, or its gates wait for samples.
    Wait,
    Pass {
        gates: Vec<Gate>,
    },
    Fail {
        reason: String,
        gates: Vec<Gate>,
    },
    /// The samples did not come in `max_wait_s`.
    Inconclusive {
        reason: String,
        gates: Vec<Gate>,
    },
}

/// The verdict on `candidate`'s step at `now_s`, from its gates. An A/B
/// split is never decided automatically; a held step only rolls back.
pub fn verdict(candidate: &Candidate, gates: Vec<Gate>, now_s: u64) -> Verdict {
    if candidate.mode == RolloutMode::Ab {
        return Verdict::Wait;
    }
    if let Some(failed) = gates.iter().find(|g| g.result == GateResult::Fail) {
        let reason = format!("gate {} failed: {}", failed.gate, failed.describe());
        return Verdict::Fail { reason, gates };
    }
    if candidate.held.is_some() {
        return Verdict::Wait;
    }
    let policy = &candidate.policy;
    let baked = now_s.saturating_sub(candidate.step_started_s);
    let short: Vec<&Gate> = gates.iter().filter(|g| g.result == GateResult::Inconclusive).collect();
    if short.is_empty() && baked >= policy.bake_s {
        return Verdict::Pass { gates };
    }
    if !short.is_empty() && baked >= policy.max_wait_s {
        let lacking: Vec<String> =
            short.iter().map(|g| format!("{} has {} of {}", g.gate, g.samples, g.needed)).collect();
        let reason = format!("inconclusive after {baked} s: {} samples", lacking.join(", "));
        return Verdict::Inconclusive { reason, gates };
    }
    Verdict::Wait
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::field::FieldSays;

    fn candidate(policy: RolloutPolicy) -> Candidate {
        Candidate {
            version: "2".into(),
            config: None,
            mode: RolloutMode::Canary,
            policy,
            step: 0,
            step_started_s: 100,
            step_id: 7,
            started_at_s: 100,
            by: "test".into(),
            held: None,
        }
    }

    fn seen(us: u64, failed: bool, agreed: Option<bool>) -> Seen {
        let compared = match agreed {
            Some(true) => Compared::Agreed,
            Some(false) => Compared::Disagreed,
            None => Compared::No,
        };
        Seen {
            model: "digits".into(),
            version: String::new(),
            config: String::new(),
            step_id: 7,
            latency: Duration::from_micros(us),
            failed,
            escalates: None,
            compared,
        }
    }

    fn policy() -> RolloutPolicy {
        RolloutPolicy { min_requests: 20, bake_s: 10, max_wait_s: 100, ..RolloutPolicy::default() }
    }

    fn by_name<'a>(gates: &'a [Gate], name: &str) -> &'a Gate {
        gates.iter().find(|g| g.gate == name).unwrap_or_else(|| panic!("no gate {name} in {gates:?}"))
    }

    fn label(version: &str, correct: bool) -> FieldSeen {
        let says = FieldSays::Label { correct };
        FieldSeen {
            model: "digits".into(),
            version: version.into(),
            config: String::new(),
            weight: 1.0,
            says,
        }
    }

    fn outcome(version: &str, x: f64) -> FieldSeen {
        FieldSeen {
            model: "digits".into(),
            version: version.into(),
            config: String::new(),
            weight: 1.0,
            says: FieldSays::Outcome(x),
        }
    }

    /// A window with `n` answers of each version, all alike, so only the
    /// field gates can decide.
    fn quiet_window(n: usize) -> Window {
        let mut w = Window::default();
        for _ in 0..n {
            w.record(&seen(1000, false, Some(true)), true);
            w.record(&seen(1000, false, None), false);
        }
        w
    }

    #[test]
    fn field_gates_fail_a_worse_candidate_pass_an_equal_one_and_wait_on_too_little_feedback() {
        let c = candidate(RolloutPolicy { min_feedback: 50, ..policy() });
        let mut rng = fastrand::Rng::with_seed(40);
        // Permuted labels: right 10% of the time against stable's 90%.
        let mut w = quiet_window(20);
        for _ in 0..60 {
            w.record_field(&label("2", rng.f64() < 0.1), true);
            w.record_field(&label("1", rng.f64() < 0.9), false);
        }
        let gates = w.gates(&c.policy);
        assert_eq!(by_name(&gates, "field_accuracy").result, GateResult::Fail, "{gates:?}");
        assert_eq!(by_name(&gates, "field_outcome").result, GateResult::Off, "no outcomes");
        let Verdict::Fail { reason, .. } = verdict(&c, gates, 150) else { panic!() };
        assert!(reason.starts_with("gate field_accuracy failed"), "{reason}");
        // Equal outcomes (both accepted 60% of the time): passes.
        let mut w = quiet_window(20);
        for _ in 0..200 {
            w.record_field(&outcome("2", f64::from(rng.f64() < 0.6)), true);
            w.record_field(&outcome("1", f64::from(rng.f64() < 0.6)), false);
        }
        assert_eq!(by_name(&w.gates(&c.policy), "field_outcome").result, GateResult::Pass);
        // A lower mean outcome (0.3 against 0.6): fails.
        let mut w = quiet_window(20);
        for _ in 0..200 {
            w.record_field(&outcome("2", f64::from(rng.f64() < 0.3)), true);
            w.record_field(&outcome("1", f64::from(rng.f64() < 0.6)), false);
        }
        assert_eq!(by_name(&w.gates(&c.policy), "field_outcome").result, GateResult::Fail);
        // Feedback on 5% of 200 answers: 10 a version, short of 50, even
        // with the candidate all wrong: inconclusive, never passing.
        let mut w = quiet_window(20);
        for _ in 0..10 {
            w.record_field(&label("2", false), true);
            w.record_field(&label("1", true), false);
            w.record_field(&outcome("2", 1.0), true);
            w.record_field(&outcome("1", 1.0), false);
        }
        let gates = w.gates(&c.policy);
        for name in ["field_accuracy", "field_outcome"] {
            assert_eq!(by_name(&gates, name).result, GateResult::Inconclusive, "{gates:?}");
        }
        assert_eq!(verdict(&c, gates.clone(), 150), Verdict::Wait);
        assert!(matches!(verdict(&c, gates, 200), Verdict::Inconclusive { .. }));
        // Plenty for stable is not enough: each version needs its own.
        for _ in 0..200 {
            w.record_field(&label("1", true), false);
        }
        assert_eq!(by_name(&w.gates(&c.policy), "field_accuracy").result, GateResult::Inconclusive);
        // A small true difference within the allowed drop passes.
        let c = candidate(RolloutPolicy { min_feedback: 50, max_accuracy_drop: 0.1, ..policy() });
        let mut w = quiet_window(20);
        for i in 0..400 {
            w.record_field(&label("2", i % 100 < 85), true);
            w.record_field(&label("1", i % 100 < 88), false);
        }
        assert_eq!(by_name(&w.gates(&c.policy), "field_accuracy").result, GateResult::Pass);
        // Shadow mode and a canary's 100% step: devices see one version
        // only, so feedback cannot compare; off, unless it found a failure.
        let mut sparse = quiet_window(20);
        sparse.record_field(&label("1", true), false);
        for (mode, step, want) in [
            (RolloutMode::Shadow, 0, GateResult::Off),
            (RolloutMode::Canary, 3, GateResult::Off),
            (RolloutMode::Canary, 0, GateResult::Inconclusive),
        ] {
            let c = Candidate { mode, step, ..candidate(RolloutPolicy { min_feedback: 50, ..policy() }) };
            let trial = sparse.trial("digits", &c);
            assert_eq!(by_name(&trial.gates, "field_accuracy").result, want, "{mode:?} step {step}");
        }
        let c = Candidate { step: 3, ..candidate(RolloutPolicy { min_feedback: 50, ..policy() }) };
        let mut worse = quiet_window(20);
        for _ in 0..60 {
            worse.record_field(&label("2", false), true);
            worse.record_field(&label("1", true), false);
        }
        assert_eq!(by_name(&worse.trial("digits", &c).gates, "field_accuracy").result, GateResult::Fail);
        // One message of weight 1,000,000 among 99 of weight 1 is about one
        // effective sample, not a hundred: inconclusive, not a rollback.
        let c = candidate(RolloutPolicy { min_feedback: 50, ..policy() });
        let mut heavy = quiet_window(20);
        for i in 0..100 {
            let (x, weight) = if i == 0 { (0.0, 1e6) } else { (1.0, 1.0) };
            heavy.record_field(&FieldSeen { weight, ..outcome("2", x) }, true);
            heavy.record_field(&outcome("1", 1.0), false);
        }
        assert_eq!(by_name(&heavy.gates(&c.policy), "field_outcome").result, GateResult::Inconclusive);
        // min_feedback = 0 turns them off.
        let c = candidate(RolloutPolicy { min_feedback: 0, ..policy() });
        assert_eq!(by_name(&w.gates(&c.policy), "field_accuracy").result, GateResult::Off);
    }

    #[test]
    fn a_label_on_one_side_only_is_a_disagreement_so_agreement_stays_on() {
        assert_eq!(Compared::labels(Some("3"), None), Compared::Disagreed);
        assert_eq!(Compared::labels(None, Some("3")), Compared::Disagreed);
        assert_eq!(Compared::labels(None, None), Compared::Unlabelled);
        assert_eq!(Compared::labels(Some("3"), Some("3")), Compared::Agreed);
        // A candidate without labels beside a labelled stable fails the gate.
        let c = candidate(policy());
        let mut w = Window::default();
        for _ in 0..20 {
            let compared = Compared::labels(Some("7"), None);
            w.record(&Seen { compared, ..seen(1000, false, None) }, true);
            w.record(&seen(1000, false, None), false);
        }
        let Verdict::Fail { reason, .. } = verdict(&c, w.gates(&c.policy), 110) else { panic!() };
        assert!(reason.starts_with("gate agreement failed"), "{reason}");
    }

    #[test]
    fn a_site_judges_the_figures_of_its_nodes_pooled() {
        let c = candidate(policy());
        // Two nodes, each short of samples; pooled, the slow candidate fails.
        let node = || {
            let mut w = Window::default();
            for _ in 0..10 {
                w.record(&seen(30_000, false, Some(true)), true);
                w.record(&seen(1000, false, None), false);
            }
            w
        };
        assert_eq!(verdict(&c, node().gates(&c.policy), 150), Verdict::Wait);
        let mut pooled = node();
        let wire = node().to_wire();
        let wire: WindowWire = serde_json::from_str(&serde_json::to_string(&wire).unwrap()).unwrap();
        pooled.add_wire(&wire);
        let Verdict::Fail { reason, gates } = verdict(&c, pooled.gates(&c.policy), 150) else { panic!() };
        assert!(reason.starts_with("gate latency failed"), "{reason}");
        assert_eq!(gates[0].samples, 20, "{gates:?}");
        assert!(by_name(&gates, "latency").candidate.unwrap() > 25.0, "{gates:?}");
    }

    #[test]
    fn too_few_samples_never_pass_and_turn_inconclusive_at_the_limit() {
        let c = candidate(policy());
        let mut w = Window::default();
        for _ in 0..19 {
            w.record(&seen(1000, false, Some(true)), true);
            w.record(&seen(1000, false, None), false);
        }
        let gates = w.gates(&c.policy);
        for name in ["error_rate", "agreement", "latency"] {
            assert_eq!(by_name(&gates, name).result, GateResult::Inconclusive, "{gates:?}");
        }
        assert_eq!(by_name(&gates, "escalation").result, GateResult::Off, "no cloud tier");
        assert_eq!(by_name(&gates, "field_accuracy").result, GateResult::Off, "no feedback");
        assert_eq!(verdict(&c, gates.clone(), 150), Verdict::Wait, "baked, but short of samples");
        let Verdict::Inconclusive { reason, .. } = verdict(&c, gates, 200) else { panic!() };
        assert!(reason.contains("agreement has 19 of 20"), "{reason}");
        w.record(&seen(1, false, Some(true)), true);
        w.record(&seen(1, false, None), false);
        assert_eq!(verdict(&c, w.gates(&c.policy), 105), Verdict::Wait, "enough samples, not baked");
        assert!(matches!(verdict(&c, w.gates(&c.policy), 110), Verdict::Pass { .. }));
    }

    #[test]
    fn disagreement_slowness_and_errors_fail_once_sampled_with_the_figures() {
        let c = candidate(policy());
        let judge = |candidate: Seen, stable: Seen| {
            let mut w = Window::default();
            for _ in 0..20 {
                w.record(&candidate, true);
                w.record(&stable, false);
            }
            match verdict(&c, w.gates(&c.policy), 101) {
                Verdict::Fail { reason, .. } => reason,
                other => panic!("{other:?}"),
            }
        };
        let reason = judge(seen(1000, false, Some(false)), seen(1000, false, None));
        assert!(
            reason.starts_with("gate agreement failed") && reason.contains("candidate 0.0000"),
            "{reason}"
        );
        let reason = judge(seen(30_000, false, Some(true)), seen(1000, false, None));
        assert!(reason.starts_with("gate latency failed") && reason.contains("candidate 30"), "{reason}");
        let reason = judge(seen(1000, true, None), seen(1000, false, None));
        assert!(reason.starts_with("gate error_rate failed"), "{reason}");
        // With a cloud tier: the candidate escalates far more often.
        let escalating =
            |escalates: bool| Seen { escalates: Some(escalates), ..seen(1000, false, Some(true)) };
        let reason = judge(escalating(true), escalating(false));
        assert!(
            reason.starts_with("gate escalation failed") && reason.contains("candidate 1.0000"),
            "{reason}"
        );
        // Slower, but within the ratio or the slack: passes.
        let mut w = Window::default();
        for _ in 0..20 {
            w.record(&seen(1400, false, Some(true)), true);
            w.record(&seen(1000, false, None), false);
            w.record(&seen(300, false, Some(true)), true);
            w.record(&seen(100, false, None), false);
        }
        assert!(matches!(verdict(&c, w.gates(&c.policy), 110), Verdict::Pass { .. }));
    }
}
