//! The retained status message.

use crate::model::{LoadedModel, Registry};
use crate::rollout::{Candidate, Decision, Deployments, FieldQuality, Trial};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Online,
    Draining,
    Offline,
}

/// The retained `PREFIX/NODE/status` JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub state: State,
    pub node: String,
    pub version: &'static str,
    /// Unix seconds when the process started.
    pub started_at: u64,
    /// Seconds since then, as of this message.
    pub uptime_s: u64,
    pub models: Vec<ModelStatus>,
    /// Requests answered since start, by model name.
    pub requests: std::collections::BTreeMap<String, u64>,
    pub cache: CacheHealth,
    /// The cloud tier's circuit breaker (`closed`, `open`, `half_open`);
    /// absent while the cloud tier is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cloud: Option<&'static str>,
    /// Why the last reload (SIGHUP) was refused or partly refused; the node
    /// serves what it had.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reload_error: Option<String>,
    /// Settings a reload read but cannot apply: they take effect at the
    /// next restart.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub restart_needed: Vec<&'static str>,
    /// Resident memory now and at its peak, in bytes (absent where /proc
    /// does not say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// Per model with a deployment state: the stable version and the last
    /// decision (`edgeinfer models promote|rollback`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub rollout: BTreeMap<String, RolloutStatus>,
    /// What the node was built from, and the sha256 of its effective config
    /// (secrets redacted): with the models' hashes, the deployment record.
    pub build: Build,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_sha256: Option<String>,
    /// The share group's connection; set by the MQTT service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share_group: Option<ShareGroupStatus>,
    /// Each version's field feedback since the node started
    /// (`feedback.enabled`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub field_quality: Vec<FieldQuality>,
}

/// What the status shows of the share group's connection (issue 42).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ShareGroupStatus {
    /// `mqtt.share_group`.
    pub group: String,
    /// Connected with the subscription in place: the broker hands this
    /// node its share of the group's requests.
    pub joined: bool,
    /// Requests received through the group since start.
    pub requests: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Build {
    pub git_sha: &'static str,
    pub target: &'static str,
}

impl Build {
    pub const THIS: Build = Build { git_sha: env!("BUILD_GIT_SHA"), target: env!("BUILD_TARGET") };
}

#[derive(Debug, Clone, Serialize)]
pub struct RolloutStatus {
    pub stable: String,
    /// The promoted config serving with it; absent: the node config's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stable_config: Option<String>,
    /// What `models rollback` would return to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_decision: Option<Decision>,
    /// A rollout in progress: the candidate, its mode, step and share.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidate: Option<Candidate>,
    /// Its step as last judged: each gate with its figures, and each
    /// version's figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trial: Option<Trial>,
    /// The last decision took effect but is not on disk yet: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unsaved: Option<String>,
}

fn rollout(
    deployments: Option<&Deployments>,
    trials: &BTreeMap<String, Trial>,
) -> BTreeMap<String, RolloutStatus> {
    let Some(deployments) = deployments else { return BTreeMap::new() };
    deployments
        .models
        .iter()
        .map(|(name, d)| {
            let status = RolloutStatus {
                stable: d.stable.clone(),
                stable_config: d.stable_config.clone(),
                // During a rollout a rollback ends it: back to stable alone.
                previous: if d.candidate.is_some() {
                    Some(d.stable.clone())
                } else {
                    d.previous.last().cloned()
                },
                last_decision: d.history.last().cloned(),
                candidate: d.candidate.clone(),
                trial: trials.get(name).cloned(),
                unsaved: d.unsaved.clone(),
            };
            (name.clone(), status)
        })
        .collect()
}

/// What changes while a node runs, for a status snapshot.
#[derive(Debug, Clone)]
pub struct EngineSnapshot {
    pub registry: std::sync::Arc<Registry>,
    /// The version of each model that answers a request naming none.
    pub serving: Vec<(String, String)>,
    pub deployments: Option<std::sync::Arc<Deployments>>,
    /// Each rollout's step as last judged.
    pub trials: std::sync::Arc<BTreeMap<String, Trial>>,
    pub config_sha256: Option<String>,
    pub requests: std::collections::BTreeMap<String, u64>,
    pub cache: CacheHealth,
    pub cloud: Option<&'static str>,
    pub reload_error: Option<String>,
    pub restart_needed: Vec<&'static str>,
    /// Each version's field feedback, when `feedback.enabled`.
    pub field_quality: std::sync::Arc<Vec<FieldQuality>>,
}

