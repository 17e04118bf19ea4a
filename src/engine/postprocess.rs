//! Stage 5: model outputs to the reply: requested outputs only, and for a
//! classifier the label, confidence and top-k of row 0, plus the
//! confidence the cascade holds against the model's threshold.

use crate::model::{LoadedModel, RawOutput, Task};
use crate::protocol::{
    Confidence, Datatype, InferError, InferRequest, InferResponse, OutputTensor, ResponseParameters, TopK,
};
use crate::telemetry::{self, Stage};
use std::time::Instant;

/// The edge model's reply, and how sure it is (`None`: not a classifier).
pub struct EdgeAnswer {
    pub response: InferResponse,
    pub confidence: Option<f32>,
}

/// The reply to `req` from the edge model's `outputs`, with its confidence
/// measured as `measure` says.
pub fn edge_answer(
    model: &LoadedModel,
    req: &InferRequest,
    outputs: Vec<RawOutput>,
    node: &str,
    measure: Confidence,
) -> Result<EdgeAnswer, InferError> {
    let started = Instant::now();
    let confidence = confidence(model, &outputs, measure);
    let response = respond(model, req, outputs, node)?;
    telemetry::observe_stage(model.name(), Stage::Postprocess, started.elapsed().as_secs_f64());
    Ok(EdgeAnswer { response, confidence })
}

pub fn respond(
    model: &LoadedModel,
    req: &InferRequest,
    outputs: Vec<RawOutput>,
    node: &str,
) -> Result<InferResponse, InferError> {
    let mut parameters = ResponseParameters { node: node.to_string(), ..Default::default() };
    if model.manifest.task == Task::Classification {
        let probs = outputs
            .first()
            .ok_or_else(|| InferError::internal(format!("model {} returned no output", model.name())))?;
        let classes = model.manifest.labels.len();
        let row0 = probs.data.to_f64();
        let mut ranked: Vec<(usize, f64)> = row0.iter().copied().take(classes).enumerate().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        let label = |i: usize| model.manifest.labels[i].clone();
        if let Some(&(best, p)) = ranked.first() {
            parameters.label = Some(label(best));
            parameters.confidence = Some(p as f32);
        }
        if let Some(k) = req.parameters.top_k.filter(|&k| k > 0) {
            parameters.top_k = Some(
                ranked
                    .iter()
                    .take(k as usize)
                    .map(|&(i, p)| TopK { label: label(i), confidence: p as f32 })
                    .collect(),
            );
        }
    }
    let wanted = |name: &str| req.outputs.is_empty() || req.outputs.iter().any(|o| o.name == name);
    let outputs = outputs
        .into_iter()
        .filter(|o| wanted(&o.name))
        .map(|o| OutputTensor {
            datatype: o.data.datatype().unwrap_or(Datatype::Fp64),
            name: o.name,
            shape: o.shape.iter().map(|&d| d as u64).collect(),
            data: o.data,
        })
        .collect();
    Ok(InferResponse {
        id: req.id.clone(),
        model_name: model.name().to_string(),
        model_version: model.version().to_string(),
        outputs,
        parameters,
    })
}

/// The confidence of a classifier's answer for the threshold: the worst
/// row's, so a batch escalates when any of its rows is unsure. `None` for a
/// model that is not a classifier (it never escalates).
fn confidence(model: &LoadedModel, outputs: &[RawOutput], measure: Confidence) -> Option<f32> {
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
