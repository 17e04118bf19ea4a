//! The systemd watchdog during a rollout, on the real binary: the node pets
//! only while every version in service answers its probe, the candidate
//! included, and its log names the version that did not.

use super::rollout::models_command;
use super::support::{copy_digits_version, free_port_pair};
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// systemd's `WatchdogSec` for these nodes, in microseconds: a probe every
/// second, each version given 500 ms (a debug build on a shared machine is
/// slow; the wedge below is far longer).
const WATCHDOG_USEC: &str = "2000000";
/// The watchdog's period: half of `WATCHDOG_USEC`.
const PET_EVERY: Duration = Duration::from_secs(1);
/// How long each batch of the wedged version sleeps: longer than the test.
const WEDGED_MS: u64 = 120_000;

/// Something the node said, and when the test heard it.
type Heard = (Instant, String);

/// A node started the way systemd starts it under `WatchdogSec`, serving
/// digits v1 as stable and v2 as a rollout's candidate, with one version's
/// inference wedged after the first few batches.
struct WatchedNode {
    child: Child,
    /// Its sd_notify messages.
    notifications: mpsc::Receiver<Heard>,
    /// Its log lines.
    log: mpsc::Receiver<Heard>,
    _dir: tempfile::TempDir,
}

impl WatchedNode {
    /// `mode`: the rollout's; `wedged`: the version whose inference stops
    /// answering, as the `inference_delay` fail point names it
    /// (`MODEL/VERSION`).
    fn start(mode: &str, wedged: &str) -> WatchedNode {
        let dir = tempfile::tempdir().unwrap();
        let (models, state) = (dir.path().join("models"), dir.path().join("state"));
        copy_digits_version(&models, "1", false);
        copy_digits_version(&models, "2", false);
        // Offline, before the node starts: no admin route (nor the token it
        // may require) is involved.
        models_command(&models, &state, &["promote", "digits", "1"]).unwrap();
        let started = models_command(&models, &state, &["rollout", "digits", "2", "--mode", mode]).unwrap();
        assert_eq!(started["action"], "started", "{started}");
        let socket_path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&socket_path).unwrap();
        // Each probe runs one batch per version: the first two rounds of
        // probes pass (the watchdog pets), then `wedged` sleeps.
        let failpoints = format!("inference_delay=4*off->return({wedged}:{WEDGED_MS})");
        // systemd sets WATCHDOG_PID to the service's pid; `exec` keeps the shell's.
        let mut child = Command::new("sh")
            .args(["-c", "WATCHDOG_PID=$$ exec \"$0\" serve --models-dir \"$1\" --log info,rumqttd=warn"])
            .arg(env!("CARGO_BIN_EXE_edgeinfer"))
            .arg(&models)
            .env_remove("EDGEINFER_CONFIG")
            .env("NOTIFY_SOCKET", &socket_path)
            .env("WATCHDOG_USEC", WATCHDOG_USEC)
            .env("FAILPOINTS", failpoints)
            .env("EDGEINFER_MQTT__URL", format!("mqtt://127.0.0.1:{}", free_port_pair()))
            .env("EDGEINFER_MQTT__EMBEDDED_BROKER", "true")
            .env("EDGEINFER_HTTP__LISTEN", "")
            .env("EDGEINFER_NODE__STATE_DIR", &state)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        WatchedNode { child, notifications: listen(socket), log: read_lines(stderr), _dir: dir }
    }

    /// Waits for an sd_notify message with the line `wanted`.
    fn notified(&self, wanted: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.notifications.recv_timeout(left) {
                Ok((_, text)) if text.lines().any(|l| l == wanted) => return,
                Ok(_) => {}
                Err(_) => panic!("no {wanted:?} from the node within {within:?}"),
            }
        }
    }

    /// When the node logged a line holding every one of `needles`.
    fn logged(&self, needles: &[&str], within: Duration) -> Instant {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.log.recv_timeout(left) {
                Ok((at, line)) if needles.iter().all(|n| line.contains(n)) => return at,
                Ok(_) => {}
                Err(_) => panic!(
                    "the node logged no line holding {needles:?} within {within:?}; \
                     it pets on, wedged"
                ),
            }
        }
    }

    /// The WATCHDOG=1 messages heard from `since` until `until`.
    fn pets_between(&self, since: Instant, until: Instant) -> Vec<Instant> {
        let mut pets = Vec::new();
        while let Ok((at, text)) =
            self.notifications.recv_timeout(until.saturating_duration_since(Instant::now()))
        {
            if at > since && text.lines().any(|l| l == "WATCHDOG=1") {
                pets.push(at);
            }
        }
        pets
    }
}

