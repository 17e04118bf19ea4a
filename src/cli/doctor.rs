//! `edgeinfer doctor`: the first command a field engineer runs when
//! something is wrong. Each check is one line, ok / warn / fail with the
//! fix; the exit code is 1 when any check fails.

use clap::Args;
use edgeinfer::config::Config;
use edgeinfer::lifecycle::{self, ReloadSource};
use edgeinfer::model::{Registry, RuntimeOptions};
use edgeinfer::transport::mqtt::client_options;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet};
use rumqttc::v5::{AsyncClient, ConnectionError, Event};
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct DoctorArgs {
    /// Print the findings as JSON (an object with `ok` and `checks`).
    #[arg(long)]
    json: bool,
    /// The longest each network check (broker, Redis, cloud tier) waits.
    #[arg(long, default_value_t = 3000, value_name = "MS")]
    timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Status {
    Ok,
    Warn,
    Fail,
    /// Not checked: it does not apply to this config or machine.
    Skip,
}

#[derive(Debug, Serialize)]
struct Finding {
    check: &'static str,
    status: Status,
    detail: String,
    /// What to do about a warn or a fail.
    #[serde(skip_serializing_if = "Option::is_none")]
    fix: Option<String>,
}

#[derive(Default)]
struct Findings(Vec<Finding>);

impl Findings {
    fn add(&mut self, check: &'static str, status: Status, detail: String, fix: Option<String>) {
        self.0.push(Finding { check, status, detail, fix });
    }
    fn ok(&mut self, check: &'static str, detail: String) {
        self.add(check, Status::Ok, detail, None);
    }
    fn warn(&mut self, check: &'static str, detail: String, fix: String) {
        self.add(check, Status::Warn, detail, Some(fix));
    }
    fn fail(&mut self, check: &'static str, detail: String, fix: String) {
        self.add(check, Status::Fail, detail, Some(fix));
    }
    fn skip(&mut self, check: &'static str, detail: String) {
        self.add(check, Status::Skip, detail, None);
    }
}

/// A round trip through the broker slower than this looks like Nagle's
/// algorithm against delayed ACKs (about 40 ms on Linux), not a slow link.
const NAGLE_LIKE: Duration = Duration::from_millis(30);

pub fn run(source: &ReloadSource, args: DoctorArgs) -> anyhow::Result<i32> {
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut findings = Findings::default();
    let file = source
        .config_file
        .as_ref()
        .map_or("no config file: the defaults".into(), |f| f.display().to_string());
    match source.load() {
        Ok(config) => {
            findings.ok("config", format!("{file}: valid"));
            check_all(&config, timeout, &mut findings)?;
        }
        Err(e) => findings.fail(
            "config",
            format!("{file}: {e}"),
            "fix the keys named (`edgeinfer config check FILE` lists every mistake); the other checks \
             need a valid config"
                .into(),
        ),
    }
    let failed = findings.0.iter().any(|f| f.status == Status::Fail);
    if args.json {
        let report = serde_json::json!({ "ok": !failed, "checks": findings.0 });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for f in &findings.0 {
            let status = match f.status {
                Status::Ok => "ok  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
                Status::Skip => "skip",
            };
            println!("{status}  {:<10} {}", f.check, f.detail);
            if let Some(fix) = &f.fix {
                println!("      {:<10} fix: {fix}", "");
            }
        }
    }
    Ok(if failed { 1 } else { 0 })
}

fn check_all(config: &Config, timeout: Duration, findings: &mut Findings) -> anyhow::Result<()> {
    let versions = models(config, findings);
    state_dir(config, findings);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(broker(config, timeout, findings));
    service_limits(config, versions, findings);
    clock(findings);
    match config.cache.redis.enabled {
        true => rt.block_on(reachable(
            "redis",
            "cache.redis.url",
            &config.cache.redis.url,
            6379,
            timeout,
            findings,
        )),
        false => findings.skip("redis", "cache.redis.enabled = false".into()),
    }
    match config.cloud.enabled {
        true => rt.block_on(reachable("cloud", "cloud.url", &config.cloud.url, 443, timeout, findings)),
        false => findings.skip("cloud", "cloud.enabled = false".into()),
    }
    Ok(())
}

/// Loads every version as `serve` does (sha256, golden vectors); the
/// number loaded.
fn models(config: &Config, findings: &mut Findings) -> usize {
    let dir = &config.node.models_dir;
    let runtime = RuntimeOptions::for_node(&[1], true, &config.node.state_dir, true);
    let registry = match Registry::load(dir, &runtime) {
        Ok(registry) => registry,
        Err(e) => {
            findings.fail(
                "models",
                format!("{}: {e}", dir.display()),
                "set node.models_dir (or --models-dir) to the directory holding NAME/VERSION/model.toml"
                    .into(),
            );
            return 0;
        }
    };
    let loaded: Vec<String> = registry.all().map(|m| format!("{} v{}", m.name(), m.version())).collect();
    for refused in &registry.refused {
        findings.fail(
            "models",
            format!("{}: refused: {}", refused.dir.display(), refused.error),
            "replace the version's files with the ones its model.toml was written for, or remove the \
             directory; `edgeinfer models verify` shows every version"
                .into(),
        );
    }
    match loaded.len() {
        0 if registry.refused.is_empty() => findings.fail(
            "models",
            format!("{}: no model versions", dir.display()),
            "set node.models_dir (or --models-dir) to the directory holding NAME/VERSION/model.toml".into(),
        ),
        0 => {}
        n => findings.ok("models", format!("{n} loaded, golden vectors pass: {}", loaded.join(", "))),
    }
    loaded.len()
}

/// Writable, synced, and room for what the config lets the node keep.
fn state_dir(config: &Config, findings: &mut Findings) {
    let dir = &config.node.state_dir;
    let fix = format!(
        "let the service's user write {} (systemd's StateDirectory= does), or set node.state_dir",
        dir.display()
    );
    if let Err(e) = write_probe(dir) {
        findings.fail("state dir", format!("{}: not writable: {e}", dir.display()), fix);
        return;
    }
    let needed = if config.cache.enabled { config.cache.disk_bytes } else { 0 }
        + if config.cloud.enabled { config.cloud.spool_max_bytes } else { 0 }
        + if config.capture.enabled { config.capture.max_bytes } else { 0 };
    let free = rustix::fs::statvfs(dir.as_path()).map(|s| s.f_bavail * s.f_frsize);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    match free {
        Ok(free) if free < needed => findings.warn(
            "state dir",
            format!(
                "{}: writable, {:.0} MiB free, less than the {:.0} MiB the cache, spool and capture bounds allow",
                dir.display(),
                mib(free),
                mib(needed)
            ),
            "free space there, or lower cache.disk_bytes (the disk cache turns itself off on a full disk \
             and serves on)"
                .into(),
        ),
        Ok(free) => findings.ok(
            "state dir",
            format!("{}: writable, {:.0} MiB free for {:.0} MiB of bounds", dir.display(), mib(free), mib(needed)),
        ),
        Err(e) => findings.ok("state dir", format!("{}: writable (free space unknown: {e})", dir.display())),
    }
}

fn write_probe(dir: &Path) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".doctor-{}", std::process::id()));
    let written = std::fs::File::create(&probe).and_then(|mut f| {
        f.write_all(b"edgeinfer doctor")?;
        f.sync_all()
    });
    let _ = std::fs::remove_file(&probe);
    written
}

