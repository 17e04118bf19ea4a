//! The deployment state of each model, in `node.state_dir/deployments.json`:
//! which version is stable, the stables before it (what a rollback returns
//! to) and the decisions taken. Written whole to a new file, synced, then
//! renamed over the old one, before a decision takes effect: a kill -9 at
//! any moment leaves the old state or the new, never a torn one. A node
//! without the file serves as it always did: the newest version. How a
//! rollout starts and steps is in `plan.rs`; ending one (a rollback) is here.

use super::candidate::Candidate;
use super::gates::Gate;
use crate::config::ServingConfig;
use crate::model::Fingerprints;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const FILE_NAME: &str = "deployments.json";
/// Decisions kept per model; older ones fall off.
const HISTORY: usize = 50;
/// Promoted configs a rollback may return to, per model (each at most 8 KiB
/// with its file): older ones fall off.
const PREVIOUS_CONFIGS: usize = 10;

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("no model {model:?} here; models: {known}")]
    UnknownModel { model: String, known: String },
    #[error("model {model} has no version {version:?}; versions: {known}")]
    UnknownVersion { model: String, version: String, known: String },
    #[error("model {model}: nothing to roll back to ({why})")]
    NothingToRollBack { model: String, why: String },
    #[error("model {model} v{version} was found but refused at load: {reason}")]
    VersionRefused { model: String, version: String, reason: String },
    #[error("model {model} v{version} is already stable")]
    AlreadyStable { model: String, version: String },
    #[error("model {model} has v{version} in a {mode} rollout; promote or roll it back first")]
    InRollout { model: String, version: String, mode: &'static str },
    #[error("{0}")]
    BadPolicy(String),
    #[error("the config candidate: {0}")]
    BadConfig(String),
    #[error("the deployment state {path}: {reason}")]
    State { path: PathBuf, reason: String },
    #[error(
        "command id {id:?} was used for {was:?}; this command asks {now:?}: give each command its own id"
    )]
    IdReused { id: String, was: String, now: String },
    #[error(
        "the rollout task did not answer within {waited_s} s (the state disk may be slow or hung); the command \
         may still take effect: check `models status`, and send it again with the same id if it did not"
    )]
    Slow { waited_s: u64 },
    #[error("the rollout task has stopped")]
    Stopped,
}

impl RolloutError {
    /// The error's class, as the control topic names it (and HTTP maps to
    /// 404, 409, 500).
    pub fn code(&self) -> &'static str {
        match self {
            RolloutError::UnknownModel { .. } | RolloutError::UnknownVersion { .. } => "unknown_model",
            RolloutError::NothingToRollBack { .. }
            | RolloutError::AlreadyStable { .. }
            | RolloutError::InRollout { .. }
            | RolloutError::IdReused { .. }
            | RolloutError::VersionRefused { .. } => "conflict",
            RolloutError::BadPolicy(_) | RolloutError::BadConfig(_) => "invalid_payload",
            RolloutError::Slow { .. } => "overloaded",
            RolloutError::State { .. } | RolloutError::Stopped => "internal",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Promoted,
    RolledBack,
    /// A rollout of a candidate began.
    Started,
    /// The candidate's gates passed and it moved to the next step.
    Stepped,
    /// The step's gates lacked data for too long; it waits for a person.
    Held,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Promoted => "promoted",
            Action::RolledBack => "rolled back",
            Action::Started => "started a rollout",
            Action::Stepped => "stepped",
            Action::Held => "held",
        }
    }

    /// As the metrics' `action` label and the JSON name it.
    pub fn label(self) -> &'static str {
        match self {
            Action::Promoted => "promoted",
            Action::RolledBack => "rolled_back",
            Action::Started => "started",
            Action::Stepped => "stepped",
            Action::Held => "held",
        }
    }
}

/// Who asks for a decision, and the id of their command when it may come
/// twice (the control topic's).
#[derive(Debug, Clone)]
pub struct Asker {
    pub by: String,
    pub command_id: Option<String>,
    /// What the command asks (`promote digits v2`), filled in by the owner
    /// thread: kept with the id, so an id reused for another command is
    /// refused instead of answered with an unrelated decision.
    pub asked: Option<String>,
}

