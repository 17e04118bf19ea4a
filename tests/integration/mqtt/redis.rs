//! The shared Redis cache tier on the real binary, against a real
//! `redis-server` each test starts on a free port.

use super::support::{
    self, Client, Mosquitto, Node, copy_digits_version, copy_test_version, embedded_node_with_http, get_json,
    infer_digits, sample, scrape,
};
use crate::{digits_request, heldout};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct RedisServer {
    child: Child,
    port: u16,
    password: Option<String>,
    /// The CA file, when the server speaks only TLS.
    tls_ca: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// `None` (SKIPPED, or a failure under CI=true) without redis-server.
    fn start(port: Option<u16>, password: Option<&str>) -> Option<RedisServer> {
        Self::start_with(port, password, false)
    }

    /// With `tls`, the server listens for TLS only, with a certificate for
    /// 127.0.0.1 from a CA of its own (`tls_ca`).
    fn start_with(port: Option<u16>, password: Option<&str>, tls: bool) -> Option<RedisServer> {
        if Command::new("redis-server").arg("--version").output().is_err() {
            crate::skipped("redis-server is not installed (apt-get install redis-server)");
            return None;
        }
        let port = port.unwrap_or_else(free_port);
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut tls_ca = None;
        if tls {
            let ca = support::test_ca("edgeinfer test site CA");
            let (cert, key) = support::loopback_cert(&ca, "redis");
            let path = |name: &str| dir.path().join(name);
            std::fs::write(path("ca.pem"), ca.pem()).unwrap();
            std::fs::write(path("redis.pem"), cert.pem()).unwrap();
            std::fs::write(path("redis.key"), key.serialize_pem()).unwrap();
            cmd.args(["--port", "0", "--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
                .arg("--tls-cert-file")
                .arg(path("redis.pem"))
                .arg("--tls-key-file")
                .arg(path("redis.key"))
                .arg("--tls-ca-cert-file")
                .arg(path("ca.pem"));
            tls_ca = Some(path("ca.pem"));
        } else {
            cmd.args(["--port", &port.to_string()]);
        }
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        let child = cmd.spawn().unwrap();
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "redis-server did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(RedisServer { child, port, password: password.map(str::to_string), tls_ca, _dir: dir })
    }

    fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    fn cli(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["-p", &self.port.to_string()]);
        if let Some(ca) = &self.tls_ca {
            cmd.arg("--tls").arg("--cacert").arg(ca);
        }
        if let Some(p) = &self.password {
            cmd.args(["-a", p, "--no-auth-warning"]);
        }
        let out = cmd.args(args).output().unwrap();
        assert!(out.status.success(), "redis-cli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A plain (no TLS, no password) connection of the tests' own, binary
    /// safe where redis-cli's arguments are not.
    fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap()
    }

    fn get(&self, key: &str) -> Vec<u8> {
        redis::cmd("GET").arg(key).query(&mut self.connection()).unwrap()
    }

    fn set(&self, key: &str, value: &[u8]) {
        redis::cmd("SET").arg(key).arg(value).query::<()>(&mut self.connection()).unwrap();
    }

    /// Bytes Redis has sent its clients so far.
    fn bytes_sent(&self) -> u64 {
        let stats = self.cli(&["INFO", "stats"]);
        let line = stats.lines().find(|l| l.starts_with("total_net_output_bytes:")).unwrap();
        line.trim_end().rsplit(':').next().unwrap().parse().unwrap()
    }

    /// The keys under `pattern`, waiting up to 5 s for at least `n`.
    fn keys(&self, pattern: &str, n: usize) -> Vec<String> {
        let start = Instant::now();
        loop {
            let keys: Vec<String> =
                self.cli(&["--scan", "--pattern", pattern]).lines().map(str::to_string).collect();
            if keys.len() >= n || start.elapsed() > Duration::from_secs(5) {
                return keys;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn request(id: &str, i: usize) -> Value {
    digits_request(id, &[heldout()[i].1.clone()])
}

fn cache_of(reply: &Value) -> &str {
    reply["parameters"]["cache"].as_str().unwrap_or_else(|| panic!("no parameters.cache in {reply}"))
}

/// The site key the tests' nodes share (`cache.redis.key_file`).
const SITE_KEY: &str = "6c0e6d6f2b1a9e3d5f7c8b4a2e1d0c9b8a7f6e5d4c3b2a19087f6e5d4c3b2a19";

/// A file holding `SITE_KEY` as `xxd -p` writes it; one per test process.
fn site_key_file() -> &'static str {
    static FILE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("edgeinfer-test-redis-{}.key", std::process::id()));
        std::fs::write(&path, format!("{}\n{}\n", &SITE_KEY[..60], &SITE_KEY[60..])).unwrap();
        path.display().to_string()
    })
}

fn key_env() -> (&'static str, &'static str) {
    ("EDGEINFER_CACHE__REDIS__KEY_FILE", site_key_file())
}

fn node(id: &str, url: &str, extra: &[(&str, &str)]) -> (Node, u16) {
    // A generous timeout: on a busy 2-core CI machine a lookup can take
    // more than the 5 ms default, and these tests count hits.
    let mut env = vec![
        ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
        ("EDGEINFER_CACHE__REDIS__URL", url),
        ("EDGEINFER_CACHE__REDIS__TIMEOUT_MS", "1000"),
        key_env(),
    ];
    env.extend_from_slice(extra);
    let (node, _, port) = embedded_node_with_http(id, &env);
    (node, port)
}

#[test]
fn nodes_share_answers_through_redis_every_key_expires_and_a_bad_value_is_a_miss() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    let (_a, a) = node("gw-r1", &redis.url(), &[]);
    let (_b, b) = node("gw-r2", &redis.url(), &[]);
    let first = infer_digits(a, &request("a1", 3));
    assert_eq!(cache_of(&first), "miss");
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 1).len(), 1, "stored off the request path, soon");
    assert_eq!(cache_of(&infer_digits(a, &request("a1b", 3))), "memory", "the node that computed it");
    // A node that never saw the request: the answer from the shared tier.
    let shared = infer_digits(b, &request("b1", 3));
    assert_eq!(cache_of(&shared), "redis", "{shared}");
    assert_eq!(shared["id"], "b1");
    assert_eq!(shared["parameters"]["node"], "gw-r2", "the node that answered, not the one that computed it");
    assert_eq!(shared["outputs"], first["outputs"]);
    // Promoted to its own layers.
    assert_eq!(cache_of(&infer_digits(b, &request("b2", 3))), "memory");
    let metrics = scrape(b);
    assert_eq!(sample(&metrics, &["edgeinfer_cache_lookups_total{", "result=\"redis\""]), 1.0);
    assert_eq!(sample(&metrics, &["edgeinfer_cache_redis_up"]), 1.0);

    // Every key expires: by default with the answer's cache TTL (a day).
    for i in 4..8 {
        infer_digits(a, &request(&format!("a{i}"), i));
    }
    let keys = redis.keys("edgeinfer:v2:digits:*", 5);
    assert_eq!(keys.len(), 5);
    for key in &keys {
        let ttl: i64 = redis.cli(&["TTL", key]).parse().unwrap();
        assert!(ttl > 86_000 && ttl <= 86_400, "{key}: TTL {ttl}");
    }

    // A value that is not a signed answer is a miss, counted, never served.
    let before: Vec<String> = keys.clone();
    infer_digits(a, &request("a9", 9));
    let nine = redis.keys("edgeinfer:v2:digits:*", 6).into_iter().find(|k| !before.contains(k)).unwrap();
    redis.cli(&["SET", &nine, "not a record", "EX", "60"]);
    let reply = infer_digits(b, &request("b9", 9));
    assert_eq!(cache_of(&reply), "miss", "{reply}");
    assert_eq!(reply["outputs"], infer_digits(a, &request("a9b", 9))["outputs"]);
    let metrics = scrape(b);
    assert_eq!(sample(&metrics, &["edgeinfer_cache_redis_rejected_total{", "reason=\"unsigned\""]), 1.0);

    // Purging a model reaches this node's keys in the shared tier.
    let purged = crate::cli::edgeinfer(
        &["cache", "purge", "-m", "digits", "--url", &format!("http://127.0.0.1:{a}")],
        None,
        &[
            ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
            ("EDGEINFER_CACHE__REDIS__URL", &redis.url()),
            key_env(),
        ],
    );
    let text = String::from_utf8_lossy(&purged.stdout);
    assert!(purged.status.success(), "{text}{}", String::from_utf8_lossy(&purged.stderr));
    assert!(text.contains("entries removed from disk and Redis"), "{text}");
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 0).len(), 0, "{text}");
}

