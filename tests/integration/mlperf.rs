//! The four MLPerf Tiny reference models, int8 and f32, through edgeinfer's
//! runtime (with its load-time passes), against onnxruntime's and LiteRT's
//! outputs on the 64 shipped inputs.

#[path = "../common/mlperf.rs"]
mod tiny;

use tiny::{MODELS, VARIANTS, argmax};

#[test]
fn every_mlperf_tiny_model_matches_onnxruntime_and_litert() {
    let Some(dir) = tiny::dir() else {
        eprintln!("SKIPPED: ../shared/mlperf-tiny is absent (CI has it)");
        return;
    };
    let mut report = Vec::new();
    for key in MODELS {
        for variant in VARIANTS {
            let case = tiny::load(&dir, key, variant, vec![1, 8]);
            let outputs =
                case.model.run(case.rows, &case.input).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let got = outputs[0].data.to_f64();
            assert_eq!(got.len(), case.onnxruntime.len(), "{}", case.name);
            let max_diff = got.iter().zip(&case.onnxruntime).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            // int8: in LSB of the output; f32: absolute.
            let tolerance = if case.int8 { 8.0 } else { 1e-3 };
            let width = got.len() / case.rows;
            let agree = if case.classifier {
                let (a, b) = (argmax(&got, width), argmax(&case.litert, width));
                a.iter().zip(&b).filter(|(x, y)| x == y).count() as f64 / case.rows as f64
            } else {
                1.0
            };
            report.push(format!(
                "{}: max diff {max_diff:.3e} vs onnxruntime, argmax agreement {agree:.3}",
                case.name
            ));
            assert!(max_diff <= tolerance, "{}: {max_diff} > {tolerance}\n{}", case.name, report.join("\n"));
            assert!(agree >= 0.98, "{}: argmax agreement {agree}\n{}", case.name, report.join("\n"));
        }
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn the_softmax_pass_is_what_makes_the_quantized_classifiers_right() {
    let Some(dir) = tiny::dir() else {
        eprintln!("SKIPPED: ../shared/mlperf-tiny is absent (CI has it)");
        return;
    };
    for key in ["kws", "vww", "ic"] {
        let case = tiny::load(&dir, key, "int8", vec![1]);
        assert!(
            case.model.passes.iter().any(|p| p.pass == "softmax-requantize"),
            "{key}: {:?}",
            case.model.passes
        );
    }
    let ad = tiny::load(&dir, "ad", "int8", vec![1]);
    assert!(ad.model.passes.is_empty(), "the autoencoder has no softmax: {:?}", ad.model.passes);
}

/// kws_int8 served by the real binary over HTTP: `INT8` in, `INT8` out, the
/// same numbers as the runtime gives in process, and the load warning.
#[test]
fn an_int8_model_is_served_with_int8_tensors_and_the_loader_says_it_runs_float() {
    let Some(dir) = tiny::dir() else {
        eprintln!("SKIPPED: ../shared/mlperf-tiny is absent (CI has it)");
        return;
    };
    let case = tiny::load(&dir, "kws", "int8", vec![1, 8]);
    let models = case.models_dir.path().display().to_string();
    let (node, _, port) = crate::mqtt::support::embedded_node_with_http(
        "gw-int8",
        &[("EDGEINFER_NODE__MODELS_DIR", &models), ("EDGEINFER_RUNTIME__BATCH_SIZES", "[1, 8]")],
    );
    let row = 49 * 10;
    let edgeinfer::protocol::TensorData::I8(all) = &case.input else { panic!("kws_int8 takes int8") };
    let req = serde_json::json!({
        "id": "k",
        "inputs": [{"name": case.model.manifest.input.name, "shape": [2, 49, 10, 1], "datatype": "INT8",
                    "data": all[..2 * row]}]
    });
    let post = |body: &serde_json::Value| {
        let path = "/v2/models/kws_int8/infer";
        crate::mqtt::support::http(port, "POST", path, body.to_string().as_bytes(), "application/json")
    };
    let (status, body) = post(&req);
    let reply: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200, "{reply}");
    let out = &reply["outputs"][0];
    assert_eq!(out["datatype"], "INT8", "{reply}");
    assert_eq!(out["shape"], serde_json::json!([2, 12]));
    let got: Vec<f64> = out["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let max_diff = got.iter().zip(&case.onnxruntime[..24]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(max_diff <= 8.0, "served kws_int8 is {max_diff} LSB from onnxruntime: {got:?}");
    // A float input to an INT8 model is refused with the field named.
    let mut wrong = req.clone();
    wrong["inputs"][0]["datatype"] = "FP32".into();
    let (status, body) = post(&wrong);
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("INT8"), "{}", String::from_utf8_lossy(&body));
    let log = node.log.lock().unwrap().join("\n");
    assert!(log.contains("kws_int8 1: labelled int8, but its optimized plan runs float kernels"), "{log}");
}
