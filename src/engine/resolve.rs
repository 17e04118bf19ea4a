//! Stage 2: which model version answers, found together with the inference
//! threads that run it, so the two cannot disagree. The version a transport
//! names (`/v2/models/M/versions/V/infer`) wins over
//! `parameters.model_version`, which wins over the deployment state: during
//! a rollout the candidate answers its share of devices (sticky by the
//! device the transport names, so a device does not flip between versions),
//! otherwise the stable version it pins, otherwise the newest. With the
//! version comes the config it serves with (`settings.rs`): stable's, or a
//! config rollout's candidate for its share of devices.

use super::envelope::Envelope;
use super::generation::Generation;
use super::settings::Arm;
use crate::config::RolloutMode;
use crate::protocol::{InferError, InferRequest};
use crate::rollout::Deployments;
use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};

/// Where a request goes.
pub struct Route {
    pub arm: Arm,
    /// During a rollout: its answer is reported to the rollout, and maybe
    /// also run on the other version to compare.
    pub trial: Option<Trial>,
}

/// A request taking part in a rollout.
pub struct Trial {
    /// The version (or config) that does not answer it.
    pub other: Arm,
    /// Whether to also run it on `other` and compare the answers.
    pub compare: bool,
    /// The rollout's step it was routed in.
    pub step_id: u64,
}

pub fn resolve(
    generation: &Generation,
    envelope: &Envelope<'_>,
    req: &InferRequest,
    deployments: Option<&Deployments>,
) -> Result<Route, InferError> {
    let (runners, options) = (&generation.runners, &generation.options);
    let deployment = deployments.and_then(|d| d.models.get(envelope.model));
    let node = options.settings(envelope.model);
    let deployed = &generation.deployed;
    // The config versions any deployment names: threads started for one
    // no longer named stop.
    let live = || -> BTreeSet<String> {
        let models = deployments.into_iter().flat_map(|d| d.models.values());
        let named = models
            .flat_map(|d| [d.stable_config.clone(), d.candidate.as_ref().and_then(|c| c.config.clone())]);
        named.flatten().collect()
    };
    let sizing = (options.threads_per_model, options.queue_capacity);
    let arm = |runner, config: Option<&String>| {
        deployed.arm(runner, deployed.settings(config, deployment, node), sizing, live)
    };
    let stable_config = deployment.and_then(|d| d.stable_config.as_ref());
    if let Some(version) = envelope.version.or(req.parameters.model_version.as_deref()) {
        let runner = runners.get(envelope.model, Some(version))?;
        return Ok(Route { arm: arm(runner, stable_config)?, trial: None });
    }
    let stable = runners.serving(envelope.model, deployment.map(|d| d.stable.as_str()))?;
    let Some(candidate) = deployment.and_then(|d| d.candidate.as_ref()) else {
        return Ok(Route { arm: arm(stable, stable_config)?, trial: None });
    };
    // A candidate whose directory is gone (removed by hand): stable serves.
    let Ok(on_trial) = runners.get(envelope.model, Some(&candidate.version)) else {
        return Ok(Route { arm: arm(stable, stable_config)?, trial: None });
    };
    let (stable, on_trial) =
        (arm(stable, stable_config)?, arm(on_trial, candidate.config.as_ref().or(stable_config))?);
    let sampled = || fastrand::f64() < candidate.policy.compare_share;
    let step_id = candidate.step_id;
    if candidate.mode == RolloutMode::Shadow {
        let trial = Trial { other: on_trial, compare: sampled(), step_id };
        return Ok(Route { arm: stable, trial: Some(trial) });
    }
    let place = split_key(envelope.device, &req.id).map_or_else(|| fastrand::u32(..10_000), bucket);
    if place < u32::from(candidate.share()) * 100 {
        Ok(Route { arm: on_trial, trial: Some(Trial { other: stable, compare: sampled(), step_id }) })
    } else {
        Ok(Route { arm: stable, trial: Some(Trial { other: on_trial, compare: false, step_id }) })
    }
}

/// What a request is split by: the device the transport names (its reply
/// topic over MQTT; `X-Device-Id`, else the peer's address, over HTTP), else
/// the request's id. Not the HTTP bearer token: `http.token_file` holds one
/// token that every device presents, so it names no device. `None` when
/// neither is known: hashing an empty key would put every such request in
/// one bucket, so a 50% split would send them all to one version.
fn split_key<'k>(device: Option<&'k str>, id: &'k str) -> Option<&'k str> {
    device.filter(|d| !d.is_empty()).or(Some(id).filter(|id| !id.is_empty()))
}

/// The device's place in 0..10000, the same in every process (SipHash with
/// fixed keys), so a restart keeps each device on its version.
fn bucket(device: &str) -> u32 {
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    device.hash(&mut hasher);
    (hasher.finish() % 10_000) as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn buckets_spread_devices_evenly_and_stay_put() {
        let under_5 = (0..10_000).filter(|i| super::bucket(&format!("site/dev{i}/replies")) < 500).count();
        assert!((350..650).contains(&under_5), "{under_5} of 10000 devices at 5%");
        assert_eq!(super::bucket("a/b"), super::bucket("a/b"));
    }

    #[test]
    fn the_http_split_follows_the_device_and_never_hashes_an_empty_key() {
        assert_eq!(super::split_key(Some("gw-7"), "req-1"), Some("gw-7"));
        assert_eq!(super::split_key(Some(""), "req-1"), Some("req-1"), "an empty device: the id");
        assert_eq!(super::split_key(None, "req-1"), Some("req-1"));
        assert_eq!(super::split_key(None, ""), None, "nothing to split by: a random place");
        assert_eq!(super::split_key(Some(""), ""), None);
    }
}