/// Connects with the node's login and TLS, then times a message through
/// the broker and back on a topic of its own.
async fn broker(config: &Config, timeout: Duration, findings: &mut Findings) {
    let mqtt = &config.mqtt;
    let client_id = format!("edgeinfer-doctor-{:08x}", fastrand::u32(..));
    // A passing client: nothing for the broker to keep once it leaves.
    let session = edgeinfer::config::MqttConfig { session_expiry_s: 0, ..mqtt.clone() };
    let mut options = match client_options(&session, &client_id, 1 << 20, 16) {
        Ok(options) => options,
        Err(e) => {
            findings.fail("broker", e.to_string(), "fix the file or setting named".into());
            return;
        }
    };
    options.set_clean_start(true).set_manual_acks(false).set_connection_timeout(timeout.as_secs().max(1));
    let (client, mut eventloop) = AsyncClient::new(options, 16);
    let topic = format!("{}/{}/doctor/{client_id}", mqtt.topic_prefix, config.node.id);
    let login = match &mqtt.username {
        Some(user) => format!("as {user}"),
        None => "without a login".into(),
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut round_trips = Vec::new();
    let mut sent = Instant::now();
    let outcome: Result<(), String> = loop {
        let event = match tokio::time::timeout_at(deadline, eventloop.poll()).await {
            Ok(event) => event,
            Err(_) => break Err(format!("no answer within {} ms", timeout.as_millis())),
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                if let Err(e) = client.subscribe(&topic, QoS::AtMostOnce).await {
                    break Err(e.to_string());
                }
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                sent = Instant::now();
                let _ = client.publish(&topic, QoS::AtMostOnce, false, "ping").await;
            }
            Ok(Event::Incoming(Packet::Publish(p))) if p.topic == topic.as_bytes() => {
                round_trips.push(sent.elapsed());
                if round_trips.len() == 5 {
                    break Ok(());
                }
                sent = Instant::now();
                let _ = client.publish(&topic, QoS::AtMostOnce, false, "ping").await;
            }
            Ok(_) => {}
            Err(e) => break Err(connection_error(&e)),
        }
    };
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(200), eventloop.poll()).await;
    match outcome {
        Ok(()) => {
            round_trips.sort();
            let median = round_trips[round_trips.len() / 2];
            let ms = median.as_secs_f64() * 1e3;
            if median > NAGLE_LIKE {
                findings.warn(
                    "broker",
                    format!("{} {login}: connected; a round trip takes {ms:.1} ms", mqtt.url),
                    "about 40 ms looks like Nagle's algorithm on the broker's sockets: set \
                     `set_tcp_nodelay true` in mosquitto.conf (the embedded broker sets it)"
                        .into(),
                );
            } else {
                findings
                    .ok("broker", format!("{} {login}: connected; a round trip takes {ms:.2} ms", mqtt.url));
            }
        }
        Err(why) => {
            let fix = if why.contains("login") || why.contains("authori") {
                "check mqtt.username and mqtt.password_file against the broker's password file".to_string()
            } else if mqtt.embedded_broker {
                "the embedded broker runs inside the node: start the node (systemctl start edgeinfer)".into()
            } else {
                "start the broker (systemctl status mosquitto) or fix mqtt.url; a firewall must let this host \
                 reach it (a node started without a config file runs its own broker there)"
                    .into()
            };
            findings.fail("broker", format!("{} {login}: {why}", mqtt.url), fix);
        }
    }
}

