use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;

/// What a run measured; `--json` prints it as is.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub mode: &'static str,
    pub topic: String,
    pub connections: usize,
    pub concurrency: usize,
    pub rate: Option<f64>,
    pub duration_s: f64,
    /// Replies received inside the measured interval (after warm-up).
    pub requests: u64,
    /// Of those, error replies.
    pub errors: u64,
    /// Requests still unanswered when the run ended.
    pub unanswered: u64,
    pub throughput_rps: f64,
    pub latency_us: Percentiles,
    /// With `--shared`: measured replies by `parameters.node`, and by
    /// `parameters.cache` (`miss`, `memory`, `disk`, `redis`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_node: Option<BTreeMap<String, u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_cache: Option<BTreeMap<String, u64>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
}

impl Percentiles {
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        Percentiles {
            p50: h.value_at_quantile(0.50),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: h.mean(),
        }
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let load = match self.rate {
            Some(r) => format!("open loop at {r} req/s (Poisson) over {} connections", self.connections),
            None => format!("closed loop, {} connections x {} in flight", self.connections, self.concurrency),
        };
        let l = &self.latency_us;
        writeln!(f, "edgeinfer bench: {load}, {:.1} s measured, on {}", self.duration_s, self.topic)?;
        writeln!(
            f,
            "requests {} ({:.0} req/s), errors {}, unanswered at the end {}",
            self.requests, self.throughput_rps, self.errors, self.unanswered
        )?;
        write!(
            f,
            "round trip us: p50 {}  p95 {}  p99 {}  p99.9 {}  max {}  mean {:.0}",
            l.p50, l.p95, l.p99, l.p999, l.max, l.mean
        )?;
        let share = |counts: &BTreeMap<String, u64>| {
            let total = counts.values().sum::<u64>().max(1) as f64;
            counts
                .iter()
                .map(|(k, n)| format!("{k} {:.1}%", *n as f64 * 100.0 / total))
                .collect::<Vec<_>>()
                .join("  ")
        };
        if let Some(nodes) = &self.by_node {
            write!(f, "\nanswered by: {}", share(nodes))?;
        }
        if let Some(layers) = &self.by_cache {
            write!(f, "\ncache: {}", share(layers))?;
        }
        Ok(())
    }
}
