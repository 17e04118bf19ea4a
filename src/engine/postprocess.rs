//! Stage 5: model outputs to the reply: requested outputs only, and for a
//! classifier the label, confidence and top-k of row 0.

use crate::model::{LoadedModel, RawOutput, Task};
use crate::protocol::{
    Datatype, InferError, InferRequest, InferResponse, OutputTensor, ResponseParameters, TopK,
};

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
