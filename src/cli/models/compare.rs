//! `edgeinfer models compare`: candidates side by side on labelled rows.
//! Accuracy: each row one request through the engine `serve` runs (its
//! plans, preprocessing and postprocessing). Latency: the same plans timed
//! on this thread, so scheduling noise does not pick the model.

use anyhow::{Context, Result, bail};
use edgeinfer::config::Config;
use edgeinfer::engine::{Cache, Engine, EngineOptions, Envelope};
use edgeinfer::model::compare::{Candidate, Constraints, Labelled, Latency, Recommendation, recommend};
use edgeinfer::model::{LoadedModel, Registry};
use edgeinfer::protocol::{Datatype, InferRequest, TensorData};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct CompareArgs {
    /// Candidates, as NAME (every loaded version) or NAME:VERSION; default:
    /// every loaded version of every model whose input rows have as many
    /// features as the data.
    #[arg(value_name = "NAME[:VERSION]")]
    candidates: Vec<String>,
    /// Labelled rows: a CSV file with the label first, then the features,
    /// one row per line; `#` lines are skipped (models/heldout/digits.csv).
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Passes over the data for the latency figures (each row one run of
    /// the batch-1 plan); the accuracy takes one.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    passes: u32,
    /// Recommend only a candidate at least this accurate on the data (0 to 1).
    #[arg(long, value_name = "FRACTION")]
    min_accuracy: Option<f64>,
    /// Recommend only a candidate whose p99, one request at a time, is at
    /// most this many milliseconds.
    #[arg(long, value_name = "MS")]
    max_p99_ms: Option<f64>,
    /// Print the figures and the recommendation as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    data: String,
    rows: usize,
    passes: u32,
    constraints: Constraints,
    candidates: Vec<Candidate>,
    recommendation: Recommendation,
}

/// Exits 0 with a recommendation, 1 when no candidate meets the constraints.
pub fn run(config: &Config, registry: Registry, args: CompareArgs) -> Result<i32> {
    if let Some(a) = args.min_accuracy
        && !(0.0..=1.0).contains(&a)
    {
        bail!("--min-accuracy {a}: use a fraction from 0 to 1 (0.96 for 96%)");
    }
    if let Some(ms) = args.max_p99_ms
        && (ms.is_nan() || ms <= 0.0)
    {
        bail!("--max-p99-ms {ms}: use a number of milliseconds above 0");
    }
    let data = Labelled::read_csv(&args.data)?;
    let chosen = candidates(&registry, &args.candidates, data.width())?;
    let engine = Engine::new(
        Arc::new(registry),
        // One request in flight: one inference thread per model is what runs it.
        EngineOptions { threads_per_model: 1, ..EngineOptions::from_config(config) },
        Cache::off(),
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut measured = Vec::new();
    for (i, model) in chosen.iter().enumerate() {
        if !args.json {
            eprintln!("[{}/{}] {}:{} ...", i + 1, chosen.len(), model.name(), model.version());
        }
        measured.push(measure(&rt, &engine, model, &data, args.passes)?);
    }
    let constraints = Constraints { min_accuracy: args.min_accuracy, max_p99_ms: args.max_p99_ms };
    let recommendation = recommend(&measured, constraints);
    let found = recommendation.chosen.is_some();
    let report = Report {
        data: args.data.display().to_string(),
        rows: data.labels.len(),
        passes: args.passes,
        constraints,
        candidates: measured,
        recommendation,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(if found { 0 } else { 1 })
}

/// The loaded versions named (or all that take rows of `width` features).
fn candidates(registry: &Registry, named: &[String], width: usize) -> Result<Vec<Arc<LoadedModel>>> {
    let takes_width = |m: &LoadedModel| m.manifest.input.shape.get(1..) == Some(&[width as i64][..]);
    let chosen: Vec<Arc<LoadedModel>> = if named.is_empty() {
        registry.all().filter(|m| takes_width(m)).cloned().collect()
    } else {
        let mut chosen = Vec::new();
        for spec in named {
            let (name, version) = match spec.split_once(':') {
                Some((n, v)) => (n, Some(v)),
                None => (spec.as_str(), None),
            };
            let versions: Vec<_> = registry
                .all()
                .filter(|m| m.name() == name && version.is_none_or(|v| m.version() == v))
                .cloned()
                .collect();
            if versions.is_empty() {
                let loaded: Vec<String> =
                    registry.all().map(|m| format!("{}:{}", m.name(), m.version())).collect();
                bail!("{spec} is not a loaded model version; loaded: {}", loaded.join(", "));
            }
            if let Some(m) = versions.iter().find(|m| !takes_width(m)) {
                bail!(
                    "{}:{} takes input of shape {:?}, not rows of the data's {width} features",
                    m.name(),
                    m.version(),
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

fn measure(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    model: &LoadedModel,
    data: &Labelled,
    passes: u32,
) -> Result<Candidate> {
    let (name, version) = (model.name(), model.version());
    let envelope = || Envelope { version: Some(version), ..Envelope::model(name) };
    let width = data.width();
    // Accuracy: each row one request through the engine, as a device sends it.
    let mut correct = 0usize;
    for (row, label) in data.features.iter().zip(&data.labels) {
        let mut req = InferRequest::single(
            "compare",
            &model.manifest.input.name,
            vec![1, width as i64],
            Datatype::Fp32,
            TensorData::F32(row.clone()),
        );
        req.parameters.cache = Some(false);
        let answer = rt
            .block_on(engine.infer(envelope(), req))
            .map_err(|e| anyhow::anyhow!("{name}:{version} refused a row: {e}"))?;
        let Some(answered) = answer.parameters.label else {
            bail!("{name}:{version} answers no label (not a classification model); compare needs labels");
        };
        correct += usize::from(&answered == label);
    }
    // Latency: the model's own work per request (the manifest's
    // preprocessing and the batch-1 plan) on this thread. The node's hand-off
    // to its inference thread is the same for every candidate and, at tens
    // of microseconds that depend on whether that thread was asleep, would
    // drown the difference between small models.
    let (preprocess, datatype) = (&model.manifest.preprocess, model.manifest.input.datatype);
    let mut samples = Vec::with_capacity(data.labels.len() * passes as usize);
    for _ in 0..passes {
        for row in &data.features {
            let started = Instant::now();
            let input = preprocess
                .apply(TensorData::F32(row.clone()), datatype)
                .map_err(|e| anyhow::anyhow!("{name}:{version}: preprocessing a row: {e}"))?;
            model.run(1, &input).map_err(|e| anyhow::anyhow!("{name}:{version} failed a row: {e}"))?;
            samples.push(started.elapsed());
        }
    }
    let best_batch = model.max_batch();
    let per_row = model
        .time_per_item(best_batch, 200)
        .map_err(|e| anyhow::anyhow!("timing {name}:{version} at batch {best_batch}: {e}"))?;
    let file = model.dir.join(&model.manifest.file);
    let file_bytes = std::fs::metadata(&file).with_context(|| format!("reading {}", file.display()))?.len();
    let quantization = model.manifest.quantization.as_str();
    Ok(Candidate {
        model: name.to_string(),
        version: version.to_string(),
        quantization: quantization.to_string(),
        kernels: model.kernels.kind().to_string(),
        accuracy: correct as f64 / data.labels.len() as f64,
        manifest_accuracy: model.manifest.accuracy.get(quantization).and_then(|v| v.as_float()),
        latency: Latency::of(samples),
        best_batch,
        per_row_us_at_best_batch: per_row.as_secs_f64() * 1e6,
        load_ms: model.load_time.as_secs_f64() * 1e3,
        file_bytes,
    })
}

fn print_table(report: &Report) {
    println!(
        "{} rows of {}, {} pass(es); latency: preprocessing and the batch-1 plan per request",
        report.rows, report.data, report.passes
    );
    println!(
        "{:<20} {:<5} {:<8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>14} {:>8} {:>9}",
        "CANDIDATE",
        "QUANT",
        "KERNELS",
        "ACCURACY",
        "MANIFEST",
        "P50 US",
        "P95 US",
        "P99 US",
        "US/ROW@BATCH",
        "LOAD MS",
        "FILE KB"
    );
    for c in &report.candidates {
        println!(
            "{:<20} {:<5} {:<8} {:>8.4} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>14} {:>8.1} {:>9.1}",
            c.id(),
            c.quantization,
            c.kernels,
            c.accuracy,
            c.manifest_accuracy.map(|a| format!("{a:.4}")).unwrap_or_else(|| "-".into()),
            c.latency.p50_us,
            c.latency.p95_us,
            c.latency.p99_us,
            format!("{:.2}@{}", c.per_row_us_at_best_batch, c.best_batch),
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
