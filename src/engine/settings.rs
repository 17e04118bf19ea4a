//! What a request is served with besides its model version: its model's
//! config version (batching, escalation, cache TTL, default `top_k`,
//! preprocessing). The node config's is built once per generation; one a
//! deployment names (a promoted config, a config rollout's candidate) is
//! read from its text the first time a request needs it, then kept. A
//! config whose batching differs from the node config's gets inference
//! threads of its own on the same loaded model, started then too.

use super::batch::BatchPolicy;
use super::cascade::CascadePolicy;
use super::run::Runner;
use crate::config::ServingConfig;
use crate::model::{LoadedModel, Preprocess};
use crate::protocol::InferError;
use crate::rollout::Deployment;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One config version, ready for the request path.
#[derive(Debug)]
pub struct Settings {
    /// The config version (`parameters.config_version` in replies).
    pub version: String,
    /// The values it was built from (what a config candidate changes).
    pub serving: ServingConfig,
    pub batching: BatchPolicy,
    pub cascade: CascadePolicy,
    /// Zero: the model's answers are not cached.
    pub cache_ttl: Duration,
    /// The `top_k` of a request that asks for none.
    pub top_k: Option<u32>,
    preprocess_scale: Option<f32>,
    preprocess_offset: Option<f32>,
}

impl Settings {
    pub fn new(serving: &ServingConfig) -> Settings {
        Settings {
            version: serving.version(),
            serving: serving.clone(),
            batching: BatchPolicy::new(serving),
            cascade: CascadePolicy::new(serving),
            cache_ttl: Duration::from_secs(serving.cache_ttl_s),
            top_k: serving.top_k.filter(|&k| k > 0),
            preprocess_scale: serving.preprocess_scale.map(|x| x as f32),
            preprocess_offset: serving.preprocess_offset.map(|x| x as f32),
        }
    }

    /// The preprocessing of `model` under these settings: the manifest's,
    /// with this config's overrides.
    pub fn preprocess(&self, model: &LoadedModel) -> Preprocess {
        let manifest = model.manifest.preprocess;
        Preprocess {
            scale: self.preprocess_scale.unwrap_or(manifest.scale),
            offset: self.preprocess_offset.unwrap_or(manifest.offset),
        }
    }
}

/// A version's inference threads with the settings they serve under.
#[derive(Clone)]
pub struct Arm {
    pub runner: Arc<Runner>,
    pub settings: Arc<Settings>,
}

/// The deployments' config versions a generation has read, and the
/// inference threads started for those that batch differently.
#[derive(Default)]
pub struct DeployedConfigs {
    settings: Mutex<HashMap<String, Arc<Settings>>>,
    /// By model, version and config version.
    runners: Mutex<HashMap<(String, String, String), Arc<Runner>>>,
}

impl DeployedConfigs {
    /// The settings of config `version` as `deployment` records it; `node`
    /// when it names none (or lost its text, which this code never writes).
    pub fn settings(
        &self,
        version: Option<&String>,
        deployment: Option<&Deployment>,
        node: &Arc<Settings>,
    ) -> Arc<Settings> {
        let Some(version) = version else { return node.clone() };
        let mut read = self.settings.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(settings) = read.get(version) {
            return settings.clone();
        }
        let text = deployment.and_then(|d| d.configs.get(version)).map(|r| r.text.as_str());
        let Some(serving) = text.and_then(|t| ServingConfig::from_text(t).ok()) else {
            tracing::warn!("config {version} is not in the deployment record; the node config serves");
            return node.clone();
        };
        let settings = Arc::new(Settings::new(&serving));
        // Kept per generation: a reload starts afresh, so this stays small.
        read.insert(version.clone(), settings.clone());
        settings
    }

    /// `runner`'s model version served under `settings`: `runner` itself
    /// when they batch as it does, else threads of their own (`live`: the
    /// config versions any deployment still names; the others' threads stop).
    pub fn arm(
        &self,
        runner: &Arc<Runner>,
        settings: Arc<Settings>,
        (threads, capacity): (usize, usize),
        live: impl Fn() -> BTreeSet<String>,
    ) -> Result<Arm, InferError> {
        if runner.batching() == &settings.batching {
            return Ok(Arm { runner: runner.clone(), settings });
        }
        let model = runner.model();
        let key = (model.name().to_string(), model.version().to_string(), settings.version.clone());
        let mut runners = self.runners.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(own) = runners.get(&key) {
            return Ok(Arm { runner: own.clone(), settings });
        }
        let own = Runner::start(model.clone(), settings.batching.clone(), threads, capacity)
            .map(Arc::new)
            .map_err(|e| InferError::internal(e.to_string()))?;
        let live = live();
        runners.retain(|(_, _, config), _| live.contains(config));
        runners.insert(key, own.clone());
        tracing::info!(
            "model {} v{}: inference threads for config {} (its batching differs)",
            model.name(),
            model.version(),
            settings.version
        );
        Ok(Arm { runner: own, settings })
    }
}
