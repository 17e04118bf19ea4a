//! Living under a service manager: signals, sd_notify, the watchdog, and
//! reloading config and models without dropping requests.
//!
//! SIGTERM and SIGINT ask the services to drain (see `MqttService::run`);
//! SIGHUP reloads. systemd hears READY once the models are loaded and the
//! broker confirmed the subscriptions, WATCHDOG only while a request can
//! still flow, STOPPING and RELOADING around those, and STATUS lines a
//! person reads in `systemctl status`.

use crate::config::Config;
use crate::config::reference::RESTART_KEYS;
use crate::engine::{Engine, EngineOptions};
use crate::model::{Registry, RuntimeOptions};
use sd_notify::NotifyState;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGTERM or SIGINT: drain and exit.
    Stop(&'static str),
    /// SIGHUP: reload config and models.
    Reload,
}

/// Signals as a channel; signal-hook's handler only writes to a pipe, and a
/// thread turns that into messages.
pub fn signals() -> std::io::Result<mpsc::UnboundedReceiver<Signal>> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for signal in signals.forever() {
            let message = match signal {
                SIGHUP => Signal::Reload,
                SIGINT => Signal::Stop("SIGINT"),
                _ => Signal::Stop("SIGTERM"),
            };
            if tx.send(message).is_err() {
                return;
            }
        }
    })?;
    Ok(rx)
}

/// Threads in tokio's blocking pool (`edgeinfer serve`).
pub const BLOCKING_THREADS: usize = 4;

/// Threads (systemd counts them as tasks) a node may have at once with
/// `config` and `versions` loaded model versions: the runtime's workers and
/// blocking pool, every version's inference threads twice over (a reload
/// starts the new ones before the old ones end), and the fixed ones
/// (signals, stats, cache writer and reader, planner, sled's flushers and its pool of
/// 7 idle threads, the embedded broker).
pub fn tasks_needed(config: &Config, versions: usize) -> usize {
    let inference = versions * config.runtime.threads_per_model;
    config.runtime.io_threads + BLOCKING_THREADS + 2 * inference + 25
}

/// File descriptors a node may hold: HTTP connections, the embedded
/// broker's, the MQTT and cloud connections, sled's files and the models.
pub fn files_needed(config: &Config) -> usize {
    let http = if config.http.listen.is_empty() { 0 } else { config.http.max_connections };
    let broker = if config.mqtt.embedded_broker { crate::config::EMBEDDED_BROKER_MAX_CONNECTIONS } else { 0 };
    http + broker + config.cloud.max_concurrency + 64
}

/// Warns, naming the setting to raise, when the service's task limit
/// (cgroup `pids.max`, systemd's TasksMax) or open-file limit is below what
/// this config may need: a thread that cannot start refuses a reload, and a
/// connection that cannot be accepted is lost.
pub fn check_limits(config: &Config, registry: &crate::model::Registry) {
    let tasks = tasks_needed(config, registry.all().count());
    if let Some(max) = pids_max()
        && max < tasks as u64
    {
        tracing::warn!(
            "the service's task limit (TasksMax / pids.max) is {max}, below the {tasks} threads this config \
             may need during a reload; raise TasksMax to at least {tasks}"
        );
    }
    let files = files_needed(config);
    if let Some(max) = open_files_max()
        && max < files as u64
    {
        tracing::warn!(
            "the open-file limit (LimitNOFILE) is {max}, below the {files} this config may use; raise it, \
             or lower http.max_connections"
        );
    }
}

/// This process's cgroup v2 `pids.max`, if it has one.
fn pids_max() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    std::fs::read_to_string(format!("/sys/fs/cgroup{path}/pids.max")).ok()?.trim().parse().ok()
}

/// The soft open-file limit, from /proc (no libc call needed).
fn open_files_max() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// sd_notify, a no-op outside systemd (no `NOTIFY_SOCKET`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Notifier;

impl Notifier {
    fn send(&self, states: &[NotifyState]) {
        if std::env::var_os("NOTIFY_SOCKET").is_some()
            && let Err(e) = sd_notify::notify(false, states)
        {
            tracing::warn!("sd_notify: {e}");
        }
    }

