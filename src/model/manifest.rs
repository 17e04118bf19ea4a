use super::LoadError;
use crate::protocol::{Datatype, TensorData};
use serde::Deserialize;
use std::path::Path;

/// `models/NAME/VERSION/model.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    /// The model file, relative to the manifest: ONNX (`.onnx`), the only
    /// format the runtime loads.
    pub file: String,
    /// Hex sha256 of `file`; a model whose file does not match is refused.
    pub sha256: String,
    pub task: Task,
    pub quantization: Quantization,
    /// Class labels, in output order (classification only).
    #[serde(default)]
    pub labels: Vec<String>,
    #[serde(default)]
    pub produced_by: String,
    pub input: TensorSpec,
    pub outputs: Vec<TensorSpec>,
    #[serde(default)]
    pub preprocess: Preprocess,
    pub golden: Option<GoldenSpec>,
    /// Held-out accuracy figures, as the producing script measured them.
    #[serde(default)]
    pub accuracy: toml::Table,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Output 0 holds class probabilities; replies carry `label` and `confidence`.
    Classification,
    /// Outputs are returned as they are.
    Raw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantization {
    Int8,
    F32,
}

impl Quantization {
    pub fn as_str(self) -> &'static str {
        match self {
            Quantization::Int8 => "int8",
            Quantization::F32 => "f32",
        }
    }
}

/// A tensor's name, datatype and shape; `-1` in the first dimension is the batch.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: Datatype,
    pub shape: Vec<i64>,
}

impl TensorSpec {
    /// Elements in one batch row.
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).map(|&d| d.max(0) as usize).product()
    }
}

/// `x * scale + offset`, applied by the node before the model sees the input.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preprocess {
    pub scale: f32,
    pub offset: f32,
}

impl Default for Preprocess {
    fn default() -> Self {
        Preprocess { scale: 1.0, offset: 0.0 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GoldenSpec {
    pub file: String,
    /// Largest allowed absolute difference of any output element.
    pub tolerance: f64,
}

impl Manifest {
    pub fn read(path: &Path) -> Result<Manifest, LoadError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| LoadError::Io { path: path.to_owned(), source })?;
        let manifest: Manifest = toml::from_str(&text)
            .map_err(|e| LoadError::Manifest { path: path.to_owned(), message: e.to_string() })?;
        manifest.check().map_err(|message| LoadError::Manifest { path: path.to_owned(), message })?;
        Ok(manifest)
    }

    fn check(&self) -> Result<(), String> {
        if !super::valid_model_name(&self.name) {
            return Err(format!(
                "name = {:?}: use letters, digits, '.', '_' and '-' (not '.' or '..')",
                self.name
            ));
        }
        if self.sha256.len() != 64 || !self.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("sha256 = {:?}: must be 64 hex digits", self.sha256));
        }
        for (what, spec) in
            std::iter::once(("input", &self.input)).chain(self.outputs.iter().map(|o| ("outputs", o)))
        {
            if spec.shape.is_empty()
                || spec.shape.iter().skip(1).any(|&d| d <= 0)
                || spec.shape[0] < -1
                || spec.shape[0] == 0
            {
                return Err(format!(
                    "{what} {:?}: shape {:?} must start with -1 (the batch) or a size, then positive sizes",
                    spec.name, spec.shape
                ));
            }
        }
        if self.outputs.is_empty() {
            return Err("outputs: list at least one output".into());
        }
        if self.task == Task::Classification {
            let classes = self.outputs[0].row_len();
            if self.labels.len() != classes {
                return Err(format!(
                    "labels: {} labels for output {:?} with {} classes; give one label per class",
                    self.labels.len(),
                    self.outputs[0].name,
                    classes
                ));
            }
        }
        Ok(())
    }
}

impl Preprocess {
    /// Types raw input as `datatype` and scales float inputs; integer inputs
    /// (already quantized by the device) pass unchanged.
    pub fn apply(&self, data: TensorData, datatype: Datatype) -> Result<TensorData, String> {
        let typed = data.into_typed(datatype)?;
        Ok(match typed {
            TensorData::F32(mut v) if (self.scale, self.offset) != (1.0, 0.0) => {
                for x in &mut v {
                    *x = *x * self.scale + self.offset;
                }
                TensorData::F32(v)
            }
            other => other,
        })
    }
}
