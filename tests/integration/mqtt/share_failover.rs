//! Issue 42: a site outlives any one node. Three nodes in one share group on
//! mosquitto under 300 requests a second of distinct requests from 100
//! devices (a reply topic each, a 2 s deadline as MQTT 5 Message Expiry);
//! one node dies (kill -9), stops (SIGTERM), or hangs without a TCP reset
//! (SIGSTOP). Its share of the requests moves to the two others within
//! `mqtt.share_keep_alive_s` x 1.5 + `mqtt.share_session_expiry_s` (the
//! shipped 5 s and 5 s), not `mqtt.session_expiry_s` (an hour), and it
//! takes its share again when it is back. Each test prints the requests
//! each node answered per second around the fault (`benches/share-failover.sh`
//! collects them for docs/BENCHMARKS.md).

use super::support::{Client, Mosquitto, Node, node_with_http, sample, scrape};
use crate::{digits_request, heldout};
use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const DEVICES: usize = 100;
const PER_SECOND: u32 = 300;
const DEADLINE: Duration = Duration::from_secs(2);
/// The shipped `mqtt.share_keep_alive_s` and `mqtt.share_session_expiry_s`.
const KEEP_ALIVE_S: f64 = 5.0;
const SHARE_EXPIRY_S: f64 = 5.0;

/// mosquitto checks session expiries about once a second.
const BROKER_CHECKS: Duration = Duration::from_millis(1500);
/// mosquitto 2.0 checks keep alives every 6 s (`last_keepalive_check + 5 <
/// now`), so it notices a silent client up to 6 s after 1.5 x keep alive.
const MOSQUITTO_KEEP_ALIVE_TICK: Duration = Duration::from_secs(6);
/// What a silent death may take beyond the worst case on mosquitto 2.0.
const SILENT_SLACK: Duration = MOSQUITTO_KEEP_ALIVE_TICK.saturating_add(BROKER_CHECKS);

/// keep alive x 1.5 + session expiry: the longest a dead node keeps its
/// place in the group.
fn worst_case() -> Duration {
    Duration::from_secs_f64(KEEP_ALIVE_S * 1.5 + SHARE_EXPIRY_S)
}

/// Three debug nodes at 300 requests a second fill this suite's two
/// cores: two such sites at once would miss every deadline.
static ONE_SITE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Site {
    mosquitto: Mosquitto,
    nodes: Vec<(Node, u16)>,
}

const IDS: [&str; 3] = ["gw-f1", "gw-f2", "gw-f3"];

fn start_node(mosquitto: &Mosquitto, id: &str) -> (Node, u16) {
    node_with_http(&mosquitto.url(), id, &[])
}

fn start_site() -> Option<Site> {
    let mosquitto = Mosquitto::start()?;
    let nodes = IDS.iter().map(|id| start_node(&mosquitto, id)).collect();
    Some(Site { mosquitto, nodes })
}

/// One request: when it was sent, and when and by which node it was
/// answered; `error`: the node answered it with an error (a request that
/// waited past its deadline in a hung node gets `deadline_exceeded`).
struct Sent {
    at: Instant,
    answer: Option<(Instant, String)>,
    error: Option<String>,
}

/// The devices: one client, a reply topic per device, distinct requests
/// (a held-out row with its first pixel moved by the request number, so no
/// cache answers one from another).
struct Devices {
    client: Client,
    sent: Vec<Sent>,
    started: Instant,
    rows: Vec<(usize, Vec<f64>)>,
}

impl Devices {
    async fn connect(port: u16) -> Devices {
        let client = Client::connect(port, "sf-devices", &["sf/+/replies"]).await;
        Devices { client, sent: Vec::new(), started: Instant::now(), rows: heldout() }
    }

    async fn send(&mut self) {
        let i = self.sent.len();
        let mut row = self.rows[i % self.rows.len()].1.clone();
        row[0] += (i / self.rows.len()) as f64 * 1e-3;
        let payload = digits_request(&i.to_string(), &[row]).to_string();
        let props = PublishProperties {
            response_topic: Some(format!("sf/dev{}/replies", i % DEVICES)),
            correlation_data: Some(Bytes::from(i.to_string())),
            message_expiry_interval: Some(DEADLINE.as_secs() as u32),
            ..Default::default()
        };
        self.client
            .client
            .publish_with_properties("edgeinfer/infer/digits", QoS::AtLeastOnce, false, payload, props)
            .await
            .unwrap();
        self.sent.push(Sent { at: Instant::now(), answer: None, error: None });
    }

