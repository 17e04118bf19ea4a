//! A serving node built from a `Config`: the embedded broker where wanted,
//! the engine with its cache and cloud tier, the MQTT and HTTP services,
//! and what systemd hears about them. `edgeinfer serve` is `Node::start`
//! then `Node::run`; tests start a node in-process the same way.

use crate::cloud::{Cloud, CloudError, CloudOptions, spool};
use crate::config::Config;
use crate::engine::{Cache, CacheOptions, CloudTier, Engine, EngineOptions};
use crate::lifecycle::{self, Heartbeat, Notifier, ReloadSource, Signal};
use crate::model::Registry;
use crate::telemetry::{self, Status, unix_now};
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
    #[error("mqtt.embedded_v311_listen = {value:?}: {why}; give HOST:PORT, or \"\" for no 3.1.1 listener")]
    V311Listen { value: String, why: String },
    #[error(transparent)]
    Broker(#[from] broker::BrokerError),
    #[error(transparent)]
    Cloud(#[from] CloudError),
    #[error("http.listen = {listen:?}: cannot listen there: {source}")]
    Http { listen: String, source: std::io::Error },
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
}

impl Node {
    /// Starts every part of the node and returns without waiting for the
    /// broker: `run` reports READY once the subscriptions are in place.
    pub async fn start(config: Config, registry: Registry, reload: ReloadSource) -> Result<Node, NodeError> {
        let started = Instant::now();
        start_embedded_broker(&config, reload.config_file.is_none())?;
        let metrics = if config.telemetry.metrics { telemetry::install() } else { None };
        telemetry::describe_models(&registry);
        let cache = Cache::open(CacheOptions::from_config(&config));
        let mut engine = Engine::new(Arc::new(registry), EngineOptions::from_config(&config), cache);
        let (follow_ups, follow_ups_rx) = mpsc::unbounded_channel();
        let (settled, settled_rx) = mpsc::unbounded_channel();
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
                    Ok((spool, task)) => {
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
        let engine = Arc::new(engine);
        if let Some((cloud, task)) = spool_task {
            tokio::spawn(task.run(cloud));
            engine.finish_escalations(settled_rx, follow_ups);
        }
        tracing::info!("node {}: serving {} over {}", config.node.id, serving(&engine), config.mqtt.url);
        let status = Status::new(&config.node.id, &engine.registry(), unix_now());
        let (service, mqtt_ready) = MqttService::new(engine.clone(), &config, status)?;
        let service = service.with_follow_ups(follow_ups_rx);
        let (heartbeat, refresh_status) = (service.heartbeat(), service.status_refresher());
        let (stop, _) = watch::channel(false);
        let mut http_server = None;
        if !config.http.listen.is_empty() {
            let listen = &config.http.listen;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|source| NodeError::Http { listen: listen.clone(), source })?;
            let router = http::router(engine.clone(), metrics, mqtt_ready.clone());
            tracing::info!("HTTP on {listen} (/metrics, /v2)");
            let shutdown = stopped(stop.subscribe());
            http_server = Some(tokio::spawn(async move {
                if let Err(e) = http::serve(listener, router, shutdown).await {
                    tracing::error!("HTTP server stopped: {e}");
                }
            }));
        }
        let mqtt = tokio::spawn(service.run(stopped(stop.subscribe())));
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
        loop {
            tokio::select! {
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
                (!done.refused.is_empty()).then(|| format!("refused {}", done.refused.join("; ")))
            }
            Ok(Err(e)) => {
                tracing::error!("reload refused, still serving the previous config and models: {e}");
                Some(e.to_string())
            }
            Err(e) => {
                tracing::error!("reload failed: {e}");
                Some(format!("reload failed: {e}"))
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
fn start_embedded_broker(config: &Config, no_config_file: bool) -> Result<(), NodeError> {
    let address = BrokerAddress::parse(&config.mqtt.url)?;
    let addr = address.socket_addr().ok_or_else(|| NodeError::Resolve(config.mqtt.url.clone()))?;
    let fallback = no_config_file && !address.tls && !broker::listening(addr);
    if !config.mqtt.embedded_broker && !fallback {
        return Ok(());
    }
    let v311 = v311_listen(addr, config.mqtt.embedded_v311_listen.as_deref())?;
    broker::start(addr, v311, config.limits.max_payload_bytes + 64 * 1024)?;
    tracing::info!(
        "embedded broker: MQTT 5 on {addr}{}",
        v311.map(|a| format!(", MQTT 3.1.1 on {a}")).unwrap_or_default()
    );
    tracing::warn!(
        "the embedded broker is for trying edgeinfer out: it keeps queued requests and replies in this \
         process's memory only, so a crash or restart of the node loses them (no at-least-once across a \
         crash); sites run mosquitto or another broker with persistence and point mqtt.url at it"
    );
    Ok(())
}

/// Where the embedded broker takes MQTT 3.1.1 clients: the configured
/// address, none for "", and by default the port after the MQTT 5 one.
fn v311_listen(v5: SocketAddr, configured: Option<&str>) -> Result<Option<SocketAddr>, NodeError> {
    let bad = |value: &str, why: &str| NodeError::V311Listen { value: value.into(), why: why.into() };
    match configured {
        Some("") => Ok(None),
        Some(listen) => listen.parse::<SocketAddr>().map(Some).map_err(|e| bad(listen, &e.to_string())),
        None => match v5.port().checked_add(1) {
            Some(port) => Ok(Some(SocketAddr::new(v5.ip(), port))),
            None => Err(bad("", "mqtt.url uses port 65535, so there is no next port for MQTT 3.1.1")),
        },
    }
}

/// Resolves once the stop flag is set.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

fn serving(engine: &Engine) -> String {
    engine
        .registry()
        .active()
        .map(|m| format!("{} v{}", m.name(), m.version()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_311_listener_defaults_to_the_next_port_and_names_the_key_when_wrong() {
        let v5: SocketAddr = "127.0.0.1:1883".parse().unwrap();
        assert_eq!(v311_listen(v5, None).unwrap(), Some("127.0.0.1:1884".parse().unwrap()));
        assert_eq!(v311_listen(v5, Some("")).unwrap(), None);
        assert_eq!(v311_listen(v5, Some("0.0.0.0:2000")).unwrap(), Some("0.0.0.0:2000".parse().unwrap()));
        let bad = v311_listen(v5, Some("nowhere")).unwrap_err().to_string();
        assert!(bad.starts_with("mqtt.embedded_v311_listen = \"nowhere\""), "{bad}");
        let top: SocketAddr = "127.0.0.1:65535".parse().unwrap();
        assert!(v311_listen(top, None).unwrap_err().to_string().contains("65535"));
    }
}