#[test]
fn redis_down_at_start_costs_misses_and_is_used_once_it_is_up() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let env = [
        ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
        ("EDGEINFER_CACHE__REDIS__URL", url.as_str()),
        ("EDGEINFER_CACHE__REDIS__TIMEOUT_MS", "50"),
        key_env(),
    ];
    let (node, mqtt, http) = embedded_node_with_http("gw-r3", &env);
    let start = Instant::now();
    let reply = infer_digits(http, &request("d1", 1));
    assert_eq!(cache_of(&reply), "miss");
    assert!(start.elapsed() < Duration::from_secs(2), "a dead Redis never stalls a request");
    let (_, stats) = get_json(http, "/cache/stats");
    assert_eq!(stats["redis"]["up"], false, "{stats}");
    let why = stats["redis"]["error"].as_str().unwrap_or_else(|| panic!("{stats}"));
    assert!(why.contains("refused") || why.contains("not connected"), "{why}");
    assert_eq!(sample(&scrape(http), &["edgeinfer_cache_redis_up"]), 0.0);
    // The retained status says the layer is down, and why.
    let status = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut c = Client::connect(mqtt, "watch-r3", &["edgeinfer/gw-r3/status"]).await;
        c.next_json().await.1
    });
    assert_eq!(status["cache"]["redis"]["up"], false, "{status}");
    assert!(status["cache"]["redis"]["error"].is_string(), "{status}");

    // Redis comes up: without a restart, answers go there again.
    let Some(redis) = RedisServer::start(Some(port), None) else { return };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut i = 10;
    while redis.keys("edgeinfer:v2:digits:*", 0).is_empty() {
        assert!(Instant::now() < deadline, "no answer reached Redis after it came up: {:?}", node.log);
        infer_digits(http, &request(&format!("d{i}"), i));
        i += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(sample(&scrape(http), &["edgeinfer_cache_redis_up"]), 1.0);
    assert_eq!(get_json(http, "/cache/stats").1["redis"], json!({"up": true}));
}

