//! The exporter: one task owns the OTLP/HTTP exporter and drains a
//! bounded queue of finished traces into it in batches. A request only
//! hands its spans over (`Queue::send` never waits): when the collector is
//! down or slow the queue fills and spans are dropped and counted, and no
//! reply waits for it.

use super::record::{Kind, Recorded};
use crate::config::TracingConfig;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use opentelemetry::trace::{Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SpanData, SpanExporter, SpanLinks};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;

/// Spans sent in one export request at most.
const MAX_BATCH_SPANS: usize = 512;
/// How long the first trace of a batch waits for more.
const BATCH_WINDOW: Duration = Duration::from_millis(500);
/// A collector's answer is a few bytes; more is not read.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("tracing.headers_file = {path}: {reason}")]
    Headers { path: String, reason: String },
    #[error("tracing.endpoint = {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
}

/// The requests' side of the exporter's queue, bounded in spans.
pub struct Queue {
    tx: mpsc::UnboundedSender<Recorded>,
    queued: Arc<AtomicUsize>,
    capacity: usize,
}

impl Queue {
    pub(super) fn new(tx: mpsc::UnboundedSender<Recorded>, capacity: usize) -> Queue {
        Queue { tx, queued: Arc::new(AtomicUsize::new(0)), capacity }
    }

    /// Hands a finished trace to the exporter, or drops it (counted) when
    /// the queue holds `tracing.queue_spans` already.
    pub fn send(&self, trace: Recorded) {
        let spans = trace.spans.len();
        dropped("span_limit", trace.dropped as usize);
        let before = self.queued.fetch_add(spans, Ordering::Relaxed);
        if before + spans > self.capacity {
            self.queued.fetch_sub(spans, Ordering::Relaxed);
            dropped("queue_full", spans);
            return;
        }
        if let Err(unsent) = self.tx.send(trace) {
            self.queued.fetch_sub(spans, Ordering::Relaxed);
            dropped("queue_full", unsent.0.spans.len());
        }
    }
}

fn dropped(reason: &'static str, spans: usize) {
    if spans > 0 {
        metrics::counter!(super::SPANS_DROPPED, "reason" => reason).increment(spans as u64);
    }
}

