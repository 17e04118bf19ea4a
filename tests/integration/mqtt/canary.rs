//! Rollouts judged on the node: `models rollout` against the real binary
//! through mosquitto, with many devices (one reply topic each) sending
//! steady load, and the decisions read from the events topic.

use super::rollout::models_command;
use super::support::{
    Client, Mosquitto, Node, PacedLoad, admin_get_json, admin_http, admin_token_env, copy_digits_version,
    copy_test_version, get_json, http_with, node_with_http, sample, scrape,
};
use crate::{digits_request, heldout};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Devices, each with its own reply topic: enough that 5% of them is some.
const DEVICES: usize = 200;

/// A node on mosquitto with `digits` v1 pinned stable (by `models promote`
/// with no node running) beside the other versions `prepare` puts in.
struct Site {
    node: Node,
    mosquitto: Mosquitto,
    http: u16,
    id: &'static str,
    models: tempfile::TempDir,
    state: tempfile::TempDir,
    /// The node's environment beyond its directories.
    env: Vec<(String, String)>,
}

impl Site {
    fn start(id: &'static str, prepare: impl FnOnce(&std::path::Path)) -> Option<Site> {
        Self::start_with(id, prepare, &[])
    }

    fn start_with(
        id: &'static str,
        prepare: impl FnOnce(&std::path::Path),
        env: &[(&str, &str)],
    ) -> Option<Site> {
        let mosquitto = Mosquitto::start()?;
        let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        copy_digits_version(models.path(), "1", false);
        prepare(models.path());
        models_command(models.path(), state.path(), &["promote", "digits", "1"]).unwrap();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let (node, http) = Self::node(&mosquitto, id, &models, &state, &env);
        Some(Site { node, mosquitto, http, id, models, state, env })
    }

    fn node(
        mosquitto: &Mosquitto,
        id: &str,
        models: &tempfile::TempDir,
        state: &tempfile::TempDir,
        extra: &[(String, String)],
    ) -> (Node, u16) {
        let (m, s) = (models.path().display().to_string(), state.path().display().to_string());
        let mut env = vec![
            ("EDGEINFER_NODE__MODELS_DIR", m.as_str()),
            ("EDGEINFER_NODE__STATE_DIR", s.as_str()),
            admin_token_env(),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        node_with_http(&mosquitto.url(), id, &env)
    }

    /// kill -9, and a new process on the same directories.
    fn restart(&mut self) {
        self.node.kill9();
        (self.node, self.http) = Self::node(&self.mosquitto, self.id, &self.models, &self.state, &self.env);
    }

    /// `edgeinfer models ARGS --url` this node, in the background.
    fn command(&self, args: &[&str]) -> tokio::task::JoinHandle<Result<Value, String>> {
        let (models, state): (PathBuf, PathBuf) = (self.models.path().into(), self.state.path().into());
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--url".into(), format!("http://127.0.0.1:{}", self.http)]);
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            models_command(&models, &state, &args)
        })
    }

    async fn json(&self, path: &'static str) -> Value {
        let port = self.http;
        tokio::task::spawn_blocking(move || admin_get_json(port, path)).await.unwrap().1
    }

    async fn metrics(&self) -> String {
        let port = self.http;
        tokio::task::spawn_blocking(move || scrape(port)).await.unwrap()
    }
}

/// The devices' side: requests sent, replies and events received.
struct Fleet {
    devices: Client,
    events: Client,
    topic: String,
    tag: &'static str,
    sent_at: Vec<Instant>,
    replies: HashMap<usize, Vec<Value>>,
    /// Each decision with when it arrived.
    decisions: Vec<(Instant, Value)>,
    /// Sent with `parameters.deadline_ms` from request `.0` on, where an
    /// error reply is expected of some.
    deadline: Option<(usize, u64)>,
    /// The field feedback a device sends about a reply (to request `id`),
    /// on the site's feedback topic.
    feedback: Option<fn(usize, &Value) -> Option<Value>>,
}

impl Fleet {
    async fn connect(site: &Site, tag: &'static str) -> Fleet {
        let port = site.mosquitto.port;
        let events =
            Client::connect(port, &format!("{tag}-events"), &[&format!("edgeinfer/{}/events", site.id)])
                .await;
        let devices = Client::connect(port, &format!("{tag}-devices"), &[&format!("{tag}/+/replies")]).await;
        let topic = format!("edgeinfer/{}/infer/digits", site.id);
        let (sent_at, replies, decisions) = (Vec::new(), HashMap::new(), Vec::new());
        Fleet { devices, events, topic, tag, sent_at, replies, decisions, deadline: None, feedback: None }
    }
}

impl PacedLoad for Fleet {
    async fn send(&mut self) {
        let i = self.sent_at.len();
        let split = heldout();
        let mut request = digits_request(&i.to_string(), &[split[i % split.len()].1.clone()]);
        if let Some((_, ms)) = self.deadline {
            request["parameters"] = serde_json::json!({"deadline_ms": ms});
        }
        let payload = request.to_string();
        let reply_to = format!("{}/dev{}/replies", self.tag, i % DEVICES);
        self.devices.request(&self.topic, payload.into_bytes(), &reply_to, b"", None).await;
        self.sent_at.push(Instant::now());
    }

