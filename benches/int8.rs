//! INT8 against f32 through edgeinfer's runtime (load-time passes
//! included): the shipped `digits` pair and the eight MLPerf Tiny models
//! (read from ../shared/mlperf-tiny; skipped with a message where absent),
//! at batch 1 and 8, one thread. Criterion times each; a summary table of
//! per-item figures follows, and with EDGEINFER_PROFILE=1 the slowest nodes
//! of each batch-1 plan. `benches/int8_onnxruntime.py` times the same ONNX
//! files under onnxruntime for the other column; docs/BENCHMARKS.md has both.
//! With EDGEINFER_INT8_OPS=off the INT8 models load without our integer
//! ops (tract's own path: the "before" figures).

#[path = "../tests/common/mlperf.rs"]
mod tiny;

use criterion::{BenchmarkId, Criterion, Throughput};
use edgeinfer::model::{LoadedModel, RuntimeOptions};
use edgeinfer::protocol::TensorData;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCHES: [usize; 2] = [1, 8];

struct Subject {
    name: String,
    model: LoadedModel,
    /// At least 8 rows of input.
    input: TensorData,
}

impl Subject {
    fn rows(&self, n: usize) -> TensorData {
        let per = self.model.manifest.input.row_len();
        self.input.slice(0..n * per)
    }
}

fn subjects() -> Vec<Subject> {
    let mut out = Vec::new();
    let options = RuntimeOptions { batch_sizes: BATCHES.to_vec(), defer: false, ..Default::default() };
    for name in ["digits", "digits-f32"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(name).join("1");
        let model = LoadedModel::load(&dir, &options).unwrap();
        let raw: Vec<f64> = (0..8 * 64).map(|i| ((i * 7) % 17) as f64).collect();
        let input =
            model.manifest.preprocess.apply(TensorData::Number(raw), model.manifest.input.datatype).unwrap();
        out.push(Subject { name: name.into(), model, input });
    }
    match tiny::dir() {
        Some(dir) => {
            for key in tiny::MODELS {
                for variant in tiny::VARIANTS {
                    let case = tiny::load(&dir, key, variant, BATCHES.to_vec());
                    out.push(Subject { name: case.name, model: case.model, input: case.input });
                }
            }
        }
        None => eprintln!("SKIPPED the MLPerf Tiny models: ../shared/mlperf-tiny is absent"),
    }
    out
}

/// Mean per-item time over runs filling about `budget`.
fn per_item(s: &Subject, batch: usize, budget: Duration) -> Duration {
    let input = s.rows(batch);
    s.model.run(batch, &input).unwrap();
    let (start, mut runs) = (Instant::now(), 0u32);
    while start.elapsed() < budget || runs < 10 {
        s.model.run(batch, &input).unwrap();
        runs += 1;
    }
    start.elapsed() / (runs * batch as u32)
}

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let subjects = subjects();
    let mut group = c.benchmark_group("int8");
    for s in &subjects {
        for batch in BATCHES {
            let data = s.rows(batch);
            group.throughput(Throughput::Elements(batch as u64));
            group.bench_with_input(BenchmarkId::new(&s.name, batch), &data, |b, data| {
                b.iter(|| s.model.run(batch, data).unwrap())
            });
        }
    }
    group.finish();

    println!("\nper item, us (mean over ~1 s of runs each):");
    println!("| model | kernels | b1 | b8 |");
    println!("| --- | --- | --- | --- |");
    for s in &subjects {
        let [b1, b8] = BATCHES.map(|b| per_item(s, b, Duration::from_secs(1)).as_secs_f64() * 1e6);
        println!("| {} | {} | {b1:.1} | {b8:.1} |", s.name, s.model.kernels.kind());
    }
    if std::env::var_os("EDGEINFER_PROFILE").is_some() {
        for s in &subjects {
            println!("\n{} batch 1, slowest nodes:", s.name);
            for n in
                s.model.profile(1, 200).unwrap().iter().take(
                    std::env::var("EDGEINFER_PROFILE_TOP").ok().and_then(|v| v.parse().ok()).unwrap_or(8),
                )
            {
                println!("  {:>9.1} us  {:<24} {}", n.per_run.as_secs_f64() * 1e6, n.op, n.node);
            }
        }
    }
}
