//! `edgeinfer bench`: load-test a node over MQTT, or measure the edge/cloud
//! trade-off on a labelled split.

use anyhow::{Context, Result};
use edgeinfer::bench::{BenchOptions, Payload};
use edgeinfer::config::Config;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Broker URL; default: mqtt.url from the config.
    #[arg(long)]
    url: Option<String>,
    /// Model to ask.
    #[arg(long, short, default_value = "digits")]
    model: String,
    /// Node to address (PREFIX/NODE/infer/MODEL); default: node.id from the config.
    #[arg(long)]
    node: Option<String>,
    /// Address the share group (PREFIX/infer/MODEL) instead of one node, and
    /// report the share of replies each node gave and each cache layer
    /// answered.
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
    /// With --echo: the MQTT client the responder runs on (rumqttc's event
    /// loop, or the node's own session layer, which writes each wakeup's
    /// packets at once).
    #[arg(long, value_enum, default_value = "rumqttc", requires = "echo")]
    echo_client: edgeinfer::bench::EchoClient,
    /// With --echo: the QoS of the responder's replies (default: --qos).
    /// 2 is the floor for a node with `mqtt.reply_qos = 2`: the broker
    /// delivers a QoS 2 reply once it has the PUBREL, a round trip later.
    #[arg(long, value_name = "QOS", requires = "echo", value_parser = clap::value_parser!(u8).range(0..=2))]
    echo_reply_qos: Option<u8>,
    /// Make every request's input different (the default request with its
    /// first pixel set to the request number), so each misses the cache.
    #[arg(long, conflicts_with = "input")]
    distinct: bool,
    /// With --distinct: number the requests from N, so a later run (of a
    /// soak, benches/soak.sh) misses the cache as well.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "distinct")]
    distinct_from: u64,
    /// With --distinct: N different inputs, asked round and round, so the
    /// cache layers answer the repeats (with --shared: where a site's
    /// answers come from, `answered by` and `cache` in the report).
    #[arg(long, value_name = "N", requires = "distinct", value_parser = clap::value_parser!(u64).range(1..))]
    keys: Option<u64>,
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

pub fn run(config: &Config, args: BenchArgs) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(bench(config, args))
}

async fn bench(config: &Config, args: BenchArgs) -> Result<i32> {
    let prefix = &config.mqtt.topic_prefix;
    let topic = if args.shared {
        format!("{prefix}/infer/{}", args.model)
    } else {
        format!("{prefix}/{}/infer/{}", args.node.as_deref().unwrap_or(&config.node.id), args.model)
    };
    let url = args.url.clone().unwrap_or_else(|| config.mqtt.url.clone());
    if let Some(split) = &args.cascade {
        let rows = edgeinfer::bench::read_split(split)?;
        let thresholds = [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995];
        let report = edgeinfer::bench::run_cascade(&url, &topic, rows, &thresholds).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{report}");
        }
        return Ok(0);
    }
    let payload = payload(&args)?;
    if args.echo {
        let qos = |n: u8| rumqttc::v5::mqttbytes::qos(n).expect("a QoS of 0 to 2, as parsed");
        let reply_qos = qos(args.echo_reply_qos.unwrap_or(args.qos));
        edgeinfer::bench::run_echo(&url, &topic, qos(args.qos), reply_qos, args.echo_client).await?;
    }
    let options = BenchOptions {
        url,
        topic,
        payload,
        connections: args.connections.max(1),
        concurrency: args.concurrency.max(1),
        rate: args.rate,
        duration: Duration::from_secs_f64(args.duration.max(0.1)),
        warmup: Duration::from_secs_f64(args.warmup.max(0.0)),
        qos1: args.qos == 1,
        progress: !args.json,
        tally: args.shared,
    };
    let report = edgeinfer::bench::run(options).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(if report.requests > 0 { 0 } else { 1 })
}

/// The request every connection sends: `--input`, or one digits row.
fn payload(args: &BenchArgs) -> Result<Payload> {
    if let Some(path) = &args.input {
        let bytes = std::fs::read(path).with_context(|| format!("reading --input {}", path.display()))?;
        return Ok(Payload::Fixed(bytes.into()));
    }
    let data: Vec<u32> = (0..64).map(|i| (i * 7) % 17).collect();
    let mut request = serde_json::json!({
        "id": "bench",
        "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": data}]
    });
    if args.no_cache {
        request["parameters"] = serde_json::json!({"cache": false});
    }
    let text = serde_json::to_string(&request)?;
    if !args.distinct {
        return Ok(Payload::Fixed(text.into()));
    }
    // The first pixel becomes the request number.
    let at = text.find("\"data\":[").expect("the request has data") + "\"data\":[".len();
    let end = at + text[at..].find(',').expect("64 pixels");
    let (head, tail) = (text[..at].to_string(), text[end..].to_string());
    Ok(Payload::Numbered { head: head.into(), tail: tail.into(), first: args.distinct_from, keys: args.keys })
}