#[test]
fn auth_with_a_password_file_works_and_the_password_is_shown_nowhere() {
    let password = "s3cret-Pa55word-for-the-site";
    let Some(redis) = RedisServer::start(None, Some(password)) else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-password");
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let file = file.to_str().unwrap();
    let env = [("EDGEINFER_CACHE__REDIS__PASSWORD_FILE", file), ("EDGEINFER_LOG", "debug,rumqttd=warn")];
    let (a_node, a) = node("gw-r4", &redis.url(), &env);
    let (b_node, b) = node("gw-r5", &redis.url(), &env);
    assert_eq!(cache_of(&infer_digits(a, &request("p1", 2))), "miss");
    redis.keys("edgeinfer:v2:digits:*", 1);
    assert_eq!(cache_of(&infer_digits(b, &request("p2", 2))), "redis");
    // An ACL user of its own, limited to the site's prefix: the user in the
    // URL, its password in the file.
    redis.cli(&["ACL", "SETUSER", "gateway", "on", ">gateway-Pa55", "~edgeinfer:*", "+@all"]);
    let user_file = dir.path().join("gateway-password");
    std::fs::write(&user_file, "gateway-Pa55\n").unwrap();
    let user_url = format!("redis://gateway@127.0.0.1:{}", redis.port);
    let user_env = [("EDGEINFER_CACHE__REDIS__PASSWORD_FILE", user_file.to_str().unwrap())];
    let (_d_node, d) = node("gw-r6u", &user_url, &user_env);
    assert_eq!(cache_of(&infer_digits(d, &request("p2u", 2))), "redis", "as the ACL user");
    // Without the password the layer is down, says so, and serving goes on.
    let (c_node, c) = node("gw-r6", &redis.url(), &[("EDGEINFER_LOG", "debug,rumqttd=warn")]);
    assert_eq!(cache_of(&infer_digits(c, &request("p3", 2))), "miss");
    let deadline = Instant::now() + Duration::from_secs(5);
    let why = loop {
        let (_, stats) = get_json(c, "/cache/stats");
        if let Some(why) = stats["redis"]["error"].as_str()
            && (why.contains("NOAUTH") || why.contains("Authentication") || why.contains("auth"))
        {
            break why.to_string();
        }
        assert!(Instant::now() < deadline, "{stats}");
        infer_digits(c, &request("p4", 2));
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!why.contains(password));
    // The site drops the password: without a restart the layer comes up.
    redis.cli(&["CONFIG", "SET", "requirepass", ""]);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut i = 10;
    while get_json(c, "/cache/stats").1["redis"]["up"] != true {
        assert!(Instant::now() < deadline, "{}", get_json(c, "/cache/stats").1);
        infer_digits(c, &request(&format!("p{i}"), i));
        i += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    for (node, port) in [(&a_node, a), (&b_node, b), (&c_node, c)] {
        let log = node.log.lock().unwrap().join("\n");
        assert!(!log.contains(password), "the password in {}'s log", node.id);
        let (_, stats) = get_json(port, "/cache/stats");
        assert!(!stats.to_string().contains(password));
        assert!(!scrape(port).contains(password));
    }
}

#[test]
fn redis_killed_while_serving_loses_no_request_and_is_used_again_when_back() {
    let Some(mut redis) = RedisServer::start(None, None) else { return };
    let port = redis.port;
    let (_node, http) = node("gw-r7", &redis.url(), &[("EDGEINFER_CACHE__REDIS__TIMEOUT_MS", "50")]);
    let split = heldout();
    // Distinct requests (a new first pixel each), so each one looks Redis up.
    let distinct = |i: usize| {
        let mut px = split[i % split.len()].1.clone();
        px[0] = (i / split.len()) as f64 + 20.0;
        digits_request(&format!("k{i}"), &[px])
    };
    for i in 0..20 {
        assert_eq!(cache_of(&infer_digits(http, &distinct(i))), "miss");
    }
    redis.keys("edgeinfer:v2:digits:*", 20);
    let _ = redis.child.kill();
    let _ = redis.child.wait();
    // Every request is answered (infer_digits asserts HTTP 200), in time.
    let start = Instant::now();
    for i in 20..120 {
        let reply = infer_digits(http, &distinct(i));
        assert_eq!(reply["model_name"], "digits");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "100 requests took {:?}", start.elapsed());
    let metrics = scrape(http);
    assert_eq!(sample(&metrics, &["edgeinfer_cache_redis_up"]), 0.0);
    assert!(
        sample(&metrics, &["edgeinfer_cache_redis_errors_total{", "reason=\"error\""]) >= 1.0,
        "{metrics}"
    );
    assert_eq!(get_json(http, "/cache/stats").1["redis"]["up"], false);
    drop(redis);

    // Back on the same port, empty: answers reach it again, no restart.
    let Some(redis) = RedisServer::start(Some(port), None) else { return };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut i = 120;
    while redis.keys("edgeinfer:v2:digits:*", 0).is_empty() {
        assert!(Instant::now() < deadline, "no answer reached Redis after it came back");
        infer_digits(http, &distinct(i));
        i += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(sample(&scrape(http), &["edgeinfer_cache_redis_up"]), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_in_one_share_group_share_answers_and_a_new_node_hits_from_its_first_request() {
    let Some(broker) = Mosquitto::start() else { return };
    let Some(redis) = RedisServer::start(None, None) else { return };
    let url = redis.url();
    let env = [
        ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
        ("EDGEINFER_CACHE__REDIS__URL", url.as_str()),
        ("EDGEINFER_CACHE__REDIS__TIMEOUT_MS", "1000"),
        key_env(),
    ];
    let _site: Vec<Node> =
        ["gw-s1", "gw-s2", "gw-s3"].iter().map(|id| Node::start(&broker.url(), id, &env)).collect();
    let mut device = Client::connect(broker.port, "dev-site", &["devices/site/replies"]).await;
    let n = 60;
    let mut round = async |name: &str, topic: &str, rows: Vec<usize>| {
        for &i in &rows {
            let id = format!("{name}-{i}");
            let payload = request(&id, i).to_string().into_bytes();
            device.request(topic, payload, "devices/site/replies", id.as_bytes(), None).await;
        }
        let mut replies: HashMap<usize, (String, String)> = HashMap::new();
        while replies.len() < rows.len() {
            let (_, body) = device.next_json().await;
            let i: usize = body["id"].as_str().unwrap().rsplit('-').next().unwrap().parse().unwrap();
            let node = body["parameters"]["node"].as_str().unwrap().to_string();
            let previous = replies.insert(i, (node, cache_of(&body).to_string()));
            assert!(previous.is_none(), "row {i} answered twice");
        }
        replies
    };
    let first = round("one", "edgeinfer/infer/digits", (0..n).collect()).await;
    assert!(first.values().all(|(_, cache)| cache == "miss"), "{first:?}");
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", n).len(), n);
    // The same rows again (in reverse: mosquitto deals a share group's
    // messages round robin), spread over the group: nothing is computed
    // twice, and a row that lands on another node than the one that
    // computed it is a Redis hit there.
    let second = round("two", "edgeinfer/infer/digits", (0..n).rev().collect()).await;
    for (i, (node, cache)) in &second {
        let computed_by = &first[i].0;
        let expected = if node == computed_by { "memory" } else { "redis" };
        assert_eq!(cache, expected, "row {i}: computed on {computed_by}, asked of {node}");
    }
    let shared = second.values().filter(|(_, cache)| cache == "redis").count();
    assert!(shared > 0, "the share group sent no row to another node: {second:?}");
    eprintln!("site of 3: {shared} of {n} repeated rows answered from Redis");
    // A node with an empty disk, new to the site: hits from its first request.
    let _fresh = Node::start(&broker.url(), "gw-s4", &env);
    let fresh = round("three", "edgeinfer/gw-s4/infer/digits", vec![0]).await;
    assert_eq!(fresh[&0], ("gw-s4".to_string(), "redis".to_string()));
}

#[test]
fn rediss_with_a_site_ca_shares_answers_and_without_the_ca_the_layer_says_why() {
    let Some(redis) = RedisServer::start_with(None, None, true) else { return };
    let ca = redis.tls_ca.clone().unwrap();
    let ca_env = [("EDGEINFER_CACHE__REDIS__CA_FILE", ca.to_str().unwrap())];
    let (_a, a) = node("gw-t1", &redis.url(), &ca_env);
    let (_b, b) = node("gw-t2", &redis.url(), &ca_env);
    assert_eq!(cache_of(&infer_digits(a, &request("t1", 4))), "miss");
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 1).len(), 1, "stored over TLS");
    assert_eq!(cache_of(&infer_digits(b, &request("t2", 4))), "redis");
    assert_eq!(get_json(b, "/cache/stats").1["redis"], json!({"up": true}));
    // The system roots do not know the site CA: no TLS, and it says so.
    let (_c, c) = node("gw-t3", &redis.url(), &[]);
    assert_eq!(cache_of(&infer_digits(c, &request("t3", 4))), "miss");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, stats) = get_json(c, "/cache/stats");
        assert_eq!(stats["redis"]["up"], false, "{stats}");
        let why = stats["redis"]["error"].as_str().unwrap_or_else(|| panic!("{stats}"));
        if why.contains("certificate") || why.contains("UnknownIssuer") {
            break;
        }
        assert!(Instant::now() < deadline, "{why}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A CA file without a certificate in it (a key, say) is named at once.
    let not_a_ca = redis.tls_ca.as_ref().unwrap().with_file_name("redis.key");
    let (_d, d) =
        node("gw-t4", &redis.url(), &[("EDGEINFER_CACHE__REDIS__CA_FILE", not_a_ca.to_str().unwrap())]);
    let (_, stats) = get_json(d, "/cache/stats");
    let why = stats["redis"]["error"].as_str().unwrap_or_else(|| panic!("{stats}"));
    assert!(why.contains("cache.redis.ca_file") && why.contains("no PEM certificate"), "{why}");
}

/// The node's count of Redis errors for `reason`, waiting up to 5 s for at
/// least one.
fn redis_errors(http: u16, reason: &str) -> f64 {
    let label = format!("reason=\"{reason}\"");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = scrape(http);
        let n = if metrics.contains(&label) {
            sample(&metrics, &["edgeinfer_cache_redis_errors_total{", &label])
        } else {
            0.0
        };
        if n >= 1.0 || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_full_redis_refuses_new_answers_yet_serves_what_it_holds_and_with_eviction_takes_them() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    let (_a, a) = node("gw-f1", &redis.url(), &[]);
    let (_b, b) = node("gw-f2", &redis.url(), &[]);
    for i in 0..10 {
        assert_eq!(cache_of(&infer_digits(b, &request(&format!("f{i}"), i))), "miss");
    }
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 10).len(), 10);
    // Full, and told not to evict: every write is refused with OOM.
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    for i in 10..40 {
        let reply = infer_digits(a, &request(&format!("f{i}"), i));
        assert_eq!(cache_of(&reply), "miss", "computed and answered: {reply}");
    }
    assert!(redis_errors(a, "full") >= 1.0, "{}", scrape(a));
    assert_eq!(redis.cli(&["DBSIZE"]), "10", "nothing new stored");
    // Refused writes do not take the layer down: what it holds is served.
    for i in 0..10 {
        assert_eq!(cache_of(&infer_digits(a, &request(&format!("g{i}"), i))), "redis", "row {i}");
    }
    let (_, stats) = get_json(a, "/cache/stats");
    assert_eq!(stats["redis"]["up"], true, "{stats}");
    let why = stats["redis"]["error"].as_str().unwrap_or_else(|| panic!("{stats}"));
    assert!(why.contains("writes refused") && why.contains("OOM"), "{why}");
    assert_eq!(sample(&scrape(a), &["edgeinfer_cache_redis_up"]), 1.0);
    // Room again: answers are stored, and the status clears.
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    infer_digits(a, &request("f40", 40));
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 11).len(), 11);
    let deadline = Instant::now() + Duration::from_secs(5);
    while get_json(a, "/cache/stats").1["redis"] != json!({"up": true}) {
        assert!(Instant::now() < deadline, "{}", get_json(a, "/cache/stats").1);
        std::thread::sleep(Duration::from_millis(50));
    }
    // Full with an eviction policy (the setting for a cache): Redis makes
    // room by evicting, every write lands, nothing is refused.
    let info = |section: &str, field: &str| -> u64 {
        let text = redis.cli(&["INFO", section]);
        let line = text.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap();
        line.trim_end().rsplit(':').next().unwrap().parse().unwrap()
    };
    let full_before = redis_errors(a, "full");
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let room = info("memory", "used_memory") + 4000;
    redis.cli(&["CONFIG", "SET", "maxmemory", &room.to_string()]);
    for i in 41..101 {
        let reply = infer_digits(a, &request(&format!("e{i}"), i));
        assert_eq!(cache_of(&reply), "miss", "computed and answered: {reply}");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while info("stats", "evicted_keys") == 0 {
        assert!(Instant::now() < deadline, "Redis evicted nothing: {}", redis.cli(&["INFO", "memory"]));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(redis_errors(a, "full"), full_before, "no write refused under allkeys-lru");
    assert_eq!(get_json(a, "/cache/stats").1["redis"], json!({"up": true}));
}

#[test]
fn a_redis_that_stops_answering_costs_misses_not_time() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    let (_n, http) = node("gw-p1", &redis.url(), &[("EDGEINFER_CACHE__REDIS__TIMEOUT_MS", "20")]);
    assert_eq!(cache_of(&infer_digits(http, &request("p0", 0))), "miss");
    redis.keys("edgeinfer:v2:digits:*", 1);
    // Redis holds every command for 5 s: each lookup gives up after 20 ms,
    // and after three the layer stands aside.
    let paused = Instant::now();
    redis.cli(&["CLIENT", "PAUSE", "5000", "ALL"]);
    for i in 1..41 {
        let reply = infer_digits(http, &request(&format!("p{i}"), i));
        assert_eq!(cache_of(&reply), "miss", "{reply}");
    }
    let took = paused.elapsed();
    assert!(took < Duration::from_secs(4), "40 requests waited on a paused Redis: {took:?}");
    // Three lookups waited, then the layer rested: not forty.
    let timeouts = redis_errors(http, "timeout");
    assert!((3.0..=6.0).contains(&timeouts), "{timeouts} lookups waited on the paused Redis");
    let (_, stats) = get_json(http, "/cache/stats");
    assert_eq!(stats["redis"]["up"], false, "{stats}");
    assert!(stats["redis"]["error"].as_str().is_some_and(|e| e.contains("20 ms")), "{stats}");
    // Once it answers again, so does the layer.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(paused.elapsed()));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 41;
    while sample(&scrape(http), &["edgeinfer_cache_redis_up"]) != 1.0 {
        assert!(Instant::now() < deadline, "the layer stayed down after the pause");
        infer_digits(http, &request(&format!("p{i}"), i));
        i += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
}

// Issue 35, finding 8: shared answers are keyed by the model's contents,
// signed with the site key, and read no further than a cap.

fn label_of(reply: &Value) -> &str {
    reply["parameters"]["label"].as_str().unwrap_or_else(|| panic!("no label in {reply}"))
}

/// Row `i` asked of the node on `http`, which computes it; the name of
/// the key its answer went to in Redis.
fn stored_key(redis: &RedisServer, http: u16, i: usize) -> String {
    let before = redis.keys("edgeinfer:v2:digits:*", 0);
    let reply = infer_digits(http, &request(&format!("store-{i}"), i));
    assert_eq!(cache_of(&reply), "miss", "{reply}");
    let after = redis.keys("edgeinfer:v2:digits:*", before.len() + 1);
    after.into_iter().find(|k| !before.contains(k)).unwrap_or_else(|| panic!("row {i} never reached Redis"))
}

/// The node's count of values it read from Redis and did not serve.
fn rejected(http: u16, reason: &str) -> f64 {
    sample(&scrape(http), &["edgeinfer_cache_redis_rejected_total{", &format!("reason=\"{reason}\"")])
}

/// A value laid out as a node signs one (format byte, HMAC-SHA256 tag
/// over the format, the key's name and the payload, then the payload),
/// tagged with `key`: with any key but the site's, the best a client that
/// can write to Redis can do.
fn signed_with(key: &[u8], name: &str, payload: &[u8]) -> Vec<u8> {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    mac.update(&[2]);
    mac.update(&(name.len() as u64).to_le_bytes());
    mac.update(name.as_bytes());
    mac.update(payload);
    [&[2][..], &mac.finalize().into_bytes(), payload].concat()
}

/// Redis format 1's record: checksummed with plain sha256 over the key and
/// contents, which anyone can compute; what nodes served before signing.
fn format_one(name: &str, stored_at_ms: u64, expires_at_ms: u64, body: Vec<u8>) -> Vec<u8> {
    use sha2::Digest;
    let key = hex::decode(name.rsplit(':').next().unwrap()).unwrap();
    let mut h = sha2::Sha256::new();
    h.update(&key);
    h.update(stored_at_ms.to_le_bytes());
    h.update(expires_at_ms.to_le_bytes());
    h.update(&body);
    let checksum = u64::from_le_bytes(h.finalize()[..8].try_into().unwrap());
    postcard::to_stdvec(&(0u64, stored_at_ms, expires_at_ms, checksum, body)).unwrap()
}

#[test]
fn finding_8_an_answer_forged_in_redis_without_the_site_key_is_not_served() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    let (_a, a) = node("gw-k1", &redis.url(), &[]);
    // The forger reads a genuine answer (row 1, a 6) and plants it, with
    // its wrong label, under other rows' exact keys.
    let donor_key = stored_key(&redis, a, 1);
    let donor = redis.get(&donor_key);
    let donor_label = label_of(&infer_digits(a, &request("donor", 1))).to_string();
    let payload = &donor[33..];
    let (stored_at_ms, expires_at_ms, body): (u64, u64, Vec<u8>) = postcard::from_bytes(payload).unwrap();
    let mut targets = Vec::new();
    for row in [0, 2, 6, 7, 8] {
        let name = stored_key(&redis, a, row);
        let right = label_of(&infer_digits(a, &request("right", row))).to_string();
        assert_ne!(right, donor_label, "row {row}");
        targets.push((row, name, right));
    }
    let other_key = [0x5a; 32];
    let planted: [(&str, Option<Vec<u8>>); 4] = [
        ("signed with a key not the site's", Some(signed_with(&other_key, &targets[0].1, payload))),
        ("format 1's unsigned record", Some(format_one(&targets[1].1, stored_at_ms, expires_at_ms, body))),
        ("a genuine value of another key, copied", Some(donor.clone())),
        ("a list, not a string", None),
    ];
    for ((_, name, _), (_, value)) in targets.iter().zip(&planted) {
        match value {
            Some(value) => redis.set(name, value),
            None => {
                redis.cli(&["DEL", name]);
                redis.cli(&["RPUSH", name, "6"]);
            }
        }
    }
    let (b_node, b) = node("gw-k2", &redis.url(), &[]);
    for ((row, _, right), (what, _)) in targets.iter().zip(&planted) {
        let reply = infer_digits(b, &request(&format!("b{row}"), *row));
        assert_eq!(cache_of(&reply), "miss", "{what}: {reply}");
        assert_eq!(label_of(&reply), right, "{what}: the model ran and answered right");
    }
    assert_eq!(rejected(b, "signature"), 2.0, "another key's tag, and a tag for another key");
    assert_eq!(rejected(b, "unsigned"), 2.0, "format 1, and a list");
    assert_eq!(sample(&scrape(b), &["edgeinfer_cache_redis_up"]), 1.0, "Redis answered all along");
    let log = b_node.log.lock().unwrap().clone();
    let lines: Vec<&String> = log.iter().filter(|l| l.contains("not served")).collect();
    assert_eq!(lines.len(), 1, "one line for four rejected values: {lines:?}");
    assert!(lines[0].contains("signature") && lines[0].contains("cache.redis.key_file"), "{}", lines[0]);
    // The control: the same wrong answer signed with the site key is
    // served, so what kept the forgeries out was the key alone.
    let (row, name, _) = &targets[4];
    redis.set(name, &signed_with(&hex::decode(SITE_KEY).unwrap(), name, payload));
    let reply = infer_digits(b, &request("b-signed", *row));
    assert_eq!((cache_of(&reply), label_of(&reply)), ("redis", donor_label.as_str()), "{reply}");
}

