//! `edgeinfer cache stats|purge|check` and `edgeinfer models status|promote|rollback`:
//! against the running node through its local HTTP endpoint (the cache
//! store and the deployment state are locked while a node has them), or
//! straight on the store and the state file when no node is running; the
//! models commands also as signed commands on a node's control topic
//! (`--via-mqtt`).

use crate::config::Config;
use crate::engine::cache::{Cache, CacheOptions, CacheStats, CheckReport, DiskError};
use crate::rollout::{Asker, Decision, Deployments, ModelReport, Plan, RolloutError};
use crate::transport::mqtt::{AskError, ControlAsk, ControlCommand};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(
        "{what} {path} is held by a running node, but {url} did not answer ({reason}); \
         give the node's HTTP address with --url, or set http.listen"
    )]
    Busy { what: &'static str, path: PathBuf, url: String, reason: String },
    #[error("{url} answered {status}: {body}")]
    Refused { url: String, status: u16, body: String },
    #[error("{url}: {reason}")]
    Http { url: String, reason: String },
    #[error("the cache store: {0}")]
    Store(String),
    #[error(
        "the cache store {0} is held by a running node: stop it first (systemctl stop edgeinfer), then check again"
    )]
    Held(PathBuf),
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error("node.models_dir {path}: {reason}")]
    Models { path: PathBuf, reason: String },
    #[error(transparent)]
    Control(#[from] AskError),
}

/// Where an answer came from.
#[derive(Debug, Clone)]
pub enum Source {
    Node(String),
    Store(PathBuf),
    /// The deployment state file.
    State(PathBuf),
    /// A node's control topic, through the broker at `url`.
    Control {
        node: String,
        url: String,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Node(url) => write!(f, "running node at {url}"),
            Source::Store(path) => write!(f, "store {} (no node running)", path.display()),
            Source::State(path) => write!(f, "{} (no node running)", path.display()),
            Source::Control { node, url } => write!(f, "node {node} over its control topic through {url}"),
        }
    }
}

pub async fn cache_stats(config: &Config, url: Option<&str>) -> Result<(CacheStats, Source), AdminError> {
    let base = base_url(config, url);
    let mut no_node = None;
    if let Some(base) = &base {
        let url = format!("{base}/cache/stats");
        match send(config, "GET", &url, None).await {
            Ok(body) => {
                let stats = serde_json::from_str(&body).map_err(|e| AdminError::Http {
                    url: url.clone(),
                    reason: format!("unexpected answer: {e}"),
                })?;
                return Ok((stats, Source::Node(base.clone())));
            }
            Err(Attempt::Failed(e)) => return Err(e),
            Err(Attempt::NoNode(reason)) => no_node = Some(reason),
        }
    }
    let cache = open_store(config, base.as_deref(), no_node).await?;
    Ok((cache.stats(), Source::Store(config.node.state_dir.join("cache"))))
}

pub async fn cache_purge(
    config: &Config,
    url: Option<&str>,
    model: Option<&str>,
) -> Result<(u64, Source), AdminError> {
    let base = base_url(config, url);
    let mut no_node = None;
    if let Some(base) = &base {
        let url = match model {
            Some(m) => format!("{base}/cache/purge?model={}", query_value(m)),
            None => format!("{base}/cache/purge"),
        };
        match send(config, "POST", &url, None).await {
            Ok(body) => {
                let answer: serde_json::Value = serde_json::from_str(&body).map_err(|e| {
                    AdminError::Http { url: url.clone(), reason: format!("unexpected answer: {e}") }
                })?;
                let n = answer["purged_disk_entries"].as_u64().unwrap_or(0);
                return Ok((n, Source::Node(base.clone())));
            }
            Err(Attempt::Failed(e)) => return Err(e),
            Err(Attempt::NoNode(reason)) => no_node = Some(reason),
        }
    }
    let cache = open_store(config, base.as_deref(), no_node).await?;
    let n = cache.purge(model).await.map_err(|e| AdminError::Store(e.to_string()))?;
    Ok((n, Source::Store(config.node.state_dir.join("cache"))))
}

