//! A serving node built from a `Config`: the embedded broker where wanted,
//! the engine with its cache and cloud tier, the MQTT and HTTP services,
//! and what systemd hears about them. `edgeinfer serve` is `Node::start`
//! then `Node::run`; tests start a node in-process the same way.

use crate::cloud::{Cloud, CloudError, CloudOptions, spool};
use crate::config::Config;
use crate::engine::{Cache, CacheOptions, Capture, CaptureOptions, CloudTier, Engine, EngineOptions};
use crate::lifecycle::{self, Heartbeat, Notifier, ReloadSource, Signal};
use crate::model::Registry;
use crate::rollout::Rollout;
use crate::telemetry::{self, Status, unix_now};
use crate::transport::mqtt::journal::{Journal, JournalOptions, JournalThread};
use crate::transport::mqtt::{BrokerAddress, MqttService, OptionsError};
use crate::transport::{broker, http};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Mqtt(#[from] OptionsError),
    #[error("mqtt.url {0:?}: cannot resolve the host")]
    Resolve(String),
    #[error("{key} = {value:?}: {why}")]
    Listen { key: &'static str, value: String, why: String },
    #[error(transparent)]
    Broker(#[from] broker::BrokerError),
    #[error(transparent)]
    Cloud(#[from] CloudError),
    #[error(transparent)]
    HttpAccess(#[from] http::AccessError),
    #[error(transparent)]
    Threads(#[from] crate::engine::SpawnError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    #[error("http.listen = {listen:?}: cannot listen there: {source}")]
    Http { listen: String, source: std::io::Error },
    #[error(transparent)]
    Rollout(#[from] crate::rollout::RolloutError),
    #[error(transparent)]
    ControlKey(#[from] crate::transport::mqtt::KeyError),
    #[error(
        "control.enabled = true with the embedded broker open to the network on {listen} and no login: \
         anyone who reaches it could read the fleet's commands and the node's answers and flood the \
         control topic; set mqtt.username and mqtt.password_file (the broker then requires that login of \
         every client), keep the broker on loopback (no mqtt.embedded_listen or \
         mqtt.embedded_v311_listen beyond it), or set control.enabled = false"
    )]
    ControlOnOpenBroker { listen: SocketAddr },
}

/// A started node: its services run on the tokio runtime it was started on.
pub struct Node {
    engine: Arc<Engine>,
    /// The config in service (a reload replaces it).
    running: Config,
    /// The config the process started with: what a reload cannot apply
    /// (the services, the cache) still runs with it.
    config_at_start: Config,
    reload: ReloadSource,
    started: Instant,
    mqtt: JoinHandle<()>,
    /// True while the MQTT session is up with its subscriptions.
    mqtt_ready: watch::Receiver<bool>,
    heartbeat: Heartbeat,
    refresh_status: Arc<Notify>,
    http: Option<JoinHandle<()>>,
    /// Set once: the services stop taking requests and drain.
    stop: watch::Sender<bool>,
    /// The request journal's threads: their last answers are written
    /// before the process exits.
    journal: Option<JournalThread>,
}

impl Node {
    /// Starts every part of the node and returns without waiting for the
    /// broker: `run` reports READY once the subscriptions are in place.
    pub async fn start(config: Config, registry: Registry, reload: ReloadSource) -> Result<Node, NodeError> {
        let started = Instant::now();
        // Read before anything starts: a bad key stops the node at once.
        let control = control_auth(&config)?;
        let broker_in_process = start_embedded_broker(&config, reload.config_file.is_none())?;
        let metrics = if config.telemetry.metrics { telemetry::install() } else { None };
        if let Some(handle) = &metrics {
            tokio::spawn(telemetry::upkeep(handle.clone()));
        }
        telemetry::describe_models(None, &registry);
        let cache = Cache::open(CacheOptions::from_config(&config));
        let mut engine = Engine::try_new(Arc::new(registry), EngineOptions::from_config(&config), cache)?;
        // The journal first: the spool must not send again a follow-up the
        // journal holds as sent.
        let mut journal = None;
        let mut journal_thread = None;
        let mut follow_ups_sent = Default::default();
        if let Some(options) = journal_options(&config) {
            match Journal::open(options) {
                Ok((opened, mut recovered, thread)) => {
                    follow_ups_sent = std::mem::take(&mut recovered.follow_ups_sent);
                    journal = Some((opened, recovered));
                    journal_thread = Some(thread);
                }
                Err(e) => tracing::error!("{e}; requests are acknowledged after their reply"),
            }
        }
        let (follow_ups, follow_ups_rx) = mpsc::channel(spool::FOLLOW_UP_QUEUE);
        let (settled, settled_rx) = mpsc::channel(spool::FOLLOW_UP_QUEUE);
        let mut spool_task = None;
        match CloudOptions::from_config(&config)? {
            Some(options) => {
                let cloud = Arc::new(Cloud::new(options)?);
                let dir = config.node.state_dir.join("spool");
                let limits = spool::SpoolLimits {
                    max_entries: config.cloud.spool_max_entries,
                    max_bytes: config.cloud.spool_max_bytes,
                    max_attempts: config.cloud.spool_max_attempts,
                    max_age: Duration::from_secs(config.cloud.spool_max_age_s),
                };
                let spool = match spool::open(&dir, limits, settled) {
                    Ok((spool, mut task)) => {
                        task.drop_sent(&follow_ups_sent);
                        spool_task = Some((cloud.clone(), task));
                        Some(spool)
                    }
                    Err(e) => {
                        tracing::error!("{e}; async escalations are answered synchronously");
                        None
                    }
                };
                engine = engine.with_cloud_tier(CloudTier { cloud, spool });
                tracing::info!("cloud tier: {} (escalating below each model's threshold)", config.cloud.url);
            }
            None => tracing::info!("cloud tier off (cloud.enabled = false): no request leaves this node"),
        }
        match crate::trace::Tracer::start(&config.tracing, &config.node.id)? {
            Some(tracer) => {
                engine = engine.with_tracer(tracer);
                let c = &config.tracing;
                tracing::info!(
                    "traces: to {} ({} of new traces, and every error and request slower than its slow_ms)",
                    c.endpoint,
                    c.sample_ratio
                );
            }
            None => tracing::debug!("traces off (tracing.enabled = false)"),
        }
        if let Some(options) = CaptureOptions::from_config(&config) {
            match Capture::start(options) {
                Ok(capture) => engine = engine.with_capture(capture),
                Err(e) => tracing::error!("{e}; serving without capture"),
            }
        }
        // A state that cannot be read stops the start: serving the newest
        // version instead could bring back one that was rolled back.
        let (rollout, decisions, to_site) =
            Rollout::start(config.node.state_dir.clone(), config.site.rollout)?;
        if config.feedback.enabled {
            let bounds = crate::engine::feedback::Bounds {
                window: Duration::from_secs(config.feedback.window_s),
                max_entries: config.feedback.max_entries as usize,
                max_bytes: config.feedback.max_bytes as usize,
            };
            match crate::engine::feedback::FeedbackStore::start(bounds, Some(rollout.observer())) {
                Ok(store) => engine = engine.with_feedback(store),
                Err(e) => tracing::error!("cannot start the feedback store: {e}; serving without feedback"),
            }
        }
        let engine = Arc::new(engine.with_rollout(rollout));
        warn_unloaded_pins(&engine);
        // Rollbacks counted from 0: an alert on `increase` sees the first one.
        for model in engine.registry().available().into_keys() {
            let (metric, action) = (crate::rollout::ROLLOUT_DECISIONS, "rolled_back");
            metrics::counter!(metric, "model" => model, "action" => action).increment(0);
        }
        crate::lifecycle::start_auto_rollouts_at_start(&engine, &config).await;
        engine.set_config(&config);
        if metrics.is_some() {
            tokio::spawn(publish_saturation(Arc::downgrade(&engine)));
        }
        if let Some((cloud, task)) = spool_task {
            tokio::spawn(task.run(cloud));
            engine.finish_escalations(settled_rx, follow_ups);
        }
        tracing::info!("node {}: serving {} over {}", config.node.id, serving(&engine), config.mqtt.url);
        let status = Status::new(&config.node.id, &engine.registry(), unix_now());
        let (service, mqtt_ready) = MqttService::new(engine.clone(), &config, status)?;
        let mut service = service.with_follow_ups(follow_ups_rx).with_events(decisions);
        if let Some((journal, recovered)) = journal {
            service = service.with_journal(journal, recovered.requests, recovered.replies);
        }
        if broker_in_process {
            service = service.with_broker_in_process();
        }
        if let Some(auth) = control {
            service = service.with_control(auth);
            tracing::info!(
                "control topic on: rollout commands signed with the key in control.key_file, issued within \
                 control.max_skew_s = {} s",
                config.control.max_skew_s
            );
        }
        let (heartbeat, refresh_status) = (service.heartbeat(), service.status_refresher());
        let (stop, _) = watch::channel(false);
        let mut http_server = None;
        if !config.http.listen.is_empty() {
            let http_config = &config.http;
            let listen = &http_config.listen;
            let access = http::Access::from_config(http_config)?;
            let tls = match (&http_config.tls_cert_file, &http_config.tls_key_file) {
                (Some(cert), Some(key)) => Some(Arc::new(crate::tls::server_config(crate::tls::Identity {
                    cert_key: "http.tls_cert_file",
                    cert,
                    key_key: "http.tls_key_file",
                    key,
                })?)),
                _ => None,
            };
            let tcp = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|source| NodeError::Http { listen: listen.clone(), source })?;
            let body_timeout = Duration::from_millis(http_config.body_timeout_ms);
            let router = http::router(engine.clone(), metrics, mqtt_ready.clone(), access, body_timeout);
            tracing::info!(
                "HTTP{} on {listen} (/metrics, /v2); inference {}, administration {}",
                if tls.is_some() { "S" } else { "" },
                if http_config.token_file.is_some() { "needs http.token_file's token" } else { "open" },
                if http_config.admin_token_file.is_some() {
                    "needs http.admin_token_file's token"
                } else {
                    "loopback only (status and cache)"
                },
            );
            if http_config.admin_token_file.is_none() {
                // A loopback peer may be anyone through ssh -L or a proxy.
                tracing::warn!(
                    "no http.admin_token_file: rollout commands over HTTP (/models/promote, /models/rollback, \
                     /models/rollout) are refused until it is set"
                );
            }
            let listener = http::Listener {
                tcp,
                tls,
                max_connections: http_config.max_connections,
                header_timeout: Duration::from_millis(http_config.header_timeout_ms),
                connection_lifetime: Duration::from_millis(
                    http_config.header_timeout_ms + http_config.body_timeout_ms,
                ) + Duration::from_secs(60),
            };
            http_server = Some(tokio::spawn(http::serve(listener, router, stopped(stop.subscribe()))));
        }
        let mqtt = tokio::spawn(service.run(stopped(stop.subscribe())));
        if let Some(to_site) = to_site {
            let link = crate::transport::mqtt::SiteLink::new(&config)?;
            tokio::spawn(link.run(engine.clone(), to_site, stopped(stop.subscribe())));
            tracing::info!(
                "site rollouts on: the site's state on {}/site/rollout/MODEL, judged by one node of the site",
                config.mqtt.topic_prefix
            );
        }
        Ok(Node {
            engine,
            config_at_start: config.clone(),
            running: config,
            reload,
            started,
            mqtt,
            mqtt_ready,
            heartbeat,
            refresh_status,
            http: http_server,
            stop,
            journal: journal_thread,
        })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Serves until a stop signal (or the end of `signals`), reloading on
    /// each reload signal, then drains and returns. systemd hears READY once
    /// the broker confirmed the subscriptions, and the watchdog starts then.
    pub async fn run(mut self, mut signals: mpsc::UnboundedReceiver<Signal>) {
        let notifier = Notifier;
        let mut ready = false;
        // Until READY, systemd's start timeout would restart a node that is
        // only waiting for its broker: while the MQTT loop keeps turning
        // (retrying the connection), ask for more time.
        let every = START_EXTENSION / 3;
        let mut waiting = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                _ = waiting.tick(), if !ready => {
                    if self.heartbeat.age() < START_EXTENSION / 3 {
                        let url = &self.running.mqtt.url;
                        notifier.extend_start(START_EXTENSION, &format!("waiting for the broker at {url}"));
                    }
                }
                changed = self.mqtt_ready.changed(), if !self.mqtt.is_finished() => {
                    if changed.is_err() {
                        continue;
                    }
                    let up = *self.mqtt_ready.borrow_and_update();
                    let line = self.status_line(up);
                    if up && !ready {
                        ready = true;
                        notifier.ready(&line);
                        tracing::info!("ready {:.1} ms after start", self.started.elapsed().as_secs_f64() * 1e3);
                        self.start_watchdog(notifier);
                    } else {
                        notifier.status(&line);
                    }
                }
                signal = signals.recv() => match signal {
                    Some(Signal::Reload) => {
                        notifier.reloading();
                        self.reload().await;
                        self.refresh_status.notify_one();
                        notifier.ready(&self.status_line(*self.mqtt_ready.borrow()));
                    }
                    Some(Signal::Stop(name)) => {
                        let timeout = self.running.node.drain_timeout_s;
                        tracing::info!("{name}: draining (node.drain_timeout_s = {timeout})");
                        notifier.stopping(&format!("{name}: draining requests in flight"));
                        break;
                    }
                    None => break,
                },
            }
        }
        self.stop.send_replace(true);
        let _ = (&mut self.mqtt).await;
        if let Some(server) = self.http.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
        }
        self.engine.cache().flush().await;
        if let Some(journal) = self.journal.take() {
            // The MQTT service is done and its handles dropped: what it
            // recorded last is written (and synced) before the exit.
            let _ = tokio::task::spawn_blocking(move || journal.finish(Duration::from_secs(2))).await;
        }
        tracing::info!("stopped");
    }

    fn start_watchdog(&self, notifier: Notifier) {
        if let Some(interval) = notifier.watchdog_interval() {
            let stale = Duration::from_secs(2 * self.running.mqtt.keep_alive_s as u64 + 10);
            let heartbeat = self.heartbeat.clone();
            tokio::spawn(lifecycle::watchdog(self.engine.clone(), heartbeat, stale, interval));
        }
    }

    /// SIGHUP: the new config and models, or the old ones with the error
    /// logged and in the status.
    async fn reload(&mut self) {
        let (source, engine) = (self.reload.clone(), self.engine.clone());
        let outcome = tokio::task::spawn_blocking(move || lifecycle::reload(&source, &engine)).await;
        let error = match outcome {
            Ok(Ok((config, done))) => {
                tracing::info!("reloaded: serving {}", done.serving.join(", "));
                for refused in &done.refused {
                    tracing::error!("reload: refused {refused}");
                }
                self.running = config;
                // The status carries no paths: its subscribers are not all operators.
                (!done.refused.is_empty()).then(|| format!("refused {}", done.refused_summary.join("; ")))
            }
            Ok(Err(e)) => {
                tracing::error!("reload refused, still serving the previous config and models: {e}");
                Some(e.reason())
            }
            Err(e) => {
                tracing::error!("reload failed: {e}");
                Some("reload failed; see the log".into())
            }
        };
        // Derived, so a refused reload does not forget what still waits.
        let waiting = lifecycle::needing_restart(&self.config_at_start, &self.running);
        if !waiting.is_empty() {
            tracing::warn!("reload: {} changed; restart to apply", waiting.join(", "));
        }
        self.engine.set_reload_outcome(error, waiting);
    }

    /// The line `systemctl status` shows.
    fn status_line(&self, mqtt_up: bool) -> String {
        let requests: u64 = self.engine.request_counts().values().sum();
        let broker = if mqtt_up { "connected to" } else { "reconnecting to" };
        let url = &self.running.mqtt.url;
        format!("serving {}; {broker} {url}; {requests} requests answered", serving(&self.engine))
    }
}

/// Starts the embedded broker on mqtt.url when `mqtt.embedded_broker`
/// asks for it, or when a first run without a config file finds nothing
/// listening there.
/// Starts the embedded broker where the config asks for it (or, with no
/// config file, where nothing listens on `mqtt.url`): whether it did.
fn start_embedded_broker(config: &Config, no_config_file: bool) -> Result<bool, NodeError> {
    let address = BrokerAddress::parse(&config.mqtt.url)?;
    let addr = address.socket_addr().ok_or_else(|| NodeError::Resolve(config.mqtt.url.clone()))?;
    let fallback = no_config_file && !address.tls && !broker::listening(addr);
    if !config.mqtt.embedded_broker && !fallback {
        return Ok(false);
    }
    let mqtt = &config.mqtt;
    let v5 = embedded_listen(addr, mqtt.embedded_listen.as_deref())?;
    let v311 = match mqtt.embedded_v311_listen.as_deref() {
        None | Some("") => None,
        Some(listen) => Some(listen.parse::<SocketAddr>().map_err(|e| NodeError::Listen {
            key: "mqtt.embedded_v311_listen",
            value: listen.into(),
            why: e.to_string(),
        })?),
    };
    let login = crate::transport::mqtt::credentials(mqtt)?;
    refuse_control_on_open_broker(config.control.enabled, v5, v311, login.as_ref())?;
    let user = login.as_ref().map(|(user, _)| user.clone());
    broker::start(broker::Listeners { v5, v311 }, login, config.limits.max_packet_bytes)?;
    tracing::info!(
        "embedded broker: MQTT 5 on {v5}{}; {}",
        v311.map(|a| format!(", MQTT 3.1.1 on {a}")).unwrap_or_default(),
        match user {
            Some(user) => format!("clients log in as {user:?} with mqtt.password"),
            None => "no login (set mqtt.username and mqtt.password_file to require one)".into(),
        }
    );
    tracing::warn!(
        "the embedded broker is for trying edgeinfer out: it keeps queued requests and replies in this \
         process's memory only, so a crash or restart of the node loses them (no at-least-once across a \
         crash); sites run mosquitto or another broker with persistence and point mqtt.url at it"
    );
    Ok(true)
}

/// With `control.enabled`, the key commands must be signed with.
fn control_auth(config: &Config) -> Result<Option<crate::transport::mqtt::ControlAuth>, NodeError> {
    let control = &config.control;
    let (true, Some(path)) = (control.enabled, &control.key_file) else { return Ok(None) };
    let key = crate::transport::mqtt::ControlKey::read(path)?;
    Ok(Some(crate::transport::mqtt::ControlAuth::new(key, control.max_skew_s)))
}

/// An embedded broker that takes anyone from the network (no login) has no
/// topic ACLs either: whoever reaches it could watch the control topic and
/// flood it. Signatures keep such a client from commanding the node; the
/// node still refuses to offer it a control topic there.
fn refuse_control_on_open_broker(
    control: bool,
    v5: SocketAddr,
    v311: Option<SocketAddr>,
    login: Option<&(String, String)>,
) -> Result<(), NodeError> {
    let has_login = login.is_some_and(|(_, password)| !password.is_empty());
    let open = std::iter::once(v5).chain(v311).find(|listen| !listen.ip().is_loopback());
    match open {
        Some(listen) if control && !has_login => Err(NodeError::ControlOnOpenBroker { listen }),
        _ => Ok(()),
    }
}

/// Where the embedded broker takes MQTT 5 clients: `mqtt.embedded_listen`,
/// else mqtt.url's address, which must then be loopback: opening a broker
/// to the network is a decision, not a default.
fn embedded_listen(url: SocketAddr, configured: Option<&str>) -> Result<SocketAddr, NodeError> {
    match configured {
        Some(listen) => listen.parse::<SocketAddr>().map_err(|e| NodeError::Listen {
            key: "mqtt.embedded_listen",
            value: listen.into(),
            why: e.to_string(),
        }),
        None if url.ip().is_loopback() => Ok(url),
        None => Err(NodeError::Listen {
            key: "mqtt.url",
            value: url.to_string(),
            why: "with mqtt.embedded_broker = true the broker listens on loopback unless \
                  mqtt.embedded_listen says otherwise; use mqtt://127.0.0.1:PORT, or set \
                  mqtt.embedded_listen = \"0.0.0.0:PORT\" (and mqtt.username with a password, which \
                  it then requires) to open it to the network"
                .into(),
        }),
    }
}

/// How much more time each start-timeout extension asks for.
const START_EXTENSION: Duration = Duration::from_secs(60);

/// Every 5 s, each model's share of time busy (`edgeinfer_inference_busy_ratio`),
/// until the engine is gone.
async fn publish_saturation(engine: std::sync::Weak<Engine>) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(engine) = engine.upgrade() else { return };
        engine.publish_saturation();
    }
}