impl Asker {
    pub fn named(by: &str) -> Asker {
        Asker { by: by.into(), command_id: None, asked: None }
    }
}

/// One decision, as the status and `models status` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub model: String,
    pub at_s: u64,
    pub action: Action,
    /// The version that became stable; for a rollout's start, step or hold,
    /// the candidate.
    pub version: String,
    /// The version that was stable before (or the candidate rolled back).
    pub from: String,
    /// Who asked: `models promote` (a terminal), `http`, ...
    pub by: String,
    pub reason: String,
    /// The id of the command that asked for it, where one came with it (the
    /// control topic's): a redelivered command finds its decision here and
    /// is not applied twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// What that command asked (`Asker::asked`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// The gates' figures a rollout decision was taken on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gates: Vec<Gate>,
    /// For a config change (a config rollout, its promotion or rollback;
    /// `version` and `from` are then the same model version): the config
    /// version it is about, and the one serving before. `None` inside is
    /// the node config's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigChange>,
}

/// The config versions a config decision moves between.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigChange {
    /// A rollout's candidate, or the config serving after the decision.
    pub to: Option<String>,
    pub from: Option<String>,
}

impl Decision {
    pub(super) fn new(
        model: &str,
        action: Action,
        version: &str,
        from: &str,
        asker: &Asker,
        now_s: u64,
    ) -> Decision {
        let reason = match action {
            Action::Promoted => "promoted by command",
            Action::RolledBack => "rolled back by command",
            Action::Started => "rollout started by command",
            Action::Stepped | Action::Held => "by the rollout's gates",
        };
        Decision {
            model: model.into(),
            at_s: now_s,
            action,
            version: version.into(),
            from: from.into(),
            by: asker.by.clone(),
            reason: reason.into(),
            command_id: asker.command_id.clone(),
            command: asker.command_id.as_ref().and(asker.asked.clone()),
            gates: Vec::new(),
            config: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Deployment {
    pub stable: String,
    /// Earlier stables, oldest first: a rollback returns to the last one.
    pub previous: Vec<String>,
    /// Newest last, at most `HISTORY`.
    pub history: Vec<Decision>,
    /// When each version last became stable, and by which command.
    #[serde(default)]
    pub deployed: BTreeMap<String, Deployed>,
    /// A version being tried on part of the traffic, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<Candidate>,
    /// The config version serving, once a config rollout was promoted;
    /// `None`: the node config's `[models.NAME]` (with `[runtime]`, `[cache]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_config: Option<String>,
    /// Earlier stable configs, oldest first: a rollback of a promoted
    /// config returns to the last one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous_configs: Vec<Option<String>>,
    /// Each config version a rollout, the stable or a decision in the
    /// history names: its text and the file it came from.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub configs: BTreeMap<String, ConfigRecord>,
    /// Counts the changes to this deployment: with `site.rollout`, the
    /// site's copy replaces a node's when its count is higher.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub seq: u64,
    /// Why this deployment is in service but not yet on disk: a decision
    /// that sends traffic back to stable takes effect at once, and its save
    /// is retried (a kill -9 meanwhile returns to the state on disk).
    #[serde(skip)]
    pub unsaved: Option<String>,
}

/// One config version in the deployment record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigRecord {
    /// The settings as served (canonical TOML); the version is the first
    /// 12 hex digits of its sha256, this is all of it.
    pub text: String,
    pub sha256: String,
    /// The file `models rollout --config` was given, byte for byte.
    pub file: String,
    pub at_s: u64,
    pub by: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployed {
    pub at_s: u64,
    pub by: String,
}

/// One version in the deployment record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionRecord {
    pub version: String,
    /// The model file's sha256 and the manifest's (preprocessing, labels).
    pub sha256: Option<String>,
    pub manifest_sha256: Option<String>,
    /// When it last became stable and by which command; absent for a
    /// version that never did (or served only as the newest, before any
    /// decision).
    pub deployed_at_s: Option<u64>,
    pub deployed_by: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Deployments {
    pub models: BTreeMap<String, Deployment>,
}

/// The versions of each model that could serve (loaded, or on disk), in
/// serving order (the newest last).
pub type Available = BTreeMap<String, Vec<String>>;

impl Deployments {
    /// The state in `state_dir`; none yet is an empty one.
    pub fn load(state_dir: &Path) -> Result<Deployments, RolloutError> {
        let path = state_dir.join(FILE_NAME);
        let error = |reason: String| RolloutError::State { path: path.clone(), reason };
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                error(format!("cannot be read ({e}); move it away to serve the newest versions"))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Deployments::default()),
            Err(e) => Err(error(e.to_string())),
        }
    }

    /// Replaces the file in `state_dir` with this state, durably.
    pub fn save(&self, state_dir: &Path) -> Result<(), RolloutError> {
        let path = state_dir.join(FILE_NAME);
        let error = |e: std::io::Error| RolloutError::State { path: path.clone(), reason: e.to_string() };
        // `sleep(MS)`: a hung disk; `return`: one that refuses the write.
        fail::fail_point!("rollout_save", |_| Err(error(std::io::Error::other("failpoint rollout_save"))));
        std::fs::create_dir_all(state_dir).map_err(error)?;
        let fresh = state_dir.join(format!("{FILE_NAME}.new"));
        let mut file = std::fs::File::create(&fresh).map_err(error)?;
        let text = serde_json::to_vec_pretty(self).expect("the state is plain data");
        file.write_all(&text).and_then(|()| file.sync_all()).map_err(error)?;
        std::fs::rename(&fresh, &path).map_err(error)?;
        // The rename itself is durable once the directory is synced.
        std::fs::File::open(state_dir).and_then(|d| d.sync_all()).map_err(error)
    }

    /// Whether any decision is in service but not yet on disk.
    pub fn has_unsaved(&self) -> bool {
        self.models.values().any(|d| d.unsaved.is_some())
    }

    /// The decision a command with this id already took, if any.
    pub fn taken(&self, command_id: &str) -> Option<&Decision> {
        self.models.values().flat_map(|d| &d.history).find(|d| d.command_id.as_deref() == Some(command_id))
    }

    /// The pinned stable version of `model`, if any.
    pub fn stable(&self, model: &str) -> Option<&str> {
        self.models.get(model).map(|d| d.stable.as_str())
    }

    /// The version serving `model` now: its stable if it can serve, else
    /// the newest available (what a node without state serves).
    pub fn serving<'a>(&'a self, model: &str, available: &'a Available) -> Option<&'a str> {
        let versions = available.get(model)?;
        match self.stable(model) {
            Some(v) if versions.iter().any(|a| a == v) => Some(v),
            _ => versions.last().map(String::as_str),
        }
    }

    /// Makes `version` (default: the newest available) `model`'s stable.
    pub fn promote(
        &mut self,
        model: &str,
        version: Option<&str>,
        available: &Available,
        asker: &Asker,
        now_s: u64,
    ) -> Result<Decision, RolloutError> {
        let versions = versions_of(model, available)?;
        // A config rollout: promoting it (naming no version, or its own)
        // makes its config stable.
        if let Some(deployment) = self.models.get_mut(model)
            && let Some(c) = &deployment.candidate
            && c.config.is_some()
            && version.is_none_or(|v| v == c.version)
        {
            let reason = "config promoted by command".to_string();
            return Ok(promote_config(deployment, model, asker, now_s, (reason, Vec::new())));
        }
        let version = match version {
            Some(v) if versions.iter().any(|a| a == v) => v.to_string(),
            Some(v) => {
                return Err(RolloutError::UnknownVersion {
                    model: model.into(),
                    version: v.into(),
                    known: versions.join(", "),
                });
            }
            None => versions.last().cloned().unwrap_or_default(),
        };
        let from = self.serving(model, available).unwrap_or_default().to_string();
        if from == version {
            return Err(RolloutError::AlreadyStable { model: model.into(), version });
        }
        let deployment = self.models.entry(model.to_string()).or_default();
        // Promoting ends a rollout, whichever version it promotes.
        deployment.candidate = None;
        if !from.is_empty() {
            deployment.previous.push(from.clone());
            keep_last(&mut deployment.previous);
        }
        Ok(record(deployment, Decision::new(model, Action::Promoted, &version, &from, asker, now_s)))
    }

    /// Pins `version` (the one serving) as `model`'s stable where nothing is
    /// pinned: with `auto_rollout`, a version found later, even by a
    /// restart, is then tried against it instead of serving everyone.
    pub fn pin(
        &mut self,
        model: &str,
        version: &str,
        asker: &Asker,
        now_s: u64,
    ) -> Result<Decision, RolloutError> {
        if let Some(stable) = self.stable(model) {
            return Err(RolloutError::AlreadyStable { model: model.into(), version: stable.into() });
        }
        let deployment = self.models.entry(model.to_string()).or_default();
        let mut decision = Decision::new(model, Action::Promoted, version, "", asker, now_s);
        decision.reason = "pinned as stable: with auto_rollout a new version is tried against it".into();
        Ok(record(deployment, decision))
    }

    /// Whether any decision of `model` names `version` (started, promoted,
    /// rolled back from or to it).
    pub fn decided_on(&self, model: &str, version: &str) -> bool {
        self.models
            .get(model)
            .is_some_and(|d| d.history.iter().any(|h| h.version == version || h.from == version))
    }

    /// Returns `model` to the stable before the current one (without state:
    /// the next older available version).
    pub fn rollback(
        &mut self,
        model: &str,
        available: &Available,
        asker: &Asker,
        now_s: u64,
    ) -> Result<Decision, RolloutError> {
        let versions = versions_of(model, available)?;
        // During a rollout, a rollback ends it: all traffic to stable.
        if let Some(decision) = self.abandon(model, asker, now_s, None) {
            return Ok(decision);
        }
        // The last promotion was a config's: back to the config before it.
        if let Some(deployment) = self.models.get_mut(model)
            && !deployment.previous_configs.is_empty()
            && deployment
                .history
                .iter()
                .rev()
                .find(|h| h.action == Action::Promoted)
                .is_some_and(|h| h.config.is_some())
        {
            let to = deployment.previous_configs.pop().flatten();
            let from = std::mem::replace(&mut deployment.stable_config, to.clone());
            let stable = deployment.stable.clone();
            let mut decision = Decision::new(model, Action::RolledBack, &stable, &stable, asker, now_s);
            decision.reason = "config rolled back by command".into();
            decision.config = Some(ConfigChange { to, from });
            return Ok(record(deployment, decision));
        }
        let from = self.serving(model, available).unwrap_or_default().to_string();
        let deployment = self.models.entry(model.to_string()).or_default();
        // The last earlier stable that can still serve; without any, the
        // next older version on disk.
        let target = loop {
            match deployment.previous.pop() {
                Some(v) if versions.contains(&v) && v != from => break Some(v),
                Some(_) => continue,
                None => {
                    let at = versions.iter().position(|v| *v == from).unwrap_or(0);
                    break at.checked_sub(1).map(|i| versions[i].clone());
                }
            }
        };
        let Some(version) = target else {
            if deployment.stable.is_empty() {
                self.models.remove(model);
            }
            return Err(RolloutError::NothingToRollBack {
                model: model.into(),
                why: format!("v{from} is the oldest version here"),
            });
        };
        Ok(record(deployment, Decision::new(model, Action::RolledBack, &version, &from, asker, now_s)))
    }

    /// Ends `model`'s rollout, if it has one: all traffic to stable. `why`:
    /// the gate that failed (none: a person asked).
    pub(super) fn abandon(
        &mut self,
        model: &str,
        asker: &Asker,
        now_s: u64,
        why: Option<(String, Vec<Gate>)>,
    ) -> Option<Decision> {
        let deployment = self.models.get_mut(model)?;
        let candidate = deployment.candidate.take()?;
        let stable = deployment.stable.clone();
        let mut decision =
            Decision::new(model, Action::RolledBack, &stable, &candidate.version, asker, now_s);
        if candidate.config.is_some() {
            decision.config =
                Some(ConfigChange { to: deployment.stable_config.clone(), from: candidate.config.clone() });
        }
        if let Some((reason, gates)) = why {
            (decision.reason, decision.gates) = (reason, gates);
        } else {
            decision.reason = format!("rollout rolled back by command at {}", candidate.describe_step());
        }
        Some(record(deployment, decision))
    }
}

/// One model's deployment as `models status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    pub model: String,
    /// The version answering requests that name none.
    pub serving: String,
    /// The version the state pins; absent: the newest serves.
    pub stable: Option<String>,
    /// What `models rollback` returns to.
    pub previous: Option<String>,
    pub versions: Vec<String>,
    /// Per version: its files' hashes and when it was deployed, by what.
    pub records: Vec<VersionRecord>,
    pub history: Vec<Decision>,
    /// The rollout in progress: its candidate, mode, step and policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<Candidate>,
    /// Its figures and gates at this step (only a running node has them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial: Option<super::gates::Trial>,
    /// The last decision took effect but is not on disk yet: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsaved: Option<String>,
    /// Per version, what devices reported of its answers since the node
    /// started (only a running node has them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub field_quality: Vec<super::FieldQuality>,
    /// The config stable serves with, and a config rollout's candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigShown>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate_config: Option<ConfigShown>,
}

