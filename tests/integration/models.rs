//! The shipped models through the Rust runtime: accuracy, golden vectors,
//! and refusal of a tampered model while good ones still load.

use crate::{heldout, models_dir};
use edgeinfer::engine::{Engine, EngineOptions, Envelope};
use edgeinfer::model::{LoadError, LoadedModel, Registry, RuntimeOptions};
use edgeinfer::protocol::{InferRequest, InputTensor, TensorData};
use std::path::Path;
use std::sync::Arc;

fn registry() -> Arc<Registry> {
    let registry = Registry::load(&models_dir(), &RuntimeOptions::default()).unwrap();
    assert!(registry.refused.is_empty(), "shipped models refused: {:?}", registry.refused);
    Arc::new(registry)
}

/// Held-out accuracy of `model`, measured through the engine's full pipeline
/// (preprocessing from the manifest, batch plans, postprocessing).
fn accuracy(engine: &Engine, model: &str) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let split = heldout();
    let mut correct = 0;
    for (c, chunk) in split.chunks(32).enumerate() {
        let req = InferRequest {
            id: format!("chunk-{c}"),
            reply_to: None,
            inputs: vec![InputTensor {
                name: "input".into(),
                shape: vec![chunk.len() as i64, 64],
                datatype: "FP32".into(),
                data: TensorData::Number(chunk.iter().flat_map(|(_, px)| px.clone()).collect()),
            }],
            outputs: vec![],
            parameters: Default::default(),
        };
        let resp = rt.block_on(engine.infer(Envelope::model(model), req)).unwrap();
        let probs = resp.outputs[0].data.to_f64();
        for (row, (label, _)) in chunk.iter().enumerate() {
            let p = &probs[row * 10..(row + 1) * 10];
            let argmax = (0..10).max_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap();
            correct += (argmax == *label) as usize;
        }
    }
    correct as f64 / split.len() as f64
}

fn manifest_accuracy(registry: &Registry, model: &str, key: &str) -> f64 {
    let m = registry.get(model, None).unwrap();
    m.manifest.accuracy[key].as_float().unwrap_or_else(|| panic!("{model} manifest has accuracy.{key}"))
}

#[test]
fn int8_accuracy_matches_manifest_and_f32_twin_and_large_is_better() {
    let registry = registry();
    let engine = Engine::new(registry.clone(), EngineOptions::default(), edgeinfer::engine::Cache::off());
    let int8 = accuracy(&engine, "digits");
    let f32_twin = accuracy(&engine, "digits-f32");
    let large = accuracy(&engine, "digits-large");
    println!(
        "held-out accuracy: digits int8 {int8:.4}, digits f32 twin {f32_twin:.4}, digits-large {large:.4}"
    );
    let declared = manifest_accuracy(&registry, "digits", "int8");
    assert!((int8 - declared).abs() <= 0.005, "digits int8 {int8} vs manifest {declared}");
    assert!((int8 - f32_twin).abs() <= 0.01, "digits int8 {int8} vs f32 twin {f32_twin}");
    let declared_twin = manifest_accuracy(&registry, "digits", "f32_twin");
    assert!((f32_twin - declared_twin).abs() <= 0.005, "f32 twin {f32_twin} vs manifest {declared_twin}");
    assert!(large > int8, "digits-large {large} must beat digits {int8}");
}

#[test]
fn shipped_models_pass_golden_vectors_on_every_plan() {
    let registry = registry();
    for name in ["digits", "digits-f32", "digits-large", "digits-small"] {
        let m = registry.get(name, None).unwrap();
        assert_eq!(m.batch_sizes(), vec![1, 2, 4, 8, 16, 32], "{name}");
        assert!(m.manifest.golden.is_some(), "{name} ships golden vectors");
    }
}