impl Drop for WatchedNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sd_notify messages arriving on `socket`, as they are heard.
fn listen(socket: UnixDatagram) -> mpsc::Receiver<Heard> {
    let (tx, rx) = mpsc::channel();
    socket.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            // A timeout sends an empty message: how the thread learns that
            // the test is gone (the send fails) and ends.
            let text = match socket.recv(&mut buf) {
                Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
                Err(_) => String::new(),
            };
            if tx.send((Instant::now(), text)).is_err() {
                return;
            }
        }
    });
    rx
}

/// The node's log lines, as they are written (and echoed to the test's).
fn read_lines(stderr: std::process::ChildStderr) -> mpsc::Receiver<Heard> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[node] {line}");
            let _ = tx.send((Instant::now(), line));
        }
    });
    rx
}

/// Finding 7 of issue 35: the watchdog probed only the version answering
/// requests that name none (stable), so a wedged candidate answering its
/// share of devices (up to all of them) kept `WATCHDOG=1` going. Now a
/// wedged candidate, canary or shadow, fails the probe like a wedged
/// stable, the log names the model, the version and its part, and the
/// candidate is rolled back: stable answers again, and the petting resumes
/// within the watchdog's period, so systemd has no restart to make (one
/// would resume the rollout from the state file, and wedge again). A wedged
/// stable stops the petting for good.
#[test]
fn a_wedged_candidate_fails_the_watchdog_probe_and_is_rolled_back_a_wedged_stable_stops_the_petting() {
    for (mode, wedged, named) in [
        ("canary", "digits/2", "digits v2 (canary candidate)"),
        // A shadow answers no device, but it is a wedged part of the node
        // all the same (its threads, its comparisons): the same rule.
        ("shadow", "digits/2", "digits v2 (shadow candidate)"),
        // The comparison: a wedged stable, which the watchdog always caught.
        ("canary", "digits/1", "digits v1 (serving)"),
    ] {
        eprintln!("{mode} rollout, {wedged} wedged");
        let node = WatchedNode::start(mode, wedged);
        node.notified("READY=1", Duration::from_secs(60));
        // While every version answers, the watchdog pets.
        node.notified("WATCHDOG=1", Duration::from_secs(30));
        let failed_at = node.logged(&["watchdog", named, "not petting"], Duration::from_secs(30));
        if wedged == "digits/1" {
            // A pet sent just before the failed probe may be heard just
            // after its log line; the next one would come a period later.
            let since = failed_at + PET_EVERY / 2;
            let pets = node.pets_between(since, failed_at + 4 * PET_EVERY);
            assert!(pets.is_empty(), "stable wedged: the node went on petting, {} times", pets.len());
            continue;
        }
        node.logged(&["watchdog: digits v2 rolled back to v1"], Duration::from_secs(10));
        let pets = node.pets_between(failed_at, failed_at + 3 * PET_EVERY);
        let first = pets.first().unwrap_or_else(|| panic!("{mode}: no pet after the rollback"));
        // WatchdogSec is 2 periods: a pet within it, and regular ones after.
        assert!(*first - failed_at < 2 * PET_EVERY, "{mode}: first pet {:?} after", *first - failed_at);
        assert!(pets.len() >= 2, "{mode}: {} pets in 3 periods after the rollback", pets.len());
    }
}
