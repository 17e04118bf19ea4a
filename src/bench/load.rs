//! The load itself: one MQTT connection per task, replies matched to their
//! request by Correlation Data.

use super::client::subscribed;
use super::report::{Percentiles, Report};
use super::{BenchError, BenchOptions};
use bytes::Bytes;
use hdrhistogram::Histogram;
use rumqttc::v5::AsyncClient;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

#[derive(Default)]
struct Counters {
    replies: AtomicU64,
    errors: AtomicU64,
}

struct Outcome {
    histogram: Histogram<u64>,
    requests: u64,
    errors: u64,
    unanswered: u64,
    by_node: BTreeMap<String, u64>,
    by_cache: BTreeMap<String, u64>,
}

/// The string value of `"name":"..."` in a JSON reply, found without
/// parsing it (the load generator's CPU is part of what is measured).
fn string_field<'a>(payload: &'a [u8], name: &str) -> Option<&'a str> {
    let needle = format!("\"{name}\":\"");
    let at = payload.windows(needle.len()).position(|w| w == needle.as_bytes())? + needle.len();
    let len = payload[at..].iter().position(|&b| b == b'"')?;
    std::str::from_utf8(&payload[at..at + len]).ok()
}

pub async fn run(options: BenchOptions) -> Result<Report, BenchError> {
    let counters = Arc::new(Counters::default());
    let start = Instant::now();
    let measure_from = start + options.warmup;
    let stop = measure_from + options.duration;
    let mut tasks = Vec::new();
    for k in 0..options.connections.max(1) {
        let connection = Connection::open(&options, k).await?;
        let counters = counters.clone();
        let options = options.clone();
        tasks.push(tokio::spawn(
            async move { connection.drive(&options, measure_from, stop, &counters).await },
        ));
    }
    let progress = options.progress.then(|| {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut last = 0;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let now = counters.replies.load(Ordering::Relaxed);
                eprint!(
                    "\r{:>5.1} s  {:>8} req/s  errors {:<8}",
                    start.elapsed().as_secs_f64(),
                    now - last,
                    counters.errors.load(Ordering::Relaxed)
                );
                last = now;
            }
        })
    });
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let (mut requests, mut errors, mut unanswered) = (0, 0, 0);
    let (mut by_node, mut by_cache) = (BTreeMap::new(), BTreeMap::new());
    for task in tasks {
        if let Ok(outcome) = task.await {
            histogram.add(&outcome.histogram).expect("same bounds");
            requests += outcome.requests;
            errors += outcome.errors;
            unanswered += outcome.unanswered;
            for (node, n) in outcome.by_node {
                *by_node.entry(node).or_default() += n;
            }
            for (layer, n) in outcome.by_cache {
                *by_cache.entry(layer).or_default() += n;
            }
        }
    }
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    let duration_s = options.duration.as_secs_f64();
    Ok(Report {
        mode: if options.rate.is_some() { "open" } else { "closed" },
        topic: options.topic.clone(),
        connections: options.connections,
        concurrency: options.concurrency,
        rate: options.rate,
        duration_s,
        requests,
        errors,
        unanswered,
        throughput_rps: requests as f64 / duration_s,
        latency_us: Percentiles::of(&histogram),
        by_node: options.tally.then_some(by_node),
        by_cache: options.tally.then_some(by_cache),
    })
}

struct Connection {
    k: usize,
    client: AsyncClient,
    replies: mpsc::UnboundedReceiver<Publish>,
    reply_topic: String,
}

impl Connection {
    async fn open(options: &BenchOptions, k: usize) -> Result<Connection, BenchError> {
        let id = format!("edgeinfer-bench-{}-{k}", std::process::id());
        let reply_topic = format!("edgeinfer-bench/{id}/replies");
        let qos = if options.qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
        let (client, replies) = subscribed(&options.url, &id, &reply_topic, qos).await?;
        Ok(Connection { k, client, replies, reply_topic })
    }