/// A config version as `models status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigShown {
    pub version: String,
    /// `node config` (its `[models.NAME]`) or `deployment` (a promoted or
    /// candidate config, kept in the state).
    pub source: String,
    /// The settings as served (canonical TOML).
    pub text: String,
}

impl Deployments {
    /// Every model available, or only `model`.
    /// `node` gives a model's serving settings as the node config has them.
    pub fn report(
        &self,
        available: &Available,
        fingerprints: &Fingerprints,
        model: Option<&str>,
        node: &dyn Fn(&str) -> ServingConfig,
    ) -> Result<Vec<ModelReport>, RolloutError> {
        if let Some(m) = model {
            versions_of(m, available)?;
        }
        let wanted = available.iter().filter(|(name, _)| model.is_none_or(|m| m == name.as_str()));
        Ok(wanted
            .map(|(name, versions)| {
                let deployment = self.models.get(name);
                ModelReport {
                    model: name.clone(),
                    serving: self.serving(name, available).unwrap_or_default().to_string(),
                    stable: deployment.map(|d| d.stable.clone()),
                    // During a rollout a rollback ends it: back to stable alone.
                    previous: deployment
                        .and_then(|d| match &d.candidate {
                            Some(_) => Some(d.stable.clone()),
                            None => d.previous.last().cloned(),
                        })
                        .or_else(|| {
                            // Without state a rollback goes one older.
                            let at = versions.len().checked_sub(2)?;
                            deployment.is_none().then(|| versions[at].clone())
                        }),
                    versions: versions.clone(),
                    records: versions
                        .iter()
                        .map(|v| {
                            let print = fingerprints.get(name).and_then(|f| f.get(v));
                            let deployed = deployment.and_then(|d| d.deployed.get(v));
                            VersionRecord {
                                version: v.clone(),
                                sha256: print.map(|p| p.sha256.clone()),
                                manifest_sha256: print.map(|p| p.manifest_sha256.clone()),
                                deployed_at_s: deployed.map(|d| d.at_s),
                                deployed_by: deployed.map(|d| d.by.clone()),
                            }
                        })
                        .collect(),
                    history: deployment.map(|d| d.history.clone()).unwrap_or_default(),
                    candidate: deployment.and_then(|d| d.candidate.clone()),
                    trial: None,
                    unsaved: deployment.and_then(|d| d.unsaved.clone()),
                    field_quality: Vec::new(),
                    config: Some(shown(deployment, name, node)),
                    candidate_config: deployment.and_then(|d| {
                        let version = d.candidate.as_ref()?.config.clone()?;
                        let text = d.configs.get(&version)?.text.clone();
                        Some(ConfigShown { version, source: "deployment".into(), text })
                    }),
                }
            })
            .collect())
    }
}

