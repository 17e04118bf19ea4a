//! `edgeinfer models ab-report NAME`: each version's answers, feedback
//! coverage, field accuracy and mean outcome with intervals, and each one's
//! difference from the baseline (stable) with its interval, read from the
//! running node's field figures (feedback since it started).

use super::deploy::Target;
use anyhow::{Context, Result};
use clap::Args;
use edgeinfer::config::Config;
use edgeinfer::rollout::ab_report::AbReport;
use edgeinfer::rollout::field::Interval;

#[derive(Args)]
pub struct AbReportArgs {
    /// The model.
    pub model: String,
    /// The confidence level of the intervals: 0.9, 0.95 or 0.99. A
    /// difference whose interval excludes 0 is significant at it.
    #[arg(long, default_value_t = 0.95)]
    pub level: f64,
    /// The version the others are compared with; default the stable one
    /// (the one serving, with its config). Where a version answered with
    /// several configs (a config rollout), its rows are VERSION+CONFIG.
    #[arg(long)]
    pub baseline: Option<String>,
    /// Also write DIR/index.html: one self-contained page (no external
    /// files) with the tables and a chart of each version's differences.
    #[arg(long, value_name = "DIR")]
    pub report: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub target: Target,
}

pub fn run(config: &Config, args: AbReportArgs) -> Result<i32> {
    let (reports, source) = super::deploy::reports(config, &args.target, Some(&args.model))?;
    let Some(m) = reports.iter().find(|r| r.model == args.model) else {
        anyhow::bail!("the {source} has no model {}", args.model);
    };
    // Stable's answers; with its config named where the version answered
    // with several (a config rollout).
    let quality: Vec<_> = m.field_quality.iter().collect();
    let stable = quality
        .iter()
        .find(|q| q.version == m.serving && q.config.as_ref() == m.config.as_ref().map(|c| &c.version));
    let named = stable.map(|q| edgeinfer::rollout::ab_report::arm(q, &quality));
    let baseline = args.baseline.clone().or(named).unwrap_or_else(|| m.serving.clone());
    let report = AbReport::new(&args.model, &m.field_quality, &baseline, args.level)?;
    if let Some(dir) = &args.report {
        std::fs::create_dir_all(dir).with_context(|| format!("--report {}: creating it", dir.display()))?;
        let page = dir.join("index.html");
        std::fs::write(&page, report.html()).with_context(|| format!("writing {}", page.display()))?;
        eprintln!("report: {}", page.display());
    }
    if args.target.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(0);
    }
    print(&report, &source.to_string());
    Ok(0)
}

fn print(report: &AbReport, source: &str) {
    println!(
        "field quality of {} on the {source}, since it started; intervals at {}, differences against v{}",
        report.model, report.level, report.baseline
    );
    let share = |s: Option<f64>| s.map_or("-".into(), |s| format!("{:.1}%", s * 100.0));
    let interval = |i: Option<Interval>| {
        i.map_or("-".into(), |i| format!("{:.4} [{:.4}, {:.4}]", i.estimate, i.low, i.high))
    };
    let difference = |i: Option<Interval>| {
        i.map_or("-".into(), |i| {
            let verdict = if i.excludes_zero() { "significant" } else { "not significant" };
            format!("{:+.4} [{:+.4}, {:+.4}] {verdict}", i.estimate, i.low, i.high)
        })
    };
    for v in &report.versions {
        println!("  v{}: {} answers", v.version, v.answers);
        println!(
            "    accuracy      {} ({} labels, {} of answers); vs v{}: {}",
            interval(v.accuracy),
            v.labels,
            share(v.label_coverage),
            report.baseline,
            difference(v.accuracy_difference)
        );
        println!(
            "    mean outcome  {} ({} outcomes, {} of answers); vs v{}: {}",
            interval(v.mean_outcome),
            v.outcomes,
            share(v.outcome_coverage),
            report.baseline,
            difference(v.outcome_difference)
        );
    }
}
