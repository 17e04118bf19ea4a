//! `edgeinfer doctor` on the real binary: a healthy setup passes every
//! check, and each broken thing gets its own FAIL line and exit code 1.

use super::support::{Mosquitto, copy_digits_version, free_port_pair, password_file};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Runs `doctor --json` with the config in `env`; (exit code, checks).
fn doctor(models: &Path, env: &[(&str, String)]) -> (Option<i32>, Vec<Value>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_edgeinfer"));
    cmd.args(["doctor", "--json", "--timeout-ms", "2000", "--models-dir"])
        .arg(models)
        .env_remove("EDGEINFER_CONFIG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(report["ok"], out.status.success(), "{report}");
    (out.status.code(), report["checks"].as_array().unwrap().clone())
}

/// The one line of `check` (the models check may have more: the failing one).
fn line<'a>(checks: &'a [Value], check: &str, status: &str) -> &'a Value {
    checks
        .iter()
        .find(|c| c["check"] == check && c["status"] == status)
        .unwrap_or_else(|| panic!("no {status} line for {check}: {checks:#?}"))
}

#[test]
fn doctor_passes_a_healthy_setup_and_names_each_broken_thing_with_its_fix() {
    let dir = tempfile::tempdir().unwrap();
    let passwords = dir.path().join("passwords");
    if !password_file(&passwords, &[("gw-01", "right")]) {
        return;
    }
    let extra = format!("allow_anonymous false\npassword_file {}\n", passwords.display());
    let Some(broker) = Mosquitto::start_with(free_port_pair(), &extra, |_| {}) else { return };
    let (right, wrong) = (dir.path().join("right.password"), dir.path().join("wrong.password"));
    std::fs::write(&right, "right\n").unwrap();
    std::fs::write(&wrong, "wrong\n").unwrap();
    let state = dir.path().join("state");
    let models = crate::models_dir();
    let healthy = vec![
        ("EDGEINFER_NODE__STATE_DIR", state.display().to_string()),
        ("EDGEINFER_MQTT__URL", broker.url()),
        ("EDGEINFER_MQTT__USERNAME", "gw-01".to_string()),
        ("EDGEINFER_MQTT__PASSWORD_FILE", right.display().to_string()),
    ];
    let with = |key: &'static str, value: String| {
        let mut env: Vec<(&str, String)> = healthy.iter().filter(|(k, _)| *k != key).cloned().collect();
        env.push((key, value));
        env
    };

    let (code, checks) = doctor(&models, &healthy);
    assert_eq!(code, Some(0), "{checks:#?}");
    for check in &checks {
        assert!(check["status"] == "ok" || check["status"] == "skip", "{check}");
    }
    for check in ["config", "models", "state dir", "broker", "clock"] {
        line(&checks, check, "ok");
    }
    let broker_line = line(&checks, "broker", "ok")["detail"].as_str().unwrap().to_string();
    assert!(broker_line.contains("as gw-01") && broker_line.contains("round trip"), "{broker_line}");

    // A wrong password: the login is refused, and the fix names the keys.
    let (code, checks) = doctor(&models, &with("EDGEINFER_MQTT__PASSWORD_FILE", wrong.display().to_string()));
    assert_eq!(code, Some(1));
    let fail = line(&checks, "broker", "fail");
    assert!(fail["detail"].as_str().unwrap().contains("refused the login"), "{fail}");
    assert!(fail["fix"].as_str().unwrap().contains("mqtt.password_file"), "{fail}");

    // The broker down.
    let down = format!("mqtt://127.0.0.1:{}", free_port_pair());
    let (code, checks) = doctor(&models, &with("EDGEINFER_MQTT__URL", down.clone()));
    assert_eq!(code, Some(1));
    let fail = line(&checks, "broker", "fail");
    assert!(fail["detail"].as_str().unwrap().contains(&down), "{fail}");
    assert!(fail["fix"].as_str().unwrap().contains("mqtt.url"), "{fail}");

    // A state directory the node cannot write.
    let readonly = ReadOnlyDir::new();
    let (code, checks) =
        doctor(&models, &with("EDGEINFER_NODE__STATE_DIR", readonly.path().display().to_string()));
    assert_eq!(code, Some(1));
    let fail = line(&checks, "state dir", "fail");
    assert!(fail["detail"].as_str().unwrap().contains("not writable"), "{fail}");

    // A model whose file does not match its sha256; the healthy one still loads.
    let bad_models = tempfile::tempdir().unwrap();
    copy_digits_version(bad_models.path(), "1", false);
    copy_digits_version(bad_models.path(), "2", true);
    let (code, checks) = doctor(bad_models.path(), &healthy);
    assert_eq!(code, Some(1));
    let fail = line(&checks, "models", "fail");
    assert!(
        fail["detail"].as_str().unwrap().contains("sha256") && fail["detail"].as_str().unwrap().contains("2")
    );
    assert!(line(&checks, "models", "ok")["detail"].as_str().unwrap().contains("digits v1"));
    // The other checks still ran.
    line(&checks, "broker", "ok");

    // The text form says the same, a line a check.
    let out = Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .args(["doctor", "--models-dir"])
        .arg(&models)
        .env_remove("EDGEINFER_CONFIG")
        .envs(with("EDGEINFER_MQTT__URL", down).iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1));
    assert!(text.lines().any(|l| l.starts_with("FAIL  broker")) && text.contains("fix: "), "{text}");
    assert!(text.lines().any(|l| l.starts_with("ok    models")), "{text}");
}

/// A directory no process can write to: a read-only tmpfs as root (root
/// writes through permission bits), mode 0555 otherwise.
struct ReadOnlyDir(tempfile::TempDir, bool);

impl ReadOnlyDir {
    fn new() -> ReadOnlyDir {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
        if std::fs::write(dir.path().join("probe"), b"x").is_err() {
            return ReadOnlyDir(dir, false);
        }
        std::fs::remove_file(dir.path().join("probe")).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "ro,size=64k", "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        assert!(mounted, "root, yet a read-only tmpfs could not be mounted");
        ReadOnlyDir(dir, true)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for ReadOnlyDir {
    fn drop(&mut self) {
        if self.1 {
            let _ = Command::new("umount").arg(self.0.path()).status();
        }
    }
}
