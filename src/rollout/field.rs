//! Field quality: what devices reported later about each version's answers
//! (`engine/feedback.rs` joins it), as figures for a share (the labels
//! answered right) and a mean (the outcomes), and the statistics the field
//! gates (`gates.rs`) and `models ab-report` draw from them.
//!
//! Why these tests (docs/FEEDBACK.md): the share of
//! labels right is a proportion per version, compared with the unpooled
//! two-proportion variance after the Agresti-Caffo adjustment (one success
//! and one failure added to each side), which keeps its coverage near the
//! level on small samples and at shares of 0 or 1, where the plain Wald
//! interval has no width. An outcome is any number, so its mean is compared
//! with each side's own variance (Welch: a version may change the spread
//! as well as the mean), with the normal quantile, which the 30 samples a
//! gate needs at least make a close approximation. Weights count through
//! Kish's effective sample size, `(sum w)^2 / sum w^2`.

use crate::config::FIELD_CONFIDENCE;
use serde::{Deserialize, Serialize};

/// Field feedback about an answer a version gave, counted in the step
/// running when it arrives: feedback comes late.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldSeen {
    pub model: String,
    pub version: String,
    /// The config version the answer was given with.
    pub config: String,
    pub weight: f64,
    pub says: FieldSays,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldSays {
    /// The true label came back: whether the answer had it.
    Label { correct: bool },
    /// An outcome (accepted 1 / rejected 0, or any value).
    Outcome(f64),
}

/// One version's field feedback, weighted, with the sums the tests need.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FieldFigures {
    /// Label feedback joined, its weight and the sum of squared weights.
    pub labels: u64,
    pub label_weight: f64,
    pub label_weight_sq: f64,
    /// The weight of the labels the answer had right.
    pub correct_weight: f64,
    /// Outcome feedback joined, its weight, the sum of squared weights, and
    /// the weighted sums of the outcomes and of their squares.
    pub outcomes: u64,
    pub outcome_weight: f64,
    pub outcome_weight_sq: f64,
    pub outcome_sum: f64,
    pub outcome_sum_sq: f64,
}

impl FieldFigures {
    pub fn record(&mut self, field: &FieldSeen) {
        let w = field.weight;
        match field.says {
            FieldSays::Label { correct } => {
                self.labels += 1;
                self.label_weight += w;
                self.label_weight_sq += w * w;
                self.correct_weight += if correct { w } else { 0.0 };
            }
            FieldSays::Outcome(x) => {
                self.outcomes += 1;
                self.outcome_weight += w;
                self.outcome_weight_sq += w * w;
                self.outcome_sum += w * x;
                self.outcome_sum_sq += w * x * x;
            }
        }
    }

    pub fn add(&mut self, other: &FieldFigures) {
        self.labels += other.labels;
        self.label_weight += other.label_weight;
        self.label_weight_sq += other.label_weight_sq;
        self.correct_weight += other.correct_weight;
        self.outcomes += other.outcomes;
        self.outcome_weight += other.outcome_weight;
        self.outcome_weight_sq += other.outcome_weight_sq;
        self.outcome_sum += other.outcome_sum;
        self.outcome_sum_sq += other.outcome_sum_sq;
    }

    /// The weighted accuracy and its effective sample size.
    pub fn accuracy(&self) -> Option<(f64, f64)> {
        (self.label_weight > 0.0).then(|| {
            let n = effective(self.labels, self.label_weight, self.label_weight_sq);
            (self.correct_weight / self.label_weight, n)
        })
    }

    /// The weighted mean outcome, its variance (with Bessel's correction
    /// on the effective n) and effective sample size.
    pub fn outcome(&self) -> Option<(f64, f64, f64)> {
        (self.outcome_weight > 0.0).then(|| {
            let mean = self.outcome_sum / self.outcome_weight;
            let n = effective(self.outcomes, self.outcome_weight, self.outcome_weight_sq);
            let spread = (self.outcome_sum_sq / self.outcome_weight - mean * mean).max(0.0);
            (mean, if n > 1.0 { spread * n / (n - 1.0) } else { spread }, n)
        })
    }
}

/// Kish's effective sample size of `count` samples weighing `weight` in
/// all and `weight_sq` squared; the count where the squares are missing
/// (a node from before them) or too small to hold, and never above it
/// (rounding of equal weights).
fn effective(count: u64, weight: f64, weight_sq: f64) -> f64 {
    let n = weight * weight / weight_sq;
    if n.is_finite() && weight_sq > 0.0 { n.min(count as f64) } else { count as f64 }
}

/// One version's field figures since the node started (one config's:
/// during a config rollout a version answers with two).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FieldQuality {
    pub model: String,
    pub version: String,
    /// The config version its answers were served with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// Answers recorded for feedback.
    pub answers: u64,
    #[serde(flatten)]
    pub figures: FieldFigures,
}

impl FieldQuality {
    /// The weighted share of labels answered right.
    pub fn accuracy(&self) -> Option<f64> {
        self.figures.accuracy().map(|a| a.0)
    }