    fn take(&mut self) {
        while let Ok(p) = self.client.inbox.try_recv() {
            let reply: serde_json::Value = serde_json::from_slice(&p.payload).unwrap();
            let id: usize = reply["id"].as_str().unwrap().parse().unwrap();
            let sent = &mut self.sent[id];
            assert!(sent.answer.is_none() && sent.error.is_none(), "request {id} answered twice");
            if reply.get("error").is_some() {
                sent.error = Some(reply["error"]["code"].to_string());
                continue;
            }
            let node = reply["parameters"]["node"].as_str().unwrap().to_string();
            sent.answer = Some((Instant::now(), node));
        }
    }

    /// Sends at `PER_SECOND` for `length`, taking replies; `each` runs every
    /// 100 ms.
    async fn load(&mut self, length: Duration, mut each: impl FnMut(&Devices)) {
        let until = Instant::now() + length;
        let mut tick = tokio::time::interval(Duration::from_secs(1) / PER_SECOND);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut checked = Instant::now();
        while Instant::now() < until {
            tick.tick().await;
            self.send().await;
            self.take();
            if checked.elapsed() >= Duration::from_millis(100) {
                checked = Instant::now();
                each(self);
            }
        }
    }

    /// Replies to what was sent, for `DEADLINE` and a little more.
    async fn settle(&mut self) {
        tokio::time::sleep(DEADLINE + Duration::from_millis(500)).await;
        self.take();
    }

    fn within_deadline(s: &Sent) -> bool {
        s.answer.as_ref().is_some_and(|(at, _)| *at - s.at <= DEADLINE)
    }

    /// The requests sent in `[from, to)`.
    fn between(&self, from: Instant, to: Instant) -> impl Iterator<Item = &Sent> {
        self.sent.iter().filter(move |s| s.at >= from && s.at < to)
    }

    /// The first instant after `fault` from which, until `to`, every request
    /// was answered by a node other than `victim`: when its share moved.
    fn moved_after(&self, fault: Instant, to: Instant, victim: &str) -> Duration {
        let last_bad = self
            .between(fault, to)
            .filter(|s| s.answer.as_ref().is_none_or(|(_, node)| node == victim))
            .map(|s| s.at)
            .max();
        last_bad.map_or(Duration::ZERO, |at| at - fault)
    }

    /// Replies per second by each node, by the second they arrived in,
    /// relative to `fault`; printed for docs/BENCHMARKS.md.
    fn timeline(&self, name: &str, fault: Instant) {
        let mut per_second: BTreeMap<i64, BTreeMap<&str, u32>> = BTreeMap::new();
        for s in &self.sent {
            if let Some((at, node)) = &s.answer {
                let second = if *at >= fault {
                    (*at - fault).as_secs() as i64
                } else {
                    -((fault - *at).as_secs() as i64) - 1
                };
                *per_second.entry(second).or_default().entry(node.as_str()).or_default() += 1;
            }
        }
        eprintln!("share-timeline {name}: t_s {}", IDS.join(" "));
        for (second, nodes) in per_second {
            let counts: Vec<String> =
                IDS.iter().map(|id| nodes.get(id).copied().unwrap_or(0).to_string()).collect();
            eprintln!("share-timeline {name}: {second} {}", counts.join(" "));
        }
    }
}

/// The share each node answered of the requests sent in `[from, to)`.
fn shares(devices: &Devices, from: Instant, to: Instant) -> BTreeMap<String, f64> {
    let mut counts: BTreeMap<String, f64> = BTreeMap::new();
    let mut total = 0.0;
    for s in devices.between(from, to) {
        total += 1.0;
        if let Some((_, node)) = &s.answer {
            *counts.entry(node.clone()).or_default() += 1.0;
        }
    }
    counts.values_mut().for_each(|c| *c /= total);
    counts
}

/// The share of the requests sent in the 2 s before `fault` answered
/// within the deadline: 1 on a machine with room for the load.
fn steady_in_time(devices: &Devices, fault: Instant) -> f64 {
    let sent: Vec<&Sent> = devices.between(fault - Duration::from_secs(2), fault).collect();
    sent.iter().filter(|s| Devices::within_deadline(s)).count() as f64 / sent.len() as f64
}

