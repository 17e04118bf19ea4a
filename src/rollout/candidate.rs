//! A version on trial: what the deployment state keeps of a rollout (its
//! version, mode, policy and step) and how much of the traffic it gets.
//! How a rollout starts and moves is in `plan.rs`.

use crate::config::{RolloutMode, RolloutPolicy};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The model version on trial; for a config rollout, stable's.
    pub version: String,
    /// For a config rollout: the config version on trial (its text in
    /// `Deployment::configs`), answering with stable's model version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    pub mode: RolloutMode,
    /// The steps and gates this rollout was started with.
    pub policy: RolloutPolicy,
    /// Which of `policy.steps` a canary is at (from 0); 0 otherwise.
    pub step: usize,
    pub step_started_s: u64,
    /// A random id each step gets: the answers reported for one step (or
    /// one rollout) never count for another, even one started the same
    /// second with the same version.
    #[serde(default)]
    pub step_id: u64,
    pub started_at_s: u64,
    /// Who started it.
    pub by: String,
    /// Why it waits for a person, once its gates lacked data too long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
}

impl Candidate {
    /// A rollout of `version` (with `config`, a config rollout) at its first
    /// step, started by `by` now.
    pub fn starting(
        (version, config): (String, Option<String>),
        (mode, policy): (RolloutMode, RolloutPolicy),
        by: &str,
        now_s: u64,
    ) -> Candidate {
        Candidate {
            version,
            config,
            mode,
            policy,
            step: 0,
            step_started_s: now_s,
            step_id: fastrand::u64(1..),
            started_at_s: now_s,
            by: by.into(),
            held: None,
        }
    }

    /// The percentage of devices the candidate answers (none in shadow).
    pub fn share(&self) -> u8 {
        match self.mode {
            RolloutMode::Canary => self.policy.steps.get(self.step).copied().unwrap_or(100),
            RolloutMode::Ab => self.policy.ab_share,
            RolloutMode::Shadow => 0,
        }
    }

    /// What is on trial, in words: `v2`, or `config 3f2a...` on stable's version.
    pub fn describe(&self) -> String {
        match &self.config {
            Some(config) => format!("config {config}"),
            None => format!("v{}", self.version),
        }
    }

    /// Whether an answer of `version` with config `config` is the candidate's.
    pub fn answered(&self, version: &str, config: &str) -> bool {
        version == self.version && self.config.as_ref().is_none_or(|c| c == config)
    }

    /// Where the rollout stands, in words (for decisions' reasons).
    pub fn describe_step(&self) -> String {
        let c = self;
        match c.mode {
            RolloutMode::Canary => {
                format!("step {} of {}, {}% of devices", c.step + 1, c.policy.steps.len(), c.share())
            }
            RolloutMode::Ab => format!("{}% of devices, no automatic decision", c.share()),
            RolloutMode::Shadow => {
                format!("{:.0}% of requests run on it too", c.policy.compare_share * 100.0)
            }
        }
    }
}