    pub fn ready(&self, status: &str) {
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    pub fn status(&self, status: &str) {
        self.send(&[NotifyState::Status(status)]);
    }

    pub fn reloading(&self) {
        // MONOTONIC_USEC lets `Type=notify-reload` (systemd 253+) match the
        // reload to its READY; plain `Type=notify` ignores it.
        match NotifyState::monotonic_usec_now() {
            Ok(now) => self.send(&[NotifyState::Reloading, now, NotifyState::Status("reloading")]),
            Err(_) => self.send(&[NotifyState::Reloading, NotifyState::Status("reloading")]),
        }
    }

    pub fn stopping(&self, status: &str) {
        self.send(&[NotifyState::Stopping, NotifyState::Status(status)]);
    }

    pub fn watchdog(&self) {
        self.send(&[NotifyState::Watchdog]);
    }

    /// Asks systemd for `more` time to finish starting (EXTEND_TIMEOUT_USEC),
    /// with the reason in the status line.
    pub fn extend_start(&self, more: Duration, status: &str) {
        let usec = u32::try_from(more.as_micros()).unwrap_or(u32::MAX);
        self.send(&[NotifyState::ExtendTimeoutUsec(usec), NotifyState::Status(status)]);
    }

    /// How often systemd wants to hear WATCHDOG (`WatchdogSec`), if at all.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        let mut usec = 0;
        sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec))
    }
}

/// When the MQTT service last got anything from its event loop (a packet,
/// or a failed reconnect): a loop that stopped turning is a wedged node.
#[derive(Debug, Clone, Default)]
pub struct Heartbeat(Arc<AtomicU64>);

impl Heartbeat {
    pub fn beat(&self) {
        self.0.store(crate::telemetry::unix_now_ms(), Ordering::Relaxed);
    }

    pub fn age(&self) -> Duration {
        Duration::from_millis(crate::telemetry::unix_now_ms().saturating_sub(self.0.load(Ordering::Relaxed)))
    }
}

/// Sends WATCHDOG at half of `interval` while a probe request gets through
/// the pipeline on every version in service (a rollout's candidate too: it
/// may answer every device) and the MQTT loop keeps turning. A wedged node
/// stops petting, and systemd restarts it; the log names each version that
/// did not answer. A broker outage does not count (the loop turns while it
/// reconnects).
pub async fn watchdog(engine: Arc<Engine>, heartbeat: Heartbeat, stale_after: Duration, interval: Duration) {
    let notifier = Notifier;
    let mut tick = tokio::time::interval(interval / 2);
    loop {
        tick.tick().await;
        match engine.probe(interval / 4).await {
            Ok(()) if heartbeat.age() <= stale_after => notifier.watchdog(),
            Ok(()) => tracing::error!(
                "watchdog: the MQTT loop has not turned for {:.0} s; not petting",
                heartbeat.age().as_secs_f64()
            ),
            Err(e) => {
                tracing::error!("watchdog: the probe failed: {e}; not petting");
                // Stable took the wedged candidate's devices back: petting
                // now, once it answers, leaves systemd no gap to act on.
                if roll_back_wedged_candidates(&engine, &e).await
                    && engine.probe(interval / 4).await.is_ok()
                    && heartbeat.age() <= stale_after
                {
                    tracing::info!("watchdog: every version in service answers again; petting");
                    notifier.watchdog();
                }
            }
        }
    }
}

/// A candidate that did not answer its probe is rolled back, so stable
/// takes its devices again and the node need not be restarted: a restart
/// would resume the same rollout from the state file, and wedge again.
/// True when every version that failed was a candidate, now rolled back.
async fn roll_back_wedged_candidates(engine: &Engine, failed: &crate::engine::ProbeError) -> bool {
    let (crate::engine::ProbeError::Unanswered(versions), Some(rollout)) = (failed, engine.rollout()) else {
        return false;
    };
    let mut all_rolled_back = true;
    for wedged in versions {
        if !matches!(wedged.role, crate::engine::Role::Candidate(_)) {
            all_rolled_back = false;
            continue;
        }
        let by = crate::rollout::Asker::named("watchdog (the candidate did not answer its probe)");
        match rollout.rollback(&wedged.model, engine.registry().available(), by).await {
            Ok(d) => tracing::error!(
                "watchdog: {} v{} rolled back to v{}: {}",
                d.model,
                d.from,
                d.version,
                wedged.why
            ),
            Err(e) => {
                tracing::error!(
                    "watchdog: {} v{} could not be rolled back: {e}",
                    wedged.model,
                    wedged.version
                );
                all_rolled_back = false;
            }
        }
    }
    all_rolled_back
}

