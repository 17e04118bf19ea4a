//! Request traces: OpenTelemetry spans over OTLP/HTTP (`[tracing]`).
//!
//! A transport hands the engine the caller's W3C `traceparent`; the
//! engine begins a trace (`Tracer::begin`), runs the request inside it,
//! and each stage records its span where it is timed (record.rs). At the
//! end the keep rule decides: a head-sampled trace, an error reply or a
//! request slower than its model's `slow_ms` goes to the exporter
//! (export.rs) through a bounded queue; the rest is dropped unbuilt.

mod export;
mod record;
pub mod w3c;

pub use export::TraceError;
pub use record::{Active, Kind, Open, Span, annotate, current, new_span_id, open, outgoing, span, within};

use crate::config::TracingConfig;
use opentelemetry::KeyValue;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Spans not exported, by `reason`: `queue_full` (the exporter is behind),
/// `export_failed` (the collector is down, slow or refused them) or
/// `span_limit` (a kept trace's spans past 64 on one request).
pub const SPANS_DROPPED: &str = "edgeinfer_trace_spans_dropped_total";
/// Spans the collector took.
pub const SPANS_EXPORTED: &str = "edgeinfer_trace_spans_exported_total";

/// The node's tracing: the head sampler, the keep rule and the exporter's
/// queue.
pub struct Tracer {
    ratio: f64,
    slow: Duration,
    model_slow: HashMap<String, Duration>,
    queue: export::Queue,
}

/// What a transport read of the caller's trace context.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caller<'a> {
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
}

impl Tracer {
    /// Starts the exporter task (on the running tokio runtime); `None`
    /// when `tracing.enabled` is off.
    pub fn start(config: &TracingConfig, node_id: &str) -> Result<Option<Arc<Tracer>>, TraceError> {
        if !config.enabled {
            return Ok(None);
        }
        let queue = export::start(config, node_id)?;
        let ms = Duration::from_millis;
        Ok(Some(Arc::new(Tracer {
            ratio: config.sample_ratio,
            slow: ms(config.slow_ms),
            model_slow: config.model_slow_ms.iter().map(|(m, v)| (m.clone(), ms(*v))).collect(),
            queue,
        })))
    }

    /// A request's trace: the caller's, continued, or a new one. A caller's
    /// sampled flag is kept (parent-based); a new trace is sampled at the
    /// configured ratio, by its id, so every node decides alike.
    pub fn begin(&self, caller: Caller<'_>) -> Arc<Active> {
        let parent = caller.traceparent.and_then(w3c::parse);
        let tracestate = parent.and(caller.tracestate).and_then(w3c::tracestate);
        match parent {
            Some(p) => Active::new(p.trace_id, Some(p.span_id), tracestate, p.sampled),
            None => {
                let trace_id = new_trace_id();
                Active::new(trace_id, None, None, sampled_at(trace_id, self.ratio))
            }
        }
    }

    /// The keep rule, at a request's end: sampled, failed, or slower than
    /// its model's latency bucket.
    pub fn keeps(&self, active: &Active, failed: bool, model: &str, elapsed: Duration) -> bool {
        let slow = self.model_slow.get(model).copied().unwrap_or(self.slow);
        active.sampled || failed || elapsed > slow
    }

    /// Ends a trace's root span: it is exported when `keep`, once the
    /// returned handle is dropped (after the transport's own span).
    pub fn finish(self: &Arc<Self>, active: Arc<Active>, root: Root, keep: bool) -> Finish {
        Finish { tracer: self.clone(), active, root: Some(root), keep }
    }
}

/// A new trace id: random, never zero.
fn new_trace_id() -> u128 {
    loop {
        let id = fastrand::u128(..);
        if id != 0 {
            return id;
        }
    }
}

/// The ratio sampler of OpenTelemetry's `TraceIdRatioBased`: the trace id's
/// low 63 bits against the ratio's share of them.
fn sampled_at(trace_id: u128, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    ((trace_id as u64) >> 1) < bound
}

/// The root span of a trace on this node: the request, or a follow-up.
#[derive(Debug)]
pub struct Root {
    pub name: &'static str,
    pub kind: Kind,
    pub start: Instant,
    pub attributes: Vec<KeyValue>,
    pub links: Vec<(u128, u64)>,
    pub error: Option<String>,
}

/// A trace whose root span ends when this is dropped, exported then when
/// the keep rule kept it.
pub struct Finish {
    tracer: Arc<Tracer>,
    active: Arc<Active>,
    root: Option<Root>,
    keep: bool,
}

impl std::fmt::Debug for Finish {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Finish").field("trace", &self.traceresponse()).field("keep", &self.keep).finish()
    }
}

impl Finish {
    /// The W3C `traceresponse` for the reply: this trace and its root
    /// span, flagged 01 when it is exported, so a device can log the id.
    pub fn traceresponse(&self) -> String {
        w3c::format(self.active.trace_id, self.active.root, self.keep)
    }