    fn take(&mut self) {
        while let Ok(p) = self.devices.inbox.try_recv() {
            let reply: Value = serde_json::from_slice(&p.payload).unwrap();
            let id: usize = reply["id"].as_str().unwrap().parse().unwrap();
            if let Some(feedback) = self.feedback.and_then(|f| f(id, &reply)) {
                let qos = rumqttc::v5::mqttbytes::QoS::AtLeastOnce;
                let body = feedback.to_string().into_bytes();
                self.devices.client.try_publish("edgeinfer/feedback", qos, false, body).unwrap();
            }
            self.replies.entry(id).or_default().push(reply);
        }
        while let Ok(p) = self.events.inbox.try_recv() {
            self.decisions.push((Instant::now(), serde_json::from_slice(&p.payload).unwrap()));
        }
    }
}

impl Fleet {
    fn decided(&self, action: &str) -> Option<&(Instant, Value)> {
        self.decisions.iter().find(|(_, d)| d["action"] == action)
    }

    /// Waits for every reply, then checks each request got exactly one,
    /// without an error.
    async fn settle(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.replies.len() < self.sent_at.len() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.take();
        }
        // A duplicate would come after the last first answer.
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.take();
        for id in 0..self.sent_at.len() {
            let answers = self.replies.get(&id).unwrap_or_else(|| panic!("request {id} was not answered"));
            assert_eq!(answers.len(), 1, "request {id} answered {} times", answers.len());
            if self.deadline.is_none_or(|(from, _)| id < from) {
                assert!(answers[0].get("error").is_none(), "{}", answers[0]);
            }
        }
    }

    fn version(&self, id: usize) -> &str {
        self.replies[&id][0]["model_version"].as_str().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_canary_goes_through_every_step_and_each_request_is_answered_once_by_the_version_it_names() {
    let Some(site) = Site::start("gw-canary", |m| copy_digits_version(m, "2", false)) else { return };
    let mut fleet = Fleet::connect(&site, "cn").await;
    fleet.load_until(Duration::from_millis(300), |_| false).await;
    // v2 is v1's twin: the steps are what this test is about, so its
    // latency gate is wide (a debug build on a shared machine is noisy).
    let gates = "bake_s=1,min_requests=15,max_p99_ratio=5,p99_slack_ms=50";
    let started = site.command(&["rollout", "digits", "2", "--gates", gates]).await.unwrap().unwrap();
    assert_eq!(
        (started["action"].as_str(), started["from"].as_str()),
        (Some("started"), Some("1")),
        "{started}"
    );
    let promoted = fleet.load_until(Duration::from_secs(90), |f| f.decided("promoted").is_some()).await;
    let status = site.json("/models/status?model=digits").await;
    assert!(promoted, "not promoted in 90 s: {status:#}");
    let promoted_at = fleet.decided("promoted").unwrap().0;
    fleet.load_until(Duration::from_millis(500), |_| false).await;
    fleet.settle().await;

    // Every step, once each, in order, on passing gates.
    let actions: Vec<&str> = fleet.decisions.iter().map(|(_, d)| d["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["started", "stepped", "stepped", "stepped", "promoted"], "{:#?}", fleet.decisions);
    for (_, d) in &fleet.decisions[1..] {
        let gates = d["gates"].as_array().unwrap();
        assert!(gates.iter().all(|g| g["result"] == "pass" || g["result"] == "off"), "{d}");
        assert!(gates.iter().any(|g| g["gate"] == "agreement" && g["samples"].as_u64() >= Some(15)), "{d}");
    }
    for (step, share) in [(1, "25%"), (2, "50%"), (3, "100%")] {
        assert!(
            fleet.decisions[step].1["reason"].as_str().unwrap().contains(share),
            "{:?}",
            fleet.decisions[step]
        );
    }
    // A device, once on v2, stays there; after the promotion all are.
    let mut on_v2 = [false; DEVICES];
    let mut v2_answers = 0;
    for id in 0..fleet.sent_at.len() {
        let device = id % DEVICES;
        match fleet.version(id) {
            "2" => (on_v2[device], v2_answers) = (true, v2_answers + 1),
            "1" => assert!(!on_v2[device], "device {device} went back to v1 at request {id}"),
            other => panic!("version {other}"),
        }
        if fleet.sent_at[id] > promoted_at {
            assert_eq!(fleet.version(id), "2", "request {id}, sent after the promotion");
        }
    }
    // The version each reply names is the one the metrics counted.
    let metrics = site.metrics().await;
    let counted = sample(&metrics, &["edgeinfer_requests_total{", "version=\"2\"", "outcome=\"ok\""]);
    assert_eq!(counted, v2_answers as f64);
    assert_eq!(sample(&metrics, &["edgeinfer_rollout_decisions_total{", "action=\"stepped\""]), 3.0);
    assert_eq!(sample(&metrics, &["edgeinfer_rollout_step{", "model=\"digits\""]), 0.0);
    let report = &status[0];
    assert_eq!((report["stable"].as_str(), report["candidate"].is_null()), (Some("2"), true), "{status:#}");
    eprintln!("{} requests, {v2_answers} answered by v2; promoted through 4 steps", fleet.sent_at.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_labels_fail_agreement_a_slow_version_fails_latency_and_shadow_answers_are_never_seen() {
    let Some(site) = Site::start("gw-gates", |m| copy_test_version(m, "digits-wrong-labels", "2")) else {
        return;
    };
    let mut fleet = Fleet::connect(&site, "gt").await;
    // v2 runs as fast as v1: only its labels are wrong, so its latency
    // gate is wide here (a debug build on a shared machine is noisy).
    let gates = "bake_s=1,min_requests=20,p99_slack_ms=50";
    let judged = |fleet: &Fleet, n: usize| {
        fleet.decisions.iter().filter(|(_, d)| d["action"] == "rolled_back").count() >= n
    };

    // Wrong labels, canary: rolled back for agreement.
    site.command(&["rollout", "digits", "2", "--steps", "50,100", "--gates", gates]).await.unwrap().unwrap();
    assert!(fleet.load_until(Duration::from_secs(60), |f| judged(f, 1)).await, "{:#?}", fleet.decisions);
    let (rolled_back_at, decision) = fleet.decided("rolled_back").cloned().unwrap();
    let reason = decision["reason"].as_str().unwrap();
    assert!(reason.starts_with("gate agreement failed"), "{decision}");
    let agreement = decision["gates"].as_array().unwrap().iter().find(|g| g["gate"] == "agreement").unwrap();
    assert_eq!(agreement["result"], "fail", "{decision}");
    assert!(agreement["candidate"].as_f64().unwrap() < 0.2, "{decision}");
    let status = site.json("/models/status?model=digits").await;
    assert_eq!(status[0]["history"].as_array().unwrap().last().unwrap()["reason"], reason, "{status:#}");
    assert!(status[0]["candidate"].is_null(), "{status:#}");
    let metrics = site.metrics().await;
    // Once it ended, no gate shows a result (the decision has them).
    assert_eq!(sample(&metrics, &["edgeinfer_rollout_gate{", "gate=\"agreement\"", "result=\"fail\""]), 0.0);
    fleet.load_until(Duration::from_millis(300), |_| false).await;

    // Shadow: every answer is stable's, while the candidate's are compared
    // (and found wrong).
    let shadow_from = fleet.sent_at.len();
    site.command(&["rollout", "digits", "2", "--mode", "shadow", "--gates", gates]).await.unwrap().unwrap();
    assert!(fleet.load_until(Duration::from_secs(60), |f| judged(f, 2)).await, "{:#?}", fleet.decisions);
    let shadow_to = fleet.sent_at.len();
    let last = &fleet.decisions.last().unwrap().1;
    assert!(last["reason"].as_str().unwrap().starts_with("gate agreement failed"), "{last}");
    fleet.settle().await;
    let split = heldout();
    let mut right = 0;
    for id in shadow_from..shadow_to {
        let reply = &fleet.replies[&id][0];
        assert_eq!(reply["model_version"], "1", "request {id} in shadow mode: {reply}");
        let label = reply["parameters"]["label"].as_str().and_then(|l| l.parse::<usize>().ok());
        right += usize::from(label == Some(split[id % split.len()].0));
    }
    assert!(
        right * 10 > (shadow_to - shadow_from) * 9,
        "stable's labels: {right} of {} right",
        shadow_to - shadow_from
    );
    for id in 0..fleet.sent_at.len() {
        if fleet.sent_at[id] > rolled_back_at + Duration::from_millis(100) {
            assert_eq!(fleet.version(id), "1", "request {id}, sent after the rollback");
        }
    }

    // A slow version, dropped in and found by SIGHUP: rolled back for latency.
    copy_test_version(site.models.path(), "digits-slow", "3");
    site.node.signal("HUP");
    site.node.wait_for_line("reloaded", Duration::from_secs(30));
    let gates = "bake_s=1,min_requests=20";
    site.command(&["rollout", "digits", "3", "--steps", "50,100", "--gates", gates]).await.unwrap().unwrap();
    assert!(fleet.load_until(Duration::from_secs(60), |f| judged(f, 3)).await, "{:#?}", fleet.decisions);
    let last = &fleet.decisions.last().unwrap().1;
    assert!(last["reason"].as_str().unwrap().starts_with("gate latency failed"), "{last}");
    let latency = last["gates"].as_array().unwrap().iter().find(|g| g["gate"] == "latency").unwrap();
    assert!(latency["candidate"].as_f64() > latency["stable"].as_f64(), "{last}");
    fleet.settle().await;
    let retained = {
        let mut watcher =
            Client::connect(site.mosquitto.port, "gt-watch", &["edgeinfer/gw-gates/status"]).await;
        watcher.next_json().await.1
    };
    let rollout = &retained["rollout"]["digits"];
    assert_eq!(rollout["stable"], "1", "{retained}");
    assert!(rollout["last_decision"]["reason"].as_str().unwrap().contains("latency"), "{retained}");

    // The slow one again, with devices that wait at most 4 ms: its answers
    // run out of time and count as failures, not as missing samples.
    fleet.deadline = Some((fleet.sent_at.len(), 4));
    site.command(&["rollout", "digits", "3", "--steps", "50,100", "--gates", gates]).await.unwrap().unwrap();
    assert!(fleet.load_until(Duration::from_secs(60), |f| judged(f, 4)).await, "{:#?}", fleet.decisions);
    let last = &fleet.decisions.last().unwrap().1;
    assert!(last["reason"].as_str().unwrap().starts_with("gate error_rate failed"), "{last}");
    let errors = last["gates"].as_array().unwrap().iter().find(|g| g["gate"] == "error_rate").unwrap();
    assert!(errors["candidate"].as_f64().unwrap() > 0.5, "{last}");
    fleet.settle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_little_data_holds_a_step_kill_9_resumes_it_and_rollback_returns_everyone_at_once() {
    let Some(mut site) = Site::start("gw-hold", |m| copy_digits_version(m, "2", false)) else { return };
    let mut fleet = Fleet::connect(&site, "hd").await;
    // More samples than the test will ever send: the step cannot pass.
    let gates = "bake_s=1,min_requests=100000,max_wait_s=4";
    site.command(&["rollout", "digits", "2", "--steps", "50,100", "--gates", gates]).await.unwrap().unwrap();
    fleet.load_until(Duration::from_millis(800), |_| false).await;
    let before = site.json("/models/status?model=digits").await[0]["candidate"].clone();
    assert_eq!((before["step"].as_u64(), before["version"].as_str()), (Some(0), Some("2")), "{before}");

    site.restart();
    let after = site.json("/models/status?model=digits").await[0]["candidate"].clone();
    assert_eq!(after, before, "the same step, started when it was, after kill -9");
    let resumed_from = fleet.sent_at.len();
    let held = fleet.load_until(Duration::from_secs(30), |f| f.decided("held").is_some()).await;
    assert!(held, "{:#?}", fleet.decisions);
    let reason = fleet.decided("held").unwrap().1["reason"].as_str().unwrap().to_string();
    assert!(reason.contains("inconclusive") && reason.contains("of 100000"), "{reason}");
    let status = site.json("/models/status?model=digits").await;
    let report = &status[0];
    assert_eq!(report["stable"], "1", "held, not promoted: {status:#}");
    assert_eq!(report["previous"], "1", "a rollback now ends the rollout on stable: {status:#}");
    assert!(report["candidate"]["held"].as_str().is_some(), "{status:#}");
    assert!(
        report["trial"]["gates"].as_array().unwrap().iter().any(|g| g["result"] == "inconclusive"),
        "{status:#}"
    );
    let metrics = site.metrics().await;
    let gate = |result: &str| {
        let result = format!("result=\"{result}\"");
        sample(&metrics, &["edgeinfer_rollout_gate{", "gate=\"agreement\"", &result])
    };
    assert_eq!((gate("inconclusive"), gate("pass")), (1.0, 0.0), "{metrics}");
    assert_eq!(sample(&metrics, &["edgeinfer_rollout_step{", "model=\"digits\""]), 50.0);

    // Rollback during the canary, straight to the admin route: every request
    // sent after it answered is v1's.
    let port = site.http;
    let asked = Instant::now();
    let answered = tokio::task::spawn(async move {
        tokio::task::spawn_blocking(move || admin_http(port, "POST", "/models/rollback?model=digits"))
            .await
            .unwrap()
    });
    let mut rolled_back = None;
    fleet
        .load_until(Duration::from_secs(10), |_| {
            if rolled_back.is_none() && answered.is_finished() {
                rolled_back = Some(Instant::now());
            }
            rolled_back.is_some_and(|at| at.elapsed() > Duration::from_millis(500))
        })
        .await;
    let (code, body) = answered.await.unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let rolled_back = rolled_back.expect("the rollback answered");
    assert!(rolled_back - asked < Duration::from_secs(1), "rollback took {:?}", rolled_back - asked);
    fleet.settle().await;
    let mut v2_after_restart = 0;
    for id in resumed_from..fleet.sent_at.len() {
        if fleet.sent_at[id] > rolled_back {
            assert_eq!(fleet.version(id), "1", "request {id}, sent after the rollback");
        } else if fleet.version(id) == "2" {
            v2_after_restart += 1;
        }
    }
    assert!(v2_after_restart > 0, "the resumed step routed devices to v2");
    eprintln!(
        "the rollback answered in {:?}; every request sent after it was answered by v1",
        rolled_back - asked
    );
    let actions: Vec<&str> = fleet.decisions.iter().map(|(_, d)| d["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["started", "held", "rolled_back"], "{:#?}", fleet.decisions);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auto_rollout_a_version_dropped_in_starts_a_canary_unless_it_fails_its_checks() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    let (m, s) = (models.path().display().to_string(), state.path().display().to_string());
    let (node, mqtt, http_port) = tokio::task::spawn_blocking(move || {
        super::support::embedded_node_with_http(
            "gw-auto",
            &[
                ("EDGEINFER_NODE__MODELS_DIR", m.as_str()),
                ("EDGEINFER_NODE__STATE_DIR", s.as_str()),
                ("EDGEINFER_MODELS__DIGITS__AUTO_ROLLOUT", "canary"),
                ("EDGEINFER_MODELS__DIGITS__ROLLOUT__BAKE_S", "3600"),
            ],
        )
    })
    .await
    .unwrap();
    let mut events = Client::connect(mqtt, "auto-events", &["edgeinfer/gw-auto/events"]).await;
    let status = || async move {
        tokio::task::spawn_blocking(move || get_json(http_port, "/models/status")).await.unwrap().1
    };

    // A version whose sha256 check fails is refused at load: no rollout.
    copy_digits_version(models.path(), "2", true);
    node.signal("HUP");
    node.wait_for_line("reloaded", Duration::from_secs(30));
    assert!(events.next(Duration::from_millis(500)).await.is_none(), "no decision for a refused version");
    let report = status().await;
    assert_eq!(
        (report[0]["serving"].as_str(), report[0]["candidate"].is_null()),
        (Some("1"), true),
        "{report}"
    );

    // A good one starts a canary against what served before: it does not
    // take every device at once.
    copy_digits_version(models.path(), "3", false);
    node.signal("HUP");
    node.wait_for_line("reloaded", Duration::from_secs(30));
    let (_, started) = events.next_json().await;
    let what = (started["action"].as_str(), started["version"].as_str(), started["from"].as_str());
    assert_eq!(what, (Some("started"), Some("3"), Some("1")), "{started}");
    assert_eq!(started["by"], "auto_rollout (reload)", "{started}");
    let report = status().await;
    let candidate = &report[0]["candidate"];
    assert_eq!(
        (candidate["version"].as_str(), candidate["mode"].as_str()),
        (Some("3"), Some("canary")),
        "{report}"
    );
    assert_eq!((report[0]["stable"].as_str(), candidate["step"].as_u64()), (Some("1"), Some(0)), "{report}");
    // HTTP devices (no reply topic) are split by the X-Device-Id they send:
    // most stay on v1.
    let versions = tokio::task::spawn_blocking(move || {
        (0..40)
            .map(|i| {
                let req = digits_request(&format!("auto-{i}"), &[heldout()[i].1.clone()]).to_string();
                let headers = format!("Content-Type: application/json\r\nX-Device-Id: auto-{i}");
                let path = "/v2/models/digits/infer";
                let (code, body) = http_with(http_port, "POST", path, headers.as_bytes(), req.as_bytes());
                let reply: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(code, 200, "{reply}");
                reply["model_version"].as_str().unwrap().to_string()
            })
            .collect::<Vec<String>>()
    })
    .await
    .unwrap();
    let on_v1 = versions.iter().filter(|v| *v == "1").count();
    assert!(on_v1 >= 30 && versions.iter().all(|v| v == "1" || v == "3"), "{versions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ab_split_keeps_figures_per_version_and_decides_nothing_even_with_data_enough() {
    let Some(site) = Site::start("gw-ab", |m| copy_digits_version(m, "2", false)) else { return };
    let mut fleet = Fleet::connect(&site, "ab").await;
    let gates = "bake_s=0,min_requests=5,max_wait_s=1";
    let started =
        site.command(&["rollout", "digits", "2", "--mode", "ab", "--gates", gates]).await.unwrap().unwrap();
    assert_eq!(started["action"], "started", "{started}");
    // Fewer requests than held-out rows: no input twice, so no cache hit
    // (a hit is not a run of either version, and is not counted).
    let rows = heldout().len();
    fleet.load_until(Duration::from_secs(3), |f| f.sent_at.len() + 1 >= rows).await;
    fleet.settle().await;
    // Past a judging tick after the last answer.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let status = site.json("/models/status?model=digits").await;
    let trial = &status[0]["trial"];
    assert_eq!((trial["mode"].as_str(), trial["share"].as_u64()), (Some("ab"), Some(50)), "{status:#}");
    let per_version = |v: &str| fleet.replies.values().filter(|r| r[0]["model_version"] == v).count() as u64;
    // Stable also ran each of the candidate's answers, to compare them.
    let compared = trial["compared"].as_u64().unwrap();
    assert_eq!(compared, per_version("2"), "{status:#}");
    assert_eq!(trial["agreed"].as_u64(), Some(compared), "twins agree: {status:#}");
    assert_eq!(trial["stable"]["answers"].as_u64(), Some(per_version("1") + compared), "{status:#}");
    assert_eq!(trial["candidate"]["answers"].as_u64(), Some(per_version("2")), "{status:#}");
    assert!(per_version("1") > 40 && per_version("2") > 40, "both halves answer");
    assert!(trial["candidate"]["p99_ms"].as_f64().is_some() && trial["stable"]["p99_ms"].as_f64().is_some());
    assert!(trial["gates"].as_array().unwrap().iter().all(|g| g["result"] != "inconclusive"), "{status:#}");
    // Every gate judged, none decides: still running, no other decision.
    fleet.take();
    let actions: Vec<&str> = fleet.decisions.iter().map(|(_, d)| d["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["started"], "{:#?}", fleet.decisions);
    assert_eq!(status[0]["candidate"]["version"], "2", "{status:#}");
}

/// The true label of request `id`'s input.
fn truth(id: usize) -> String {
    let split = heldout();
    split[id % split.len()].0.to_string()
}

/// Issue 40: devices report the truth later, and the field gates judge the
/// candidate on it. A candidate that agrees with stable on nothing is let
/// through the agreement gate (`min_agreement=0`) and rolled back by field
/// accuracy; a twin of stable whose devices report a lower outcome (a
/// simulated business metric) by the outcome gate; feedback on 5% of too
/// few answers leaves both field gates inconclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn field_feedback_rolls_back_wrong_labels_and_a_lower_outcome_and_too_little_stays_inconclusive() {
    let Some(site) = Site::start("gw-field", |m| {
        copy_test_version(m, "digits-wrong-labels", "2");
        copy_digits_version(m, "3", false);
    }) else {
        return;
    };
    let mut fleet = Fleet::connect(&site, "fd").await;
    let gates = "bake_s=1,min_requests=20,min_agreement=0,min_feedback=30,max_p99_ratio=5,p99_slack_ms=50";
    let rolled_back =
        |f: &Fleet, n: usize| f.decisions.iter().filter(|(_, d)| d["action"] == "rolled_back").count() >= n;
    let field_gate = |decision: &Value, name: &str| {
        decision["gates"].as_array().unwrap().iter().find(|g| g["gate"] == name).cloned().unwrap()
    };

    // Every answer's true label comes back.
    fleet.feedback = Some(|id, _| Some(serde_json::json!({"id": id.to_string(), "label": truth(id)})));
    site.command(&["rollout", "digits", "2", "--steps", "50,100", "--gates", gates]).await.unwrap().unwrap();
    assert!(fleet.load_until(Duration::from_secs(60), |f| rolled_back(f, 1)).await, "{:#?}", fleet.decisions);
    let decision = &fleet.decided("rolled_back").unwrap().1;
    assert!(decision["reason"].as_str().unwrap().starts_with("gate field_accuracy failed"), "{decision}");
    let accuracy = field_gate(decision, "field_accuracy");
    assert!(
        accuracy["candidate"].as_f64().unwrap() < 0.3 && accuracy["stable"].as_f64().unwrap() > 0.8,
        "{decision}"
    );
    assert_eq!(field_gate(decision, "agreement")["result"], "pass", "let through: {decision}");
    fleet.load_until(Duration::from_millis(300), |_| false).await;

    // A twin, but its devices accept its answers less often: v1's answers
    // are accepted 7 times in 10, v3's 4 in 10.
    fleet.feedback = Some(|id, reply| {
        let accepted = match reply["model_version"].as_str() {
            Some("3") => id % 10 < 4,
            _ => id % 10 < 7,
        };
        Some(serde_json::json!({"id": id.to_string(), "outcome": f64::from(u8::from(accepted))}))
    });
    site.command(&["rollout", "digits", "3", "--steps", "50,100", "--gates", gates]).await.unwrap().unwrap();
    assert!(fleet.load_until(Duration::from_secs(60), |f| rolled_back(f, 2)).await, "{:#?}", fleet.decisions);
    let decision = &fleet.decisions.iter().rev().find(|(_, d)| d["action"] == "rolled_back").unwrap().1;
    assert!(decision["reason"].as_str().unwrap().starts_with("gate field_outcome failed"), "{decision}");
    assert_eq!(field_gate(decision, "agreement")["result"], "pass", "twins agree: {decision}");
    let outcome = field_gate(decision, "field_outcome");
    let (c, s) = (outcome["candidate"].as_f64().unwrap(), outcome["stable"].as_f64().unwrap());
    assert!((0.25..0.55).contains(&c) && (0.55..0.85).contains(&s), "{decision}");
    fleet.load_until(Duration::from_millis(300), |_| false).await;

    // Feedback on 5% of the answers, every one saying the candidate was
    // wrong: after 200 more requests each version has a few, short of 30.
    fleet.feedback = Some(|id, reply| {
        let wrong = if reply["model_version"] == "3" { "x" } else { "" };
        (id % 20 == 0)
            .then(|| serde_json::json!({"id": id.to_string(), "label": format!("{}{wrong}", truth(id))}))
    });
    let from = fleet.sent_at.len();
    let gates = format!("{gates},max_wait_s=3600");
    site.command(&["rollout", "digits", "3", "--steps", "50,100", "--gates", &gates]).await.unwrap().unwrap();
    fleet.load_until(Duration::from_secs(30), |f| f.sent_at.len() >= from + 200).await;
    fleet.settle().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let status = site.json("/models/status?model=digits").await;
    let trial = &status[0]["trial"];
    let gate =
        |name: &str| trial["gates"].as_array().unwrap().iter().find(|g| g["gate"] == name).cloned().unwrap();
    assert_eq!(gate("field_accuracy")["result"], "inconclusive", "{status:#}");
    assert!(gate("field_accuracy")["samples"].as_u64().unwrap() < 30, "{status:#}");
    assert_eq!(status[0]["candidate"]["version"], "3", "still on trial: {status:#}");
    fleet.take();
    assert_eq!(fleet.decisions.last().unwrap().1["action"], "started", "{:#?}", fleet.decisions);
}

/// Issue 40: an A/B split with devices reporting a simulated business
/// outcome (v1's answers accepted with probability 0.7, its twin v3's with
/// 0.4) and true labels; `models ab-report` on the run gives intervals
/// that contain the true differences: -0.3 for the outcome (significant),
/// 0 for the accuracy of twins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ab_report_intervals_contain_the_true_simulated_difference() {
    let Some(site) = Site::start("gw-abr", |m| copy_digits_version(m, "3", false)) else { return };
    let mut fleet = Fleet::connect(&site, "ar").await;
    fleet.feedback = Some(|id, reply| {
        if id % 2 == 1 {
            return Some(serde_json::json!({"id": id.to_string(), "label": truth(id)}));
        }
        let p = if reply["model_version"] == "3" { 0.4 } else { 0.7 };
        let accepted = fastrand::Rng::with_seed(id as u64).f64() < p;
        Some(serde_json::json!({"id": id.to_string(), "outcome": f64::from(u8::from(accepted))}))
    });
    let gates = "bake_s=0,min_requests=5,max_wait_s=3600";
    site.command(&["rollout", "digits", "3", "--mode", "ab", "--gates", gates]).await.unwrap().unwrap();
    fleet.load_until(Duration::from_secs(60), |f| f.sent_at.len() >= 1600).await;
    fleet.settle().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pages = tempfile::tempdir().unwrap();
    let dir = pages.path().join("report");
    let report =
        site.command(&["ab-report", "digits", "--report", dir.to_str().unwrap()]).await.unwrap().unwrap();
    assert_eq!(
        (report["baseline"].as_str(), report["level"].as_f64()),
        (Some("1"), Some(0.95)),
        "{report:#}"
    );
    let v3 = report["versions"].as_array().unwrap().iter().find(|v| v["version"] == "3").unwrap();
    let within =
        |i: &Value, truth: f64| i["low"].as_f64().unwrap() <= truth && truth <= i["high"].as_f64().unwrap();
    let outcome = &v3["outcome_difference"];
    assert!(within(outcome, -0.3) && !within(outcome, 0.0), "outcome: {report:#}");
    assert!(within(&v3["accuracy_difference"], 0.0), "accuracy of twins: {report:#}");
    let answered = fleet.replies.values().filter(|r| r[0]["model_version"] == "3").count() as u64;
    assert_eq!(v3["answers"].as_u64(), Some(answered), "{report:#}");
    assert!(v3["outcomes"].as_u64().unwrap() > 300 && v3["labels"].as_u64().unwrap() > 300, "{report:#}");
    // A level it has not, named.
    let err = site.command(&["ab-report", "digits", "--level", "0.8"]).await.unwrap().unwrap_err();
    assert!(err.contains("--level 0.8") && err.contains("0.95"), "{err}");

    // The page: self-contained, both tables, a chart a kind, each verdict.
    let page = std::fs::read_to_string(dir.join("index.html")).unwrap();
    for outside in ["<script", "<link", " src=", "<img", "url("] {
        assert!(!page.contains(outside), "the report refers to an outside file ({outside})");
    }
    let outcome = page.split("<section id=\"outcome\">").nth(1).unwrap().split("</section>").next().unwrap();
    assert!(outcome.contains("<td>v3</td>") && outcome.contains("] significant</td>"), "{outcome}");
    let accuracy =
        page.split("<section id=\"accuracy\">").nth(1).unwrap().split("</section>").next().unwrap();
    assert!(accuracy.contains("] not significant</td>"), "{accuracy}");
    assert_eq!(page.matches("<svg").count(), 2, "a chart a kind");
    let Some(chromium) = crate::chromium() else {
        return crate::skipped(
            "chromium is not installed (apt-get install chromium): the report is not rendered",
        );
    };
    let url = format!("file://{}", dir.join("index.html").display());
    let dom = crate::headless(&chromium, &pages.path().join("profile"), &["--dump-dom"], &url);
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert_eq!(dom.matches("<svg").count(), 2, "{dom}");
    assert!(dom.contains("<circle") && dom.contains("difference from v1"), "the charts' points and titles");
}

/// The config in service for `digits` as `models status` shows it: its
/// version and its text.
async fn config_in_service(site: &Site) -> (String, String) {
    let status = site.json("/models/status?model=digits").await;
    let config = &status[0]["config"];
    (config["version"].as_str().unwrap().to_string(), config["text"].as_str().unwrap().to_string())
}

/// A config change rolled out like a model version, through mosquitto with
/// a cloud tier: a threshold that escalates every answer fails the
/// escalation gate and is rolled back, and the config in service after is
/// byte-identical to stable's. A harmless change promoted by command then
/// serves, and `models rollback` returns the node's config byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_candidate_that_escalates_everything_is_rolled_back_to_stables_exact_config() {
    let (_cloud, cloud_port) = super::cascade::cloud_node(None);
    let url = format!("http://127.0.0.1:{cloud_port}");
    let env = [
        ("EDGEINFER_CLOUD__ENABLED", "true"),
        ("EDGEINFER_CLOUD__URL", url.as_str()),
        ("EDGEINFER_MODELS__DIGITS__CLOUD_MODEL", "digits-large"),
        ("EDGEINFER_MODELS__DIGITS__THRESHOLD", "0.3"),
    ];
    // v2 beside v1 only so that v1 can be pinned stable.
    let Some(site) = Site::start_with("gw-config", |m| copy_digits_version(m, "2", false), &env) else {
        return;
    };
    let files = tempfile::tempdir().unwrap();
    let escalate = files.path().join("escalate.toml");
    std::fs::write(&escalate, "# every answer to the cloud tier\nthreshold = 1.0\n").unwrap();
    let (stable_version, stable_text) = config_in_service(&site).await;
    assert!(stable_text.contains("threshold = 0.3"), "{stable_text}");
    let mut fleet = Fleet::connect(&site, "cf").await;
    let gates = "bake_s=1,min_requests=20,p99_slack_ms=200";
    let path = escalate.display().to_string();
    let started =
        site.command(&["rollout", "digits", "--config", &path, "--steps", "50,100", "--gates", gates]);
    let started = started.await.unwrap().unwrap();
    let candidate = started["config"]["to"].as_str().unwrap().to_string();
    assert_ne!(candidate, stable_version, "{started}");
    assert_eq!(started["version"], "1", "on stable's version: {started}");
    let rolled_back = |f: &Fleet| f.decided("rolled_back").is_some();
    assert!(fleet.load_until(Duration::from_secs(60), rolled_back).await, "{:#?}", fleet.decisions);
    let (rolled_back_at, decision) = fleet.decided("rolled_back").cloned().unwrap();
    assert!(decision["reason"].as_str().unwrap().starts_with("gate escalation failed"), "{decision}");
    assert_eq!(decision["config"]["from"], candidate.as_str(), "{decision}");
    let escalation =
        decision["gates"].as_array().unwrap().iter().find(|g| g["gate"] == "escalation").unwrap();
    assert!(escalation["candidate"].as_f64().unwrap() > 0.9, "{decision}");
    fleet.settle().await;
    // Every reply names the config it was served with: the candidate's
    // answers went to the cloud tier, stable's mostly did not.
    let config_of =
        |id: usize| fleet.replies[&id][0]["parameters"]["config_version"].as_str().unwrap().to_string();
    let (mut on_candidate, mut escalated) = (0, 0);
    for id in 0..fleet.sent_at.len() {
        let (config, reply) = (config_of(id), &fleet.replies[&id][0]);
        assert!(config == stable_version || config == candidate, "request {id}: {reply}");
        assert_eq!(reply["model_version"], "1", "{reply}");
        let after_rollback = fleet.sent_at[id] > rolled_back_at + Duration::from_millis(100);
        assert!(!(after_rollback && config == candidate), "request {id}, sent after the rollback: {reply}");
        if config == candidate {
            on_candidate += 1;
            escalated += usize::from(reply["parameters"]["served_by"] == "cloud");
        }
    }
    assert!(on_candidate >= 20 && escalated * 10 >= on_candidate * 9, "{escalated} of {on_candidate}");
    let after = config_in_service(&site).await;
    assert_eq!(after, (stable_version.clone(), stable_text.clone()), "byte for byte stable's");
    let state: Value =
        serde_json::from_slice(&std::fs::read(site.state.path().join("deployments.json")).unwrap()).unwrap();
    let kept = &state["models"]["digits"]["configs"][&candidate];
    assert_eq!(kept["file"], "# every answer to the cloud tier\nthreshold = 1.0\n", "the file, as given");
    assert!(state["models"]["digits"].get("stable_config").is_none(), "{state:#}");

    // A harmless change (a top-3 list on every reply), promoted by command.
    let top3 = files.path().join("top3.toml");
    std::fs::write(&top3, "top_k = 3\n").unwrap();
    let path = top3.display().to_string();
    let started =
        site.command(&["rollout", "digits", "--config", &path, "--mode", "ab"]).await.unwrap().unwrap();
    let promoted = site.command(&["promote", "digits"]).await.unwrap().unwrap();
    assert_eq!(promoted["config"]["to"], started["config"]["to"], "{promoted}");
    let (version, text) = config_in_service(&site).await;
    assert_eq!(Some(version.as_str()), started["config"]["to"].as_str());
    assert!(text.contains("top_k = 3") && text.contains("threshold = 0.3"), "{text}");
    let from = fleet.sent_at.len();
    fleet.load_until(Duration::from_millis(500), |_| false).await;
    fleet.settle().await;
    let reply = &fleet.replies[&from][0];
    assert_eq!(
        (
            reply["parameters"]["config_version"].as_str(),
            reply["parameters"]["top_k"].as_array().map(Vec::len)
        ),
        (Some(version.as_str()), Some(3)),
        "{reply}"
    );
    let back = site.command(&["rollback", "digits"]).await.unwrap().unwrap();
    assert_eq!(back["config"]["to"], Value::Null, "back to the node config's: {back}");
    assert_eq!(config_in_service(&site).await, (stable_version, stable_text), "byte for byte the node's");
}
