//! tract: parse once with a symbolic batch, then one optimized plan per
//! batch-size bucket (a concrete batch lets tract pick its best kernels; a
//! symbolic one was measured 1.5-2x slower on convolutions).

use super::quant::choice::{Chooser, KernelCache, LayerChoice};
use super::{Golden, KernelReport, LoadError, Manifest};
use crate::protocol::{Datatype, TensorData};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tract_onnx::prelude::*;

/// How plans are built. No request ever waits for a plan: a batch runs on
/// the plans that are ready.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Batch sizes with a plan, ascending. A batch of n rows runs on the
    /// smallest planned bucket >= n, padded; more rows than the largest run
    /// in chunks.
    pub batch_sizes: Vec<usize>,
    /// Plan (and golden-check) only the smallest bucket in `load`, leaving
    /// the others to `plan_rest`: `serve` does that on a background thread,
    /// so a node is ready in the time one plan per model takes. Until a
    /// bucket is planned, its batches run in chunks on the smaller ones.
    pub defer: bool,
    /// Where each integer layer's kernel choice is kept (`serve`:
    /// `node.state_dir/kernels`); `None` measures on every load.
    pub kernel_cache: Option<KernelCache>,
}

impl RuntimeOptions {
    /// As a node (and the commands that load models as it does) runs them:
    /// kernel choices kept in `state_dir/kernels`, reused when `reuse`.
    pub fn for_node(batch_sizes: &[usize], defer: bool, state_dir: &Path, reuse: bool) -> RuntimeOptions {
        let kernel_cache = Some(KernelCache { dir: state_dir.join("kernels"), reuse });
        RuntimeOptions { batch_sizes: batch_sizes.to_vec(), defer, kernel_cache }
    }
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions { batch_sizes: vec![1, 2, 4, 8, 16, 32], defer: false, kernel_cache: None }
    }
}

/// One batch size and its plan, once built and checked.
struct Bucket {
    size: usize,
    plan: OnceLock<Arc<TypedSimplePlan>>,
}

/// What `plan_rest` needs to build the buckets `load` left out.
struct Deferred {
    typed: TypedModel,
    batch: Symbol,
    golden: Option<(Golden, f64)>,
}

/// One model version, verified and planned, ready to run batches.
pub struct LoadedModel {
    pub manifest: Manifest,
    pub dir: PathBuf,
    buckets: Vec<Bucket>,
    deferred: Mutex<Option<Deferred>>,
    pub kernels: KernelReport,
    /// The load-time graph passes that changed this model.
    pub passes: Vec<super::passes::Applied>,
    /// The kernel each integer layer runs on and what the candidates took.
    pub kernel_choices: Vec<LayerChoice>,
    /// Reading, hashing, parsing, planning and the golden check.
    pub load_time: Duration,
    /// Hex sha256 of `model.toml` as loaded: the preprocessing, labels and
    /// thresholds a version serves with, for the deployment record.
    pub manifest_sha256: String,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.manifest.name)
            .field("version", &self.manifest.version)
            .field("batch_sizes", &self.batch_sizes())
            .finish()
    }
}

