//! Stage 5b: a request that takes part in a rollout. Its answer is reported
//! to the rollout (the figures its gates judge), and a sample is also run
//! on the other version, after the request's own answer, to compare labels:
//! the candidate's in shadow mode (then dropped: no device sees it), and
//! stable's for a canary's answers. A comparison run waits in the other
//! version's bounded queue like any request; a full one skips it.

use super::postprocess::{self, EdgeAnswer};
use super::preprocess::Prepared;
use super::resolve::Trial;
use super::run::Runner;
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

/// Reports `answer` (from `model`, in `latency`) and starts the comparison
/// run of `input` when the trial asked for one.
pub fn report(
    settings: &Settings<'_>,
    trial: &Trial<'_>,
    model: &LoadedModel,
    req: &InferRequest,
    answer: &Result<EdgeAnswer, InferError>,
    latency: Duration,
    input: Option<Prepared>,
) {
    let observer = &settings.observer;
    let Some(first_seen) = seen(model, answer, latency, settings.threshold, Compared::No) else { return };
    observer.observe(first_seen);
    let (Some(input), Ok(first)) = (input, answer) else { return };
    let label = first.response.parameters.label.clone();
    let (other, observer) = (trial.other.clone(), observer.clone());
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
            (Ok(a), Some(label)) => match &a.response.parameters.label {
                Some(l) if l == label => Compared::Agreed,
                Some(_) => Compared::Disagreed,
                None => Compared::Unlabelled,
            },
            (Ok(_), None) => Compared::Unlabelled,
            (Err(_), _) => Compared::Failed,
        };
        if let Some(counted) = seen(other.model(), &answer, latency, threshold, compared) {
            observer.observe(counted);
        }
    });
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

/// An answer as the rollout counts it. Any failure of a device's own
/// request counts (`internal`, a full queue, a deadline: a slow version
/// causes the last two); the gate weighs it against stable's rate over the
/// same time, so load on the whole node does not count against the
/// candidate. A comparison run the other version's full queue turned away
/// is extra work skipped, and not counted.
fn seen(
    model: &LoadedModel,
    answer: &Result<EdgeAnswer, InferError>,
    latency: Duration,
    threshold: Option<f32>,
    compared: Compared,
) -> Option<Seen> {
    let failed = match answer {
        Ok(_) => false,
        Err(e) if e.code == ErrorCode::Overloaded && compared != Compared::No => return None,
        Err(_) => true,
    };
    let confidence = answer.as_ref().ok().and_then(|a| a.confidence);
    Some(Seen {
        model: model.name().to_string(),
        version: model.version().to_string(),
        latency,
        failed,
        escalates: threshold.map(|t| confidence.is_some_and(|c| c < t)),
        compared,
    })
}