#[test]
fn finding_8_nodes_with_other_contents_under_version_1_do_not_share_answers() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    // Three "digits v1": the shipped one; another model file (trained on
    // labels shifted by one); the shipped file with its labels renamed
    // (another manifest).
    let (stock, other_file, other_manifest) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(stock.path(), "1", false);
    copy_test_version(other_file.path(), "digits-wrong-labels", "1");
    copy_digits_version(other_manifest.path(), "1", false);
    let manifest = other_manifest.path().join("digits/1/model.toml");
    let names = r#"["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]"#;
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replace(r#"["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]"#, names))
        .unwrap();
    let url = redis.url();
    let start = |id: &str, models: &tempfile::TempDir| {
        node(id, &url, &[("EDGEINFER_NODE__MODELS_DIR", models.path().to_str().unwrap())])
    };
    let (_a, a) = start("gw-c1", &stock);
    let (_b, b) = start("gw-c2", &other_file);
    let (_c, c) = start("gw-c3", &other_manifest);
    let (_d, d) = start("gw-c4", &stock);
    let row = 2;
    let from_a = infer_digits(a, &request("a", row));
    assert_eq!(cache_of(&from_a), "miss");
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 1).len(), 1);
    let from_b = infer_digits(b, &request("b", row));
    assert_eq!((cache_of(&from_b), from_b["model_version"].as_str()), ("miss", Some("1")), "{from_b}");
    assert_ne!(label_of(&from_b), label_of(&from_a), "its own model's answer");
    let from_c = infer_digits(c, &request("c", row));
    assert_eq!(cache_of(&from_c), "miss", "{from_c}");
    let renamed = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"];
    assert_eq!(label_of(&from_c), renamed[label_of(&from_a).parse::<usize>().unwrap()], "its own labels");
    assert_eq!(redis.keys("edgeinfer:v2:digits:*", 3).len(), 3, "one answer per contents");
    // The same contents still share.
    let from_d = infer_digits(d, &request("d", row));
    assert_eq!(cache_of(&from_d), "redis", "{from_d}");
    assert_eq!(from_d["outputs"], from_a["outputs"]);
}

