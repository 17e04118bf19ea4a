//! Which version serves: `models status|promote|rollback` against the real
//! binary, under load, across kill -9, and with no node running.

use super::support::{
    Client, admin_get_json, admin_token_env, copy_digits_version, embedded_node_with_http, get_json, scrape,
};
use crate::{digits_request, heldout};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// `edgeinfer models ARGS` on `models` and `state`, its stdout as JSON when
/// it succeeds; its stderr otherwise.
pub(super) fn models_command(models: &Path, state: &Path, args: &[&str]) -> Result<Value, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .arg("--models-dir")
        .arg(models)
        .arg("models")
        .args(args)
        .arg("--json")
        .env_remove("EDGEINFER_CONFIG")
        // No default address to ask: only --url reaches a node.
        .env("EDGEINFER_HTTP__LISTEN", "")
        .env("EDGEINFER_NODE__STATE_DIR", state)
        // What the tests' nodes that take rollout commands hold.
        .env("EDGEINFER_HTTP__ADMIN_TOKEN_FILE", super::support::admin_token_file())
        .output()
        .unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}")))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn row(i: usize) -> Vec<u8> {
    let split = heldout();
    digits_request(&i.to_string(), &[split[i % split.len()].1.clone()]).to_string().into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_and_promote_take_effect_at_once_under_load_and_hold_across_kill_9_and_offline() {
    let models = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    let (m, s) = (models.path().display().to_string(), state.path().display().to_string());
    let env = [
        ("EDGEINFER_NODE__MODELS_DIR", m.as_str()),
        ("EDGEINFER_NODE__STATE_DIR", s.as_str()),
        admin_token_env(),
    ];
    let start = |env: [(&'static str, String); 3]| async move {
        tokio::task::spawn_blocking(move || {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            embedded_node_with_http("gw-ro", &env)
        })
        .await
        .unwrap()
    };
    let owned = env.map(|(k, v)| (k, v.to_string()));
    let (mut node, mqtt, http) = start(owned.clone()).await;
    let url = format!("http://127.0.0.1:{http}");
    let ask = {
        let (models, state, url) = (models.path().to_path_buf(), state.path().to_path_buf(), url.clone());
        move |args: Vec<&'static str>| {
            let (models, state, url) = (models.clone(), state.clone(), url.clone());
            tokio::task::spawn_blocking(move || {
                let mut all = args.clone();
                all.extend(["--url", url.as_str()]);
                models_command(&models, &state, &all)
            })
        }
    };
    let status = ask(vec!["status", "digits"]).await.unwrap().unwrap();
    assert_eq!((status[0]["serving"].as_str(), status[0]["previous"].as_str()), (Some("2"), Some("1")));
    assert!(status[0]["stable"].is_null(), "no state yet: the newest serves: {status}");

    // Steady load; a rollback in the middle of it.
    let mut events = Client::connect(mqtt, "events-ro", &["edgeinfer/gw-ro/events"]).await;
    let mut device = Client::connect(mqtt, "dev-ro", &["ro/replies"]).await;
    let mut replies: HashMap<usize, Vec<Value>> = HashMap::new();
    let mut sent_at = Vec::new();
    let started = Instant::now();
    let mut rollback = None;
    let mut rolled_back_at = None;
    let mut i = 0;
    // Load for 3 s, and on until the command (a process of its own, slow to
    // start on a loaded machine) has answered, up to 10 s.
    while started.elapsed() < Duration::from_secs(3)
        || (rolled_back_at.is_none() && started.elapsed() < Duration::from_secs(10))
    {
        device.request("edgeinfer/gw-ro/infer/digits", row(i), "ro/replies", b"", None).await;
        sent_at.push(Instant::now());
        i += 1;
        tokio::time::sleep(Duration::from_millis(3)).await;
        if started.elapsed() > Duration::from_secs(1) && rollback.is_none() && rolled_back_at.is_none() {
            rollback = Some(ask(vec!["rollback", "digits"]));
        }
        if let Some(task) = rollback.take_if(|t| t.is_finished()) {
            let decision = task.await.unwrap().unwrap();
            let what = (decision["action"].as_str(), decision["version"].as_str());
            assert_eq!(what, (Some("rolled_back"), Some("1")));
            rolled_back_at = Some(Instant::now());
        }
        while let Ok(p) = device.inbox.try_recv() {
            let reply: Value = serde_json::from_slice(&p.payload).unwrap();
            replies.entry(reply["id"].as_str().unwrap().parse().unwrap()).or_default().push(reply);
        }
    }
    let rolled_back_at = rolled_back_at.expect("the rollback answered within 9 s");
    let sent = i;
    let deadline = Instant::now() + Duration::from_secs(10);
    while replies.values().map(Vec::len).sum::<usize>() < sent && Instant::now() < deadline {
        if let Some(p) = device.next(Duration::from_secs(1)).await {
            let reply: Value = serde_json::from_slice(&p.payload).unwrap();
            replies.entry(reply["id"].as_str().unwrap().parse().unwrap()).or_default().push(reply);
        }
    }
    // A duplicate would come after the last first answer.
    while let Some(p) = device.next(Duration::from_millis(300)).await {
        let reply: Value = serde_json::from_slice(&p.payload).unwrap();
        replies.entry(reply["id"].as_str().unwrap().parse().unwrap()).or_default().push(reply);
    }
    let mut last_v2 = None;
    for (id, sent_at) in sent_at.iter().enumerate() {
        let answers = replies.get(&id).unwrap_or_else(|| panic!("request {id} of {sent} was not answered"));
        assert_eq!(answers.len(), 1, "request {id} answered {} times", answers.len());
        let reply = &answers[0];
        assert!(reply.get("error").is_none(), "{reply}");
        if reply["model_version"] == "2" {
            last_v2 = Some(id);
        }
        // Sent after the command answered: the rolled-back-to version.
        if *sent_at > rolled_back_at {
            assert_eq!(reply["model_version"], "1", "request {id}, sent after the rollback: {reply}");
        }
    }
    assert_eq!(replies[&0][0]["model_version"], "2");
    let last_v2: usize = last_v2.unwrap();
    eprintln!(
        "{sent} requests answered once each; the last on v2 was sent {:?} before the rollback returned",
        rolled_back_at.saturating_duration_since(sent_at[last_v2])
    );
    // One event for the decision, on the events topic.
    let (_, event) = events.next_json().await;
    let what = (event["action"].as_str(), event["from"].as_str(), event["version"].as_str());
    assert_eq!(what, (Some("rolled_back"), Some("2"), Some("1")), "{event}");
    assert_eq!((event["node"].as_str(), event["model"].as_str()), (Some("gw-ro"), Some("digits")));
    assert!(events.next(Duration::from_millis(500)).await.is_none(), "one event per decision");
    drop(events);
    // The status says so, and the version label counts the answers.
    let mut watcher = Client::connect(mqtt, "watch-ro", &["edgeinfer/gw-ro/status"]).await;
    let (_, retained) = watcher.next_json().await;
    let rollout = &retained["rollout"]["digits"];
    assert_eq!((rollout["stable"].as_str(), rollout["previous"].as_str()), (Some("1"), None), "{retained}");
    assert_eq!(rollout["last_decision"]["action"], "rolled_back", "{retained}");
    let active: Vec<&Value> =
        retained["models"].as_array().unwrap().iter().filter(|m| m["active"] == true).collect();
    assert_eq!((active.len(), active[0]["version"].as_str()), (1, Some("1")), "{retained}");
    // The deployment record: hashes per version, who made it stable, the
    // build and the config.
    let hex64 =
        |v: &Value| v.as_str().is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    let v1 = &active[0];
    assert!(hex64(&v1["sha256"]) && hex64(&v1["manifest_sha256"]), "{v1}");
    assert!(v1["deployed_by"].as_str().unwrap().contains("rollback"), "{v1}");
    assert!(v1["deployed_at_s"].as_u64().unwrap() > 1_700_000_000, "{v1}");
    assert!(hex64(&retained["config_sha256"]), "{retained}");
    assert!(!retained["build"]["git_sha"].as_str().unwrap().is_empty(), "{retained}");
    let (_, meta) = tokio::task::spawn_blocking(move || get_json(http, "/v2/models/digits")).await.unwrap();
    assert_eq!(meta["deployment"]["serving"], "1", "{meta}");
    let records = meta["deployment"]["records"].as_array().unwrap();
    assert_eq!(records.len(), 2, "{meta}");
    assert!(records.iter().all(|r| hex64(&r["sha256"]) && hex64(&r["manifest_sha256"])), "{meta}");
    assert!(records[1]["deployed_at_s"].is_null(), "version 2 was never made stable: {meta}");
    let metrics = tokio::task::spawn_blocking(move || scrape(http)).await.unwrap();
    assert!(metrics.contains("version=\"1\"") && metrics.contains("version=\"2\""));
    let state_file: Value =
        serde_json::from_slice(&std::fs::read(state.path().join("deployments.json")).unwrap()).unwrap();
    assert_eq!(state_file["models"]["digits"]["stable"], "1");

    // kill -9: the state holds; the new process serves version 1.
    node.kill9();
    drop(node);
    let (node, _, http) = start(owned.clone()).await;
    let reply = tokio::task::spawn_blocking(move || {
        super::support::infer_digits(http, &digits_request("after-kill", &[heldout()[0].1.clone()]))
    })
    .await
    .unwrap();
    assert_eq!(reply["model_version"], "1", "{reply}");
    // The node holds the state; a command that cannot reach it says so and
    // writes nothing behind its back.
    let (models_path, state_path) = (models.path().to_path_buf(), state.path().to_path_buf());
    let held = tokio::task::spawn_blocking(move || {
        models_command(&models_path, &state_path, &["rollback", "digits"])
    })
    .await
    .unwrap()
    .unwrap_err();
    assert!(held.contains("held by a running node") && held.contains("--url"), "{held}");
    let url = format!("http://127.0.0.1:{http}");
    let (models_path, state_path) = (models.path().to_path_buf(), state.path().to_path_buf());
    let promoted = tokio::task::spawn_blocking(move || {
        models_command(&models_path, &state_path, &["promote", "digits", "2", "--url", &url])
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!((promoted["version"].as_str(), promoted["from"].as_str()), (Some("2"), Some("1")));
    let reply = tokio::task::spawn_blocking(move || {
        super::support::infer_digits(http, &digits_request("promoted", &[heldout()[0].1.clone()]))
    })
    .await
    .unwrap();
    assert_eq!(reply["model_version"], "2", "{reply}");
    let (code, wrong) = tokio::task::spawn_blocking(move || {
        super::support::admin_http(http, "POST", "/models/promote?model=digits&version=9")
    })
    .await
    .unwrap();
    let wrong: Value = serde_json::from_slice(&wrong).unwrap();
    let why = wrong["error"].as_str().unwrap_or_default();
    assert!(code == 404 && why.contains("\"9\"") && why.contains("1, 2"), "{code} {wrong}");
    let metadata =
        tokio::task::spawn_blocking(move || admin_get_json(http, "/models/status")).await.unwrap().1;
    assert_eq!(metadata[0]["history"].as_array().map(Vec::len), Some(2), "{metadata}");
    drop(node);

    // No node: the command works on the state itself, which the next node reads.
    let offline = models_command(models.path(), state.path(), &["rollback", "digits"]).unwrap();
    assert_eq!(offline["version"], "1");
    assert!(offline["by"].as_str().unwrap().contains("no node"), "{offline}");
    let listed = models_command(models.path(), state.path(), &["status"]).unwrap();
    assert_eq!((listed[0]["serving"].as_str(), listed[0]["stable"].as_str()), (Some("1"), Some("1")));
    let records = listed[0]["records"].as_array().unwrap();
    assert_eq!(records.len(), 2, "{listed}");
    assert!(records.iter().all(|r| r["sha256"].as_str().is_some_and(|h| h.len() == 64)), "{listed}");
    assert!(records[0]["deployed_by"].as_str().unwrap().contains("no node"), "{listed}");
    let refused = models_command(models.path(), state.path(), &["rollback", "digits"]).unwrap_err();
    assert!(refused.contains("nothing to roll back") && refused.contains("v1"), "{refused}");
    // A new version dropped in waits for a promote: the stable serves on.
    copy_digits_version(models.path(), "3", false);
    let (node, mqtt, http) = start(owned).await;
    let reply = tokio::task::spawn_blocking(move || {
        super::support::infer_digits(http, &digits_request("offline", &[heldout()[0].1.clone()]))
    })
    .await
    .unwrap();
    assert_eq!(reply["model_version"], "1", "{reply}");
    // A reload that would drop the stable version is refused: v1 serves on.
    std::fs::remove_dir_all(models.path().join("digits/1")).unwrap();
    node.signal("HUP");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reply = tokio::task::spawn_blocking(move || {
        super::support::infer_digits(http, &digits_request("reloaded", &[heldout()[0].1.clone()]))
    })
    .await
    .unwrap();
    assert_eq!(reply["model_version"], "1", "{reply}");
    let mut watcher = Client::connect(mqtt, "watch-ro2", &["edgeinfer/gw-ro/status"]).await;
    let (_, retained) = watcher.next_json().await;
    let why = retained["reload_error"].as_str().unwrap_or_else(|| panic!("{retained}"));
    assert!(why.contains("stable version v1"), "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_topic_takes_signed_commands_only_and_is_absent_when_off() {
    use super::control::{KEY, control_env, signed};
    let models = tempfile::tempdir().unwrap();
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    let mut env = control_env(models.path());
    env.push(("EDGEINFER_NODE__MODELS_DIR", models.path().display().to_string()));
    let (_on, mqtt_on, _) = tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        embedded_node_with_http("gw-ctl", &env)
    })
    .await
    .unwrap();
    let mut fleet = Client::connect(mqtt_on, "fleet-ctl", &["fleet/replies"]).await;
    let mut ask = async |command: &Value| {
        let payload = command.to_string().into_bytes();
        fleet.request("edgeinfer/gw-ctl/control", payload, "fleet/replies", b"c", None).await;
        fleet.next_json().await.1
    };
    let sign = |command: Value| signed("edgeinfer/gw-ctl/control", command);
    let refused = ask(&serde_json::json!({"id": "c1", "command": "rollback", "model": "digits"})).await;
    assert_eq!(refused["error"]["code"], "unauthorized", "{refused}");
    // A token, even the key itself, is no signature.
    let token = serde_json::json!({"id": "c2", "token": KEY, "command": "rollback", "model": "digits"});
    assert_eq!(ask(&token).await["error"]["code"], "unauthorized");
    let status = ask(&sign(serde_json::json!({"id": "c3", "command": "status"}))).await;
    assert_eq!(status["result"][0]["serving"], "2", "{status}");
    let rollback = sign(serde_json::json!({"id": "c4", "command": "rollback", "model": "digits"}));
    let done = ask(&rollback).await;
    assert_eq!((done["id"].as_str(), done["result"]["version"].as_str()), (Some("c4"), Some("1")), "{done}");
    assert_eq!(done["result"]["by"], "control topic");
    // The same signed command again (a broker redelivering it after a
    // restart): the decision it took, not a second step back.
    let again = ask(&rollback).await;
    assert_eq!(again["result"], done["result"], "{again}");
    // Signed again under the same id (a sender retrying): applied once too.
    let resigned =
        ask(&sign(serde_json::json!({"id": "c4", "command": "rollback", "model": "digits"}))).await;
    assert_eq!(resigned["result"], done["result"], "{resigned}");
    // Finding 9: the same id for another command is refused, not answered
    // with the decision the id took.
    let reused =
        ask(&sign(serde_json::json!({"id": "c4", "command": "promote", "model": "digits", "version": "2"})))
            .await;
    assert_eq!(reused["error"]["code"], "conflict", "{reused}");
    let message = reused["error"]["message"].as_str().unwrap();
    assert!(message.contains("rollback digits") && message.contains("promote digits v2"), "{reused}");
    let status = ask(&sign(serde_json::json!({"id": "c4b", "command": "status", "model": "digits"}))).await;
    assert_eq!(status["result"][0]["history"].as_array().map(Vec::len), Some(1), "{status}");
    let unknown =
        ask(&sign(serde_json::json!({"id": "c5", "command": "promote", "model": "digits", "version": "9"})))
            .await;
    assert_eq!(unknown["error"]["code"], "unknown_model", "{unknown}");
    let rollout = |id: &str, mode: &str| {
        sign(
            serde_json::json!({"id": id, "command": "rollout", "model": "digits", "version": "2", "mode": mode}),
        )
    };
    let sideways = ask(&rollout("c5b", "sideways")).await;
    assert_eq!(sideways["error"]["code"], "invalid_payload", "{sideways}");
    assert!(sideways["error"]["message"].as_str().unwrap().contains("canary, shadow or ab"), "{sideways}");
    let shadow = ask(&rollout("c5c", "shadow")).await;
    assert_eq!(
        (shadow["result"]["action"].as_str(), shadow["result"]["version"].as_str()),
        (Some("started"), Some("2")),
        "{shadow}"
    );
    let junk = ask(&sign(serde_json::json!({"id": "c6", "command": "reboot"}))).await;
    assert!(
        junk["error"]["message"].as_str().unwrap().contains("status, promote, rollback or rollout"),
        "{junk}"
    );
    let no_id = ask(&sign(serde_json::json!({"command": "rollback", "model": "digits"}))).await;
    assert_eq!(no_id["error"]["code"], "invalid_payload", "{no_id}");

    // Off (the default): nothing listens there.
    let (_off, mqtt_off, _) =
        tokio::task::spawn_blocking(|| embedded_node_with_http("gw-noctl", &[])).await.unwrap();
    let mut fleet = Client::connect(mqtt_off, "fleet-noctl", &["fleet/replies"]).await;
    let command = signed("edgeinfer/gw-noctl/control", serde_json::json!({"id": "x", "command": "status"}));
    fleet
        .request("edgeinfer/gw-noctl/control", command.to_string().into_bytes(), "fleet/replies", b"c", None)
        .await;
    assert!(fleet.next(Duration::from_secs(1)).await.is_none(), "a node with control off answered");
}
