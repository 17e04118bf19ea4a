//! Stage 5b: a request that takes part in a rollout. Its answer is reported
//! to the rollout (the figures its gates judge), and a sample is also run
//! on the other version beside it, without delaying its reply, to compare
//! labels: the candidate's in shadow mode (then dropped: no device sees
//! it), and stable's for a canary's answers. A comparison run waits in the
//! other version's bounded queue like any request; a full one skips it.

use super::postprocess::{self, EdgeAnswer};
use super::preprocess::{self, Prepared};
use super::resolve::Trial;
use super::settings::Arm;
use crate::config::LimitsConfig;
use crate::protocol::{Confidence, ErrorCode, InferError, InferRequest};
use crate::rollout::{Compared, Observer, Seen};
use std::time::{Duration, Instant};

/// Where answers are reported, and what the trial needs of the request's
/// settings.
pub struct Reporter<'a> {
    pub observer: Observer,
    pub node: &'a str,
    pub measure: Confidence,
    /// Whether the node has a cloud tier (then escalations are counted,
    /// against each config's own threshold).
    pub escalates: bool,
}

/// One request's part in a rollout, from just before its run. Dropped
/// unfinished after its deadline passed (it ran out of time while it
/// waited or ran), it reports a failure, so a version slow on part of its
/// traffic cannot hide it; dropped for another reason (a client that hung
/// up, a shutdown) it reports nothing.
pub struct Watch<'a> {
    settings: Reporter<'a>,
    trial: &'a Trial,
    arm: &'a Arm,
    due: Option<Instant>,
    started: Instant,
    finished: bool,
}

/// The comparison run a route asked for: the input prepared for the
/// other version, or why that version refused it.
pub type Comparison = Option<Result<Prepared, InferError>>;

/// The input for the comparison run, when the route asked for one: the
/// request's, prepared again when the other version prepares it
/// differently (its manifest's input or scaling). Worked out before the
/// request's own run is timed.
pub fn comparison(
    trial: &Trial,
    arm: &Arm,
    prepared: &Prepared,
    req: &InferRequest,
    limits: &LimitsConfig,
) -> Comparison {
    if !trial.compare {
        return None;
    }
    let (model, other) = (arm.runner.model(), trial.other.runner.model());
    let scaling = |a: &Arm| a.settings.preprocess(a.runner.model());
    if model.manifest.input == other.manifest.input && scaling(arm) == scaling(&trial.other) {
        Some(Ok(prepared.clone()))
    } else {
        Some(preprocess::prepare(other, req, limits, &scaling(&trial.other)))
    }
}

/// A request the answering version refused at preprocessing: a failure of
/// that version when the other one accepts the same input (a device's own
/// bad input is refused by both, and is nobody's failure).
pub fn refused(observer: &Observer, trial: &Trial, arm: &Arm, req: &InferRequest, limits: &LimitsConfig) {
    let other = &trial.other;
    let scaling = other.settings.preprocess(other.runner.model());
    if preprocess::prepare(other.runner.model(), req, limits, &scaling).is_ok() {
        observer.observe(failure(arm, trial.step_id, Duration::ZERO, Compared::No));
    }
}

impl<'a> Watch<'a> {
    pub fn start(settings: Reporter<'a>, trial: &'a Trial, arm: &'a Arm, due: Option<Instant>) -> Watch<'a> {
        Watch { settings, trial, arm, due, started: Instant::now(), finished: false }
    }

    /// Reports `answer` and starts the comparison run, if any.
    pub fn finish(
        mut self,
        req: &InferRequest,
        answer: &Result<EdgeAnswer, InferError>,
        comparison: Comparison,
    ) {
        self.finished = true;
        let settings = &self.settings;
        let latency = self.started.elapsed();
        let step_id = self.trial.step_id;
        let escalates = settings.escalates;
        settings.observer.observe(seen(self.arm, step_id, answer, latency, escalates, Compared::No));
        let (Some(comparison), Ok(first)) = (comparison, answer) else { return };
        let other = self.trial.other.clone();
        let input = match comparison {
            Ok(input) => input,
            Err(_) => {
                // The other version refuses what this one answered.
                settings.observer.observe(failure(&other, step_id, Duration::ZERO, Compared::Failed));
                return;
            }
        };
        let label = first.response.parameters.label.clone();
        let observer = settings.observer.clone();
        // The request's own parts postprocessing reads; not its inputs.
        let req = InferRequest {
            id: req.id.clone(),
            reply_to: None,
            inputs: Vec::new(),
            outputs: req.outputs.clone(),
            parameters: req.parameters.clone(),
        };
        let (node, measure) = (settings.node.to_string(), settings.measure);
        tokio::spawn(async move {
            let (answer, latency) = run(&other, input, &req, &node, measure).await;
            let compared = match &answer {
                // Turned away by a full queue: extra work skipped, not a failure.
                Err(e) if e.code == ErrorCode::Overloaded => return,
                Err(_) => Compared::Failed,
                Ok(a) => Compared::labels(label.as_deref(), a.response.parameters.label.as_deref()),
            };
            observer.observe(seen(&other, step_id, &answer, latency, escalates, compared));
        });
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let timed_out = self.due.is_some_and(|due| Instant::now() >= due);
        if !self.finished && timed_out {
            let failure = failure(self.arm, self.trial.step_id, self.started.elapsed(), Compared::No);
            self.settings.observer.observe(failure);
        }
    }
}

fn failure(arm: &Arm, step_id: u64, latency: Duration, compared: Compared) -> Seen {
    let failed: Result<EdgeAnswer, InferError> = Err(InferError::internal(String::new()));
    seen(arm, step_id, &failed, latency, false, compared)
}

/// `input` on `arm`, postprocessed as the request's answer would be.
async fn run(
    arm: &Arm,
    input: Prepared,
    req: &InferRequest,
    node: &str,
    measure: Confidence,
) -> (Result<EdgeAnswer, InferError>, Duration) {
    let started = Instant::now();
    let answer = match arm.runner.run(input, None).await {
        Ok(outputs) => postprocess::edge_answer(arm.runner.model(), req, outputs, node, measure),
        Err(e) => Err(e),
    };
    (answer, started.elapsed())
}

/// An answer as the rollout counts it. Any failure counts (`internal`, a
/// full queue, a deadline: a slow version causes the last two); the gate
/// weighs it against stable's rate over the same time, so load on the
/// whole node does not count against the candidate.
fn seen(
    arm: &Arm,
    step_id: u64,
    answer: &Result<EdgeAnswer, InferError>,
    latency: Duration,
    escalates: bool,
    compared: Compared,
) -> Seen {
    let confidence = answer.as_ref().ok().map(|a| a.confidence);
    let model = arm.runner.model();
    let threshold = escalates.then_some(arm.settings.cascade.threshold);
    Seen {
        model: model.name().to_string(),
        version: model.version().to_string(),
        config: arm.settings.version.clone(),
        step_id,
        latency,
        failed: answer.is_err(),
        // A failed answer says nothing about escalation.
        escalates: threshold.zip(confidence).map(|(t, c)| c.is_some_and(|c| c < t)),
        compared,
    }
}
