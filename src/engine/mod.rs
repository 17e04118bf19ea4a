//! The request pipeline every transport shares:
//! decode -> route -> preprocess -> cache -> batch/run -> postprocess -> reply.
//! Each stage lives in the file named after it.

mod batch;
pub mod cache;
mod cascade;
mod decode;
mod postprocess;
mod preprocess;
mod reply;
mod route;
mod run;

pub use batch::BatchPolicy;
pub use cache::{Cache, CacheOptions};
pub use cascade::{CascadePolicy, Tiers};
pub use decode::{Peek, decode, peek};
pub use reply::encode;
pub use run::Runner;

use crate::cloud::{FollowUp, ReplyRoute, SpoolEntry};
use crate::config::LimitsConfig;
use crate::model::Registry;
use crate::protocol::{Encoding, Enrich, ErrorCode, InferError, InferRequest, InferResponse, Tier};
use crate::telemetry::{self, Stage};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Reported as `parameters.node` in every reply.
    pub node_id: String,
    pub limits: LimitsConfig,
    pub threads_per_model: usize,
    /// Requests waiting in a model's queue before `overloaded`.
    pub queue_capacity: usize,
    /// Batching for models without their own policy.
    pub batching: BatchPolicy,
    /// Per-model batching, by model name.
    pub model_batching: HashMap<String, BatchPolicy>,
    /// How models escalate to the cloud tier (used only with one), by name;
    /// models not listed take `default_cascade`.
    pub cascade: HashMap<String, CascadePolicy>,
    pub default_cascade: CascadePolicy,
}

impl EngineOptions {
    fn cascade(&self, model: &str) -> &CascadePolicy {
        self.cascade.get(model).unwrap_or(&self.default_cascade)
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            node_id: "edgeinfer".into(),
            limits: LimitsConfig::default(),
            threads_per_model: 1,
            queue_capacity: 1024,
            batching: BatchPolicy::default(),
            model_batching: HashMap::new(),
            cascade: HashMap::new(),
            default_cascade: CascadePolicy::new(&Default::default()),
        }
    }
}

impl EngineOptions {
    /// The options the config file asks for.
    pub fn from_config(config: &crate::config::Config) -> EngineOptions {
        EngineOptions {
            node_id: config.node.id.clone(),
            limits: config.limits.clone(),
            threads_per_model: config.runtime.threads_per_model,
            queue_capacity: config.runtime.queue_capacity,
            batching: config.batch_policy(""),
            model_batching: config.models.keys().map(|m| (m.clone(), config.batch_policy(m))).collect(),
            cascade: config.models.iter().map(|(m, c)| (m.clone(), CascadePolicy::new(c))).collect(),
            default_cascade: CascadePolicy::new(&Default::default()),
        }
    }
}

/// Which model a transport addressed (topic or URL), before the request is read.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub model: &'a str,
    /// A version named by the transport (`/v2/models/M/versions/V/infer`);
    /// otherwise `parameters.model_version`, otherwise the active version.
    pub version: Option<&'a str>,
    /// A deadline the transport imposes (MQTT 5 Message Expiry), on top of
    /// `parameters.deadline_ms`; the earlier one wins.
    pub deadline: Option<Duration>,
    /// `mqtt`, `http` or `cli`: the `transport` label of the request metrics.
    pub transport: &'static str,
    /// Where a second reply can go (MQTT); without one, async enrichment
    /// is answered synchronously.
    pub follow_up: Option<&'a ReplyRoute>,
}

impl<'a> Target<'a> {
    pub fn model(model: &'a str) -> Self {
        Target { model, version: None, deadline: None, transport: "cli", follow_up: None }
    }
}

/// The reply to one request and what a transport logs or counts about it.
#[derive(Debug)]
pub struct Handled {
    pub id: String,
    /// The payload's `reply_to` (MQTT 3.1.1 replies go there).
    pub reply_to: Option<String>,
    pub outcome: Result<(), ErrorCode>,
    pub reply: Vec<u8>,
}

pub struct Engine {
    /// The models and settings in service; a reload swaps in a new one while
    /// requests already running finish on the one they started with.
    current: std::sync::RwLock<Arc<Generation>>,
    cache: Cache,
    /// Why the last reload was refused, for the status.
    reload_error: std::sync::Mutex<Option<String>>,
    /// The cloud tier, when `cloud.enabled`.
    tiers: Option<Tiers>,
}

/// One set of loaded models with their inference threads and settings.
struct Generation {
    registry: Arc<Registry>,
    runners: HashMap<(String, String), Runner>,
    options: EngineOptions,
    /// Per model name, for the status and stats messages; carried across reloads.
    served: HashMap<String, Arc<Served>>,
}

