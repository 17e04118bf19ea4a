//! Models on disk: the manifest, the tract runtime with its per-batch-size
//! plans, the golden-vector gate and the registry of loaded versions.

pub mod compare;
mod error;
mod golden;
mod kernels;
mod manifest;
pub mod passes;
mod profile;
pub mod quant;
mod registry;
mod runtime;

pub use error::LoadError;
pub use golden::{Golden, GoldenVector};
pub use kernels::KernelReport;
pub use manifest::{Manifest, Preprocess, Quantization, Task, TensorSpec};
pub use profile::NodeTime;
pub use quant::choice::{Kernel, KernelCache, LayerChoice};
pub use registry::{
    Fingerprint, Fingerprints, Refused, Registry, Versions, fingerprints_on_disk, valid_model_name,
    versions_on_disk,
};
pub use runtime::{LoadedModel, RawOutput, RunError, RuntimeOptions};
