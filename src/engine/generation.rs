//! One set of loaded models with their inference threads and settings. A
//! reload starts a new generation; requests already running finish on the
//! one they started with, whose threads stop after.

use super::options::EngineOptions;
use super::run::{Runner, SpawnError};
use super::settings::DeployedConfigs;
use super::stats::Answered;
use crate::model::{Registry, Versions};
use std::collections::HashMap;
use std::sync::Arc;

pub struct Generation {
    pub registry: Arc<Registry>,
    /// Every loaded version's inference threads, looked up as the models are.
    pub runners: Versions<Arc<Runner>>,
    pub options: EngineOptions,
    /// Answers per model in service, by name; carried across reloads.
    pub answered: HashMap<String, Arc<Answered>>,
    /// The config versions deployments name, as requests met them.
    pub deployed: DeployedConfigs,
}

impl Generation {
    /// Starts the inference threads of every loaded model version; counts of
    /// models `previous` served carry over.
    pub fn start(
        registry: Arc<Registry>,
        options: EngineOptions,
        previous: Option<&Generation>,
    ) -> Result<Generation, SpawnError> {
        let runners = registry.try_map(|m| {
            let policy = options.settings(m.name()).batching.clone();
            Runner::start(m.clone(), policy, options.threads_per_model, options.queue_capacity).map(Arc::new)
        })?;
        let answered = registry
            .active()
            .map(|m| {
                let kept = previous.and_then(|p| p.answered.get(m.name()).cloned());
                (m.name().to_string(), kept.unwrap_or_else(|| Answered::new(m.name())))
            })
            .collect();
        Ok(Generation { registry, runners, options, answered, deployed: DeployedConfigs::default() })
    }

    /// The `model` label: the name for models this node serves, `unknown`
    /// otherwise, so a device sending junk topics cannot grow the metric set.
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.answered.contains_key(model) { model } else { "unknown" }
    }
}
