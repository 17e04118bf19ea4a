//! `[models.NAME.rollout]` and `models.NAME.auto_rollout`: how a new
//! version is tried before it serves everyone. The defaults suit a gateway
//! that sees tens of requests a minute: each step bakes ten minutes and
//! needs 50 of the candidate's answers, and a step still short of data
//! after a day holds rather than passes. `models rollout --steps/--gates`
//! override them for one rollout.

use serde::{Deserialize, Serialize};

/// How a candidate version meets traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutMode {
    /// A growing share of devices (sticky per reply topic) gets its answers.
    Canary,
    /// Devices get stable's answers only; the candidate runs on the same
    /// inputs and its answers are compared, then dropped.
    Shadow,
    /// A fixed share with figures per version, and no automatic decision.
    Ab,
}

impl RolloutMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RolloutMode::Canary => "canary",
            RolloutMode::Shadow => "shadow",
            RolloutMode::Ab => "ab",
        }
    }

    pub fn parse(text: &str) -> Option<RolloutMode> {
        [RolloutMode::Canary, RolloutMode::Shadow, RolloutMode::Ab].into_iter().find(|m| m.as_str() == text)
    }
}

/// `models.NAME.auto_rollout`: what a new version found by a reload starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AutoRollout {
    /// It becomes the newest version; it serves unless a stable is pinned.
    #[default]
    Off,
    Canary,
    Shadow,
}

impl AutoRollout {
    pub fn mode(self) -> Option<RolloutMode> {
        match self {
            AutoRollout::Off => None,
            AutoRollout::Canary => Some(RolloutMode::Canary),
            AutoRollout::Shadow => Some(RolloutMode::Shadow),
        }
    }
}

/// What a step does when its gates still lack data at `max_wait_s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnInconclusive {
    /// Stay at this step until someone promotes or rolls back (a failing
    /// gate still rolls back).
    #[default]
    Hold,
    Rollback,
}

/// The confidence levels `field_confidence` may name, with the one-sided
/// normal quantile each stands for.
pub const FIELD_CONFIDENCE: [(f64, f64); 3] = [(0.90, 1.2816), (0.95, 1.6449), (0.99, 2.3263)];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutPolicy {
    /// The canary's shares of devices, in percent, one per step.
    pub steps: Vec<u8>,
    /// The candidate's share in an A/B split, in percent.
    pub ab_share: u8,
    /// The share of requests run a second time on the other version to
    /// compare answers: on the candidate in shadow mode, on stable for the
    /// candidate's canary answers.
    pub compare_share: f64,
    /// The least time a step lasts.
    pub bake_s: u64,
    /// The least samples each gate needs per step (candidate answers,
    /// compared answers) before it may pass or fail.
    pub min_requests: u64,
    /// How long a step may wait for its samples before `on_inconclusive`.
    pub max_wait_s: u64,
    /// What a step still short of samples at `max_wait_s` does: `hold`
    /// (wait for someone to promote or roll back) or `rollback`.
    pub on_inconclusive: OnInconclusive,
    /// Gate `error_rate`: the candidate's error rate may exceed stable's by this.
    pub max_error_rate_increase: f64,
    /// Gate `latency`: the candidate's p99 may be this multiple of stable's...
    pub max_p99_ratio: f64,
    /// ...or at most this many milliseconds above it (noise on fast models).
    pub p99_slack_ms: f64,
    /// Gate `agreement`: the least share of compared answers with the same label.
    pub min_agreement: f64,
    /// Gate `escalation` (with a cloud tier): the candidate's share of answers
    /// below the threshold may exceed stable's by this.
    pub max_escalation_increase: f64,
    /// Gates `field_accuracy` and `field_outcome` (devices' feedback): the
    /// least feedback of the kind each version needs in a step (effective
    /// samples: weights count); 0 turns them off. Off too while neither
    /// version has feedback of the kind, in shadow mode and at a canary's
    /// 100% step.
    // The field keys are written only when set: a node from before them
    // reads a deployment (the state file, the site's) that keeps the
    // defaults.
    #[serde(skip_serializing_if = "is_default_min_feedback")]
    pub min_feedback: u64,
    /// Gate `field_accuracy`: the candidate's share of labels right may be
    /// this far below stable's before it fails.
    #[serde(skip_serializing_if = "is_zero")]
    pub max_accuracy_drop: f64,
    /// Gate `field_outcome`: the candidate's mean outcome may be this far
    /// below stable's before it fails.
    #[serde(skip_serializing_if = "is_zero")]
    pub max_outcome_drop: f64,
    /// How sure the field gates must be that the candidate is worse before
    /// failing it: 0.9, 0.95 or 0.99 (one-sided).
    #[serde(skip_serializing_if = "is_default_confidence")]
    pub field_confidence: f64,
}

