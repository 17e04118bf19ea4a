//! Stage 5b: a request that takes part in a rollout. Its answer is reported
//! to the rollout (the figures its gates judge), and a sample is also run
//! on the other version beside it, without delaying its reply, to compare
//! labels: the candidate's in shadow mode (then dropped: no device sees
//! it), and stable's for a canary's answers. A comparison run waits in the
//! other version's bounded queue like any request; a full one skips it.

use super::postprocess::{self, EdgeAnswer};
use super::preprocess::{self, Prepared};
use super::resolve::Trial;
use super::run::Runner;
use crate::config::LimitsConfig;
use crate::model::LoadedModel;
use crate::protocol::{Confidence, ErrorCode, InferError, InferRequest};
use crate::rollout::{Compared, Observer, Seen};
use std::time::{Duration, Instant};

/// Where answers are reported, and what the trial needs of the request's
/// settings.
pub struct Settings<'a> {
    pub observer: Observer,
    pub node: &'a str,
    pub measure: Confidence,
    /// The model's escalation threshold, with a cloud tier.
    pub threshold: Option<f32>,
}

/// One request's part in a rollout, from just before its run. Dropped
/// unfinished (its deadline ran out while it waited or ran), it reports a
/// failure, so a version slow on part of its traffic cannot hide it.
pub struct Watch<'a> {
    settings: Settings<'a>,
    trial: &'a Trial<'a>,
    model: &'a LoadedModel,
    started: Instant,
    finished: bool,
}

impl<'a> Watch<'a> {
    pub fn start(settings: Settings<'a>, trial: &'a Trial<'a>, model: &'a LoadedModel) -> Watch<'a> {
        Watch { settings, trial, model, started: Instant::now(), finished: false }
    }

    /// The input for the comparison run, when the route asked for one: the
    /// request's, prepared again when the other version prepares it
    /// differently (its manifest's input or scaling).
    pub fn comparison_input(
        &self,
        prepared: &Prepared,
        req: &InferRequest,
        limits: &LimitsConfig,
    ) -> Option<Prepared> {
        if !self.trial.compare {
            return None;
        }
        let (mine, other) = (&self.model.manifest, &self.trial.other.model().manifest);
        if mine.input == other.input && mine.preprocess == other.preprocess {
            Some(prepared.clone())
        } else {
            preprocess::prepare(self.trial.other.model(), req, limits).ok()
        }
    }

    /// Reports `answer` and starts the comparison run of `input`, if any.
    pub fn finish(
        mut self,
        req: &InferRequest,
        answer: &Result<EdgeAnswer, InferError>,
        input: Option<Prepared>,
    ) {
        self.finished = true;
        let settings = &self.settings;
        let latency = self.started.elapsed();
        let step_id = self.trial.step_id;
        settings.observer.observe(seen(
            self.model,
            step_id,
            answer,
            latency,
            settings.threshold,
            Compared::No,
        ));
        let (Some(input), Ok(first)) = (input, answer) else { return };
        let label = first.response.parameters.label.clone();
        let (other, observer) = (self.trial.other.clone(), settings.observer.clone());
        // The request's own parts postprocessing reads; not its inputs.
        let req = InferRequest {
            id: req.id.clone(),
            reply_to: None,
            inputs: Vec::new(),
            outputs: req.outputs.clone(),
            parameters: req.parameters.clone(),
        };
        let (node, measure, threshold) = (settings.node.to_string(), settings.measure, settings.threshold);
        tokio::spawn(async move {
            let (answer, latency) = run(&other, input, &req, &node, measure).await;
            let compared = match (&answer, &label) {
                // Turned away by a full queue: extra work skipped, not a failure.
                (Err(e), _) if e.code == ErrorCode::Overloaded => return,
                (Err(_), _) => Compared::Failed,
                (Ok(a), Some(label)) => match &a.response.parameters.label {
                    Some(l) if l == label => Compared::Agreed,
                    Some(_) => Compared::Disagreed,
                    None => Compared::Unlabelled,
                },
                (Ok(_), None) => Compared::Unlabelled,
            };
            observer.observe(seen(other.model(), step_id, &answer, latency, threshold, compared));
        });
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let failed: Result<EdgeAnswer, InferError> = Err(InferError::internal(String::new()));
            let latency = self.started.elapsed();
            let seen = seen(self.model, self.trial.step_id, &failed, latency, None, Compared::No);
            self.settings.observer.observe(seen);
        }
    }
}

/// `input` on `runner`, postprocessed as the request's answer would be.
async fn run(
    runner: &Runner,
    input: Prepared,
    req: &InferRequest,
    node: &str,
    measure: Confidence,
) -> (Result<EdgeAnswer, InferError>, Duration) {
    let started = Instant::now();
    let answer = match runner.run(input, None).await {
        Ok(outputs) => postprocess::edge_answer(runner.model(), req, outputs, node, measure),
        Err(e) => Err(e),
    };
    (answer, started.elapsed())
}

/// An answer as the rollout counts it. Any failure counts (`internal`, a
/// full queue, a deadline: a slow version causes the last two); the gate
/// weighs it against stable's rate over the same time, so load on the
/// whole node does not count against the candidate.
fn seen(
    model: &LoadedModel,
    step_id: u64,
    answer: &Result<EdgeAnswer, InferError>,
    latency: Duration,
    threshold: Option<f32>,
    compared: Compared,
) -> Seen {
    let confidence = answer.as_ref().ok().map(|a| a.confidence);
    Seen {
        model: model.name().to_string(),
        version: model.version().to_string(),
        step_id,
        latency,
        failed: answer.is_err(),
        // A failed answer says nothing about escalation.
        escalates: threshold.zip(confidence).map(|(t, c)| c.is_some_and(|c| c < t)),
        compared,
    }
}
