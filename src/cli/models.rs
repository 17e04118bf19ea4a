//! `edgeinfer models list|verify|profile|compare|status|ab-report|promote|rollback|rollout`:
//! what is in the models directory, whether it loads, where its time goes,
//! which to serve, and which version serves.

mod ab_report;
mod compare;
mod deploy;

use anyhow::Result;
use clap::Subcommand;
use edgeinfer::admin::Change;
use edgeinfer::config::Config;
use edgeinfer::model::Registry;
use std::collections::BTreeSet;
use std::sync::Arc;

#[derive(Subcommand)]
pub enum ModelsCommand {
    /// Time each node of a model's optimized plan (tract's evaluation hook)
    /// and list the slowest: where a model's time goes, and whether its
    /// heavy nodes run integer or float kernels. An integer layer's row ends
    /// with the kernel chosen for it, its time at load and the runner-up's.
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
    /// A/B report from the field: per version, the answers since the node
    /// started, how many got label or outcome feedback, the accuracy and
    /// mean outcome with intervals, and each version's difference from the
    /// baseline (stable) with its interval and whether it is significant at
    /// --level (two-proportion Agresti-Caffo for accuracy, Welch for the
    /// outcome; docs/FEEDBACK.md). Asks the running
    /// node as `models status` does.
    #[command(name = "ab-report")]
    AbReport(ab_report::AbReportArgs),
    /// Which version of each model serves (the stable one the deployment
    /// state pins, or the newest), what a rollback would return to, the
    /// versions there are and the last decisions. Asks the running node
    /// (admin routes on http.listen: loopback, or http.admin_token_file's
    /// token), or with --via-mqtt its control topic (a command signed with
    /// control.key_file's key); with no node running, reads node.state_dir
    /// and the models directory.
    Status {
        /// Only this model.
        model: Option<String>,
        #[command(flatten)]
        target: deploy::Target,
    },
    /// Make a version the stable one: it answers every request that names
    /// no version, at once, with nothing reloaded; the one it replaces is
    /// what `models rollback` returns to. Written to node.state_dir before
    /// it takes effect, so it holds across restarts. A running node takes it
    /// only with http.admin_token_file's token (sent from --config), or
    /// signed with control.key_file's key on its control topic (--via-mqtt);
    /// with no node running, the state file is changed directly.
    Promote {
        /// The model's name.
        model: String,
        /// The version; default: the newest loaded.
        version: Option<String>,
        #[command(flatten)]
        target: deploy::Target,
    },
    /// Return a model to the stable version before the current one (without
    /// any deployment state yet: the next older version), at once. A newer
    /// version on disk then waits for `models promote`. Needs the admin
    /// token as `promote` does.
    Rollback {
        /// The model's name.
        model: String,
        #[command(flatten)]
        target: deploy::Target,
    },
    /// Try a version on part of the traffic before it serves everyone, judged
    /// by the node from its own figures at each step: error rate, p99
    /// latency against stable's, label agreement with stable on the same
    /// inputs, and escalation rate (with a cloud tier). `canary` gives the
    /// candidate a growing share of devices (sticky per reply topic) and
    /// promotes it after the last step; `shadow` runs it beside stable and
    /// devices only ever get stable's answers; `ab` keeps a fixed split with
    /// figures per version and decides nothing. A failing gate rolls back at
    /// once; a step short of samples waits and, after max_wait_s, holds (or
    /// rolls back). `models status` shows the step, the gates and the
    /// figures; `models promote` or `models rollback` end it any time.
    /// Needs the admin token as `promote` does.
    ///
    /// With --config FILE.toml instead of a version, a config change is
    /// tried the same way on stable's version: FILE sets some of the model's
    /// serving keys (cloud_model, threshold, confidence, enrich, max_batch,
    /// max_delay_us, latency_budget_ms, cache_ttl_s, top_k,
    /// preprocess_scale, preprocess_offset; the names of [models.NAME]), the
    /// others stay as stable has them. Replies name the config version they
    /// were served with (parameters.config_version); the deployment state
    /// keeps each config version's text, hash and file, so a rollback
    /// restores stable's exactly. Give the node's own config before the
    /// subcommand (edgeinfer -c node.toml models rollout NAME --config
    /// FILE.toml) or in EDGEINFER_CONFIG.
    Rollout {
        /// The model's name.
        model: String,
        /// The candidate version (a directory already loaded); none with --config.
        #[arg(required_unless_present = "config", conflicts_with = "config")]
        version: Option<String>,
        /// A config candidate (TOML, at most 4096 bytes) to roll out on
        /// stable's version instead of a model version.
        #[arg(long, value_name = "FILE.toml")]
        config: Option<std::path::PathBuf>,
        /// canary, shadow or ab.
        #[arg(long, default_value = "canary")]
        mode: String,
        /// The canary's shares of devices in percent, ending at 100; default
        /// models.NAME.rollout.steps (5,25,50,100).
        #[arg(long)]
        steps: Option<String>,
        /// Gate settings over models.NAME.rollout's, as KEY=VALUE,...: bake_s,
        /// min_requests, max_wait_s, on_inconclusive (hold|rollback),
        /// max_error_rate_increase, max_p99_ratio, p99_slack_ms,
        /// min_agreement, max_escalation_increase, compare_share, ab_share,
        /// and the field gates' min_feedback (0: off), max_accuracy_drop,
        /// max_outcome_drop, field_confidence (0.9|0.95|0.99).
        #[arg(long)]
        gates: Option<String>,
        #[command(flatten)]
        target: deploy::Target,
    },
    /// Load every model version as `serve` would: check its sha256, run its
    /// golden vectors through every batch plan, report whether the optimized
    /// plan runs integer or float kernels, and time it. Each integer layer's
    /// kernels (each of ours the host runs: byte tiles, the i16 tile,
    /// depthwise kernels; tract-linalg's) are timed again and the fastest kept,
    /// refreshing the choices `serve` reuses from node.state_dir/kernels;
    /// each layer's choice and the runner-up's time are printed. Exits 1 when
    /// any version is refused.
    Verify {
        /// Timed runs per batch size.
        #[arg(long, default_value_t = 200)]
        iterations: usize,
    },
}

