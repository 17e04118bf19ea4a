//! `models ab-report`: each version's field quality with intervals, its
//! difference from a baseline (stable) with its interval, and whether that
//! is significant; as text, JSON or one HTML page (`crate::report`).

use super::field::{FieldQuality, Interval, MIN_FOR_INTERVAL, two_sided};
use crate::report::{STYLE, escape, svg_chart};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// Each version's field quality with intervals, and its difference from a
/// baseline version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbReport {
    pub model: String,
    /// The confidence level of every interval.
    pub level: f64,
    /// The version the differences are taken against.
    pub baseline: String,
    pub versions: Vec<AbVersion>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbVersion {
    /// The version; `VERSION+CONFIG` where the version answered with more
    /// than one config (a config rollout, a reload that changed it).
    pub version: String,
    pub answers: u64,
    pub labels: u64,
    /// The share of answers with label feedback.
    pub label_coverage: Option<f64>,
    pub accuracy: Option<Interval>,
    /// This version's accuracy minus the baseline's.
    pub accuracy_difference: Option<Interval>,
    pub outcomes: u64,
    pub outcome_coverage: Option<f64>,
    pub mean_outcome: Option<Interval>,
    pub outcome_difference: Option<Interval>,
}

/// Why there is no report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AbReportError {
    #[error("--level {0}: use 0.9, 0.95 or 0.99")]
    Level(String),
    #[error(
        "no field feedback for {0} on this node since it started: devices send it on PREFIX/feedback \
         or POST /v2/feedback (docs/FEEDBACK.md); a node that is not running has none"
    )]
    NoFeedback(String),
    #[error("version {version} of {model} has no answers here; versions with some: {known}")]
    UnknownBaseline { model: String, version: String, known: String },
}

impl AbReport {
    /// The report of `model` from its versions' field figures, against
    /// `baseline` (a version among them).
    pub fn new(
        model: &str,
        quality: &[FieldQuality],
        baseline: &str,
        level: f64,
    ) -> Result<AbReport, AbReportError> {
        let z = two_sided(level).ok_or_else(|| AbReportError::Level(level.to_string()))?;
        let quality: Vec<&FieldQuality> = quality.iter().filter(|q| q.model == model).collect();
        if quality.is_empty() {
            return Err(AbReportError::NoFeedback(model.into()));
        }
        let labels: Vec<String> = quality.iter().map(|q| arm(q, &quality)).collect();
        let Some(base) = labels.iter().position(|l| l == baseline).map(|at| quality[at]) else {
            let known = labels.join(", ");
            return Err(AbReportError::UnknownBaseline {
                model: model.into(),
                version: baseline.into(),
                known,
            });
        };
        let share = |n: u64, of: u64| (of > 0).then(|| n as f64 / of as f64);
        let versions = quality
            .iter()
            .zip(labels)
            .map(|(q, label)| {
                let (f, b) = (&q.figures, &base.figures);
                let against = label != baseline;
                AbVersion {
                    version: label,
                    answers: q.answers,
                    labels: f.labels,
                    label_coverage: share(f.labels, q.answers),
                    accuracy: f.accuracy_interval(z),
                    accuracy_difference: f.accuracy_difference(b, z).filter(|_| against),
                    outcomes: f.outcomes,
                    outcome_coverage: share(f.outcomes, q.answers),
                    mean_outcome: f.outcome_interval(z),
                    outcome_difference: f.outcome_difference(b, z).filter(|_| against),
                }
            })
            .collect();
        Ok(AbReport { model: model.into(), level, baseline: baseline.into(), versions })
    }
}

/// How a report names `q`: its version, with its config where the version
/// answered with several.
pub fn arm(q: &FieldQuality, all: &[&FieldQuality]) -> String {
    let configs = all.iter().filter(|o| o.model == q.model && o.version == q.version).count();
    match &q.config {
        Some(config) if configs > 1 => format!("{}+{config}", q.version),
        _ => q.version.clone(),
    }
}

