//! Stage 6, the cascade: after the edge model answered, decide whether the
//! cloud tier should (`parameters.tier`, the model's threshold), ask it
//! within the request's deadline, and mark what the device gets
//! (`served_by`, `degraded`, `final`).

use super::postprocess;
use crate::cloud::{Cloud, CloudError, FollowUp, ReplyRoute, Spool, SpoolEntry};
use crate::model::{LoadedModel, RawOutput, Task};
use crate::protocol::{Confidence, Encoding, Enrich, InferError, InferRequest, InferResponse, ServedBy};
use crate::telemetry;
use std::sync::Arc;
use std::time::Instant;

/// How one model escalates (its `[models.NAME]` keys).
#[derive(Debug, Clone, PartialEq)]
pub struct CascadePolicy {
    /// `None`: the cloud serves it under the edge model's own name.
    cloud_model: Option<String>,
    pub threshold: f32,
    pub confidence: Confidence,
    pub enrich: Enrich,
}

impl CascadePolicy {
    pub fn new(m: &crate::config::ModelConfig) -> CascadePolicy {
        CascadePolicy {
            cloud_model: m.cloud_model.clone(),
            threshold: m.threshold,
            confidence: m.confidence,
            enrich: m.enrich,
        }
    }

    /// The cloud tier's name for edge model `model`.
    pub fn cloud_model<'a>(&'a self, model: &'a str) -> &'a str {
        self.cloud_model.as_deref().unwrap_or(model)
    }
}

/// The cloud tier as the engine sees it: the client and, where the node
/// has a transport for later replies, the spool for async escalations.
pub struct Tiers {
    pub cloud: Arc<Cloud>,
    pub spool: Option<Spool>,
}

/// The confidence of a classifier's answer for the threshold: the worst
/// row's, so a batch escalates when any of its rows is unsure. `None` for a
/// model that is not a classifier (it never escalates).
pub fn confidence(model: &LoadedModel, outputs: &[RawOutput], measure: Confidence) -> Option<f32> {
    if model.manifest.task != Task::Classification {
        return None;
    }
    let probs = outputs.first()?;
    let rows = probs.shape.first().copied().unwrap_or(1).max(1);
    let values = probs.data.to_f64();
    let width = values.len() / rows;
    if width == 0 {
        return None;
    }
    values
        .chunks(width)
        .map(|row| {
            let (mut best, mut second) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
            for &p in row {
                if p > best {
                    second = best;
                    best = p;
                } else if p > second {
                    second = p;
                }
            }
            match measure {
                Confidence::Max => best,
                Confidence::Margin if row.len() < 2 => best,
                Confidence::Margin => best - second,
            }
        })
        .fold(None, |worst: Option<f64>, c| Some(worst.map_or(c, |w| w.min(c))))
        .map(|c| c as f32)
}

/// The cloud's answer in our reply format: its outputs, with label,
/// confidence and top-k worked out from them with the edge model's labels.
pub fn from_cloud(
    model: &LoadedModel,
    req: &InferRequest,
    cloud: InferResponse,
    node: &str,
) -> Result<InferResponse, CloudError> {
    if cloud.outputs.is_empty() {
        return Err(CloudError::Invalid("it has no outputs".into()));
    }
    let mut raw = Vec::with_capacity(cloud.outputs.len());
    for o in cloud.outputs {
        // JSON numbers, typed as the cloud declared them.
        let data = o
            .data
            .into_typed(o.datatype)
            .map_err(|e| CloudError::Invalid(format!("output {:?}: {e}", o.name)))?;
        raw.push(RawOutput { name: o.name, shape: o.shape.iter().map(|&d| d as usize).collect(), data });
    }
    let mut response =
        postprocess::respond(model, req, raw, node).map_err(|e| CloudError::Invalid(e.message))?;
    response.model_name = cloud.model_name;
    response.model_version = cloud.model_version;
    response.parameters.served_by = ServedBy::Cloud;
    Ok(response)
}

pub fn count_escalation(model: &str, mode: &'static str) {
    metrics::counter!(telemetry::CLOUD_ESCALATIONS, "model" => model.to_string(), "mode" => mode)
        .increment(1);
}

pub fn degrade(model: &str, mut response: InferResponse) -> InferResponse {
    metrics::counter!(telemetry::CLOUD_DEGRADED, "model" => model.to_string()).increment(1);
    response.parameters.degraded = true;
    response
}

fn count_agreement(model: &str, edge: &InferResponse, cloud: &InferResponse) {
    if let (Some(a), Some(b)) = (&edge.parameters.label, &cloud.parameters.label) {
        let agree = if a == b { "true" } else { "false" };
        metrics::counter!(telemetry::CLOUD_AGREEMENT, "model" => model.to_string(), "agree" => agree)
            .increment(1);
    }
}

