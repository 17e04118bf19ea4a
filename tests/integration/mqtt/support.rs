//! Real brokers, the real binary and MQTT clients for the service tests.

use crate::models_dir;
use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// One HTTP/1.1 request; returns the status and the body.
pub fn http(port: u16, method: &str, path: &str, body: &[u8], content_type: &str) -> (u16, Vec<u8>) {
    http_with(port, method, path, &[b"Content-Type: ", content_type.as_bytes()].concat(), body)
}

/// The same with `headers` (raw header lines, `\r\n`-separated, any bytes).
pub fn http_with(port: u16, method: &str, path: &str, headers: &[u8], body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    s.write_all(&[head.as_bytes(), headers, b"\r\n\r\n", body].concat()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("an HTTP response");
    let status = std::str::from_utf8(&raw[9..12]).unwrap().parse().unwrap();
    (status, raw[split + 4..].to_vec())
}

/// The admin token of the tests' nodes that take rollout commands (which
/// need one), and of `edgeinfer models` asking them.
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A file holding `ADMIN_TOKEN`, for `http.admin_token_file`; one per test
/// process.
pub fn admin_token_file() -> &'static str {
    static FILE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("edgeinfer-test-admin-{}.token", std::process::id()));
        std::fs::write(&path, format!("{ADMIN_TOKEN}\n")).unwrap();
        path.display().to_string()
    })
}

/// `http.admin_token_file` as a node's environment sets it.
pub fn admin_token_env() -> (&'static str, &'static str) {
    ("EDGEINFER_HTTP__ADMIN_TOKEN_FILE", admin_token_file())
}

/// `http()` to an admin route of a node with `admin_token_env()`, no body.
pub fn admin_http(port: u16, method: &str, path: &str) -> (u16, Vec<u8>) {
    http_with(port, method, path, format!("Authorization: Bearer {ADMIN_TOKEN}").as_bytes(), b"")
}

/// `get_json()` for an admin route of a node with `admin_token_env()`.
pub fn admin_get_json(port: u16, path: &str) -> (u16, serde_json::Value) {
    let (status, body) = admin_http(port, "GET", path);
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{path}: {e}: {:?}", String::from_utf8_lossy(&body)));
    (status, json)
}

/// `POST /v2/models/digits/infer` with `req`; the reply, asserting 200.
pub fn infer_digits(port: u16, req: &serde_json::Value) -> serde_json::Value {
    let (status, body) =
        http(port, "POST", "/v2/models/digits/infer", req.to_string().as_bytes(), "application/json");
    let reply: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200, "{reply}");
    reply
}

/// The node's `/metrics` text, asserting 200.
pub fn scrape(port: u16) -> String {
    let (status, body) = http(port, "GET", "/metrics", b"", "text/plain");
    assert_eq!(status, 200);
    String::from_utf8(body).unwrap()
}

pub fn get_json(port: u16, path: &str) -> (u16, serde_json::Value) {
    let (status, body) = http(port, "GET", path, b"", "application/json");
    (
        status,
        serde_json::from_slice(&body)
            .unwrap_or_else(|e| panic!("{path}: {e}: {:?}", String::from_utf8_lossy(&body))),
    )
}