/// Where a reload reads from: the same file and command-line override the
/// node started with.
#[derive(Debug, Clone)]
pub struct ReloadSource {
    pub config_file: Option<PathBuf>,
    pub models_dir: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("models directory {dir}: {source}")]
    Models { dir: PathBuf, source: Box<crate::model::LoadError> },
    #[error("model {model} would have no loadable version left ({why}); keeping the current models")]
    Lost { model: String, why: String },
    #[error(
        "model {model}'s stable version v{version} would be gone ({why}); keeping the current models \
         (promote another version first, or put it back)"
    )]
    StableLost { model: String, version: String, why: String },
    #[error("{0}; keeping the current models")]
    Threads(#[from] crate::engine::SpawnError),
    #[error(
        "model {model} v{version} is new and models.{model}.auto_rollout is on, but its rollout cannot start \
         ({source}); keeping the current models, so it never serves untried"
    )]
    Rollout { model: String, version: String, source: Box<crate::rollout::RolloutError> },
}

impl ReloadError {
    /// A few words and no paths, for the retained status (the log has the rest).
    pub fn reason(&self) -> String {
        match self {
            ReloadError::Config(e) => e.reason(),
            ReloadError::Models { .. } => "the models directory cannot be read".into(),
            ReloadError::Lost { model, .. } => {
                format!("model {model} would have no loadable version left; keeping the current models")
            }
            ReloadError::StableLost { model, version, .. } => {
                format!("model {model}'s stable version v{version} would be gone; keeping the current models")
            }
            ReloadError::Threads(e) => format!("cannot start inference threads for model {}", e.model),
            ReloadError::Rollout { model, version, source } => format!(
                "model {model} v{version}'s auto rollout cannot start ({}); keeping the current models",
                source.code()
            ),
        }
    }
}

/// What a reload did, for the log and the status line.
#[derive(Debug, Default)]
pub struct Reloaded {
    pub serving: Vec<String>,
    /// Versions found but refused (the rest were swapped in), with paths.
    pub refused: Vec<String>,
    /// The same as `NAME vVERSION: reason`, for the status.
    pub refused_summary: Vec<String>,
}

impl ReloadSource {
    pub fn load(&self) -> Result<Config, crate::config::ConfigError> {
        let mut config = Config::load(self.config_file.as_deref())?;
        if let Some(dir) = &self.models_dir {
            config.node.models_dir = dir.clone();
        }
        Ok(config)
    }
}

/// Reads the config and the models directory again and swaps them in. On
/// any error the node keeps serving what it had. What it cannot apply:
/// `needing_restart`.
pub fn reload(source: &ReloadSource, engine: &Engine) -> Result<(Config, Reloaded), ReloadError> {
    let config = source.load()?;
    let runtime = RuntimeOptions::for_node(&config.runtime.batch_sizes, true, &config.node.state_dir, true);
    let registry = Registry::load(&config.node.models_dir, &runtime).map_err(|source| {
        ReloadError::Models { dir: config.node.models_dir.clone(), source: Box::new(source) }
    })?;
    registry.plan_rest_in_background();
    let refused: Vec<String> =
        registry.refused.iter().map(|r| format!("{}: {}", r.dir.display(), r.error)).collect();
    for model in engine.registry().active() {
        if registry.get(model.name(), None).is_err() {
            let why = refused
                .iter()
                .find(|r| r.contains(&format!("/{}/", model.name())))
                .cloned()
                .unwrap_or_else(|| "its directory is gone".into());
            return Err(ReloadError::Lost { model: model.name().to_string(), why });
        }
    }
    // A pinned stable version must survive the reload: serving the newest
    // instead could bring back the version it was rolled back from.
    if let Some(rollout) = engine.rollout() {
        for (model, deployment) in &rollout.current().models {
            if engine.registry().get(model, Some(&deployment.stable)).is_ok()
                && registry.get(model, Some(&deployment.stable)).is_err()
            {
                let stable_dir = format!("/{model}/{}", deployment.stable);
                let why = refused
                    .iter()
                    .find(|r| r.contains(&stable_dir))
                    .cloned()
                    .unwrap_or_else(|| "its directory is gone".into());
                let version = deployment.stable.clone();
                return Err(ReloadError::StableLost { model: model.clone(), version, why });
            }
        }
    }
    // Before the swap, so a new version never serves everyone first; ended
    // again if the swap fails (the candidate would never be loaded).
    let (previous, mut started) = (engine.registry(), Vec::new());
    let outcome = start_auto_rollouts(engine, &registry, &config, &mut started).and_then(|()| {
        let deployments = engine.rollout().map(|r| r.current());
        let stable = |m: &str| deployments.as_deref().and_then(|d| d.stable(m));
        let serving = registry.serving(stable).map(|m| format!("{} v{}", m.name(), m.version())).collect();
        let refused_summary = registry.refused.iter().map(|r| r.summary()).collect();
        let registry = Arc::new(registry);
        engine.reload(registry.clone(), EngineOptions::from_config(&config))?;
        Ok((serving, refused_summary, registry))
    });
    let (serving, refused_summary, registry) = match outcome {
        Ok(swapped) => swapped,
        Err(e) => {
            end_rollouts(engine, started);
            return Err(e);
        }
    };
    engine.set_config(&config);
    crate::telemetry::describe_models(Some(&previous), &registry);
    Ok((config, Reloaded { serving, refused, refused_summary }))
}