/// Builds the exporter and starts its task.
pub fn start(config: &TracingConfig, node_id: &str) -> Result<Queue, TraceError> {
    let endpoint_error = |reason: String| TraceError::Endpoint { endpoint: config.endpoint.clone(), reason };
    let https = config.endpoint.starts_with("https://");
    let tls = crate::tls::client_config("tracing.endpoint", None, None, https)
        .map_err(|e| endpoint_error(e.to_string()))?;
    let headers = match &config.headers_file {
        Some(path) => read_headers(path)?,
        None => HashMap::new(),
    };
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(config.endpoint.clone())
        .with_timeout(Duration::from_millis(config.timeout_ms))
        .with_headers(headers)
        .with_http_client(HttpClient::new(tls))
        .build()
        .map_err(|e| endpoint_error(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name(config.service_name.clone())
        .with_attributes([KeyValue::new("service.instance.id", node_id.to_string())])
        .build();
    exporter.set_resource(&resource);
    let (tx, rx) = mpsc::unbounded_channel();
    let queue = Queue::new(tx, config.queue_spans);
    let timeout = Duration::from_millis(config.timeout_ms);
    tokio::spawn(run(rx, queue.queued.clone(), exporter, timeout));
    Ok(queue)
}

/// `Name: value` lines; `#` starts a comment.
fn read_headers(path: &std::path::Path) -> Result<HashMap<String, String>, TraceError> {
    let error = |reason: String| TraceError::Headers { path: path.display().to_string(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| error(format!("cannot read: {e}")))?;
    let mut headers = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(error(format!("line {} is not `Name: value`", n + 1)));
        };
        let name = name.trim();
        let valid = hyper::header::HeaderName::from_bytes(name.as_bytes()).is_ok()
            && hyper::header::HeaderValue::from_str(value.trim()).is_ok();
        if !valid {
            return Err(error(format!("line {}: {name:?} is not a valid header name and value", n + 1)));
        }
        headers.insert(name.to_string(), value.trim().to_string());
    }
    Ok(headers)
}

/// The exporter task: a batch at a time, each bounded by `timeout`.
async fn run(
    mut rx: mpsc::UnboundedReceiver<Recorded>,
    queued: Arc<AtomicUsize>,
    exporter: opentelemetry_otlp::SpanExporter,
    timeout: Duration,
) {
    let scope = InstrumentationScope::builder("edgeinfer").with_version(env!("CARGO_PKG_VERSION")).build();
    let mut failing = false;
    while let Some(first) = rx.recv().await {
        // Traces that end within BATCH_WINDOW of the first go in one
        // export: at 1% of a few thousand requests a second that is one
        // request to the collector a second, not one per trace.
        let closes = tokio::time::Instant::now() + BATCH_WINDOW;
        let mut batch = vec![first];
        let mut spans = batch[0].spans.len();
        while spans < MAX_BATCH_SPANS {
            let Ok(Some(more)) = tokio::time::timeout_at(closes, rx.recv()).await else { break };
            spans += more.spans.len();
            batch.push(more);
        }
        queued.fetch_sub(spans, Ordering::Relaxed);
        let data: Vec<SpanData> = batch.into_iter().flat_map(|trace| span_data(trace, &scope)).collect();
        let outcome = match tokio::time::timeout(timeout, exporter.export(data)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within tracing.timeout_ms = {}", timeout.as_millis())),
        };
        match outcome {
            Ok(()) => {
                metrics::counter!(super::SPANS_EXPORTED).increment(spans as u64);
                if std::mem::take(&mut failing) {
                    tracing::info!("traces: the collector takes spans again");
                }
            }
            Err(why) => {
                dropped("export_failed", spans);
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!("traces: export failed ({why}); spans are dropped until it works");
                }
            }
        }
    }
}

/// A trace's spans as the OTLP exporter takes them.
fn span_data(trace: Recorded, scope: &InstrumentationScope) -> Vec<SpanData> {
    let (wall, epoch) = (trace.wall, trace.epoch);
    let at = |t: Instant| -> SystemTime {
        match t.checked_duration_since(epoch) {
            Some(after) => wall + after,
            None => wall - epoch.duration_since(t),
        }
    };
    let state = trace.tracestate.as_deref().and_then(|s| s.parse::<TraceState>().ok()).unwrap_or_default();
    let trace_id = TraceId::from_bytes(trace.trace_id.to_be_bytes());
    let context = |span: u64, remote: bool, state: TraceState| {
        SpanContext::new(trace_id, SpanId::from_bytes(span.to_be_bytes()), TraceFlags::SAMPLED, remote, state)
    };
    trace
        .spans
        .into_iter()
        .map(|span| {
            let links = span.links.iter().map(|&(t, s)| {
                let linked = SpanContext::new(
                    TraceId::from_bytes(t.to_be_bytes()),
                    SpanId::from_bytes(s.to_be_bytes()),
                    TraceFlags::SAMPLED,
                    t != trace.trace_id,
                    TraceState::default(),
                );
                Link::with_context(linked)
            });
            SpanData {
                span_context: context(span.id, false, state.clone()),
                parent_span_id: SpanId::from_bytes(span.parent.to_be_bytes()),
                parent_span_is_remote: span.parent != 0 && Some(span.parent) == trace.remote_parent,
                span_kind: match span.kind {
                    Kind::Server => SpanKind::Server,
                    Kind::Client => SpanKind::Client,
                    Kind::Internal => SpanKind::Internal,
                },
                name: Cow::Borrowed(span.name),
                start_time: at(span.start),
                end_time: at(span.end),
                attributes: span.attributes,
                dropped_attributes_count: 0,
                events: Default::default(),
                links: {
                    let mut all = SpanLinks::default();
                    all.links = links.collect();
                    all
                },
                status: span.error.map(Status::error).unwrap_or(Status::Unset),
                instrumentation_scope: scope.clone(),
            }
        })
        .collect()
}