#[test]
fn int8_model_runs_integer_kernels_and_f32_runs_float() {
    let registry = registry();
    let digits = registry.get("digits", None).unwrap();
    assert!(digits.kernels.runs_integer(), "digits kernels: {:?}", digits.kernels);
    // Both QLinearMatMul layers run on our integer ops (the load-time rewrite).
    assert_eq!(digits.kernels.ours, vec!["QDense", "QDense"], "{:?}", digits.kernels);
    assert!(digits.passes.iter().any(|p| p.pass == "int8-ops" && p.nodes == 2), "{:?}", digits.passes);
    let twin = registry.get("digits-f32", None).unwrap();
    assert_eq!(twin.kernels.kind(), "float", "{:?}", twin.kernels);
}

#[test]
fn rows_beyond_the_largest_plan_run_in_chunks_with_the_same_answers() {
    let dir = models_dir().join("digits/1");
    let small =
        LoadedModel::load(&dir, &RuntimeOptions { batch_sizes: vec![1, 4], ..Default::default() }).unwrap();
    let big =
        LoadedModel::load(&dir, &RuntimeOptions { batch_sizes: vec![1, 32], ..Default::default() }).unwrap();
    let rows: Vec<f64> = heldout().iter().take(11).flat_map(|(_, px)| px.clone()).collect();
    let input =
        small.manifest.preprocess.apply(TensorData::Number(rows), small.manifest.input.datatype).unwrap();
    let a = small.run(11, &input).unwrap();
    let b = big.run(11, &input).unwrap();
    assert_eq!(a[0].shape, vec![11, 10]);
    let (a, b) = (a[0].data.to_f64(), b[0].data.to_f64());
    assert_eq!(a.len(), 110);
    let max_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(max_diff < 1e-5, "chunked vs padded differ by {max_diff}");
}

#[test]
fn a_deferred_load_serves_on_its_first_plan_and_plans_the_rest_later_with_the_same_answers() {
    let dir = models_dir().join("digits/1");
    let sizes = vec![1, 2, 4, 8];
    let eager = LoadedModel::load(
        &dir,
        &RuntimeOptions { batch_sizes: sizes.clone(), defer: false, ..Default::default() },
    )
    .unwrap();
    let lazy = LoadedModel::load(
        &dir,
        &RuntimeOptions { batch_sizes: sizes.clone(), defer: true, ..Default::default() },
    )
    .unwrap();
    assert_eq!(eager.planned_sizes(), sizes);
    assert_eq!(lazy.planned_sizes(), vec![1], "only the smallest plan before load returns");
    assert_eq!(lazy.batch_sizes(), sizes, "the others are still configured");
    let rows: Vec<f64> = heldout().iter().take(7).flat_map(|(_, px)| px.clone()).collect();
    let input =
        lazy.manifest.preprocess.apply(TensorData::Number(rows), lazy.manifest.input.datatype).unwrap();
    let reference = eager.run(7, &input).unwrap()[0].data.to_f64();
    let close = |got: Vec<f64>| reference.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let before = lazy.run(7, &input).unwrap();
    assert_eq!(before[0].shape, vec![7, 10]);
    assert!(close(before[0].data.to_f64()) < 1e-5, "7 rows on the batch-1 plan");
    lazy.plan_rest().unwrap();
    assert_eq!(lazy.planned_sizes(), sizes);
    assert!(close(lazy.run(7, &input).unwrap()[0].data.to_f64()) < 1e-5, "7 rows on the batch-8 plan");
    lazy.plan_rest().unwrap();
}

fn copy_version(from: &Path, to: &Path, name: &str) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["model.onnx", "golden.json"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
    let manifest = std::fs::read_to_string(from.join("model.toml")).unwrap();
    let manifest = manifest.replace("name = \"digits\"", &format!("name = \"{name}\""));
    std::fs::write(to.join("model.toml"), manifest).unwrap();
}

