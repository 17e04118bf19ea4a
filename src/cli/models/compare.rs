//! `edgeinfer models compare`: candidates side by side on labelled rows.
//! Accuracy: each row one request through the engine `serve` runs (its
//! plans, preprocessing and postprocessing). Latency: the same plans timed
//! on this thread, so scheduling noise does not pick the model.

use anyhow::{Context, Result, bail};
use edgeinfer::config::Config;
use edgeinfer::engine::{Cache, Engine, EngineOptions, Envelope};
use edgeinfer::model::compare::{
    Candidate, Comparison, Constraints, Latency, Rows, accuracy, agreement, html, recommend, share_text,
    top_k_accuracy,
};
use edgeinfer::model::{LoadedModel, Registry};
use edgeinfer::protocol::{Datatype, InferRequest, TensorData};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct CompareArgs {
    /// Candidates, as NAME (every loaded version) or NAME:VERSION; default:
    /// every loaded version of every model whose input rows have as many
    /// features as the data.
    #[arg(value_name = "NAME[:VERSION]")]
    candidates: Vec<String>,
    /// Rows: a CSV file with the label first (left empty for a row without
    /// one), then the features, one row per line, `#` lines skipped
    /// (models/heldout/digits.csv); a NumPy `.npy` of shape (rows,
    /// features), labelled by --labels; or a node's capture
    /// (`capture.jsonl` in its state directory, `capture.enabled`), each row
    /// labelled with the cloud tier's answer where the cloud gave one.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// With a `.npy` --data: the labels, a `.npy` of one integer per row.
    #[arg(long, value_name = "FILE.npy")]
    labels: Option<PathBuf>,
    /// Also count, for every candidate, the rows it answers as this model
    /// does (NAME or NAME:VERSION, loaded). Default, when no row has a
    /// label: the candidate with the largest model file.
    #[arg(long, value_name = "NAME[:VERSION]")]
    reference: Option<String>,
    /// Passes over the data for the latency figures (each row one run of
    /// the batch-1 plan); the accuracy takes one.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    passes: u32,
    /// Recommend only a candidate at least this accurate on the data (0 to 1).
    #[arg(long, value_name = "FRACTION")]
    min_accuracy: Option<f64>,
    /// Recommend only a candidate whose p99 latency per request is at most
    /// this many milliseconds.
    #[arg(long, value_name = "MS")]
    max_p99_ms: Option<f64>,
    /// Recommend only a candidate that answers at most this share of the
    /// rows (0 to 1) differently from the reference.
    #[arg(long, value_name = "FRACTION")]
    max_agreement_loss: Option<f64>,
    /// Also count the rows whose label is among a candidate's K best answers.
    #[arg(long, value_name = "K", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    top_k: u32,
    /// Print the figures and the recommendation as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write DIR/index.html: one self-contained page (no external
    /// files) with the recommendation, the figures and two charts.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
}

/// How long each throughput figure runs the plan.
const THROUGHPUT_TIME: Duration = Duration::from_millis(500);

/// A progress bar on a terminal; elsewhere (a log, a pipe) a line per
/// candidate, and nothing with --json.
struct Progress {
    bar: Option<ProgressBar>,
    lines: bool,
}