    fn send(&self, options: &BenchOptions, seq: u64) -> bool {
        let props = PublishProperties {
            response_topic: Some(self.reply_topic.clone()),
            correlation_data: Some(Bytes::copy_from_slice(&seq.to_be_bytes())),
            ..Default::default()
        };
        let qos = if options.qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
        self.client
            .try_publish_with_properties(
                options.topic.clone(),
                qos,
                false,
                options.payload.bytes(self.k, options.connections, seq),
                props,
            )
            .is_ok()
    }

    async fn drive(
        mut self,
        options: &BenchOptions,
        measure_from: Instant,
        stop: Instant,
        counters: &Counters,
    ) -> Outcome {
        let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
        let mut in_flight: HashMap<u64, Instant> = HashMap::new();
        let (mut requests, mut errors, mut seq) = (0u64, 0u64, 0u64);
        let (mut by_node, mut by_cache) = (BTreeMap::new(), BTreeMap::new());
        // Open loop: this connection's share of the rate, Poisson arrivals.
        let per_connection = options.rate.map(|r| r / options.connections.max(1) as f64);
        let mut next_send = Instant::now();
        if per_connection.is_none() {
            for _ in 0..options.concurrency.max(1) {
                if self.send(options, seq) {
                    in_flight.insert(seq, Instant::now());
                }
                seq += 1;
            }
        }
        // Open loop, a request sent in the measured window counts whenever
        // its reply comes (up to 10 s after the window): leaving out the
        // late ones would hide exactly the waits a run is meant to show.
        let open = per_connection.is_some();
        let grace = stop + Duration::from_secs(if open { 10 } else { 2 });
        loop {
            let now = Instant::now();
            if now >= grace || (now >= stop && in_flight.is_empty()) {
                break;
            }
            if let Some(rate) = per_connection
                && now < stop
            {
                // Send everything due; latency counts from the intended time.
                while next_send <= now {
                    if self.send(options, seq) {
                        in_flight.insert(seq, next_send);
                    }
                    seq += 1;
                    next_send += Duration::from_secs_f64(-(1.0 - fastrand::f64()).ln() / rate);
                }
            }
            let wake = if per_connection.is_some() && now < stop { next_send.min(grace) } else { grace };
            let reply = tokio::select! {
                r = self.replies.recv() => r,
                _ = tokio::time::sleep_until(wake) => continue,
            };
            let Some(reply) = reply else { break };
            let Some(key) = reply
                .properties
                .as_ref()
                .and_then(|p| p.correlation_data.as_ref())
                .and_then(|c| <[u8; 8]>::try_from(c.as_ref()).ok().map(u64::from_be_bytes))
            else {
                continue;
            };
            let Some(sent) = in_flight.remove(&key) else { continue };
            let done = Instant::now();
            let is_error = reply.payload.windows(7).any(|w| w == b"\"error\"");
            if sent >= measure_from && (done <= stop || (open && sent < stop)) {
                let _ = histogram.record((done - sent).as_micros().max(1) as u64);
                requests += 1;
                errors += is_error as u64;
                if options.tally {
                    let count = |tally: &mut BTreeMap<String, u64>, field| {
                        let value = string_field(&reply.payload, field).unwrap_or("-");
                        *tally.entry(value.to_string()).or_default() += 1;
                    };
                    count(&mut by_node, "node");
                    count(&mut by_cache, "cache");
                }
            }
            counters.replies.fetch_add(1, Ordering::Relaxed);
            counters.errors.fetch_add(is_error as u64, Ordering::Relaxed);
            if per_connection.is_none() && done < stop {
                if self.send(options, seq) {
                    in_flight.insert(seq, Instant::now());
                }
                seq += 1;
            }
        }
        let _ = self.client.disconnect().await;
        Outcome { histogram, requests, errors, unanswered: in_flight.len() as u64, by_node, by_cache }
    }
}
