use super::LoadError;
use serde::Deserialize;
use std::path::Path;

/// Reference inputs (as a device sends them, before preprocessing) with the
/// outputs onnxruntime gave for them when the model was produced.
#[derive(Debug, Clone, Deserialize)]
pub struct Golden {
    pub vectors: Vec<GoldenVector>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoldenVector {
    pub input: Vec<f64>,
    /// Output 0, flattened.
    pub expected: Vec<f64>,
}

impl Golden {
    pub fn read(path: &Path) -> Result<Golden, LoadError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| LoadError::Io { path: path.to_owned(), source })?;
        let golden: Golden = serde_json::from_str(&text)
            .map_err(|e| LoadError::Manifest { path: path.to_owned(), message: e.to_string() })?;
        if golden.vectors.is_empty() {
            return Err(LoadError::Manifest {
                path: path.to_owned(),
                message: "vectors: give at least one golden vector".into(),
            });
        }
        Ok(golden)
    }
}