impl AbReport {
    /// The report as one self-contained HTML page: a table per kind and a
    /// chart of each version's difference from the baseline with its
    /// interval.
    pub fn html(&self) -> String {
        let mut page = String::with_capacity(32 * 1024);
        let title = format!("edgeinfer models ab-report {}", escape(&self.model));
        let _ = write!(
            page,
            "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>\n\
             <style>{STYLE}</style></head>\n<body>\n<h1>A/B report: {}</h1>\n<p>Field feedback since the node \
             started; intervals at {}; differences against v{}.</p>\n",
            escape(&self.model),
            self.level,
            escape(&self.baseline)
        );
        let kinds: [(&str, &str, Kind); 2] = [
            ("accuracy", "Accuracy (the share of labels answered right)", |v: &AbVersion| {
                (v.labels, v.label_coverage, v.accuracy, v.accuracy_difference)
            }),
            ("outcome", "Mean outcome", |v: &AbVersion| {
                (v.outcomes, v.outcome_coverage, v.mean_outcome, v.outcome_difference)
            }),
        ];
        for (id, heading, kind) in kinds {
            let _ = write!(
                page,
                "<section id=\"{id}\">\n<h2>{heading}</h2>\n<table>\n<tr><th>version</th><th>answers</th>\
                 <th>feedback</th><th>coverage</th><th>estimate [interval]</th><th>vs v{}</th></tr>\n",
                escape(&self.baseline)
            );
            for v in &self.versions {
                let (n, coverage, estimate, difference) = kind(v);
                let _ = writeln!(
                    page,
                    "<tr><td>v{}</td><td>{}</td><td>{n}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    escape(&v.version),
                    v.answers,
                    coverage.map_or("-".into(), |c| format!("{:.1}%", c * 100.0)),
                    estimate.map_or("-".into(), |i| i.text()),
                    difference.map_or("-".into(), |i| format!("{} {}", i.text(), i.verdict())),
                );
            }
            let _ = writeln!(
                page,
                "</table>\n<figure>{}<figcaption>Each version's {id} minus v{}'s, with its interval at {}: \
                 one that does not cross 0 is significant.</figcaption></figure>\n</section>",
                self.difference_svg(heading, kind),
                escape(&self.baseline),
                self.level
            );
        }
        page.push_str("</body></html>\n");
        page
    }

    /// The differences of one kind as a forest plot: a row a version, its
    /// interval as a bar and its estimate as a point, 0 as a line.
    fn difference_svg(&self, heading: &str, kind: Kind) -> String {
        let rows: Vec<(String, Interval)> =
            self.versions.iter().filter_map(|v| Some((format!("v{}", v.version), kind(v).3?))).collect();
        if rows.is_empty() {
            return format!(
                "<p>No difference to chart: the baseline and another version each need {MIN_FOR_INTERVAL} \
                 pieces of feedback of this kind.</p>"
            );
        }
        let reach = rows.iter().map(|(_, i)| i.low.abs().max(i.high.abs())).fold(0.0, f64::max) * 1.2 + 1e-3;
        let height = rows.len() as f64;
        svg_chart(
            &format!("{heading}: difference from v{}", self.baseline),
            -reach..reach,
            -0.5..height - 0.5,
            |chart| {
                let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
                chart
                    .configure_mesh()
                    .x_desc("difference from the baseline")
                    .y_labels(rows.len())
                    .y_label_formatter(&|y| names.get(y.round() as usize).cloned().unwrap_or_default())
                    .draw()?;
                chart
                    .draw_series(LineSeries::new([(0.0, -0.5), (0.0, height - 0.5)], BLACK.mix(0.6)))?
                    .label("no difference")
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.6)));
                for (row, (_, i)) in rows.iter().enumerate() {
                    let y = row as f64;
                    let colour = if i.excludes_zero() { RED } else { BLUE };
                    chart.draw_series(LineSeries::new([(i.low, y), (i.high, y)], colour.stroke_width(3)))?;
                    chart.draw_series([Circle::new((i.estimate, y), 5, colour.filled())])?;
                }
                // The legend's key to the colours.
                for (colour, text) in [(RED, "significant"), (BLUE, "not significant")] {
                    chart.draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?.label(text).legend(
                        move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(3)),
                    );
                }
                Ok(())
            },
        )
    }
}

