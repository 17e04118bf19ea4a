//! The `edgeinfer` command line: parse, load config, wire the parts, run.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use edgeinfer::cloud::{Cloud, CloudOptions, spool};
use edgeinfer::config::Config;
use edgeinfer::engine::{Cache, CacheOptions, Engine, EngineOptions, Target, Tiers};
use edgeinfer::lifecycle::{self, Notifier, ReloadSource, Signal};
use edgeinfer::model::{Registry, RuntimeOptions};
use edgeinfer::protocol::Encoding;
use edgeinfer::telemetry::{Status, unix_now};
use edgeinfer::transport::mqtt::{BrokerAddress, MqttService};
use edgeinfer::transport::{broker, http};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    /// Log filter: a level (error, warn, info, debug, trace) or target=level
    /// directives, comma-separated, like info,edgeinfer=debug.
    #[arg(
        long,
        global = true,
        env = "EDGEINFER_LOG",
        default_value = "info,rumqttd=warn,tract_linalg=warn",
        value_name = "FILTER"
    )]
    log: String,
    /// Log lines as text (for people) or JSON (one object a line, for collectors).
    #[arg(long, global = true, env = "EDGEINFER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    /// Load-test a node (or any broker) over MQTT and print round-trip
    /// percentiles and throughput.
    ///
    /// Closed loop by default: every connection keeps --concurrency requests in
    /// flight. With --rate, open loop: Poisson arrivals at that total rate,
    /// latency counted from each request's intended send time. With --echo, a
    /// trivial responder on the same broker answers instead of a node: the
    /// broker's own floor, measured with the same client.
    Bench(BenchArgs),
    /// Inspect the models directory.
    Models {
        #[command(subcommand)]
        command: ModelsCommand,
    },
    /// Inspect or empty the response cache.
    ///
    /// Talks to the running node through its HTTP endpoint (http.listen, on
    /// loopback only), since a node holds its store locked; with no node
    /// running it opens the store in node.state_dir/cache itself.
    Cache {
        #[command(subcommand)]
        command: CacheCommand,
    },
}