/// What a model has served: a running count, and round trips since the last
/// stats snapshot.
struct Served {
    requests: std::sync::atomic::AtomicU64,
    latency_us: std::sync::Mutex<hdrhistogram::Histogram<u64>>,
}

impl Served {
    fn new() -> Served {
        let histogram = hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds");
        Served { requests: Default::default(), latency_us: histogram.into() }
    }
}

/// One model's figures since the previous snapshot.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelStats {
    pub requests_total: u64,
    pub requests: u64,
    pub rate_rps: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
}

impl Generation {
    /// Starts the inference threads of every loaded model version; counts of
    /// models `previous` served carry over.
    fn start(registry: Arc<Registry>, options: EngineOptions, previous: Option<&Generation>) -> Generation {
        let runners = registry
            .all()
            .map(|m| {
                let key = (m.name().to_string(), m.version().to_string());
                let policy = options.model_batching.get(m.name()).unwrap_or(&options.batching).clone();
                (key, Runner::start(m.clone(), policy, options.threads_per_model, options.queue_capacity))
            })
            .collect();
        let served = registry
            .active()
            .map(|m| {
                let kept = previous.and_then(|p| p.served.get(m.name()).cloned());
                (m.name().to_string(), kept.unwrap_or_else(|| Arc::new(Served::new())))
            })
            .collect();
        Generation { registry, runners, options, served }
    }

    /// The `model` label: the name for models this node serves, `unknown`
    /// otherwise, so a device sending junk topics cannot grow the metric set.
    fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.served.contains_key(model) { model } else { "unknown" }
    }
}

impl Engine {
    /// Starts the inference threads of every loaded model version.
    pub fn new(registry: Arc<Registry>, options: EngineOptions, cache: Cache) -> Engine {
        let generation = Generation::start(registry, options, None);
        Engine {
            current: std::sync::RwLock::new(Arc::new(generation)),
            cache,
            reload_error: Default::default(),
            tiers: None,
        }
    }

    /// Escalates to the cloud tier from now on.
    pub fn with_tiers(mut self, tiers: Tiers) -> Engine {
        self.tiers = Some(tiers);
        self
    }

    pub fn cloud_state(&self) -> Option<crate::cloud::BreakerState> {
        self.tiers.as_ref().map(|t| t.cloud.breaker_state())
    }

    /// The reply that ends a spooled escalation (the spool task calls it).
    pub fn finish_escalation(&self, entry: &SpoolEntry, cloud: Option<InferResponse>) -> Option<FollowUp> {
        let generation = self.current();
        let model = generation.registry.get(&entry.model, None).ok();
        cascade::finish(model.as_deref(), entry, cloud, &generation.options.node_id)
    }

    fn current(&self) -> Arc<Generation> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Serves `registry` with `options` from now on. Requests already running
    /// finish on the models they started with; their threads stop after.
    pub fn reload(&self, registry: Arc<Registry>, options: EngineOptions) {
        let previous = self.current();
        let next = Arc::new(Generation::start(registry, options, Some(&previous)));
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
    }

    /// Requests answered since start, by model.
    pub fn request_counts(&self) -> std::collections::BTreeMap<String, u64> {
        self.current()
            .served
            .iter()
            .map(|(m, s)| (m.clone(), s.requests.load(std::sync::atomic::Ordering::Relaxed)))
            .collect()
    }

    /// Per-model figures since the previous call, `interval` apart.
    pub fn take_stats(&self, interval: Duration) -> std::collections::BTreeMap<String, ModelStats> {
        let mut out = std::collections::BTreeMap::new();
        for (name, served) in &self.current().served {
            let Ok(mut h) = served.latency_us.lock() else { continue };
            let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
            out.insert(
                name.clone(),
                ModelStats {
                    requests_total: served.requests.load(std::sync::atomic::Ordering::Relaxed),
                    requests: h.len(),
                    rate_rps: h.len() as f64 / interval.as_secs_f64().max(1e-9),
                    p50_ms: ms(0.5),
                    p95_ms: ms(0.95),
                    p99_ms: ms(0.99),
                },
            );
            h.reset();
        }
        out
    }