/// Resolves once the stop flag is set.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

fn serving(engine: &Engine) -> String {
    engine.serving().iter().map(|m| format!("{} v{}", m.name(), m.version())).collect::<Vec<_>>().join(", ")
}

/// A pinned stable or candidate version that did not load (refused at
/// load, or its directory gone) is named at start: the stable's model
/// serves its newest version meanwhile, and a candidate gets no traffic.
fn warn_unloaded_pins(engine: &Engine) {
    let (Some(rollout), registry) = (engine.rollout(), engine.registry()) else { return };
    for (model, deployment) in &rollout.current().models {
        let pinned = std::iter::once(("stable", &deployment.stable))
            .chain(deployment.candidate.as_ref().map(|c| ("candidate", &c.version)));
        for (role, version) in pinned {
            if !version.is_empty() && registry.get(model, Some(version)).is_err() {
                tracing::error!(
                    "model {model}'s {role} version v{version} is not loaded (refused or gone; see above): \
                     {}; put it back, or `edgeinfer models promote` another",
                    if role == "stable" {
                        "its newest version serves meanwhile"
                    } else {
                        "it gets no traffic"
                    }
                );
            }
        }
    }
}

/// `[mqtt.journal]`, or `None` when it is off.
fn journal_options(config: &Config) -> Option<JournalOptions> {
    let journal = &config.mqtt.journal;
    (journal.max_bytes > 0).then(|| JournalOptions {
        dir: config.node.state_dir.join("journal"),
        max_bytes: journal.max_bytes,
        fsync: journal.fsync,
        commit_window: Duration::from_millis(journal.commit_window_ms),
        // A re-delivery is of what the broker had sent and not seen
        // acknowledged: at most its window, which mosquitto does not keep
        // to our Receive Maximum.
        answered_capacity: (4 * config.mqtt.max_in_flight).max(4096),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_broker_stays_on_loopback_unless_told_otherwise() {
        let local: SocketAddr = "127.0.0.1:1883".parse().unwrap();
        assert_eq!(embedded_listen(local, None).unwrap(), local);
        let lan: SocketAddr = "10.0.0.5:1883".parse().unwrap();
        let refused = embedded_listen(lan, None).unwrap_err().to_string();
        assert!(
            refused.starts_with("mqtt.url = \"10.0.0.5:1883\"") && refused.contains("mqtt.embedded_listen")
        );
        assert_eq!(embedded_listen(lan, Some("0.0.0.0:1883")).unwrap(), "0.0.0.0:1883".parse().unwrap());
        let bad = embedded_listen(local, Some("nowhere")).unwrap_err().to_string();
        assert!(bad.starts_with("mqtt.embedded_listen = \"nowhere\""), "{bad}");
    }

    #[test]
    fn finding_2_control_on_an_embedded_broker_open_to_the_network_needs_a_login() {
        let (local, lan): (SocketAddr, SocketAddr) =
            ("127.0.0.1:1883".parse().unwrap(), "0.0.0.0:1883".parse().unwrap());
        let login = ("fleet".to_string(), "pw".to_string());
        let no_password = ("fleet".to_string(), String::new());
        assert!(refuse_control_on_open_broker(true, local, None, None).is_ok());
        assert!(refuse_control_on_open_broker(false, lan, None, None).is_ok());
        assert!(refuse_control_on_open_broker(true, lan, None, Some(&login)).is_ok());
        let refused = refuse_control_on_open_broker(true, lan, None, None).unwrap_err().to_string();
        assert!(
            refused.starts_with("control.enabled = true") && refused.contains("mqtt.username"),
            "{refused}"
        );
        assert!(refuse_control_on_open_broker(true, lan, None, Some(&no_password)).is_err());
        // The MQTT 3.1.1 listener opens it as much.
        assert!(refuse_control_on_open_broker(true, local, Some(lan), None).is_err());
    }
}
