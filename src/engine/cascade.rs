//! Stage 6, the cascade: the whole tier decision. Before the model runs it
//! settles what this request may do (`parameters.tier`, `enrich`, the
//! model's policy, whether the node has a cloud tier); after the edge model
//! answered it decides whether the cloud tier should (the model's
//! threshold), asks it within the request's deadline, and marks what the
//! device gets (`served_by`, `degraded`, `final`).

use super::envelope::Envelope;
use super::postprocess::{self, EdgeAnswer};
use crate::cloud::{Cloud, CloudError, Spool, SpoolEntry};
use crate::model::{LoadedModel, RawOutput};
use crate::protocol::{
    Confidence, Enrich, FollowUpTo, InferError, InferRequest, InferResponse, ServedBy, Tier,
};
use crate::telemetry;
use std::future::Future;
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
    pub fn new(m: &crate::config::ServingConfig) -> CascadePolicy {
        CascadePolicy {
            cloud_model: m.cloud_model.clone(),
            threshold: m.threshold as f32,
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
pub struct CloudTier {
    pub cloud: Arc<Cloud>,
    pub spool: Option<Spool>,
}

/// What one request may do with the cloud tier, settled before it runs.
pub struct Cascade<'a> {
    /// The tier and the model's policy, where the node has a cloud tier.
    escalation: Option<(&'a CloudTier, &'a CascadePolicy)>,
    /// `parameters.tier`.
    tier: Tier,
    /// `parameters.enrich` over the policy's; only a model that escalates has one.
    enrich: Option<Enrich>,
    /// Where a second reply can go (MQTT).
    follow_up: Option<&'a FollowUpTo>,
    /// The cloud gets what is left of the deadline minus a reserve, so a
    /// slow cloud still leaves time to send the edge answer.
    cloud_deadline: Option<Instant>,
    node: &'a str,
}

impl<'a> Cascade<'a> {
    /// `escalation`: the cloud tier and the model's policy, where the node
    /// has a cloud tier.
    pub fn plan(
        escalation: Option<(&'a CloudTier, &'a CascadePolicy)>,
        node: &'a str,
        req: &InferRequest,
        envelope: &Envelope<'a>,
        due: Option<Instant>,
    ) -> Cascade<'a> {
        let cloud_deadline = due.map(|at| {
            let reserve = escalation.map(|(t, _)| t.cloud.options.reserve).unwrap_or_default();
            at.checked_sub(reserve).unwrap_or_else(Instant::now)
        });
        Cascade {
            escalation,
            tier: req.parameters.tier.unwrap_or_default(),
            enrich: escalation.map(|(_, policy)| req.parameters.enrich.unwrap_or(policy.enrich)),
            follow_up: envelope.follow_up,
            cloud_deadline,
            node,
        }
    }

    /// How the edge answer's confidence is measured for the threshold.
    /// The tier the request asked for, as traces name it.
    pub fn tier_name(&self) -> &'static str {
        match self.tier {
            Tier::Fast => "fast",
            Tier::Standard => "standard",
            Tier::Quality => "quality",
        }
    }

    pub fn measure(&self) -> Confidence {
        self.escalation.map(|(_, policy)| policy.confidence).unwrap_or_default()
    }

    /// Where the node has a cloud tier, each tier caches its own answers.
    pub fn cache_tier(&self) -> Option<Tier> {
        self.escalation.map(|_| self.tier)
    }

    /// A cached answer as this request's reply: its id, and this node as
    /// the one answering (a Redis hit was computed by another).
    pub fn cached(&self, mut response: InferResponse, id: &str) -> InferResponse {
        id.clone_into(&mut response.id);
        self.node.clone_into(&mut response.parameters.node);
        response.parameters.is_final = self.final_if_async();
        response
    }

    /// The reply: the edge answer, the cloud's, or the edge's while the
    /// cloud's follows (async enrichment).
    pub async fn answer(
        &self,
        model: &LoadedModel,
        req: &InferRequest,
        edge: impl Future<Output = Result<EdgeAnswer, InferError>>,
    ) -> Result<InferResponse, InferError> {
        let node = self.node;
        match (self.tier, self.escalation) {
            (Tier::Quality, Some((cloud_tier, policy))) => {
                let _traced = cascade_span("quality");
                count_escalation(model.name(), "quality");
                let cloud_model = policy.cloud_model(model.name());
                let cloud = cloud_tier.cloud.infer(model.name(), cloud_model, req, self.cloud_deadline);
                let (edge, cloud) = tokio::join!(edge, cloud);
                quality(cloud_tier, model, req, edge?.response, cloud, node)
            }
            (Tier::Quality, None) => Ok(degrade(model.name(), edge.await?.response)),
            (Tier::Standard, Some((cloud_tier, policy))) => {
                let EdgeAnswer { response: mut edge, confidence } = edge.await?;
                if !confidence.is_some_and(|c| c < policy.threshold) {
                    edge.parameters.is_final = self.final_if_async();
                    return Ok(edge);
                }
                let async_asked = self.enrich == Some(Enrich::Async);
                let _traced = cascade_span(if async_asked { "async" } else { "sync" });
                if let (Some(Enrich::Async), Some(spool), Some(route)) =
                    (self.enrich, &cloud_tier.spool, self.follow_up)
                    && spool_escalation(spool, policy, model.name(), req, &edge, route).await
                {
                    edge.parameters.is_final = Some(false);
                    return Ok(edge);
                }
                // Asked async but answered here (HTTP, or the spool could
                // not take it): this reply is the final one.
                let mut answer =
                    escalate(cloud_tier, policy, model, req, edge, self.cloud_deadline, node).await;
                answer.parameters.is_final = self.final_if_async();
                Ok(answer)
            }
            _ => Ok(edge.await?.response),
        }
    }

    /// `final: true` where the request asked for async enrichment (its one
    /// reply ends it), nothing otherwise.
    fn final_if_async(&self) -> Option<bool> {
        (self.enrich == Some(Enrich::Async)).then_some(true)
    }
}

