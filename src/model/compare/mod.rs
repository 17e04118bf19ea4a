//! Choosing between model candidates (`edgeinfer models compare`): the
//! rows they are judged on (labelled, or not: then against a reference
//! model), the figures kept per candidate, and the recommendation: the
//! cheapest candidate that meets every constraint, with the reason each
//! other one was not chosen. The measuring itself runs the node's engine
//! and lives with the command.

mod report;
mod rows;

pub use report::html;
pub use rows::{Captured, DataError, Rows};
use serde::Serialize;
use std::time::Duration;

/// The share of the labelled rows `answers` got right; `None` without labels.
pub fn accuracy(answers: &[String], labels: &[Option<String>]) -> Option<f64> {
    let judged: Vec<bool> =
        answers.iter().zip(labels).filter_map(|(a, l)| l.as_ref().map(|l| a == l)).collect();
    (!judged.is_empty()).then(|| judged.iter().filter(|&&ok| ok).count() as f64 / judged.len() as f64)
}

/// A share to four places, or `-` where there is none.
pub fn share_text(share: Option<f64>) -> String {
    share.map(|s| format!("{s:.4}")).unwrap_or_else(|| "-".into())
}

/// The share of the labelled rows whose label is among the candidate's
/// best answers (`top`, per row); `None` without labels.
pub fn top_k_accuracy(top: &[Vec<String>], labels: &[Option<String>]) -> Option<f64> {
    let judged: Vec<bool> =
        top.iter().zip(labels).filter_map(|(t, l)| l.as_ref().map(|l| t.contains(l))).collect();
    (!judged.is_empty()).then(|| judged.iter().filter(|&&ok| ok).count() as f64 / judged.len() as f64)
}

/// The share of rows on which two candidates gave the same answer.
pub fn agreement(answers: &[String], reference: &[String]) -> f64 {
    let same = answers.iter().zip(reference).filter(|(a, r)| a == r).count();
    same as f64 / answers.len().max(1) as f64
}

/// The value at quantile `q` (0..=1) of `sorted`, by nearest rank.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Latency per request, in microseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Latency {
    pub p50_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    /// The value at each whole percent, 1 to 100: the distribution the
    /// report draws.
    pub percentiles_us: Vec<f64>,
}

impl Latency {
    pub fn of(mut samples: Vec<Duration>) -> Latency {
        samples.sort_unstable();
        let us = |q| percentile(&samples, q).as_secs_f64() * 1e6;
        Latency {
            p50_us: us(0.50),
            p95_us: us(0.95),
            p99_us: us(0.99),
            percentiles_us: (1..=100).map(|p| us(p as f64 / 100.0)).collect(),
        }
    }
}

/// Everything `models compare` found: what `--json` prints and the
/// report shows.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub data: String,
    pub rows: usize,
    pub labelled_rows: usize,
    /// `model:version` the agreement is measured against.
    pub reference: Option<String>,
    pub passes: u32,
    pub constraints: Constraints,
    pub candidates: Vec<Candidate>,
    pub recommendation: Recommendation,
}

/// What was measured of one candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub model: String,
    pub version: String,
    pub quantization: String,
    /// `integer`, `float` or `mixed` kernels in the optimized plan.
    pub kernels: String,
    /// Rows answered with the file's label, of the labelled rows.
    pub accuracy: Option<f64>,
    /// Rows whose label is among the candidate's `top_k` best answers.
    pub top_k: usize,
    pub top_k_accuracy: Option<f64>,
    /// The accuracy the producing script wrote into the manifest, if any.
    pub manifest_accuracy: Option<f64>,
    /// Rows answered as the reference model answered them, when there is one.
    pub agreement: Option<f64>,
    /// The model's own work per request: preprocessing and the batch-1 plan.
    pub latency: Latency,
    /// The largest planned batch size and the time per row there, on one thread.
    pub best_batch: usize,
    pub per_row_us_at_best_batch: f64,
    /// Throughput at saturation at the best batch, in process: one thread,
    /// and `threads` (every core) running the plan at once.
    pub rows_per_s_one_thread: f64,
    pub rows_per_s_all_threads: f64,
    pub threads: usize,
    /// The most this process had resident while the candidate was measured
    /// (every candidate is loaded throughout).
    pub peak_rss_bytes: Option<u64>,
    pub load_ms: f64,
    pub file_bytes: u64,
}

impl Candidate {
    pub fn id(&self) -> String {
        format!("{}:{}", self.model, self.version)
    }
}

/// What the chosen candidate must meet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Constraints {
    pub min_accuracy: Option<f64>,
    pub max_p99_ms: Option<f64>,
    /// Most share of rows a candidate may answer differently from the reference.
    pub max_agreement_loss: Option<f64>,
}

