//! The HTTP face as an attacker and a careful operator see it: tokens,
//! administration behind loopback or a token (rollout commands behind the
//! token alone), slow clients cut off, HTTPS.

use super::rollout::models_command;
use super::support::{admin_http, admin_token_env, copy_digits_version, embedded_node_with_http, http_with};
use crate::{digits_request, heldout};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn infer_body() -> Vec<u8> {
    digits_request("h1", &[heldout()[0].1.clone()]).to_string().into_bytes()
}

fn bearer(token: &str) -> Vec<u8> {
    format!("Content-Type: application/json\r\nAuthorization: Bearer {token}").into_bytes()
}

const INFER: &str = "/v2/models/digits/infer";

#[test]
fn tokens_guard_inference_and_administration_and_a_proxy_does_not_make_a_peer_local() {
    let files = tempfile::tempdir().unwrap();
    let (infer_file, admin_file) = (files.path().join("http.token"), files.path().join("admin.token"));
    std::fs::write(&infer_file, "infer-token\n").unwrap();
    std::fs::write(&admin_file, "admin-token\n").unwrap();
    let (infer_path, admin_path) = (infer_file.display().to_string(), admin_file.display().to_string());
    let (_node, _, port) = embedded_node_with_http(
        "gw-h1",
        &[("EDGEINFER_HTTP__TOKEN_FILE", &infer_path), ("EDGEINFER_HTTP__ADMIN_TOKEN_FILE", &admin_path)],
    );
    let status = |path: &str, headers: &[u8]| http_with(port, "POST", path, headers, &infer_body()).0;
    assert_eq!(status(INFER, b"Content-Type: application/json"), 401, "no token");
    assert_eq!(status(INFER, &bearer("wrong")), 401, "a wrong token");
    assert_eq!(status(INFER, &bearer("infer-token")), 200);
    assert_eq!(status(INFER, &bearer("admin-token")), 200, "the admin token may infer too");
    let get = |path: &str, headers: &[u8]| http_with(port, "GET", path, headers, b"").0;
    assert_eq!(get("/v2/models/digits", b"X-A: b"), 401, "metadata needs the token");
    assert_eq!(get("/cache/stats", &bearer("infer-token")), 401, "administration needs its own token");
    assert_eq!(get("/cache/stats", &bearer("admin-token")), 200);
    assert_eq!(get("/metrics", b"X-A: b"), 200, "metrics are open unless http.protect_metrics");
    assert_eq!(get("/v2/health/live", b"X-A: b"), 200);
    // A content type that is not UTF-8 is read as JSON, the default.
    let (code, body) = http_with(
        port,
        "POST",
        INFER,
        b"Content-Type: application/\xff\xfe\r\nAuthorization: Bearer infer-token",
        &infer_body(),
    );
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));

    // `edgeinfer cache stats` sends the admin token it finds in the config.
    let config = files.path().join("edgeinfer.toml");
    std::fs::write(
        &config,
        format!("[http]\nlisten = \"127.0.0.1:{port}\"\nadmin_token_file = {admin_path:?}\n"),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .args(["cache", "stats", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("running node"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Without an admin token: loopback only, and not through a proxy.
    let (_open, _, open_port) = embedded_node_with_http("gw-h2", &[]);
    assert_eq!(http_with(open_port, "GET", "/cache/stats", b"X-A: b", b"").0, 200);
    for proxy in ["X-Forwarded-For: 10.0.0.9", "Forwarded: for=10.0.0.9", "X-Real-IP: 10.0.0.9"] {
        let (code, body) = http_with(open_port, "POST", "/cache/purge", proxy.as_bytes(), b"");
        assert_eq!(code, 403, "{proxy}");
        assert!(String::from_utf8_lossy(&body).contains("http.admin_token_file"), "names the fix");
    }
    assert_eq!(status(INFER, b"Content-Type: application/json"), 401, "the first node is unchanged");
    assert_eq!(http_with(open_port, "POST", INFER, b"Content-Type: application/json", &infer_body()).0, 200);
}

#[test]
fn without_an_admin_token_rollout_routes_are_refused_even_to_loopback_and_the_start_log_says_so() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    copy_digits_version(models.path(), "2", false);
    let m = models.path().display().to_string();
    let (node, _, port) = embedded_node_with_http("gw-h6", &[("EDGEINFER_NODE__MODELS_DIR", &m)]);
    let warned = |node: &super::support::Node| {
        node.log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("no http.admin_token_file") && l.contains("refused"))
    };
    assert!(warned(&node), "the start log says rollout commands are refused without the token");
    // A loopback peer may be ssh -L, socat or a proxy: it may read the status
    // and the cache, but not change which version serves.
    let rollout_routes = [
        "/models/rollback?model=digits",
        "/models/promote?model=digits&version=1",
        "/models/rollout?model=digits&version=1",
    ];
    for path in rollout_routes {
        let (code, body) = http_with(port, "POST", path, b"X-A: b", b"");
        let body = String::from_utf8_lossy(&body);
        assert_eq!(code, 403, "{path}: {body}");
        assert!(body.contains("http.admin_token_file") && body.contains("no node running"), "{body}");
    }
    let (code, status) = http_with(port, "GET", "/models/status", b"X-A: b", b"");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&status));
    let status: serde_json::Value = serde_json::from_slice(&status).unwrap();
    assert_eq!(status[0]["serving"], "2", "nothing changed: {status}");
    assert_eq!(http_with(port, "GET", "/cache/stats", b"X-A: b", b"").0, 200);
    // `edgeinfer models` against it is refused the same way, with the fix.
    let url = format!("http://127.0.0.1:{port}");
    let refused = models_command(models.path(), state.path(), &["rollback", "digits", "--url", &url]);
    let refused = refused.unwrap_err();
    assert!(refused.contains("403") && refused.contains("http.admin_token_file"), "{refused}");
    drop(node);

    // With the token: the right bearer changes the deployment, none or a wrong one is 401.
    let (node, _, port) =
        embedded_node_with_http("gw-h7", &[("EDGEINFER_NODE__MODELS_DIR", &m), admin_token_env()]);
    assert!(!warned(&node), "a node with the token does not warn");
    let rollback = "/models/rollback?model=digits";
    assert_eq!(http_with(port, "POST", rollback, b"X-A: b", b"").0, 401, "no token");
    assert_eq!(http_with(port, "POST", rollback, &bearer("guess"), b"").0, 401, "a wrong token");
    let (code, decision) = admin_http(port, "POST", rollback);
    let decision: serde_json::Value = serde_json::from_slice(&decision).unwrap();
    assert_eq!((code, decision["action"].as_str()), (200, Some("rolled_back")), "{decision}");
    let url = format!("http://127.0.0.1:{port}");
    let promoted = models_command(models.path(), state.path(), &["promote", "digits", "2", "--url", &url]);
    assert_eq!(promoted.unwrap()["version"], "2", "edgeinfer models sends the token from its config");
}