fn connection_error(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ConnectionRefused(code) => match code {
            ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized => {
                format!("the broker refused the login ({code:?})")
            }
            other => format!("the broker refused the connection ({other:?})"),
        },
        other => other.to_string(),
    }
}

/// The installed unit's TasksMax and LimitNOFILE against what this config
/// may need (the same sums `serve` warns with).
fn service_limits(config: &Config, versions: usize, findings: &mut Findings) {
    let shown = std::process::Command::new("systemctl")
        .args(["show", "edgeinfer.service", "--property=LoadState,TasksMax,LimitNOFILE"])
        .output();
    let text = match shown {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        _ => return findings.skip("limits", "no systemd here (systemctl show failed)".into()),
    };
    let value = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    if value("LoadState") != "loaded" {
        return findings.skip("limits", "edgeinfer.service is not installed".into());
    }
    let tasks = lifecycle::tasks_needed(config, versions.max(1));
    let files = lifecycle::files_needed(config);
    let below = |set: &str, needed: usize| set.parse::<u64>().is_ok_and(|v| v < needed as u64);
    let (tasks_max, nofile) = (value("TasksMax"), value("LimitNOFILE"));
    let mut short = Vec::new();
    if below(&tasks_max, tasks) {
        short.push(format!("TasksMax={tasks_max} < {tasks} threads"));
    }
    if below(&nofile, files) {
        short.push(format!("LimitNOFILE={nofile} < {files} files"));
    }
    match short.is_empty() {
        true => findings.ok(
            "limits",
            format!("edgeinfer.service: TasksMax={tasks_max} (needs {tasks}), LimitNOFILE={nofile} (needs {files})"),
        ),
        false => findings.fail(
            "limits",
            format!("edgeinfer.service: {}", short.join(", ")),
            "raise them in a drop-in (systemctl edit edgeinfer) or lower runtime.threads_per_model / \
             http.max_connections"
                .into(),
        ),
    }
}

/// A clock behind the commit this binary was built from is wrong, and TLS
/// certificates will look not yet valid.
fn clock(findings: &mut Findings) {
    let now = edgeinfer::telemetry::unix_now();
    let built: u64 = env!("BUILD_COMMIT_TIME").parse().unwrap_or(0);
    if built > 0 && now + 86_400 < built {
        findings.fail(
            "clock",
            format!("the system clock says {now} s since 1970, before this binary was built ({built})"),
            "set the time and keep it set (timedatectl set-ntp true); TLS to the broker, Redis and the \
             cloud tier fails with a clock this far behind"
                .into(),
        );
    } else {
        findings.ok("clock", "not behind this binary's build".into());
    }
}

/// A TCP connection to the service at `url` (host and port; `default_port`
/// without one).
async fn reachable(
    check: &'static str,
    key: &str,
    url: &str,
    default_port: u16,
    timeout: Duration,
    findings: &mut Findings,
) {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or_default();
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    let default_port = if url.starts_with("http://") { 80 } else { default_port };
    let address = match authority.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => format!("{host}:{port}"),
        _ => format!("{authority}:{default_port}"),
    };
    let started = Instant::now();
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&address)).await {
        Ok(Ok(_)) => findings.ok(
            check,
            format!("{address}: reachable ({:.1} ms to connect)", started.elapsed().as_secs_f64() * 1e3),
        ),
        Ok(Err(e)) => findings.fail(check, format!("{address}: {e}"), format!("start it, or fix {key}")),
        Err(_) => findings.fail(
            check,
            format!("{address}: no connection within {} ms", timeout.as_millis()),
            format!("a firewall or a wrong address: check {key} and the route"),
        ),
    }
}