/// Where a synchronous escalation's answer comes from.
pub async fn escalate(
    tiers: &Tiers,
    policy: &CascadePolicy,
    model: &LoadedModel,
    req: &InferRequest,
    edge: InferResponse,
    cloud_deadline: Option<Instant>,
    node: &str,
) -> InferResponse {
    count_escalation(model.name(), "sync");
    let answer = tiers
        .cloud
        .infer(model.name(), policy.cloud_model(model.name()), req, cloud_deadline)
        .await
        .and_then(|c| from_cloud(model, req, c, node));
    match answer {
        Ok(cloud) => {
            count_agreement(model.name(), &edge, &cloud);
            cloud
        }
        Err(e) => {
            tracing::debug!(id = %req.id, "escalation of {} answered from the edge: {e}", model.name());
            degrade(model.name(), edge)
        }
    }
}

/// `quality`: the cloud first; the edge answer (already computed) when the
/// cloud fails, or `cloud_unavailable` where fallback is off.
pub fn quality(
    tiers: &Tiers,
    model: &LoadedModel,
    req: &InferRequest,
    edge: InferResponse,
    cloud: Result<InferResponse, CloudError>,
    node: &str,
) -> Result<InferResponse, InferError> {
    match cloud.and_then(|c| from_cloud(model, req, c, node)) {
        Ok(cloud) => {
            count_agreement(model.name(), &edge, &cloud);
            Ok(cloud)
        }
        Err(e) if tiers.cloud.options.fallback => {
            tracing::debug!(id = %req.id, "quality request for {} answered from the edge: {e}", model.name());
            Ok(degrade(model.name(), edge))
        }
        Err(e) => Err(InferError::cloud_unavailable(format!(
            "parameters.tier = \"quality\": {e}; retry later, or use tier \"standard\" to accept the edge answer"
        ))),
    }
}

/// Hands an async escalation to the spool. On success the device gets
/// `edge` now with `final: false`; otherwise it is answered synchronously.
pub async fn spool(
    spool: &Spool,
    policy: &CascadePolicy,
    model: &str,
    req: &InferRequest,
    edge: &InferResponse,
    route: &ReplyRoute,
) -> bool {
    let entry = SpoolEntry {
        model: model.to_string(),
        cloud_model: policy.cloud_model(model).to_string(),
        request: serde_json::to_vec(req).expect("JSON encoding of protocol types cannot fail"),
        edge: serde_json::to_vec(edge).expect("JSON encoding of protocol types cannot fail"),
        route: route.clone(),
    };
    let queued = spool.push(entry).await;
    if queued {
        count_escalation(model, "async");
    }
    queued
}

/// The reply that ends an async escalation: the cloud's answer, or the
/// edge's marked degraded when the cloud will not give one.
pub fn finish(
    model: Option<&LoadedModel>,
    entry: &SpoolEntry,
    cloud: Option<InferResponse>,
    node: &str,
) -> Option<FollowUp> {
    let req: InferRequest = serde_json::from_slice(&entry.request).ok()?;
    let edge: InferResponse = serde_json::from_slice(&entry.edge).ok()?;
    let cloud = match (model, cloud) {
        (Some(model), Some(c)) => from_cloud(model, &req, c, node).ok(),
        _ => None,
    };
    let mut reply = match cloud {
        Some(cloud) => {
            count_agreement(&entry.model, &edge, &cloud);
            cloud
        }
        None => degrade(&entry.model, edge),
    };
    reply.id = req.id.clone();
    reply.parameters.is_final = Some(true);
    let encoding = Encoding::from_content_type(entry.route.content_type.as_deref());
    Some(FollowUp { route: entry.route.clone(), payload: super::encode(&req.id, Ok(reply), encoding) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::TensorData;

    fn probs(rows: &[&[f32]]) -> Vec<RawOutput> {
        vec![RawOutput {
            name: "probabilities".into(),
            shape: vec![rows.len(), rows[0].len()],
            data: TensorData::F32(rows.iter().flat_map(|r| r.iter().copied()).collect()),
        }]
    }

    #[test]
    fn confidence_is_the_worst_rows_max_or_margin() {
        let registry = crate::model::Registry::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models"),
            &crate::model::RuntimeOptions { batch_sizes: vec![1], ..Default::default() },
        )
        .unwrap();
        let model = registry.get("digits", None).unwrap();
        let out = probs(&[&[0.9, 0.05, 0.05], &[0.5, 0.4, 0.1]]);
        assert_eq!(confidence(&model, &out, Confidence::Max), Some(0.5));
        let margin = confidence(&model, &out, Confidence::Margin).unwrap();
        assert!((margin - 0.1).abs() < 1e-6, "{margin}");
        let sure = probs(&[&[0.1, 0.85, 0.05]]);
        let margin = confidence(&model, &sure, Confidence::Margin).unwrap();
        assert!((margin - 0.75).abs() < 1e-6, "{margin}");
    }
}