#[test]
fn a_client_sending_headers_a_byte_at_a_time_is_cut_off_while_others_are_served() {
    let (_node, _, port) = embedded_node_with_http(
        "gw-h3",
        &[
            ("EDGEINFER_HTTP__HEADER_TIMEOUT_MS", "1000"),
            ("EDGEINFER_HTTP__BODY_TIMEOUT_MS", "1000"),
            ("EDGEINFER_HTTP__MAX_CONNECTIONS", "4"),
        ],
    );
    let slow = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let started = Instant::now();
        let head = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ".repeat(4);
        for byte in &head {
            if s.write_all(&[*byte]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            if started.elapsed() > Duration::from_secs(10) {
                break;
            }
        }
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        (started.elapsed(), answer)
    });
    // Meanwhile others are served, more of them than max_connections.
    for _ in 0..10 {
        assert_eq!(http_with(port, "POST", INFER, b"Content-Type: application/json", &infer_body()).0, 200);
    }
    // A body that stops arriving gets 408 after http.body_timeout_ms.
    let mut stalled = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stalled.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let started = Instant::now();
    stalled
        .write_all(
            format!("POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{{\"id\":").as_bytes(),
        )
        .unwrap();
    let mut answer = Vec::new();
    let _ = stalled.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("http.body_timeout_ms"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    let (took, answer) = slow.join().unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(took < Duration::from_secs(5), "the slow client was cut off after {took:?}");
    assert!(!answer.contains("200 OK"), "it never got an answer: {answer}");
    eprintln!("slow client cut off after {took:?} ({answer:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_speaks_https_with_the_configured_certificate() {
    use super::support::{loopback_cert, test_ca};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ca = test_ca("edgeinfer site CA");
    let (cert, key) = loopback_cert(&ca, "gw-h4");
    let files = tempfile::tempdir().unwrap();
    let (cert_file, key_file) = (files.path().join("node.pem"), files.path().join("node.key"));
    // The chain: the node's certificate, then its CA (which `edgeinfer cache` trusts).
    std::fs::write(&cert_file, format!("{}{}", cert.pem(), ca.pem())).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let (cert_path, key_path) = (cert_file.display().to_string(), key_file.display().to_string());
    let (_node, _, port) = tokio::task::block_in_place(|| {
        embedded_node_with_http(
            "gw-h4",
            &[("EDGEINFER_HTTP__TLS_CERT_FILE", &cert_path), ("EDGEINFER_HTTP__TLS_KEY_FILE", &key_path)],
        )
    });
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls =
        connector.connect(name, tcp).await.expect("a TLS handshake with the configured certificate");
    let body = infer_body();
    let head = format!(
        "POST {INFER} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(&[head.as_bytes(), &body].concat()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tls.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("\"model_name\":\"digits\""), "{answer}");

    // Plain HTTP gets no answer from an HTTPS listener.
    let plain = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        raw
    })
    .await
    .unwrap();
    assert!(!String::from_utf8_lossy(&plain).contains("\"live\""), "plain HTTP is not served");

    // `edgeinfer cache stats` reaches it over HTTPS, trusting the chain in http.tls_cert_file.
    let config = files.path().join("edgeinfer.toml");
    std::fs::write(
        &config,
        format!("[http]\nlisten = \"127.0.0.1:{port}\"\ntls_cert_file = {cert_path:?}\ntls_key_file = {key_path:?}\n"),
    )
    .unwrap();
    let out = tokio::task::block_in_place(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
            .args(["cache", "stats", "--config"])
            .arg(&config)
            .output()
            .unwrap()
    });
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("https://127.0.0.1"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(feature = "failpoints")]
#[test]
fn a_client_that_hangs_up_leaves_nothing_in_flight() {
    use super::support::{sample, scrape};
    let (_node, _, port) =
        embedded_node_with_http("gw-h5", &[("FAILPOINTS", "request_delay=return(slow:1500)")]);
    let body = digits_request("slow", &[heldout()[0].1.clone()]).to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let during = sample(&scrape(port), &["edgeinfer_in_flight_requests", "model=\"digits\""]);
    assert_eq!(during, 1.0, "the slow request is in flight");
    drop(s);
    std::thread::sleep(Duration::from_millis(2000));
    let after = sample(&scrape(port), &["edgeinfer_in_flight_requests", "model=\"digits\""]);
    assert_eq!(after, 0.0, "the request the client gave up on is not counted in flight any more");
}
