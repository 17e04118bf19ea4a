//! The command-line definitions, a file per command group, and what every
//! command shares: the global options, logging and loading the models.

pub mod bench;
pub mod cache;
pub mod config;
pub mod doctor;
pub mod infer;
pub mod install;
pub mod models;
pub mod serve;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use edgeinfer::config::Config;
use edgeinfer::lifecycle::ReloadSource;
use edgeinfer::model::{Registry, RuntimeOptions};
use std::path::PathBuf;

/// edgeinfer: serves INT8 tract models to IoT devices over MQTT and HTTP.
///
/// Models live in MODELS_DIR/NAME/VERSION/ (model.onnx + model.toml). Every
/// command reads the same TOML config; EDGEINFER_<SECTION>__<KEY> environment
/// variables override it (EDGEINFER_NODE__MODELS_DIR=/opt/models).
#[derive(Parser)]
#[command(name = "edgeinfer", version, about, long_about)]
pub struct Cli {
    /// TOML config file; without one every key has its default.
    #[arg(long, short, global = true, env = "EDGEINFER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Models directory, overriding node.models_dir.
    #[arg(long, global = true, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Log filter: a level (error, warn, info, debug, trace) or target=level
    /// directives, comma-separated, like info,edgeinfer=debug.
    #[arg(
        long,
        global = true,
        env = "EDGEINFER_LOG",
        default_value = "info,rumqttd=warn,tract_linalg=warn",
        value_name = "FILTER"
    )]
    pub log: String,
    /// Log lines as text (for people) or JSON (one object a line, for collectors).
    #[arg(long, global = true, env = "EDGEINFER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve inference requests over MQTT until SIGTERM or SIGINT.
    ///
    /// Subscribes (QoS 1, persistent session) to PREFIX/NODE/infer/+ and to
    /// the shared $share/GROUP/PREFIX/infer/+, replies to each request's MQTT 5
    /// Response Topic (or its payload's reply_to), and keeps a retained
    /// PREFIX/NODE/status. Without --config, and with nothing listening on
    /// mqtt.url, it starts the embedded broker there (as mqtt.embedded_broker
    /// = true does), so a first run needs no setup.
    Serve,
    /// Answer one Open Inference Protocol request through the same pipeline
    /// the services use, and print the reply.
    ///
    /// Reads the request (JSON, or postcard with --postcard) from FILE or
    /// standard input and writes the reply to standard output. Exits 0 for a
    /// result and 2 for an error reply (which names the field and the fix).
    Infer(infer::InferArgs),
    /// Load-test a node (or any broker) over MQTT and print round-trip
    /// percentiles and throughput.
    ///
    /// Closed loop by default: every connection keeps --concurrency requests in
    /// flight. With --rate, open loop: Poisson arrivals at that total rate,
    /// latency counted from each request's intended send time, and a request
    /// sent in the measured interval counted whenever its reply comes (up to
    /// 10 s after). With --echo, a
    /// trivial responder on the same broker answers instead of a node: the
    /// broker's own floor, measured with the same client.
    Bench(bench::BenchArgs),
    /// Inspect the models directory.
    Models {
        #[command(subcommand)]
        command: models::ModelsCommand,
    },
    /// Inspect or empty the response cache.
    ///
    /// Talks to the running node through its HTTP endpoint (http.listen, on
    /// loopback only), since a node holds its store locked; with no node
    /// running it opens the store in node.state_dir/cache itself.
    Cache {
        #[command(subcommand)]
        command: cache::CacheCommand,
    },
    /// Check what a node needs, one line each, and say what to fix.
    ///
    /// Each check prints ok, WARN or FAIL with the fix: the config; the models (sha256 and golden vectors); the state
    /// directory (writable, room for the cache, spool and capture bounds);
    /// the broker (reachable, the login accepted, a round trip timed: ~40
    /// ms looks like Nagle); the installed unit's TasksMax and LimitNOFILE
    /// against the config; the clock; Redis and the cloud tier when on.
    /// Exits 1 when a check fails.
    Doctor(doctor::DoctorArgs),
    /// Check, print or look up the configuration.
    ///
    /// `config check` reports every mistake in a file at once; `config
    /// print` shows the config in effect; `config reference` lists every
    /// key (docs/CONFIG.md).
    Config {
        #[command(subcommand)]
        command: config::ConfigCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    ///
    /// The Debian package installs them; after a tarball install:
    /// `edgeinfer completions bash > /etc/bash_completion.d/edgeinfer`, or for
    /// zsh into a directory on $fpath as `_edgeinfer`, for fish into
    /// ~/.config/fish/completions/edgeinfer.fish.
    Completions(install::CompletionsArgs),
    /// Write the man pages, edgeinfer.1 and one per subcommand
    /// (edgeinfer-models-verify.1, ...), into DIR.
    ///
    /// The Debian package installs them; after a tarball install:
    /// `edgeinfer manpages /usr/local/share/man/man1`.
    Manpages(install::ManpagesArgs),
}

