//! Stage 4b: inference on dedicated threads, never on the async runtime's.
//! A model version's `Runner` is its bounded queue (a full one answers
//! `overloaded` instead of growing memory) and the inference threads that
//! form batches from it and run them (see batch.rs).

use super::batch::{BatchPolicy, BatchRun, Queued, Traced, run_batches};
use super::preprocess::Prepared;
use crate::model::{LoadedModel, RawOutput};
use crate::protocol::InferError;
use crate::protocol::TensorData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::oneshot;

pub struct Runner {
    model: Arc<LoadedModel>,
    /// How its threads form batches.
    batching: BatchPolicy,
    queue: SyncSender<Queued>,
    /// Batches its threads finished, and the count the last probe saw: a
    /// full queue with no batch finished since is a wedged model.
    finished: Arc<AtomicU64>,
    probed: AtomicU64,
    /// Nanoseconds its threads spent running batches, and when and at what
    /// count the saturation gauge last read it.
    busy_ns: Arc<AtomicU64>,
    threads: usize,
    sampled: Mutex<(Instant, u64)>,
}

/// What an inference thread runs on a packed batch.
type RunBatch = dyn Fn(usize, &TensorData) -> Result<Vec<RawOutput>, InferError> + Send + Sync;

/// An inference thread could not be started (the service's task limit, or
/// memory): the models it was for do not go into service.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot start an inference thread for model {model}: {source}; raise the service's TasksMax \
     (systemd) or lower runtime.threads_per_model"
)]
pub struct SpawnError {
    pub model: String,
    source: std::io::Error,
}

impl Runner {
    pub fn start(
        model: Arc<LoadedModel>,
        policy: BatchPolicy,
        threads: usize,
        capacity: usize,
    ) -> Result<Runner, SpawnError> {
        let run_model = model.clone();
        let run: Arc<RunBatch> = Arc::new(move |rows, input: &TensorData| {
            panic_on_marked_input(run_model.name(), input);
            slow_inference(&run_model);
            run_model.run(rows, input).map_err(|e| InferError::internal(e.to_string()))
        });
        Runner::start_with(model, policy, threads, capacity, run)
    }

    /// Threads that run each batch with `run`. A panic in it answers that
    /// batch's requests `internal` and the thread goes on with the next; a
    /// panic anywhere else in the thread restarts its loop (the requests it
    /// held get `internal` as their reply channels drop). Both are counted.
    fn start_with(
        model: Arc<LoadedModel>,
        policy: BatchPolicy,
        threads: usize,
        capacity: usize,
        run: Arc<RunBatch>,
    ) -> Result<Runner, SpawnError> {
        let (queue, queued) = sync_channel::<Queued>(capacity.max(1));
        let queued = Arc::new(Mutex::new(queued));
        let finished = Arc::new(AtomicU64::new(0));
        // The threads running a batch now: a window waits only while one is.
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let busy_ns = Arc::new(AtomicU64::new(0));
        for i in 0..threads.max(1) {
            let name = model.name().to_string();
            let (queued, policy, run, finished, running, busy_ns) = (
                queued.clone(),
                policy.clone(),
                run.clone(),
                finished.clone(),
                running.clone(),
                busy_ns.clone(),
            );
            std::thread::Builder::new()
                .name(format!("infer-{name}-{i}"))
                .spawn(move || {
                    let guarded = |rows: usize, input: &TensorData| {
                        let started = Instant::now();
                        let outcome = catch_unwind(AssertUnwindSafe(|| run(rows, input)));
                        busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        finished.fetch_add(1, Ordering::Relaxed);
                        outcome.unwrap_or_else(|panic| {
                            let why = panic_message(&*panic);
                            count_panic(&name, &why);
                            Err(InferError::internal(format!(
                                "model {name} failed on this batch ({why}); other requests are served"
                            )))
                        })
                    };
                    // Ends when the queue closes (a reload retired this version).
                    while let Err(panic) = catch_unwind(AssertUnwindSafe(|| {
                        run_batches(&queued, &policy, &name, &running, guarded)
                    })) {
                        count_panic(&name, &panic_message(&*panic));
                    }
                })
                // The threads already started end when `queue` drops.
                .map_err(|source| SpawnError { model: model.name().to_string(), source })?;
        }
        let sampled = Mutex::new((Instant::now(), 0));
        Ok(Runner {
            model,
            batching: policy,
            queue,
            finished,
            probed: AtomicU64::new(0),
            busy_ns,
            threads: threads.max(1),
            sampled,
        })
    }

