//! The request pipeline every transport shares:
//! decode -> route -> preprocess -> run -> postprocess -> reply.
//! Each stage lives in the file named after it.

mod decode;
mod postprocess;
mod preprocess;
mod reply;
mod route;
mod run;

pub use decode::decode;
pub use reply::encode;
pub use run::Runner;

use crate::config::LimitsConfig;
use crate::model::Registry;
use crate::protocol::{Encoding, ErrorCode, InferError, InferRequest, InferResponse};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Reported as `parameters.node` in every reply.
    pub node_id: String,
    pub limits: LimitsConfig,
    pub threads_per_model: usize,
    /// Jobs waiting for a model's threads before `overloaded`.
    pub queue_capacity: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            node_id: "edgeinfer".into(),
            limits: LimitsConfig::default(),
            threads_per_model: 1,
            queue_capacity: 1024,
        }
    }
}

/// Which model a transport addressed (topic or URL), before the request is read.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub model: &'a str,
    /// A version named by the transport (`/v2/models/M/versions/V/infer`);
    /// otherwise `parameters.model_version`, otherwise the active version.
    pub version: Option<&'a str>,
}

/// The reply to one request and what a transport logs or counts about it.
#[derive(Debug)]
pub struct Handled {
    pub id: String,
    pub outcome: Result<(), ErrorCode>,
    pub reply: Vec<u8>,
}

pub struct Engine {
    registry: Arc<Registry>,
    runners: HashMap<(String, String), Runner>,
    options: EngineOptions,
}

impl Engine {
    /// Starts the inference threads of every loaded model version.
    pub fn new(registry: Arc<Registry>, options: EngineOptions) -> Engine {
        let runners = registry
            .all()
            .map(|m| {
                let key = (m.name().to_string(), m.version().to_string());
                (key, Runner::start(m.clone(), options.threads_per_model, options.queue_capacity))
            })
            .collect();
        Engine { registry, runners, options }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Bytes in, bytes out: the whole pipeline, for transports.
    pub async fn handle(&self, target: Target<'_>, payload: &[u8], encoding: Encoding) -> Handled {
        let request = decode(payload, encoding, &self.options.limits);
        let (id, result) = match request {
            Ok(req) => {
                let id = req.id.clone();
                (id, self.infer(target, req).await)
            }
            Err(e) => (decode::salvage_id(payload, encoding), Err(e)),
        };
        let outcome = result.as_ref().map(|_| ()).map_err(|e| e.code);
        Handled { reply: encode(&id, result, encoding), id, outcome }
    }

    /// One decoded request through route, preprocess, run and postprocess,
    /// within its deadline.
    pub async fn infer(&self, target: Target<'_>, req: InferRequest) -> Result<InferResponse, InferError> {
        let start = Instant::now();
        let model = route::route(&self.registry, target, &req)?;
        let prepared = preprocess::prepare(&model, &req, &self.options.limits)?;
        let runner =
            self.runners.get(&(model.name().to_string(), model.version().to_string())).ok_or_else(|| {
                InferError::internal(format!("model {} has no inference threads", model.name()))
            })?;
        let outputs = match req.parameters.deadline_ms {
            Some(ms) if start.elapsed() >= Duration::from_millis(ms) => {
                return Err(InferError::deadline_exceeded(format!(
                    "parameters.deadline_ms = {ms} passed before the model could run; allow more time"
                )));
            }
            Some(ms) => {
                let left = Duration::from_millis(ms).saturating_sub(start.elapsed());
                tokio::time::timeout(left, runner.run(prepared)).await.map_err(|_| {
                    InferError::deadline_exceeded(format!(
                        "parameters.deadline_ms = {ms}: no answer in time; allow more time or send fewer rows"
                    ))
                })??
            }
            None => runner.run(prepared).await?,
        };
        postprocess::respond(&model, &req, outputs, &self.options.node_id)
    }
}