#[test]
fn finding_8_an_oversized_value_in_redis_is_a_miss_read_no_further_than_the_cap() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    let (_a, a) = node("gw-o1", &redis.url(), &[]);
    let (_b, b) = node("gw-o2", &redis.url(), &[]);
    let row = 4;
    let name = stored_key(&redis, a, row);
    let genuine = infer_digits(a, &request("a-again", row));
    // The genuine signed answer, then zeros up to 32 MiB.
    redis.cli(&["SETRANGE", &name, &((32 << 20) - 1).to_string(), "x"]);
    assert_eq!(redis.cli(&["STRLEN", &name]), (32 << 20).to_string());
    let sent = redis.bytes_sent();
    let asked = Instant::now();
    let reply = infer_digits(b, &request("b", row));
    let took = asked.elapsed();
    let read = redis.bytes_sent() - sent;
    assert_eq!(cache_of(&reply), "miss", "{reply}");
    assert_eq!(label_of(&reply), label_of(&genuine));
    assert!(read < 2 << 20, "Redis sent {read} bytes for one lookup of a 32 MiB value");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(rejected(b, "oversized"), 1.0);
    assert_eq!(sample(&scrape(b), &["edgeinfer_cache_redis_up"]), 1.0);
    // The node's own answer replaces the giant, and it serves on.
    let deadline = Instant::now() + Duration::from_secs(5);
    while redis.cli(&["STRLEN", &name]).parse::<u64>().unwrap() > 1 << 20 {
        assert!(Instant::now() < deadline, "the oversized value was never replaced");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(cache_of(&infer_digits(b, &request("b-again", row))), "memory");
}