/// Reads the stopped node's disk store whole (`edgeinfer cache check`);
/// `repair` rebuilds its index from the segments first.
pub fn cache_check(config: &Config, repair: bool) -> Result<(CheckReport, PathBuf), AdminError> {
    let options = CacheOptions::from_config(config);
    match Cache::check_store(&options, repair) {
        Ok(report) => Ok((report, options.dir)),
        Err(DiskError::Locked(_)) => Err(AdminError::Held(options.dir)),
        Err(e) => Err(AdminError::Store(e.to_string())),
    }
}

/// A change to a model's deployment.
#[derive(Debug, Clone)]
pub enum Change {
    /// `version`, or the newest, becomes stable.
    Promote { model: String, version: Option<String> },
    /// The stable before the current one serves again (or, during a
    /// rollout, stable alone).
    Rollback { model: String },
    /// `version` is tried on part of the traffic, judged by gates; or,
    /// with `config` (a config candidate file's text) and no version, that
    /// config on stable's version.
    Rollout {
        model: String,
        version: Option<String>,
        config: Option<String>,
        mode: Option<String>,
        steps: Option<String>,
        gates: Option<String>,
    },
}

pub async fn models_status(
    config: &Config,
    url: Option<&str>,
    model: Option<&str>,
) -> Result<(Vec<ModelReport>, Source), AdminError> {
    let base = base_url(config, url);
    let mut no_node = None;
    if let Some(base) = &base {
        let url = match model {
            Some(m) => format!("{base}/models/status?model={}", query_value(m)),
            None => format!("{base}/models/status"),
        };
        match send(config, "GET", &url, None).await {
            Ok(body) => return Ok((decode(&url, &body)?, Source::Node(base.clone()))),
            Err(Attempt::Failed(e)) => return Err(e),
            Err(Attempt::NoNode(reason)) => no_node = Some(reason),
        }
    }
    let (_lock, deployments, available) = open_state(config, base.as_deref(), no_node)?;
    let dir = &config.node.models_dir;
    let fingerprints = crate::model::fingerprints_on_disk(dir)
        .map_err(|e| AdminError::Models { path: dir.clone(), reason: e.to_string() })?;
    let report = deployments.report(&available, &fingerprints, model, &|m: &str| config.serving(m))?;
    Ok((report, Source::State(config.node.state_dir.join(crate::rollout::state::FILE_NAME))))
}

pub async fn models_change(
    config: &Config,
    url: Option<&str>,
    change: &Change,
) -> Result<(Decision, Source), AdminError> {
    let base = base_url(config, url);
    let mut no_node = None;
    if let Some(base) = &base {
        let url = match change {
            Change::Promote { model, version: Some(v) } => {
                format!("{base}/models/promote?model={}&version={}", query_value(model), query_value(v))
            }
            Change::Promote { model, version: None } => {
                format!("{base}/models/promote?model={}", query_value(model))
            }
            Change::Rollback { model } => format!("{base}/models/rollback?model={}", query_value(model)),
            Change::Rollout { model, version, mode, steps, gates, .. } => {
                let mut url = format!("{base}/models/rollout?model={}", query_value(model));
                for (key, value) in [("version", version), ("mode", mode), ("steps", steps), ("gates", gates)]
                {
                    if let Some(v) = value {
                        url.push_str(&format!("&{key}={}", query_value(v)));
                    }
                }
                url
            }
        };
        let body = match change {
            Change::Rollout { config, .. } => config.clone(),
            _ => None,
        };
        match send(config, "POST", &url, body).await {
            Ok(body) => return Ok((decode(&url, &body)?, Source::Node(base.clone()))),
            Err(Attempt::Failed(e)) => return Err(e),
            Err(Attempt::NoNode(reason)) => no_node = Some(reason),
        }
    }
    let (_lock, mut deployments, available) = open_state(config, base.as_deref(), no_node)?;
    let now_s = crate::telemetry::unix_now();
    let decision = match change {
        Change::Promote { model, version } => deployments.promote(
            model,
            version.as_deref(),
            &available,
            &Asker::named("models promote (no node)"),
            now_s,
        )?,
        Change::Rollback { model } => {
            deployments.rollback(model, &available, &Asker::named("models rollback (no node)"), now_s)?
        }
        Change::Rollout { model, version, config: file, mode, steps, gates } => {
            let policy = config.rollout_policy(model);
            let overrides = (steps.as_deref(), gates.as_deref());
            let by = "models rollout (no node)";
            let (asked, node) = ((version.as_deref(), file.as_deref()), config.serving(model));
            let stable = (deployments.models.get(model), &node);
            let plan = Plan::asked(asked, mode.as_deref(), &policy, overrides, stable, by, now_s)?;
            deployments.start_rollout(model, plan, &available, &Asker::named(by), now_s)?
        }
    };
    deployments.save(&config.node.state_dir)?;
    Ok((decision, Source::State(config.node.state_dir.join(crate::rollout::state::FILE_NAME))))
}