    /// The share of the time since the previous call (0 to 1) that its
    /// inference threads spent running batches: how saturated the model is.
    pub fn busy_share(&self) -> f64 {
        let busy = self.busy_ns.load(Ordering::Relaxed);
        let mut sampled = self.sampled.lock().unwrap_or_else(|e| e.into_inner());
        let (since, before) = std::mem::replace(&mut *sampled, (Instant::now(), busy));
        let elapsed = since.elapsed().as_nanos() as f64 * self.threads as f64;
        if elapsed <= 0.0 { 0.0 } else { ((busy - before) as f64 / elapsed).min(1.0) }
    }

    /// Whether a batch finished since the previous call (the watchdog's
    /// test that an `overloaded` model is busy, not wedged).
    pub fn progressed(&self) -> bool {
        let now = self.finished.load(Ordering::Relaxed);
        self.probed.swap(now, Ordering::Relaxed) != now
    }

    /// The model version these threads run.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    pub fn batching(&self) -> &BatchPolicy {
        &self.batching
    }

    pub async fn run(
        &self,
        prepared: Prepared,
        deadline: Option<Instant>,
    ) -> Result<Vec<RawOutput>, InferError> {
        let (reply, answer) = oneshot::channel();
        // Counted before the send: the inference thread may take it at once.
        let depth = metrics::gauge!(crate::telemetry::QUEUE_DEPTH, "model" => self.model.name().to_string());
        depth.increment(1.0);
        // A traced request learns how its batch ran, for its spans.
        let active = crate::trace::current();
        let traced = active.as_ref().map(|active| Traced {
            trace_id: active.trace_id,
            span: crate::trace::new_span_id(),
            ran: Default::default(),
        });
        let ran = traced.as_ref().map(|t| (t.span, t.ran.clone()));
        let enqueued = Instant::now();
        let sent = self.queue.try_send(Queued { prepared, deadline, reply, enqueued, traced });
        if sent.is_err() {
            depth.decrement(1.0);
        }
        match sent {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(InferError::overloaded(format!(
                    "model {} has a full queue; retry later or spread requests over more nodes",
                    self.model.name()
                )));
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(InferError::internal(format!("model {} has stopped", self.model.name())));
            }
        }
        let outputs = answer.await.unwrap_or_else(|_| {
            Err(InferError::internal(format!("model {} dropped a request", self.model.name())))
        });
        if let (Some(active), Some((span, ran))) = (active, ran)
            && let Some(ran) = ran.get()
        {
            record_batch(&active, enqueued, span, ran);
        }
        outputs
    }
}

