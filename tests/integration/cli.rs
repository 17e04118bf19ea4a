//! The real `edgeinfer` binary, as a user runs it.

use crate::{digits_request, heldout, models_dir};
use serde_json::Value;
use std::io::Write;
use std::process::{Command, Output, Stdio};

pub(crate) fn edgeinfer(args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_edgeinfer"));
    cmd.args(args)
        .arg("--models-dir")
        .arg(models_dir())
        .env_remove("EDGEINFER_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut pipe = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        pipe.write_all(bytes).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

#[test]
fn infer_from_stdin_and_from_a_file() {
    let split = heldout();
    let (label, px) = &split[3];
    let request = digits_request("cli-1", std::slice::from_ref(px)).to_string();
    let out = edgeinfer(
        &["infer", "--model", "digits"],
        Some(request.as_bytes()),
        &[("EDGEINFER_NODE__ID", "gw-test")],
    );
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["id"], "cli-1");
    assert_eq!(reply["model_name"], "digits");
    assert_eq!(reply["parameters"]["label"], label.to_string());
    assert_eq!(reply["parameters"]["node"], "gw-test");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("req.json");
    std::fs::write(&file, &request).unwrap();
    let out = edgeinfer(&["infer", "-m", "digits-large", "--input", file.to_str().unwrap()], None, &[]);
    assert!(out.status.success());
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["model_name"], "digits-large");
    assert_eq!(reply["parameters"]["label"], label.to_string());
}

#[test]
fn infer_error_reply_exits_2() {
    let out = edgeinfer(&["infer", "--model", "digits"], Some(b"{not json"), &[]);
    assert_eq!(out.status.code(), Some(2));
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["parameters"]["code"], "invalid_payload");
}

