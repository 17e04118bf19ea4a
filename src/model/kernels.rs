//! What the optimized plan actually computes with: an `int8` label on a model
//! says nothing about whether it runs integer kernels.

use tract_onnx::prelude::*;

/// The operators of a plan that decide its speed, in three groups: our
/// integer ops (`edgeinfer.Q*`, from the load-time rewrite), tract's heavy
/// operators (matrix products, convolutions) on integers, and those on floats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelReport {
    pub ours: Vec<String>,
    pub integer: Vec<String>,
    pub float: Vec<String>,
}

impl KernelReport {
    pub fn of(model: &TypedModel) -> KernelReport {
        let mut report = KernelReport::default();
        for node in model.nodes() {
            let op = node.op.name();
            if op.starts_with("edgeinfer.Q") {
                report.ours.push(op.trim_start_matches("edgeinfer.").to_string());
                continue;
            }
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

    /// No heavy node computes in float.
    pub fn runs_integer(&self) -> bool {
        !(self.integer.is_empty() && self.ours.is_empty()) && self.float.is_empty()
    }

    /// `integer`, `float` or `mixed`, for people and for `models verify`.
    pub fn kind(&self) -> &'static str {
        match (self.integer.is_empty() && self.ours.is_empty(), self.float.is_empty()) {
            (false, true) => "integer",
            (true, false) => "float",
            (false, false) => "mixed",
            (true, true) => "none",
        }
    }

    /// One line for `models verify`: counts, then the float nodes by name
    /// (what is left to make integer).
    pub fn summary(&self) -> String {
        let mut line = format!(
            "{} ({} on edgeinfer integer ops, {} on tract integer kernels, {} on float kernels)",
            self.kind(),
            self.ours.len(),
            self.integer.len(),
            self.float.len()
        );
        if !self.float.is_empty() {
            line.push_str(&format!("; float: {}", self.float.join(" ")));
        }
        line
    }
}

/// Packing ops only reorder operands for the product that follows them.
fn is_heavy(op: &str) -> bool {
    !op.contains("Pack")
        && ["MatMul", "Mmm", "Conv", "Gemm", "EinSum", "Depthwise", "DepthWise"]
            .iter()
            .any(|k| op.contains(k))
}