/// The config `model` serves with: the promoted one, else the node config's.
fn shown(deployment: Option<&Deployment>, model: &str, node: &dyn Fn(&str) -> ServingConfig) -> ConfigShown {
    let promoted = deployment.and_then(|d| Some((d.stable_config.clone()?, d)));
    match promoted.and_then(|(v, d)| Some((v.clone(), d.configs.get(&v)?.text.clone()))) {
        Some((version, text)) => ConfigShown { version, source: "deployment".into(), text },
        None => {
            let config = node(model);
            ConfigShown { version: config.version(), source: "node config".into(), text: config.text() }
        }
    }
}

/// Held by a running node for its life, so a command with no node to talk
/// to knows whether it may write the state itself.
pub const LOCK_NAME: &str = "deployments.lock";

/// Takes the lock in `state_dir`; `Ok(None)` when another process holds it.
pub fn lock(state_dir: &Path) -> Result<Option<std::fs::File>, RolloutError> {
    let path = state_dir.join(LOCK_NAME);
    let error = |e: std::io::Error| RolloutError::State { path: path.clone(), reason: e.to_string() };
    std::fs::create_dir_all(state_dir).map_err(error)?;
    let file =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(error)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(error(e)),
    }
}

pub(super) fn versions_of<'a>(
    model: &str,
    available: &'a Available,
) -> Result<&'a Vec<String>, RolloutError> {
    available.get(model).filter(|v| !v.is_empty()).ok_or_else(|| RolloutError::UnknownModel {
        model: model.into(),
        known: available.keys().cloned().collect::<Vec<_>>().join(", "),
    })
}

