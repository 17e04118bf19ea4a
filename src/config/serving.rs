//! How one model serves, apart from which version: its batching, cascade
//! threshold and tier, cache TTL, default `top_k` and preprocessing, each
//! resolved (the `[models.NAME]` key, else its `[runtime]` or `[cache]`
//! default). A *config version* is this set of values, named by the first
//! 12 hex digits of the sha256 of its canonical TOML text: the node
//! config's is one, and `models rollout NAME --config FILE.toml` tries
//! another (a `ServingChange` over stable's) on part of the traffic like a
//! model version. The text is what the deployment record keeps, so a
//! rollback restores the values exactly.

use super::Config;
use crate::protocol::{Confidence, Enrich};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The largest config candidate file taken: it travels in an HTTP body, a
/// signed control command and the deployment state.
pub const MAX_CHANGE_BYTES: usize = 4096;

/// One model's serving settings, every value resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServingConfig {
    /// The cloud tier's name for the model; absent: the same name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_model: Option<String>,
    pub threshold: f64,
    pub confidence: Confidence,
    pub enrich: Enrich,
    pub max_batch: usize,
    pub max_delay_us: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_budget_ms: Option<f64>,
    pub cache_ttl_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preprocess_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preprocess_offset: Option<f64>,
}

/// A config candidate file: any of the keys of `ServingConfig` (the same
/// names as in `[models.NAME]`); the others stay as stable has them.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServingChange {
    pub cloud_model: Option<String>,
    pub threshold: Option<f64>,
    pub confidence: Option<Confidence>,
    pub enrich: Option<Enrich>,
    pub max_batch: Option<usize>,
    pub max_delay_us: Option<u64>,
    pub latency_budget_ms: Option<f64>,
    pub cache_ttl_s: Option<u64>,
    pub top_k: Option<u32>,
    pub preprocess_scale: Option<f64>,
    pub preprocess_offset: Option<f64>,
}

/// The keys a config candidate may set, for error messages.
pub const CHANGE_KEYS: &str = "cloud_model, threshold, confidence, enrich, max_batch, max_delay_us, \
                               latency_budget_ms, cache_ttl_s, top_k, preprocess_scale, preprocess_offset";