impl Progress {
    fn new(steps: u64, json: bool) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let bar = ProgressBar::new(steps);
            let style =
                ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {percent:>3}% {msg}")
                    .expect("a fixed template");
            bar.set_style(style);
            bar
        });
        Progress { bar, lines: !terminal && !json }
    }

    fn candidate(&self, model: &LoadedModel) {
        match &self.bar {
            Some(bar) => bar.set_message(id(model)),
            None if self.lines => eprintln!("measuring {} ...", id(model)),
            None => {}
        }
    }

    fn step(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Exits 0 with a recommendation, 1 when no candidate meets the constraints.
pub fn run(config: &Config, registry: Registry, args: CompareArgs) -> Result<i32> {
    for (flag, share) in
        [("--min-accuracy", args.min_accuracy), ("--max-agreement-loss", args.max_agreement_loss)]
    {
        if let Some(a) = share
            && !(0.0..=1.0).contains(&a)
        {
            bail!("{flag} {a}: use a fraction from 0 to 1 (0.96 for 96%)");
        }
    }
    if let Some(ms) = args.max_p99_ms
        && (ms.is_nan() || ms <= 0.0)
    {
        bail!("--max-p99-ms {ms}: use a number of milliseconds above 0");
    }
    let data = Rows::read(&args.data, args.labels.as_deref())?;
    if data.labelled() == 0 && args.min_accuracy.is_some() {
        bail!(
            "{} has no labels, so --min-accuracy cannot be judged; use --max-agreement-loss, against \
             --reference (default: the largest candidate)",
            args.data.display()
        );
    }
    let chosen = candidates(&registry, &args.candidates, data.width())?;
    let reference = match &args.reference {
        Some(spec) => Some(one_version(&registry, spec, data.width())?),
        None if data.labelled() == 0 => chosen.iter().max_by_key(|m| file_bytes(m).unwrap_or(0)).cloned(),
        None => None,
    };
    if reference.is_none() && args.max_agreement_loss.is_some() {
        bail!("--max-agreement-loss needs a reference model: name one with --reference");
    }
    let engine = Engine::new(
        Arc::new(registry),
        // One request in flight: one inference thread per model is what runs it.
        EngineOptions { threads_per_model: 1, ..EngineOptions::from_config(config) },
        Cache::off(),
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let reference_apart = reference.as_ref().is_some_and(|r| !chosen.iter().any(|m| Arc::ptr_eq(m, r)));
    let rows = data.features.len() as u64;
    let steps =
        chosen.len() as u64 * (rows * (1 + args.passes as u64) + 2) + u64::from(reference_apart) * rows;
    let progress = Progress::new(steps, args.json);
    let top_k = args.top_k as usize;
    let mut measured = Vec::new();
    let mut answered = Vec::new();
    for model in &chosen {
        progress.candidate(model);
        let (labels, top) = answers(&rt, &engine, model, &data, top_k, &progress)?;
        let mut candidate = measure(model, &data, args.passes, &progress)?;
        candidate.accuracy = accuracy(&labels, &data.labels);
        (candidate.top_k, candidate.top_k_accuracy) = (top_k, top_k_accuracy(&top, &data.labels));
        measured.push(candidate);
        answered.push(labels);
    }
    if let Some(reference) = &reference {
        // The default reference is a candidate: its answers are in hand.
        let theirs = match chosen.iter().position(|m| Arc::ptr_eq(m, reference)) {
            Some(i) => answered[i].clone(),
            None => {
                progress.candidate(reference);
                answers(&rt, &engine, reference, &data, top_k, &progress)?.0
            }
        };
        for (candidate, ours) in measured.iter_mut().zip(&answered) {
            candidate.agreement = Some(agreement(ours, &theirs));
        }
    }
    let constraints = Constraints {
        min_accuracy: args.min_accuracy,
        max_p99_ms: args.max_p99_ms,
        max_agreement_loss: args.max_agreement_loss,
    };
    progress.finish();
    let recommendation = recommend(&measured, constraints);
    let found = recommendation.chosen.is_some();
    let comparison = Comparison {
        data: args.data.display().to_string(),
        rows: data.labels.len(),
        labelled_rows: data.labelled(),
        reference: reference.as_deref().map(id),
        passes: args.passes,
        constraints,
        candidates: measured,
        recommendation,
    };
    if let Some(dir) = &args.report {
        std::fs::create_dir_all(dir).with_context(|| format!("--report {}: creating it", dir.display()))?;
        let page = dir.join("index.html");
        std::fs::write(&page, html(&comparison)).with_context(|| format!("writing {}", page.display()))?;
        if !args.json {
            eprintln!("report: {}", page.display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print_table(&comparison);
    }
    Ok(if found { 0 } else { 1 })
}

/// The loaded versions named (or all that take rows of `width` features).
fn candidates(registry: &Registry, named: &[String], width: usize) -> Result<Vec<Arc<LoadedModel>>> {
    let chosen: Vec<Arc<LoadedModel>> = if named.is_empty() {
        registry.all().filter(|m| takes_rows_of(m, width)).cloned().collect()
    } else {
        let mut chosen = Vec::new();
        for spec in named {
            let (name, version) = name_and_version(spec);
            let versions: Vec<_> = registry
                .all()
                .filter(|m| m.name() == name && version.is_none_or(|v| m.version() == v))
                .cloned()
                .collect();
            if versions.is_empty() {
                let loaded: Vec<String> = registry.all().map(|m| id(m)).collect();
                bail!("{spec} is not a loaded model version; loaded: {}", loaded.join(", "));
            }
            if let Some(m) = versions.iter().find(|m| !takes_rows_of(m, width)) {
                bail!(
                    "{} takes input of shape {:?}, not rows of the data's {width} features",
                    id(m),
                    m.manifest.input.shape
                );
            }
            chosen.extend(versions);
        }
        chosen
    };
    if chosen.is_empty() {
        bail!("no loaded model takes rows of {width} features (the data's width); name the candidates");
    }
    Ok(chosen)
}

/// One loaded version, `NAME` (the newest) or `NAME:VERSION`, taking rows of `width`.
fn one_version(registry: &Registry, spec: &str, width: usize) -> Result<Arc<LoadedModel>> {
    let (name, version) = name_and_version(spec);
    let model = registry.get(name, version).map_err(|e| anyhow::anyhow!("--reference {spec}: {e}"))?;
    if !takes_rows_of(&model, width) {
        bail!(
            "--reference {spec} takes input of shape {:?}, not rows of {width} features",
            model.manifest.input.shape
        );
    }
    Ok(model)
}

/// `NAME:VERSION` as its two parts; a bare `NAME` has no version.
fn name_and_version(spec: &str) -> (&str, Option<&str>) {
    match spec.split_once(':') {
        Some((name, version)) => (name, Some(version)),
        None => (spec, None),
    }
}

/// Whether the model's input is rows of `width` features.
fn takes_rows_of(model: &LoadedModel, width: usize) -> bool {
    model.manifest.input.shape.get(1..) == Some(&[width as i64][..])
}

/// `name:version`, as the report names a candidate.
fn id(model: &LoadedModel) -> String {
    format!("{}:{}", model.name(), model.version())
}

fn file_bytes(model: &LoadedModel) -> Result<u64> {
    let file = model.dir.join(&model.manifest.file);
    Ok(std::fs::metadata(&file).with_context(|| format!("reading {}", file.display()))?.len())
}

/// The label `model` gives each row, and its `top_k` best, each row one
/// request through the engine, as a device sends it.
fn answers(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    model: &LoadedModel,
    data: &Rows,
    top_k: usize,
    progress: &Progress,
) -> Result<(Vec<String>, Vec<Vec<String>>)> {
    let (name, version) = (model.name(), model.version());
    let width = data.width();
    let mut labels = Vec::with_capacity(data.features.len());
    let mut tops = Vec::with_capacity(data.features.len());
    for row in &data.features {
        let mut req = InferRequest::single(
            "compare",
            &model.manifest.input.name,
            vec![1, width as i64],
            Datatype::Fp32,
            TensorData::F32(row.clone()),
        );
        req.parameters.cache = Some(false);
        req.parameters.top_k = Some(top_k as u32);
        let envelope = Envelope { version: Some(version), ..Envelope::model(name) };
        let answer = rt
            .block_on(engine.infer(envelope, req))
            .map_err(|e| anyhow::anyhow!("{name}:{version} refused a row: {e}"))?;
        let Some(label) = answer.parameters.label else {
            bail!("{name}:{version} answers no label (not a classification model); compare needs labels");
        };
        labels.push(label);
        tops.push(answer.parameters.top_k.unwrap_or_default().into_iter().map(|t| t.label).collect());
        progress.step();
    }
    Ok((labels, tops))
}

/// Everything but the answers: latency, batch cost, load time, size.
fn measure(model: &LoadedModel, data: &Rows, passes: u32, progress: &Progress) -> Result<Candidate> {
    // The peak from here on is this candidate's (where the kernel allows).
    let peak_is_ours = edgeinfer::telemetry::reset_peak_resident();
    let (name, version) = (model.name(), model.version());
    // Latency: the model's own work per request (the manifest's
    // preprocessing and the batch-1 plan) on this thread. The node's hand-off
    // to its inference thread is the same for every candidate and, at tens
    // of microseconds that depend on whether that thread was asleep, would
    // drown the difference between small models.
    let (preprocess, datatype) = (&model.manifest.preprocess, model.manifest.input.datatype);
    let mut samples = Vec::with_capacity(data.features.len() * passes as usize);
    for _ in 0..passes {
        for row in &data.features {
            let started = Instant::now();
            let input = preprocess
                .apply(TensorData::F32(row.clone()), datatype)
                .map_err(|e| anyhow::anyhow!("{name}:{version}: preprocessing a row: {e}"))?;
            model.run(1, &input).map_err(|e| anyhow::anyhow!("{name}:{version} failed a row: {e}"))?;
            samples.push(started.elapsed());
            progress.step();
        }
    }
    let best_batch = model.max_batch();
    let per_row = model
        .time_per_item(best_batch, 200)
        .map_err(|e| anyhow::anyhow!("timing {name}:{version} at batch {best_batch}: {e}"))?;
    let saturate = |threads| {
        let rows = model
            .rows_per_second(best_batch, threads, THROUGHPUT_TIME)
            .map_err(|e| anyhow::anyhow!("timing {name}:{version} on {threads} thread(s): {e}"));
        progress.step();
        rows
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (rows_per_s_one_thread, rows_per_s_all_threads) = (saturate(1)?, saturate(threads)?);
    let quantization = model.manifest.quantization.as_str();
    Ok(Candidate {
        model: name.to_string(),
        version: version.to_string(),
        quantization: quantization.to_string(),
        kernels: model.kernels.kind().to_string(),
        accuracy: None,
        top_k: 0,
        top_k_accuracy: None,
        manifest_accuracy: model.manifest.accuracy.get(quantization).and_then(|v| v.as_float()),
        agreement: None,
        latency: Latency::of(samples),
        best_batch,
        per_row_us_at_best_batch: per_row.as_secs_f64() * 1e6,
        rows_per_s_one_thread,
        rows_per_s_all_threads,
        threads,
        peak_rss_bytes: edgeinfer::telemetry::peak_resident_bytes().filter(|_| peak_is_ours),
        load_ms: model.load_time.as_secs_f64() * 1e3,
        file_bytes: file_bytes(model)?,
    })
}

fn print_table(report: &Comparison) {
    println!(
        "{} rows of {} ({} labelled), {} pass(es); latency: preprocessing and the batch-1 plan per request",
        report.rows, report.data, report.labelled_rows, report.passes
    );
    if let Some(reference) = &report.reference {
        println!("agreement: the share of rows answered as {reference} answers them");
    }
    let top_k = report.candidates.first().map_or(0, |c| c.top_k);
    println!(
        "{:<20} {:<5} {:<8} {:>8} {:>8} {:>8} {:>8}",
        "CANDIDATE",
        "QUANT",
        "KERNELS",
        "ACCURACY",
        format!("TOP-{top_k}"),
        "MANIFEST",
        "AGREE"
    );
    for c in &report.candidates {
        println!(
            "{:<20} {:<5} {:<8} {:>8} {:>8} {:>8} {:>8}",
            c.id(),
            c.quantization,
            c.kernels,
            share_text(c.accuracy),
            share_text(c.top_k_accuracy),
            share_text(c.manifest_accuracy),
            share_text(c.agreement)
        );
    }
    let threads = report.candidates.first().map_or(1, |c| c.threads);
    println!(
        "{:<20} {:>8} {:>8} {:>8} {:>13} {:>11} {:>11} {:>8} {:>7} {:>8}",
        "",
        "P50 US",
        "P95 US",
        "P99 US",
        "US/ROW@BATCH",
        "ROWS/S 1T",
        format!("ROWS/S {threads}T"),
        "PEAK MIB",
        "LOAD MS",
        "FILE KB"
    );
    for c in &report.candidates {
        println!(
            "{:<20} {:>8.1} {:>8.1} {:>8.1} {:>13} {:>11.0} {:>11.0} {:>8} {:>7.1} {:>8.1}",
            c.id(),
            c.latency.p50_us,
            c.latency.p95_us,
            c.latency.p99_us,
            format!("{:.2}@{}", c.per_row_us_at_best_batch, c.best_batch),
            c.rows_per_s_one_thread,
            c.rows_per_s_all_threads,
            c.peak_rss_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / (1 << 20) as f64)),
            c.load_ms,
            c.file_bytes as f64 / 1024.0
        );
    }
    let r = &report.recommendation;
    match &r.chosen {
        Some(chosen) => println!("recommended: {chosen}: {}", r.why),
        None => println!("no recommendation: {}", r.why),
    }
    for (id, reason) in &r.rejected {
        println!("  not {id}: {reason}");
    }
}
