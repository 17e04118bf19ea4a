//! A rollout when things go wrong, on the real binary: a reload or a restart
//! that finds new versions with `auto_rollout` on, a state disk that
//! refuses writes or hangs, a version `models rollout` names before any
//! reload loaded it. Each test is named after the finding of issue 35 it
//! guards.

use super::support::{Client, Node, copy_digits_version, embedded_node_with_http, http_with};
use crate::{digits_request, heldout};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

const ADMIN_TOKEN: &str = "admin-Secret-35";

/// Env for a node on `models` and `state`, with `auto_rollout = canary`
/// (steps that never bake in a test) and an admin token in `state`.
fn auto_env(models: &Path, state: &Path) -> Vec<(&'static str, String)> {
    let token = state.join("admin.token");
    std::fs::write(&token, format!("{ADMIN_TOKEN}\n")).unwrap();
    vec![
        ("EDGEINFER_NODE__MODELS_DIR", models.display().to_string()),
        ("EDGEINFER_NODE__STATE_DIR", state.display().to_string()),
        ("EDGEINFER_HTTP__ADMIN_TOKEN_FILE", token.display().to_string()),
        ("EDGEINFER_MODELS__DIGITS__AUTO_ROLLOUT", "canary".into()),
        ("EDGEINFER_MODELS__DIGITS__ROLLOUT__BAKE_S", "3600".into()),
    ]
}

fn start(id: &'static str, env: Vec<(&'static str, String)>) -> (Node, u16, u16) {
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    embedded_node_with_http(id, &pairs)
}

async fn status(port: u16) -> Value {
    let (code, body) = tokio::task::spawn_blocking(move || {
        let auth = format!("Authorization: Bearer {ADMIN_TOKEN}");
        http_with(port, "GET", "/models/status?model=digits", auth.as_bytes(), b"")
    })
    .await
    .unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(code, 200, "{body}");
    body[0].clone()
}

fn state_file(state: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(state.join("deployments.json")).unwrap()).unwrap()
}