/// What a table and chart show of a version: the feedback count, its
/// coverage, the estimate and the difference from the baseline.
type Kind = fn(&AbVersion) -> (u64, Option<f64>, Option<Interval>, Option<Interval>);

impl Interval {
    fn text(&self) -> String {
        format!("{:.4} [{:.4}, {:.4}]", self.estimate, self.low, self.high)
    }

    fn verdict(&self) -> &'static str {
        if self.excludes_zero() { "significant" } else { "not significant" }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::field::{FieldFigures, FieldSays, FieldSeen};

    fn quality(version: &str, accepted: f64, right: f64, n: usize, rng: &mut fastrand::Rng) -> FieldQuality {
        let mut figures = FieldFigures::default();
        for _ in 0..n {
            let seen = |says| FieldSeen {
                model: "digits".into(),
                version: version.into(),
                config: String::new(),
                weight: 1.0,
                says,
            };
            figures.record(&seen(FieldSays::Outcome(f64::from(u8::from(rng.f64() < accepted)))));
            figures.record(&seen(FieldSays::Label { correct: rng.f64() < right }));
        }
        FieldQuality {
            model: "digits".into(),
            version: version.into(),
            config: None,
            answers: 2 * n as u64,
            figures,
        }
    }

    /// Over many simulated A/B runs (outcomes accepted 40% against 70%,
    /// labels right 90% on both), the 95% intervals of the differences
    /// contain the true ones about 95% of the time, and the outcome's is
    /// significant in nearly every run, the accuracy's in few.
    #[test]
    fn the_report_intervals_cover_the_true_difference_at_their_level() {
        let mut rng = fastrand::Rng::with_seed(40);
        let (
            runs,
            mut outcome_covered,
            mut accuracy_covered,
            mut outcome_significant,
            mut accuracy_significant,
        ) = (400, 0, 0, 0, 0);
        for _ in 0..runs {
            let figures = [quality("1", 0.7, 0.9, 300, &mut rng), quality("2", 0.4, 0.9, 300, &mut rng)];
            let report = AbReport::new("digits", &figures, "1", 0.95).unwrap();
            let v2 = report.versions.iter().find(|v| v.version == "2").unwrap();
            let (o, a) = (v2.outcome_difference.unwrap(), v2.accuracy_difference.unwrap());
            outcome_covered += usize::from(o.low <= -0.3 && -0.3 <= o.high);
            accuracy_covered += usize::from(a.low <= 0.0 && 0.0 <= a.high);
            outcome_significant += usize::from(o.excludes_zero());
            accuracy_significant += usize::from(a.excludes_zero());
            let v1 = report.versions.iter().find(|v| v.version == "1").unwrap();
            assert!(v1.outcome_difference.is_none() && v1.accuracy_difference.is_none(), "the baseline");
            assert_eq!((v1.label_coverage, v1.outcomes), (Some(0.5), 300));
        }
        let share = |n: usize| n as f64 / runs as f64;
        assert!(
            (0.92..=0.98).contains(&share(outcome_covered)),
            "outcome coverage {}",
            share(outcome_covered)
        );
        assert!(
            (0.92..=0.99).contains(&share(accuracy_covered)),
            "accuracy coverage {}",
            share(accuracy_covered)
        );
        assert!(share(outcome_significant) > 0.99, "{}", share(outcome_significant));
        assert!(share(accuracy_significant) < 0.08, "{}", share(accuracy_significant));
    }

    #[test]
    fn the_page_has_a_table_and_a_chart_a_kind_and_escapes_names() {
        let mut rng = fastrand::Rng::with_seed(3);
        let mut figures = [quality("1", 0.7, 0.9, 200, &mut rng), quality("2<b>", 0.4, 0.9, 200, &mut rng)];
        figures[1].model = "digits".into();
        let page = AbReport::new("digits", &figures, "1", 0.95).unwrap().html();
        assert_eq!(page.matches("<svg").count(), 2, "{page}");
        assert_eq!(page.matches("<tr><td>v").count(), 4, "a row a version and kind");
        assert!(page.contains("v2&lt;b&gt;") && !page.contains("2<b>"), "names escaped");
        if let Ok(path) = std::env::var("EDGEINFER_AB_REPORT_PAGE") {
            std::fs::write(path, &page).unwrap();
        }
    }

