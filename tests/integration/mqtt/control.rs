//! Issue 35, finding 2: the control topic takes commands signed with the
//! key in `control.key_file` (HMAC-SHA256 over the command's fields, its
//! id, when it was issued and the topic it is addressed to) instead of a
//! token that crossed the broker in clear. The tests sign as docs/ROLLOUTS.md
//! "Rolling out a model" says, with code of their own, so the recipe an
//! outside fleet manager follows is what is tested.

use super::support::{
    Client, Mosquitto, Node, copy_digits_version, embedded_node_with_http, free_port_pair, password_file,
};
use hmac::{Hmac, Mac};
use rumqttc::v5::MqttOptions;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The key the tests' nodes and senders share (64 bytes, as `openssl rand
/// -hex 32` writes one).
pub const KEY: &str = "9f2c4e6a8b0d1f3e5a7c9e1b3d5f7a9c2e4f6b8d0a1c3e5f7b9d2a4c6e8f0b1d";

/// A file holding `KEY` in `dir`; its path.
pub fn key_file(dir: &Path) -> String {
    let path = dir.join("control.key");
    std::fs::write(&path, format!("{KEY}\n")).unwrap();
    path.display().to_string()
}

/// The environment of a node that takes signed commands with `KEY`.
pub fn control_env(dir: &Path) -> Vec<(&'static str, String)> {
    vec![("EDGEINFER_CONTROL__ENABLED", "true".into()), ("EDGEINFER_CONTROL__KEY_FILE", key_file(dir))]
}

pub fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// `command` with `issued_at_s` (now, unless it has one) and its
/// `signature` for `topic` under `key`: docs/ROLLOUTS.md's recipe.
pub fn signed_with(key: &str, topic: &str, mut command: Value) -> Value {
    if command.get("issued_at_s").is_none() {
        command["issued_at_s"] = json!(now_s());
    }
    let field = |name: &str| match &command[name] {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut canonical = format!("edgeinfer-control-v1\ntopic={topic}\n");
    for name in ["id", "issued_at_s", "command", "model", "version", "mode", "steps", "gates", "reply_to"] {
        canonical.push_str(&format!("{name}={}\n", field(name)));
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).unwrap();
    mac.update(canonical.as_bytes());
    command["signature"] = json!(hex::encode(mac.finalize().into_bytes()));
    command
}

/// `signed_with` the tests' `KEY`.
pub fn signed(topic: &str, command: Value) -> Value {
    signed_with(KEY, topic, command)
}

/// A node `id` with digits v1 and v2 (v2 serving) taking signed commands;
/// the node, its MQTT port and the models directory (which holds the key).
async fn control_node(id: &'static str) -> (Node, u16, tempfile::TempDir) {
    let models = tempfile::tempdir().unwrap();
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    let mut env = control_env(models.path());
    env.push(("EDGEINFER_NODE__MODELS_DIR", models.path().display().to_string()));
    let (node, mqtt, _) = tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        embedded_node_with_http(id, &env)
    })
    .await
    .unwrap();
    (node, mqtt, models)
}

/// Publishes `command` on `topic` and returns the answer.
async fn ask(fleet: &mut Client, topic: &str, command: &Value) -> Value {
    fleet.request(topic, command.to_string().into_bytes(), "fleet/replies", b"c", None).await;
    fleet.next_json().await.1
}