/// One output of a run: the first dimension is the batch.
#[derive(Debug, Clone, PartialEq)]
pub struct RawOutput {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

#[derive(Debug, thiserror::Error)]
#[error("model {model} version {version}: {message}")]
pub struct RunError {
    pub model: String,
    pub version: String,
    pub message: String,
}

/// Hex sha256 of `dir/model.toml`.
pub fn manifest_sha256(dir: &Path) -> Result<String, LoadError> {
    let path = dir.join("model.toml");
    let bytes = std::fs::read(&path).map_err(|source| LoadError::Io { path, source })?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

impl LoadedModel {
    /// Loads `dir/model.toml` and refuses the model when its file's sha256 or
    /// its golden vectors do not match.
    pub fn load(dir: &Path, options: &RuntimeOptions) -> Result<LoadedModel, LoadError> {
        let start = Instant::now();
        let manifest = Manifest::read(&dir.join("model.toml"))?;
        let manifest_sha256 = manifest_sha256(dir)?;
        let tract_err = |e: TractError| LoadError::Tract {
            model: manifest.name.clone(),
            version: manifest.version.clone(),
            message: format!("{e:#}"),
        };
        let path = dir.join(&manifest.file);
        let bytes = std::fs::read(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
        let actual = hex::encode(Sha256::digest(&bytes));
        if !actual.eq_ignore_ascii_case(&manifest.sha256) {
            return Err(LoadError::Sha256Mismatch {
                model: manifest.name.clone(),
                version: manifest.version.clone(),
                path,
                expected: manifest.sha256.clone(),
                actual,
            });
        }
        if !manifest.file.ends_with(".onnx") {
            return Err(LoadError::Manifest {
                path: dir.join("model.toml"),
                message: format!("file = {:?}: only ONNX (.onnx) models are supported", manifest.file),
            });
        }
        let read = start.elapsed();
        let mut chooser = Chooser::open(options.kernel_cache.as_ref(), &actual);
        let (typed, batch, passes) = parse_onnx(&manifest, &bytes, &mut chooser).map_err(tract_err)?;
        if let Err(e) = chooser.save() {
            // The choice stands for this run; the next start measures again.
            tracing::warn!("{} {}: could not keep its kernel choices: {e}", manifest.name, manifest.version);
        }
        let parsed = start.elapsed();
        let sizes: Vec<usize> = match manifest.input.shape[0] {
            -1 => options.batch_sizes.clone(),
            fixed => vec![fixed as usize],
        };
        let now = if options.defer { &sizes[..1] } else { &sizes[..] };
        let plans = plan_all(&typed, &batch, now).map_err(tract_err)?;
        let planned = start.elapsed();
        let golden = match &manifest.golden {
            Some(spec) => Some((Golden::read(&dir.join(&spec.file))?, spec.tolerance)),
            None => None,
        };
        let model = LoadedModel {
            kernels: KernelReport::of(plans[0].1.model()),
            manifest,
            dir: dir.to_owned(),
            buckets: sizes.iter().map(|&size| Bucket { size, plan: OnceLock::new() }).collect(),
            deferred: Mutex::new(None),
            passes,
            kernel_choices: chooser.made,
            load_time: Duration::ZERO,
            manifest_sha256,
        };
        for (size, plan) in plans {
            model.admit(size, plan, golden.as_ref())?;
        }
        let mut model = model;
        if now.len() < sizes.len() {
            *model.deferred.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(Deferred { typed, batch, golden });
        }
        model.load_time = start.elapsed();
        if model.manifest.quantization == super::Quantization::Int8 && !model.kernels.runs_integer() {
            tracing::warn!(
                "{} {}: labelled int8, but its optimized plan runs float kernels ({}): tract folds QDQ \
                 graphs back to f32, so expect f32 speed or slower (edgeinfer models profile {})",
                model.name(),
                model.version(),
                model.kernels.float.join(" "),
                model.name()
            );
        }
        tracing::debug!(
            "{} {}: read and hashed in {read:.1?}, parsed in {:.1?}, planned {now:?} in {:.1?}, golden check in {:.1?}",
            model.name(),
            model.version(),
            parsed - read,
            planned - parsed,
            model.load_time - planned
        );
        Ok(model)
    }

    /// Golden-checks a plan and puts it in service.
    fn admit(
        &self,
        size: usize,
        plan: Arc<TypedSimplePlan>,
        golden: Option<&(Golden, f64)>,
    ) -> Result<(), LoadError> {
        if let Some((golden, tolerance)) = golden {
            self.check_golden(size, &plan, golden, *tolerance)?;
        }
        if let Some(bucket) = self.buckets.iter().find(|b| b.size == size) {
            let _ = bucket.plan.set(plan);
        }
        Ok(())
    }

    /// Plans the buckets `load` deferred. A bucket that fails is left
    /// unplanned (its batches keep running on smaller plans) and reported.
    pub fn plan_rest(&self) -> Result<(), LoadError> {
        let Some(d) = self.deferred.lock().unwrap_or_else(|e| e.into_inner()).take() else { return Ok(()) };
        let started = Instant::now();
        let rest: Vec<usize> =
            self.buckets.iter().filter(|b| b.plan.get().is_none()).map(|b| b.size).collect();
        let plans = plan_all(&d.typed, &d.batch, &rest).map_err(|e| LoadError::Tract {
            model: self.manifest.name.clone(),
            version: self.manifest.version.clone(),
            message: format!("{e:#}"),
        })?;
        for (size, plan) in plans {
            self.admit(size, plan, d.golden.as_ref())?;
        }
        tracing::debug!("{} {}: planned {rest:?} in {:.1?}", self.name(), self.version(), started.elapsed());
        Ok(())
    }

    /// The plan of exactly `batch` rows, if one is in service.
    pub(super) fn plan_for(&self, batch: usize) -> Option<&Arc<TypedSimplePlan>> {
        self.buckets.iter().find(|b| b.size == batch)?.plan.get()
    }

    /// Batch sizes with a plan in service now.
    pub fn planned_sizes(&self) -> Vec<usize> {
        self.buckets.iter().filter(|b| b.plan.get().is_some()).map(|b| b.size).collect()
    }

    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    pub fn version(&self) -> &str {
        &self.manifest.version
    }

    /// Every configured batch size, planned or not yet.
    pub fn batch_sizes(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.size).collect()
    }

    pub fn max_batch(&self) -> usize {
        self.buckets.last().map(|b| b.size).unwrap_or(1)
    }

    /// Runs `rows` rows of already preprocessed input (typed as the model's
    /// input datatype), returning every output with exactly `rows` rows.
    pub fn run(&self, rows: usize, input: &TensorData) -> Result<Vec<RawOutput>, RunError> {
        let row_len = self.manifest.input.row_len();
        if input.len() != rows * row_len {
            return Err(self.run_error(format!(
                "input has {} elements, expected {rows} rows of {row_len}",
                input.len()
            )));
        }
        let mut outputs: Vec<RawOutput> = Vec::new();
        let mut done = 0;
        let ready: Vec<(usize, &Arc<TypedSimplePlan>)> =
            self.buckets.iter().filter_map(|b| Some((b.size, b.plan.get()?))).collect();
        while done < rows {
            let left = rows - done;
            let &(bucket, plan) = ready
                .iter()
                .find(|(b, _)| *b >= left)
                .or(ready.last())
                .expect("a loaded model has its smallest bucket planned");
            let take = left.min(bucket);
            let result = self.run_plan(plan, input, done, take, bucket)?;
            for (i, value) in result.iter().enumerate() {
                let (shape, data) = output_rows(value, take).map_err(|e| self.run_error(format!("{e:#}")))?;
                match outputs.get_mut(i) {
                    Some(out) => {
                        out.shape[0] += take;
                        out.data.extend(data).map_err(|e| self.run_error(e))?;
                    }
                    None => outputs.push(RawOutput {
                        name: self.manifest.outputs.get(i).map(|o| o.name.clone()).unwrap_or_default(),
                        shape,
                        data,
                    }),
                }
            }
            done += take;
        }
        Ok(outputs)
    }

    fn run_plan(
        &self,
        plan: &Arc<TypedSimplePlan>,
        input: &TensorData,
        first_row: usize,
        rows: usize,
        bucket: usize,
    ) -> Result<TVec<TValue>, RunError> {
        let tensor = self
            .input_tensor(input, first_row, rows, bucket)
            .map_err(|e| self.run_error(format!("{e:#}")))?;
        plan.run(tvec!(tensor.into())).map_err(|e| self.run_error(format!("{e:#}")))
    }

    pub(super) fn run_error(&self, message: String) -> RunError {
        RunError { model: self.manifest.name.clone(), version: self.manifest.version.clone(), message }
    }

    pub(super) fn input_tensor(
        &self,
        input: &TensorData,
        first_row: usize,
        rows: usize,
        bucket: usize,
    ) -> TractResult<Tensor> {
        let spec = &self.manifest.input;
        let row_len = spec.row_len();
        let mut shape: Vec<usize> = spec.shape.iter().map(|&d| d.max(0) as usize).collect();
        shape[0] = bucket;
        let range = first_row * row_len..(first_row + rows) * row_len;
        macro_rules! padded {
            ($v:expr, $t:ty) => {{
                let mut buf: Vec<$t> = Vec::with_capacity(bucket * row_len);
                buf.extend_from_slice(&$v[range]);
                buf.resize(bucket * row_len, <$t>::default());
                Tensor::from_shape(&shape, &buf)
            }};
        }
        match input {
            TensorData::F32(v) => padded!(v, f32),
            TensorData::F64(v) => padded!(v, f64),
            TensorData::I8(v) => padded!(v, i8),
            TensorData::U8(v) => padded!(v, u8),
            TensorData::I32(v) => padded!(v, i32),
            TensorData::I64(v) => padded!(v, i64),
            TensorData::Number(_) => anyhow::bail!("input was not typed before the run"),
        }
    }

    /// Runs the golden vectors through `plan` (cycled to fill its `batch`
    /// rows) and compares output 0 with the reference.
    fn check_golden(
        &self,
        batch: usize,
        plan: &Arc<TypedSimplePlan>,
        golden: &Golden,
        tolerance: f64,
    ) -> Result<(), LoadError> {
        let spec = &self.manifest.input;
        let refuse = |vector: usize, max_diff: f64| LoadError::Golden {
            model: self.manifest.name.clone(),
            version: self.manifest.version.clone(),
            vector,
            batch,
            max_diff,
            tolerance,
        };
        let mut raw = Vec::with_capacity(batch * spec.row_len());
        for i in 0..batch {
            raw.extend_from_slice(&golden.vectors[i % golden.vectors.len()].input);
        }
        let input = self
            .manifest
            .preprocess
            .apply(TensorData::Number(raw), spec.datatype)
            .map_err(|m| self.golden_error(m))?;
        let outputs =
            self.run_plan(plan, &input, 0, batch, batch).map_err(|e| self.golden_error(e.to_string()))?;
        let (_, first) = output_rows(&outputs[0], batch).map_err(|e| self.golden_error(format!("{e:#}")))?;
        let got = first.to_f64();
        let width = got.len() / batch;
        for row in 0..batch {
            let vector = row % golden.vectors.len();
            let expected = &golden.vectors[vector].expected;
            if expected.len() != width {
                return Err(refuse(vector, f64::INFINITY));
            }
            let max_diff = got[row * width..(row + 1) * width]
                .iter()
                .zip(expected)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            if max_diff.is_nan() || max_diff > tolerance {
                return Err(refuse(vector, max_diff));
            }
        }
        Ok(())
    }

    fn golden_error(&self, message: String) -> LoadError {
        LoadError::Manifest {
            path: self.dir.join("model.toml"),
            message: format!("golden vectors: {message}"),
        }
    }
}

/// One optimized plan per batch size, planned on parallel threads: planning
/// is most of a model's load time and the sizes are independent, so this is
/// what brings a node's start under its budget on a multi-core gateway.
fn plan_all(
    typed: &TypedModel,
    batch: &Symbol,
    sizes: &[usize],
) -> TractResult<Vec<(usize, Arc<TypedSimplePlan>)>> {
    std::thread::scope(|scope| {
        let planning: Vec<_> = sizes
            .iter()
            .map(|&size| {
                scope.spawn(move || {
                    let plan = typed
                        .set_symbols(&HashMap::from([(batch.clone(), TDim::Val(size as i64))]))?
                        .into_optimized()?
                        .into_runnable()?;
                    Ok((size, plan))
                })
            })
            .collect();
        planning
            .into_iter()
            .map(|handle| handle.join().unwrap_or_else(|_| anyhow::bail!("tract panicked while planning")))
            .collect()
    })
}

fn parse_onnx(
    manifest: &Manifest,
    bytes: &[u8],
    chooser: &mut Chooser,
) -> TractResult<(TypedModel, Symbol, Vec<super::passes::Applied>)> {
    let onnx = tract_onnx::onnx().with_ignore_output_shapes(true).with_ignore_value_info(true);
    let proto = onnx.proto_model_for_read(&mut &bytes[..])?;
    let mut model = onnx.model_for_proto_model(&proto)?;
    let batch = model.sym("batch");
    let input_name = &model.node(model.input_outlets()?[0].node).name;
    anyhow::ensure!(
        model.input_outlets()?.len() == 1 && *input_name == manifest.input.name,
        "the model's inputs are {:?}, the manifest declares one input {:?}",
        model.input_outlets()?.iter().map(|o| model.node(o.node).name.clone()).collect::<Vec<_>>(),
        manifest.input.name
    );
    anyhow::ensure!(
        model.output_outlets()?.len() == manifest.outputs.len(),
        "the model has {} outputs, the manifest declares {}",
        model.output_outlets()?.len(),
        manifest.outputs.len()
    );
    let dims: TVec<TDim> = manifest
        .input
        .shape
        .iter()
        .map(|&d| if d == -1 { batch.to_dim() } else { (d as usize).to_dim() })
        .collect();
    model.set_input_fact(0, InferenceFact::dt_shape(datum_type(manifest.input.datatype), dims))?;
    let mut typed = model.into_typed()?;
    let mut applied = super::passes::before_declutter(&mut typed)?;
    // EDGEINFER_INT8_OPS=off leaves quantized patterns on tract's own ops
    // (the "before" column of docs/BENCHMARKS.md, measured in the same
    // build); a list such as `conv,dense` rewrites only those kinds.
    let kinds = super::quant::Kinds::from_env();
    if let Some(graph) = &proto.graph {
        let rewritten = super::quant::rewrite(graph, &*onnx.provider, &mut typed, &kinds, chooser)?;
        if rewritten.total() > 0 {
            applied.push(super::passes::Applied { pass: "int8-ops", nodes: rewritten.total() });
        }
        if rewritten.float_depthwise > 0 {
            applied.push(super::passes::Applied { pass: "f32-depthwise", nodes: rewritten.float_depthwise });
        }
        let [after_depthwise, after_pointwise] = rewritten.channels_last;
        if after_depthwise > 0 {
            applied.push(super::passes::Applied { pass: "int8-channels-last", nodes: after_depthwise });
        }
        if after_pointwise > 0 {
            applied.push(super::passes::Applied {
                pass: "int8-channels-last-pointwise",
                nodes: after_pointwise,
            });
        }
    }
    let mut typed = typed.into_decluttered()?;
    applied.extend(super::passes::after_declutter(&mut typed)?);
    Ok((typed, batch, applied))
}

fn datum_type(datatype: Datatype) -> DatumType {
    match datatype {
        Datatype::Fp32 => DatumType::F32,
        Datatype::Fp64 => DatumType::F64,
        Datatype::Int8 => DatumType::I8,
        Datatype::Uint8 => DatumType::U8,
        Datatype::Int32 => DatumType::I32,
        Datatype::Int64 => DatumType::I64,
    }
}

/// The first `rows` rows of an output, with its shape.
fn output_rows(value: &TValue, rows: usize) -> TractResult<(Vec<usize>, TensorData)> {
    let mut shape = value.shape().to_vec();
    let row_len: usize = shape.iter().skip(1).product();
    shape[0] = rows;
    let n = rows * row_len;
    fn rows_of<D: Datum + Copy>(value: &TValue, n: usize) -> TractResult<Vec<D>> {
        Ok(value.try_as_plain_ram()?.as_slice::<D>()?[..n].to_vec())
    }
    let data = match value.datum_type().unquantized() {
        DatumType::F32 => TensorData::F32(rows_of(value, n)?),
        DatumType::F64 => TensorData::F64(rows_of(value, n)?),
        // Quantized i8/u8 outputs read as their storage type.
        DatumType::I8 => TensorData::I8(rows_of(value, n)?),
        DatumType::U8 => TensorData::U8(rows_of(value, n)?),
        DatumType::I32 => TensorData::I32(rows_of(value, n)?),
        DatumType::I64 => TensorData::I64(rows_of(value, n)?),
        other => {
            let cast = value.cast_to::<f32>()?;
            anyhow::ensure!(cast.len() >= n, "output of type {other:?} has too few elements");
            TensorData::F32(cast.try_as_plain_ram()?.as_slice::<f32>()?[..n].to_vec())
        }
    };
    Ok((shape, data))
}

impl LoadedModel {
    /// Mean wall time per row of `iterations` runs at `batch` rows of zeros,
    /// after one warm-up run: the figure `models verify` prints.
    pub fn time_per_item(&self, batch: usize, iterations: usize) -> Result<Duration, RunError> {
        let input = self.zeros(batch)?;
        self.run(batch, &input)?;
        let start = Instant::now();
        for _ in 0..iterations {
            self.run(batch, &input)?;
        }
        Ok(start.elapsed() / (iterations * batch).max(1) as u32)
    }

    /// Rows per second at `batch` with `threads` threads running the plan
    /// at once for about `duration`: the model's own throughput at
    /// saturation, as `threads_per_model` threads would see it.
    pub fn rows_per_second(&self, batch: usize, threads: usize, duration: Duration) -> Result<f64, RunError> {
        let input = self.zeros(batch)?;
        self.run(batch, &input)?;
        let start = Instant::now();
        let runs = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    scope.spawn(|| {
                        let mut runs = 0u64;
                        while start.elapsed() < duration {
                            self.run(batch, &input)?;
                            runs += 1;
                        }
                        Ok::<u64, RunError>(runs)
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("a timing thread panicked")).sum::<Result<u64, _>>()
        })?;
        Ok((runs * batch as u64) as f64 / start.elapsed().as_secs_f64())
    }
}

impl LoadedModel {
    /// `batch` rows of zeros, preprocessed and typed as the model takes them.
    pub(super) fn zeros(&self, batch: usize) -> Result<TensorData, RunError> {
        let n = batch * self.manifest.input.row_len();
        self.manifest
            .preprocess
            .apply(TensorData::Number(vec![0.0; n]), self.manifest.input.datatype)
            .map_err(|m| self.run_error(m))
    }
}

impl RawOutput {
    /// Rows `first..first + rows` of this output.
    pub fn rows(&self, first: usize, rows: usize) -> RawOutput {
        let row_len: usize = self.shape.iter().skip(1).product();
        let mut shape = self.shape.clone();
        shape[0] = rows;
        RawOutput {
            name: self.name.clone(),
            shape,
            data: self.data.slice(first * row_len..(first + rows) * row_len),
        }
    }
}
