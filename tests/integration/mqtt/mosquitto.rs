//! The node against mosquitto, the site broker the contract is tested on:
//! persistence across a node crash, broker restarts, the last will, shared
//! subscriptions, and the README's mosquitto_rr example.

use super::labelled_request;
use super::support::{Client, Client311, Mosquitto, Node};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_for_mqtt5_and_311_and_the_readme_mosquitto_rr_example() {
    let Some(broker) = Mosquitto::start() else { return };
    let _node = Node::start(&broker.url(), "gw-m1", &[]);
    let mut c = Client::connect(broker.port, "dev-m1", &["devices/m1/replies"]).await;
    let (payload, label) = labelled_request("m1-1", 2);
    c.request(
        "edgeinfer/gw-m1/infer/digits",
        payload.clone(),
        "devices/m1/replies",
        &[9, 0, 9],
        Some("application/json"),
    )
    .await;
    let (reply, body) = c.next_json().await;
    assert_eq!(reply.properties.unwrap().correlation_data.as_deref(), Some(&[9u8, 0, 9][..]));
    assert_eq!(body["parameters"]["label"], label);

    let mut old = Client311::connect(broker.port, "dev-m1-311", "devices/m1-311/replies").await;
    let mut req: Value = serde_json::from_slice(&payload).unwrap();
    req["reply_to"] = json!("devices/m1-311/replies");
    req["id"] = json!("m1-311");
    old.client
        .publish("edgeinfer/gw-m1/infer/digits", rumqttc::QoS::AtLeastOnce, false, req.to_string())
        .await
        .unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(20), old.inbox.recv()).await.unwrap().unwrap();
    let body: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(body["id"], "m1-311");

    // The README's mosquitto_rr example, as written, against a node with the
    // default id (the host name), on this broker's port.
    if std::path::Path::new("/usr/bin/mosquitto_rr").exists() {
        let _default = Node::start(&broker.url(), "", &[]);
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
        let start = readme.find("mosquitto_rr -h").expect("README has a mosquitto_rr example");
        let end = start + readme[start..].find("\n```").unwrap();
        let command =
            readme[start..end].replace("\\\n", " ").replace("-p 1883", &format!("-p {}", broker.port));
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(&command)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let body: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{command}\nprinted {:?}: {e}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(body["id"], "req-17");
        assert_eq!(body["parameters"]["label"], "7");
    } else {
        crate::skipped("(README example) mosquitto_rr is not installed (apt-get install mosquitto-clients)");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_published_while_the_node_is_down_are_all_answered_after_restart() {
    let Some(broker) = Mosquitto::start() else { return };
    let mut node = Node::start(&broker.url(), "gw-m2", &[]);
    let mut status = Client::connect(broker.port, "fleet-m2", &["edgeinfer/gw-m2/status"]).await;
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "online");
    let mut c = Client::connect(broker.port, "dev-m2", &["devices/m2/replies"]).await;

    node.kill9();
    // The last will turns the retained status offline.
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "offline", "{s}");
    let mut late = Client::connect(broker.port, "fleet-m2-late", &["edgeinfer/gw-m2/status"]).await;
    let (retained, s) = late.next_json().await;
    assert!(retained.retain, "status is retained");
    assert_eq!(s["state"], "offline");

    for i in 0..100 {
        let id = format!("down-{i}");
        let (payload, _) = labelled_request(&id, i);
        c.request("edgeinfer/gw-m2/infer/digits", payload, "devices/m2/replies", id.as_bytes(), None).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _node = Node::start(&broker.url(), "gw-m2", &[]);
    let mut answered: HashMap<String, usize> = HashMap::new();
    while answered.len() < 100 {
        let (_, body) = c.next_json().await;
        *answered.entry(body["id"].as_str().unwrap().to_string()).or_default() += 1;
    }
    assert!((0..100).all(|i| answered.contains_key(&format!("down-{i}"))));
    let (_, s) = late.next_json().await;
    assert_eq!(s["state"], "online");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_serves_again_within_seconds_of_a_broker_restart() {
    let Some(broker) = Mosquitto::start() else { return };
    let port = broker.port;
    let node = Node::start(&broker.url(), "gw-m3", &[]);
    drop(broker);
    std::thread::sleep(Duration::from_millis(500));
    let restarted_at = Instant::now();
    let broker = Mosquitto::start_on(port).unwrap();
    node.wait_for_line("MQTT connected", Duration::from_secs(15));
    let reconnect = restarted_at.elapsed();
    let mut c = Client::connect(broker.port, "dev-m3", &["devices/m3/replies"]).await;
    let (payload, label) = labelled_request("m3", 4);
    c.request("edgeinfer/gw-m3/infer/digits", payload, "devices/m3/replies", b"m3", None).await;
    let (_, body) = c.next_json().await;
    assert_eq!(body["parameters"]["label"], label);
    assert!(reconnect < Duration::from_secs(10), "reconnected after {reconnect:?}");
    eprintln!("node reconnected {reconnect:?} after the broker came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_in_one_share_group_split_requests_and_answer_each_once() {
    let Some(broker) = Mosquitto::start() else { return };
    let _a = Node::start(&broker.url(), "gw-ma", &[]);
    let _b = Node::start(&broker.url(), "gw-mb", &[]);
    let mut c = Client::connect(broker.port, "dev-m4", &["devices/m4/replies"]).await;
    for i in 0..200 {
        let id = format!("s-{i}");
        let (payload, _) = labelled_request(&id, i);
        c.request("edgeinfer/infer/digits", payload, "devices/m4/replies", id.as_bytes(), None).await;
    }
    let mut by_node: HashMap<String, usize> = HashMap::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    while ids.len() < 200 {
        let (_, body) = c.next_json().await;
        *ids.entry(body["id"].as_str().unwrap().to_string()).or_default() += 1;
        *by_node.entry(body["parameters"]["node"].as_str().unwrap().to_string()).or_default() += 1;
    }
    assert!(c.next(Duration::from_millis(500)).await.is_none(), "a request was answered twice");
    assert!(ids.values().all(|&n| n == 1));
    assert!(
        by_node.get("gw-ma").copied().unwrap_or(0) > 0 && by_node.get("gw-mb").copied().unwrap_or(0) > 0,
        "{by_node:?}"
    );
    eprintln!("share group split: {by_node:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_publishes_draining_then_offline_and_exits_0() {
    let Some(broker) = Mosquitto::start() else { return };
    let mut node = Node::start(&broker.url(), "gw-m5", &[]);
    let mut status = Client::connect(broker.port, "fleet-m5", &["edgeinfer/gw-m5/status"]).await;
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "online");
    let code = node.terminate();
    assert!(code.success(), "exit {code:?}");
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "draining");
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "offline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtts_with_client_certificate_and_password_keeps_the_secret_out_of_logs() {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
    };
    // Distinct subjects: OpenSSL takes a certificate whose subject equals its
    // issuer's for self-signed.
    let params = |sans: Vec<String>, cn: &str| {
        let mut p = CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p
    };
    let secret = "s3cret-pa55-for-tls-test";
    let files = tempfile::tempdir().unwrap();
    let path = |name: &str| files.path().join(name).to_str().unwrap().to_string();
    if !super::support::password_file(std::path::Path::new(&path("passwd")), &[("gw-tls", secret)]) {
        return;
    }
    let mut ca_params = params(vec![], "edgeinfer test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server =
        params(vec!["127.0.0.1".into(), "localhost".into()], "broker").signed_by(&server_key, &ca).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let client = params(vec!["gw-tls".into()], "gw-tls").signed_by(&client_key, &ca).unwrap();
    let tls_port = super::support::free_port_pair();
    for (name, body) in [
        ("ca.pem", ca.pem()),
        ("server.pem", server.pem()),
        ("server.key", server_key.serialize_pem()),
        ("client.pem", client.pem()),
        ("client.key", client_key.serialize_pem()),
    ] {
        std::fs::write(path(name), body).unwrap();
    }
    let extra = format!(
        "listener {tls_port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n\
         allow_anonymous false\npassword_file {}\n",
        path("ca.pem"),
        path("server.pem"),
        path("server.key"),
        path("passwd")
    );
    let Some(broker) = Mosquitto::start_with(super::support::free_port_pair(), &extra, |_| {}) else {
        return;
    };
    let ca_file = path("ca.pem");
    let cert = path("client.pem");
    let key = path("client.key");
    let node = Node::start(
        &format!("mqtts://127.0.0.1:{tls_port}"),
        "gw-tls",
        &[
            ("EDGEINFER_MQTT__CA_FILE", ca_file.as_str()),
            ("EDGEINFER_MQTT__CLIENT_CERT_FILE", cert.as_str()),
            ("EDGEINFER_MQTT__CLIENT_KEY_FILE", key.as_str()),
            ("EDGEINFER_MQTT__USERNAME", "gw-tls"),
            ("EDGEINFER_MQTT__PASSWORD", secret),
            ("EDGEINFER_LOG", "debug,rumqttd=warn"),
        ],
    );
    let mut c =
        Client::connect(broker.port, "dev-tls", &["devices/tls/replies", "edgeinfer/gw-tls/status"]).await;
    let (_, s) = c.next_json().await;
    assert_eq!(s["state"], "online");
    assert!(!s.to_string().contains(secret));
    let (payload, label) = labelled_request("tls-1", 8);
    c.request("edgeinfer/gw-tls/infer/digits", payload, "devices/tls/replies", b"t", None).await;
    let (_, body) = c.next_json().await;
    assert_eq!(body["parameters"]["label"], label);
    let log = node.log.lock().unwrap().join("\n");
    assert!(!log.contains(secret), "the password appears in the node's log");
}

/// Prints the round trip at low load (one request in flight) on mosquitto
/// with TCP_NODELAY everywhere; the figures go to docs/BENCHMARKS.md. Run
/// against a release node with
/// `EDGEINFER_TEST_BIN=target/release/edgeinfer cargo test --test integration low_load -- --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn low_load_round_trip_through_mosquitto() {
    let Some(broker) = Mosquitto::start() else { return };
    let _node = Node::start(&broker.url(), "gw-lat", &[]);
    let mut c = Client::connect(broker.port, "dev-lat", &["devices/lat/replies"]).await;
    let (payload, label) = labelled_request("lat", 1);
    let mut times = Vec::new();
    for i in 0..1100 {
        let start = Instant::now();
        c.request("edgeinfer/gw-lat/infer/digits", payload.clone(), "devices/lat/replies", b"l", None).await;
        let (_, body) = c.next_json().await;
        if i >= 100 {
            times.push(start.elapsed());
        }
        assert_eq!(body["parameters"]["label"], label);
    }
    times.sort();
    let pct = |p: f64| times[((times.len() as f64 * p) as usize).min(times.len() - 1)].as_secs_f64() * 1e6;
    eprintln!(
        "low-load round trip through mosquitto, digits, 1000 requests one at a time: p50 {:.0} us, p99 {:.0} us, max {:.0} us",
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_echo_measures_the_broker_floor_without_a_node() {
    let Some(broker) = Mosquitto::start() else { return };
    // On rumqttc's event loop and on the node's own session layer (issue 36).
    for client in ["rumqttc", "session"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
            .args([
                "bench",
                "--echo",
                "--echo-client",
                client,
                "--json",
                "--duration",
                "1",
                "--warmup",
                "0.2",
            ])
            .args(["--url", &broker.url(), "--node", &format!("nobody-{client}")])
            .env_remove("EDGEINFER_CONFIG")
            .output()
            .unwrap();
        assert!(out.status.success(), "{client}: {}", String::from_utf8_lossy(&out.stderr));
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(report["requests"].as_u64().unwrap() > 100, "{client}: {report}");
        assert_eq!(report["errors"], 0, "{client}");
    }
}
