//! `edgeinfer infer`: one request through the pipeline, without a broker.

use anyhow::{Context, Result, bail};
use edgeinfer::config::Config;
use edgeinfer::engine::{Cache, Engine, EngineOptions, Envelope};
use edgeinfer::protocol::Encoding;
use std::io::{Read, Write};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct InferArgs {
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
}

/// Exits 0 for a result and 2 for an error reply.
pub fn run(config: &Config, args: InferArgs) -> Result<i32> {
    let registry = super::load_models(config, true, true)?;
    let payload = read_input(&args.input)?;
    let engine = Engine::new(
        Arc::new(registry),
        // One request: one inference thread per model is plenty.
        EngineOptions { threads_per_model: 1, ..EngineOptions::from_config(config) },
        // One answer: nothing to reuse, and a serving node may hold the store.
        Cache::off(),
    );
    let encoding = if args.postcard { Encoding::Postcard } else { Encoding::Json };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let envelope = Envelope { version: args.model_version.as_deref(), ..Envelope::model(&args.model) };
    let reply = rt.block_on(engine.handle(envelope, &payload, encoding));
    let mut out = std::io::stdout().lock();
    out.write_all(&reply.payload)?;
    if encoding == Encoding::Json {
        writeln!(out)?;
    }
    Ok(if reply.outcome.is_ok() { 0 } else { 2 })
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