/// The value of the sample whose name and labels contain every `needle`.
pub fn sample(scrape: &str, needles: &[&str]) -> f64 {
    let line = scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| needles.iter().all(|n| l.contains(n)))
        .unwrap_or_else(|| panic!("no sample with {needles:?} in:\n{scrape}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A node serving HTTP on a free port; returns it and that port.
pub fn node_with_http(url: &str, id: &str, env: &[(&str, &str)]) -> (Node, u16) {
    let http_port = free_port_pair();
    let listen = format!("127.0.0.1:{http_port}");
    let mut all = vec![("EDGEINFER_HTTP__LISTEN", listen.as_str())];
    all.extend_from_slice(env);
    (Node::start(url, id, &all), http_port)
}

/// The same with its embedded broker; returns it, the MQTT port and the HTTP port.
/// A port `free_port_pair` found free can be taken by another test before
/// the node binds it: then the node exits saying so, and it starts again
/// on other ports.
pub fn embedded_node_with_http(id: &str, env: &[(&str, &str)]) -> (Node, u16, u16) {
    for _ in 0..3 {
        let (port, http_port) = (free_port_pair(), free_port_pair());
        let listen = format!("127.0.0.1:{http_port}");
        let mut all =
            vec![("EDGEINFER_MQTT__EMBEDDED_BROKER", "true"), ("EDGEINFER_HTTP__LISTEN", listen.as_str())];
        all.extend_from_slice(env);
        match Node::try_start(&format!("mqtt://127.0.0.1:{port}"), id, &all) {
            Ok(node) => return (node, port, http_port),
            Err(log) if log.iter().any(|l| l.contains("in use")) => eprintln!("ports taken, again: {log:?}"),
            Err(log) => panic!("node {id} did not log \"MQTT connected\"; its log:\n{}", log.join("\n")),
        }
    }
    panic!("node {id}: no free ports in 3 tries");
}

/// A port with its successor free too (the embedded broker's 3.1.1 listener).
pub fn free_port_pair() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if port < 65000 && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

fn wait_listening(port: u16) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A mosquitto broker on a free port, stopped on drop. `None` (with a clear
/// message) where mosquitto is not installed; CI installs it.
pub struct Mosquitto {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Mosquitto {
    pub fn start() -> Option<Mosquitto> {
        Self::start_on(free_port_pair())
    }

    pub fn start_on(port: u16) -> Option<Mosquitto> {
        Self::start_with(port, "", |_| {})
    }

    /// With `extra` appended to the config (more listeners); `prepare` writes
    /// files into the config's directory first.
    pub fn start_with(port: u16, extra: &str, prepare: impl FnOnce(&std::path::Path)) -> Option<Mosquitto> {
        let binary = ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(binary) = binary else {
            crate::skipped("mosquitto is not installed (apt-get install mosquitto mosquitto-clients)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        prepare(dir.path());
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "per_listener_settings true\nset_tcp_nodelay true\npersistence false\n\
                 max_queued_messages 10000\nmax_inflight_messages 0\n\
                 listener {port} 127.0.0.1\nallow_anonymous true\n{extra}"
            ),
        )
        .unwrap();
        let child = Command::new(binary)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_listening(port);
        Some(Mosquitto { child, port, _dir: dir })
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// With persistence on in `dir`, as sites run it: a broker stopped
    /// with `stop` and started again on the same `dir` keeps its sessions
    /// and the messages in flight.
    pub fn start_persistent(port: u16, dir: &std::path::Path) -> Option<Mosquitto> {
        // Started as root, mosquitto writes as its own user.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let extra = format!("persistence true\npersistence_location {}/\n", dir.display());
        Self::start_with(port, &extra, |_| {})
    }

    /// Stops the broker as a service manager would (SIGTERM: it saves its
    /// persistence file first).
    pub fn stop(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let _ = self.child.wait();
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `edgeinfer serve`, the real binary, stopped (SIGKILL) on drop.
pub struct Node {
    child: Child,
    pub id: String,
    lines: std_mpsc::Receiver<String>,
    /// Everything the node logged so far.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// A fresh state directory (the cache store) unless the test gave one.
    _state: Option<tempfile::TempDir>,
}

impl Node {
    /// Starts a node and waits until its subscriptions are in place.
    pub fn start(url: &str, id: &str, env: &[(&str, &str)]) -> Node {
        Node::try_start(url, id, env).unwrap_or_else(|log| {
            panic!("node {id} did not log \"MQTT connected\" within 30 s; its log:\n{}", log.join("\n"))
        })
    }

    /// `start`, or the node's log if it never got connected (it exited, or
    /// 30 s passed).
    pub fn try_start(url: &str, id: &str, env: &[(&str, &str)]) -> Result<Node, Vec<String>> {
        // EDGEINFER_TEST_BIN points the tests at another build (a release one,
        // to measure latency).
        let bin =
            std::env::var("EDGEINFER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_edgeinfer").into());
        let mut cmd = Command::new(bin);
        let models = env
            .iter()
            .find(|(k, _)| *k == "EDGEINFER_NODE__MODELS_DIR")
            .map(|(_, v)| std::path::PathBuf::from(v))
            .unwrap_or_else(models_dir);
        cmd.arg("serve")
            .arg("--models-dir")
            .arg(models)
            .arg("--log")
            .arg(
                env.iter()
                    .find(|(k, _)| *k == "EDGEINFER_LOG")
                    .map(|(_, v)| *v)
                    .unwrap_or("info,rumqttd=warn"),
            )
            .env_remove("EDGEINFER_CONFIG")
            .env_remove("EDGEINFER_TEST_BIN")
            .env("EDGEINFER_MQTT__URL", url)
            .env("EDGEINFER_HTTP__LISTEN", "")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // An empty id leaves the default: the host name.
        if !id.is_empty() {
            cmd.env("EDGEINFER_NODE__ID", id);
        }
        let state = if env.iter().any(|(k, _)| *k == "EDGEINFER_NODE__STATE_DIR") {
            None
        } else {
            let dir = tempfile::tempdir().unwrap();
            cmd.env("EDGEINFER_NODE__STATE_DIR", dir.path());
            Some(dir)
        };
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std_mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[node] {line}");
                sink.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let node = Node { child, id: id.into(), lines, log, _state: state };
        if node.saw_line("MQTT connected", Duration::from_secs(30)) {
            Ok(node)
        } else {
            Err(node.log.lock().unwrap().clone())
        }
    }

    pub fn wait_for_line(&self, needle: &str, timeout: Duration) {
        if !self.saw_line(needle, timeout) {
            panic!("node {} did not log {needle:?} within {timeout:?}", self.id);
        }
    }

    /// Whether the node logs a line with `needle` within `timeout` (false
    /// at once if it exits first).
    fn saw_line(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal("TERM");
        self.child.wait().unwrap()
    }

    /// The process id, to read its `/proc` entries.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `kill -NAME` (TERM, HUP, ...).
    pub fn signal(&self, name: &str) {
        let _ = Command::new("kill").arg(format!("-{name}")).arg(self.child.id().to_string()).status();
    }

    /// Waits for the process to exit on its own.
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "node {} did not exit within {timeout:?}", self.id);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// An MQTT 5 client that sends requests and collects what arrives on the
/// topics it subscribed to.
pub struct Client {
    pub client: AsyncClient,
    pub inbox: mpsc::UnboundedReceiver<Publish>,
}

impl Client {
    pub async fn connect(port: u16, id: &str, subscriptions: &[&str]) -> Client {
        let mut options = MqttOptions::new(id, "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30)).set_max_packet_size(Some(4 * 1024 * 1024));
        let mut net = rumqttc::NetworkOptions::new();
        net.set_tcp_nodelay(true);
        options.set_network_options(net);
        Client::connect_with(options, subscriptions).await
    }

    /// A client made with `options` (a login, another id), subscribed to
    /// `subscriptions` one at a time, each waited for; a refused one
    /// brings nothing.
    pub async fn connect_with(options: MqttOptions, subscriptions: &[&str]) -> Client {
        Client::connect_with_qos(options, subscriptions, QoS::AtLeastOnce).await
    }

    /// `connect_with`, subscribing at `qos`.
    pub async fn connect_with_qos(options: MqttOptions, subscriptions: &[&str], qos: QoS) -> Client {
        let (client, mut eventloop) = AsyncClient::new(options, 4096);
        let (tx, inbox) = mpsc::unbounded_channel();
        let (subscribed_tx, mut subscribed) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let _ = tx.send(p);
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        let _ = subscribed_tx.send(());
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        for topic in subscriptions {
            client.subscribe(*topic, qos).await.unwrap();
            tokio::time::timeout(Duration::from_secs(10), subscribed.recv()).await.expect("SUBACK").unwrap();
        }
        Client { client, inbox }
    }

    pub async fn request(
        &self,
        topic: &str,
        payload: Vec<u8>,
        reply_to: &str,
        correlation: &[u8],
        content_type: Option<&str>,
    ) {
        let props = PublishProperties {
            response_topic: Some(reply_to.into()),
            correlation_data: Some(Bytes::copy_from_slice(correlation)),
            content_type: content_type.map(Into::into),
            ..Default::default()
        };
        self.client.publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props).await.unwrap();
    }

    pub async fn next(&mut self, timeout: Duration) -> Option<Publish> {
        tokio::time::timeout(timeout, self.inbox.recv()).await.ok().flatten()
    }

    /// The next message, as JSON.
    pub async fn next_json(&mut self) -> (Publish, serde_json::Value) {
        let p = self.next(Duration::from_secs(20)).await.expect("a reply within 20 s");
        let v = serde_json::from_slice(&p.payload)
            .unwrap_or_else(|e| panic!("reply is not JSON ({e}): {:?}", p.payload));
        (p, v)
    }
}

/// An MQTT 3.1.1 client (no properties: replies go to the payload's reply_to).
pub struct Client311 {
    pub client: rumqttc::AsyncClient,
    pub inbox: mpsc::UnboundedReceiver<rumqttc::Publish>,
}

impl Client311 {
    pub async fn connect(port: u16, id: &str, subscription: &str) -> Client311 {
        let mut options = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30));
        let (client, mut eventloop) = rumqttc::AsyncClient::new(options, 64);
        let (tx, inbox) = mpsc::unbounded_channel();
        let (subscribed_tx, mut subscribed) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                        let _ = tx.send(p);
                    }
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                        let _ = subscribed_tx.send(());
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        client.subscribe(subscription, rumqttc::QoS::AtLeastOnce).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), subscribed.recv()).await.expect("SUBACK").unwrap();
        Client311 { client, inbox }
    }
}

/// A certificate authority for TLS tests, named `name`.
pub fn test_ca(name: &str) -> rcgen::CertifiedIssuer<'static, rcgen::KeyPair> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let mut params = CertificateParams::new(vec![]).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    rcgen::CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A server certificate for 127.0.0.1 named `name`, signed by `ca`, and its key.
pub fn loopback_cert(
    ca: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    name: &str,
) -> (rcgen::Certificate, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".into()]).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    (params.signed_by(&key, ca).unwrap(), key)
}

/// Version `version` of `digits` under `models`: a copy of the shipped
/// version 1, renamed; with `break_sha`, one whose sha256 check fails.
/// A mosquitto password file at `path` holding `logins` (user, password),
/// written by mosquitto_passwd; false (SKIPPED, a failure under CI=true)
/// where it is not installed.
pub fn password_file(path: &std::path::Path, logins: &[(&str, &str)]) -> bool {
    let Some(passwd) = ["/usr/bin/mosquitto_passwd", "/usr/sbin/mosquitto_passwd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        crate::skipped("mosquitto_passwd is not installed (apt-get install mosquitto)");
        return false;
    };
    std::fs::write(path, "").unwrap();
    for (user, password) in logins {
        let done = Command::new(passwd).arg("-b").arg(path).args([user, password]).status();
        assert!(done.unwrap().success(), "mosquitto_passwd {user}");
    }
    true
}

pub fn copy_digits_version(models: &std::path::Path, version: &str, break_sha: bool) {
    let from = models_dir().join("digits/1");
    let dir = models.join("digits").join(version);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.onnx", "golden.json"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    let mut manifest = std::fs::read_to_string(from.join("model.toml")).unwrap();
    manifest = manifest.replace("version = \"1\"", &format!("version = \"{version}\""));
    if break_sha {
        manifest = manifest.replace("sha256 = \"e", "sha256 = \"0");
    }
    std::fs::write(dir.join("model.toml"), manifest).unwrap();
}

/// Version `version` of `digits` under `models`: a copy of one of the bad
/// candidates `models/produce.py --rollout-tests` made under tests/models/.
pub fn copy_test_version(models: &std::path::Path, candidate: &str, version: &str) {
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models").join(candidate);
    let dir = models.join("digits").join(version);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.onnx", "golden.json"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    let manifest = std::fs::read_to_string(from.join("model.toml")).unwrap();
    std::fs::write(
        dir.join("model.toml"),
        manifest.replace("version = \"2\"", &format!("version = \"{version}\"")),
    )
    .unwrap();
}

/// Devices under steady load while a test waits for something to happen
/// (a rollout step, a judgement): a request every 4 ms, then whatever came
/// back, until `done` or `limit` (false).
pub(crate) trait PacedLoad {
    /// One request.
    async fn send(&mut self);
    /// Whatever arrived since the last look.
    fn take(&mut self);

    async fn load_until(&mut self, limit: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let started = Instant::now();
        while started.elapsed() < limit {
            self.send().await;
            tokio::time::sleep(Duration::from_millis(4)).await;
            self.take();
            if done(self) {
                return true;
            }
        }
        false
    }
}
