//! Where a plan's time goes: each node of the optimized plan timed over
//! many runs, through tract's own evaluation hook (`run_plan_with_eval`).

use super::{LoadedModel, RunError};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tract_onnx::prelude::*;

/// One node of the plan and its mean time per run.
#[derive(Debug, Clone)]
pub struct NodeTime {
    pub node: String,
    pub op: String,
    pub per_run: Duration,
}

impl LoadedModel {
    /// Per-node mean time of `iterations` runs at `batch` rows of zeros (the
    /// batch's own plan), slowest first.
    pub fn profile(&self, batch: usize, iterations: usize) -> Result<Vec<NodeTime>, RunError> {
        let plan =
            self.plan_for(batch).ok_or_else(|| self.run_error(format!("no plan for batch {batch}")))?;
        let input = self.zeros(batch)?;
        let tensor =
            self.input_tensor(&input, 0, batch, batch).map_err(|e| self.run_error(format!("{e:#}")))?;
        let mut totals: HashMap<usize, Duration> = HashMap::new();
        let mut state = plan.spawn().map_err(|e| self.run_error(format!("{e:#}")))?;
        for _ in 0..iterations.max(1) + 1 {
            state
                .run_plan_with_eval(tvec!(tensor.clone().into_tvalue()), |ctx, st, node, inputs| {
                    let started = Instant::now();
                    let out = tract_onnx::tract_core::plan::eval(ctx, st, node, inputs);
                    *totals.entry(node.id).or_default() += started.elapsed();
                    out
                })
                .map_err(|e| self.run_error(format!("{e:#}")))?;
        }
        let model = plan.model();
        let mut times: Vec<NodeTime> = totals
            .into_iter()
            .map(|(id, total)| NodeTime {
                node: model.node(id).name.clone(),
                op: model.node(id).op.name().to_string(),
                per_run: total / (iterations.max(1) + 1) as u32,
            })
            .collect();
        times.sort_by_key(|t| std::cmp::Reverse(t.per_run));
        Ok(times)
    }
}