/// The response cache as the status reports it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CacheHealth {
    pub enabled: bool,
    pub memory_entries: u64,
    pub disk_enabled: bool,
    pub disk_entries: u64,
    /// What went wrong with the disk layer (a store moved aside, an I/O
    /// error), in a few words without paths: the log has the details.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<&'static str>,
    /// The shared layer, when `cache.redis.enabled`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisState>,
}

/// The shared Redis cache layer, for the status and `cache stats`.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct RedisState {
    /// The last command it was sent succeeded.
    pub up: bool,
    /// Why it is not up, in the client's words (never the password).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelStatus {
    pub name: String,
    pub version: String,
    pub sha256: String,
    /// Of `model.toml`: the preprocessing and labels it serves with.
    pub manifest_sha256: String,
    /// When a decision last made it stable, and by what.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deployed_at_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deployed_by: Option<String>,
    pub quantization: &'static str,
    pub active: bool,
}

impl Status {
    pub fn new(node: &str, registry: &Registry, started_at: u64) -> Status {
        Status {
            state: State::Online,
            node: node.into(),
            version: env!("CARGO_PKG_VERSION"),
            started_at,
            uptime_s: 0,
            requests: Default::default(),
            cache: Default::default(),
            cloud: None,
            reload_error: None,
            restart_needed: Vec::new(),
            rss_bytes: None,
            peak_rss_bytes: None,
            models: models(registry, &newest(registry), None),
            rollout: BTreeMap::new(),
            build: Build::THIS,
            config_sha256: None,
            share_group: None,
            field_quality: Vec::new(),
        }
    }

    /// The message with `state` and what it had at start (the last will).
    pub fn with_state(&self, state: State) -> Vec<u8> {
        let mut s = self.clone();
        s.state = state;
        serde_json::to_vec(&s).expect("status serializes")
    }

    /// The message as of now: `state`, uptime, the models in service, request
    /// counts and the cache.
    pub fn snapshot(&self, state: State, live: EngineSnapshot) -> Vec<u8> {
        let mut s = self.clone();
        s.state = state;
        s.uptime_s = unix_now().saturating_sub(self.started_at);
        s.models = models(&live.registry, &live.serving, live.deployments.as_deref());
        s.rollout = rollout(live.deployments.as_deref(), &live.trials);
        s.config_sha256 = live.config_sha256;
        s.requests = live.requests;
        s.cache = live.cache;
        s.cloud = live.cloud;
        s.reload_error = live.reload_error;
        s.restart_needed = live.restart_needed;
        s.field_quality = live.field_quality.to_vec();
        s.rss_bytes = super::resident_bytes();
        s.peak_rss_bytes = super::peak_resident_bytes();
        serde_json::to_vec(&s).expect("status serializes")
    }
}

fn newest(registry: &Registry) -> Vec<(String, String)> {
    registry.active().map(|m| (m.name().to_string(), m.version().to_string())).collect()
}

/// Every loaded version; `active` marks the one serving requests that name
/// none.
fn models(
    registry: &Registry,
    serving: &[(String, String)],
    deployments: Option<&Deployments>,
) -> Vec<ModelStatus> {
    let deployed = |m: &LoadedModel| deployments?.models.get(m.name())?.deployed.get(m.version());
    registry
        .all()
        .map(|m| ModelStatus {
            name: m.name().into(),
            version: m.version().into(),
            sha256: m.manifest.sha256.clone(),
            manifest_sha256: m.manifest_sha256.clone(),
            deployed_at_s: deployed(m).map(|d| d.at_s),
            deployed_by: deployed(m).map(|d| d.by.clone()),
            quantization: m.manifest.quantization.as_str(),
            active: serving.contains(&(m.name().to_string(), m.version().to_string())),
        })
        .collect()
}

pub fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