    /// Too few to say gives no interval, so one against one is never
    /// "significant"; an all-right version's interval stays within 1; a
    /// node from before the squared weights counts its messages.
    #[test]
    fn small_samples_get_no_interval_and_shares_stay_within_0_and_1() {
        let mut rng = fastrand::Rng::with_seed(9);
        let few = [quality("1", 1.0, 1.0, 1, &mut rng), quality("2", 0.0, 0.0, 1, &mut rng)];
        let report = AbReport::new("digits", &few, "1", 0.95).unwrap();
        let v2 = report.versions.iter().find(|v| v.version == "2").unwrap();
        assert_eq!((v2.outcome_difference, v2.accuracy_difference, v2.mean_outcome), (None, None, None));
        assert!(report.html().contains("No difference to chart"));
        let all_right = [quality("1", 1.0, 1.0, 30, &mut rng)];
        let report = AbReport::new("digits", &all_right, "1", 0.99).unwrap();
        let accuracy = report.versions[0].accuracy.unwrap();
        assert_eq!((accuracy.estimate, accuracy.high), (1.0, 1.0));
        assert!(accuracy.low > 0.75 && accuracy.low < 0.9, "{accuracy:?}");
        let mut old = quality("1", 0.5, 0.9, 40, &mut rng);
        (old.figures.label_weight_sq, old.figures.outcome_weight_sq) = (0.0, 0.0);
        assert_eq!(old.figures.accuracy().map(|a| a.1), Some(40.0));
        assert_eq!(old.figures.outcome().map(|o| o.2), Some(40.0));
    }

    /// A config rollout: one version answering with two configs gives two
    /// rows, named by their configs; a version with one keeps its name.
    #[test]
    fn a_version_answering_with_two_configs_gets_a_row_for_each() {
        let mut rng = fastrand::Rng::with_seed(5);
        let arm = |config: &str, accepted: f64, rng: &mut fastrand::Rng| FieldQuality {
            config: Some(config.into()),
            ..quality("1", accepted, 0.9, 200, rng)
        };
        let other = FieldQuality { config: Some("aaa".into()), ..quality("2", 0.5, 0.9, 200, &mut rng) };
        let figures = [arm("aaa", 0.7, &mut rng), arm("bbb", 0.3, &mut rng), other];
        let report = AbReport::new("digits", &figures, "1+aaa", 0.95).unwrap();
        let names: Vec<&str> = report.versions.iter().map(|v| v.version.as_str()).collect();
        assert_eq!(names, ["1+aaa", "1+bbb", "2"]);
        let candidate = report.versions[1].outcome_difference.unwrap();
        assert!(candidate.high < 0.0, "the lower outcome of config bbb is found: {candidate:?}");
        let err = AbReport::new("digits", &figures, "1", 0.95).unwrap_err().to_string();
        assert!(err.contains("1+aaa, 1+bbb, 2"), "{err}");
    }

    #[test]
    fn a_report_needs_feedback_a_known_baseline_and_a_level_it_has() {
        let mut rng = fastrand::Rng::with_seed(1);
        let figures = [quality("1", 0.5, 0.5, 10, &mut rng)];
        let err = AbReport::new("other", &figures, "1", 0.95).unwrap_err().to_string();
        assert!(err.contains("no field feedback for other"), "{err}");
        let err = AbReport::new("digits", &figures, "7", 0.95).unwrap_err().to_string();
        assert!(err.contains("version 7") && err.contains("with some: 1"), "{err}");
        let err = AbReport::new("digits", &figures, "1", 0.8).unwrap_err().to_string();
        assert!(err.contains("--level 0.8"), "{err}");
    }
}