/// `decision` in the history; a promotion or a rollback to another
/// version makes its version stable, recorded as deployed.
pub(super) fn record(deployment: &mut Deployment, decision: Decision) -> Decision {
    let changes_stable = matches!(decision.action, Action::Promoted | Action::RolledBack);
    if changes_stable && deployment.stable != decision.version {
        deployment.stable = decision.version.clone();
        let deployed = Deployed { at_s: decision.at_s, by: decision.by.clone() };
        deployment.deployed.insert(decision.version.clone(), deployed);
    }
    deployment.history.push(decision.clone());
    keep_last(&mut deployment.history);
    // The config files kept: those the stable, the rollout and the configs
    // a rollback may return to name, and the newest others the history
    // names (a rolled-back candidate's, for the record). The history keeps
    // every version's name; the files stay few, since the site's retained
    // copy carries them.
    let d = &*deployment;
    let candidate = d.candidate.as_ref().and_then(|c| c.config.clone());
    let mut named: std::collections::BTreeSet<String> = [d.stable_config.clone(), candidate]
        .into_iter()
        .chain(d.previous_configs.clone())
        .flatten()
        .collect();
    let recent = d.history.iter().rev().filter_map(|h| h.config.as_ref()).flat_map(|c| [&c.to, &c.from]);
    for version in recent.flatten() {
        if named.len() >= PREVIOUS_CONFIGS + 2 {
            break;
        }
        named.insert(version.clone());
    }
    deployment.configs.retain(|version, _| named.contains(version));
    decision
}

