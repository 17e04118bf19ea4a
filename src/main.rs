//! The `edgeinfer` command line: parse, load config, wire the parts, run.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use edgeinfer::config::Config;
use edgeinfer::engine::{Engine, EngineOptions, Target};
use edgeinfer::model::{Registry, RuntimeOptions};
use edgeinfer::protocol::Encoding;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// edgeinfer: serves INT8 tract models to IoT devices over MQTT and HTTP.
///
/// Models live in MODELS_DIR/NAME/VERSION/ (model.onnx + model.toml). Every
/// command reads the same TOML config; EDGEINFER_<SECTION>__<KEY> environment
/// variables override it (EDGEINFER_NODE__MODELS_DIR=/opt/models).
#[derive(Parser)]
#[command(name = "edgeinfer", version, about, long_about)]
struct Cli {
    /// TOML config file; without one every key has its default.
    #[arg(long, short, global = true, env = "EDGEINFER_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Models directory, overriding node.models_dir.
    #[arg(long, global = true, value_name = "DIR")]
    models_dir: Option<PathBuf>,
    /// Log filter (error, warn, info, debug, trace, or tracing directives).
    #[arg(long, global = true, env = "EDGEINFER_LOG", default_value = "warn", value_name = "FILTER")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer one Open Inference Protocol request through the same pipeline
    /// the services use, and print the reply.
    ///
    /// Reads the request (JSON, or postcard with --postcard) from FILE or
    /// standard input and writes the reply to standard output. Exits 0 for a
    /// result and 2 for an error reply (which names the field and the fix).
    Infer {
        /// Model name, as in MODELS_DIR/NAME.
        #[arg(long, short)]
        model: String,
        /// Model version; default: parameters.model_version, else the newest.
        #[arg(long, value_name = "VERSION")]
        model_version: Option<String>,
        /// Request file, or - for standard input.
        #[arg(long, short, default_value = "-", value_name = "FILE|-")]
        input: String,
        /// The request and reply are postcard (application/x-postcard), not JSON.
        #[arg(long)]
        postcard: bool,
    },
    /// Inspect the models directory.
    Models {
        #[command(subcommand)]
        command: ModelsCommand,
    },
}

#[derive(Subcommand)]
enum ModelsCommand {
    /// List every model version found, loaded or refused (with the reason).
    List,
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

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log);
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

fn run(cli: Cli) -> Result<i32> {
    let mut config = Config::load(cli.config.as_deref())?;
    if let Some(dir) = cli.models_dir {
        config.node.models_dir = dir;
    }
    let runtime = RuntimeOptions { batch_sizes: config.runtime.batch_sizes.clone() };
    let registry = Registry::load(&config.node.models_dir, &runtime)
        .with_context(|| "loading models (set node.models_dir or --models-dir)")?;
    for refused in &registry.refused {
        tracing::error!("refused {}: {}", refused.dir.display(), refused.error);
    }
    match cli.command {
        Command::Infer { model, model_version, input, postcard } => {
            let payload = read_input(&input)?;
            let engine = Engine::new(
                Arc::new(registry),
                EngineOptions {
                    node_id: config.node.id.clone(),
                    limits: config.limits.clone(),
                    threads_per_model: 1,
                    ..Default::default()
                },
            );
            let encoding = if postcard { Encoding::Postcard } else { Encoding::Json };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let target = Target { model: &model, version: model_version.as_deref() };
            let handled = rt.block_on(engine.handle(target, &payload, encoding));
            let mut out = std::io::stdout().lock();
            out.write_all(&handled.reply)?;
            if encoding == Encoding::Json {
                writeln!(out)?;
            }
            Ok(if handled.outcome.is_ok() { 0 } else { 2 })
        }
        Command::Models { command: ModelsCommand::List } => {
            println!(
                "{:<16} {:<8} {:<6} {:<9} {:<10} STATUS",
                "MODEL", "VERSION", "QUANT", "KERNELS", "SHA256"
            );
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
        Command::Models { command: ModelsCommand::Verify { iterations } } => {
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
                println!(
                    "  kernels: {} ({} integer, {} float: {})",
                    kernels.kind(),
                    kernels.integer.len(),
                    kernels.float.len(),
                    kernels.integer.iter().chain(&kernels.float).cloned().collect::<Vec<_>>().join(" ")
                );
                if m.manifest.quantization.as_str() == "int8" && !kernels.runs_integer() {
                    println!("  warning: labelled int8 but the optimized plan runs float kernels");
                }
                let mut timings = Vec::new();
                for &batch in [1, m.max_batch()].iter().collect::<std::collections::BTreeSet<_>>() {
                    let per_item = m.time_per_item(batch, iterations)?;
                    timings.push(format!("batch {batch}: {:.2} us/item", per_item.as_secs_f64() * 1e6));
                }
                println!("  latency: {}", timings.join(", "));
            }
            for r in &registry.refused {
                println!("{}: REFUSED: {}", r.dir.display(), r.error);
            }
            if registry.refused.is_empty() { Ok(0) } else { Ok(1) }
        }
    }
}

fn read_input(input: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    if input == "-" {
        std::io::stdin().read_to_end(&mut buf).context("reading the request from standard input")?;
    } else {
        buf = std::fs::read(input).with_context(|| format!("reading the request from {input}"))?;
    }
    if buf.is_empty() && input == "-" {
        bail!(
            "no request on standard input; pass --input FILE or pipe an Open Inference Protocol JSON request"
        );
    }
    Ok(buf)
}
