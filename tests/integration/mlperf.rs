//! The four MLPerf Tiny reference models, int8 and f32, through edgeinfer's
//! runtime (with its load-time passes), against onnxruntime's and LiteRT's
//! outputs on the 64 shipped inputs.

#[path = "../common/mlperf.rs"]
mod tiny;

use tiny::{MODELS, VARIANTS, argmax};

#[test]
fn every_mlperf_tiny_model_matches_onnxruntime_and_litert() {
    let Some(dir) = tiny::dir_or_skip() else { return };
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
    let Some(dir) = tiny::dir_or_skip() else { return };
    for key in ["kws", "vww", "ic"] {
        let case = tiny::load(&dir, key, "int8", vec![1]);
        assert!(
            case.model.passes.iter().any(|p| p.pass == "softmax-requantize"),
            "{key}: {:?}",
            case.model.passes
        );
    }
    let ad = tiny::load(&dir, "ad", "int8", vec![1]);
    assert!(
        ad.model.passes.iter().all(|p| p.pass != "softmax-requantize"),
        "the autoencoder has no softmax: {:?}",
        ad.model.passes
    );
}

/// The load-time rewrite puts every convolution, dense layer, residual add
/// and pooling of ic_int8 (ResNet-8) on our integer ops, and every
/// convolution of kws (DS-CNN) and vww (MobileNet), depthwise ones on
/// `QDepthwise`: no float kernel is left in any of them.
#[test]
fn the_integer_rewrite_covers_every_conv_depthwise_included() {
    let Some(dir) = tiny::dir_or_skip() else { return };
    let ic = tiny::load(&dir, "ic", "int8", vec![1]);
    let count = |ops: &[String], op: &str| ops.iter().filter(|o| o.as_str() == op).count();
    let k = &ic.model.kernels;
    assert!(k.runs_integer() && k.float.is_empty() && k.integer.is_empty(), "{k:?}");
    assert_eq!(
        [
            count(&k.ours, "QConv"),
            count(&k.ours, "QDense"),
            count(&k.ours, "QAdd"),
            count(&k.ours, "QGlobalAvgPool")
        ],
        [9, 1, 3, 1],
        "{k:?}"
    );
    assert!(ic.model.passes.iter().any(|p| p.pass == "int8-ops" && p.nodes == 14), "{:?}", ic.model.passes);
    for (key, pointwise, depthwise) in [("kws", 5, 4), ("vww", 14, 13)] {
        let case = tiny::load(&dir, key, "int8", vec![1]);
        let k = &case.model.kernels;
        assert_eq!(count(&k.ours, "QConv"), pointwise, "{key}: {k:?}");
        assert_eq!(count(&k.ours, "QDepthwise"), depthwise, "{key}: {k:?}");
        assert!(k.runs_integer() && k.float.is_empty() && k.integer.is_empty(), "{key}: {k:?}");
        // Where every convolution runs on the byte tile (the choice is made
        // by timing, and an unoptimized build may time tract's kernels
        // faster), each depthwise layer not on the planar kernel hands its
        // output channels-last to the pointwise layer after it.
        let choices = &case.model.kernel_choices;
        let pass = |name: &str| case.model.passes.iter().find(|p| p.pass == name).map_or(0, |p| p.nodes);
        let handed = pass("int8-channels-last");
        // Back from the pointwise layers (where the host has the
        // channels-in-lanes tile): only those that read channels-last.
        assert!(pass("int8-channels-last-pointwise") <= handed, "{key}: {:?}", case.model.passes);
        let planar = choices.iter().filter(|c| c.name.contains("planar")).count();
        let on_bytes = choices.iter().filter(|c| c.name.contains("u8xs8")).count();
        match on_bytes == pointwise {
            true => assert_eq!(handed, depthwise - planar, "{key}: {choices:?} {:?}", case.model.passes),
            false => assert!(handed <= depthwise - planar, "{key}: {choices:?} {:?}", case.model.passes),
        }
    }
}