/// A decimal f32 as the f64 it reads as (0.9, not 0.8999999761581421), so
/// the canonical text shows what the operator wrote.
fn widen(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

impl Config {
    /// `model`'s serving settings as this config resolves them.
    pub fn serving(&self, model: &str) -> ServingConfig {
        match self.models.get(model) {
            Some(m) => self.serving_of(m.clone()),
            None => self.default_serving(),
        }
    }

    /// The serving settings of a model without its own `[models.NAME]`.
    pub fn default_serving(&self) -> ServingConfig {
        self.serving_of(super::ModelConfig::default())
    }

    fn serving_of(&self, m: super::ModelConfig) -> ServingConfig {
        let rt = &self.runtime;
        ServingConfig {
            cloud_model: m.cloud_model,
            threshold: widen(m.threshold),
            confidence: m.confidence,
            enrich: m.enrich,
            max_batch: m.max_batch.unwrap_or(rt.max_batch),
            max_delay_us: m.max_delay_us.unwrap_or(rt.max_delay_us),
            latency_budget_ms: m.latency_budget_ms.or(rt.latency_budget_ms),
            cache_ttl_s: m.cache_ttl_s.unwrap_or(self.cache.ttl_s),
            top_k: m.top_k,
            preprocess_scale: m.preprocess_scale.map(widen),
            preprocess_offset: m.preprocess_offset.map(widen),
        }
    }
}

impl ServingConfig {
    /// The canonical text: TOML, keys in a fixed order.
    pub fn text(&self) -> String {
        toml::to_string(self).expect("plain values serialize")
    }

    /// The config version: the first 12 hex digits of the text's sha256.
    pub fn version(&self) -> String {
        version_of(&self.text())
    }

    /// Reads a canonical text back (a deployment record's).
    pub fn from_text(text: &str) -> Result<ServingConfig, String> {
        toml::from_str(text).map_err(|e| e.message().to_string())
    }

    /// These settings with `change`'s keys over them.
    pub fn with_change(&self, change: &ServingChange) -> ServingConfig {
        let c = change.clone();
        ServingConfig {
            cloud_model: c.cloud_model.or_else(|| self.cloud_model.clone()),
            threshold: c.threshold.unwrap_or(self.threshold),
            confidence: c.confidence.unwrap_or(self.confidence),
            enrich: c.enrich.unwrap_or(self.enrich),
            max_batch: c.max_batch.unwrap_or(self.max_batch),
            max_delay_us: c.max_delay_us.unwrap_or(self.max_delay_us),
            latency_budget_ms: c.latency_budget_ms.or(self.latency_budget_ms),
            cache_ttl_s: c.cache_ttl_s.unwrap_or(self.cache_ttl_s),
            top_k: c.top_k.or(self.top_k),
            preprocess_scale: c.preprocess_scale.or(self.preprocess_scale),
            preprocess_offset: c.preprocess_offset.or(self.preprocess_offset),
        }
    }

    /// What is wrong with the values, each as (key under `prefix`, what is
    /// allowed): the checks `[models.NAME]` gets, shared.
    pub fn problems(&self, prefix: &str) -> Vec<(String, String)> {
        let mut bad = Vec::new();
        let mut say = |key: &str, message: String| bad.push((format!("{prefix}.{key}"), message));
        if !(1..=4096).contains(&self.max_batch) {
            say("max_batch", format!("{}: use 1 (no batching) to 4096", self.max_batch));
        }
        if self.max_delay_us > 1_000_000 {
            say("max_delay_us", format!("{}: use 0 to 1000000 (one second)", self.max_delay_us));
        }
        if let Some(b) = self.latency_budget_ms
            && !(b > 0.0 && b <= 60_000.0)
        {
            say("latency_budget_ms", format!("{b}: use a positive number of milliseconds"));
        }
        if !(0.0..=1.0).contains(&self.threshold) {
            say("threshold", format!("{}: use a confidence between 0.0 and 1.0", self.threshold));
        }
        if let Some(k) = self.top_k
            && k > 1000
        {
            say("top_k", format!("{k}: use 0 (none) to 1000"));
        }
        for (key, value) in
            [("preprocess_scale", self.preprocess_scale), ("preprocess_offset", self.preprocess_offset)]
        {
            if let Some(v) = value
                && !(v.is_finite() && v.abs() <= 1e6)
            {
                say(key, format!("{v}: use a finite number within +-1000000"));
            }
        }
        bad
    }
}

/// A config candidate file's text, read: refused when too large, not TOML,
/// naming an unknown key, or setting nothing.
pub fn parse_change(text: &str) -> Result<ServingChange, String> {
    if text.len() > MAX_CHANGE_BYTES {
        return Err(format!("{} bytes: keep it under {MAX_CHANGE_BYTES}", text.len()));
    }
    let change: ServingChange = toml::from_str(text).map_err(|e| {
        let message = e.message().trim().to_string();
        match message.starts_with("unknown field") {
            true => format!("{message}; a config candidate sets only {CHANGE_KEYS}"),
            false => message,
        }
    })?;
    if change == ServingChange::default() {
        return Err(format!("it sets no key; set one or more of {CHANGE_KEYS}"));
    }
    Ok(change)
}

/// The version of a canonical text.
pub fn version_of(text: &str) -> String {
    sha256_of(text)[..12].to_string()
}

/// The whole sha256 of a canonical text, in hex; its first 12 digits are
/// the config version.
pub fn sha256_of(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_overrides_only_its_keys_and_the_version_follows_the_values() {
        let mut config = Config::default();
        config.models.entry("digits".into()).or_default().max_batch = Some(8);
        let stable = config.serving("digits");
        assert_eq!((stable.max_batch, stable.threshold, stable.cache_ttl_s), (8, 0.99, config.cache.ttl_s));
        assert_eq!(ServingConfig::from_text(&stable.text()).unwrap(), stable, "the text reads back");
        let change = parse_change("threshold = 0.5\ntop_k = 3\n").unwrap();
        let candidate = stable.with_change(&change);
        assert_eq!((candidate.threshold, candidate.top_k, candidate.max_batch), (0.5, Some(3), 8));
        assert_ne!(candidate.version(), stable.version());
        assert_eq!(stable.with_change(&parse_change("max_batch = 8").unwrap()).version(), stable.version());
        assert_eq!(stable.version().len(), 12);
    }

    #[test]
    fn a_bad_candidate_file_is_refused_naming_the_key_and_what_is_allowed() {
        let err = parse_change("treshold = 0.5").unwrap_err();
        assert!(err.contains("treshold") && err.contains("threshold, confidence"), "{err}");
        assert!(parse_change("").unwrap_err().contains("sets no key"));
        assert!(parse_change(&"#".repeat(MAX_CHANGE_BYTES + 1)).unwrap_err().contains("4096"));
        let wild = Config::default().serving("digits").with_change(&parse_change("threshold = 1.5").unwrap());
        let problems = wild.problems("config");
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].0 == "config.threshold" && problems[0].1.contains("0.0 and 1.0"), "{problems:?}");
    }
}
