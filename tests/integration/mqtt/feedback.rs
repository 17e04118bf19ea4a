//! Field feedback (issue 40): devices tell the node later what the right
//! answer was, over MQTT (the node's topic and the site's) and HTTP; the
//! node joins it with the answer it gave and counts it per version.

use super::labelled_request;
use super::support::{
    Client, Mosquitto, admin_get_json, admin_token_env, embedded_node_with_http, http, node_with_http,
    sample, scrape,
};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_joins_the_answer_given_on_both_brokers_and_counts_per_version() {
    let env = [admin_token_env()];
    let (_node, port, http_port) = embedded_node_with_http("gw-fb1", &env);
    feedback_round(port, http_port, "gw-fb1").await;
    if let Some(broker) = Mosquitto::start() {
        let (_node, http_port) = node_with_http(&broker.url(), "gw-fb2", &env);
        feedback_round(broker.port, http_port, "gw-fb2").await;
    }
}

async fn feedback_round(port: u16, http_port: u16, node: &str) {
    let replies = format!("devices/{node}/replies");
    let feedback_replies = format!("devices/{node}/feedback-replies");
    let mut c = Client::connect(port, &format!("dev-{node}"), &[&replies]).await;
    let mut f = Client::connect(port, &format!("fb-{node}"), &[&feedback_replies]).await;
    let infer = format!("edgeinfer/{node}/infer/digits");

    // 16 answers, each with the label a device later learns is true.
    let mut answers = Vec::new();
    for i in 0..16 {
        let (payload, truth) = labelled_request(&format!("{node}-r{i}"), i);
        c.request(&infer, payload, &replies, b"", None).await;
        let (_, reply) = c.next_json().await;
        let label = reply["parameters"]["label"].as_str().unwrap().to_string();
        answers.push((
            reply["id"].as_str().unwrap().to_string(),
            label,
            truth,
            reply["model_version"].clone(),
        ));
    }
    let version = answers[0].3.as_str().unwrap().to_string();

    // Labels on the node's own topic, each answered as joined.
    let own = format!("edgeinfer/{node}/feedback");
    let mut right = 0;
    for (id, label, truth, _) in &answers[..8] {
        let body = json!({"id": id, "label": truth}).to_string().into_bytes();
        f.request(&own, body, &feedback_replies, id.as_bytes(), None).await;
        let (reply, joined) = f.next_json().await;
        assert_eq!(reply.properties.unwrap().correlation_data.as_deref(), Some(id.as_bytes()));
        assert_eq!(joined["status"], "joined", "{joined}");
        assert_eq!((joined["id"].as_str(), joined["kind"].as_str()), (Some(id.as_str()), Some("label")));
        assert_eq!(joined["version"], version.as_str());
        assert_eq!(joined["correct"], label == truth, "{joined}");
        right += (label == truth) as usize;
    }
    // Outcomes on the site's topic, no reply asked: 1 for the even, 0 for the odd.
    for (i, (id, ..)) in answers[8..12].iter().enumerate() {
        let body = json!({"id": id, "outcome": (i % 2 == 0) as u8 as f64}).to_string().into_bytes();
        f.client
            .publish("edgeinfer/feedback", rumqttc::v5::mqttbytes::QoS::AtLeastOnce, false, body)
            .await
            .unwrap();
    }
    // Over HTTP, with a weight of 3.
    let (id, _, truth, _) = &answers[12];
    let body = json!({"id": id, "label": truth, "weight": 3}).to_string();
    let (status, joined) = http(http_port, "POST", "/v2/feedback", body.as_bytes(), "application/json");
    let joined: serde_json::Value = serde_json::from_slice(&joined).unwrap();
    assert_eq!((status, joined["status"].as_str()), (200, Some("joined")), "{joined}");
    let weight_right = if answers[12].1 == *truth { 3.0 } else { 0.0 };

    // Not joined, each counted, none an error: a second label for an
    // answer, an id never answered (on the node's topic and over HTTP).
    let body = json!({"id": answers[0].0, "label": answers[0].2}).to_string().into_bytes();
    f.request(&own, body, &feedback_replies, b"dup", None).await;
    let (_, dup) = f.next_json().await;
    assert_eq!(
        (dup["status"].as_str(), dup["reason"].as_str()),
        (Some("unjoined"), Some("duplicate")),
        "{dup}"
    );
    let body = json!({"id": "never-asked", "outcome": 1}).to_string();
    let (status, unknown) = http(http_port, "POST", "/v2/feedback", body.as_bytes(), "application/json");
    let unknown: serde_json::Value = serde_json::from_slice(&unknown).unwrap();
    assert_eq!((status, unknown["reason"].as_str()), (200, Some("unknown_id")), "{unknown}");
    // On the site's topic an id this node did not answer is another
    // node's: it does not reply, even when asked.
    let body = json!({"id": "another-nodes", "label": "3"}).to_string().into_bytes();
    f.request("edgeinfer/feedback", body, &feedback_replies, b"site", None).await;

    // Bad feedback: the error names the field and the fix.
    f.request(&own, br#"{"id": "x", "lable": "3"}"#.to_vec(), &feedback_replies, b"bad", None).await;
    let (reply, bad) = f.next_json().await;
    assert_eq!(
        reply.properties.unwrap().correlation_data.as_deref(),
        Some(&b"bad"[..]),
        "no reply to the site's"
    );
    assert_eq!(bad["parameters"]["code"], "invalid_payload", "{bad}");
    assert!(bad["error"].as_str().unwrap().contains("lable"), "{bad}");
    let (status, bad) = http(http_port, "POST", "/v2/feedback", br#"{"id": "x"}"#, "application/json");
    let bad: serde_json::Value = serde_json::from_slice(&bad).unwrap();
    assert_eq!(status, 400, "{bad}");
    assert!(bad["error"].as_str().unwrap().contains("label or outcome"), "{bad}");
    let huge = vec![b'x'; 64 * 1024];
    let (status, _) = http(http_port, "POST", "/v2/feedback", &huge, "application/json");
    assert_eq!(status, 413);

    // Per version: in the metrics, and in `models status`.
    let labels = format!("version=\"{version}\"");
    let wanted_accuracy = (right as f64 + weight_right) / (8.0 + 3.0);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let metrics = scrape(http_port);
        // The store takes feedback in batches: the site's messages may
        // still be on their way.
        let outcomes = metrics
            .lines()
            .any(|l| l.starts_with("edgeinfer_feedback_total") && l.contains("outcome") && l.ends_with(" 4"));
        let elsewhere = metrics.lines().any(|l| l.contains("\"not_here\""));
        if (outcomes && elsewhere) || std::time::Instant::now() > deadline {
            break metrics;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let total =
        |kind: &str| sample(&metrics, &["edgeinfer_feedback_total{", &labels, &format!("kind=\"{kind}\"")]);
    assert_eq!((total("label"), total("outcome")), (9.0, 4.0), "{metrics}");
    // Unweighted, for windows in Prometheus: the labels answered right.
    let right_over_http = usize::from(weight_right > 0.0);
    let correct = sample(&metrics, &["edgeinfer_feedback_correct_total{", &labels]);
    assert_eq!(correct, (right + right_over_http) as f64, "{metrics}");
    let accuracy = sample(&metrics, &["edgeinfer_feedback_accuracy{", &labels]);
    assert!((accuracy - wanted_accuracy).abs() < 1e-9, "{accuracy} against {wanted_accuracy}");
    assert_eq!(sample(&metrics, &["edgeinfer_feedback_outcome_mean{", &labels]), 0.5);
    let unjoined =
        |reason: &str| sample(&metrics, &["edgeinfer_feedback_unjoined_total{", &format!("\"{reason}\"")]);
    assert_eq!(
        [unjoined("duplicate"), unjoined("unknown_id"), unjoined("not_here"), unjoined("invalid")],
        [1.0, 1.0, 1.0, 3.0]
    );
    assert!(sample(&metrics, &["edgeinfer_feedback_answers_kept"]) >= 16.0);
    let (status, report) = admin_get_json(http_port, "/models/status?model=digits");
    assert_eq!(status, 200, "{report}");
    let quality = report
        .as_array()
        .and_then(|models| models.iter().find(|m| m["model"] == "digits"))
        .map(|m| m["field_quality"].clone())
        .unwrap_or_else(|| panic!("digits in {report}"));
    let v = quality.as_array().unwrap().iter().find(|q| q["version"] == version.as_str()).unwrap();
    assert_eq!(
        (v["answers"].as_u64(), v["labels"].as_u64(), v["outcomes"].as_u64()),
        (Some(16), Some(9), Some(4))
    );
}

/// A flood of feedback for ids never answered, and answers past the
/// store's bounds: bounded, counted, and requests are still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feedback_flood_is_bounded_and_counted_and_serving_goes_on() {
    let env = [("EDGEINFER_FEEDBACK__MAX_ENTRIES", "50")];
    let (_node, port, http_port) = embedded_node_with_http("gw-fb3", &env);
    let mut c = Client::connect(port, "dev-fb3", &["devices/fb3/replies"]).await;
    let f = Client::connect(port, "fb-fb3", &[]).await;
    for i in 0..5000 {
        let body = json!({"id": format!("flood-{i}"), "outcome": 1}).to_string().into_bytes();
        f.client
            .publish("edgeinfer/gw-fb3/feedback", rumqttc::v5::mqttbytes::QoS::AtMostOnce, false, body)
            .await
            .unwrap();
    }
    // 120 answers in a store of 50: the oldest 70 go, counted.
    for i in 0..120 {
        let (payload, _) = labelled_request(&format!("fb3-{i}"), i);
        c.request("edgeinfer/gw-fb3/infer/digits", payload, "devices/fb3/replies", b"", None).await;
        let (_, reply) = c.next_json().await;
        assert_eq!(reply["id"], format!("fb3-{i}"), "{reply}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let metrics = scrape(http_port);
        let kept = sample(&metrics, &["edgeinfer_feedback_answers_kept"]);
        let evicted = sample(&metrics, &["edgeinfer_feedback_answers_dropped_total{", "evicted"]);
        let unknown = sample(&metrics, &["edgeinfer_feedback_unjoined_total{", "unknown_id"]);
        if (kept, evicted) == (50.0, 70.0) && unknown > 0.0 {
            // QoS 0 may lose some on the way; the node counts each it got.
            assert!(unknown <= 5000.0, "{metrics}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "kept {kept}, evicted {evicted}, unknown {unknown}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The oldest answer is gone, the newest still joins.
    let body = json!({"id": "fb3-0", "outcome": 1}).to_string();
    let (_, gone) = http(http_port, "POST", "/v2/feedback", body.as_bytes(), "application/json");
    assert!(String::from_utf8_lossy(&gone).contains("unknown_id"));
    let body = json!({"id": "fb3-119", "outcome": 1}).to_string();
    let (_, joined) = http(http_port, "POST", "/v2/feedback", body.as_bytes(), "application/json");
    assert!(String::from_utf8_lossy(&joined).contains("\"joined\""), "{}", String::from_utf8_lossy(&joined));
}