/// The cloud's answer in our reply format: its outputs, with label,
/// confidence and top-k worked out from them with the edge model's labels.
fn from_cloud(
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

/// The cascade's span in the request's trace: the cloud calls nest under
/// it; `escalation` is how the cloud tier was asked.
fn cascade_span(escalation: &'static str) -> Option<crate::trace::Open> {
    let mut span = crate::trace::open("cascade")?;
    span.set(opentelemetry::KeyValue::new("edgeinfer.escalation", escalation));
    Some(span)
}

fn count_escalation(model: &str, mode: &'static str) {
    metrics::counter!(telemetry::CLOUD_ESCALATIONS, "model" => model.to_string(), "mode" => mode)
        .increment(1);
}

fn degrade(model: &str, mut response: InferResponse) -> InferResponse {
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
async fn escalate(
    cloud_tier: &CloudTier,
    policy: &CascadePolicy,
    model: &LoadedModel,
    req: &InferRequest,
    edge: InferResponse,
    cloud_deadline: Option<Instant>,
    node: &str,
) -> InferResponse {
    count_escalation(model.name(), "sync");
    let answer = cloud_tier
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
fn quality(
    cloud_tier: &CloudTier,
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
        Err(e) if cloud_tier.cloud.options.fallback => {
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
async fn spool_escalation(
    spool: &Spool,
    policy: &CascadePolicy,
    model: &str,
    req: &InferRequest,
    edge: &InferResponse,
    follow_up: &FollowUpTo,
) -> bool {
    let entry = SpoolEntry {
        model: model.to_string(),
        cloud_model: policy.cloud_model(model).to_string(),
        request: serde_json::to_vec(req).expect("JSON encoding of protocol types cannot fail"),
        edge: serde_json::to_vec(edge).expect("JSON encoding of protocol types cannot fail"),
        route: follow_up.route.clone(),
    };
    // The follow-up continues the request's trace under its root span.
    let traceparent = crate::trace::current().map(|active| active.traceparent(active.root));
    let queued = spool.push(entry, follow_up.after.clone(), traceparent).await;
    if queued {
        count_escalation(model, "async");
    }
    queued
}

/// The reply that ends an async escalation: the cloud's answer, or the
/// edge's marked degraded when the cloud will not give one; with the
/// request it answers.
pub fn finish(
    model: Option<&LoadedModel>,
    entry: &SpoolEntry,
    cloud: Option<InferResponse>,
    node: &str,
) -> Option<(InferRequest, InferResponse)> {
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
    Some((req, reply))
}