/// A traced request's `queue` and `inference` spans: the wait for its
/// batch, and the batch's run, linked to the other requests it carried.
fn record_batch(active: &crate::trace::Active, enqueued: Instant, span: u64, ran: &BatchRun) {
    use opentelemetry::KeyValue;
    active.add("queue", (enqueued, ran.started), Vec::new());
    let this = (active.trace_id, span);
    // The first traced request's span is the batch's: it links to every
    // other request; the others link to it.
    let links = if ran.spans.first() == Some(&this) {
        ran.spans[1..].to_vec()
    } else {
        ran.spans.first().copied().into_iter().collect()
    };
    active.push(crate::trace::Span {
        id: span,
        parent: active.parent(),
        name: "inference",
        kind: crate::trace::Kind::Internal,
        start: ran.started,
        end: ran.ended,
        attributes: vec![
            KeyValue::new("edgeinfer.batch.requests", ran.requests as i64),
            KeyValue::new("edgeinfer.batch.rows", ran.rows as i64),
        ],
        links,
        error: None,
    });
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

fn count_panic(model: &str, why: &str) {
    metrics::counter!(crate::telemetry::INFERENCE_PANICS, "model" => model.to_string()).increment(1);
    tracing::error!("model {model}: an inference thread panicked ({why}); it goes on with the next batch");
}

/// A fail point's argument, `SCOPE:VALUE` or `VALUE`: the scope (a model,
/// a request id) it is limited to, if any, and the value.
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
pub(super) fn failpoint_scope(arg: &str) -> (Option<&str>, &str) {
    arg.rsplit_once(':').map_or((None, arg), |(scope, value)| (Some(scope), value))
}

/// Fail point `inference_delay`: `return(MS)`, or `return(MODEL:MS)` for one
/// model, or `return(MODEL/VERSION:MS)` for one version of it (a wedged
/// candidate beside a healthy stable), makes every batch take that much
/// longer (a slow model, for tests that need requests in flight).
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn slow_inference(model: &LoadedModel) -> Option<()> {
    fail::fail_point!("inference_delay", |arg: Option<String>| {
        let arg = arg?;
        let (only, ms) = failpoint_scope(&arg);
        let names_this_one = |scope: &str| match scope.split_once('/') {
            Some((name, version)) => name == model.name() && version == model.version(),
            None => scope == model.name(),
        };
        if only.is_none_or(names_this_one) {
            std::thread::sleep(std::time::Duration::from_millis(ms.parse().ok()?));
        }
        None
    });
    None
}

/// Fault injection for the end-to-end tests (`--features failpoints`; the
/// shipped binary has none): `FAILPOINTS=inference_panic=return(V)` panics
/// on a batch holding the preprocessed value `V`; `return(MODEL:V)` only on
/// model `MODEL`'s.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn panic_on_marked_input(model: &str, input: &TensorData) -> Option<()> {
    fail::fail_point!("inference_panic", |marker: Option<String>| {
        let marker = marker?;
        let (only, value) = failpoint_scope(&marker);
        let value: f32 = value.parse().ok()?;
        if only.is_none_or(|m| m == model)
            && let TensorData::F32(values) = input
            && values.contains(&value)
        {
            panic!("failpoint inference_panic: the input holds {value}");
        }
        None
    });
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RuntimeOptions;
    use crate::protocol::{ErrorCode, TensorData};

    fn digits() -> Arc<LoadedModel> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/digits/1");
        Arc::new(LoadedModel::load(&dir, &RuntimeOptions::default()).unwrap())
    }

    #[tokio::test]
    async fn a_failed_run_is_an_internal_error_and_the_runner_keeps_serving() {
        let runner = Runner::start(digits(), BatchPolicy::default(), 1, 4).unwrap();
        let broken = Prepared { rows: 1, input: TensorData::F32(vec![0.0; 3]) };
        let err = runner.run(broken, None).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::Internal);
        assert!(err.message.contains("digits"), "{}", err.message);
        let good = Prepared { rows: 2, input: TensorData::F32(vec![0.5; 128]) };
        let out = runner.run(good, None).await.unwrap();
        assert_eq!(out[0].shape, vec![2, 10]);
    }

    #[tokio::test]
    async fn a_panicking_batch_answers_internal_and_the_thread_keeps_serving() {
        let model = digits();
        let inner = model.clone();
        let run: Arc<RunBatch> = Arc::new(move |rows, input: &TensorData| {
            if let TensorData::F32(v) = input
                && v[0] < 0.0
            {
                panic!("a marked input");
            }
            inner.run(rows, input).map_err(|e| InferError::internal(e.to_string()))
        });
        // One thread: had the panic killed it, nothing would answer after.
        let runner = Runner::start_with(model, BatchPolicy::default(), 1, 4, run).unwrap();
        for round in 0..3 {
            let marked = Prepared { rows: 1, input: TensorData::F32(vec![-1.0; 64]) };
            let err = runner.run(marked, None).await.unwrap_err();
            assert_eq!(err.code, ErrorCode::Internal, "round {round}");
            assert!(err.message.contains("a marked input"), "{}", err.message);
            let good = Prepared { rows: 1, input: TensorData::F32(vec![0.5; 64]) };
            assert_eq!(runner.run(good, None).await.unwrap()[0].shape, vec![1, 10], "round {round}");
        }
        assert!(runner.progressed(), "six batches finished");
        assert!(!runner.progressed(), "none since");
    }

    #[tokio::test]
    async fn busy_share_is_the_time_spent_running_batches() {
        let model = digits();
        let inner = model.clone();
        let run: Arc<RunBatch> = Arc::new(move |rows, input: &TensorData| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            inner.run(rows, input).map_err(|e| InferError::internal(e.to_string()))
        });
        let runner = Runner::start_with(model, BatchPolicy::default(), 1, 4, run).unwrap();
        runner.busy_share();
        for _ in 0..5 {
            let p = Prepared { rows: 1, input: TensorData::F32(vec![0.5; 64]) };
            runner.run(p, None).await.unwrap();
        }
        // Five batches of 20 ms, one after another: busy nearly all along.
        let share = runner.busy_share();
        assert!(share > 0.6 && share <= 1.0, "{share}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(runner.busy_share(), 0.0, "idle since");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_answers_overloaded_and_every_request_gets_one_answer() {
        // No batching and a queue of one: requests arriving faster than one
        // inference thread runs them overflow it.
        let policy = BatchPolicy { max_batch: 1, max_delay: std::time::Duration::ZERO, latency_budget: None };
        let runner = Arc::new(Runner::start(digits(), policy, 1, 1).unwrap());
        let pending: Vec<_> = (0..200)
            .map(|_| {
                let r = runner.clone();
                let p = Prepared { rows: 1, input: TensorData::F32(vec![0.5; 64]) };
                tokio::spawn(async move { r.run(p, None).await })
            })
            .collect();
        let (mut ok, mut overloaded) = (0, 0);
        for p in pending {
            match p.await.unwrap() {
                Ok(_) => ok += 1,
                Err(e) if e.code == ErrorCode::Overloaded => overloaded += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(ok + overloaded, 200);
        assert!(overloaded > 0 && ok > 0, "ok {ok}, overloaded {overloaded}");
    }
}
