//! Issue 36, exactly one final reply: with the journal and
//! `mqtt.reply_qos = 2` (the defaults), every request of 3 rounds of 150
//! async escalations gets exactly one final reply while the node is killed
//! (kill -9), stopped (SIGTERM) or its broker restarted (mosquitto with
//! persistence on, as sites run it) in the middle round. Counted at the
//! device: a reply the broker delivers again after the device's own
//! reconnect carries DUP and is the broker's, not a second answer.
//!
//! `EXACTLY_ONCE_RUNS` (default 1) repeats each stop; the closing
//! figures of issue 36 come from 20.

use super::labelled_request;
use super::support::{Client, Mosquitto, Node, free_port_pair};
use rumqttc::v5::MqttOptions;
use rumqttc::v5::mqttbytes::QoS;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const PER_ROUND: usize = 150;

/// What the device got for each request: (final replies, provisional
/// replies, broker re-deliveries).
#[derive(Default, Debug)]
struct Got {
    finals: Vec<Value>,
    provisional: usize,
    redelivered: usize,
}

/// Reads replies into `got` until every id in `ids` has a final one (or
/// `timeout`), then half a second more for any second one.
async fn collect(client: &mut Client, got: &mut BTreeMap<String, Got>, ids: &[String], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut settle_until: Option<Instant> = None;
    loop {
        if settle_until.is_none() && ids.iter().all(|id| got.get(id).is_some_and(|g| !g.finals.is_empty())) {
            settle_until = Some(Instant::now() + Duration::from_millis(500));
        }
        let until = settle_until.unwrap_or(deadline);
        let Some(p) = client.next(until.saturating_duration_since(Instant::now())).await else {
            if settle_until.is_none() {
                let missing: Vec<&String> =
                    ids.iter().filter(|id| got.get(*id).is_none_or(|g| g.finals.is_empty())).collect();
                panic!("{} requests without a final reply after {timeout:?}: {missing:?}", missing.len());
            }
            return;
        };
        let id = String::from_utf8(p.properties.unwrap().correlation_data.unwrap().to_vec()).unwrap();
        let entry = got.entry(id).or_default();
        if p.dup {
            entry.redelivered += 1;
            continue;
        }
        let reply: Value = serde_json::from_slice(&p.payload).unwrap();
        if reply["parameters"]["final"] == true {
            entry.finals.push(reply);
        } else {
            entry.provisional += 1;
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Stop {
    Kill9,
    Sigterm,
    BrokerRestart,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_escalation_gets_exactly_one_final_reply_across_kill_9_sigterm_and_a_broker_restart() {
    let runs: usize = std::env::var("EXACTLY_ONCE_RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(1);
    let persistence = tempfile::tempdir().unwrap();
    let port = free_port_pair();
    let Some(mut broker) = Mosquitto::start_persistent(port, persistence.path()) else { return };
    let cloud = super::cascade::FakeCloud::start(Duration::from_millis(5));
    let url = format!("http://127.0.0.1:{}", cloud.port);
    // The device keeps its session too, so replies wait for it across the
    // broker's restart.
    let mut options = MqttOptions::new("dev-x1", "127.0.0.1", port);
    options
        .set_keep_alive(Duration::from_secs(30))
        .set_clean_start(false)
        .set_session_expiry_interval(Some(600));
    let mut client = Client::connect_with(options, &["dev/x1/replies"]).await;
    let mut totals: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    for stop in [Stop::Kill9, Stop::Sigterm, Stop::BrokerRestart] {
        for run in 0..runs {
            let state = tempfile::tempdir().unwrap();
            let dir = state.path().display().to_string();
            let env = super::cascade::async_edge_env(&url, &dir, &[("EDGEINFER_CACHE__ENABLED", "false")]);
            let mut node = tokio::task::block_in_place(|| Node::start(&broker.url(), "gw-x1", &env));
            let mut got: BTreeMap<String, Got> = BTreeMap::new();
            for round in 0..3 {
                let ids: Vec<String> =
                    (0..PER_ROUND).map(|i| format!("{stop:?}-{run}-{round}-{i}")).collect();
                for (i, id) in ids.iter().enumerate() {
                    let (payload, _) = labelled_request(id, i);
                    client
                        .request(
                            "edgeinfer/gw-x1/infer/digits",
                            payload,
                            "dev/x1/replies",
                            id.as_bytes(),
                            None,
                        )
                        .await;
                }
                if round == 1 {
                    // In the middle of the round: a third of its finals out.
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while ids.iter().filter(|id| got.get(*id).is_some_and(|g| !g.finals.is_empty())).count()
                        < PER_ROUND / 3
                    {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let p = client.next(left).await.expect("a third of the round's finals");
                        let id = String::from_utf8(p.properties.unwrap().correlation_data.unwrap().to_vec())
                            .unwrap();
                        let reply: Value = serde_json::from_slice(&p.payload).unwrap();
                        let entry = got.entry(id).or_default();
                        match (p.dup, reply["parameters"]["final"] == true) {
                            (true, _) => entry.redelivered += 1,
                            (false, true) => entry.finals.push(reply),
                            (false, false) => entry.provisional += 1,
                        }
                    }
                    tokio::task::block_in_place(|| match stop {
                        Stop::Kill9 => node.kill9(),
                        Stop::Sigterm => assert!(node.terminate().success()),
                        Stop::BrokerRestart => {
                            broker.stop();
                            broker = Mosquitto::start_persistent(port, persistence.path()).unwrap();
                        }
                    });
                    if !matches!(stop, Stop::BrokerRestart) {
                        node = tokio::task::block_in_place(|| Node::start(&broker.url(), "gw-x1", &env));
                    }
                }
                collect(&mut client, &mut got, &ids, Duration::from_secs(60)).await;
            }
            let twice: Vec<(&String, &Got)> = got.iter().filter(|(_, g)| g.finals.len() > 1).collect();
            assert!(
                twice.is_empty(),
                "{stop:?} run {run}: {} requests answered twice: {twice:?}",
                twice.len()
            );
            assert_eq!(
                got.len(),
                3 * PER_ROUND,
                "{stop:?} run {run}: a reply for every request and no other"
            );
            let total = totals.entry(stop_name(stop)).or_default();
            total.0 += got.len();
            total.1 += got.values().map(|g| g.provisional.saturating_sub(1)).sum::<usize>();
            total.2 += got.values().map(|g| g.redelivered).sum::<usize>();
            drop(node);
        }
    }
    for (stop, (requests, extra_provisional, redelivered)) in totals {
        eprintln!(
            "{stop}: {requests} requests in {runs} runs, each with exactly one final reply; {extra_provisional} \
             provisional replies twice, {redelivered} broker re-deliveries (DUP) after the device's reconnect"
        );
    }
}

fn stop_name(stop: Stop) -> &'static str {
    match stop {
        Stop::Kill9 => "kill -9",
        Stop::Sigterm => "SIGTERM",
        Stop::BrokerRestart => "broker restart",
    }
}

/// `mqtt.reply_qos` as a device subscribed at QoS 2 sees it: replies at
/// QoS 2 by default, at QoS 1 with `reply_qos = 1`, at QoS 1 without the
/// journal (which QoS 2 needs), and at QoS 1 through the embedded broker
/// (it dies with the node: QoS 2 would buy nothing across a crash).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_go_at_the_qos_mqtt_reply_qos_names_and_at_qos_1_without_the_journal() {
    let Some(broker) = Mosquitto::start() else { return };
    let cases: [(&[(&str, &str)], QoS); 3] = [
        (&[], QoS::ExactlyOnce),
        (&[("EDGEINFER_MQTT__REPLY_QOS", "1")], QoS::AtLeastOnce),
        (&[("EDGEINFER_MQTT__JOURNAL__MAX_BYTES", "0")], QoS::AtLeastOnce),
    ];
    for (n, (env, qos)) in cases.into_iter().enumerate() {
        let node = tokio::task::block_in_place(|| Node::start(&broker.url(), "gw-q", env));
        let options = MqttOptions::new(format!("dev-q{n}"), "127.0.0.1", broker.port);
        // A topic per case: a node killed with its request not yet
        // acknowledged (QoS 1 acknowledges after the sync) has it delivered
        // again to the next one, whose answer must not be taken for this one.
        let replies = format!("dev/q{n}/replies");
        let mut client = Client::connect_with_qos(options, &[&replies], QoS::ExactlyOnce).await;
        let (payload, label) = labelled_request("q", n);
        client.request("edgeinfer/gw-q/infer/digits", payload, &replies, b"q", None).await;
        let (publish, reply) = client.next_json().await;
        assert_eq!(reply["parameters"]["label"], label, "{reply}");
        assert_eq!(publish.qos, qos, "{env:?}");
        if env.iter().any(|(k, _)| k.contains("JOURNAL")) {
            let log = node.log.lock().unwrap();
            assert!(log.iter().any(|l| l.contains("replies go at QoS 1")), "the start log says so");
        }
        drop(node);
    }
    let (node, port, _) =
        tokio::task::block_in_place(|| super::support::embedded_node_with_http("gw-qe", &[]));
    let options = MqttOptions::new("dev-qe", "127.0.0.1", port);
    let mut client = Client::connect_with_qos(options, &["dev/q/replies"], QoS::ExactlyOnce).await;
    let (payload, label) = labelled_request("qe", 0);
    client.request("edgeinfer/gw-qe/infer/digits", payload, "dev/q/replies", b"qe", None).await;
    let (_, reply) = client.next_json().await;
    assert_eq!(reply["parameters"]["label"], label, "{reply}");
    // rumqttd delivers at the subscription's QoS whatever the publish's, so
    // the device cannot tell here: the node's start log says what it does.
    let log = node.log.lock().unwrap();
    assert!(
        log.iter().any(|l| l.contains("replies go at QoS 1 to the embedded broker")),
        "the start log says so"
    );
}
