use std::path::PathBuf;

/// Why a model version was refused at load. Each names the model and the fix.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: cannot read: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid manifest: {message}")]
    Manifest { path: PathBuf, message: String },
    #[error(
        "model {model} version {version}: sha256 of {path} is {actual}, but the manifest says {expected}; \
         the file is corrupt or was replaced: restore it, or regenerate the model with models/produce.py"
    )]
    Sha256Mismatch { model: String, version: String, path: PathBuf, expected: String, actual: String },
    #[error("model {model} version {version}: tract cannot load or plan it: {message}")]
    Tract { model: String, version: String, message: String },
    #[error(
        "model {model} version {version}: golden vector {vector} differs from the reference by {max_diff:.3e} \
         at batch size {batch} (tolerance {tolerance:.1e}); refusing to serve a model that computes wrong answers"
    )]
    Golden { model: String, version: String, vector: usize, batch: usize, max_diff: f64, tolerance: f64 },
}

impl LoadError {
    /// A few words and no paths, for the retained status (the log has the rest).
    pub fn reason(&self) -> &'static str {
        match self {
            LoadError::Io { .. } => "a file cannot be read",
            LoadError::Manifest { .. } => "invalid manifest",
            LoadError::Sha256Mismatch { .. } => "the model file does not match its sha256",
            LoadError::Tract { .. } => "tract cannot load or plan it",
            LoadError::Golden { .. } => "its golden outputs differ",
        }
    }
}
