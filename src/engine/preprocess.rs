//! Stage 3: check the request against the model's signature, then type and
//! scale its input as the manifest says (or the config serving it: `scaling`). Every error names the field and the fix.

use crate::config::LimitsConfig;
use crate::model::{LoadedModel, Preprocess};
use crate::protocol::{Datatype, InferError, InferRequest, TensorData};
use crate::telemetry::{self, Stage};
use std::time::Instant;

/// Input ready for the model: `rows` rows, typed as the model's input.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub rows: usize,
    pub input: TensorData,
}

pub fn prepare(
    model: &LoadedModel,
    req: &InferRequest,
    limits: &LimitsConfig,
    scaling: &Preprocess,
) -> Result<Prepared, InferError> {
    let started = Instant::now();
    let prepared = check_and_type(model, req, limits, scaling)?;
    telemetry::observe_stage(model.name(), Stage::Preprocess, started.elapsed().as_secs_f64());
    Ok(prepared)
}

fn check_and_type(
    model: &LoadedModel,
    req: &InferRequest,
    limits: &LimitsConfig,
    scaling: &Preprocess,
) -> Result<Prepared, InferError> {
    let spec = &model.manifest.input;
    let name = model.name();
    let input = match req.inputs.as_slice() {
        [one] => one,
        [] => {
            return Err(InferError::invalid_input(format!(
                "inputs is empty; model {name} takes one input {:?} of shape {}",
                spec.name,
                shape_text(&spec.shape)
            )));
        }
        many => {
            return Err(InferError::invalid_input(format!(
                "inputs has {} tensors; model {name} takes one input {:?}",
                many.len(),
                spec.name
            )));
        }
    };
    if input.name != spec.name {
        return Err(InferError::invalid_input(format!(
            "inputs[0].name {:?} is not an input of model {name}; use {:?}",
            input.name, spec.name
        )));
    }
    let Some(datatype) = Datatype::parse(&input.datatype) else {
        return Err(InferError::invalid_input(format!(
            "inputs[0].datatype {:?} is not an Open Inference Protocol datatype served here; model {name} takes {}",
            input.datatype, spec.datatype
        )));
    };
    if datatype != spec.datatype {
        return Err(InferError::invalid_input(format!(
            "inputs[0].datatype is {datatype} but model {name} takes {}; send {} data",
            spec.datatype, spec.datatype
        )));
    }
    let shape = &input.shape;
    let fits = shape.len() == spec.shape.len()
        && shape.iter().zip(&spec.shape).all(|(&got, &want)| got >= 1 && (want == -1 || got == want));
    if !fits {
        return Err(InferError::invalid_input(format!(
            "inputs[0].shape {shape:?} does not fit model {name}, which takes {}; \
             the first dimension is the number of rows",
            shape_text(&spec.shape)
        )));
    }
    let rows = shape[0] as usize;
    if rows > limits.max_rows {
        return Err(InferError::too_large(format!(
            "inputs[0].shape[0] = {rows} rows, more than limits.max_rows = {}; split the request",
            limits.max_rows
        )));
    }
    let expected = rows * spec.row_len();
    if input.data.len() != expected {
        return Err(InferError::invalid_input(format!(
            "inputs[0].data has {} elements but shape {shape:?} needs {expected}; \
             send the flat, row-major data of every row",
            input.data.len()
        )));
    }
    for (i, out) in req.outputs.iter().enumerate() {
        if !model.manifest.outputs.iter().any(|o| o.name == out.name) {
            return Err(InferError::invalid_input(format!(
                "outputs[{i}].name {:?} is not an output of model {name}; use one of {}",
                out.name,
                model.manifest.outputs.iter().map(|o| format!("{:?}", o.name)).collect::<Vec<_>>().join(", ")
            )));
        }
    }
    let input = scaling
        .apply(input.data.clone(), spec.datatype)
        .map_err(|m| InferError::invalid_input(format!("inputs[0].data: {m}")))?;
    Ok(Prepared { rows, input })
}

fn shape_text(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(|&d| if d == -1 { "N".into() } else { d.to_string() }).collect();
    format!("[{}]", dims.join(", "))
}