#[test]
fn models_verify_reports_kernels_and_latency() {
    let out = edgeinfer(&["models", "verify", "--iterations", "5"], None, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let digits = text.split("\ndigits-").next().unwrap();
    assert!(digits.contains("digits 1: ok"), "{text}");
    assert!(digits.contains("kernels: integer (2 on edgeinfer integer ops"), "{text}");
    assert!(digits.contains("load-time pass: int8-ops (2 nodes)"), "{text}");
    assert!(text.contains("digits-large 1: ok"), "{text}");
    assert!(text.contains("us/item"), "{text}");
}

/// Each integer layer's kernels (ours, tract-linalg's) are timed at load
/// and the faster kept: one slowed by a fail point loses on every layer,
/// `models profile` reuses what `models verify` measured, and choices made
/// on another CPU are measured again.
#[cfg(all(feature = "failpoints", target_arch = "x86_64"))]
#[test]
fn kernels_are_chosen_by_measurement_kept_per_cpu_and_a_slowed_one_loses() {
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let run = |args: &[&str], slow: &str| {
        let failpoint = format!("int8_kernel_slow=return({slow})");
        let env = [("EDGEINFER_NODE__STATE_DIR", state_dir), ("FAILPOINTS", failpoint.as_str())];
        let out = edgeinfer(args, None, &env);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
        text
    };
    // A dense layer's candidates: our i16 tiles and tract-linalg's (`ours`
    // slows every form of ours).
    // (With tract-linalg's slowed, the runner-up may be another i16 tile.)
    for (slow, chosen, runner_up) in [("ours", "tract", "i16_"), ("tract", "i16_", "")] {
        let text = run(&["models", "verify", "--iterations", "5"], slow);
        let digits = text.split("\ndigits-").next().unwrap();
        let layers: Vec<&str> = digits.lines().filter(|l| l.trim_start().starts_with("layer ")).collect();
        assert_eq!(layers.len(), 2, "{text}");
        for layer in layers {
            assert!(layer.contains(&format!(": {chosen}")), "{slow} slowed: {layer}");
            assert!(layer.contains(&format!("runner-up {runner_up}")), "{slow} slowed: {layer}");
            assert!(!layer.contains("earlier start"), "verify measures again: {layer}");
        }
    }
    // The last verify kept the i16 tile; a profile with ours slowed reuses it.
    let profile = |slow| run(&["models", "profile", "digits", "--iterations", "5"], slow);
    let rows =
        |text: &str| text.lines().filter(|l| l.contains("edgeinfer.QDense")).map(str::to_owned).collect();
    let reused: Vec<String> = rows(&profile("ours"));
    assert_eq!(reused.len(), 2, "{reused:?}");
    assert!(
        reused.iter().all(|r| r.contains("[i16_") && r.contains("measured at an earlier start")),
        "{reused:?}"
    );
    // The same file from another CPU: measured again, so the slowed kernel loses.
    for entry in std::fs::read_dir(state.path().join("kernels")).unwrap() {
        let path = entry.unwrap().path();
        let mut cache: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        cache["signature"] = "x86_64 AnotherCPU family 25 model 97".into();
        std::fs::write(&path, serde_json::to_vec(&cache).unwrap()).unwrap();
    }
    let remeasured: Vec<String> = rows(&profile("ours"));
    assert!(
        remeasured.iter().all(|r| r.contains("[tract (") && !r.contains("earlier start")),
        "{remeasured:?}"
    );
}

/// `models compare` on the held-out split: the accuracies it measures are
/// the manifests', the kernels are what `models verify` reports, and the
/// recommendation is the fastest candidate that meets the constraint.
#[test]
fn models_compare_recommends_the_fastest_model_that_is_accurate_enough() {
    let data = models_dir().join("heldout/digits.csv");
    let compare_on = |data: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["models", "compare", "--data", data.to_str().unwrap(), "--passes", "1"];
        args.extend_from_slice(extra);
        edgeinfer(&args, None, &[])
    };
    let compare = |extra: &[&str]| compare_on(&data, extra);
    let out = compare(&["--min-accuracy", "0.96", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["rows"], 360);
    let candidates = report["candidates"].as_array().unwrap();
    let ids: Vec<String> =
        candidates.iter().map(|c| format!("{}:{}", c["model"], c["version"]).replace('"', "")).collect();
    assert_eq!(ids, ["digits:1", "digits-f32:1", "digits-large:1", "digits-small:1"], "{text}");
    for c in candidates {
        let (measured, manifest) =
            (c["accuracy"].as_f64().unwrap(), c["manifest_accuracy"].as_f64().unwrap());
        assert!(
            (measured - manifest).abs() < 1e-4,
            "{}: {measured} against the manifest's {manifest}",
            c["model"]
        );
        assert!(c["latency"]["p50_us"].as_f64().unwrap() > 0.0);
        assert!(c["latency"]["p99_us"].as_f64().unwrap() >= c["latency"]["p50_us"].as_f64().unwrap());
        assert_eq!(c["latency"]["percentiles_us"].as_array().unwrap().len(), 100);
        assert_eq!(c["top_k"], 3);
        assert!(c["top_k_accuracy"].as_f64().unwrap() >= measured, "{c}");
        for figure in
            ["rows_per_s_one_thread", "rows_per_s_all_threads", "per_row_us_at_best_batch", "load_ms"]
        {
            assert!(c[figure].as_f64().unwrap() > 0.0, "{figure}: {c}");
        }
        assert!(c["threads"].as_u64().unwrap() >= 1);
        if let Some(peak) = c["peak_rss_bytes"].as_u64() {
            assert!(peak > 4 << 20, "a process with three models resident: {peak}");
        }
    }
    // The kernels are the ones `models verify` reports for each model.
    let verify = edgeinfer(&["models", "verify"], None, &[]);
    let verify = String::from_utf8_lossy(&verify.stdout);
    let kinds: Vec<&str> = verify
        .lines()
        .filter_map(|l| l.trim().strip_prefix("kernels: ")?.split_whitespace().next())
        .collect();
    let compared: Vec<&str> = candidates.iter().map(|c| c["kernels"].as_str().unwrap()).collect();
    assert_eq!(compared, kinds, "{verify}");
    assert_eq!(compared, ["integer", "float", "float", "integer"]);
    let chosen = report["recommendation"]["chosen"].as_str().unwrap();
    let chosen = candidates
        .iter()
        .find(|c| format!("{}:{}", c["model"].as_str().unwrap(), c["version"].as_str().unwrap()) == chosen)
        .unwrap();
    assert!(chosen["accuracy"].as_f64().unwrap() >= 0.96);
    let p50 = |c: &Value| c["latency"]["p50_us"].as_f64().unwrap();
    assert!(
        candidates.iter().filter(|c| c["accuracy"].as_f64().unwrap() >= 0.96).all(|c| p50(chosen) <= p50(c)),
        "{text}"
    );
    assert_eq!(report["recommendation"]["rejected"].as_array().unwrap().len(), 3);
    // The narrow model is the one too inaccurate for 0.96.
    let rejected = report["recommendation"]["rejected"].to_string();
    assert!(
        rejected.contains("digits-small:1\",\"accuracy 0.9417 is below --min-accuracy 0.96"),
        "{rejected}"
    );

    // Only the large model reaches 0.98; the table names why the others lost.
    let out = compare(&["--min-accuracy", "0.98"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("recommended: digits-large:1"), "{text}");
    assert!(text.contains("not digits:1: accuracy 0.9694 is below --min-accuracy 0.98"), "{text}");

    // Nothing reaches 0.999: no recommendation, exit 1.
    let out = compare(&["--min-accuracy", "0.999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no recommendation"));

    let out = compare(&["nosuch", "--min-accuracy", "0.5"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nosuch is not a loaded model version; loaded: digits:1"), "{err}");

    // The same rows without their labels: judged against the largest
    // candidate, the fastest that answers at most 5% of rows differently.
    let dir = tempfile::tempdir().unwrap();
    let unlabelled = dir.path().join("unlabelled.csv");
    let rows: String = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!(",{}\n", l.split_once(',').unwrap().1))
        .collect();
    std::fs::write(&unlabelled, rows).unwrap();
    let out = compare_on(&unlabelled, &["--max-agreement-loss", "0.05", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["labelled_rows"].as_u64(), report["reference"].as_str()),
        (Some(0), Some("digits-large:1"))
    );
    let candidates = report["candidates"].as_array().unwrap();
    let agreement = |i: usize| candidates[i]["agreement"].as_f64().unwrap();
    assert!(candidates.iter().all(|c| c["accuracy"].is_null()), "{text}");
    assert_eq!(agreement(2), 1.0, "the reference agrees with itself");
    // Both small models are right on 96.9% of the rows and the large one on
    // 98.9%, so they agree with it on at least 95.8%.
    assert!(agreement(0) >= 0.958 && agreement(0) < 1.0, "{text}");
    let chosen = report["recommendation"]["chosen"].as_str().unwrap();
    let chosen = candidates.iter().find(|c| format!("{}:1", c["model"].as_str().unwrap()) == chosen).unwrap();
    assert!(chosen["agreement"].as_f64().unwrap() >= 0.95);
    let close_enough = |c: &&Value| c["agreement"].as_f64().unwrap() >= 0.95;
    assert!(candidates.iter().filter(close_enough).all(|c| p50(chosen) <= p50(c)), "{text}");

    let out = compare_on(&unlabelled, &["--min-accuracy", "0.9"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no labels") && err.contains("--max-agreement-loss"), "{err}");
}

#[test]
fn models_list_shows_every_shipped_model() {
    let out = edgeinfer(&["models", "list"], None, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for m in ["digits ", "digits-f32", "digits-large", "digits-small"] {
        assert!(text.contains(m), "{text}");
    }
}

#[test]
fn config_mistakes_name_the_key_the_value_and_what_is_allowed() {
    let out = edgeinfer(&["models", "list"], None, &[("EDGEINFER_MQTT__URL", "http://10.0.0.5")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("mqtt.url") && err.contains("http://10.0.0.5") && err.contains("mqtt://"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edgeinfer.toml");
    std::fs::write(&file, "[mqtt]\nurll = \"mqtt://x:1883\"\n").unwrap();
    let out = edgeinfer(&["--config", file.to_str().unwrap(), "models", "list"], None, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("mqtt") && err.contains("urll") && err.contains("url"), "{err}");

    std::fs::write(&file, "[runtime]\nbatch_sizes = [8, 1]\n").unwrap();
    let out = edgeinfer(&["--config", file.to_str().unwrap(), "models", "list"], None, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("runtime.batch_sizes") && err.contains("[8, 1]") && err.contains("ascending"),
        "{err}"
    );
}

#[test]
fn config_check_reports_every_mistake_at_once_and_print_redacts_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edgeinfer.toml");
    std::fs::write(
        &file,
        "[mqtt]\nurl = \"http://broker:1883\"\nkeep_alive_s = \"thirty\"\n\
         [runtime]\nthreads_per_model = 0\n[capture]\nrate = 2.0\n",
    )
    .unwrap();
    let out = edgeinfer(&["config", "check", file.to_str().unwrap()], None, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("4 mistakes"), "{text}");
    for (key, value, allowed) in [
        ("mqtt.url", "http://broker:1883", "mqtt://HOST:PORT"),
        ("mqtt.keep_alive_s", "thirty", "u16"),
        ("runtime.threads_per_model", "0", "1 to 64"),
        ("capture.rate", "2", "0 to 1"),
    ] {
        let line = text.lines().find(|l| l.trim_start().starts_with(&format!("{key}:"))).unwrap_or_default();
        assert!(line.contains(value) && line.contains(allowed), "{key}: {text}");
    }
    // Fixed, the same file passes; the environment overrides count as for serve.
    std::fs::write(&file, "[mqtt]\nurl = \"mqtt://broker:1883\"\n").unwrap();
    let out = edgeinfer(&["config", "check", file.to_str().unwrap()], None, &[]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains(": ok"));
    let out = edgeinfer(
        &["config", "check", file.to_str().unwrap()],
        None,
        &[("EDGEINFER_HTTP__LISTEN", "nowhere")],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("http.listen"));

    let out = edgeinfer(
        &["--config", file.to_str().unwrap(), "config", "print"],
        None,
        &[("EDGEINFER_MQTT__PASSWORD", "hunter2"), ("EDGEINFER_NODE__ID", "gw-print")],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains("hunter2") && text.contains("password = \"<redacted>\""), "{text}");
    // What it prints is a config that reads back to the same thing.
    let printed = dir.path().join("printed.toml");
    std::fs::write(&printed, text.replace("\"<redacted>\"", "\"x\"").as_bytes()).unwrap();
    let out = edgeinfer(&["config", "check", printed.to_str().unwrap()], None, &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(text.contains("id = \"gw-print\"") && text.contains("url = \"mqtt://broker:1883\""), "{text}");
}

/// Every command's --help is walked by `man_pages_and_help_cover_every_command`.
#[test]
fn help_and_version() {
    let out = edgeinfer(&["infer", "--help"], None, &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("--model"));
    let out = edgeinfer(&["--version"], None, &[]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("edgeinfer {}", env!("CARGO_PKG_VERSION"))
    );
}

/// The man pages name every command there is, so this walks all of them:
/// each has a page and a complete --help, and the page says what --help says.
#[test]
fn man_pages_and_help_cover_every_command() {
    let dir = tempfile::tempdir().unwrap();
    // A shared man1 directory: another program's page is not ours to list.
    std::fs::write(dir.path().join("mosquitto.1"), ".TH mosquitto 1").unwrap();
    let out = edgeinfer(&["manpages", dir.path().to_str().unwrap()], None, &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("mosquitto.1"));
    let mut pages: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name != "mosquitto.1")
        .collect();
    pages.sort();
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), pages.len());
    for expected in ["edgeinfer.1", "edgeinfer-serve.1", "edgeinfer-models-verify.1", "edgeinfer-doctor.1"] {
        assert!(pages.iter().any(|p| p == expected), "{expected} missing from {pages:?}");
    }
    for page in &pages {
        let words: Vec<&str> = page.trim_end_matches(".1").split('-').skip(1).collect();
        // A command's own name may hold a dash (`models ab-report`): each
        // level takes the fewest words that name a command.
        let mut commands: Vec<String> = Vec::new();
        let mut at = 0;
        while at < words.len() {
            let next = (at + 1..=words.len())
                .find(|&end| {
                    let mut args: Vec<String> = commands.clone();
                    args.extend([words[at..end].join("-"), "--help".into()]);
                    edgeinfer(&args.iter().map(String::as_str).collect::<Vec<_>>(), None, &[])
                        .status
                        .success()
                })
                .unwrap_or_else(|| panic!("{page}: no command named by {:?}", &words[at..]));
            commands.push(words[at..next].join("-"));
            at = next;
        }
        let mut args: Vec<&str> = commands.iter().map(String::as_str).collect();
        args.push("--help");
        let help = edgeinfer(&args, None, &[]);
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(help.status.success(), "{args:?}");
        assert!(text.contains("Usage:") && text.contains("--config"), "{args:?}: {text}");
        let about = text.lines().next().unwrap().trim_end_matches('.');
        let roff = std::fs::read_to_string(dir.path().join(page)).unwrap();
        let roff_text = roff.replace("\\-", "-").replace("\\(aq", "'");
        assert!(
            roff.starts_with(".ie") || roff.starts_with(".TH"),
            "{page} is not a man page: {}",
            &roff[..roff.len().min(80)]
        );
        let first_words: String = about.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
        assert!(
            roff_text.split_whitespace().collect::<Vec<_>>().join(" ").contains(&first_words),
            "{page} does not say {first_words:?}"
        );
    }
}

/// The bash completion script completes the commands and their options.
#[test]
fn bash_completion_completes_commands_and_options() {
    let out = edgeinfer(&["completions", "bash"], None, &[]);
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("edgeinfer.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    let complete = |words: &str, cword: usize| {
        let probe = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD={cword}; COMP_LINE='{words}'; COMP_POINT=${{#COMP_LINE}}; \
             _edgeinfer edgeinfer \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display()
        );
        let out = Command::new("bash").arg("-c").arg(probe).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect::<Vec<_>>()
    };
    assert_eq!(complete("edgeinfer mod", 1), ["models"]);
    let verify = complete("edgeinfer models verify --it", 3);
    assert_eq!(verify, ["--iterations"]);
    for shell in ["zsh", "fish"] {
        let out = edgeinfer(&["completions", shell], None, &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("doctor") && text.contains("models-dir"),
            "{shell}: {text}"
        );
    }
}

#[test]
fn models_profile_reports_kernels_and_our_integer_ops_by_node() {
    let out = edgeinfer(&["models", "profile", "digits", "--iterations", "5"], None, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("kernels: integer (2 on edgeinfer integer ops, 0 on tract"), "{text}");
    assert_eq!(text.matches("edgeinfer.QDense").count(), 2, "{text}");
}

#[test]
fn models_compare_writes_a_report_that_chromium_renders_with_its_charts_and_recommendation() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report");
    let data = models_dir().join("heldout/digits.csv");
    let args = ["models", "compare", "--data", data.to_str().unwrap(), "--passes", "1"];
    let out = edgeinfer(
        &[&args[..], &["--min-accuracy", "0.96", "--json", "--report", report.to_str().unwrap()]].concat(),
        None,
        &[],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let chosen = json["recommendation"]["chosen"].as_str().unwrap().to_string();
    let page = std::fs::read_to_string(report.join("index.html")).unwrap();
    // Self-contained: nothing for the browser to fetch.
    for outside in ["<script", "<link", " src=", "<img", "url("] {
        assert!(!page.contains(outside), "the report refers to an outside file ({outside})");
    }
    let section =
        page.split("<section id=\"recommendation\">").nth(1).unwrap().split("</section>").next().unwrap();
    assert!(section.contains(&format!("<strong>{chosen}</strong>")), "{section}");
    assert!(section.contains("not digits-large:1: meets the constraints but costs more"), "{section}");
    assert_eq!(page.matches("<svg").count(), 2, "two charts");
    for id in ["digits:1", "digits-f32:1", "digits-large:1", "digits-small:1", "Pareto front", "recommended"]
    {
        assert!(page.contains(id), "no {id} in the page");
    }

    let Some(chromium) = crate::chromium() else {
        return crate::skipped(
            "chromium is not installed (apt-get install chromium): the report is not rendered",
        );
    };
    let url = format!("file://{}", report.join("index.html").display());
    let profile = dir.path().join("profile");
    // The page as Chromium parsed it: both charts are in its DOM.
    let dom = crate::headless(&chromium, &profile, &["--dump-dom"], &url);
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert_eq!(dom.matches("<svg").count(), 2, "{dom}");
    assert!(dom.contains("<circle"), "the scatter's points");
    // The screenshot shows them: the recommendation's green band, the
    // Pareto front's blue line and the green ring round the chosen model.
    let shot = dir.path().join("report.png");
    crate::headless(
        &chromium,
        &profile,
        &["--window-size=1100,1500", "--hide-scrollbars", &format!("--screenshot={}", shot.display())],
        &url,
    );
    let mut decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    decoder.set_transformations(png::Transformations::EXPAND);
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size()];
    let frame = reader.next_frame(&mut pixels).unwrap();
    assert_eq!((frame.width, frame.height), (1100, 1500));
    let step = frame.color_type.samples();
    let count = |rgb: [u8; 3]| pixels[..frame.buffer_size()].chunks(step).filter(|p| p[..3] == rgb).count();
    let (band, front, ring) = (count([0xe6, 0xf4, 0xea]), count([0, 0, 255]), count([0, 255, 0]));
    assert!(band > 5_000, "the recommendation's band: {band} pixels");
    assert!(front > 100, "the Pareto front: {front} pixels");
    assert!(ring > 30, "the recommended model's ring: {ring} pixels");
    let white = count([255, 255, 255]);
    assert!(white < 1100 * 1500 * 9 / 10, "the page is mostly blank: {white} white pixels");
}