#[derive(Subcommand)]
enum CacheCommand {
    /// Entries, bytes and capacity of the memory and disk layers, and any
    /// problem the disk layer had (a store moved aside, an I/O error).
    Stats {
        /// The node's HTTP address; default: http://<http.listen>.
        #[arg(long)]
        url: Option<String>,
        /// Print the figures as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove cached answers from both layers: all of them, or one model's.
    Purge {
        /// Only this model's answers.
        #[arg(long, short)]
        model: Option<String>,
        /// The node's HTTP address; default: http://<http.listen>.
        #[arg(long)]
        url: Option<String>,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Broker URL; default: mqtt.url from the config.
    #[arg(long)]
    url: Option<String>,
    /// Model to ask.
    #[arg(long, short, default_value = "digits")]
    model: String,
    /// Node to address (PREFIX/NODE/infer/MODEL); default: node.id from the config.
    #[arg(long)]
    node: Option<String>,
    /// Address the share group (PREFIX/infer/MODEL) instead of one node.
    #[arg(long, conflicts_with = "node")]
    shared: bool,
    /// Request payload file (OIP JSON); default: one 64-pixel digits row.
    #[arg(long, short, value_name = "FILE")]
    input: Option<PathBuf>,
    /// MQTT connections, each with its own reply topic.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Closed loop: requests in flight per connection.
    #[arg(long, short = 'C', default_value_t = 32)]
    concurrency: usize,
    /// Open loop: total requests per second (Poisson arrivals).
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds measured, after the warm-up.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// QoS of requests and replies (0 or 1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    qos: u8,
    /// Run an echo responder on the request topic and measure the broker floor.
    #[arg(long)]
    echo: bool,
    /// Make every request's input different (the default request with its
    /// first pixel set to the request number), so each misses the cache.
    #[arg(long, conflicts_with = "input")]
    distinct: bool,
    /// Send `parameters.cache = false`: the node skips its cache.
    #[arg(long, conflicts_with = "input")]
    no_cache: bool,
    /// Instead of load: the edge/cloud trade-off on a labelled split (CSV
    /// `label,x1,...`, like models/heldout/digits.csv). Each row is sent one
    /// at a time with tier fast and tier quality; prints, per threshold, the
    /// share answered at the edge, the accuracy and the mean round trip. The
    /// node needs [cloud] enabled.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["input", "echo", "distinct", "no_cache"])]
    cascade: Option<PathBuf>,
    /// Print the report as JSON on standard output.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum ModelsCommand {
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
    init_logging(&cli.log, cli.log_format == "json");
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn init_logging(filter: &str, json: bool) {
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

fn run(cli: Cli) -> Result<i32> {
    let mut config = Config::load(cli.config.as_deref())?;
    if let Some(dir) = &cli.models_dir {
        config.node.models_dir = dir.clone();
    }
    // Every command but the load generator reads the models directory.
    // `defer`: only the smallest plan before returning (the rest is planned
    // in the background by serve, or never needed by one request).
    let load_models = |config: &Config, defer: bool| -> Result<Registry> {
        let runtime = RuntimeOptions { batch_sizes: config.runtime.batch_sizes.clone(), defer };
        let registry = Registry::load(&config.node.models_dir, &runtime)
            .with_context(|| "loading models (set node.models_dir or --models-dir)")?;
        for refused in &registry.refused {
            tracing::error!("refused {}: {}", refused.dir.display(), refused.error);
        }
        Ok(registry)
    };
    match cli.command {
        Command::Cache { command } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(cache_command(&config, command))
        }
        Command::Bench(args) => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            rt.block_on(bench(&config, args))
        }
        Command::Serve => {
            let registry = load_models(&config, true)?;
            registry.plan_rest_in_background();
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let source = ReloadSource { config_file: cli.config.clone(), models_dir: cli.models_dir.clone() };
            rt.block_on(serve(config, registry, source))
        }
        Command::Infer { model, model_version, input, postcard } => {
            let registry = load_models(&config, true)?;
            let payload = read_input(&input)?;
            let engine = Engine::new(
                Arc::new(registry),
                // One request: one inference thread per model is plenty.
                EngineOptions { threads_per_model: 1, ..EngineOptions::from_config(&config) },
                // One answer: nothing to reuse, and a serving node may hold the store.
                Cache::off(),
            );
            let encoding = if postcard { Encoding::Postcard } else { Encoding::Json };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let target = Target { version: model_version.as_deref(), ..Target::model(&model) };
            let handled = rt.block_on(engine.handle(target, &payload, encoding));
            let mut out = std::io::stdout().lock();
            out.write_all(&handled.reply)?;
            if encoding == Encoding::Json {
                writeln!(out)?;
            }
            Ok(if handled.outcome.is_ok() { 0 } else { 2 })
        }
        Command::Models { command: ModelsCommand::List } => {
            let registry = load_models(&config, false)?;
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
        Command::Models { command: ModelsCommand::Profile { model, version, batch, iterations, top } } => {
            let registry = load_models(&config, false)?;
            let m = registry.get(&model, version.as_deref())?;
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
        Command::Models { command: ModelsCommand::Verify { iterations } } => {
            let registry = load_models(&config, false)?;
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

async fn serve(config: Config, registry: Registry, source: ReloadSource) -> Result<i32> {
    let started = std::time::Instant::now();
    let notifier = Notifier;
    // Before anything else, so an early SIGTERM still drains cleanly.
    let mut signals = lifecycle::signals().context("installing signal handlers")?;
    let address = BrokerAddress::parse(&config.mqtt.url)?;
    let addr = address
        .socket_addr()
        .with_context(|| format!("mqtt.url {:?}: cannot resolve the host", config.mqtt.url))?;
    let fallback = source.config_file.is_none() && !address.tls && !broker::listening(addr);
    if config.mqtt.embedded_broker || fallback {
        let v311 = match config.mqtt.embedded_v311_listen.as_deref() {
            None => Some(std::net::SocketAddr::new(addr.ip(), addr.port().wrapping_add(1))),
            Some("") => None,
            Some(listen) => Some(listen.parse()?),
        };
        broker::start(addr, v311, config.limits.max_payload_bytes + 64 * 1024)?;
        tracing::info!(
            "embedded broker: MQTT 5 on {addr}{}",
            v311.map(|a| format!(", MQTT 3.1.1 on {a}")).unwrap_or_default()
        );
    }
    let metrics = if config.telemetry.metrics { edgeinfer::telemetry::install() } else { None };
    edgeinfer::telemetry::describe_models(&registry);
    let cache = Cache::open(CacheOptions::from_config(&config));
    let mut engine = Engine::new(Arc::new(registry), EngineOptions::from_config(&config), cache);
    let (cloud, spool_task) = match CloudOptions::from_config(&config)? {
        Some(options) => {
            let cloud = Arc::new(Cloud::new(options)?);
            let dir = config.node.state_dir.join("spool");
            let (spool, task) =
                match spool::open(&dir, config.cloud.spool_max_entries, config.cloud.spool_max_bytes) {
                    Ok((spool, task)) => (Some(spool), Some(task)),
                    Err(e) => {
                        tracing::error!("{e}; async escalations are answered synchronously");
                        (None, None)
                    }
                };
            engine = engine.with_tiers(Tiers { cloud: cloud.clone(), spool });
            tracing::info!("cloud tier: {} (escalating below each model's threshold)", config.cloud.url);
            (Some(cloud), task)
        }
        None => {
            tracing::info!("cloud tier off (cloud.enabled = false): no request leaves this node");
            (None, None)
        }
    };
    let engine = Arc::new(engine);
    let (follow_ups, follow_ups_rx) = tokio::sync::mpsc::unbounded_channel();
    if let (Some(cloud), Some(task)) = (cloud, spool_task) {
        let weak = Arc::downgrade(&engine);
        let finish: spool::Finish =
            Arc::new(move |entry, cloud| weak.upgrade()?.finish_escalation(entry, cloud));
        tokio::spawn(task.run(cloud, finish, follow_ups));
    }
    tracing::info!("node {}: serving {} over {}", config.node.id, serving(&engine), config.mqtt.url);
    let status = Status::new(&config.node.id, &engine.registry(), unix_now());
    let (service, mut mqtt_ready) = MqttService::new(engine.clone(), &config, status)?;
    let service = service.with_follow_ups(follow_ups_rx);
    let heartbeat = service.heartbeat();
    let refresh_status = service.status_refresher();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let mut http_server = None;
    if !config.http.listen.is_empty() {
        let listener = tokio::net::TcpListener::bind(&config.http.listen)
            .await
            .with_context(|| format!("http.listen = {:?}: cannot listen there", config.http.listen))?;
        let router = http::router(engine.clone(), metrics, mqtt_ready.clone());
        tracing::info!("HTTP on {} (/metrics, /v2)", config.http.listen);
        let shutdown = stopped(stop_rx.clone());
        http_server = Some(tokio::spawn(async move {
            if let Err(e) = http::serve(listener, router, shutdown).await {
                tracing::error!("HTTP server stopped: {e}");
            }
        }));
    }
    let mqtt = tokio::spawn(service.run(stopped(stop_rx)));

    // READY once the models are loaded and the broker confirmed the subscriptions.
    let mut ready = false;
    let mut running = config;
    loop {
        tokio::select! {
            changed = mqtt_ready.changed(), if !mqtt.is_finished() => {
                if changed.is_err() {
                    continue;
                }
                let up = *mqtt_ready.borrow_and_update();
                let line = status_line(&engine, &running, up);
                if up && !ready {
                    ready = true;
                    notifier.ready(&line);
                    tracing::info!("ready {:.1} ms after start", started.elapsed().as_secs_f64() * 1e3);
                    if let Some(interval) = notifier.watchdog_interval() {
                        let stale = Duration::from_secs(2 * running.mqtt.keep_alive_s as u64 + 10);
                        tokio::spawn(lifecycle::watchdog(engine.clone(), heartbeat.clone(), stale, interval));
                    }
                } else {
                    notifier.status(&line);
                }
            }
            signal = signals.recv() => match signal {
                Some(Signal::Reload) => {
                    notifier.reloading();
                    running = reload(&source, running, &engine).await;
                    refresh_status.notify_one();
                    notifier.ready(&status_line(&engine, &running, *mqtt_ready.borrow()));
                }
                Some(Signal::Stop(name)) => {
                    tracing::info!("{name}: draining (node.drain_timeout_s = {})", running.node.drain_timeout_s);
                    notifier.stopping(&format!("{name}: draining requests in flight"));
                    break;
                }
                None => break,
            },
        }
    }
    stop_tx.send_replace(true);
    let _ = mqtt.await;
    if let Some(server) = http_server {
        let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    }
    engine.cache().flush().await;
    tracing::info!("stopped");
    Ok(0)
}

/// SIGHUP: the new config and models, or the old ones with the error logged
/// and in the status.
async fn reload(source: &ReloadSource, running: Config, engine: &Arc<Engine>) -> Config {
    let (source, engine2, current) = (source.clone(), engine.clone(), running.clone());
    let outcome = tokio::task::spawn_blocking(move || lifecycle::reload(&source, &current, &engine2)).await;
    match outcome {
        Ok(Ok((config, done))) => {
            tracing::info!("reloaded: serving {}", done.serving.join(", "));
            for refused in &done.refused {
                tracing::error!("reload: refused {refused}");
            }
            if !done.need_restart.is_empty() {
                tracing::warn!("reload: {} changed; restart to apply", done.need_restart.join(", "));
            }
            engine.set_reload_error(
                (!done.refused.is_empty()).then(|| format!("refused {}", done.refused.join("; "))),
            );
            config
        }
        Ok(Err(e)) => {
            tracing::error!("reload refused, still serving the previous config and models: {e}");
            engine.set_reload_error(Some(e.to_string()));
            running
        }
        Err(e) => {
            tracing::error!("reload failed: {e}");
            engine.set_reload_error(Some(format!("reload failed: {e}")));
            running
        }
    }
}

fn serving(engine: &Engine) -> String {
    engine
        .registry()
        .active()
        .map(|m| format!("{} v{}", m.name(), m.version()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The line `systemctl status` shows.
fn status_line(engine: &Engine, config: &Config, mqtt_up: bool) -> String {
    let requests: u64 = engine.request_counts().values().sum();
    let broker = if mqtt_up { "connected to" } else { "reconnecting to" };
    format!("serving {}; {broker} {}; {requests} requests answered", serving(engine), config.mqtt.url)
}

async fn bench(config: &Config, args: BenchArgs) -> Result<i32> {
    let prefix = &config.mqtt.topic_prefix;
    let topic = if args.shared {
        format!("{prefix}/infer/{}", args.model)
    } else {
        format!("{prefix}/{}/infer/{}", args.node.as_deref().unwrap_or(&config.node.id), args.model)
    };
    let payload = match &args.input {
        Some(path) => edgeinfer::bench::Payload::Fixed(
            std::fs::read(path).with_context(|| format!("reading --input {}", path.display()))?.into(),
        ),
        None => {
            let data: Vec<u32> = (0..64).map(|i| (i * 7) % 17).collect();
            let mut request = serde_json::json!({
                "id": "bench",
                "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": data}]
            });
            if args.no_cache {
                request["parameters"] = serde_json::json!({"cache": false});
            }
            let text = serde_json::to_string(&request)?;
            if args.distinct {
                // The first pixel becomes the request number.
                let at = text.find("\"data\":[").expect("the request has data") + "\"data\":[".len();
                let end = at + text[at..].find(',').expect("64 pixels");
                let (head, tail) = (text[..at].to_string(), text[end..].to_string());
                edgeinfer::bench::Payload::Numbered { head: head.into(), tail: tail.into() }
            } else {
                edgeinfer::bench::Payload::Fixed(text.into())
            }
        }
    };
    let url = args.url.clone().unwrap_or_else(|| config.mqtt.url.clone());
    if let Some(split) = &args.cascade {
        let rows = edgeinfer::bench::read_split(split)?;
        let thresholds: Vec<f64> =
            [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995].into_iter().collect();
        let report = edgeinfer::bench::run_cascade(&url, &topic, rows, &thresholds).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{report}");
        }
        return Ok(0);
    }
    if args.echo {
        edgeinfer::bench::run_echo(&url, &topic, args.qos == 1).await?;
    }
    let options = edgeinfer::bench::BenchOptions {
        url,
        topic,
        payload,
        connections: args.connections.max(1),
        concurrency: args.concurrency.max(1),
        rate: args.rate,
        duration: std::time::Duration::from_secs_f64(args.duration.max(0.1)),
        warmup: std::time::Duration::from_secs_f64(args.warmup.max(0.0)),
        qos1: args.qos == 1,
        progress: !args.json,
    };
    let report = edgeinfer::bench::run(options).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(if report.requests > 0 { 0 } else { 1 })
}

async fn cache_command(config: &Config, command: CacheCommand) -> Result<i32> {
    match command {
        CacheCommand::Stats { url, json } => {
            let (stats, source) = edgeinfer::admin::cache_stats(config, url.as_deref()).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stats)?);
                return Ok(0);
            }
            println!("cache of the {source}{}", if stats.enabled { "" } else { " (cache.enabled = false)" });
            println!(
                "  memory: {} entries, {} of {} bytes",
                stats.memory_entries, stats.memory_bytes, stats.memory_capacity_bytes
            );
            match &stats.disk {
                Some(d) => {
                    println!(
                        "  disk:   {} entries, {} of {} bytes ({} bytes of files) in {}{}",
                        d.entries,
                        d.bytes,
                        d.capacity_bytes,
                        d.size_on_disk,
                        d.path.display(),
                        if d.enabled { "" } else { ", DISABLED" }
                    );
                    if let Some(p) = &d.problem {
                        println!("  problem: {p}");
                    }
                }
                None => println!("  disk:   off"),
            }
        }
        CacheCommand::Purge { model, url } => {
            let (n, source) = edgeinfer::admin::cache_purge(config, url.as_deref(), model.as_deref()).await?;
            let what = model.map(|m| format!("model {m}'s")).unwrap_or_else(|| "all".into());
            println!("purged {what} cached answers from the {source}: {n} disk entries removed");
        }
    }
    Ok(0)
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