fn is_default_min_feedback(v: &u64) -> bool {
    *v == RolloutPolicy::default().min_feedback
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

fn is_default_confidence(v: &f64) -> bool {
    *v == RolloutPolicy::default().field_confidence
}

impl Default for RolloutPolicy {
    fn default() -> Self {
        RolloutPolicy {
            steps: vec![5, 25, 50, 100],
            ab_share: 50,
            compare_share: 1.0,
            bake_s: 600,
            min_requests: 50,
            max_wait_s: 86_400,
            on_inconclusive: OnInconclusive::Hold,
            max_error_rate_increase: 0.01,
            max_p99_ratio: 1.5,
            p99_slack_ms: 1.0,
            min_agreement: 0.95,
            max_escalation_increase: 0.05,
            min_feedback: 100,
            max_accuracy_drop: 0.0,
            max_outcome_drop: 0.0,
            field_confidence: 0.95,
        }
    }
}

impl RolloutPolicy {
    /// The policy with `models rollout`'s overrides: `steps` as `5,25,100`,
    /// `gates` as `key=value,...` over this table's keys.
    pub fn with_overrides(&self, steps: Option<&str>, gates: Option<&str>) -> Result<RolloutPolicy, String> {
        let mut table = self.as_table();
        if let Some(steps) = steps.filter(|s| !s.is_empty()) {
            table.insert("steps".into(), parse_value("steps", &format!("[{steps}]"))?);
        }
        for pair in gates.unwrap_or_default().split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("--gates {pair:?}: write KEY=VALUE, e.g. max_p99_ratio=2"))?;
            let key = key.trim();
            if key == "steps" || !table.contains_key(key) {
                let keys: Vec<&str> = table.keys().map(String::as_str).filter(|k| *k != "steps").collect();
                return Err(format!("--gates {key:?} is not a gate setting; use one of {}", keys.join(", ")));
            }
            table.insert(key.into(), parse_value(key, value.trim())?);
        }
        let policy: RolloutPolicy =
            table.try_into().map_err(|e: toml::de::Error| format!("--gates: {}", e.message()))?;
        policy.check().map_err(|(key, why)| format!("{key}: {why}"))?;
        Ok(policy)
    }

    /// Every key with its value, those written only when set included.
    pub fn as_table(&self) -> toml::Table {
        let mut table = toml::Table::try_from(self).expect("a policy serializes");
        let field_keys = [
            ("min_feedback", toml::Value::Integer(self.min_feedback as i64)),
            ("max_accuracy_drop", toml::Value::Float(self.max_accuracy_drop)),
            ("max_outcome_drop", toml::Value::Float(self.max_outcome_drop)),
            ("field_confidence", toml::Value::Float(self.field_confidence)),
        ];
        for (key, value) in field_keys {
            table.entry(key).or_insert(value);
        }
        table
    }

    /// The key and what is wrong with it, if any.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let ascending = self.steps.windows(2).all(|w| w[0] < w[1]);
        if self.steps.is_empty() || !ascending || self.steps.last() != Some(&100) || self.steps[0] == 0 {
            return Err((
                "steps",
                format!("{:?}: use ascending percentages ending at 100, e.g. [5, 25, 50, 100]", self.steps),
            ));
        }
        if !(1..=99).contains(&self.ab_share) {
            return Err(("ab_share", format!("{}: use a percentage from 1 to 99", self.ab_share)));
        }
        if self.compare_share <= 0.0 {
            return Err((
                "compare_share",
                format!(
                    "{}: use a share above 0 (up to 1.0): the compared answers feed the agreement gate, \
                     and stable's figures once a canary reaches 100%",
                    self.compare_share
                ),
            ));
        }
        let shares = [
            ("compare_share", self.compare_share),
            ("min_agreement", self.min_agreement),
            ("max_error_rate_increase", self.max_error_rate_increase),
            ("max_escalation_increase", self.max_escalation_increase),
        ];
        for (key, v) in shares {
            if !(0.0..=1.0).contains(&v) {
                return Err((key, format!("{v}: use a share from 0.0 to 1.0")));
            }
        }
        if self.max_p99_ratio < 1.0 || self.p99_slack_ms < 0.0 {
            return Err((
                "max_p99_ratio",
                format!(
                    "{} (slack {} ms): use a ratio of 1.0 or more and a slack of 0 or more",
                    self.max_p99_ratio, self.p99_slack_ms
                ),
            ));
        }
        if (1..30).contains(&self.min_feedback) {
            return Err((
                "min_feedback",
                format!(
                    "{}: use 0 (field gates off) or at least 30 (the tests' normal approximation)",
                    self.min_feedback
                ),
            ));
        }
        if !FIELD_CONFIDENCE.iter().any(|(c, _)| (c - self.field_confidence).abs() < 1e-9) {
            return Err(("field_confidence", format!("{}: use 0.9, 0.95 or 0.99", self.field_confidence)));
        }
        if !(0.0..=1.0).contains(&self.max_accuracy_drop) {
            return Err((
                "max_accuracy_drop",
                format!("{}: use a share from 0.0 to 1.0", self.max_accuracy_drop),
            ));
        }
        if !(self.max_outcome_drop.is_finite() && self.max_outcome_drop >= 0.0) {
            return Err((
                "max_outcome_drop",
                format!("{}: use 0 or a positive number", self.max_outcome_drop),
            ));
        }
        if self.min_requests == 0 {
            return Err(("min_requests", "0: a gate needs at least one sample; use 1 or more".into()));
        }
        Ok(())
    }
}