/// The choice and the reasons.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recommendation {
    /// `model:version` of the cheapest candidate meeting every constraint.
    pub chosen: Option<String>,
    pub why: String,
    /// `model:version` and why it was not chosen, for every other candidate.
    pub rejected: Vec<(String, String)>,
}

/// The cheapest candidate (lowest p50 latency per request; on a tie,
/// the smaller file, then the name) that meets every constraint.
pub fn recommend(candidates: &[Candidate], constraints: Constraints) -> Recommendation {
    let failures = |c: &Candidate| {
        let mut failed = Vec::new();
        if let Some(min) = constraints.min_accuracy {
            match c.accuracy {
                Some(a) if a < min => failed.push(format!("accuracy {a:.4} is below --min-accuracy {min}")),
                Some(_) => {}
                None => failed.push("no labelled rows to measure its accuracy on".into()),
            }
        }
        if let Some(max) = constraints.max_agreement_loss {
            match c.agreement {
                Some(a) if 1.0 - a > max => failed.push(format!(
                    "answers {:.4} of the rows unlike the reference, more than --max-agreement-loss {max}",
                    1.0 - a
                )),
                Some(_) => {}
                None => failed.push("no reference to measure its agreement against".into()),
            }
        }
        if let Some(max) = constraints.max_p99_ms
            && c.latency.p99_us / 1e3 > max
        {
            failed.push(format!("p99 {:.3} ms is above --max-p99-ms {max}", c.latency.p99_us / 1e3));
        }
        failed
    };
    let mut order: Vec<&Candidate> = candidates.iter().collect();
    order.sort_by(|a, b| {
        a.latency
            .p50_us
            .total_cmp(&b.latency.p50_us)
            .then(a.file_bytes.cmp(&b.file_bytes))
            .then_with(|| a.id().cmp(&b.id()))
    });
    let judged: Vec<(&Candidate, Vec<String>)> = order.into_iter().map(|c| (c, failures(c))).collect();
    let chosen = judged.iter().find(|(_, failed)| failed.is_empty()).map(|&(c, _)| c);
    let rejected = judged
        .iter()
        .filter_map(|(c, failed)| match chosen {
            Some(chosen) if std::ptr::eq(*c, chosen) => None,
            Some(chosen) if failed.is_empty() => Some((
                c.id(),
                format!(
                    "meets the constraints but costs more: p50 {:.1} us against {:.1} us",
                    c.latency.p50_us, chosen.latency.p50_us
                ),
            )),
            _ => Some((c.id(), failed.join("; "))),
        })
        .collect();
    let why = match chosen {
        Some(c) if constraints == Constraints::default() => {
            format!("the fastest (p50 {:.1} us); no constraint was given", c.latency.p50_us)
        }
        Some(c) => {
            let quality = [("accuracy", c.accuracy), ("agreement", c.agreement)]
                .into_iter()
                .filter_map(|(name, share)| share.map(|s| format!("{name} {s:.4}, ")))
                .collect::<String>();
            format!(
                "the fastest that meets every constraint: {quality}p50 {:.1} us, p99 {:.1} us",
                c.latency.p50_us, c.latency.p99_us
            )
        }
        None => "no candidate meets every constraint; relax them or add a candidate".into(),
    };
    Recommendation { chosen: chosen.map(Candidate::id), why, rejected }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(model: &str, accuracy: f64, p50_us: f64, p99_us: f64, file_bytes: u64) -> Candidate {
        Candidate {
            model: model.into(),
            version: "1".into(),
            quantization: "int8".into(),
            kernels: "integer".into(),
            accuracy: Some(accuracy),
            top_k: 3,
            top_k_accuracy: None,
            manifest_accuracy: None,
            agreement: None,
            latency: Latency { p50_us, p95_us: p99_us, p99_us, percentiles_us: vec![p50_us, p99_us] },
            best_batch: 32,
            per_row_us_at_best_batch: 1.0,
            rows_per_s_one_thread: 1e6,
            rows_per_s_all_threads: 2e6,
            threads: 2,
            peak_rss_bytes: None,
            load_ms: 1.0,
            file_bytes,
        }
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile(&samples, 0.50), Duration::from_micros(50));
        assert_eq!(percentile(&samples, 0.99), Duration::from_micros(99));
        assert_eq!(percentile(&samples, 1.0), Duration::from_micros(100));
        assert_eq!(percentile(&samples, 0.0), Duration::from_micros(1));
        assert_eq!(percentile(&[Duration::from_micros(7)], 0.95), Duration::from_micros(7));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
        let l = Latency::of(vec![
            Duration::from_micros(30),
            Duration::from_micros(10),
            Duration::from_micros(20),
        ]);
        assert_eq!((l.p50_us, l.p99_us), (20.0, 30.0));
    }

    #[test]
    fn the_cheapest_candidate_meeting_every_constraint_is_chosen() {
        let small = candidate("small", 0.95, 10.0, 20.0, 1000);
        let mid = candidate("mid", 0.97, 20.0, 40.0, 2000);
        let large = candidate("large", 0.99, 50.0, 900.0, 9000);
        let all = [large.clone(), small.clone(), mid.clone()];
        let r = recommend(&all, Constraints { min_accuracy: Some(0.96), ..Default::default() });
        assert_eq!(r.chosen.as_deref(), Some("mid:1"), "{r:?}");
        assert!(r.why.contains("accuracy 0.9700"), "{}", r.why);
        let reasons: std::collections::HashMap<_, _> = r.rejected.into_iter().collect();
        assert!(reasons["small:1"].contains("below --min-accuracy 0.96"), "{reasons:?}");
        assert!(reasons["large:1"].contains("costs more"), "{reasons:?}");
        // Both constraints: the accurate one is too slow in its tail.
        let r = recommend(
            &all,
            Constraints { min_accuracy: Some(0.98), max_p99_ms: Some(0.5), max_agreement_loss: None },
        );
        assert_eq!(r.chosen, None);
        assert!(r.why.contains("no candidate meets"), "{}", r.why);
        assert_eq!(r.rejected.len(), 3);
        let reasons: std::collections::HashMap<_, _> = r.rejected.into_iter().collect();
        assert!(reasons["large:1"].contains("above --max-p99-ms 0.5"), "{reasons:?}");
        // No constraint: the fastest.
        let r = recommend(&all, Constraints::default());
        assert_eq!(r.chosen.as_deref(), Some("small:1"));
    }

    #[test]
    fn ties_go_to_the_smaller_file_then_the_name() {
        let a = candidate("a", 0.97, 10.0, 20.0, 5000);
        let b = candidate("b", 0.97, 10.0, 20.0, 1000);
        let c = candidate("c", 0.97, 10.0, 20.0, 1000);
        let r = recommend(&[a, c, b], Constraints { min_accuracy: Some(0.9), ..Default::default() });
        assert_eq!(r.chosen.as_deref(), Some("b:1"));
        assert_eq!(r.rejected.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["c:1", "a:1"]);
    }

    #[test]
    fn without_labels_candidates_are_judged_against_the_reference() {
        let answers = |s: &str| s.chars().map(String::from).collect::<Vec<_>>();
        let reference = answers("0123456789");
        assert_eq!(agreement(&answers("0123456789"), &reference), 1.0);
        assert_eq!(agreement(&answers("0123456700"), &reference), 0.8);
        let labels = vec![Some("0".to_string()), None, Some("9".to_string())];
        assert_eq!(accuracy(&answers("019"), &labels), Some(1.0));
        assert_eq!(accuracy(&answers("010"), &labels), Some(0.5));
        assert_eq!(accuracy(&answers("01"), &[None, None]), None);
        let top = |s: &[&str]| s.iter().map(|t| answers(t)).collect::<Vec<_>>();
        assert_eq!(top_k_accuracy(&top(&["01", "23", "98"]), &labels), Some(1.0));
        assert_eq!(top_k_accuracy(&top(&["12", "23", "87"]), &labels), Some(0.0));

        let mut close = candidate("close", 0.0, 10.0, 20.0, 1000);
        let mut far = candidate("far", 0.0, 5.0, 20.0, 1000);
        let mut reference = candidate("reference", 0.0, 50.0, 90.0, 9000);
        for (c, agreed) in [(&mut close, 0.97), (&mut far, 0.80), (&mut reference, 1.0)] {
            c.accuracy = None;
            c.agreement = Some(agreed);
        }
        let all = [far, close, reference];
        let r = recommend(&all, Constraints { max_agreement_loss: Some(0.05), ..Default::default() });
        assert_eq!(r.chosen.as_deref(), Some("close:1"), "{r:?}");
        assert!(r.why.contains("agreement 0.9700"), "{}", r.why);
        let reasons: std::collections::HashMap<_, _> = r.rejected.into_iter().collect();
        assert!(reasons["far:1"].contains("0.2000 of the rows unlike the reference"), "{reasons:?}");
        // Asking for accuracy without labels rejects every candidate, saying why.
        let r = recommend(&all, Constraints { min_accuracy: Some(0.9), ..Default::default() });
        assert_eq!(r.chosen, None);
        assert!(r.rejected.iter().all(|(_, why)| why.contains("no labelled rows")), "{r:?}");
    }
}
