//! What the optimized plan actually computes with: an `int8` label on a model
//! says nothing about whether tract runs integer kernels for it.

use tract_onnx::prelude::*;

/// The heavy operators of a plan (matrix products, convolutions), split by
/// whether they multiply integers or floats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelReport {
    pub integer: Vec<String>,
    pub float: Vec<String>,
}

impl KernelReport {
    pub fn of(model: &TypedModel) -> KernelReport {
        let mut report = KernelReport::default();
        for node in model.nodes() {
            let op = node.op.name();
            if !is_heavy(&op) {
                continue;
            }
            let Ok(facts) = model.node_input_facts(node.id) else { continue };
            let integer =
                facts.iter().any(|f| matches!(f.datum_type.unquantized(), DatumType::I8 | DatumType::U8));
            let dt = facts.first().map(|f| format!("{:?}", f.datum_type.unquantized())).unwrap_or_default();
            let entry = format!("{op}({dt})");
            if integer {
                report.integer.push(entry);
            } else {
                report.float.push(entry);
            }
        }
        report
    }

    pub fn runs_integer(&self) -> bool {
        !self.integer.is_empty() && self.float.is_empty()
    }

    /// `integer`, `float` or `mixed`, for people and for `models verify`.
    pub fn kind(&self) -> &'static str {
        match (self.integer.is_empty(), self.float.is_empty()) {
            (false, true) => "integer",
            (true, false) => "float",
            (false, false) => "mixed",
            (true, true) => "none",
        }
    }
}

/// Packing ops only reorder operands for the product that follows them.
fn is_heavy(op: &str) -> bool {
    !op.contains("Pack")
        && ["MatMul", "Mmm", "Conv", "Gemm", "EinSum", "Depthwise"].iter().any(|k| op.contains(k))
}
