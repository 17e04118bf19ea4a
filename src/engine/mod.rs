//! The request pipeline every transport shares. `Engine::run` reads as its
//! stages, each in the file named after it:
//! decode -> resolve -> preprocess -> cache -> batch/run -> postprocess ->
//! trial -> cascade -> capture -> store -> encode.

mod batch;
pub mod cache;
mod capture;
mod cascade;
mod deadline;
mod decode;
mod envelope;
pub mod feedback;
mod generation;
mod options;
mod postprocess;
mod preprocess;
mod probe;
mod resolve;
mod run;
mod settings;
mod stats;
mod trial;

pub use batch::BatchPolicy;
pub use cache::{Cache, CacheOptions};
pub use capture::{Capture, CaptureError, CaptureOptions};
pub use cascade::{CascadePolicy, CloudTier};
pub use decode::{Decoded, Peek, peek};
pub use envelope::Envelope;
pub use options::EngineOptions;
pub use probe::{ProbeError, Role, Unanswered};
pub use run::{Runner, SpawnError};
pub use settings::Settings;
pub use stats::ModelStats;

use crate::cloud::Settled;
use crate::model::{LoadedModel, Registry, RuntimeOptions};
use crate::protocol::{Encoding, ErrorCode, FollowUp, InferError, InferRequest, InferResponse, codec};
use crate::rollout::{Deployments, Rollout, RolloutError};
use crate::telemetry::{self, Stage};
use crate::trace;
use cache::Lookup;
use cascade::Cascade;
use deadline::Deadline;
use futures_util::FutureExt;
use generation::Generation;
use stats::Stats;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;

/// One request in the in-flight gauge, for as long as it lives.
struct InFlight(metrics::Gauge);

