//! Stage 4b: inference on dedicated threads, never on the async runtime's.
//! A model version's `Runner` is its bounded queue (a full one answers
//! `overloaded` instead of growing memory), the batcher task that owns it, and
//! the worker threads that run its batches.

use super::batch::{Batch, BatchPolicy, BatchTiming, Entry, run_batcher};
use super::preprocess::Prepared;
use crate::model::{LoadedModel, RawOutput};
use crate::protocol::InferError;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

pub struct Runner {
    model: Arc<LoadedModel>,
    queue: mpsc::Sender<Entry>,
}

impl Runner {
    pub fn start(model: Arc<LoadedModel>, policy: BatchPolicy, threads: usize, capacity: usize) -> Runner {
        let (queue, queued) = mpsc::channel::<Entry>(capacity.max(1));
        // One batch per idle worker in the hand-off: while all are busy the
        // batcher waits and the queue grows into the next (fuller) batch.
        let (to_workers, batches) = mpsc::channel::<Batch>(threads.max(1));
        let (timings_tx, timings) = mpsc::unbounded_channel();
        let batches = Arc::new(Mutex::new(batches));
        for i in 0..threads.max(1) {
            let model = model.clone();
            let batches = batches.clone();
            let timings_tx = timings_tx.clone();
            std::thread::Builder::new()
                .name(format!("infer-{}-{i}", model.name()))
                .spawn(move || work(&model, &batches, &timings_tx))
                .expect("spawning an inference thread");
        }
        // The batcher owns the queue on a thread of its own, with a runtime of
        // its own, so it keeps time whatever the callers' runtimes do.
        std::thread::Builder::new()
            .name(format!("batch-{}", model.name()))
            .spawn(move || {
                let rt =
                    tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime");
                rt.block_on(run_batcher(queued, policy, to_workers, timings));
            })
            .expect("spawning the batcher thread");
        Runner { model, queue }
    }

    pub async fn run(
        &self,
        prepared: Prepared,
        deadline: Option<Instant>,
    ) -> Result<Vec<RawOutput>, InferError> {
        let (reply, answer) = oneshot::channel();
        match self.queue.try_send(Entry { prepared, deadline, reply }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(InferError::overloaded(format!(
                    "model {} has a full queue; retry later or spread requests over more nodes",
                    self.model.name()
                )));
            }
            Err(TrySendError::Closed(_)) => {
                return Err(InferError::internal(format!("model {} has stopped", self.model.name())));
            }
        }
        answer.await.unwrap_or_else(|_| {
            Err(InferError::internal(format!("model {} dropped a request", self.model.name())))
        })
    }
}

fn work(
    model: &LoadedModel,
    batches: &Mutex<mpsc::Receiver<Batch>>,
    timings: &mpsc::UnboundedSender<BatchTiming>,
) {
    loop {
        let batch = match batches.lock() {
            Ok(mut rx) => rx.blocking_recv(),
            Err(_) => return,
        };
        let Some(batch) = batch else { return };
        let opened = batch.opened;
        let started = Instant::now();
        batch.execute(|rows, input| model.run(rows, input).map_err(|e| InferError::internal(e.to_string())));
        let done = Instant::now();
        let _ = timings.send(BatchTiming { latency: done - opened, run: done - started });
    }
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
        let runner = Runner::start(digits(), BatchPolicy::default(), 1, 4);
        let broken = Prepared { rows: 1, input: TensorData::F32(vec![0.0; 3]) };
        let err = runner.run(broken, None).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::Internal);
        assert!(err.message.contains("digits"), "{}", err.message);
        let good = Prepared { rows: 2, input: TensorData::F32(vec![0.5; 128]) };
        let out = runner.run(good, None).await.unwrap();
        assert_eq!(out[0].shape, vec![2, 10]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_answers_overloaded_and_every_request_gets_one_answer() {
        // No batching and a queue of one: requests arriving faster than one
        // inference thread runs them overflow it.
        let policy = BatchPolicy { max_batch: 1, max_delay: std::time::Duration::ZERO, latency_budget: None };
        let runner = Arc::new(Runner::start(digits(), policy, 1, 1));
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
