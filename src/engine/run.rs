//! Stage 4b: inference on dedicated threads, never on the async runtime's.
//! A model version's `Runner` is its bounded queue (a full one answers
//! `overloaded` instead of growing memory) and the inference threads that
//! form batches from it and run them (see batch.rs).

use super::batch::{BatchPolicy, Queued, run_batches};
use super::preprocess::Prepared;
use crate::model::{LoadedModel, RawOutput};
use crate::protocol::InferError;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::oneshot;

pub struct Runner {
    model: Arc<LoadedModel>,
    queue: SyncSender<Queued>,
}

impl Runner {
    pub fn start(model: Arc<LoadedModel>, policy: BatchPolicy, threads: usize, capacity: usize) -> Runner {
        let (queue, queued) = sync_channel::<Queued>(capacity.max(1));
        let queued = Arc::new(Mutex::new(queued));
        for i in 0..threads.max(1) {
            let model = model.clone();
            let queued = queued.clone();
            let policy = policy.clone();
            std::thread::Builder::new()
                .name(format!("infer-{}-{i}", model.name()))
                .spawn(move || {
                    run_batches(&queued, &policy, model.name(), |rows, input| {
                        model.run(rows, input).map_err(|e| InferError::internal(e.to_string()))
                    })
                })
                .expect("spawning an inference thread");
        }
        Runner { model, queue }
    }

    /// The model version these threads run.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
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
        let sent = self.queue.try_send(Queued { prepared, deadline, reply, enqueued: Instant::now() });
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
        answer.await.unwrap_or_else(|_| {
            Err(InferError::internal(format!("model {} dropped a request", self.model.name())))
        })
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