/// Kernel choice on a conv net (issue 38, item 1): each pointwise layer
/// times every form of ours the host runs (each byte tile, the i16 tile)
/// against tract-linalg's, each depthwise layer each of its channels-last
/// kernels (and the planar one where it fits); and in `models verify` on
/// the real binary, the forms slowed by a fail point lose every layer to
/// the one left (a byte tile, then with the byte tile slowed the i16 tile).
#[test]
fn every_form_of_ours_is_timed_per_layer_and_a_slowed_one_loses() {
    use edgeinfer::model::Kernel;
    let Some(dir) = tiny::dir_or_skip() else { return };
    let kws = tiny::load(&dir, "kws", "int8", vec![1]);
    let choices = &kws.model.kernel_choices;
    let tiles = edgeinfer::model::quant::udot::TileKernel::available();
    // The convolutions (the dense layer has no byte tile to time).
    let on_bytes =
        |c: &&edgeinfer::model::LayerChoice| c.times.iter().any(|t| matches!(t.0, Kernel::Bytes(_)));
    let conv: Vec<_> = choices.iter().filter(on_bytes).collect();
    assert_eq!(conv.len(), if tiles.is_empty() { 0 } else { 5 }, "{choices:?}");
    for c in &conv {
        assert!(c.times.iter().any(|t| matches!(t.0, Kernel::I16(_))), "{c:?}");
        let timed: Vec<Kernel> = c.times.iter().map(|t| t.0).collect();
        assert!(timed.contains(&Kernel::Tract), "{c:?}");
        for tile in &tiles {
            assert!(timed.contains(&Kernel::Bytes(*tile)), "{tile:?} not timed: {c:?}");
        }
    }
    let depthwise = choices.iter().filter(|c| matches!(c.kernel, Kernel::Depthwise(_)));
    assert_eq!(depthwise.count(), 4, "{choices:?}");

    let state = tempfile::tempdir().unwrap();
    let verify = |slow: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
            .args(["models", "verify", "--iterations", "2"])
            .env_remove("EDGEINFER_CONFIG")
            .env("EDGEINFER_NODE__MODELS_DIR", kws.models_dir.path())
            .env("EDGEINFER_NODE__STATE_DIR", state.path())
            .env("FAILPOINTS", format!("int8_kernel_slow=return({slow})"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
        text
    };
    // "layer NAME: KERNEL (its name) ..., runner-up ..."
    let chosen = |text: &str| -> Vec<(String, String)> {
        let layers = text.lines().filter_map(|l| l.trim_start().strip_prefix("layer "));
        let split = |l: &str| {
            Some((l.split(": ").next()?.to_string(), l.split(": ").nth(1)?.split(' ').next()?.to_string()))
        };
        layers.filter_map(split).collect()
    };
    let plain = chosen(&verify("nothing"));
    assert_eq!(plain.len(), choices.len(), "{plain:?}");
    // Each of two forms (the host's first byte tile and its first i16
    // tile) wins every convolution when all the others are slowed, so each
    // loses when slowed itself.
    let Some(first) = conv.first() else { return };
    let forms: Vec<&str> = first.times.iter().map(|t| t.0.as_str()).collect();
    let i16_form = *forms.iter().find(|f| f.starts_with("i16_")).unwrap();
    let conv_layers: Vec<&str> = conv.iter().map(|c| c.layer.as_str()).collect();
    for target in [forms[0], i16_form] {
        let others: Vec<&str> = forms.iter().copied().filter(|f| *f != target).collect();
        let after = chosen(&verify(&others.join(",")));
        assert_eq!(after.len(), plain.len(), "{after:?}");
        for (layer, kernel) in after.iter().filter(|(l, _)| conv_layers.contains(&l.as_str())) {
            assert_eq!(kernel, target, "{layer} with {others:?} slowed: {after:?}");
        }
        eprintln!("{others:?} slowed: every convolution on {target}");
    }
}

/// The float twins' depthwise layers run on `FDepthwise` (tract's own f32
/// depthwise op was 59% of kws_f32), and the agreement test above holds
/// them within 1e-3 of onnxruntime.
#[test]
fn float_depthwise_layers_run_on_our_op() {
    let Some(dir) = tiny::dir_or_skip() else { return };
    for (key, depthwise) in [("kws", 4), ("vww", 13), ("ic", 0)] {
        let case = tiny::load(&dir, key, "f32", vec![1]);
        let replaced = case.model.passes.iter().find(|p| p.pass == "f32-depthwise").map_or(0, |p| p.nodes);
        assert_eq!(replaced, depthwise, "{key}: {:?}", case.model.passes);
    }
}

/// The three conv nets served by the real binary over HTTP: `INT8` in,
/// `INT8` out, within 8 LSB of onnxruntime, argmax as LiteRT's; none of
/// them draws the load warning for float kernels.
#[test]
fn int8_models_are_served_with_int8_tensors_and_none_runs_float_kernels() {
    let Some(dir) = tiny::dir_or_skip() else { return };
    let cases: Vec<_> =
        ["kws", "vww", "ic"].iter().map(|key| tiny::load(&dir, key, "int8", vec![1, 8])).collect();
    let all = tempfile::tempdir().unwrap();
    for case in &cases {
        std::os::unix::fs::symlink(case.models_dir.path().join(&case.name), all.path().join(&case.name))
            .unwrap();
    }
    let models = all.path().display().to_string();
    let (node, _, port) = crate::mqtt::support::embedded_node_with_http(
        "gw-int8",
        &[("EDGEINFER_NODE__MODELS_DIR", &models), ("EDGEINFER_RUNTIME__BATCH_SIZES", "[1, 8]")],
    );
    for case in &cases {
        let spec = &case.model.manifest.input;
        let row: usize = spec.shape[1..].iter().map(|&d| d as usize).product();
        let width = case.onnxruntime.len() / case.rows;
        let edgeinfer::protocol::TensorData::I8(all) = &case.input else {
            panic!("{} takes int8", case.name)
        };
        let mut shape = vec![2i64];
        shape.extend(&spec.shape[1..]);
        let req = serde_json::json!({
            "id": "k",
            "inputs": [{"name": spec.name, "shape": shape, "datatype": "INT8", "data": all[..2 * row]}]
        });
        let post = |body: &serde_json::Value| {
            let path = format!("/v2/models/{}/infer", case.name);
            crate::mqtt::support::http(port, "POST", &path, body.to_string().as_bytes(), "application/json")
        };
        let (status, body) = post(&req);
        let reply: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status, 200, "{reply}");
        let out = &reply["outputs"][0];
        assert_eq!(out["datatype"], "INT8", "{reply}");
        assert_eq!(out["shape"], serde_json::json!([2, width]));
        let got: Vec<f64> = out["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let reference = &case.onnxruntime[..2 * width];
        let max_diff = got.iter().zip(reference).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(max_diff <= 8.0, "served {} is {max_diff} LSB from onnxruntime: {got:?}", case.name);
        assert_eq!(argmax(&got, width), argmax(&case.litert[..2 * width], width), "{}", case.name);
        if case.name == "kws_int8" {
            // A float input to an INT8 model is refused with the field named.
            let mut wrong = req.clone();
            wrong["inputs"][0]["datatype"] = "FP32".into();
            let (status, body) = post(&wrong);
            assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
            assert!(String::from_utf8_lossy(&body).contains("INT8"), "{}", String::from_utf8_lossy(&body));
        }
    }
    let log = node.log.lock().unwrap().join("\n");
    assert!(log.contains("vww_int8"), "the node logged its models: {log}");
    assert!(!log.contains("labelled int8, but"), "{log}");
}