/// After the worst case (and `slack`, the broker's own check intervals),
/// until `back`: every request answered by the two others, at least 99.9%
/// within the deadline. Returns when the share moved.
fn assert_survivors_take_the_share(
    devices: &Devices,
    fault: Instant,
    back: Instant,
    victim: &str,
    slack: Duration,
) -> Duration {
    let steady = steady_in_time(devices, fault);
    let after = fault + worst_case() + slack;
    let moved = devices.moved_after(fault, back, victim);
    let sent: Vec<&Sent> = devices.between(after, back).collect();
    assert!(sent.len() > 500, "{} requests sent after the worst case", sent.len());
    let unanswered = sent.iter().filter(|s| s.answer.is_none()).count();
    let by_victim = sent.iter().filter(|s| s.answer.as_ref().is_some_and(|(_, n)| n == victim)).count();
    let in_time = sent.iter().filter(|s| Devices::within_deadline(s)).count() as f64 / sent.len() as f64;
    assert_eq!(
        (unanswered, by_victim),
        (0, 0),
        "of {} requests sent from the worst case on: unanswered, answered by {victim} (the share moved \
         {moved:?} after the fault)",
        sent.len()
    );
    if steady >= 0.999 {
        assert!(in_time >= 0.999, "{in_time} answered within {DEADLINE:?} (before the fault: {steady})");
    } else {
        // Other tests took the cores: the deadline measures them, not the
        // failover (run alone, or benches/share-failover.sh, for the figure).
        eprintln!(
            "share-failover: only {steady:.3} answered within {DEADLINE:?} before the fault (a busy machine); \
             {in_time:.3} after the worst case, not asserted"
        );
    }
    assert!(moved <= worst_case() + slack, "the share moved {moved:?} after the fault");
    moved
}

/// The node back in the group takes about a third again.
fn assert_rejoined(devices: &Devices, from: Instant, to: Instant, victim: &str) -> f64 {
    let share = shares(devices, from, to);
    let answered: f64 = share.values().sum();
    let victim_share = share.get(victim).copied().unwrap_or(0.0);
    assert!(victim_share > 0.2, "{victim} back took {victim_share} of the requests: {share:?}");
    assert!(answered >= 0.999, "{answered} answered after it was back: {share:?}");
    victim_share
}

