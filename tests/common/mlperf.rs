#![allow(dead_code)] // each user (tests, the benchmark) reads a part of it
//! The MLPerf Tiny reference models in `../shared/mlperf-tiny` (test data,
//! never copied here) loaded through edgeinfer's runtime, with their 64
//! inputs and reference outputs. Shared by the tests and the benchmark.

use edgeinfer::model::{LoadedModel, RuntimeOptions};
use edgeinfer::protocol::TensorData;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

pub const MODELS: [&str; 4] = ["kws", "vww", "ic", "ad"];
pub const VARIANTS: [&str; 2] = ["int8", "f32"];

pub fn dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/mlperf-tiny");
    dir.join("README.md").is_file().then_some(dir)
}

/// `dir()` for a test: says SKIPPED where the data is absent, except under
/// `CI=true`, where CI has it and a missing copy must fail the run.
pub fn dir_or_skip() -> Option<PathBuf> {
    let found = dir();
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "../shared/mlperf-tiny is absent, and CI=true requires it"
        );
        eprintln!("SKIPPED: ../shared/mlperf-tiny is absent (CI has it)");
    }
    found
}

pub struct Case {
    pub name: String,
    pub model: LoadedModel,
    /// A models directory holding just this model (NAME/1/model.toml).
    pub models_dir: tempfile::TempDir,
    /// The 64 inputs, as the model takes them.
    pub input: TensorData,
    pub rows: usize,
    pub onnxruntime: Vec<f64>,
    pub litert: Vec<f64>,
    pub int8: bool,
    /// Whether output rows are class scores (not the autoencoder).
    pub classifier: bool,
}

fn npy(path: &std::path::Path) -> (Vec<u64>, TensorData) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = npyz::NpyFile::new(&bytes[..]).unwrap();
    let shape = file.shape().to_vec();
    let data = match file.dtype() {
        npyz::DType::Plain(t) if t.type_char() == npyz::TypeChar::Int && t.size_field() == 1 => {
            TensorData::I8(file.into_vec::<i8>().unwrap())
        }
        _ => TensorData::F32(file.into_vec::<f32>().unwrap()),
    };
    (shape, data)
}

/// `key` (`kws`, `vww`, `ic`, `ad`) in `variant` (`int8`, `f32`), planned
/// for `batch_sizes`, with a manifest written beside it in a temp dir.
pub fn load(dir: &std::path::Path, key: &str, variant: &str, batch_sizes: Vec<usize>) -> Case {
    let name = format!("{key}_{variant}");
    let file = dir.join(format!("{name}.onnx"));
    let bytes = std::fs::read(&file).unwrap();
    let onnx = tract_onnx::onnx();
    use tract_onnx::prelude::*;
    let proto = onnx.model_for_read(&mut &bytes[..]).unwrap();
    let input_name = proto.node(proto.input_outlets().unwrap()[0].node).name.clone();
    let output_name = proto.node(proto.output_outlets().unwrap()[0].node).name.clone();
    let (in_shape, input) = npy(&dir.join(format!("{name}_input.npy")));
    let (out_shape, ort) = npy(&dir.join(format!("{name}_onnxruntime.npy")));
    let (_, litert) = npy(&dir.join(format!("{name}_litert.npy")));
    let int8 = matches!(input, TensorData::I8(_));
    let dt = if int8 { "INT8" } else { "FP32" };
    let dims = |s: &[u64]| {
        std::iter::once("-1".to_string())
            .chain(s[1..].iter().map(|d| d.to_string()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let manifest = format!(
        "name = \"{name}\"\nversion = \"1\"\nfile = \"model.onnx\"\nsha256 = \"{}\"\ntask = \"raw\"\n\
         quantization = \"{}\"\nproduced_by = \"MLPerf Tiny reference, ../shared/mlperf-tiny\"\n\
         [input]\nname = {input_name:?}\ndatatype = \"{dt}\"\nshape = [{}]\n\
         [[outputs]]\nname = {output_name:?}\ndatatype = \"{dt}\"\nshape = [{}]\n",
        hex::encode(Sha256::digest(&bytes)),
        if variant == "int8" { "int8" } else { "f32" },
        dims(&in_shape),
        dims(&out_shape),
    );
    let tmp = tempfile::tempdir().unwrap();
    let version_dir = tmp.path().join(&name).join("1");
    std::fs::create_dir_all(&version_dir).unwrap();
    // A manifest names a file inside its version directory: link the
    // shared model there (it is read, never copied into the repository).
    std::os::unix::fs::symlink(std::path::absolute(&file).unwrap(), version_dir.join("model.onnx")).unwrap();
    std::fs::write(version_dir.join("model.toml"), manifest).unwrap();
    let model =
        LoadedModel::load(&version_dir, &RuntimeOptions { batch_sizes, defer: false, ..Default::default() })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    Case {
        name,
        model,
        models_dir: tmp,
        input,
        rows: in_shape[0] as usize,
        onnxruntime: ort.to_f64(),
        litert: litert.to_f64(),
        int8,
        classifier: key != "ad",
    }
}

/// Index of the largest value of each `width`-wide row.
pub fn argmax(v: &[f64], width: usize) -> Vec<usize> {
    v.chunks(width)
        .map(|r| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap())
        .collect()
}
