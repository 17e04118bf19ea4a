//! One request's spans while it runs. The request's task carries its
//! record in a task-local, so a stage records its span where it is timed
//! without the record passing through every call; code on other tasks or
//! threads (the spool, the inference threads) is handed what it needs.
//! Every request is recorded, sampled or not, since the keep rule decides
//! only at its end; recording is a few timestamps and small vectors, and
//! nothing is built for export unless it is kept.

use opentelemetry::KeyValue;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

/// The most spans one request keeps (a request retried against the cloud
/// many times stops adding spans, and counts them dropped).
pub const MAX_SPANS: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The request as the transport received it.
    Server,
    /// A call out: the cloud tier.
    Client,
    Internal,
}

/// A span of a trace, as the exporter reads it.
#[derive(Debug)]
pub struct Span {
    pub id: u64,
    pub parent: u64,
    pub name: &'static str,
    pub kind: Kind,
    pub start: Instant,
    pub end: Instant,
    pub attributes: Vec<KeyValue>,
    /// Other spans it is about: (trace id, span id).
    pub links: Vec<(u128, u64)>,
    /// Set where the span failed: the status description.
    pub error: Option<String>,
}

/// One trace's spans on this node, and what the exporter needs with them.
#[derive(Debug)]
pub struct Recorded {
    pub trace_id: u128,
    /// The caller's span the root nests under, if it came with one.
    pub remote_parent: Option<u64>,
    pub tracestate: Option<String>,
    /// Wall-clock time at `epoch`: spans are timed by `Instant` and placed
    /// on the wall clock once, at export.
    pub wall: SystemTime,
    pub epoch: Instant,
    pub spans: Vec<Span>,
    /// Spans over `MAX_SPANS`, not kept.
    pub dropped: u32,
}

/// A trace being recorded: a request's, or an escalation's follow-up.
#[derive(Debug)]
pub struct Active {
    pub trace_id: u128,
    /// The root span: the request (or follow-up) on this node.
    pub root: u64,
    /// The head sampling decision (a caller's, else the ratio's).
    pub sampled: bool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    recorded: Recorded,
    /// The span new spans nest under.
    parent: u64,
    /// What the stages learned for the root span (the tier asked for).
    annotations: Vec<KeyValue>,
}

impl State {
    /// Keeps `span`, or counts it dropped past `MAX_SPANS`.
    fn keep(&mut self, span: Span) {
        if self.recorded.spans.len() < MAX_SPANS {
            self.recorded.spans.push(span);
        } else {
            self.recorded.dropped += 1;
        }
    }
}

pub fn new_span_id() -> u64 {
    loop {
        let id = fastrand::u64(..);
        if id != 0 {
            return id;
        }
    }
}

impl Active {
    pub fn new(
        trace_id: u128,
        remote_parent: Option<u64>,
        tracestate: Option<String>,
        sampled: bool,
    ) -> Arc<Active> {
        let root = new_span_id();
        let recorded = Recorded {
            trace_id,
            remote_parent,
            tracestate,
            wall: SystemTime::now(),
            epoch: Instant::now(),
            spans: Vec::with_capacity(12),
            dropped: 0,
        };
        Arc::new(Active {
            trace_id,
            root,
            sampled,
            state: Mutex::new(State { recorded, parent: root, annotations: Vec::new() }),
        })
    }