/// How `edgeinfer models ... --via-mqtt` reaches a node: a command signed
/// with `control.key_file`'s key on its control topic.
#[derive(Debug, Clone, Default)]
pub struct ViaMqtt {
    /// NODE in the node's topics; default `node.id`.
    pub node: Option<String>,
    /// The command's id; default a new one. The same id again is applied once.
    pub id: Option<String>,
    /// Where the node answers; default one of the sender's own.
    pub reply_topic: Option<String>,
}

pub async fn models_status_via_mqtt(
    config: &Config,
    via: &ViaMqtt,
    model: Option<&str>,
) -> Result<(Vec<ModelReport>, Source), AdminError> {
    let command =
        ControlCommand { command: "status".into(), model: model.map(Into::into), ..Default::default() };
    ask_node(config, via, command).await
}

pub async fn models_change_via_mqtt(
    config: &Config,
    via: &ViaMqtt,
    change: &Change,
) -> Result<(Decision, Source), AdminError> {
    let named = |command: &str, model: &str| ControlCommand {
        command: command.into(),
        model: Some(model.into()),
        ..Default::default()
    };
    let command = match change {
        Change::Promote { model, version } => {
            ControlCommand { version: version.clone(), ..named("promote", model) }
        }
        Change::Rollback { model } => named("rollback", model),
        Change::Rollout { model, version, config: file, mode, steps, gates } => ControlCommand {
            version: version.clone(),
            config_hex: file.as_ref().map(hex::encode),
            mode: mode.clone(),
            steps: steps.clone(),
            gates: gates.clone(),
            ..named("rollout", model)
        },
    };
    ask_node(config, via, command).await
}

/// `command` with its id, signed, to the node `via` names; its result decoded.
async fn ask_node<T: serde::de::DeserializeOwned>(
    config: &Config,
    via: &ViaMqtt,
    command: ControlCommand,
) -> Result<(T, Source), AdminError> {
    let node = via.node.clone().unwrap_or_else(|| config.node.id.clone());
    let id = via
        .id
        .clone()
        .unwrap_or_else(|| format!("cli-{}-{:08x}", crate::telemetry::unix_now(), fastrand::u32(..)));
    let asked = ControlAsk {
        node: node.clone(),
        command: ControlCommand { id, ..command },
        reply_topic: via.reply_topic.clone(),
    };
    let result = crate::transport::mqtt::ask(config, asked).await?;
    let answer = serde_json::from_value(result)
        .map_err(|e| AskError::Unexpected { node: node.clone(), reason: e.to_string() })?;
    Ok((answer, Source::Control { node, url: config.mqtt.url.clone() }))
}

fn decode<T: serde::de::DeserializeOwned>(url: &str, body: &str) -> Result<T, AdminError> {
    serde_json::from_str(body)
        .map_err(|e| AdminError::Http { url: url.into(), reason: format!("unexpected answer: {e}") })
}

