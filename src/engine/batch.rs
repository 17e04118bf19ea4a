//! Stage 4a: micro-batching. A model version's queue is owned by its inference
//! threads: an idle one takes the queue, forms the next batch and runs it
//! itself, so a request crosses one thread boundary each way. Each entry
//! carries its own reply channel. A window opens when its first request
//! arrives and takes what already waits; it stays open for more (up to the
//! batch limit, `max_delay`, or earlier when waiting would make a request
//! miss its deadline) only while another of the model's threads is running
//! a batch: then waiting can pay, since the model is busy anyway. An idle
//! model runs a lone request at once; under load the queue grows while the
//! threads run, and the next batch takes it all. Requests already past
//! their deadline are answered `deadline_exceeded` without running.
//!
//! The window logic (`Window`) takes the time as an argument, so its tests
//! run on an injected clock; the thread loop waits with `recv_timeout`,
//! which is precise to tens of microseconds (tokio's timer rounds to 1 ms).

use super::preprocess::Prepared;
use crate::model::RawOutput;
use crate::protocol::{InferError, TensorData};
use crate::telemetry::{self, Stage};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Where an inference thread sends a queued request's outputs.
pub type OutputSender = oneshot::Sender<Result<Vec<RawOutput>, InferError>>;

/// One request waiting in a model's queue.
pub struct Queued {
    pub prepared: Prepared,
    pub deadline: Option<Instant>,
    pub reply: OutputSender,
    /// When it joined the queue (for the `queue` stage metric).
    pub enqueued: Instant,
    /// Where a traced request learns of the batch that ran it.
    pub traced: Option<Traced>,
}

/// A traced request's part in its batch (`[tracing]`): its `inference`
/// span, and where the batch's thread says how the batch ran.
pub struct Traced {
    pub trace_id: u128,
    pub span: u64,
    pub ran: Arc<OnceLock<Arc<BatchRun>>>,
}

/// How a batch ran, for the traces of the requests it carried. The first
/// traced request's `inference` span is the batch's span: it links to
/// each request the batch carried, and theirs link to it.
#[derive(Debug)]
pub struct BatchRun {
    pub started: Instant,
    pub ended: Instant,
    pub rows: usize,
    pub requests: usize,
    /// Each traced request's (trace id, `inference` span id), in queue order.
    pub spans: Vec<(u128, u64)>,
}

/// Requests run together; rows are packed in queue order.
pub struct Batch {
    pub entries: Vec<Queued>,
    pub rows: usize,
    /// When its window opened (the first request's arrival at the batcher).
    pub opened: Instant,
}

/// How a model's batches are formed.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    /// Most rows in one batch (a single larger request still runs, alone).
    pub max_batch: usize,
    /// Longest a window stays open waiting for more requests.
    pub max_delay: Duration,
    /// AIMD on the batch limit, to keep batch latency inside this budget.
    pub latency_budget: Option<Duration>,
}

impl BatchPolicy {
    /// The batching a model's serving settings ask for.
    pub fn new(serving: &crate::config::ServingConfig) -> BatchPolicy {
        BatchPolicy {
            max_batch: serving.max_batch,
            max_delay: Duration::from_micros(serving.max_delay_us),
            latency_budget: serving.latency_budget_ms.map(|ms| Duration::from_secs_f64(ms / 1e3)),
        }
    }
}

impl Default for BatchPolicy {
    fn default() -> Self {
        BatchPolicy { max_batch: 32, max_delay: Duration::from_millis(2), latency_budget: None }
    }
}

/// Additive increase, multiplicative decrease of the batch limit (Clipper):
/// +1 row while batches finish inside the budget, -10% when one does not.
#[derive(Debug, Clone)]
pub struct Aimd {
    budget: Duration,
    max: usize,
    limit: f64,
}

impl Aimd {
    pub fn new(budget: Duration, max: usize) -> Aimd {
        Aimd { budget, max: max.max(1), limit: 1.0 }
    }

    pub fn limit(&self) -> usize {
        self.limit as usize
    }

    pub fn observe(&mut self, latency: Duration) {
        self.limit = if latency <= self.budget {
            (self.limit + 1.0).min(self.max as f64)
        } else {
            (self.limit * 0.9).max(1.0)
        };
    }
}

/// Headroom before a deadline for handing the batch over and replying.
const DEADLINE_MARGIN: Duration = Duration::from_micros(200);