#[test]
fn tampered_file_and_wrong_golden_outputs_are_refused_while_a_good_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let shipped = models_dir().join("digits/1");
    copy_version(&shipped, &tmp.path().join("digits/1"), "digits");

    let bad_sha = tmp.path().join("bad-sha/1");
    copy_version(&shipped, &bad_sha, "bad-sha");
    let mut bytes = std::fs::read(bad_sha.join("model.onnx")).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(bad_sha.join("model.onnx"), bytes).unwrap();

    let bad_golden = tmp.path().join("bad-golden/1");
    copy_version(&shipped, &bad_golden, "bad-golden");
    let mut golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bad_golden.join("golden.json")).unwrap()).unwrap();
    // Vector 2 now claims class 0 is certain: the model disagrees.
    golden["vectors"][2]["expected"] = serde_json::json!([1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    std::fs::write(bad_golden.join("golden.json"), golden.to_string()).unwrap();

    let registry = Registry::load(tmp.path(), &RuntimeOptions::default()).unwrap();
    assert!(registry.get("digits", None).is_ok(), "the good model still loads");
    assert_eq!(registry.refused.len(), 2, "{:?}", registry.refused);
    let mut saw_sha = false;
    let mut saw_golden = false;
    for r in &registry.refused {
        let text = r.error.to_string();
        match &r.error {
            LoadError::Sha256Mismatch { model, .. } => {
                assert_eq!(model, "bad-sha");
                assert!(text.contains("bad-sha") && text.contains("sha256"), "{text}");
                saw_sha = true;
            }
            LoadError::Golden { model, vector, max_diff, .. } => {
                assert_eq!(model, "bad-golden");
                assert_eq!(*vector, 2);
                assert!(*max_diff > 0.5, "{max_diff}");
                assert!(text.contains("bad-golden") && text.contains("golden vector 2"), "{text}");
                saw_golden = true;
            }
            other => panic!("unexpected refusal {other}"),
        }
    }
    assert!(saw_sha && saw_golden);
    let err = registry.get("bad-sha", None).unwrap_err();
    assert_eq!(err.code, edgeinfer::protocol::ErrorCode::UnknownModel);
}

#[test]
fn manifests_that_point_outside_their_directory_or_sit_in_another_versions_place_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let shipped = models_dir().join("digits/1");
    copy_version(&shipped, &tmp.path().join("digits/1"), "digits");
    let edit = |dir: &str, name: &str, from: &str, to: &str| {
        let dir = tmp.path().join(dir);
        copy_version(&shipped, &dir, name);
        let manifest = std::fs::read_to_string(dir.join("model.toml")).unwrap();
        assert!(manifest.contains(from), "{from} in the shipped manifest");
        std::fs::write(dir.join("model.toml"), manifest.replace(from, to)).unwrap();
    };
    let onnx = shipped.join("model.onnx").display().to_string();
    edit("absolute/1", "absolute", "file = \"model.onnx\"", &format!("file = {onnx:?}"));
    edit("dotdot/1", "dotdot", "file = \"golden.json\"", "file = \"../../digits/1/golden.json\"");
    // A copy of version 1 dropped in as version 7: it must not serve as 7.
    copy_version(&shipped, &tmp.path().join("digits/7"), "digits");
    edit("renamed/1", "digits", "name = \"digits\"", "name = \"digits\"");

    let registry = Registry::load(tmp.path(), &RuntimeOptions::default()).unwrap();
    assert_eq!(registry.versions("digits"), vec!["1".to_string()], "only the version in its own place");
    let refused: Vec<String> = registry.refused.iter().map(|r| r.error.to_string()).collect();
    assert_eq!(refused.len(), 4, "{refused:#?}");
    let says = |needle: &str| refused.iter().filter(|r| r.contains(needle)).count();
    assert_eq!(says("no absolute path, no '..'"), 2, "{refused:#?}");
    assert_eq!(says("but it sits in"), 2, "{refused:#?}");
    assert!(refused.iter().any(|r| r.contains("sits in digits/7/") && r.contains("move it to digits/1/")));
}
