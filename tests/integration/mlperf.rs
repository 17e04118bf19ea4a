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