#[test]
fn finding_8_a_site_key_shorter_than_32_bytes_leaves_the_layer_off_and_says_why() {
    let Some(redis) = RedisServer::start(None, None) else { return };
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("redis.key");
    std::fs::write(&short, &SITE_KEY[..32]).unwrap();
    let (node, http) =
        node("gw-s16", &redis.url(), &[("EDGEINFER_CACHE__REDIS__KEY_FILE", short.to_str().unwrap())]);
    assert_eq!(cache_of(&infer_digits(http, &request("s1", 3))), "miss", "the node serves");
    let (_, stats) = get_json(http, "/cache/stats");
    assert_eq!(stats["redis"]["up"], false, "{stats}");
    let why = stats["redis"]["error"].as_str().unwrap_or_else(|| panic!("{stats}"));
    assert!(
        why.contains("cache.redis.key_file") && why.contains("16 bytes") && why.contains("at least 32"),
        "{why}"
    );
    assert!(!why.contains(&SITE_KEY[..32]), "the key is never shown: {why}");
    let log = node.log.lock().unwrap().join("\n");
    assert!(log.contains("cache.redis.key_file") && !log.contains(&SITE_KEY[..32]), "{log}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(redis.cli(&["DBSIZE"]), "0", "nothing unsigned written");
}