fn expired_error() -> InferError {
    InferError::deadline_exceeded(
        "the request's deadline passed while it waited for the model; allow more time",
    )
}

/// An open window: the entries admitted so far and when it must close.
pub struct Window {
    batch: Batch,
    close_at: Instant,
}

impl Window {
    pub fn open(now: Instant, policy: &BatchPolicy) -> Window {
        Window {
            batch: Batch { entries: Vec::new(), rows: 0, opened: now },
            close_at: now + policy.max_delay,
        }
    }

    pub fn close_at(&self) -> Instant {
        self.close_at
    }

    pub fn rows(&self) -> usize {
        self.batch.rows
    }

    /// Takes `entry` unless its deadline has passed (then it is answered
    /// `deadline_exceeded`); a deadline closes the window early enough for the
    /// batch to run in time, `expected_run` being the usual run time.
    pub fn admit(&mut self, entry: Queued, now: Instant, expected_run: Duration) {
        if entry.reply.is_closed() {
            return;
        }
        if let Some(deadline) = entry.deadline {
            if deadline <= now {
                let _ = entry.reply.send(Err(expired_error()));
                return;
            }
            let latest_start = deadline.checked_sub(expected_run + DEADLINE_MARGIN).unwrap_or(now).max(now);
            self.close_at = self.close_at.min(latest_start);
        }
        self.batch.rows += entry.prepared.rows;
        self.batch.entries.push(entry);
    }

    /// The batch to run, without the entries that expired while it was open
    /// (answered `deadline_exceeded`); `None` when nothing is left.
    pub fn close(self, now: Instant) -> Option<Batch> {
        let Batch { entries, opened, .. } = self.batch;
        let (live, expired): (Vec<Queued>, Vec<Queued>) =
            entries.into_iter().partition(|e| e.deadline.is_none_or(|d| d > now));
        for entry in expired {
            let _ = entry.reply.send(Err(expired_error()));
        }
        let rows = live.iter().map(|e| e.prepared.rows).sum();
        (!live.is_empty()).then_some(Batch { entries: live, rows, opened })
    }
}

/// What one inference thread learns from the batches it ran.
pub struct Pacing {
    aimd: Option<Aimd>,
    /// Moving average of batch run time, for deadline-aware closing.
    expected_run: Duration,
}

impl Pacing {
    pub fn new(policy: &BatchPolicy) -> Pacing {
        Pacing {
            aimd: policy.latency_budget.map(|b| Aimd::new(b, policy.max_batch)),
            expected_run: Duration::ZERO,
        }
    }

    fn limit(&self, policy: &BatchPolicy) -> usize {
        self.aimd.as_ref().map(|a| a.limit()).unwrap_or(policy.max_batch)
    }

    fn observe(&mut self, latency: Duration, run: Duration) {
        self.expected_run = (self.expected_run * 7 + run) / 8;
        if let Some(aimd) = &mut self.aimd {
            aimd.observe(latency);
        }
    }
}