/// Ends `deployment`'s config rollout by making its config stable.
pub(super) fn promote_config(
    deployment: &mut Deployment,
    model: &str,
    asker: &Asker,
    now_s: u64,
    (reason, gates): (String, Vec<Gate>),
) -> Decision {
    let candidate = deployment.candidate.take().expect("a config rollout runs");
    let from = std::mem::replace(&mut deployment.stable_config, candidate.config.clone());
    deployment.previous_configs.push(from.clone());
    let excess = deployment.previous_configs.len().saturating_sub(PREVIOUS_CONFIGS);
    deployment.previous_configs.drain(..excess);
    let mut decision =
        Decision::new(model, Action::Promoted, &candidate.version, &candidate.version, asker, now_s);
    (decision.reason, decision.gates) = (reason, gates);
    decision.config = Some(ConfigChange { to: candidate.config, from });
    record(deployment, decision)
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Drops the oldest entries beyond `HISTORY`.
pub(super) fn keep_last<T>(entries: &mut Vec<T>) {
    let excess = entries.len().saturating_sub(HISTORY);
    entries.drain(..excess);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn available(versions: &[&str]) -> Available {
        BTreeMap::from([("digits".to_string(), versions.iter().map(|v| v.to_string()).collect())])
    }

    #[test]
    fn without_state_the_newest_serves_and_rollback_goes_one_older_then_promote_returns() {
        let two = available(&["1", "2"]);
        let mut state = Deployments::default();
        assert_eq!(state.serving("digits", &two), Some("2"));
        let back = state.rollback("digits", &two, &Asker::named("test"), 10).unwrap();
        assert_eq!((back.action, back.version.as_str(), back.from.as_str()), (Action::RolledBack, "1", "2"));
        assert_eq!(state.serving("digits", &two), Some("1"));
        let err = state.rollback("digits", &two, &Asker::named("test"), 11).unwrap_err().to_string();
        assert!(err.contains("nothing to roll back") && err.contains("v1"), "{err}");
        assert_eq!(state.serving("digits", &two), Some("1"), "a refused rollback changes nothing");
        // A new version on disk does not serve until promoted.
        let three = available(&["1", "2", "3"]);
        assert_eq!(state.serving("digits", &three), Some("1"));
        let up = state.promote("digits", None, &three, &Asker::named("test"), 12).unwrap();
        assert_eq!((up.version.as_str(), up.from.as_str()), ("3", "1"));
        // Rollback returns to the stable before, not merely the next older.
        assert_eq!(state.rollback("digits", &three, &Asker::named("test"), 13).unwrap().version, "1");
        assert_eq!(state.models["digits"].history.len(), 3);
    }

    #[test]
    fn promote_refuses_what_is_not_there_or_already_stable_and_names_what_is() {
        let two = available(&["1", "2"]);
        let mut state = Deployments::default();
        let err = state.promote("digits", Some("7"), &two, &Asker::named("t"), 1).unwrap_err().to_string();
        assert!(err.contains("\"7\"") && err.contains("1, 2"), "{err}");
        let err = state.promote("digits", Some("2"), &two, &Asker::named("t"), 1).unwrap_err().to_string();
        assert!(err.contains("already stable"), "{err}");
        let err = state.promote("kws", None, &two, &Asker::named("t"), 1).unwrap_err().to_string();
        assert!(err.contains("kws") && err.contains("digits"), "{err}");
        assert_eq!(state, Deployments::default(), "refusals leave no state behind");
        // A stable whose directory is gone: the newest serves meanwhile.
        state.promote("digits", Some("1"), &two, &Asker::named("t"), 2).unwrap();
        assert_eq!(state.serving("digits", &available(&["2", "3"])), Some("3"));
    }

    #[test]
    fn the_state_survives_a_save_and_a_torn_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Deployments::load(dir.path()).unwrap(), Deployments::default());
        let mut state = Deployments::default();
        state.rollback("digits", &available(&["1", "2"]), &Asker::named("t"), 5).unwrap();
        state.save(dir.path()).unwrap();
        assert_eq!(Deployments::load(dir.path()).unwrap(), state);
        assert!(!dir.path().join(format!("{FILE_NAME}.new")).exists());
        std::fs::write(dir.path().join(FILE_NAME), b"{\"models\": {\"dig").unwrap();
        let err = Deployments::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains(FILE_NAME) && err.contains("move it away"), "{err}");
    }
}