pub fn run(config: &Config, command: ModelsCommand) -> Result<i32> {
    // These need no model loaded.
    let command = match command {
        ModelsCommand::Status { model, target } => return deploy::status(config, model, target),
        ModelsCommand::AbReport(args) => return ab_report::run(config, args),
        ModelsCommand::Promote { model, version, target } => {
            return deploy::change(config, Change::Promote { model, version }, target);
        }
        ModelsCommand::Rollback { model, target } => {
            return deploy::change(config, Change::Rollback { model }, target);
        }
        ModelsCommand::Rollout { model, version, config: file, mode, steps, gates, target } => {
            let file = match file {
                Some(path) => Some(std::fs::read_to_string(&path).map_err(|e| {
                    anyhow::anyhow!("--config {}: cannot read the config candidate: {e}", path.display())
                })?),
                None => None,
            };
            let change = Change::Rollout { model, version, config: file, mode: Some(mode), steps, gates };
            return deploy::change(config, change, target);
        }
        other => other,
    };
    let measure_again = matches!(command, ModelsCommand::Verify { .. });
    let registry = super::load_models(config, false, !measure_again)?;
    match command {
        ModelsCommand::List => list(config, &registry),
        ModelsCommand::Profile { model, version, batch, iterations, top } => {
            profile(&registry, &model, version.as_deref(), batch, iterations, top)
        }
        ModelsCommand::Verify { iterations } => verify(&registry, iterations),
        ModelsCommand::Compare(args) => compare::run(config, registry, args),
        ModelsCommand::Status { .. }
        | ModelsCommand::AbReport(_)
        | ModelsCommand::Promote { .. }
        | ModelsCommand::Rollback { .. }
        | ModelsCommand::Rollout { .. } => {
            unreachable!("answered above")
        }
    }
}

fn list(config: &Config, registry: &Registry) -> Result<i32> {
    // The version a node would serve: the deployment state's stable one.
    let deployments = edgeinfer::rollout::Deployments::load(&config.node.state_dir)?;
    let serving: Vec<&Arc<edgeinfer::model::LoadedModel>> =
        registry.serving(|m| deployments.stable(m)).collect();
    println!("{:<16} {:<8} {:<6} {:<9} {:<10} STATUS", "MODEL", "VERSION", "QUANT", "KERNELS", "SHA256");
    for m in registry.all() {
        println!(
            "{:<16} {:<8} {:<6} {:<9} {:<10} {}",
            m.name(),
            m.version(),
            m.manifest.quantization.as_str(),
            m.kernels.kind(),
            &m.manifest.sha256[..8],
            if serving.iter().any(|a| Arc::ptr_eq(a, m)) { "active" } else { "loaded" }
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
        let choice = m.kernel_choices.iter().find(|c| n.node == format!("{}.int8", c.layer));
        let note = choice.map(|c| format!("  [{}]", choice_note(c))).unwrap_or_default();
        println!("  {us:>9.1} us {:>5.1}%  {:<24} {}{note}", 100.0 * us / (total * 1e6), n.op, n.node);
    }
    Ok(0)
}

/// A layer's kernel, its time per run at batch 1 and the runner-up's.
fn choice_note(c: &edgeinfer::model::LayerChoice) -> String {
    match (c.chosen_us(), c.runner_up()) {
        (Some(us), Some((other, other_us))) => format!(
            "{} ({}) {us:.1} us, runner-up {} {other_us:.1} us{}",
            c.kernel.as_str(),
            c.name,
            other.as_str(),
            if c.cached { ", measured at an earlier start" } else { "" }
        ),
        _ => format!(
            "{} ({}), not measured: EDGEINFER_INT8_GEMM, or a host with neither AVX2 nor a byte dot product",
            c.kernel.as_str(),
            c.name
        ),
    }
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
        for c in &m.kernel_choices {
            println!("  layer {}: {}", c.layer, choice_note(c));
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