impl Cli {
    /// Where `serve` reads the config again on SIGHUP: the same file and
    /// overrides it started with.
    pub fn reload_source(&self) -> ReloadSource {
        ReloadSource { config_file: self.node_config(), models_dir: self.models_dir.clone() }
    }

    /// The node's config file. `models rollout NAME --config FILE.toml`
    /// names a config candidate there, and clap hands a subcommand's value
    /// of a global argument's name up to the global one: the node config is
    /// then the one given before the subcommand, else EDGEINFER_CONFIG.
    fn node_config(&self) -> Option<PathBuf> {
        let candidate = match &self.command {
            Command::Models { command: models::ModelsCommand::Rollout { config, .. } } => config.as_ref(),
            _ => None,
        };
        if candidate.is_none() || self.config.as_ref() != candidate {
            return self.config.clone();
        }
        let args: Vec<String> = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect();
        let before = &args[1..args.iter().position(|a| a == "rollout").unwrap_or(args.len())];
        let mut given = None;
        for (i, arg) in before.iter().enumerate() {
            if arg == "--config" || arg == "-c" {
                given = before.get(i + 1).map(PathBuf::from);
            } else if let Some(path) = arg.strip_prefix("--config=").or_else(|| arg.strip_prefix("-c")) {
                given = Some(PathBuf::from(path.trim_start_matches('=')));
            }
        }
        given.or_else(|| std::env::var_os("EDGEINFER_CONFIG").map(PathBuf::from))
    }
}

pub fn init_logging(filter: &str, json: bool) {
    // `target=level` directives; tracing's regex-based EnvFilter would add a
    // megabyte of regex engine to the binary for span filters nobody sets here.
    let filter: tracing_subscriber::filter::Targets = filter.parse().unwrap_or_else(|e| {
        eprintln!("--log {filter:?}: {e}; logging warnings only");
        tracing_subscriber::filter::Targets::new().with_default(tracing::Level::WARN)
    });
    // Plain text (no colours): journald and log collectors read it.
    use tracing_subscriber::prelude::*;
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry.with(tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr)).init();
    } else {
        registry.with(tracing_subscriber::fmt::layer().with_ansi(false).with_writer(std::io::stderr)).init();
    }
}

/// The models directory, as every command but the load generator reads it.
/// `defer`: only the smallest plan before returning (the rest is planned in
/// the background by serve, or never needed by one request).
/// `reuse_kernel_choices: false` times each integer layer's kernels again
/// (`models verify`) instead of reading `node.state_dir/kernels`.
pub fn load_models(config: &Config, defer: bool, reuse_kernel_choices: bool) -> Result<Registry> {
    let (batch_sizes, state_dir) = (&config.runtime.batch_sizes, &config.node.state_dir);
    let runtime = RuntimeOptions::for_node(batch_sizes, defer, state_dir, reuse_kernel_choices);
    let registry = Registry::load(&config.node.models_dir, &runtime)
        .with_context(|| "loading models (set node.models_dir or --models-dir)")?;
    for refused in &registry.refused {
        tracing::error!("refused {}: {}", refused.dir.display(), refused.error);
    }
    Ok(registry)
}
