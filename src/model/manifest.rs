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
    /// Reads `NAME/VERSION/model.toml`; its name and version must be the
    /// directory's, so a stray copy cannot stand in for another version.
    pub fn read(path: &Path) -> Result<Manifest, LoadError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| LoadError::Io { path: path.to_owned(), source })?;
        let manifest = Manifest::parse(&text)
            .map_err(|message| LoadError::Manifest { path: path.to_owned(), message })?;
        manifest
            .check_place(path)
            .map_err(|message| LoadError::Manifest { path: path.to_owned(), message })?;
        Ok(manifest)
    }

    /// A manifest's text, parsed and checked (all but its place on disk).
    pub fn parse(text: &str) -> Result<Manifest, String> {
        let manifest: Manifest = toml::from_str(text).map_err(|e| e.to_string())?;
        manifest.check()?;
        Ok(manifest)
    }

    fn check_place(&self, path: &Path) -> Result<(), String> {
        let mut dirs = path.parent().into_iter().flat_map(|d| d.iter().rev()).map(|n| n.to_string_lossy());
        let (version, name) = (dirs.next().unwrap_or_default(), dirs.next().unwrap_or_default());
        if (name.as_ref(), version.as_ref()) != (self.name.as_str(), self.version.as_str()) {
            return Err(format!(
                "name = {:?}, version = {:?}, but it sits in {name}/{version}/; move it to {}/{}/ \
                 or correct the manifest",
                self.name, self.version, self.name, self.version
            ));
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        if !super::valid_model_name(&self.name) {
            return Err(format!(
                "name = {:?}: use letters, digits, '.', '_' and '-' (not '.' or '..')",
                self.name
            ));
        }
        let files = std::iter::once(("file", &self.file))
            .chain(self.golden.as_ref().map(|g| ("golden.file", &g.file)));
        for (key, file) in files {
            let plain = !file.is_empty()
                && Path::new(file).components().all(|c| matches!(c, std::path::Component::Normal(_)));
            if !plain {
                return Err(format!(
                    "{key} = {file:?}: name a file inside the version directory, like \"model.onnx\" \
                     (no absolute path, no '..')"
                ));
            }
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
