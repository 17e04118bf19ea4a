//! Field quality: what devices reported about each version's answers
//! (`engine/feedback.rs` gathers it), the figures a field-quality gate and
//! the status read.

use serde::{Deserialize, Serialize};

/// One version's field figures since the node started (weighted).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FieldQuality {
    pub model: String,
    pub version: String,
    /// Answers recorded for feedback.
    pub answers: u64,
    /// Label feedback joined, and its weight.
    pub labels: u64,
    pub label_weight: f64,
    /// The weight of the labels the answer had right.
    pub correct_weight: f64,
    /// Outcome feedback joined, its weight and weighted sum.
    pub outcomes: u64,
    pub outcome_weight: f64,
    pub outcome_sum: f64,
}

impl FieldQuality {
    /// The weighted share of labels answered right.
    pub fn accuracy(&self) -> Option<f64> {
        (self.label_weight > 0.0).then(|| self.correct_weight / self.label_weight)
    }

    /// The weighted mean outcome.
    pub fn mean_outcome(&self) -> Option<f64> {
        (self.outcome_weight > 0.0).then(|| self.outcome_sum / self.outcome_weight)
    }
}