fn summary(name: &str, devices: &Devices, fault: Instant, moved: Duration) {
    let sent = devices.sent.len();
    let answered = devices.sent.iter().filter(|s| s.answer.is_some()).count();
    let in_time = devices.sent.iter().filter(|s| Devices::within_deadline(s)).count();
    eprintln!(
        "share-summary {name}: {sent} requests over {:.1} s, {answered} answered, {in_time} within {DEADLINE:?} \
         ({:.4}); the share moved {:.2} s after the fault (worst case {:.1} s)",
        devices.started.elapsed().as_secs_f64(),
        in_time as f64 / sent as f64,
        moved.as_secs_f64(),
        worst_case().as_secs_f64()
    );
    devices.timeline(name, fault);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_one_node_moves_its_share_to_the_others_within_the_worst_case_and_it_rejoins() {
    let _one = ONE_SITE_AT_A_TIME.lock().await;
    let Some(mut site) = start_site() else { return };
    let mut devices = Devices::connect(site.mosquitto.port).await;
    let warm = Instant::now();
    devices.load(Duration::from_secs(3), |_| {}).await;
    let before = shares(&devices, warm, Instant::now());
    assert_eq!(before.len(), 3, "all three take a share: {before:?}");

    let victim = IDS[0];
    let fault = Instant::now();
    site.nodes[0].0.kill9();
    devices.load(worst_case() + BROKER_CHECKS + Duration::from_secs(4), |_| {}).await;
    let restart_at = Instant::now();
    site.nodes[0] = start_node(&site.mosquitto, victim);
    let back = Instant::now();
    devices.load(Duration::from_secs(5), |_| {}).await;
    devices.settle().await;
    let moved = assert_survivors_take_the_share(&devices, fault, restart_at, victim, BROKER_CHECKS);
    let share = assert_rejoined(&devices, back + Duration::from_secs(1), Instant::now() - DEADLINE, victim);
    summary("kill9", &devices, fault, moved);
    eprintln!("share-summary kill9: back after restart with {share:.3} of the requests");
    // Seen on a survivor: the counter, the gauge and the retained status.
    let metrics = scrape(site.nodes[1].1);
    assert!(sample(&metrics, &["edgeinfer_mqtt_share_requests_total"]) > 1000.0);
    assert_eq!(sample(&metrics, &["edgeinfer_mqtt_share_connected"]), 1.0);
    let mut fleet = Client::connect(site.mosquitto.port, "sf-fleet", &["edgeinfer/gw-f2/status"]).await;
    let (_, status) = fleet.next_json().await;
    let group = &status["share_group"];
    assert_eq!(
        (group["group"].as_str(), group["joined"].as_bool()),
        (Some("edgeinfer"), Some(true)),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_the_group_first_and_loses_nothing() {
    let _one = ONE_SITE_AT_A_TIME.lock().await;
    let Some(mut site) = start_site() else { return };
    let mut devices = Devices::connect(site.mosquitto.port).await;
    devices.load(Duration::from_secs(3), |_| {}).await;

    let victim = IDS[0];
    let fault = Instant::now();
    site.nodes[0].0.signal("TERM");
    let log = site.nodes[0].0.log.clone();
    let mut left_at = None;
    devices
        .load(Duration::from_secs(6), |_| {
            if left_at.is_none() && log.lock().unwrap().iter().any(|l| l.contains("left share group")) {
                left_at = Some(Instant::now());
            }
        })
        .await;
    let status = site.nodes[0].0.wait(Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
    let restart_at = Instant::now();
    site.nodes[0] = start_node(&site.mosquitto, victim);
    let back = Instant::now();
    devices.load(Duration::from_secs(5), |_| {}).await;
    devices.settle().await;

    // Nothing lost, and nothing handed to it after it left.
    let unanswered: Vec<usize> =
        devices.sent.iter().enumerate().filter(|(_, s)| s.answer.is_none()).map(|(i, _)| i).collect();
    assert!(
        unanswered.is_empty(),
        "{} of {} unanswered: {unanswered:?}",
        unanswered.len(),
        devices.sent.len()
    );
    let moved = devices.moved_after(fault, restart_at, victim);
    assert!(moved < Duration::from_secs(2), "the share moved {moved:?} after SIGTERM");
    let left_at = left_at.expect("the stopping node logged that it left the group");
    let late = devices.sent.iter().filter(|s| {
        s.answer.as_ref().is_some_and(|(_, n)| n == victim) && s.at > left_at && s.at < restart_at
    });
    assert_eq!(late.count(), 0, "requests sent after {victim} left were answered by it");
    let log = log.lock().unwrap().join("\n");
    assert!(log.contains(" 0 arrived after leaving"), "{log}");
    let share = assert_rejoined(&devices, back + Duration::from_secs(1), Instant::now() - DEADLINE, victim);
    summary("sigterm", &devices, fault, moved);
    eprintln!("share-summary sigterm: back after restart with {share:.3} of the requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_hung_without_a_tcp_reset_loses_its_share_after_keep_alive_and_expiry_not_an_hour() {
    let _one = ONE_SITE_AT_A_TIME.lock().await;
    let Some(site) = start_site() else { return };
    let mut devices = Devices::connect(site.mosquitto.port).await;
    devices.load(Duration::from_secs(3), |_| {}).await;

    let victim = IDS[0];
    let fault = Instant::now();
    // SIGSTOP: the process hangs, its sockets stay open, the broker hears
    // nothing until the keep alive runs out.
    site.nodes[0].0.signal("STOP");
    devices.load(worst_case() + SILENT_SLACK + Duration::from_secs(3), |_| {}).await;
    let resumed_at = Instant::now();
    site.nodes[0].0.signal("CONT");
    // It finds its share connection gone and joins again within a second
    // or two (its reconnection backoff).
    let back = Instant::now() + Duration::from_secs(2);
    devices.load(Duration::from_secs(7), |_| {}).await;
    devices.settle().await;
    let moved = assert_survivors_take_the_share(&devices, fault, resumed_at, victim, SILENT_SLACK);
    // Not before the keep alive ran out: the broker could not tell.
    assert!(moved >= Duration::from_secs_f64(KEEP_ALIVE_S), "the share moved {moved:?} after SIGSTOP");
    let share = assert_rejoined(&devices, back + Duration::from_secs(1), Instant::now() - DEADLINE, victim);
    summary("sigstop", &devices, fault, moved);
    eprintln!("share-summary sigstop: back after SIGCONT with {share:.3} of the requests");
}