/// `text` as TOML reads it (`2`, `0.9`, `[5, 100]`), or else as a word
/// (`rollback`); the key's type decides whether it fits.
fn parse_value(key: &str, text: &str) -> Result<toml::Value, String> {
    if text.is_empty() {
        return Err(format!("--gates {key}= has no value"));
    }
    let doc: Result<toml::Table, _> = toml::from_str(&format!("v = {text}"));
    Ok(doc.ok().and_then(|mut d| d.remove("v")).unwrap_or_else(|| toml::Value::String(text.into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_change_the_named_keys_and_name_a_bad_one() {
        let p = RolloutPolicy::default()
            .with_overrides(Some("10,100"), Some("bake_s=2, min_agreement=0.9"))
            .unwrap();
        assert_eq!((p.steps, p.bake_s, p.min_agreement, p.min_requests), (vec![10, 100], 2, 0.9, 50));
        // The field gates' keys, though a default policy does not write them.
        let p = RolloutPolicy::default()
            .with_overrides(None, Some("min_feedback=30,field_confidence=0.99"))
            .unwrap();
        assert_eq!((p.min_feedback, p.field_confidence), (30, 0.99));
        let written = toml::to_string(&RolloutPolicy::default()).unwrap();
        assert!(!written.contains("min_feedback"), "an older node reads it: {written}");
        let err = RolloutPolicy::default().with_overrides(None, Some("min_feedback=10")).unwrap_err();
        assert!(err.contains("min_feedback") && err.contains("at least 30"), "{err}");
        let err = RolloutPolicy::default().with_overrides(None, Some("bake=2")).unwrap_err();
        assert!(err.contains("\"bake\"") && err.contains("bake_s"), "{err}");
        let err = RolloutPolicy::default().with_overrides(Some("50,25,100"), None).unwrap_err();
        assert!(err.starts_with("steps:"), "{err}");
        let err = RolloutPolicy::default().with_overrides(None, Some("on_inconclusive=wait")).unwrap_err();
        assert!(err.contains("on_inconclusive") || err.contains("wait"), "{err}");
    }
}