/// Forms the next batch from the shared queue: waits for a first request,
/// takes what already waits, then, while `running` (the model's threads
/// running a batch) is not zero, waits for more until the window closes.
/// `None` once the queue is closed.
pub fn next_batch(
    queue: &Mutex<Receiver<Queued>>,
    policy: &BatchPolicy,
    pacing: &Pacing,
    model: &str,
    running: &AtomicUsize,
) -> Option<Batch> {
    let depth = metrics::gauge!(telemetry::QUEUE_DEPTH, "model" => model.to_string());
    // Holding the queue while the window is open keeps the other threads
    // from splitting this batch.
    // A thread that panicked while forming a batch poisoned the lock; the
    // queue itself is intact, and the others go on with it.
    let queue = queue.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let first = queue.recv().ok()?;
        depth.decrement(1.0);
        let now = Instant::now();
        let mut window = Window::open(now, policy);
        window.admit(first, now, pacing.expected_run);
        let limit = pacing.limit(policy);
        while window.rows() < limit {
            match queue.try_recv() {
                Ok(entry) => {
                    depth.decrement(1.0);
                    window.admit(entry, Instant::now(), pacing.expected_run);
                    continue;
                }
                Err(TryRecvError::Disconnected) => break,
                // Idle: nothing would come sooner for waiting.
                Err(TryRecvError::Empty) if running.load(Ordering::Relaxed) == 0 => break,
                Err(TryRecvError::Empty) => {}
            }
            let now = Instant::now();
            if now >= window.close_at() {
                break;
            }
            match queue.recv_timeout(window.close_at() - now) {
                Ok(entry) => {
                    depth.decrement(1.0);
                    window.admit(entry, Instant::now(), pacing.expected_run)
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if let Some(batch) = window.close(Instant::now()) {
            return Some(batch);
        }
    }
}

/// An inference thread: take the next batch, run it, learn from it.
pub fn run_batches(
    queue: &Mutex<Receiver<Queued>>,
    policy: &BatchPolicy,
    model: &str,
    running: &AtomicUsize,
    run: impl Fn(usize, &TensorData) -> Result<Vec<RawOutput>, InferError>,
) {
    let mut pacing = Pacing::new(policy);
    let rows_metric = metrics::histogram!(telemetry::BATCH_ROWS, "model" => model.to_string());
    while let Some(batch) = next_batch(queue, policy, &pacing, model, running) {
        /// Counts this thread as running until the batch is done (also
        /// when it panics).
        struct Running<'a>(&'a AtomicUsize);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        running.fetch_add(1, Ordering::Relaxed);
        let _running = Running(running);
        let opened = batch.opened;
        let started = Instant::now();
        rows_metric.record(batch.rows as f64);
        let waited: Vec<f64> = batch.entries.iter().map(|e| (started - e.enqueued).as_secs_f64()).collect();
        let (batch_rows, requests) = (batch.rows, batch.entries.len());
        let traced: Vec<_> = batch.entries.iter().filter_map(|e| e.traced.as_ref()).collect();
        let spans: Vec<(u128, u64)> = traced.iter().map(|t| (t.trace_id, t.span)).collect();
        let slots: Vec<_> = traced.iter().map(|t| t.ran.clone()).collect();
        // The stages are recorded before the replies go out, so a scrape
        // after a reply always counts its request.
        batch.execute(|rows, input| {
            let outputs = run(rows, input);
            let run_seconds = started.elapsed().as_secs_f64();
            for &queued in &waited {
                telemetry::observe_stage(model, Stage::Queue, queued);
                telemetry::observe_stage(model, Stage::Inference, run_seconds);
            }
            if !slots.is_empty() {
                let ran =
                    Arc::new(BatchRun { started, ended: Instant::now(), rows: batch_rows, requests, spans });
                for slot in slots {
                    let _ = slot.set(ran.clone());
                }
            }
            outputs
        });
        let done = Instant::now();
        pacing.observe(done - opened, done - started);
    }
}

impl Batch {
    /// Runs the packed rows with `run` and hands each requester its own rows.
    pub fn execute(self, run: impl FnOnce(usize, &TensorData) -> Result<Vec<RawOutput>, InferError>) {
        let mut entries = self.entries;
        let result = match entries.as_slice() {
            [one] => run(one.prepared.rows, &one.prepared.input),
            _ => {
                // The inputs are not needed after packing: move, do not copy.
                let mut taken = entries
                    .iter_mut()
                    .map(|e| std::mem::replace(&mut e.prepared.input, TensorData::F32(Vec::new())));
                let mut input = taken.next().expect("a batch has entries");
                let packed = taken.try_for_each(|part| input.extend(part));
                match packed {
                    Ok(()) => run(self.rows, &input),
                    Err(m) => Err(InferError::internal(m)),
                }
            }
        };
        let outputs = match result {
            Ok(outputs) => outputs,
            Err(e) => {
                for entry in entries {
                    let _ = entry.reply.send(Err(e.clone()));
                }
                return;
            }
        };
        if entries.len() == 1 {
            let _ = entries.pop().expect("one entry").reply.send(Ok(outputs));
            return;
        }
        let mut first_row = 0;
        for entry in entries {
            let rows = entry.prepared.rows;
            let mine = outputs.iter().map(|o| o.rows(first_row, rows)).collect();
            first_row += rows;
            let _ = entry.reply.send(Ok(mine));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ErrorCode;

    type Answer = oneshot::Receiver<Result<Vec<RawOutput>, InferError>>;

    fn entry(rows: usize, deadline: Option<Instant>) -> (Queued, Answer) {
        let (reply, rx) = oneshot::channel();
        let input = TensorData::F32(vec![0.0; rows * 2]);
        (
            Queued {
                prepared: Prepared { rows, input },
                deadline,
                reply,
                enqueued: Instant::now(),
                traced: None,
            },
            rx,
        )
    }

    fn policy(max_batch: usize, max_delay_ms: u64) -> BatchPolicy {
        BatchPolicy { max_batch, max_delay: Duration::from_millis(max_delay_ms), latency_budget: None }
    }

    const MS: Duration = Duration::from_millis(1);

    /// Drives `next_batch` over a queue already holding `entries`, so the
    /// window logic meets the real loop without any waiting.
    fn batch_of(entries: Vec<Queued>, policy: &BatchPolicy) -> Option<Batch> {
        let (tx, rx) = std::sync::mpsc::channel();
        for e in entries {
            tx.send(e).unwrap();
        }
        drop(tx);
        next_batch(&Mutex::new(rx), policy, &Pacing::new(policy), "test", &AtomicUsize::new(1))
    }

    #[test]
    fn an_idle_model_runs_a_lone_request_at_once_and_a_busy_one_waits_for_more() {
        let p = policy(8, 300);
        for (running, waits) in [(0, false), (1, true)] {
            let (tx, rx) = std::sync::mpsc::channel();
            let (e, _reply) = entry(1, None);
            tx.send(e).unwrap();
            let started = Instant::now();
            let batch = next_batch(&Mutex::new(rx), &p, &Pacing::new(&p), "test", &AtomicUsize::new(running))
                .unwrap();
            let took = started.elapsed();
            assert_eq!(batch.rows, 1);
            if waits {
                assert!(took >= 300 * MS, "another batch running: the window waits ({took:?})");
            } else {
                assert!(took < 100 * MS, "idle: no window ({took:?})");
            }
            drop(tx);
        }
    }

    #[test]
    fn the_window_closes_at_max_batch() {
        let p = policy(4, 10_000);
        let mut keep = Vec::new();
        let entries: Vec<Queued> = (0..6)
            .map(|_| {
                let (e, rx) = entry(1, None);
                keep.push(rx);
                e
            })
            .collect();
        // A 10 s window, yet the batch is ready at once: it is full.
        let started = Instant::now();
        let batch = batch_of(entries, &p).unwrap();
        assert_eq!((batch.rows, batch.entries.len()), (4, 4));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn the_window_closes_at_max_delay_counted_from_the_first_request() {
        let t0 = Instant::now();
        let p = policy(32, 7);
        let mut w = Window::open(t0, &p);
        let (a, _a) = entry(3, None);
        w.admit(a, t0, Duration::ZERO);
        let (b, _b) = entry(2, None);
        w.admit(b, t0 + 2 * MS, Duration::ZERO);
        assert_eq!(w.close_at(), t0 + 7 * MS, "the window opened with the first request");
        assert_eq!(w.rows(), 5);
        let batch = w.close(t0 + 7 * MS).unwrap();
        assert_eq!(batch.entries.len(), 2);
    }

    #[test]
    fn a_deadline_closes_the_window_early_enough_to_run_in_time() {
        let t0 = Instant::now();
        let mut w = Window::open(t0, &policy(32, 50));
        let (a, _a) = entry(1, None);
        w.admit(a, t0, Duration::ZERO);
        let (b, _b) = entry(1, Some(t0 + 3 * MS));
        // Batches usually take 500 us to run.
        w.admit(b, t0, Duration::from_micros(500));
        assert_eq!(w.close_at(), t0 + 3 * MS - Duration::from_micros(500) - DEADLINE_MARGIN);
        let close_at = w.close_at();
        let batch = w.close(close_at).unwrap();
        assert_eq!(batch.rows, 2, "both run, the one with the deadline in time");
    }

    #[test]
    fn expired_requests_are_answered_deadline_exceeded_and_do_not_run() {
        let t0 = Instant::now();
        let mut w = Window::open(t0 + MS, &policy(32, 5));
        let (late, late_rx) = entry(1, Some(t0));
        w.admit(late, t0 + MS, Duration::ZERO);
        assert_eq!(w.rows(), 0, "not admitted");
        let (ok, _ok) = entry(2, None);
        w.admit(ok, t0 + MS, Duration::ZERO);
        // One whose deadline passes while the window is open does not run either.
        let (soon, mut soon_rx) = entry(1, Some(t0 + 2 * MS));
        w.admit(soon, t0 + MS, Duration::ZERO);
        let batch = w.close(t0 + 3 * MS).unwrap();
        assert_eq!((batch.entries.len(), batch.rows), (1, 2));
        let mut late_rx = late_rx;
        assert_eq!(late_rx.try_recv().unwrap().unwrap_err().code, ErrorCode::DeadlineExceeded);
        assert_eq!(soon_rx.try_recv().unwrap().unwrap_err().code, ErrorCode::DeadlineExceeded);
        // A window left with only expired requests forms no batch.
        let mut w = Window::open(t0, &policy(32, 5));
        let (e, _e) = entry(1, Some(t0 + MS));
        w.admit(e, t0, Duration::ZERO);
        assert!(w.close(t0 + 2 * MS).is_none());
    }

    /// Property: whatever the mix of multi-row requests, each requester gets
    /// back exactly its own rows, in order (an identity model echoes rows).
    #[test]
    fn rows_of_mixed_requests_return_to_their_own_requester_in_order() {
        let mut rng = fastrand::Rng::with_seed(7);
        for case in 0..500 {
            let n = rng.usize(1..12);
            let width = rng.usize(1..5);
            let mut receivers = Vec::new();
            let mut entries = Vec::new();
            let mut rows_total = 0;
            for r in 0..n {
                let rows = rng.usize(1..6);
                let data: Vec<f32> =
                    (0..rows * width).map(|i| (case * 10_000 + r * 100 + i) as f32).collect();
                let (reply, rx) = oneshot::channel();
                receivers.push((rows, data.clone(), rx));
                entries.push(Queued {
                    prepared: Prepared { rows, input: TensorData::F32(data) },
                    deadline: None,
                    reply,
                    enqueued: Instant::now(),
                    traced: None,
                });
                rows_total += rows;
            }
            let batch = batch_of(entries, &policy(64, 10_000)).unwrap();
            assert_eq!(batch.rows, rows_total);
            batch.execute(|rows, input| {
                assert_eq!(rows, rows_total);
                let echo = RawOutput { name: "echo".into(), shape: vec![rows, width], data: input.clone() };
                let index = RawOutput {
                    name: "index".into(),
                    shape: vec![rows, 1],
                    data: TensorData::F32((0..rows).map(|i| i as f32).collect()),
                };
                Ok(vec![echo, index])
            });
            let mut first_row = 0;
            for (rows, data, mut rx) in receivers {
                let outputs = rx.try_recv().unwrap().unwrap();
                assert_eq!(outputs[0].shape, vec![rows, width], "case {case}");
                assert_eq!(outputs[0].data, TensorData::F32(data), "case {case}");
                let expected: Vec<f32> = (first_row..first_row + rows).map(|i| i as f32).collect();
                assert_eq!(outputs[1].data, TensorData::F32(expected), "case {case}");
                first_row += rows;
            }
        }
    }

    #[test]
    fn aimd_grows_by_one_inside_the_budget_and_cuts_ten_percent_outside() {
        let budget = Duration::from_millis(10);
        let mut a = Aimd::new(budget, 32);
        assert_eq!(a.limit(), 1);
        for expected in 2..=20 {
            a.observe(Duration::from_millis(5));
            assert_eq!(a.limit(), expected);
        }
        a.observe(Duration::from_millis(11));
        assert_eq!(a.limit(), 18, "20 * 0.9");
        a.observe(Duration::from_millis(11));
        assert_eq!(a.limit(), 16, "18 * 0.9 = 16.2");
        for _ in 0..100 {
            a.observe(Duration::from_millis(1));
        }
        assert_eq!(a.limit(), 32, "capped at max_batch");
        for _ in 0..100 {
            a.observe(Duration::from_secs(1));
        }
        assert_eq!(a.limit(), 1, "never below one row");
    }

    #[test]
    fn adaptive_pacing_limits_the_batch() {
        let mut p = policy(32, 10_000);
        p.latency_budget = Some(Duration::from_millis(10));
        let mut pacing = Pacing::new(&p);
        assert_eq!(pacing.limit(&p), 1, "AIMD starts at one row");
        pacing.observe(MS, MS);
        pacing.observe(MS, MS);
        assert_eq!(pacing.limit(&p), 3);
        let (tx, rx) = std::sync::mpsc::channel();
        let mut keep = Vec::new();
        for _ in 0..8 {
            let (e, r) = entry(1, None);
            keep.push(r);
            tx.send(e).unwrap();
        }
        let batch = next_batch(&Mutex::new(rx), &p, &pacing, "test", &AtomicUsize::new(1)).unwrap();
        assert_eq!(batch.rows, 3, "the batch stops at the adaptive limit, not max_batch");
    }
}