    /// The weighted mean outcome.
    pub fn mean_outcome(&self) -> Option<f64> {
        self.figures.outcome().map(|o| o.0)
    }
}

/// The one-sided normal quantile for `confidence` (0.9, 0.95 or 0.99).
fn one_sided(confidence: f64) -> f64 {
    FIELD_CONFIDENCE.iter().find(|(c, _)| (c - confidence).abs() < 1e-9).map_or(1.6449, |q| q.1)
}

/// Whether the candidate is worse than stable by more than `drop`, at
/// `confidence`: the one-sided bound of (candidate - stable + drop) is
/// below 0. Each side is (estimate, variance, effective n): for a share,
/// `adjusted` first.
pub fn field_worse(candidate: (f64, f64, f64), stable: (f64, f64, f64), drop: f64, confidence: f64) -> bool {
    let z = one_sided(confidence);
    let [(mc, vc, nc), (ms, vs, ns)] = [candidate, stable];
    let se = (vc / nc + vs / ns).sqrt();
    let d = mc - ms + drop;
    if se == 0.0 { d < 0.0 } else { d / se < -z }
}

/// Agresti-Caffo: a share `p` of `n` as one more success and one more
/// failure: (share, its variance per sample, n).
pub fn adjusted(p: f64, n: f64) -> (f64, f64, f64) {
    let (n, p) = (n + 2.0, (p * n + 1.0) / (n + 2.0));
    (p, p * (1.0 - p), n)
}

/// Fewer effective samples than this get no interval in a report: the
/// normal approximation would call one against one significant. The
/// gates ask at least as many (`min_feedback`).
pub const MIN_FOR_INTERVAL: f64 = 30.0;

/// An estimate with its two-sided interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub estimate: f64,
    pub low: f64,
    pub high: f64,
}

impl Interval {
    /// Whether it excludes 0: a difference significant at its level.
    pub fn excludes_zero(&self) -> bool {
        self.low > 0.0 || self.high < 0.0
    }
}

/// `(estimate, variance, n)` as an interval with the two-sided quantile `z`.
fn interval(estimate: f64, variance_of_estimate: f64, z: f64) -> Interval {
    let half = z * variance_of_estimate.sqrt();
    Interval { estimate, low: estimate - half, high: estimate + half }
}

impl FieldFigures {
    /// The accuracy's interval (Agresti-Coull: z^2 / 2 successes and as
    /// many failures added, the interval round that share, kept within 0
    /// and 1); the estimate is the plain share. None below
    /// `MIN_FOR_INTERVAL` effective samples.
    pub fn accuracy_interval(&self, z: f64) -> Option<Interval> {
        let (p, n) = self.accuracy().filter(|a| a.1 >= MIN_FOR_INTERVAL)?;
        let (n_adj, p_adj) = (n + z * z, (p * n + z * z / 2.0) / (n + z * z));
        let i = interval(p_adj, p_adj * (1.0 - p_adj) / n_adj, z);
        Some(Interval { estimate: p, low: i.low.max(0.0), high: i.high.min(1.0) })
    }

    /// The mean outcome's interval; None below `MIN_FOR_INTERVAL`.
    pub fn outcome_interval(&self, z: f64) -> Option<Interval> {
        let (m, v, n) = self.outcome().filter(|o| o.2 >= MIN_FOR_INTERVAL)?;
        Some(interval(m, v / n, z))
    }

    /// This version's accuracy minus `other`'s (Agresti-Caffo: the
    /// interval round the adjusted difference); the estimate is the plain
    /// one. None while either side is below `MIN_FOR_INTERVAL`.
    pub fn accuracy_difference(&self, other: &FieldFigures, z: f64) -> Option<Interval> {
        let enough = |a: &(f64, f64)| a.1 >= MIN_FOR_INTERVAL;
        let [(p1, n1), (p2, n2)] = [self.accuracy().filter(enough)?, other.accuracy().filter(enough)?];
        let [(a1, v1, m1), (a2, v2, m2)] = [adjusted(p1, n1), adjusted(p2, n2)];
        let mut i = interval(a1 - a2, v1 / m1 + v2 / m2, z);
        i.estimate = p1 - p2;
        Some(i)
    }

    /// This version's mean outcome minus `other`'s (Welch); None while
    /// either side is below `MIN_FOR_INTERVAL`.
    pub fn outcome_difference(&self, other: &FieldFigures, z: f64) -> Option<Interval> {
        let enough = |o: &(f64, f64, f64)| o.2 >= MIN_FOR_INTERVAL;
        let [(m1, v1, n1), (m2, v2, n2)] = [self.outcome().filter(enough)?, other.outcome().filter(enough)?];
        Some(interval(m1 - m2, v1 / n1 + v2 / n2, z))
    }
}

/// The two-sided normal quantile for a confidence `level`.
pub fn two_sided(level: f64) -> Option<f64> {
    [(0.90, 1.6449), (0.95, 1.9600), (0.99, 2.5758)]
        .iter()
        .find(|(l, _)| (l - level).abs() < 1e-9)
        .map(|q| q.1)
}
