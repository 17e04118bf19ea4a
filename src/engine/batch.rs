//! Stage 4a: micro-batching. One task per model version owns its queue; each
//! entry carries its own reply channel. A window opens when its first request
//! arrives and closes at the batch limit, at `max_delay`, or earlier when
//! waiting would make a request miss its deadline. Requests already past
//! their deadline are answered `deadline_exceeded` without running.

use super::preprocess::Prepared;
use crate::model::RawOutput;
use crate::protocol::{InferError, TensorData};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

pub type Reply = oneshot::Sender<Result<Vec<RawOutput>, InferError>>;

/// One request waiting in a model's queue.
pub struct Entry {
    pub prepared: Prepared,
    pub deadline: Option<Instant>,
    pub reply: Reply,
}

/// Requests run together; rows are packed in queue order.
pub struct Batch {
    pub entries: Vec<Entry>,
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

impl Default for BatchPolicy {
    fn default() -> Self {
        BatchPolicy { max_batch: 32, max_delay: Duration::from_millis(2), latency_budget: None }
    }
}

/// What a worker reports after running a batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchTiming {
    /// Window open to last reply sent.
    pub latency: Duration,
    pub run: Duration,
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

/// The batcher: runs until the queue's senders are gone.
pub async fn run_batcher(
    mut queue: mpsc::Receiver<Entry>,
    policy: BatchPolicy,
    to_workers: mpsc::Sender<Batch>,
    mut timings: mpsc::UnboundedReceiver<BatchTiming>,
) {
    let mut aimd = policy.latency_budget.map(|b| Aimd::new(b, policy.max_batch));
    // Expected run time of a batch, so a deadline closes the window early
    // enough to still be met.
    let mut expected_run = Duration::ZERO;
    while let Some(first) = queue.recv().await {
        while let Ok(t) = timings.try_recv() {
            expected_run = (expected_run * 7 + t.run) / 8;
            if let Some(aimd) = &mut aimd {
                aimd.observe(t.latency);
            }
        }
        let limit = aimd.as_ref().map(|a| a.limit()).unwrap_or(policy.max_batch);
        let opened = Instant::now();
        let mut batch = Batch { entries: Vec::new(), rows: 0, opened };
        let mut close_at = opened + policy.max_delay;
        admit(first, &mut batch, &mut close_at, expected_run);
        while batch.rows < limit {
            tokio::select! {
                biased;
                entry = queue.recv() => match entry {
                    Some(entry) => admit(entry, &mut batch, &mut close_at, expected_run),
                    None => break,
                },
                _ = tokio::time::sleep_until(close_at) => break,
            }
        }
        // A request may have expired while the window was open.
        let now = Instant::now();
        let (live, expired): (Vec<Entry>, Vec<Entry>) =
            batch.entries.into_iter().partition(|e| e.deadline.is_none_or(|d| d > now));
        for entry in expired {
            let _ = entry.reply.send(Err(expired_error()));
        }
        if live.is_empty() {
            continue;
        }
        let rows = live.iter().map(|e| e.prepared.rows).sum();
        if to_workers.send(Batch { entries: live, rows, opened }).await.is_err() {
            return;
        }
    }
}

fn admit(entry: Entry, batch: &mut Batch, close_at: &mut Instant, expected_run: Duration) {
    let now = Instant::now();
    if entry.reply.is_closed() {
        return;
    }
    if let Some(deadline) = entry.deadline {
        if deadline <= now {
            let _ = entry.reply.send(Err(expired_error()));
            return;
        }
        // Close early enough for the batch to run before the deadline.
        let slack = expected_run + DEADLINE_MARGIN;
        let latest_start = deadline.checked_sub(slack).unwrap_or(now).max(now);
        *close_at = (*close_at).min(latest_start);
    }
    batch.rows += entry.prepared.rows;
    batch.entries.push(entry);
}

/// Headroom before a deadline for handing the batch over and replying; at
/// least the timer's 1 ms resolution, or a window closing "just before" a
/// deadline would close just after it.
const DEADLINE_MARGIN: Duration = Duration::from_millis(1);

fn expired_error() -> InferError {
    InferError::deadline_exceeded(
        "the request's deadline passed while it waited for the model; allow more time",
    )
}

impl Batch {
    /// Runs the packed rows with `run` and hands each requester its own rows.
    pub fn execute(self, run: impl FnOnce(usize, &TensorData) -> Result<Vec<RawOutput>, InferError>) {
        let mut entries = self.entries;
        let result = match entries.as_slice() {
            [one] => run(one.prepared.rows, &one.prepared.input),
            _ => {
                let mut input = entries[0].prepared.input.clone();
                let packed = entries[1..].iter().try_for_each(|e| input.extend(e.prepared.input.clone()));
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

    fn entry(
        rows: usize,
        deadline: Option<Instant>,
    ) -> (Entry, oneshot::Receiver<Result<Vec<RawOutput>, InferError>>) {
        let (reply, rx) = oneshot::channel();
        let input = TensorData::F32(vec![0.0; rows * 2]);
        (Entry { prepared: Prepared { rows, input }, deadline, reply }, rx)
    }

    struct Harness {
        queue: mpsc::Sender<Entry>,
        batches: mpsc::Receiver<Batch>,
        _timings: mpsc::UnboundedSender<BatchTiming>,
    }

    fn start(policy: BatchPolicy) -> Harness {
        let (queue, rx) = mpsc::channel(64);
        let (to_workers, batches) = mpsc::channel(1);
        let (timings_tx, timings) = mpsc::unbounded_channel();
        tokio::spawn(run_batcher(rx, policy, to_workers, timings));
        Harness { queue, batches, _timings: timings_tx }
    }

    fn policy(max_batch: usize, max_delay_ms: u64) -> BatchPolicy {
        BatchPolicy { max_batch, max_delay: Duration::from_millis(max_delay_ms), latency_budget: None }
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_closes_at_max_batch_without_waiting() {
        let mut h = start(policy(4, 10));
        let t0 = Instant::now();
        let mut keep = Vec::new();
        for _ in 0..6 {
            let (e, rx) = entry(1, None);
            keep.push(rx);
            h.queue.send(e).await.unwrap();
        }
        let batch = h.batches.recv().await.unwrap();
        assert_eq!((batch.rows, batch.entries.len()), (4, 4));
        assert_eq!(Instant::now() - t0, Duration::ZERO, "closed at max_batch, not at max_delay");
        let rest = h.batches.recv().await.unwrap();
        assert_eq!(rest.rows, 2);
        assert_eq!(Instant::now() - t0, Duration::from_millis(10), "the remainder waits its window");
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_closes_at_max_delay() {
        let mut h = start(policy(32, 7));
        let t0 = Instant::now();
        let (e, _rx) = entry(3, None);
        h.queue.send(e).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
        let (e, _rx2) = entry(2, None);
        h.queue.send(e).await.unwrap();
        let batch = h.batches.recv().await.unwrap();
        assert_eq!(batch.rows, 5);
        assert_eq!(Instant::now() - t0, Duration::from_millis(7), "the window opened with the first request");
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_closes_the_window_early() {
        let mut h = start(policy(32, 50));
        let t0 = Instant::now();
        let (e, _a) = entry(1, None);
        h.queue.send(e).await.unwrap();
        let (e, _b) = entry(1, Some(t0 + Duration::from_millis(3)));
        h.queue.send(e).await.unwrap();
        let batch = h.batches.recv().await.unwrap();
        assert_eq!(batch.rows, 2, "both run, the one with the deadline in time");
        assert_eq!(Instant::now() - t0, Duration::from_millis(3) - DEADLINE_MARGIN);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_requests_are_answered_deadline_exceeded_and_do_not_run() {
        let mut h = start(policy(32, 5));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let (e, rx) = entry(1, Some(Instant::now() - Duration::from_micros(1)));
        h.queue.send(e).await.unwrap();
        let err = rx.await.unwrap().unwrap_err();
        assert_eq!(err.code, crate::protocol::ErrorCode::DeadlineExceeded);
        // It formed no batch: the next batch holds only the next request.
        let (e, _rx) = entry(2, None);
        h.queue.send(e).await.unwrap();
        let batch = h.batches.recv().await.unwrap();
        assert_eq!((batch.entries.len(), batch.rows), (1, 2));
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
                entries.push(Entry {
                    prepared: Prepared { rows, input: TensorData::F32(data) },
                    deadline: None,
                    reply,
                });
                rows_total += rows;
            }
            let batch = Batch { entries, rows: rows_total, opened: Instant::now() };
            batch.execute(|rows, input| {
                assert_eq!(rows, rows_total);
                let echo = RawOutput { name: "echo".into(), shape: vec![rows, width], data: input.clone() };
                let doubled = RawOutput {
                    name: "x2".into(),
                    shape: vec![rows, 1],
                    data: TensorData::F32((0..rows).map(|i| i as f32).collect()),
                };
                Ok(vec![echo, doubled])
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
}
