//! Stage 4: inference on dedicated threads, never on the async runtime's.
//! Each job carries its own reply channel; the bounded queue turns a flood
//! into `overloaded` answers instead of unbounded memory.

use super::preprocess::Prepared;
use crate::model::{LoadedModel, RawOutput};
use crate::protocol::InferError;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

struct Job {
    prepared: Prepared,
    reply: oneshot::Sender<Result<Vec<RawOutput>, InferError>>,
}

/// The inference threads of one model version.
pub struct Runner {
    model: Arc<LoadedModel>,
    jobs: SyncSender<Job>,
}

impl Runner {
    pub fn start(model: Arc<LoadedModel>, threads: usize, capacity: usize) -> Runner {
        let (jobs, rx) = sync_channel::<Job>(capacity);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let model = model.clone();
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("infer-{}-{i}", model.name()))
                .spawn(move || work(&model, &rx))
                .expect("spawning an inference thread");
        }
        Runner { model, jobs }
    }

    pub async fn run(&self, prepared: Prepared) -> Result<Vec<RawOutput>, InferError> {
        let (reply, answer) = oneshot::channel();
        match self.jobs.try_send(Job { prepared, reply }) {
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

fn work(model: &LoadedModel, rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        // The requester may have given up (deadline); skip work nobody awaits.
        if job.reply.is_closed() {
            continue;
        }
        let result = model
            .run(job.prepared.rows, &job.prepared.input)
            .map_err(|e| InferError::internal(e.to_string()));
        let _ = job.reply.send(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RuntimeOptions;
    use crate::protocol::{ErrorCode, TensorData};

    #[tokio::test]
    async fn a_failed_run_is_an_internal_error_and_the_runner_keeps_serving() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/digits/1");
        let model = Arc::new(LoadedModel::load(&dir, &RuntimeOptions::default()).unwrap());
        let runner = Runner::start(model, 1, 4);
        let broken = Prepared { rows: 1, input: TensorData::F32(vec![0.0; 3]) };
        let err = runner.run(broken).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::Internal);
        assert!(err.message.contains("digits"), "{}", err.message);
        let good = Prepared { rows: 2, input: TensorData::F32(vec![0.5; 128]) };
        let out = runner.run(good).await.unwrap();
        assert_eq!(out[0].shape, vec![2, 10]);
    }
}