    /// The models in service now.
    pub fn registry(&self) -> Arc<Registry> {
        self.current().registry.clone()
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// Records (or clears) why the last reload was refused.
    pub fn set_reload_error(&self, error: Option<String>) {
        *self.reload_error.lock().unwrap_or_else(|e| e.into_inner()) = error;
    }

    /// What a status message reports of the engine now.
    pub fn live(&self) -> telemetry::Live {
        telemetry::Live {
            registry: self.registry(),
            requests: self.request_counts(),
            cache: self.cache.health(),
            cloud: self.cloud_state().map(|s| s.as_str()),
            reload_error: self.reload_error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }

    /// One request through the whole pipeline (cache skipped) on the first
    /// model in service: the watchdog's proof that requests still flow. A
    /// node too busy to take it (`overloaded`) is alive.
    pub async fn probe(&self) -> Result<(), String> {
        let registry = self.registry();
        let Some(model) = registry.active().next() else { return Err("no model is in service".into()) };
        let spec = &model.manifest.input;
        let shape: Vec<i64> = spec.shape.iter().map(|&d| if d < 0 { 1 } else { d }).collect();
        let elements = shape.iter().product::<i64>() as usize;
        let mut req = InferRequest::single(
            "watchdog",
            &spec.name,
            shape,
            spec.datatype,
            crate::protocol::TensorData::Number(vec![0.0; elements]),
        );
        req.parameters.cache = Some(false);
        req.parameters.deadline_ms = Some(5000);
        match self.infer(Target::model(model.name()), req).await {
            Ok(_) => Ok(()),
            Err(e) if e.code == ErrorCode::Overloaded => Ok(()),
            Err(e) => Err(format!("{} v{}: {e}", model.name(), model.version())),
        }
    }

    /// The request limits in service now (a transport reading a body needs
    /// the payload bound before the pipeline runs).
    pub fn max_payload_bytes(&self) -> usize {
        self.current().options.limits.max_payload_bytes
    }

    /// Bytes in, bytes out: the whole pipeline, for transports.
    pub async fn handle(&self, target: Target<'_>, payload: &[u8], encoding: Encoding) -> Handled {
        let start = Instant::now();
        let generation = self.current();
        let label = generation.model_label(target.model);
        let in_flight = metrics::gauge!(telemetry::IN_FLIGHT, "model" => label.to_string());
        in_flight.increment(1.0);
        let request = decode(payload, encoding, &generation.options.limits);
        let (id, reply_to, result) = match request {
            Ok(req) => (req.id.clone(), req.reply_to.clone(), self.run(&generation, target, req).await),
            Err(e) => {
                let peek = decode::peek(payload, encoding);
                (peek.id, peek.reply_to, Err(e))
            }
        };
        let outcome = result.as_ref().map(|_| ()).map_err(|e| e.code);
        let version = result.as_ref().map(|r| r.model_version.clone()).unwrap_or_default();
        let reply = encode(&id, result, encoding);
        record(&generation, label, &version, target.transport, outcome, start.elapsed());
        in_flight.decrement(1.0);
        Handled { reply, id, reply_to, outcome }
    }

    /// An error reply without running the pipeline (a transport refusing
    /// work), counted like any other answer.
    pub fn reject(
        &self,
        target: Target<'_>,
        payload: &[u8],
        encoding: Encoding,
        error: InferError,
    ) -> Handled {
        let start = Instant::now();
        let peek = decode::peek(payload, encoding);
        let code = error.code;
        let reply = encode(&peek.id, Err(error), encoding);
        let generation = self.current();
        let label = generation.model_label(target.model);
        record(&generation, label, "", target.transport, Err(code), start.elapsed());
        Handled { outcome: Err(code), reply, id: peek.id, reply_to: peek.reply_to }
    }

    /// One decoded request through route, preprocess, cache, run and
    /// postprocess, within its deadline.
    pub async fn infer(&self, target: Target<'_>, req: InferRequest) -> Result<InferResponse, InferError> {
        self.run(&self.current(), target, req).await
    }

    async fn run(
        &self,
        generation: &Generation,
        target: Target<'_>,
        req: InferRequest,
    ) -> Result<InferResponse, InferError> {
        let start = Instant::now();
        let model = route::route(&generation.registry, target, &req)?;
        let prepared = preprocess::prepare(&model, &req, &generation.options.limits)?;
        telemetry::observe_stage(model.name(), Stage::Preprocess, start.elapsed().as_secs_f64());
        let runner =
            generation.runners.get(&(model.name().to_string(), model.version().to_string())).ok_or_else(
                || InferError::internal(format!("model {} has no inference threads", model.name())),
            )?;
        let deadline = match (req.parameters.deadline_ms.map(Duration::from_millis), target.deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let what = || match req.parameters.deadline_ms {
            Some(ms) => format!("parameters.deadline_ms = {ms}"),
            None => "the message expiry interval".to_string(),
        };
        let tier = req.parameters.tier.unwrap_or_default();
        let tiers = self.tiers.as_ref();
        let policy = tiers.map(|_| generation.options.cascade(model.name()));
        let cached = match req.parameters.cache {
            Some(false) => None,
            _ => self.cache.ttl(model.name()).map(|ttl| {
                let key = cache::Key::new(&model, &req, &prepared.input);
                (if tiers.is_some() { key.for_tier(tier) } else { key }, ttl)
            }),
        };
        let deadline_at = deadline.map(|d| start + d);
        // The cloud gets what is left minus a reserve, so a slow cloud still
        // leaves time to send the edge answer.
        let cloud_deadline = deadline_at.map(|at| {
            let reserve = tiers.map(|t| t.cloud.options.reserve).unwrap_or_default();
            at.checked_sub(reserve).unwrap_or(start)
        });
        let node = generation.options.node_id.as_str();
        // Only a model that escalates has an enrichment mode.
        let enrich = policy.map(|p| req.parameters.enrich.unwrap_or(p.enrich));
        let answer = async {
            let ticket = match cached {
                Some((key, ttl)) => match self.cache.lookup(model.name(), key, ttl).await {
                    cache::Lookup::Hit(mut response) => {
                        response.id.clone_from(&req.id);
                        response.parameters.is_final = (enrich == Some(Enrich::Async)).then_some(true);
                        return Ok(response);
                    }
                    cache::Lookup::Miss(ticket) => Some(ticket),
                },
                None => None,
            };
            let edge_answer = async {
                let outputs = runner.run(prepared, deadline_at).await?;
                let post = Instant::now();
                let measure = policy.map(|p| p.confidence).unwrap_or_default();
                let confidence = cascade::confidence(&model, &outputs, measure);
                let response = postprocess::respond(&model, &req, outputs, node)?;
                telemetry::observe_stage(model.name(), Stage::Postprocess, post.elapsed().as_secs_f64());
                Ok::<_, InferError>((response, confidence))
            };
            let response = match (tier, tiers, policy) {
                (Tier::Quality, Some(tiers), Some(policy)) => {
                    cascade::count_escalation(model.name(), "quality");
                    let cloud_model = policy.cloud_model(model.name());
                    let cloud = tiers.cloud.infer(model.name(), cloud_model, &req, cloud_deadline);
                    let (edge, cloud) = tokio::join!(edge_answer, cloud);
                    cascade::quality(tiers, &model, &req, edge?.0, cloud, node)?
                }
                (Tier::Quality, None, _) => cascade::degrade(model.name(), edge_answer.await?.0),
                (Tier::Standard, Some(tiers), Some(policy)) => {
                    let (mut edge, confidence) = edge_answer.await?;
                    let enrich = enrich.unwrap_or(policy.enrich);
                    if !confidence.is_some_and(|c| c < policy.threshold) {
                        edge.parameters.is_final = (enrich == Enrich::Async).then_some(true);
                        edge
                    } else if let (Enrich::Async, Some(spool), Some(route)) =
                        (enrich, &tiers.spool, target.follow_up)
                        && cascade::spool(spool, policy, model.name(), &req, &edge, route).await
                    {
                        edge.parameters.is_final = Some(false);
                        edge
                    } else {
                        // Asked async but answered here (HTTP, or the spool
                        // could not take it): this reply is the final one.
                        let mut answer =
                            cascade::escalate(tiers, policy, &model, &req, edge, cloud_deadline, node).await;
                        answer.parameters.is_final = (enrich == Enrich::Async).then_some(true);
                        answer
                    }
                }
                _ => edge_answer.await?.0,
            };
            // Only answers that end the request are kept: not a degraded one
            // (the cloud may be back next time), not a provisional one.
            if let Some(ticket) = ticket
                && !response.parameters.degraded
                && response.parameters.is_final != Some(false)
            {
                self.cache.store(ticket, &response);
            }
            Ok(response)
        };
        match deadline {
            Some(d) if start.elapsed() >= d => Err(InferError::deadline_exceeded(format!(
                "{} passed before the model could run; allow more time",
                what()
            ))),
            Some(d) => tokio::time::timeout(d - start.elapsed(), answer).await.map_err(|_| {
                InferError::deadline_exceeded(format!(
                    "{}: no answer in time; allow more time or send fewer rows",
                    what()
                ))
            })?,
            None => answer.await,
        }
    }
}

fn record(
    generation: &Generation,
    model: &str,
    version: &str,
    transport: &'static str,
    outcome: Result<(), ErrorCode>,
    elapsed: Duration,
) {
    metrics::counter!(
        telemetry::REQUESTS,
        "model" => model.to_string(),
        "version" => version.to_string(),
        "transport" => transport,
        "outcome" => outcome.map(|_| "ok").unwrap_or_else(|c| c.as_str())
    )
    .increment(1);
    telemetry::observe_stage(model, Stage::EndToEnd, elapsed.as_secs_f64());
    if let Some(served) = generation.served.get(model) {
        served.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut h) = served.latency_us.lock() {
            let _ = h.record((elapsed.as_micros() as u64).max(1));
        }
    }
}