/// The deployment state and the versions on disk, with the lock that keeps
/// a node from starting meanwhile; refused while a node holds it.
fn open_state(
    config: &Config,
    url: Option<&str>,
    reason: Option<String>,
) -> Result<(std::fs::File, Deployments, crate::rollout::Available), AdminError> {
    let state_dir = &config.node.state_dir;
    let Some(lock) = crate::rollout::state::lock(state_dir)? else {
        return Err(AdminError::Busy {
            what: "the deployment state in",
            path: state_dir.clone(),
            url: url.unwrap_or("(no http.listen)").into(),
            reason: reason.unwrap_or_else(|| "no address to ask".into()),
        });
    };
    let deployments = Deployments::load(state_dir)?;
    let dir = &config.node.models_dir;
    let available = crate::model::versions_on_disk(dir)
        .map_err(|e| AdminError::Models { path: dir.clone(), reason: e.to_string() })?;
    Ok((lock, deployments, available))
}

fn base_url(config: &Config, url: Option<&str>) -> Option<String> {
    match url {
        Some(u) => Some(u.trim_end_matches('/').to_string()),
        None if config.http.listen.is_empty() => None,
        None => {
            let scheme = if config.http.tls_cert_file.is_some() { "https" } else { "http" };
            Some(format!("{scheme}://{}", config.http.listen))
        }
    }
}

enum Attempt {
    /// Nothing listens there: no node is running (as far as HTTP tells).
    NoNode(String),
    Failed(AdminError),
}

/// A model name as a query value (names are `[A-Za-z0-9._-]`, but a typo
/// should reach the node intact and be refused there).
fn query_value(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One request to the node, with the admin token when the config names one;
/// over HTTPS the node's own certificate (`http.tls_cert_file`) is trusted.
async fn send(config: &Config, method: &str, url: &str, body: Option<String>) -> Result<String, Attempt> {
    use http_body_util::BodyExt;
    let failed = |reason: String| Attempt::Failed(AdminError::Http { url: url.into(), reason });
    let mut request = hyper::Request::builder().method(method).uri(url);
    if let Some(path) = &config.http.admin_token_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| failed(format!("http.admin_token_file = {}: cannot read: {e}", path.display())))?;
        let token = text.lines().next().unwrap_or_default().trim().to_string();
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let body = http_body_util::Full::new(bytes::Bytes::from(body.unwrap_or_default()));
    let request = request.body(body).map_err(|e| failed(e.to_string()))?;
    let tls = crate::tls::client_config(
        "http.tls_cert_file",
        config.http.tls_cert_file.as_deref(),
        None,
        url.starts_with("https://"),
    )
    .map_err(|e| failed(e.to_string()))?;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    let client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(https);
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(request))
        .await
        .map_err(|_| failed("no answer within 10 s".into()))?
        .map_err(|e| if e.is_connect() { Attempt::NoNode(e.to_string()) } else { failed(e.to_string()) })?;
    let status = response.status();
    let body = response.into_body().collect().await.map_err(|e| failed(e.to_string()))?.to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    if !status.is_success() {
        return Err(Attempt::Failed(AdminError::Refused { url: url.into(), status: status.as_u16(), body }));
    }
    Ok(body)
}

/// The store itself, once its writer has counted what it holds.
async fn open_store(config: &Config, url: Option<&str>, reason: Option<String>) -> Result<Cache, AdminError> {
    let options = CacheOptions::from_config(config);
    let path = options.dir.clone();
    let cache = Cache::open(CacheOptions { enabled: true, ..options });
    if let Some(DiskError::Locked(_)) = cache.disk_error() {
        return Err(AdminError::Busy {
            what: "the cache store",
            path,
            url: url.unwrap_or("(no http.listen)").into(),
            reason: reason.unwrap_or_else(|| "no address to ask".into()),
        });
    }
    if !cache.health().disk_enabled {
        // The details, paths included: this is the operator's own terminal.
        let detail = cache.disk_error().map(|e| e.to_string()).or_else(|| cache.stats().disk?.problem);
        return Err(AdminError::Store(detail.unwrap_or_else(|| "cache.disk_bytes is 0".into())));
    }
    cache.flush().await;
    Ok(cache)
}