impl InFlight {
    fn enter(model: &str) -> InFlight {
        let gauge = metrics::gauge!(telemetry::IN_FLIGHT, "model" => model.to_string());
        gauge.increment(1.0);
        InFlight(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// The one reply to a request, encoded, and what a transport logs about it.
#[derive(Debug)]
pub struct Reply {
    pub id: String,
    pub outcome: Result<(), ErrorCode>,
    pub payload: Vec<u8>,
    /// The request's trace (`[tracing]` on): its root span ends, and the
    /// trace is exported if kept, when the transport drops it.
    pub trace: Option<trace::Finish>,
}

pub struct Engine {
    /// The models and settings in service; a reload swaps in a new one while
    /// requests already running finish on the one they started with.
    current: RwLock<Arc<Generation>>,
    cache: Cache,
    /// The cloud tier, when `cloud.enabled`.
    cloud_tier: Option<CloudTier>,
    /// The capture of real inputs, when `capture.enabled`.
    capture: Option<Capture>,
    /// The answers kept for field feedback, when `feedback.enabled`.
    feedback: Option<feedback::FeedbackStore>,
    /// The deployment state (which version is stable); without it the
    /// newest version of each model serves.
    rollout: Option<Rollout>,
    stats: Stats,
    /// Why the last reload was refused, and the changed settings that wait
    /// for a restart, for the status.
    reload_outcome: Mutex<(Option<String>, Vec<&'static str>)>,
    /// The sha256 of the config in service, for the deployment record.
    config_sha256: Mutex<Option<String>>,
    /// How the config in service loads a model version (its batch sizes),
    /// for a version `models rollout` names before any reload found it.
    runtime_options: Mutex<RuntimeOptions>,
    /// The traces of requests, when `tracing.enabled`.
    tracer: Option<Arc<trace::Tracer>>,
}

impl Engine {
    /// Starts the inference threads of every loaded model version; panics
    /// when one cannot start (tests and tools; the node uses `try_new`).
    pub fn new(registry: Arc<Registry>, options: EngineOptions, cache: Cache) -> Engine {
        Engine::try_new(registry, options, cache).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts the inference threads of every loaded model version.
    pub fn try_new(
        registry: Arc<Registry>,
        options: EngineOptions,
        cache: Cache,
    ) -> Result<Engine, SpawnError> {
        Ok(Engine {
            current: RwLock::new(Arc::new(Generation::start(registry, options, None)?)),
            cache,
            cloud_tier: None,
            capture: None,
            feedback: None,
            rollout: None,
            stats: Stats::start(),
            reload_outcome: Default::default(),
            config_sha256: Default::default(),
            runtime_options: Default::default(),
            tracer: None,
        })
    }

    /// Escalates to the cloud tier from now on.
    pub fn with_cloud_tier(mut self, cloud_tier: CloudTier) -> Engine {
        self.cloud_tier = Some(cloud_tier);
        self
    }

    /// Traces requests from now on.
    pub fn with_tracer(mut self, tracer: Arc<trace::Tracer>) -> Engine {
        self.tracer = Some(tracer);
        self
    }

    /// Captures a sample of the answered requests from now on.
    pub fn with_capture(mut self, capture: Capture) -> Engine {
        self.capture = Some(capture);
        self
    }

    /// Keeps each answer for field feedback from now on.
    pub fn with_feedback(mut self, store: feedback::FeedbackStore) -> Engine {
        self.feedback = Some(store);
        self
    }

    /// Whether feedback is taken (`feedback.enabled`).
    pub fn takes_feedback(&self) -> bool {
        self.feedback.is_some()
    }

    /// One field feedback message from a transport: joined with the
    /// answer given, and on to the rollout's field gates.
    pub async fn take_feedback(
        &self,
        payload: &[u8],
        addressed: feedback::Addressed,
    ) -> Result<(String, feedback::Joined), (String, InferError)> {
        feedback::take(self.feedback.as_ref(), payload, addressed).await
    }

    /// Keeps `response` for the feedback about request `id`.
    fn keep_for_feedback(&self, id: &str, response: &InferResponse) {
        let Some(store) = &self.feedback else { return };
        let p = &response.parameters;
        let config = p.config_version.clone();
        let answer = feedback::Answer {
            model: response.model_name.clone(),
            version: response.model_version.clone(),
            label: p.label.clone(),
            confidence: p.confidence,
            served_by: match p.served_by {
                crate::protocol::ServedBy::Edge => "edge",
                crate::protocol::ServedBy::Cloud => "cloud",
            },
            config,
        };
        store.record(id, answer);
    }

    /// Records the config in service (at start and after each reload) as
    /// its hash: the effective values, secrets redacted.
    pub fn set_config(&self, config: &crate::config::Config) {
        use sha2::{Digest, Sha256};
        let hash = hex::encode(Sha256::digest(format!("{config:?}").as_bytes()));
        *self.config_sha256.lock().unwrap_or_else(|e| e.into_inner()) = Some(hash);
        let runtime =
            RuntimeOptions::for_node(&config.runtime.batch_sizes, true, &config.node.state_dir, true);
        *self.runtime_options.lock().unwrap_or_else(|e| e.into_inner()) = runtime;
    }

    /// Loads `model` v`version` when its directory is there, beside the
    /// model's loaded versions, but no reload has loaded it yet: `models
    /// rollout` of a version just dropped in needs no SIGHUP first. Its
    /// sha256 and golden checks run first; a version that fails them is
    /// refused with the reason. Nothing to load (already loaded, or no such
    /// directory) is `Ok`: starting the rollout then names what there is.
    pub async fn load_new_version(&self, model: &str, version: &str) -> Result<(), RolloutError> {
        let registry = self.registry();
        let Some(sibling) = registry.all().find(|m| m.name() == model) else { return Ok(()) };
        if registry.get(model, Some(version)).is_ok() || !crate::model::valid_model_name(version) {
            return Ok(());
        }
        let Some(dir) = sibling.dir.parent().map(|parent| parent.join(version)) else { return Ok(()) };
        if !dir.join("model.toml").is_file() {
            return Ok(());
        }
        let options = self.runtime_options.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let load = move || crate::model::LoadedModel::load(&dir, &options);
        let refused = |reason: String| RolloutError::VersionRefused {
            model: model.into(),
            version: version.into(),
            reason,
        };
        let loaded = match tokio::task::spawn_blocking(load).await {
            Ok(Ok(loaded)) => Arc::new(loaded),
            Ok(Err(e)) => return Err(refused(e.to_string())),
            Err(e) => return Err(refused(format!("its load stopped: {e}"))),
        };
        tracing::info!("loaded {model} v{version} for its rollout ({:?})", loaded.load_time);
        // Onto the registry in service now (a reload may have swapped one
        // in while this version loaded).
        let (before, options) = (self.registry(), self.current().options.clone());
        let next = Arc::new(before.with_version(loaded));
        next.plan_rest_in_background();
        self.reload(next.clone(), options).map_err(|e| refused(e.to_string()))?;
        crate::telemetry::describe_models(Some(&before), &next);
        Ok(())
    }

    /// Serves the versions the deployment state pins from now on.
    pub fn with_rollout(mut self, rollout: Rollout) -> Engine {
        self.rollout = Some(rollout);
        self
    }

    pub fn rollout(&self) -> Option<&Rollout> {
        self.rollout.as_ref()
    }

    /// `models status`: each model's deployment (or `model`'s), with the
    /// figures of a rollout's step as last judged.
    pub fn models_report(
        &self,
        model: Option<&str>,
    ) -> Result<Vec<crate::rollout::ModelReport>, crate::rollout::RolloutError> {
        let Some(rollout) = &self.rollout else { return Err(crate::rollout::RolloutError::Stopped) };
        let registry = self.registry();
        let node = |model: &str| self.node_serving(model);
        let mut report =
            rollout.current().report(&registry.available(), &registry.fingerprints(), model, &node)?;
        let trials = rollout.trials();
        let quality = self.feedback.as_ref().map(|f| f.quality()).unwrap_or_default();
        for m in &mut report {
            m.trial = trials.get(&m.model).cloned();
            m.field_quality = quality.iter().filter(|q| q.model == m.model).cloned().collect();
        }
        Ok(report)
    }

    /// `model`'s serving settings as the node config in service has them.
    pub fn node_serving(&self, model: &str) -> crate::config::ServingConfig {
        self.current().options.serving(model).clone()
    }

    /// A rollout of `model` v`version` as `models rollout` asks for it: the
    /// mode (default canary) and the model's policy in service with the
    /// command's overrides. With `config` (a config candidate file, from
    /// `by`), a config rollout on stable's version instead.
    fn rollout_plan(
        &self,
        (model, version, config): (&str, Option<&str>, Option<&str>),
        mode: Option<&str>,
        overrides: (Option<&str>, Option<&str>),
        by: &str,
    ) -> Result<crate::rollout::Plan, crate::rollout::RolloutError> {
        let (policy, node) = (self.current().options.rollout(model), self.node_serving(model));
        let deployments = self.deployments();
        let stable = (deployments.as_deref().and_then(|d| d.models.get(model)), &node);
        let asked = (version, config);
        crate::rollout::Plan::asked(asked, mode, &policy, overrides, stable, by, telemetry::unix_now())
    }

    /// `models rollout` as a transport asks it (`rollout_plan`'s request,
    /// from `by`): the version loaded first where it was dropped in since
    /// the last load, then the rollout started.
    pub async fn start_rollout(
        &self,
        asked: (&str, Option<&str>, Option<&str>),
        mode: Option<&str>,
        overrides: (Option<&str>, Option<&str>),
        by: crate::rollout::Asker,
    ) -> Result<crate::rollout::Decision, RolloutError> {
        let rollout = self.rollout.as_ref().ok_or(RolloutError::Stopped)?;
        let plan = self.rollout_plan(asked, mode, overrides, &by.by)?;
        if plan.config.is_none() {
            self.load_new_version(asked.0, &plan.version).await?;
        }
        rollout.start_rollout(asked.0, plan, self.registry().available(), by).await
    }

    /// The deployment state in service, if there is one.
    fn deployments(&self) -> Option<Arc<Deployments>> {
        self.rollout.as_ref().map(Rollout::current)
    }

    /// The version of each model that answers a request naming none.
    pub fn serving(&self) -> Vec<Arc<LoadedModel>> {
        let (generation, deployments) = (self.current(), self.deployments());
        let stable = |model: &str| deployments.as_deref().and_then(|d| d.stable(model));
        generation.registry.serving(stable).cloned().collect()
    }

    /// The version of `model` that answers a request naming none: the
    /// stable one the deployment state pins when it is loaded, else the
    /// newest. Metadata, readiness and the cloud's late answers use it.
    pub fn serving_model(&self, model: &str) -> Result<Arc<LoadedModel>, InferError> {
        let deployments = self.deployments();
        self.registry().serving_one(model, deployments.as_deref().and_then(|d| d.stable(model)))
    }

    /// Bytes in, bytes out: the whole pipeline, for transports.
    pub async fn handle(&self, envelope: Envelope<'_>, payload: &[u8], encoding: Encoding) -> Reply {
        self.answer(envelope, self.decode(payload, encoding), encoding).await
    }

    /// Stage 1 alone, for a transport that must read the request before it
    /// can answer it (an MQTT 3.1.1 request names its reply topic inside).
    pub fn decode(&self, payload: &[u8], encoding: Encoding) -> Decoded {
        let limits = &self.current().options.limits;
        std::panic::catch_unwind(|| decode::decode(payload, encoding, limits)).unwrap_or_else(|panic| {
            let now = Instant::now();
            let request = Err(request_panicked("", &*panic));
            Decoded { id: String::new(), reply_to: None, request, timed: (now, now) }
        })
    }

    /// A decoded request through the rest of the pipeline, encoded.
    pub async fn answer(&self, envelope: Envelope<'_>, decoded: Decoded, encoding: Encoding) -> Reply {
        let start = Instant::now();
        let generation = self.current();
        let label = generation.model_label(envelope.model);
        // Counted back down when dropped: also when a transport stops
        // waiting (an HTTP client that hung up cancels this future).
        let _in_flight = InFlight::enter(label);
        let active = self.tracer.as_ref().map(|tracer| tracer.begin(envelope.trace));
        let result = match decoded.request {
            // A panic anywhere in the pipeline is this request's `internal`
            // reply, not a request acknowledged with no reply at all.
            Ok(req) => {
                let run = async {
                    AssertUnwindSafe(self.run(&generation, envelope, req))
                        .catch_unwind()
                        .await
                        .unwrap_or_else(|panic| Err(request_panicked(label, &*panic)))
                };
                // Log lines about a sampled request carry its trace id (a
                // log span per request costs as much as the rest of its
                // recording; an unsampled request's panic names it itself).
                let logged = match &active {
                    Some(active) if active.sampled => {
                        tracing::info_span!("request", trace_id = %TraceId(active.trace_id))
                    }
                    _ => tracing::Span::none(),
                };
                trace::within(active.clone(), run).instrument(logged).await
            }
            Err(e) => Err(e),
        };
        let outcome = result.as_ref().map(|_| ()).map_err(|e| e.code);
        let version = result.as_ref().map(|r| r.model_version.clone()).unwrap_or_default();
        if let Ok(response) = &result {
            self.keep_for_feedback(&decoded.id, response);
        }
        let trace = self.tracer.as_ref().zip(active).map(|(tracer, active)| {
            active.add("decode", decoded.timed, Vec::new());
            let ended = Ended { id: &decoded.id, result: &result, transport: envelope.transport };
            let node = &generation.options.node_id;
            end_trace(tracer, active, (label, node), decoded.timed.0.min(start), ended)
        });
        let payload = codec::encode_reply(&decoded.id, result, encoding);
        self.record(&generation, label, &version, envelope.transport, outcome, start.elapsed());
        Reply { id: decoded.id, outcome, payload, trace }
    }

    /// An error reply to request `id` without running the pipeline (a
    /// transport refusing work), counted like any other answer.
    pub fn reject(&self, envelope: Envelope<'_>, id: String, encoding: Encoding, error: InferError) -> Reply {
        let start = Instant::now();
        let code = error.code;
        let generation = self.current();
        let label = generation.model_label(envelope.model);
        let result = Err(error);
        let trace = self.tracer.as_ref().map(|tracer| {
            let ended = Ended { id: &id, result: &result, transport: envelope.transport };
            let node = &generation.options.node_id;
            end_trace(tracer, tracer.begin(envelope.trace), (label, node), start, ended)
        });
        let payload = codec::encode_reply(&id, result, encoding);
        self.record(&generation, label, "", envelope.transport, Err(code), start.elapsed());
        Reply { id, outcome: Err(code), payload, trace }
    }

    /// One decoded request through the pipeline, unencoded.
    pub async fn infer(
        &self,
        envelope: Envelope<'_>,
        req: InferRequest,
    ) -> Result<InferResponse, InferError> {
        self.run(&self.current(), envelope, req).await
    }

    /// Stages 2 to 8, within the request's deadline.
    async fn run(
        &self,
        generation: &Generation,
        envelope: Envelope<'_>,
        req: InferRequest,
    ) -> Result<InferResponse, InferError> {
        panic_on_marked_request(&req.id);
        if let Some(delay) = injected_delay(&req.id) {
            tokio::time::sleep(delay).await;
        }
        let deadline = Deadline::new(req.parameters.deadline_ms, envelope.deadline);
        let deployments = self.deployments();
        let resolving = Instant::now();
        let route = resolve::resolve(generation, &envelope, &req, deployments.as_deref())?;
        trace::span("resolve", resolving, Vec::new);
        let (arm, settings) = (&route.arm, &route.arm.settings);
        let model = arm.runner.model();
        // The config's default `top_k`, before the cache key is taken.
        let mut req = req;
        req.parameters.top_k = req.parameters.top_k.or(settings.top_k);
        let limits = &generation.options.limits;
        let preparing = Instant::now();
        let prepared =
            preprocess::prepare(model, &req, limits, &settings.preprocess(model)).inspect_err(|_| {
                if let (Some(trial), Some(rollout)) = (&route.trial, &self.rollout) {
                    trial::refused(&rollout.observer(), trial, arm, &req, limits);
                }
            })?;
        trace::span("preprocess", preparing, Vec::new);
        let options = &generation.options;
        let escalation = self.cloud_tier.as_ref().map(|tier| (tier, &settings.cascade));
        let cascade = Cascade::plan(escalation, &options.node_id, &req, &envelope, deadline.at());
        trace::annotate(|| opentelemetry::KeyValue::new("edgeinfer.tier", cascade.tier_name()));
        let answered = deadline
            .bound(async {
                let lookup = (cascade.cache_tier(), settings.cache_ttl, settings.version.as_str());
                let ticket = match self.cache.check(model, &req, &prepared.input, lookup).await {
                    Lookup::Hit(response) => return Ok(cascade.cached(response, &req.id)),
                    Lookup::Miss(ticket) => Some(ticket),
                    Lookup::Bypass => None,
                };
                let edge = async {
                    let node = &generation.options.node_id;
                    // Only a request taking part in a rollout reports to it.
                    let trial = route.trial.as_ref().zip(self.rollout.as_ref());
                    let comparison =
                        trial.and_then(|(t, _)| trial::comparison(t, arm, &prepared, &req, limits));
                    let watch = trial.map(|(trial, rollout)| {
                        let observer = rollout.observer();
                        let escalates = escalation.is_some();
                        let reporter =
                            trial::Reporter { observer, node, measure: cascade.measure(), escalates };
                        trial::Watch::start(reporter, trial, arm, deadline.at())
                    });
                    let answer = match arm.runner.run(prepared, deadline.at()).await {
                        Ok(outputs) => {
                            let started = Instant::now();
                            let answer =
                                postprocess::edge_answer(model, &req, outputs, node, cascade.measure());
                            trace::span("postprocess", started, Vec::new);
                            answer
                        }
                        Err(e) => Err(e),
                    };
                    // Named on the edge answer too: an async escalation's
                    // follow-up carries it from the spool.
                    let answer = answer.map(|mut a| {
                        a.response.parameters.config_version = Some(settings.version.clone());
                        a
                    });
                    if let Some(watch) = watch {
                        watch.finish(&req, &answer, comparison);
                    }
                    answer
                };
                let response = cascade.answer(model, &req, edge).await?;
                // A provisional answer is not kept: the cloud's follows it.
                if let Some(capture) = &self.capture
                    && response.parameters.is_final != Some(false)
                {
                    capture.offer(model, &req, &response);
                }
                self.cache.store(ticket, &response);
                Ok(response)
            })
            .await;
        answered.map(|mut response| {
            response.parameters.config_version = Some(settings.version.clone());
            response
        })
    }

    fn record(
        &self,
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
        if let Some(answered) = generation.answered.get(model) {
            self.stats.record(answered, elapsed);
        }
    }

    fn current(&self) -> Arc<Generation> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Serves `registry` with `options` from now on. Requests already running
    /// finish on the models they started with; their threads stop after.
    /// Swaps in a new generation; if its threads cannot all start, the
    /// current one serves on.
    pub fn reload(&self, registry: Arc<Registry>, options: EngineOptions) -> Result<(), SpawnError> {
        let previous = self.current();
        let next = Arc::new(Generation::start(registry, options, Some(&previous))?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
        Ok(())
    }

    /// Sets each served model's saturation gauge: the share of the time
    /// since the previous call its inference threads were busy.
    pub fn publish_saturation(&self) {
        let generation = self.current();
        for model in self.serving() {
            if let Ok(runner) = generation.runners.get(model.name(), Some(model.version())) {
                metrics::gauge!(telemetry::INFERENCE_BUSY, "model" => model.name().to_string())
                    .set(runner.busy_share());
            }
        }
    }

    /// The models in service now.
    pub fn registry(&self) -> Arc<Registry> {
        self.current().registry.clone()
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The request limits in service now (a transport reading a body needs
    /// the payload bound before the pipeline runs).
    pub fn max_payload_bytes(&self) -> usize {
        self.current().options.limits.max_payload_bytes
    }

    pub fn cloud_state(&self) -> Option<crate::cloud::BreakerState> {
        self.cloud_tier.as_ref().map(|t| t.cloud.breaker_state())
    }

    /// Starts the engine's enrichment task: each escalation the cloud spool
    /// settled becomes the reply that ends its request, handed to the
    /// transport. It holds the engine weakly, so a dropped engine ends it.
    pub fn finish_escalations(
        self: &Arc<Self>,
        mut settled: mpsc::Receiver<Settled>,
        follow_ups: mpsc::Sender<FollowUp>,
    ) {
        let engine = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(Settled { entry, cloud, delivery, after, trace }) = settled.recv().await {
                let Some(engine) = engine.upgrade() else { return };
                // Its root span ends once the transport has the follow-up.
                let _traced =
                    trace.and_then(|active| engine.follow_up_trace(active, &entry.model, cloud.is_none()));
                let generation = engine.current();
                // The version that gave the provisional answer (a canary's
                // candidate, say), if it is still loaded; else the serving one.
                let edge = serde_json::from_slice::<serde_json::Value>(&entry.edge).ok();
                let field = |value: &serde_json::Value| value.as_str().map(str::to_string);
                let answered = edge.as_ref().and_then(|edge| field(&edge["model_version"]));
                // The config it was answered with ends the request too.
                let config_version =
                    edge.as_ref().and_then(|edge| field(&edge["parameters"]["config_version"]));
                let model = answered
                    .and_then(|v| generation.registry.get(&entry.model, Some(&v)).ok())
                    .or_else(|| engine.serving_model(&entry.model).ok());
                let node = &generation.options.node_id;
                match cascade::finish(model.as_deref(), &entry, cloud, node) {
                    Some((req, mut reply)) => {
                        reply.parameters.config_version = config_version;
                        if let (Some(capture), Some(model)) = (&engine.capture, &model) {
                            capture.offer(model, &req, &reply);
                        }
                        // The answer that ends the request is the one feedback is about.
                        engine.keep_for_feedback(&req.id, &reply);
                        let route = entry.route.clone();
                        let encoding = Encoding::from_content_type(route.content_type.as_deref());
                        let payload = codec::encode_reply(&req.id, Ok(reply), encoding);
                        if let Some(first) = after {
                            // The transport hands the provisional reply on
                            // right after the pipeline returns: moments.
                            first.sent().await;
                        }
                        // Waits while the transport is away (bounded channels
                        // all the way back to the spool).
                        let _ = follow_ups.send(FollowUp { route, payload, delivery }).await;
                    }
                    None => {
                        // Nothing can be sent for it, now or later.
                        tracing::warn!(
                            "cloud spool: an unreadable escalation of {} was dropped",
                            entry.model
                        );
                        delivery.confirm();
                    }
                }
            }
        });
    }

    /// A follow-up's trace, when tracing is on: kept where its request was
    /// head-sampled, or where the cloud never answered (`failed`).
    fn follow_up_trace(
        &self,
        active: Arc<trace::Active>,
        model: &str,
        failed: bool,
    ) -> Option<trace::Finish> {
        use opentelemetry::KeyValue;
        let tracer = self.tracer.as_ref()?;
        let keep = active.sampled || failed;
        let request = active.remote_parent().map(|span| (active.trace_id, span));
        let root = trace::Root {
            name: "follow_up",
            kind: trace::Kind::Internal,
            start: active.began(),
            attributes: vec![
                KeyValue::new("edgeinfer.model", model.to_string()),
                KeyValue::new("edgeinfer.served_by", if failed { "edge" } else { "cloud" }),
            ],
            links: request.into_iter().collect(),
            error: failed
                .then(|| "the cloud tier gave no answer; the edge answer ends the request".to_string()),
        };
        Some(tracer.finish(active, root, keep))
    }

    /// Requests answered since start, by model.
    pub fn request_counts(&self) -> std::collections::BTreeMap<String, u64> {
        self.current().answered.iter().map(|(m, a)| (m.clone(), a.count())).collect()
    }

    /// Per-model figures since the previous call, `interval` apart.
    pub async fn take_stats(&self, interval: Duration) -> std::collections::BTreeMap<String, ModelStats> {
        let generation = self.current();
        self.stats.take(generation.answered.values(), interval).await
    }

    /// Records what the last reload could not do: why it was refused (or
    /// none), and the changed settings that wait for a restart.
    pub fn set_reload_outcome(&self, error: Option<String>, restart_needed: Vec<&'static str>) {
        *self.reload_outcome.lock().unwrap_or_else(|e| e.into_inner()) = (error, restart_needed);
    }

    /// What a status message reports of the engine now.
    pub fn live(&self) -> telemetry::EngineSnapshot {
        let (reload_error, restart_needed) =
            self.reload_outcome.lock().unwrap_or_else(|e| e.into_inner()).clone();
        telemetry::EngineSnapshot {
            registry: self.registry(),
            serving: self.serving().iter().map(|m| (m.name().to_string(), m.version().to_string())).collect(),
            deployments: self.deployments(),
            trials: self.rollout.as_ref().map(Rollout::trials).unwrap_or_default(),
            config_sha256: self.config_sha256.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            field_quality: self.feedback.as_ref().map(|f| f.quality()).unwrap_or_default(),
            requests: self.request_counts(),
            cache: self.cache.health(),
            cloud: self.cloud_state().map(|s| s.as_str()),
            reload_error,
            restart_needed,
        }
    }

    /// One request through the whole pipeline (cache skipped, edge only)
    /// on every version in service, a rollout's candidate included: the
    /// watchdog's proof that requests still flow. Each version gets
    /// `within`, all at once, so a wedged one neither uses up the others'
    /// time nor hides which it was. A version too busy to take it
    /// (`overloaded`) is alive only if it finished a batch since the
    /// previous probe; a full queue that does not move is a wedged version.
    pub async fn probe(&self, within: Duration) -> Result<(), ProbeError> {
        let generation = self.current();
        let deployments = self.deployments();
        let versions = probe::in_service(&generation.runners, deployments.as_deref());
        if versions.is_empty() {
            return Err(ProbeError::NothingInService);
        }
        let probes = versions.iter().map(|version| self.probe_one(&generation, version, within));
        let unanswered: Vec<_> = futures_util::future::join_all(probes).await.into_iter().flatten().collect();
        if unanswered.is_empty() { Ok(()) } else { Err(ProbeError::Unanswered(unanswered)) }
    }

    /// The probe of one version: what went wrong, if anything.
    async fn probe_one(
        &self,
        generation: &Generation,
        version: &probe::InService<'_>,
        within: Duration,
    ) -> Option<probe::Unanswered> {
        let model = version.runner.model();
        let req = probe::request(model, within);
        let answer =
            tokio::time::timeout(within, self.run(generation, Envelope::model(model.name()), req)).await;
        let no_answer = || format!("no answer within {} ms", within.as_millis());
        let why = match answer {
            Ok(Ok(_)) => return None,
            Ok(Err(e)) if e.code == ErrorCode::Overloaded => {
                if version.runner.progressed() {
                    return None;
                }
                "its queue is full and no batch finished since the last probe".to_string()
            }
            Ok(Err(e)) if e.code == ErrorCode::DeadlineExceeded => no_answer(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => no_answer(),
        };
        Some(probe::Unanswered::new(version, why))
    }
}

/// A trace id as logs print it: 32 hex digits, as in `traceresponse`.
struct TraceId(u128);

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The keep rule and the root span of a request's trace on this node
/// (`model`, `node`).
fn end_trace(
    tracer: &Arc<trace::Tracer>,
    active: Arc<trace::Active>,
    (model, node): (&str, &str),
    start: Instant,
    ended: Ended<'_>,
) -> trace::Finish {
    let failed = ended.result.is_err();
    let keep = tracer.keeps(&active, failed, model, start.elapsed());
    let mut root = trace::Root {
        name: "infer",
        kind: trace::Kind::Server,
        start,
        attributes: Vec::new(),
        links: Vec::new(),
        error: None,
    };
    // Attributes are built only for a trace that is exported.
    if keep {
        root.attributes = ended.attributes(model, node);
        root.error = ended.result.as_ref().err().map(|e| format!("{}: {}", e.code, e.message));
    }
    tracer.finish(active, root, keep)
}

/// How a request ended, for its trace's root span.
struct Ended<'a> {
    id: &'a str,
    result: &'a Result<InferResponse, InferError>,
    transport: &'static str,
}

impl Ended<'_> {
    /// What an operator filters a trace by.
    fn attributes(&self, model: &str, node: &str) -> Vec<opentelemetry::KeyValue> {
        use crate::protocol::{CacheStatus, ServedBy};
        use opentelemetry::KeyValue;
        let mut attributes = vec![
            KeyValue::new("edgeinfer.model", model.to_string()),
            KeyValue::new("edgeinfer.node", node.to_string()),
            KeyValue::new("edgeinfer.transport", self.transport),
            KeyValue::new("edgeinfer.request_id", self.id.to_string()),
        ];
        match self.result {
            Ok(response) => {
                let p = &response.parameters;
                let served_by = if p.served_by == ServedBy::Cloud { "cloud" } else { "edge" };
                let cache = match p.cache {
                    CacheStatus::Miss => "miss",
                    CacheStatus::Memory => "memory",
                    CacheStatus::Disk => "disk",
                    CacheStatus::Redis => "redis",
                };
                attributes.extend([
                    KeyValue::new("edgeinfer.code", "ok"),
                    KeyValue::new("edgeinfer.version", response.model_version.clone()),
                    KeyValue::new("edgeinfer.served_by", served_by),
                    KeyValue::new("edgeinfer.cache", cache),
                ]);
                if let Some(config) = &p.config_version {
                    attributes.push(KeyValue::new("edgeinfer.config_version", config.clone()));
                }
            }
            Err(e) => attributes.push(KeyValue::new("edgeinfer.code", e.code.as_str())),
        }
        attributes
    }
}

/// The reply to a request whose handling panicked (a bug): logged, counted.
fn request_panicked(model: &str, panic: &(dyn std::any::Any + Send)) -> InferError {
    let why = run::panic_message(panic);
    metrics::counter!(telemetry::REQUEST_PANICS, "model" => model.to_string()).increment(1);
    // A sampled request's log span names its trace already.
    match trace::current().filter(|active| !active.sampled) {
        Some(active) => tracing::error!(
            trace_id = %TraceId(active.trace_id),
            "a request to {model:?} panicked ({why}); it is answered internal"
        ),
        None => tracing::error!("a request to {model:?} panicked ({why}); it is answered internal"),
    }
    InferError::internal(format!(
        "the node failed on this request ({why}); it was logged, other requests are served"
    ))
}

/// Fault injection for the end-to-end tests (`--features failpoints`):
/// `FAILPOINTS=request_panic=return(ID)` panics in the pipeline of request `ID`.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn panic_on_marked_request(id: &str) -> Option<()> {
    fail::fail_point!("request_panic", |marker: Option<String>| {
        if marker? == id {
            panic!("failpoint request_panic: request {id}");
        }
        None
    });
    None
}

/// Fault injection (`--features failpoints`): `FAILPOINTS=request_delay=return(MS)`
/// holds every request `MS` milliseconds, to have many in flight at once;
/// `return(ID:MS)` only request `ID`.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn injected_delay(id: &str) -> Option<Duration> {
    fail::fail_point!("request_delay", |arg: Option<String>| {
        let arg = arg?;
        let (only, ms) = run::failpoint_scope(&arg);
        if only.is_some_and(|only| only != id) {
            return None;
        }
        ms.parse().ok().map(Duration::from_millis)
    });
    None
}
