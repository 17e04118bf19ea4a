//! `edgeinfer models list|verify|profile|compare`: what is in the models
//! directory, whether it loads, where its time goes, and which to serve.

mod compare;

use anyhow::Result;
use clap::Subcommand;
use edgeinfer::config::Config;
use edgeinfer::model::Registry;
use std::collections::BTreeSet;
use std::sync::Arc;

#[derive(Subcommand)]
pub enum ModelsCommand {
    /// Time each node of a model's optimized plan (tract's evaluation hook)
    /// and list the slowest: where a model's time goes, and whether its
    /// heavy nodes run integer or float kernels.
    Profile {
        /// The model's name.
        model: String,
        /// A version other than the active one.
        #[arg(long)]
        version: Option<String>,
        /// Rows per run; must be one of runtime.batch_sizes.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Timed runs (after one warm-up).
        #[arg(long, default_value_t = 200)]
        iterations: usize,
        /// Nodes listed.
        #[arg(long, default_value_t = 15)]
        top: usize,
    },
    /// List every model version found, loaded or refused (with the reason).
    List,
    /// Put candidates side by side on data: accuracy on its labelled rows
    /// and agreement with a reference model (each row one request through
    /// the engine `serve` runs), latency per request of the model's own work
    /// (p50, p95, p99 of preprocessing and the batch-1 plan), time per row
    /// at the largest batch, load time, file size and kernels; then
    /// recommend the cheapest (lowest p50) that meets --min-accuracy,
    /// --max-p99-ms and --max-agreement-loss. Exits 1 when none does.
    Compare(compare::CompareArgs),
    /// Load every model version as `serve` would: check its sha256, run its
    /// golden vectors through every batch plan, report whether the optimized
    /// plan runs integer or float kernels, and time it. Exits 1 when any
    /// version is refused.
    Verify {
        /// Timed runs per batch size.
        #[arg(long, default_value_t = 200)]
        iterations: usize,
    },
}

pub fn run(config: &Config, command: ModelsCommand) -> Result<i32> {
    let registry = super::load_models(config, false)?;
    match command {
        ModelsCommand::List => list(&registry),
        ModelsCommand::Profile { model, version, batch, iterations, top } => {
            profile(&registry, &model, version.as_deref(), batch, iterations, top)
        }
        ModelsCommand::Verify { iterations } => verify(&registry, iterations),
        ModelsCommand::Compare(args) => compare::run(config, registry, args),
    }
}

fn list(registry: &Registry) -> Result<i32> {
    println!("{:<16} {:<8} {:<6} {:<9} {:<10} STATUS", "MODEL", "VERSION", "QUANT", "KERNELS", "SHA256");
    for m in registry.all() {
        println!(
            "{:<16} {:<8} {:<6} {:<9} {:<10} {}",
            m.name(),
            m.version(),
            m.manifest.quantization.as_str(),
            m.kernels.kind(),
            &m.manifest.sha256[..8],
            if registry.active().any(|a| Arc::ptr_eq(a, m)) { "active" } else { "loaded" }
        );
    }
    for r in &registry.refused {
        println!("{:<60} refused: {}", r.dir.display(), r.error);
    }
    Ok(0)
}

fn profile(
    registry: &Registry,
    model: &str,
    version: Option<&str>,
    batch: usize,
    iterations: usize,
    top: usize,
) -> Result<i32> {
    let m = registry.get(model, version)?;
    let nodes = m.profile(batch, iterations)?;
    let total: f64 = nodes.iter().map(|n| n.per_run.as_secs_f64()).sum();
    println!(
        "{} {}: batch {batch}, {:.1} us per run over {} nodes; kernels: {}; slowest first:",
        m.name(),
        m.version(),
        total * 1e6,
        nodes.len(),
        m.kernels.summary()
    );
    for n in nodes.iter().take(top) {
        let us = n.per_run.as_secs_f64() * 1e6;
        println!("  {us:>9.1} us {:>5.1}%  {:<24} {}", 100.0 * us / (total * 1e6), n.op, n.node);
    }
    Ok(0)
}

fn verify(registry: &Registry, iterations: usize) -> Result<i32> {
    for m in registry.all() {
        let kernels = &m.kernels;
        println!(
            "{} {}: ok  sha256 {}  golden vectors pass at batch {:?}  load {:.1} ms",
            m.name(),
            m.version(),
            m.manifest.sha256,
            m.batch_sizes(),
            m.load_time.as_secs_f64() * 1e3
        );
        println!("  kernels: {}", kernels.summary());
        if m.manifest.quantization.as_str() == "int8" && !kernels.runs_integer() {
            println!("  warning: labelled int8 but the optimized plan runs float kernels");
        }
        for p in &m.passes {
            println!("  load-time pass: {} ({} nodes)", p.pass, p.nodes);
        }
        let mut timings = Vec::new();
        for batch in BTreeSet::from([1, m.max_batch()]) {
            let per_item = m.time_per_item(batch, iterations)?;
            timings.push(format!("batch {batch}: {:.2} us/item", per_item.as_secs_f64() * 1e6));
        }
        println!("  latency: {}", timings.join(", "));
    }
    for r in &registry.refused {
        println!("{}: REFUSED: {}", r.dir.display(), r.error);
    }
    Ok(if registry.refused.is_empty() { 0 } else { 1 })
}
