//! Stage 2: which model version answers, found together with the inference
//! threads that run it, so the two cannot disagree. The version a transport
//! names (`/v2/models/M/versions/V/infer`) wins over
//! `parameters.model_version`, which wins over the deployment state: during
//! a rollout the candidate answers its share of devices (sticky by the
//! device the transport names, so a device does not flip between versions),
//! otherwise the stable version it pins, otherwise the newest.

use super::envelope::Envelope;
use super::run::Runner;
use crate::config::RolloutMode;
use crate::model::Versions;
use crate::protocol::{InferError, InferRequest};
use crate::rollout::Deployments;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Where a request goes.
pub struct Route<'g> {
    pub runner: &'g Arc<Runner>,
    /// During a rollout: its answer is reported to the rollout, and maybe
    /// also run on the other version to compare.
    pub trial: Option<Trial<'g>>,
}

/// A request taking part in a rollout.
pub struct Trial<'g> {
    /// The version that does not answer it.
    pub other: &'g Arc<Runner>,
    /// Whether to also run it on `other` and compare the answers.
    pub compare: bool,
    /// The rollout's step it was routed in.
    pub step_id: u64,
}

pub fn resolve<'g>(
    runners: &'g Versions<Arc<Runner>>,
    envelope: &Envelope<'_>,
    req: &InferRequest,
    deployments: Option<&Deployments>,
) -> Result<Route<'g>, InferError> {
    if let Some(version) = envelope.version.or(req.parameters.model_version.as_deref()) {
        return Ok(Route { runner: runners.get(envelope.model, Some(version))?, trial: None });
    }
    let deployment = deployments.and_then(|d| d.models.get(envelope.model));
    let stable = runners.serving(envelope.model, deployment.map(|d| d.stable.as_str()))?;
    let plain = Route { runner: stable, trial: None };
    let Some(candidate) = deployment.and_then(|d| d.candidate.as_ref()) else { return Ok(plain) };
    // A candidate whose directory is gone (removed by hand): stable serves.
    let Ok(on_trial) = runners.get(envelope.model, Some(&candidate.version)) else { return Ok(plain) };
    let sampled = || fastrand::f64() < candidate.policy.compare_share;
    let step_id = candidate.step_id;
    if candidate.mode == RolloutMode::Shadow {
        let trial = Trial { other: on_trial, compare: sampled(), step_id };
        return Ok(Route { runner: stable, trial: Some(trial) });
    }
    let place = split_key(envelope.device, &req.id).map_or_else(|| fastrand::u32(..10_000), bucket);
    if place < u32::from(candidate.share()) * 100 {
        Ok(Route { runner: on_trial, trial: Some(Trial { other: stable, compare: sampled(), step_id }) })
    } else {
        Ok(Route { runner: stable, trial: Some(Trial { other: on_trial, compare: false, step_id }) })
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