/// The exporter's HTTP client: hyper's, on the node's rustls and ring,
/// like the cloud tier's.
#[derive(Debug)]
struct HttpClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl HttpClient {
    fn new(tls: rustls::ClientConfig) -> HttpClient {
        HttpClient { client: crate::tls::https_client(tls, Duration::from_secs(5)) }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for HttpClient {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<Bytes>,
    ) -> Result<opentelemetry_http::Response<Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let response = self.client.request(hyper::Request::from_parts(parts, Full::new(body))).await?;
        let (parts, body) = response.into_parts();
        let body = Limited::new(body, MAX_RESPONSE_BYTES).collect().await?.to_bytes();
        Ok(opentelemetry_http::Response::from_parts(parts, body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::record::{Active, Span};

    #[test]
    fn a_full_queue_drops_whole_traces_and_the_rest_wait_in_order() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let queue = Queue::new(tx, 4);
        let trace = |spans: usize| {
            let active = Active::new(7, None, None, true);
            for _ in 0..spans {
                active.record("stage", Instant::now(), Vec::new());
            }
            active.take()
        };
        queue.send(trace(3));
        queue.send(trace(3));
        queue.send(trace(1));
        assert_eq!(rx.try_recv().unwrap().spans.len(), 3);
        assert_eq!(rx.try_recv().unwrap().spans.len(), 1, "the second trace did not fit");
        assert!(rx.try_recv().is_err());
        // A request keeps at most MAX_SPANS spans; the rest are counted
        // (as `span_limit` when its trace is sent).
        let long = Active::new(7, None, None, true);
        for _ in 0..crate::trace::record::MAX_SPANS + 2 {
            long.record("stage", Instant::now(), Vec::new());
        }
        let long = long.take();
        assert_eq!((long.spans.len(), long.dropped), (crate::trace::record::MAX_SPANS, 2));
    }

    #[test]
    fn spans_become_otlp_spans_with_their_ids_parents_times_links_and_status() {
        let active = Active::new(0xabc, Some(0x11), Some("k=v".into()), false);
        let began = active.began();
        active.push(Span {
            id: 0x22,
            parent: 0x11,
            name: "infer",
            kind: Kind::Server,
            start: began,
            end: began + Duration::from_millis(3),
            attributes: vec![KeyValue::new("edgeinfer.model", "digits")],
            links: vec![(0xdef, 0x33)],
            error: Some("internal: boom".into()),
        });
        let scope = InstrumentationScope::builder("edgeinfer").build();
        let data = span_data(active.take(), &scope);
        let span = &data[0];
        assert_eq!(span.span_context.trace_id(), TraceId::from_bytes(0xabc_u128.to_be_bytes()));
        assert_eq!(span.span_context.span_id(), SpanId::from_bytes(0x22_u64.to_be_bytes()));
        assert_eq!(span.parent_span_id, SpanId::from_bytes(0x11_u64.to_be_bytes()));
        assert!(span.parent_span_is_remote, "the caller's span");
        assert_eq!(span.span_kind, SpanKind::Server);
        assert_eq!(span.end_time.duration_since(span.start_time).unwrap(), Duration::from_millis(3));
        assert_eq!(span.links.links[0].span_context.span_id(), SpanId::from_bytes(0x33_u64.to_be_bytes()));
        assert_eq!(span.status, Status::error("internal: boom"));
        assert_eq!(span.span_context.trace_state().header(), "k=v");
    }

    #[test]
    fn a_headers_file_reads_name_value_lines_and_names_a_bad_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        std::fs::write(&path, "# key\nX-Api-Key: s3cret\n\nAuthorization: Bearer t\n").unwrap();
        let headers = read_headers(&path).unwrap();
        assert_eq!(headers["X-Api-Key"], "s3cret");
        assert_eq!(headers["Authorization"], "Bearer t");
        std::fs::write(&path, "X-Api-Key s3cret\n").unwrap();
        let error = read_headers(&path).unwrap_err().to_string();
        assert!(error.contains("tracing.headers_file") && error.contains("line 1"), "{error}");
    }
}
