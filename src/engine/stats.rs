//! What each model has served, for the retained status and the periodic
//! stats message: a running count per model (an atomic the status reads)
//! and the round trips since the last stats message, in histograms one
//! thread owns. Requests hand it their round trip over a bounded channel
//! it drains every few milliseconds, so no request waits on a lock the
//! stats message holds, nor wakes a thread.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::time::Duration;
use tokio::sync::oneshot;

/// Round trips waiting for the owner; beyond this a sample is dropped (a
/// stats message missing a few beats a request waiting).
const BACKLOG: usize = 16 * 1024;

/// One model's figures since the previous stats message.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelStats {
    pub requests_total: u64,
    pub requests: u64,
    pub rate_rps: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
}

/// Requests a model in service has answered since the node started;
/// carried across reloads by name.
#[derive(Debug)]
pub struct Answered {
    model: Arc<str>,
    count: AtomicU64,
}

impl Answered {
    pub fn new(model: &str) -> Arc<Answered> {
        Arc::new(Answered { model: model.into(), count: AtomicU64::new(0) })
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Round-trip percentiles of one model since the last `take`.
struct Window {
    requests: u64,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
}

enum Message {
    Answered { model: Arc<str>, micros: u64 },
    Take(oneshot::Sender<HashMap<Arc<str>, Window>>),
}

/// The requests' side of the owner thread.
pub struct Stats {
    tx: SyncSender<Message>,
}

impl Stats {
    /// Starts the owner thread; it ends when the `Stats` is dropped.
    pub fn start() -> Stats {
        let (tx, rx) = sync_channel(BACKLOG);
        std::thread::Builder::new()
            .name("stats".into())
            .spawn(move || own(rx))
            .expect("spawning the stats thread");
        Stats { tx }
    }

    /// Counts one answer of a model in service and its round trip.
    pub fn record(&self, answered: &Answered, elapsed: Duration) {
        answered.count.fetch_add(1, Ordering::Relaxed);
        let micros = (elapsed.as_micros() as u64).max(1);
        // Full: the sample is dropped (see BACKLOG). Gone: the engine is.
        let _ = self.tx.try_send(Message::Answered { model: answered.model.clone(), micros });
    }

    /// Each model's figures since the previous call, `interval` apart, and
    /// a fresh window.
    pub async fn take<'a>(
        &self,
        models: impl Iterator<Item = &'a Arc<Answered>>,
        interval: Duration,
    ) -> BTreeMap<String, ModelStats> {
        let (reply, windows) = oneshot::channel();
        // Blocks only while the owner's backlog is full, for a moment.
        let windows = match self.tx.send(Message::Take(reply)) {
            Ok(()) => windows.await.unwrap_or_default(),
            Err(_) => HashMap::new(),
        };
        models
            .map(|answered| {
                let window = windows.get(&answered.model);
                let requests = window.map_or(0, |w| w.requests);
                let stats = ModelStats {
                    requests_total: answered.count(),
                    requests,
                    rate_rps: requests as f64 / interval.as_secs_f64().max(1e-9),
                    p50_ms: window.map_or(0.0, |w| w.p50_ms),
                    p95_ms: window.map_or(0.0, |w| w.p95_ms),
                    p99_ms: window.map_or(0.0, |w| w.p99_ms),
                };
                (answered.model.to_string(), stats)
            })
            .collect()
    }
}

/// How often the owner drains its channel while requests come. It polls
/// instead of blocking in `recv`, because a blocked receiver is woken (a
/// futex call and a context switch) by every request's sample: measured,
/// the node ran 6.7% below the previous one that way (docs/BENCHMARKS.md).
/// A `take` waits at most this long.
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// Drains in a row that found nothing before the owner blocks in `recv`:
/// an idle node's thread then sleeps until the next sample or `take` (one
/// wake-up), instead of waking 50 times a second.
const IDLE_AFTER: u32 = 50;

/// The owner: one histogram per model, reset at each `Take`.
fn own(rx: Receiver<Message>) {
    let mut histograms: HashMap<Arc<str>, hdrhistogram::Histogram<u64>> = HashMap::new();
    let mut empty_drains = 0;
    loop {
        let message = match rx.try_recv() {
            Ok(message) => message,
            Err(TryRecvError::Empty) if empty_drains >= IDLE_AFTER => match rx.recv() {
                Ok(message) => message,
                Err(_) => return,
            },
            Err(TryRecvError::Empty) => {
                empty_drains += 1;
                std::thread::sleep(DRAIN_EVERY);
                continue;
            }
            Err(TryRecvError::Disconnected) => return,
        };
        empty_drains = 0;
        match message {
            Message::Answered { model, micros } => {
                let h = histograms.entry(model).or_insert_with(|| {
                    hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds")
                });
                let _ = h.record(micros.min(60_000_000));
            }
            Message::Take(reply) => {
                let windows = histograms
                    .iter_mut()
                    .map(|(model, h)| {
                        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
                        let window =
                            Window { requests: h.len(), p50_ms: ms(0.5), p95_ms: ms(0.95), p99_ms: ms(0.99) };
                        h.reset();
                        (model.clone(), window)
                    })
                    .collect();
                let _ = reply.send(windows);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_window_holds_the_round_trips_since_the_last_take_and_the_count_keeps_running() {
        let stats = Stats::start();
        let (digits, idle) = (Answered::new("digits"), Answered::new("idle"));
        for ms in 1..=100 {
            stats.record(&digits, Duration::from_millis(ms));
        }
        let first = stats.take([&digits, &idle].into_iter(), Duration::from_secs(10)).await;
        let d = &first["digits"];
        assert_eq!((d.requests_total, d.requests), (100, 100));
        assert!((d.rate_rps - 10.0).abs() < 1e-9, "{}", d.rate_rps);
        assert!((49.0..=51.0).contains(&d.p50_ms) && (98.0..=100.5).contains(&d.p99_ms), "{d:?}");
        assert_eq!(first["idle"].requests, 0);
        stats.record(&digits, Duration::from_millis(7));
        let second = stats.take([&digits].into_iter(), Duration::from_secs(1)).await;
        let d = &second["digits"];
        assert_eq!((d.requests_total, d.requests), (101, 1));
        assert!((6.9..=7.1).contains(&d.p50_ms), "{d:?}");
    }
}