fn refused_unauthorized(answer: &Value, needle: &str) {
    assert_eq!(answer["error"]["code"], "unauthorized", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{needle:?} not in {answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_a_signed_command_is_applied_and_a_wrong_tampered_stale_or_misaddressed_one_is_refused() {
    let (_node, mqtt, _models) = control_node("gw-sig").await;
    let topic = "edgeinfer/gw-sig/control";
    let mut fleet = Client::connect(mqtt, "fleet-sig", &["fleet/replies"]).await;

    let promote_1 =
        signed(topic, json!({"id": "s1", "command": "promote", "model": "digits", "version": "1"}));
    let done = ask(&mut fleet, topic, &promote_1).await;
    assert_eq!(
        (done["result"]["action"].as_str(), done["result"]["version"].as_str()),
        (Some("promoted"), Some("1")),
        "{done}"
    );

    let promote_2 = json!({"id": "s2", "command": "promote", "model": "digits", "version": "2"});
    let other_key = "0000000000000000111111111111111122222222222222223333333333333333";
    refused_unauthorized(
        &ask(&mut fleet, topic, &signed_with(other_key, topic, promote_2.clone())).await,
        "wrong signature",
    );
    // Signed for version 1, then the version changed on the way.
    let mut tampered =
        signed(topic, json!({"id": "s3", "command": "promote", "model": "digits", "version": "1"}));
    tampered["version"] = json!("2");
    refused_unauthorized(&ask(&mut fleet, topic, &tampered).await, "wrong signature");
    // Signed for another node: this node's topic is not in what was signed.
    let elsewhere = signed("edgeinfer/gw-other/control", promote_2.clone());
    refused_unauthorized(&ask(&mut fleet, topic, &elsewhere).await, topic);
    let stale = signed(
        topic,
        json!({"id": "s4", "command": "promote", "model": "digits", "version": "2", "issued_at_s": now_s() - 400}),
    );
    let answer = ask(&mut fleet, topic, &stale).await;
    refused_unauthorized(&answer, "s behind this node's clock (control.max_skew_s = 300)");
    let early = signed(
        topic,
        json!({"id": "s5", "command": "promote", "model": "digits", "version": "2", "issued_at_s": now_s() + 400}),
    );
    refused_unauthorized(&ask(&mut fleet, topic, &early).await, "s ahead of this node's clock");
    let unsigned = json!({"id": "s6", "token": KEY, "command": "promote", "model": "digits", "version": "2"});
    refused_unauthorized(&ask(&mut fleet, topic, &unsigned).await, "no signature");
    // `status` is read-only, but signed too.
    refused_unauthorized(
        &ask(&mut fleet, topic, &json!({"id": "s7", "command": "status"})).await,
        "no signature",
    );
    let status =
        ask(&mut fleet, topic, &signed(topic, json!({"id": "s8", "command": "status", "model": "digits"})))
            .await;
    assert_eq!(
        (status["result"][0]["stable"].as_str(), status["result"][0]["serving"].as_str()),
        (Some("1"), Some("1")),
        "{status}"
    );

    // A refused command replayed after the state changed is refused as it
    // was, not applied: v1 is stable, so a rollout of it is a conflict...
    let rollout_1 =
        signed(topic, json!({"id": "s9", "command": "rollout", "model": "digits", "version": "1"}));
    let conflict = ask(&mut fleet, topic, &rollout_1).await;
    assert_eq!(conflict["error"]["code"], "conflict", "{conflict}");
    let promoted = ask(
        &mut fleet,
        topic,
        &signed(topic, json!({"id": "s10", "command": "promote", "model": "digits", "version": "2"})),
    )
    .await;
    assert_eq!(promoted["result"]["version"], "2", "{promoted}");
    // ...and still one once v2 is: the same bytes get the same answer.
    let replayed = ask(&mut fleet, topic, &rollout_1).await;
    assert_eq!(replayed, conflict);
    let status =
        ask(&mut fleet, topic, &signed(topic, json!({"id": "s11", "command": "status", "model": "digits"})))
            .await;
    let report = &status["result"][0];
    assert!(report["candidate"].is_null(), "a replayed command started a rollout: {status}");
    assert_eq!(report["history"].as_array().map(Vec::len), Some(2), "{status}");
}

/// `edgeinfer ARGS` with `env`; what it printed and its exit status.
fn edgeinfer(env: &[(&str, String)], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .args(args)
        .env_remove("EDGEINFER_CONFIG")
        .env("EDGEINFER_HTTP__LISTEN", "")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The environment `edgeinfer models ... --via-mqtt` reaches the node
/// `mqtt` with, signing with the key in `key_file`.
fn sender_env(mqtt: u16, key_file: String) -> Vec<(&'static str, String)> {
    vec![
        ("EDGEINFER_MQTT__URL", format!("mqtt://127.0.0.1:{mqtt}")),
        ("EDGEINFER_CONTROL__KEY_FILE", key_file),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_a_subscriber_to_the_control_topic_sees_no_secret() {
    let (_node, mqtt, models) = control_node("gw-snoop").await;
    // The embedded broker has no topic ACLs: anyone may subscribe to all.
    let mut snoop = Client::connect(mqtt, "snoop", &["#"]).await;
    let env = sender_env(mqtt, key_file(models.path()));
    let out = tokio::task::spawn_blocking(move || {
        edgeinfer(&env, &["models", "rollback", "digits", "--via-mqtt", "--node", "gw-snoop", "--json"])
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut seen = Vec::new();
    while let Some(publish) = snoop.next(Duration::from_millis(500)).await {
        seen.push(publish);
    }
    let commands: Vec<Value> = seen
        .iter()
        .filter(|p| p.topic == "edgeinfer/gw-snoop/control")
        .map(|p| serde_json::from_slice(&p.payload).unwrap())
        .collect();
    assert_eq!(commands.len(), 1, "the command crossed the broker once: {commands:?}");
    let command = &commands[0];
    let fields: Vec<&str> = command.as_object().unwrap().keys().map(String::as_str).collect();
    let documented = [
        "id",
        "command",
        "model",
        "version",
        "mode",
        "steps",
        "gates",
        "reply_to",
        "issued_at_s",
        "signature",
    ];
    assert!(fields.iter().all(|f| documented.contains(f)), "undocumented fields: {command}");
    let signature = command["signature"].as_str().unwrap();
    assert!(signature.len() == 64 && signature.chars().all(|c| c.is_ascii_hexdigit()), "{command}");
    // Neither the key nor anything made from it but the signature, on any topic.
    let derived = [
        KEY.to_string(),
        KEY.to_uppercase(),
        hex::encode(KEY),
        hex::encode(Sha256::digest(KEY.as_bytes())),
        KEY[..16].to_string(),
    ];
    for publish in &seen {
        let text = String::from_utf8_lossy(&publish.payload);
        for secret in &derived {
            assert!(!text.contains(secret.as_str()), "{secret} on {:?}: {text}", publish.topic);
        }
    }
    // What the snooper can do with what it saw: replay it (the answer it
    // got, no second rollback) or change it (refused).
    let mut attacker = Client::connect(mqtt, "attacker", &["evil/replies"]).await;
    let topic = "edgeinfer/gw-snoop/control";
    let mut evil = async |command: &Value| {
        attacker.request(topic, command.to_string().into_bytes(), "evil/replies", b"e", None).await;
        attacker.next_json().await.1
    };
    let first: Value = serde_json::from_slice(&out.stdout).unwrap();
    let replayed = evil(command).await;
    assert_eq!(replayed["result"], first, "{replayed}");
    let mut changed = command.clone();
    changed["command"] = json!("promote");
    changed["version"] = json!("1");
    refused_unauthorized(&evil(&changed).await, "wrong signature");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_models_via_mqtt_signs_commands_on_the_real_binary() {
    let (_node, mqtt, models) = control_node("gw-cli").await;
    let env = sender_env(mqtt, key_file(models.path()));
    let run = |args: &'static [&'static str], env: Vec<(&'static str, String)>| async move {
        tokio::task::spawn_blocking(move || edgeinfer(&env, args)).await.unwrap()
    };
    let out =
        run(&["models", "status", "digits", "--via-mqtt", "--node", "gw-cli", "--json"], env.clone()).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report[0]["serving"], "2", "{report}");
    let out = run(&["models", "promote", "digits", "1", "--via-mqtt", "--node", "gw-cli"], env.clone()).await;
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        printed.contains("digits v2 -> v1: promoted")
            && printed.contains("node gw-cli over its control topic"),
        "{printed}"
    );
    let args = &[
        "models",
        "rollout",
        "digits",
        "2",
        "--mode",
        "shadow",
        "--via-mqtt",
        "--node",
        "gw-cli",
        "--id",
        "cli-r1",
        "--json",
    ];
    let out = run(args, env.clone()).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let started: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (started["action"].as_str(), started["by"].as_str()),
        (Some("started"), Some("control topic")),
        "{started}"
    );
    // The same id again (after an `overloaded`, say): applied once.
    let again: Value = serde_json::from_slice(&run(args, env.clone()).await.stdout).unwrap();
    assert_eq!(again, started);
    let out = run(&["models", "status", "--via-mqtt", "--node", "gw-cli", "--json"], env.clone()).await;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report[0]["candidate"]["version"], "2", "{report}");
    assert_eq!(report[0]["history"].as_array().map(Vec::len), Some(2), "{report}");

    // A config candidate over the control topic (the file hex-encoded in
    // the signed command), once the shadow rollout is rolled back.
    let out = run(&["models", "rollback", "digits", "--via-mqtt", "--node", "gw-cli"], env.clone()).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = models.path().join("top2.toml");
    std::fs::write(&file, "top_k = 2\n").unwrap();
    let path: &'static str = Box::leak(file.display().to_string().into_boxed_str());
    let args = ["models", "rollout", "digits", "--config", path, "--via-mqtt", "--node", "gw-cli", "--json"];
    let out = run(Box::leak(Box::new(args)), env.clone()).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let started: Value = serde_json::from_slice(&out.stdout).unwrap();
    let config = started["config"]["to"].as_str().unwrap_or_else(|| panic!("{started}")).to_string();
    let out =
        run(&["models", "status", "digits", "--via-mqtt", "--node", "gw-cli", "--json"], env.clone()).await;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report[0]["candidate"]["config"], config.as_str(), "{report}");
    assert_eq!(report[0]["candidate"]["version"], "1", "on stable's version: {report}");
    assert!(report[0]["candidate_config"]["text"].as_str().unwrap().contains("top_k = 2"), "{report}");

    // Another key: refused by the node, and said so.
    let wrong = models.path().join("wrong.key");
    std::fs::write(&wrong, "1111111111111111111111111111111111111111111111111111111111111111\n").unwrap();
    let wrong_env = sender_env(mqtt, wrong.display().to_string());
    let out = run(&["models", "rollback", "digits", "--via-mqtt", "--node", "gw-cli"], wrong_env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("unauthorized") && stderr.contains("wrong signature"),
        "{stderr}"
    );
    // No key: nothing is sent.
    let no_key = vec![("EDGEINFER_MQTT__URL", format!("mqtt://127.0.0.1:{mqtt}"))];
    let out = run(&["models", "rollback", "digits", "--via-mqtt", "--node", "gw-cli"], no_key).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("control.key_file"), "{stderr}");
    // No node there: a bounded wait, then what to check.
    let started = Instant::now();
    let out = run(&["models", "status", "--via-mqtt", "--node", "gw-nobody"], env.clone()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("gw-nobody") && stderr.contains("control.enabled"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(15), "waited {:?}", started.elapsed());
    // --help says how.
    let help = run(&["models", "rollback", "--help"], vec![]).await;
    let help = String::from_utf8_lossy(&help.stdout);
    for needle in ["--via-mqtt", "control.key_file", "--node", "--id", "--reply-topic"] {
        assert!(help.contains(needle), "{needle} not in {help}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_control_on_an_embedded_broker_open_to_the_network_without_a_login_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port_pair();
    let mut env = control_env(dir.path());
    env.extend([
        ("EDGEINFER_MQTT__EMBEDDED_BROKER", "true".to_string()),
        ("EDGEINFER_MQTT__EMBEDDED_LISTEN", format!("0.0.0.0:{port}")),
        ("EDGEINFER_MQTT__URL", format!("mqtt://127.0.0.1:{port}")),
        ("EDGEINFER_NODE__STATE_DIR", dir.path().display().to_string()),
    ]);
    let serve = |env: Vec<(&'static str, String)>| async move {
        tokio::task::spawn_blocking(move || {
            edgeinfer(&env, &["serve", "--models-dir", &crate::models_dir().display().to_string()])
        })
        .await
        .unwrap()
    };
    let out = serve(env.clone()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("control.enabled = true")
            && stderr.contains(&format!("0.0.0.0:{port}"))
            && stderr.contains("mqtt.username"),
        "{stderr}"
    );
    // A key shorter than 32 bytes is refused too, naming the key.
    let short = dir.path().join("short.key");
    std::fs::write(&short, "fleet-Secret-7\n").unwrap();
    let mut short_env = env.clone();
    short_env.push(("EDGEINFER_CONTROL__KEY_FILE", short.display().to_string()));
    let out = serve(short_env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("control.key_file") && stderr.contains("at least 32"),
        "{stderr}"
    );
    // With a login it starts, and takes signed commands.
    let password = dir.path().join("mqtt.password");
    std::fs::write(&password, "broker-pw\n").unwrap();
    let mut env: Vec<(&str, String)> = env.into_iter().filter(|(k, _)| *k != "EDGEINFER_MQTT__URL").collect();
    env.extend([
        ("EDGEINFER_MQTT__USERNAME", "edge".to_string()),
        ("EDGEINFER_MQTT__PASSWORD_FILE", password.display().to_string()),
    ]);
    let node = tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Node::start(&format!("mqtt://127.0.0.1:{port}"), "gw-lan", &env)
    })
    .await
    .unwrap();
    assert!(node.log.lock().unwrap().iter().any(|l| l.contains("control topic on")));
}

/// The mosquitto ACL in docs/RUNBOOK.md ("Broker ACLs for control and
/// events"), as written there.
fn runbook_acl() -> String {
    let runbook = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/RUNBOOK.md")).unwrap();
    let start = runbook.find("# /etc/mosquitto/edgeinfer.acl").expect("the RUNBOOK's ACL");
    let block = &runbook[start..];
    block[..block.find("```").unwrap()].to_string()
}

/// A client logged in as `user`, subscribed to `topics` (the broker may
/// refuse them: then nothing arrives).
async fn logged_in(port: u16, user: &str, topics: &[&str]) -> Client {
    let mut options = MqttOptions::new(format!("{user}-{}", fastrand::u32(..)), "127.0.0.1", port);
    options.set_credentials(user, format!("pw-{user}"));
    Client::connect_with(options, topics).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_the_runbook_acl_lets_only_the_fleet_manager_command_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let (passwords, acl) = (dir.path().join("passwords"), dir.path().join("edgeinfer.acl"));
    if !password_file(&passwords, &[("gw-01", "pw-gw-01"), ("fleet", "pw-fleet"), ("cam-3", "pw-cam-3")]) {
        return;
    }
    std::fs::write(&acl, runbook_acl()).unwrap();
    let extra =
        format!("allow_anonymous false\npassword_file {}\nacl_file {}\n", passwords.display(), acl.display());
    let Some(broker) = Mosquitto::start_with(free_port_pair(), &extra, |_| {}) else { return };
    let port = broker.port;
    copy_digits_version(dir.path(), "1", false);
    copy_digits_version(dir.path(), "2", false);
    let node_password = dir.path().join("gw-01.password");
    std::fs::write(&node_password, "pw-gw-01\n").unwrap();
    let mut env = control_env(dir.path());
    env.extend([
        ("EDGEINFER_NODE__MODELS_DIR", dir.path().display().to_string()),
        ("EDGEINFER_MQTT__USERNAME", "gw-01".into()),
        ("EDGEINFER_MQTT__PASSWORD_FILE", node_password.display().to_string()),
        ("EDGEINFER_MQTT__REPLY_PREFIXES", r#"["devices", "fleet"]"#.into()),
    ]);
    let url = broker.url();
    // Ready only once the broker granted every subscription.
    let _node = tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Node::start(&url, "gw-01", &env)
    })
    .await
    .unwrap();

    // A device may neither read the control topic nor write to it, even a
    // correctly signed command (say one it got hold of elsewhere).
    let mut device = logged_in(port, "cam-3", &["devices/cam-3/replies", "edgeinfer/gw-01/control"]).await;
    let command =
        signed("edgeinfer/gw-01/control", json!({"id": "d1", "command": "rollback", "model": "digits"}));
    device
        .request(
            "edgeinfer/gw-01/control",
            command.to_string().into_bytes(),
            "devices/cam-3/replies",
            b"d",
            None,
        )
        .await;
    // It still gets answers to its requests.
    let (request, _) = super::labelled_request("r1", 0);
    device.request("edgeinfer/infer/digits", request, "devices/cam-3/replies", b"r", None).await;
    let (reply, answer) = device.next_json().await;
    assert_eq!(
        (reply.topic.as_ref(), answer["id"].as_str()),
        (&b"devices/cam-3/replies"[..], Some("r1")),
        "{answer}"
    );
    assert!(device.next(Duration::from_secs(1)).await.is_none(), "the device's command was answered");

    // The fleet manager may: `models ... --via-mqtt` logged in as fleet.
    let fleet_password = dir.path().join("fleet.password");
    std::fs::write(&fleet_password, "pw-fleet\n").unwrap();
    let fleet = vec![
        ("EDGEINFER_MQTT__URL", broker.url()),
        ("EDGEINFER_MQTT__USERNAME", "fleet".to_string()),
        ("EDGEINFER_MQTT__PASSWORD_FILE", fleet_password.display().to_string()),
        ("EDGEINFER_MQTT__REPLY_PREFIXES", r#"["fleet"]"#.to_string()),
        ("EDGEINFER_CONTROL__KEY_FILE", key_file(dir.path())),
    ];
    let out = tokio::task::spawn_blocking(move || {
        edgeinfer(&fleet, &["models", "rollback", "digits", "--via-mqtt", "--node", "gw-01", "--json"])
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let decision: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((decision["action"].as_str(), decision["version"].as_str()), (Some("rolled_back"), Some("1")));
    // The device, subscribed to the control topic, saw none of it.
    assert!(device.next(Duration::from_millis(500)).await.is_none(), "the device read the control topic");
}
