//! In-process runtime figures: load time per shipped model, and per-item
//! latency at batch 1, 8 and 32 for `digits` (INT8), its f32 twin and
//! `digits-large`. Run with `cargo bench --bench runtime`; docs/BENCHMARKS.md
//! records the figures.

use criterion::{BenchmarkId, Criterion, Throughput};
use edgeinfer::model::{LoadedModel, RuntimeOptions};
use edgeinfer::protocol::TensorData;
use std::path::PathBuf;
use std::time::Duration;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MODELS: [&str; 3] = ["digits", "digits-f32", "digits-large"];
const BATCHES: [usize; 3] = [1, 8, 32];

fn dir(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(model).join("1")
}

fn input(model: &LoadedModel, batch: usize) -> TensorData {
    // Held-out-like pixels (0..16) rather than zeros, so activations are realistic.
    let raw: Vec<f64> = (0..batch * 64).map(|i| ((i * 7) % 17) as f64).collect();
    model.manifest.preprocess.apply(TensorData::Number(raw), model.manifest.input.datatype).unwrap()
}

fn main() {
    let mut c = Criterion::default().configure_from_args().warm_up_time(Duration::from_millis(500));
    let options = RuntimeOptions::default();

    let mut load = c.benchmark_group("load");
    load.sample_size(10);
    for model in MODELS {
        load.bench_function(model, |b| b.iter(|| LoadedModel::load(&dir(model), &options).unwrap()));
    }
    load.finish();

    let loaded: Vec<LoadedModel> =
        MODELS.iter().map(|m| LoadedModel::load(&dir(m), &options).unwrap()).collect();
    let mut run = c.benchmark_group("run");
    for model in &loaded {
        for batch in BATCHES {
            let data = input(model, batch);
            run.throughput(Throughput::Elements(batch as u64));
            run.bench_with_input(BenchmarkId::new(model.name(), batch), &data, |b, data| {
                b.iter(|| model.run(batch, data).unwrap())
            });
        }
    }
    run.finish();
    c.final_summary();

    // The per-item table docs/BENCHMARKS.md quotes, measured side by side.
    println!("\nper-item latency (us/item, mean of 2000 runs after warm-up)");
    println!("{:<14} {:>9} {:>9} {:>9} {:>10}", "model", "batch 1", "batch 8", "batch 32", "load (ms)");
    for (name, model) in MODELS.iter().zip(&loaded) {
        let per_item: Vec<String> = BATCHES
            .iter()
            .map(|&b| format!("{:>9.2}", model.time_per_item(b, 2000).unwrap().as_secs_f64() * 1e6))
            .collect();
        let reload = LoadedModel::load(&dir(name), &options).unwrap();
        println!("{:<14} {} {:>10.1}", name, per_item.join(" "), reload.load_time.as_secs_f64() * 1e3);
    }
}
