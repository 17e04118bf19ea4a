//! What the engine is told: plain settings, turned from the config file's
//! data into the engine's own policies (batching, escalation) here.

use super::batch::BatchPolicy;
use super::cascade::CascadePolicy;
use crate::config::{Config, LimitsConfig, RolloutPolicy};
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Reported as `parameters.node` in every reply.
    pub node_id: String,
    pub limits: LimitsConfig,
    pub threads_per_model: usize,
    /// Requests waiting in a model's queue before `overloaded`.
    pub queue_capacity: usize,
    /// Batching for models without their own policy.
    pub batching: BatchPolicy,
    /// Per-model batching, by model name.
    pub model_batching: HashMap<String, BatchPolicy>,
    /// How models escalate to the cloud tier (used only with one), by name;
    /// models not listed take `default_cascade`.
    pub cascade: HashMap<String, CascadePolicy>,
    pub default_cascade: CascadePolicy,
    /// How each model's rollouts step and judge; models not listed take
    /// the defaults.
    pub rollout: HashMap<String, RolloutPolicy>,
}

impl EngineOptions {
    /// The options the config file asks for.
    pub fn from_config(config: &Config) -> EngineOptions {
        let batching = |model: &str| BatchPolicy::from_config(config, model);
        EngineOptions {
            node_id: config.node.id.clone(),
            limits: config.limits.clone(),
            threads_per_model: config.runtime.threads_per_model,
            queue_capacity: config.runtime.queue_capacity,
            batching: batching(""),
            model_batching: config.models.keys().map(|m| (m.clone(), batching(m))).collect(),
            cascade: config.models.iter().map(|(m, c)| (m.clone(), CascadePolicy::new(c))).collect(),
            default_cascade: CascadePolicy::new(&Default::default()),
            rollout: config.models.iter().map(|(m, c)| (m.clone(), c.rollout.clone())).collect(),
        }
    }

    /// `model`'s rollout policy.
    pub fn rollout(&self, model: &str) -> RolloutPolicy {
        self.rollout.get(model).cloned().unwrap_or_default()
    }

    pub fn cascade(&self, model: &str) -> &CascadePolicy {
        self.cascade.get(model).unwrap_or(&self.default_cascade)
    }

    pub fn batching(&self, model: &str) -> &BatchPolicy {
        self.model_batching.get(model).unwrap_or(&self.batching)
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            node_id: "edgeinfer".into(),
            limits: LimitsConfig::default(),
            threads_per_model: 1,
            queue_capacity: 1024,
            batching: BatchPolicy::default(),
            model_batching: HashMap::new(),
            cascade: HashMap::new(),
            default_cascade: CascadePolicy::new(&Default::default()),
            rollout: HashMap::new(),
        }
    }
}
