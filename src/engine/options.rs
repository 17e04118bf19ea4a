//! What the engine is told: plain settings, turned from the config file's
//! data into the engine's own policies (batching, escalation) here.

use super::settings::Settings;
use crate::config::{Config, LimitsConfig, RolloutPolicy, ServingConfig};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Reported as `parameters.node` in every reply.
    pub node_id: String,
    pub limits: LimitsConfig,
    pub threads_per_model: usize,
    /// Requests waiting in a model's queue before `overloaded`.
    pub queue_capacity: usize,
    /// Each model's serving settings as the node config has them (its
    /// config version), by name; models not listed take `default_settings`.
    pub settings: HashMap<String, Arc<Settings>>,
    pub default_settings: Arc<Settings>,
    /// How each model's rollouts step and judge; models not listed take
    /// the defaults.
    pub rollout: HashMap<String, RolloutPolicy>,
}

impl EngineOptions {
    /// The options the config file asks for.
    pub fn from_config(config: &Config) -> EngineOptions {
        EngineOptions {
            node_id: config.node.id.clone(),
            limits: config.limits.clone(),
            threads_per_model: config.runtime.threads_per_model,
            queue_capacity: config.runtime.queue_capacity,
            settings: config
                .models
                .keys()
                .map(|m| (m.clone(), Arc::new(Settings::new(&config.serving(m)))))
                .collect(),
            default_settings: Arc::new(Settings::new(&config.default_serving())),
            rollout: config.models.iter().map(|(m, c)| (m.clone(), c.rollout.clone())).collect(),
        }
    }

    /// `model`'s rollout policy.
    pub fn rollout(&self, model: &str) -> RolloutPolicy {
        self.rollout.get(model).cloned().unwrap_or_default()
    }

    /// `model`'s settings from the node config.
    pub fn settings(&self, model: &str) -> &Arc<Settings> {
        self.settings.get(model).unwrap_or(&self.default_settings)
    }

    /// `model`'s serving values from the node config.
    pub fn serving(&self, model: &str) -> &ServingConfig {
        &self.settings(model).serving
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            node_id: "edgeinfer".into(),
            threads_per_model: 1,
            queue_capacity: 1024,
            ..EngineOptions::from_config(&Config::default())
        }
    }
}