/// `models.NAME.auto_rollout`: the newest version a reload finds that was
/// not loaded before starts a rollout against the version that served
/// before, instead of serving. A version that failed its checks is not in
/// `registry`, so it never starts one. One that cannot start refuses the
/// reload, unless a pinned stable keeps it from serving anyway (a rollout
/// already runs). The models and versions whose rollout started go into
/// `started`.
fn start_auto_rollouts(
    engine: &Engine,
    registry: &Registry,
    config: &Config,
    started: &mut Vec<(String, String)>,
) -> Result<(), ReloadError> {
    let Some(rollout) = engine.rollout() else { return Ok(()) };
    let (before, available) = (engine.registry().available(), registry.available());
    for (model, versions) in &available {
        let Some(mode) = config.models.get(model).and_then(|m| m.auto_rollout.mode()) else { continue };
        let Some(newest) = versions.last() else { continue };
        if before.get(model).is_some_and(|v| v.contains(newest)) {
            continue;
        }
        let state = rollout.current();
        let plan = crate::rollout::Plan {
            version: newest.clone(),
            mode,
            policy: config.rollout_policy(model),
            serving_before: state.serving(model, &before).map(str::to_string),
            config: None,
        };
        let by = crate::rollout::Asker::named("auto_rollout (reload)");
        match rollout.start_rollout_blocking(model, plan, available.clone(), by) {
            Ok(d) => {
                tracing::info!("reload: {model} v{newest}: {}", d.reason);
                started.push((model.clone(), newest.clone()));
            }
            Err(e) if state.stable(model).is_some() => {
                tracing::warn!("reload: {model} v{newest} did not start a rollout ({e}); it does not serve")
            }
            Err(source) => {
                let source = Box::new(source);
                return Err(ReloadError::Rollout { model: model.clone(), version: newest.clone(), source });
            }
        }
    }
    Ok(())
}

/// Ends the rollouts a refused reload started.
fn end_rollouts(engine: &Engine, started: Vec<(String, String)>) {
    let Some(rollout) = engine.rollout() else { return };
    for (model, version) in started {
        let by = crate::rollout::Asker::named("auto_rollout (reload refused)");
        if let Err(e) = rollout.end_rollout_blocking(&model, &version, by) {
            tracing::error!("reload: the rollout of {model} could not be ended: {e}");
        }
    }
}

/// `models.NAME.auto_rollout` at start, from the deployment state: with no
/// stable pinned, the version serving is pinned (this is the first start
/// that knows of it), so a version a later restart finds is tried against
/// it; with one pinned, the newest version, if it is newer than stable and
/// no decision ever named it, starts a rollout against stable. Either way
/// stable serves meanwhile, so a failure is logged, not fatal.
pub async fn start_auto_rollouts_at_start(engine: &Engine, config: &Config) {
    let Some(rollout) = engine.rollout() else { return };
    let available = engine.registry().available();
    for (model, versions) in &available {
        let Some(mode) = config.models.get(model).and_then(|m| m.auto_rollout.mode()) else { continue };
        let state = rollout.current();
        let Some(serving) = state.serving(model, &available).map(str::to_string) else { continue };
        let Some(stable) = state.stable(model) else {
            let by = crate::rollout::Asker::named("auto_rollout (start)");
            if let Err(e) = rollout.pin(model, &serving, by).await {
                tracing::error!("start: {model} v{serving} could not be pinned as stable: {e}");
            }
            continue;
        };
        // Serving order is oldest first: only a version after stable is new.
        let Some(at) = versions.iter().position(|v| v == stable) else { continue };
        let Some(newest) = versions.get(at + 1..).and_then(<[String]>::last).cloned() else { continue };
        if state.decided_on(model, &newest) || state.models[model].candidate.is_some() {
            continue;
        }
        let plan = crate::rollout::Plan {
            version: newest.clone(),
            mode,
            policy: config.rollout_policy(model),
            serving_before: Some(serving),
            config: None,
        };
        let by = crate::rollout::Asker::named("auto_rollout (start)");
        match rollout.start_rollout(model, plan, available.clone(), by).await {
            Ok(d) => tracing::info!("start: {model} v{newest}: {}", d.reason),
            Err(e) => {
                tracing::error!("start: {model} v{newest} did not start a rollout ({e}); stable serves")
            }
        }
    }
}

