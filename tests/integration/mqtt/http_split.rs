//! A rollout's split of HTTP clients, which have no reply topic: by the
//! device a request names (`X-Device-Id`), else the peer's address; never by
//! a missing request id, which would send every such request to one version.

use super::rollout::models_command;
use super::support::{admin_token_env, copy_digits_version, embedded_node_with_http, http_with};
use crate::{digits_request, heldout};
use serde_json::Value;

/// Devices that name themselves: enough that a 50% split shows.
const DEVICES: usize = 120;

/// The version that answers a request without an id, from `device` (its
/// `X-Device-Id`) or, with `None`, from this host's address.
fn version_for(port: u16, device: Option<&str>, row: usize) -> String {
    let split = heldout();
    let mut request = digits_request("", &[split[row % split.len()].1.clone()]);
    // As a plain HTTP client sends it: no id at all.
    request.as_object_mut().unwrap().remove("id");
    let mut headers = "Content-Type: application/json".to_string();
    if let Some(device) = device {
        headers.push_str(&format!("\r\nX-Device-Id: {device}"));
    }
    let body = request.to_string();
    let (code, reply) =
        http_with(port, "POST", "/v2/models/digits/infer", headers.as_bytes(), body.as_bytes());
    let reply: Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(code, 200, "{reply}");
    reply["model_version"].as_str().unwrap().to_string()
}

#[test]
fn the_http_split_follows_x_device_id_not_a_missing_request_id() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    models_command(models.path(), state.path(), &["promote", "digits", "1"]).unwrap();
    let (m, s) = (models.path().display().to_string(), state.path().display().to_string());
    let (_node, _, port) = embedded_node_with_http(
        "gw-split",
        &[("EDGEINFER_NODE__MODELS_DIR", &m), ("EDGEINFER_NODE__STATE_DIR", &s), admin_token_env()],
    );
    let url = format!("http://127.0.0.1:{port}");
    let ab = ["rollout", "digits", "2", "--mode", "ab", "--url", &url];
    let started = models_command(models.path(), state.path(), &ab).unwrap();
    assert_eq!(started["action"], "started", "{started}");

    // Each device's first answer: both versions answer a fair share.
    let name = |d: usize| format!("sensor-{d:03}");
    let first: Vec<String> = (0..DEVICES).map(|d| version_for(port, Some(&name(d)), d)).collect();
    let on_v2 = first.iter().filter(|v| *v == "2").count();
    assert!(
        (DEVICES / 4..=DEVICES * 3 / 4).contains(&on_v2),
        "{on_v2} of {DEVICES} devices on v2 in a 50% A/B split: {first:?}"
    );
    // And a device keeps its version, whatever it sends.
    for round in 1..3 {
        for (d, version) in first.iter().enumerate() {
            let again = version_for(port, Some(&name(d)), d + round * DEVICES);
            assert_eq!(&again, version, "device {} moved from v{version} to v{again}", name(d));
        }
    }
    // Without the header a client is its address: one version, every time.
    let by_address: Vec<String> = (0..10).map(|i| version_for(port, None, i)).collect();
    assert!(by_address.iter().all(|v| *v == by_address[0]), "{by_address:?}");

    // A header that cannot name a device is refused, naming the header and its limit.
    let long = "d".repeat(129);
    for bad in [long.as_str(), " "] {
        let headers = format!("Content-Type: application/json\r\nX-Device-Id: {bad}");
        let body = digits_request("bad", &[heldout()[0].1.clone()]).to_string();
        let (code, reply) =
            http_with(port, "POST", "/v2/models/digits/infer", headers.as_bytes(), body.as_bytes());
        let reply = String::from_utf8_lossy(&reply);
        assert_eq!(code, 400, "{bad:?}: {reply}");
        assert!(reply.contains("X-Device-Id") && reply.contains("128"), "{reply}");
    }
    eprintln!("{on_v2} of {DEVICES} devices on v2, each on one version over 3 rounds");
}