    /// `traceparent` naming `span` of this trace, with the head decision.
    pub fn traceparent(&self, span: u64) -> String {
        super::w3c::format(self.trace_id, span, self.sampled)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The span new spans nest under now.
    pub fn parent(&self) -> u64 {
        self.state().parent
    }

    /// Keeps `span`, with the parent it names (0: a root without one).
    pub fn push(&self, span: Span) {
        self.state().keep(span);
    }

    /// A span named `name` from `start` to now, under the current parent.
    pub fn record(&self, name: &'static str, start: Instant, attributes: Vec<KeyValue>) {
        self.add(name, (start, Instant::now()), attributes);
    }

    /// Takes what the stages noted for the root span.
    pub fn annotations(&self) -> Vec<KeyValue> {
        std::mem::take(&mut self.state().annotations)
    }

    /// The caller's span this trace's root nests under, if any.
    pub fn remote_parent(&self) -> Option<u64> {
        self.state().recorded.remote_parent
    }

    /// A span from `timed.0` to `timed.1`, under the current parent.
    pub fn add(&self, name: &'static str, timed: (Instant, Instant), attributes: Vec<KeyValue>) {
        let id = new_span_id();
        let mut state = self.state();
        let parent = state.parent;
        let span = Span {
            id,
            parent,
            name,
            kind: Kind::Internal,
            start: timed.0,
            end: timed.1,
            attributes,
            links: Vec::new(),
            error: None,
        };
        state.keep(span);
    }

    /// When this trace began on this node.
    pub fn began(&self) -> Instant {
        self.state().recorded.epoch
    }

    /// Takes what was recorded, for export.
    pub fn take(&self) -> Recorded {
        let mut state = self.state();
        let empty = Recorded {
            trace_id: self.trace_id,
            remote_parent: state.recorded.remote_parent,
            tracestate: None,
            wall: state.recorded.wall,
            epoch: state.recorded.epoch,
            spans: Vec::new(),
            dropped: 0,
        };
        std::mem::replace(&mut state.recorded, empty)
    }
}

/// A span open while its stage runs: the spans recorded meanwhile nest
/// under it. Recorded when closed or dropped.
pub struct Open {
    active: Arc<Active>,
    pub id: u64,
    outer: u64,
    name: &'static str,
    kind: Kind,
    start: Instant,
    pub attributes: Vec<KeyValue>,
    pub error: Option<String>,
}

impl Open {
    /// `traceparent` naming this span (sent with a call out).
    pub fn traceparent(&self) -> String {
        self.active.traceparent(self.id)
    }

    pub fn set(&mut self, attribute: KeyValue) {
        self.attributes.push(attribute);
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let span = Span {
            id: self.id,
            parent: self.outer,
            name: self.name,
            kind: self.kind,
            start: self.start,
            end: Instant::now(),
            attributes: std::mem::take(&mut self.attributes),
            links: Vec::new(),
            error: self.error.take(),
        };
        let mut state = self.active.state();
        // Spans of a stage running beside this one may have nested under it
        // meanwhile; the parent goes back to where it was when it opened.
        state.parent = self.outer;
        state.keep(span);
    }
}

tokio::task_local! {
    static CURRENT: Arc<Active>;
}

/// Runs `future` with `active` as its task's trace (or untraced).
pub async fn within<F: Future>(active: Option<Arc<Active>>, future: F) -> F::Output {
    match active {
        Some(active) => CURRENT.scope(active, future).await,
        None => future.await,
    }
}

/// The trace of the task running now, if it is traced.
pub fn current() -> Option<Arc<Active>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// Records a span from `start` to now in the current trace, if any;
/// `attributes` is only called when there is one.
pub fn span(name: &'static str, start: Instant, attributes: impl FnOnce() -> Vec<KeyValue>) {
    let _ = CURRENT.try_with(|active| active.record(name, start, attributes()));
}

/// Notes an attribute for the current trace's root span, if any.
pub fn annotate(attribute: impl FnOnce() -> KeyValue) {
    let _ = CURRENT.try_with(|active| active.state().annotations.push(attribute()));
}

/// Opens a span in the current trace, if any.
pub fn open(name: &'static str) -> Option<Open> {
    open_kind(name, Kind::Internal)
}

/// Opens a span for a call out of the node: its `traceparent` goes with
/// the call, so the callee's spans nest under it.
pub fn outgoing(name: &'static str) -> Option<Open> {
    open_kind(name, Kind::Client)
}

fn open_kind(name: &'static str, kind: Kind) -> Option<Open> {
    let active = current()?;
    let id = new_span_id();
    let outer = {
        let mut state = active.state();
        std::mem::replace(&mut state.parent, id)
    };
    let start = Instant::now();
    Some(Open { active, id, outer, name, kind, start, attributes: Vec::new(), error: None })
}