    /// Records a span of the transport's (the reply's publish) from `start`.
    pub fn span(&self, name: &'static str, start: Instant) {
        self.active.record(name, start, Vec::new());
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        let Some(root) = self.root.take() else { return };
        if !self.keep {
            return;
        }
        let remote_parent = self.active.remote_parent();
        let mut attributes = root.attributes;
        attributes.extend(self.active.annotations());
        self.active.push(Span {
            id: self.active.root,
            parent: remote_parent.unwrap_or(0),
            name: root.name,
            kind: root.kind,
            start: root.start,
            end: Instant::now(),
            attributes,
            links: root.links,
            error: root.error,
        });
        self.tracer.queue.send(self.active.take());
    }
}

/// A follow-up's trace (an async escalation's cloud calls and final
/// reply): its request's, nested under the request's root span, which
/// `traceparent` names; exported where the request was head-sampled, or
/// when the cloud does not answer.
pub fn follow(traceparent: &str) -> Option<Arc<Active>> {
    let request = w3c::parse(traceparent)?;
    Some(Active::new(request.trace_id, Some(request.span_id), None, request.sampled))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_sampler_exports_about_its_share_and_the_ends_exactly() {
        let share =
            |ratio| (0..20_000).filter(|_| sampled_at(new_trace_id(), ratio)).count() as f64 / 20_000.0;
        assert_eq!(share(0.0), 0.0);
        assert_eq!(share(1.0), 1.0);
        let tenth = share(0.1);
        assert!((0.08..0.12).contains(&tenth), "{tenth}");
    }

    fn tracer_at(ratio: f64) -> Tracer {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let mut model_slow = HashMap::new();
        model_slow.insert("digits".to_string(), Duration::from_millis(10));
        Tracer { ratio, slow: Duration::from_millis(100), model_slow, queue: export::Queue::new(tx, 64) }
    }

    #[test]
    fn a_callers_trace_is_continued_with_its_decision_and_a_broken_one_starts_anew() {
        let tracer = tracer_at(0.0);
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let caller = Caller { traceparent: Some(sampled), tracestate: Some("congo=t61rcWkgMzE") };
        let active = tracer.begin(caller);
        assert_eq!(active.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(active.remote_parent(), Some(0x00f067aa0ba902b7));
        assert!(active.sampled, "parent-based: the caller's sampled flag");
        let unsampled =
            tracer.begin(Caller { traceparent: Some(&sampled.replace("-01", "-00")), tracestate: None });
        assert!(!unsampled.sampled);
        let broken = tracer.begin(Caller { traceparent: Some("00-zz"), tracestate: None });
        assert_ne!(broken.trace_id, 0);
        assert_eq!(broken.remote_parent(), None);
        assert!(!broken.sampled, "a new trace at ratio 0");
        assert!(tracer_at(1.0).begin(Caller::default()).sampled);
    }

    #[test]
    fn the_keep_rule_keeps_sampled_failed_and_slow_requests_by_each_models_bucket() {
        let tracer = tracer_at(0.0);
        let active = tracer.begin(Caller::default());
        let ms = Duration::from_millis;
        assert!(!tracer.keeps(&active, false, "kws", ms(50)), "fast, ok, unsampled");
        assert!(tracer.keeps(&active, true, "kws", ms(1)), "an error reply");
        assert!(tracer.keeps(&active, false, "kws", ms(101)), "slower than slow_ms");
        assert!(tracer.keeps(&active, false, "digits", ms(11)), "slower than digits' own bucket");
        assert!(!tracer.keeps(&active, false, "digits", ms(9)));
        let sampled = tracer_at(1.0);
        assert!(sampled.keeps(&sampled.begin(Caller::default()), false, "kws", ms(1)));
    }

    #[tokio::test]
    async fn spans_nest_under_the_span_open_when_they_end_and_the_root_ends_last() {
        let tracer = Arc::new(tracer_at(1.0));
        let active = tracer.begin(Caller::default());
        let start = Instant::now();
        within(Some(active.clone()), async {
            span("resolve", Instant::now(), Vec::new);
            let outer = open("cascade").expect("traced");
            let call = outgoing("cloud.call").expect("traced");
            assert!(call.traceparent().ends_with(&format!("{:016x}-01", call.id)));
            drop(call);
            drop(outer);
            span("postprocess", Instant::now(), Vec::new);
        })
        .await;
        assert!(open("outside").is_none(), "no trace outside its task");
        let recorded = active.take();
        let parent = |name: &str| recorded.spans.iter().find(|s| s.name == name).unwrap().parent;
        let id = |name: &str| recorded.spans.iter().find(|s| s.name == name).unwrap().id;
        assert_eq!(parent("resolve"), active.root);
        assert_eq!(parent("cascade"), active.root);
        assert_eq!(parent("cloud.call"), id("cascade"));
        assert_eq!(parent("postprocess"), active.root, "the parent goes back when a span closes");
        let root = Root {
            name: "infer",
            kind: Kind::Server,
            start,
            attributes: Vec::new(),
            links: Vec::new(),
            error: None,
        };
        let finish = tracer.finish(active.clone(), root, true);
        assert!(finish.traceresponse().ends_with("-01"));
    }
}