/// The settings changed since `started` (the config the process started
/// with) that a reload does not apply: the services and the cache are
/// built once at start (`config::reference::RESTART_KEYS`, which the
/// config reference's reload column shows too).
pub fn needing_restart(started: &Config, next: &Config) -> Vec<&'static str> {
    let (started, next) = (started.to_toml_with_secrets(), next.to_toml_with_secrets());
    RESTART_KEYS.into_iter().filter(|key| values_at(&started, key) != values_at(&next, key)).collect()
}

/// The values under a dotted `key` with their paths; `NAME` matches every
/// model, and a key that is not set has no value.
fn values_at<'v>(value: &'v toml::Value, key: &str) -> Vec<(String, &'v toml::Value)> {
    let mut found = vec![(String::new(), value)];
    for part in key.split('.') {
        found = found
            .into_iter()
            .flat_map(|(path, value)| -> Vec<(String, &toml::Value)> {
                match (part, value.as_table()) {
                    ("NAME", Some(table)) => table.iter().map(|(k, v)| (format!("{path}.{k}"), v)).collect(),
                    (_, Some(table)) => {
                        table.get(part).map(|v| (format!("{path}.{part}"), v)).into_iter().collect()
                    }
                    _ => Vec::new(),
                }
            })
            .collect();
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_unit_leaves_room_for_the_shipped_config() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let unit = std::fs::read_to_string(root.join("systemd/edgeinfer.service")).unwrap();
        let setting = |key: &str| -> usize {
            let line = unit.lines().find(|l| l.starts_with(&format!("{key}="))).unwrap();
            line[key.len() + 1..].trim().parse().unwrap()
        };
        let text = std::fs::read_to_string(root.join("systemd/edgeinfer.toml")).unwrap();
        let config = Config::parse(&text).unwrap();
        let versions = std::fs::read_dir(root.join("models"))
            .unwrap()
            .flat_map(|d| std::fs::read_dir(d.unwrap().path()).into_iter().flatten())
            .filter(|v| v.as_ref().unwrap().path().join("model.toml").is_file())
            .count();
        assert!(versions >= 3, "{versions}");
        // Room for four times the shipped models, or four threads each.
        assert!(setting("TasksMax") >= tasks_needed(&config, 4 * versions), "{}", setting("TasksMax"));
        let mut threaded = config.clone();
        threaded.runtime.threads_per_model = 4;
        assert!(setting("TasksMax") >= tasks_needed(&threaded, versions));
        let mut embedded = config.clone();
        embedded.mqtt.embedded_broker = true;
        assert!(setting("LimitNOFILE") >= files_needed(&embedded));
    }

    #[test]
    fn a_reload_names_the_changes_it_cannot_apply() {
        let running = Config::default();
        assert!(needing_restart(&running, &running.clone()).is_empty());
        let mut applied = running.clone();
        applied.models.entry("digits".into()).or_default().threshold = 0.5;
        assert!(needing_restart(&running, &applied).is_empty(), "a threshold is applied by a reload");
        let mut next = running.clone();
        next.cache.memory_bytes *= 2;
        next.limits.max_packet_bytes *= 2;
        next.limits.max_payload_bytes *= 2;
        next.models.entry("digits".into()).or_default().threshold = 0.5;
        let named = needing_restart(&running, &next);
        assert_eq!(named.len(), 2, "{named:?}");
        assert!(named[0].starts_with("cache") && named[1].starts_with("limits.max_packet_bytes"));
        // A secret is compared as it is, though it prints redacted.
        let mut password = running.clone();
        password.mqtt.password = Some(crate::config::Secret("hunter2".into()));
        assert_eq!(needing_restart(&running, &password), ["mqtt"]);
        assert!(
            !password.to_toml().to_string().contains("hunter2")
                && password.to_toml().to_string().contains("<redacted>")
        );
    }
}