/// The version that answers one digits request over HTTP.
fn answered_by(port: u16, device: &str) -> String {
    let body = digits_request("", &[heldout()[0].1.clone()]).to_string();
    let headers = format!("Content-Type: application/json\r\nX-Device-Id: {device}");
    let (code, reply) =
        http_with(port, "POST", "/v2/models/digits/infer", headers.as_bytes(), body.as_bytes());
    let reply: Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(code, 200, "{reply}");
    reply["model_version"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_1_a_reload_finding_two_new_versions_pins_the_one_that_served_never_an_untried_one() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    let env = auto_env(models.path(), state.path());
    let (node, _, port) = tokio::task::spawn_blocking(move || start("gw-f1a", env)).await.unwrap();
    copy_digits_version(models.path(), "2", false);
    copy_digits_version(models.path(), "3", false);
    node.signal("HUP");
    node.wait_for_line("reloaded", Duration::from_secs(30));
    let report = status(port).await;
    assert_eq!(report["stable"], "1", "v2 never served or passed a gate: {report:#}");
    assert_eq!(report["candidate"]["version"], "3", "{report:#}");
    assert_eq!(report["previous"], "1", "a rollback returns to what served: {report:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_1_a_restart_that_finds_a_new_version_starts_its_rollout_against_the_one_that_served() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    let env = auto_env(models.path(), state.path());
    let again = env.clone();
    let (mut node, _, port) = tokio::task::spawn_blocking(move || start("gw-f1b", env)).await.unwrap();
    assert_eq!(status(port).await["stable"], "1", "the first start pins what serves");
    assert!(node.terminate().success());
    // Dropped in while the node was down (an image update, a reboot).
    copy_digits_version(models.path(), "2", false);
    let (_node, _, port) = tokio::task::spawn_blocking(move || start("gw-f1b", again)).await.unwrap();
    let report = status(port).await;
    assert_eq!((report["stable"].as_str(), report["serving"].as_str()), (Some("1"), Some("1")), "{report:#}");
    assert_eq!(report["candidate"]["version"], "2", "{report:#}");
    let started = report["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        (started["action"].as_str(), started["by"].as_str()),
        (Some("started"), Some("auto_rollout (start)"))
    );
    // A device outside the 5% step stays on v1.
    let on_v1 = (0..40).filter(|i| answered_by(port, &format!("dev-{i}")) == "1").count();
    assert!(on_v1 >= 30, "{on_v1} of 40 devices on v1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_1_a_reload_whose_rollout_cannot_start_is_refused_whole() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    // auto_rollout comes on with the reload (nothing pinned before it).
    let config = state.path().join("edgeinfer.toml");
    std::fs::write(&config, "").unwrap();
    let mut env = auto_env(models.path(), state.path());
    env.retain(|(k, _)| !k.starts_with("EDGEINFER_MODELS__"));
    env.push(("EDGEINFER_CONFIG", config.display().to_string()));
    let (node, mqtt, port) = tokio::task::spawn_blocking(move || start("gw-f1c", env)).await.unwrap();
    std::fs::write(
        &config,
        "[models.digits]\nauto_rollout = \"canary\"\n[models.digits.rollout]\nbake_s = 3600\n",
    )
    .unwrap();
    // The state disk refuses the write: the new file's name is taken.
    let blocker = state.path().join("deployments.json.new");
    std::fs::create_dir(&blocker).unwrap();
    copy_digits_version(models.path(), "2", false);
    node.signal("HUP");
    node.wait_for_line("reload refused", Duration::from_secs(30));
    let report = status(port).await;
    assert_eq!(report["versions"], serde_json::json!(["1"]), "nothing swapped in: {report:#}");
    assert_eq!(report["serving"], "1", "{report:#}");
    let mut watcher = Client::connect(mqtt, "watch-f1c", &["edgeinfer/gw-f1c/status"]).await;
    let (_, retained) = watcher.next_json().await;
    let why = retained["reload_error"].as_str().unwrap_or_else(|| panic!("{retained}"));
    assert!(why.contains("auto rollout cannot start"), "{why}");
    // Once the disk takes writes, the same reload starts the rollout.
    std::fs::remove_dir(&blocker).unwrap();
    node.signal("HUP");
    node.wait_for_line("reloaded", Duration::from_secs(30));
    let report = status(port).await;
    assert_eq!((report["stable"].as_str(), report["candidate"]["version"].as_str()), (Some("1"), Some("2")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_3_a_rollback_takes_effect_when_the_state_disk_refuses_it_and_is_saved_once_it_can() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    // A canary at 100%, set up with no node running.
    super::rollout::models_command(models.path(), state.path(), &["promote", "digits", "1"]).unwrap();
    let args = ["rollout", "digits", "2", "--steps", "100", "--gates", "bake_s=3600"];
    super::rollout::models_command(models.path(), state.path(), &args).unwrap();
    let mut env = auto_env(models.path(), state.path());
    env.retain(|(k, _)| !k.starts_with("EDGEINFER_MODELS__"));
    let (mut node, _, port) = tokio::task::spawn_blocking(move || start("gw-f3", env)).await.unwrap();
    assert_eq!(tokio::task::spawn_blocking(move || answered_by(port, "d1")).await.unwrap(), "2");

    let blocker = state.path().join("deployments.json.new");
    std::fs::create_dir(&blocker).unwrap();
    let asked = Instant::now();
    let (code, body) = tokio::task::spawn_blocking(move || {
        let auth = format!("Authorization: Bearer {ADMIN_TOKEN}");
        http_with(port, "POST", "/models/rollback?model=digits", auth.as_bytes(), b"")
    })
    .await
    .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    assert!(asked.elapsed() < Duration::from_secs(2), "{:?}", asked.elapsed());
    // In service at once, marked unsaved; the disk still has the rollout.
    assert_eq!(tokio::task::spawn_blocking(move || answered_by(port, "d1")).await.unwrap(), "1");
    let report = status(port).await;
    assert!(report["candidate"].is_null() && report["stable"] == "1", "{report:#}");
    let unsaved = report["unsaved"].as_str().unwrap_or_else(|| panic!("{report:#}"));
    assert!(unsaved.contains("rolled_back"), "{unsaved}");
    assert_eq!(state_file(state.path())["models"]["digits"]["candidate"]["version"], "2");
    // A decision that widens a share waits for the disk: refused meanwhile.
    let (code, _) = tokio::task::spawn_blocking(move || {
        let auth = format!("Authorization: Bearer {ADMIN_TOKEN}");
        http_with(port, "POST", "/models/rollout?model=digits&version=2", auth.as_bytes(), b"")
    })
    .await
    .unwrap();
    assert_eq!(code, 500, "a rollout is not started without the disk");

    // The disk takes writes again: saved within a second or two.
    std::fs::remove_dir(&blocker).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while status(port).await["unsaved"].is_string() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(status(port).await["unsaved"].is_null(), "still unsaved after 10 s");
    assert!(state_file(state.path())["models"]["digits"]["candidate"].is_null());
    node.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_10_a_control_command_on_a_hung_state_disk_is_answered_in_bounded_time_and_inference_goes_on()
{
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    let mut env = auto_env(models.path(), state.path());
    env.retain(|(k, _)| !k.starts_with("EDGEINFER_MODELS__"));
    env.extend(super::control::control_env(state.path()));
    // Every save of the deployment state hangs for 15 s.
    env.push(("FAILPOINTS", "rollout_save=sleep(15000)".to_string()));
    let (_node, mqtt, _) = tokio::task::spawn_blocking(move || start("gw-f10", env)).await.unwrap();
    let mut fleet = Client::connect(mqtt, "fleet-f10", &["fleet/replies", "f10/+/replies"]).await;
    let command = super::control::signed(
        "edgeinfer/gw-f10/control",
        serde_json::json!({"id": "h1", "command": "rollback", "model": "digits"}),
    );
    let asked = Instant::now();
    fleet
        .request("edgeinfer/gw-f10/control", command.to_string().into_bytes(), "fleet/replies", b"c", None)
        .await;
    // Requests sent behind it are answered while the disk hangs.
    for i in 0..5 {
        let request = digits_request(&format!("r{i}"), &[heldout()[i].1.clone()]).to_string();
        let reply_to = format!("f10/dev{i}/replies");
        fleet.request("edgeinfer/gw-f10/infer/digits", request.into_bytes(), &reply_to, b"", None).await;
    }
    let (mut answers, mut control) = (0, None);
    while (answers < 5 || control.is_none()) && asked.elapsed() < Duration::from_secs(12) {
        let Some(publish) = fleet.next(Duration::from_secs(1)).await else { continue };
        let reply: Value = serde_json::from_slice(&publish.payload).unwrap();
        if publish.topic == "fleet/replies" {
            control = Some((asked.elapsed(), reply));
        } else {
            assert!(reply.get("error").is_none(), "{reply}");
            assert!(
                asked.elapsed() < Duration::from_secs(4),
                "inference waited on the disk: {:?}",
                asked.elapsed()
            );
            answers += 1;
        }
    }
    assert_eq!(answers, 5, "every request behind the command answered");
    let (after, reply) = control.expect("the control command answered within 12 s");
    assert!(after < Duration::from_secs(8), "answered after {after:?}");
    assert_eq!(reply["error"]["code"], "overloaded", "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains("state disk"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_12_models_rollout_loads_a_version_dropped_in_since_the_last_load_and_refuses_a_broken_one() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    let mut env = auto_env(models.path(), state.path());
    env.retain(|(k, _)| !k.starts_with("EDGEINFER_MODELS__"));
    let (_node, _, port) = tokio::task::spawn_blocking(move || start("gw-f12", env)).await.unwrap();
    let rollout = |version: &'static str| async move {
        tokio::task::spawn_blocking(move || {
            let auth = format!("Authorization: Bearer {ADMIN_TOKEN}");
            let path = format!("/models/rollout?model=digits&version={version}");
            let (code, body) = http_with(port, "POST", &path, auth.as_bytes(), b"");
            (code, serde_json::from_slice::<Value>(&body).unwrap())
        })
        .await
        .unwrap()
    };
    // No SIGHUP: the directories appear while the node runs.
    copy_digits_version(models.path(), "2", false);
    copy_digits_version(models.path(), "3", true);
    let (code, started) = rollout("2").await;
    assert_eq!(code, 200, "{started}");
    assert_eq!((started["action"].as_str(), started["from"].as_str()), (Some("started"), Some("1")));
    let report = status(port).await;
    assert_eq!(report["versions"], serde_json::json!(["1", "2"]), "{report:#}");
    assert_eq!(report["candidate"]["version"], "2", "{report:#}");
    // A version whose sha256 check fails is refused with the reason, and
    // not loaded.
    let (code, refused) = rollout("3").await;
    assert_eq!(code, 409, "{refused}");
    let why = refused["error"].as_str().unwrap();
    assert!(why.contains("v3 was found but refused at load") && why.contains("sha256"), "{why}");
    assert_eq!(status(port).await["versions"], serde_json::json!(["1", "2"]));
    // A version with no directory is still named with what there is.
    let (code, unknown) = rollout("9").await;
    assert_eq!(code, 404, "{unknown}");
    assert!(unknown["error"].as_str().unwrap().contains("versions: 1, 2"), "{unknown}");
}
