//! Stage 2: which loaded model version answers.

use super::Target;
use crate::model::{LoadedModel, Registry};
use crate::protocol::{InferError, InferRequest};
use std::sync::Arc;

pub fn route(
    registry: &Registry,
    target: Target<'_>,
    req: &InferRequest,
) -> Result<Arc<LoadedModel>, InferError> {
    let version = target.version.or(req.parameters.model_version.as_deref());
    registry.get(target.model, version)
}
