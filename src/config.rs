//! `edgeinfer serve --config FILE`: TOML, every key defaulted, and
//! `EDGEINFER_<SECTION>__<KEY>` environment variables over the file.

pub mod reference;
mod rollout;
pub mod serving;

pub use rollout::{AutoRollout, FIELD_CONFIDENCE, OnInconclusive, RolloutMode, RolloutPolicy};
use serde::{Deserialize, Serialize};
pub use serving::{ServingChange, ServingConfig};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("config key {key}: {message}")]
    Key { key: String, message: String },
    /// More than one key is wrong: all of them, so one edit fixes the file.
    #[error("{} config mistakes:{}", .0.len(), .0.iter().map(|(k, m)| format!("\n  config key {k}: {m}")).collect::<String>())]
    Keys(Vec<(String, String)>),
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub node: NodeConfig,
    pub mqtt: MqttConfig,
    pub http: HttpConfig,
    pub cloud: CloudConfig,
    pub runtime: RuntimeConfig,
    pub limits: LimitsConfig,
    pub telemetry: TelemetryConfig,
    pub cache: CacheConfig,
    pub capture: CaptureConfig,
    pub feedback: FeedbackConfig,
    pub control: ControlConfig,
    pub site: SiteConfig,
    pub tracing: TracingConfig,
    /// Per-model settings, keyed by model name.
    pub models: BTreeMap<String, ModelConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// NODE in topics and `parameters.node` in replies.
    pub id: String,
    /// The models directory: MODELS_DIR/NAME/VERSION/ holds model.onnx
    /// and model.toml.
    pub models_dir: PathBuf,
    /// Where the node keeps what outlives it: the disk cache, the cloud
    /// spool, the request journal, the deployment state, the capture and
    /// each model's kernel choices (`kernels/`).
    pub state_dir: PathBuf,
    /// On SIGTERM, how long requests in flight may take to finish; the rest
    /// stay unacknowledged with the broker, which redelivers them.
    pub drain_timeout_s: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MqttConfig {
    /// The broker: `mqtt://HOST:PORT`, or `mqtts://HOST:PORT` for TLS.
    pub url: String,
    /// Start an in-process MQTT broker on `embedded_listen` (a node with
    /// no config file and nothing listening on `url` starts one anyway).
    pub embedded_broker: bool,
    /// Where the embedded broker takes MQTT 5 clients; default: the url's
    /// address, which must then be loopback.
    pub embedded_listen: Option<String>,
    /// The embedded broker's MQTT 3.1.1 listener (rumqttd serves each protocol
    /// version on its own port); default: none.
    pub embedded_v311_listen: Option<String>,
    /// PREFIX, the first level of every topic the node uses.
    pub topic_prefix: String,
    /// The share group (`$share/GROUP/PREFIX/infer/+`) the nodes of a site
    /// take requests from.
    pub share_group: String,
    /// Client id; fixed so the broker keeps the session (and the requests
    /// that arrive while the node restarts). Default `edgeinfer-NODE`.
    pub client_id: Option<String>,
    /// How long the broker keeps the session while the node is away.
    pub session_expiry_s: u32,
    /// Keep alive of the node's connection, 5 to 65535 seconds (5 is the
    /// MQTT client's floor).
    pub keep_alive_s: u16,
    /// The share group's own connection (`transport/mqtt/share.rs`): how
    /// long the broker keeps its session, and with it the node's place in
    /// the group, after the connection is gone. A dead node's share of the
    /// site's requests goes to it until then.
    pub share_session_expiry_s: u32,
    /// Keep alive of the share group's connection: a node that dies without
    /// a TCP reset leaves the group after 1.5 times this plus
    /// `share_session_expiry_s`.
    pub share_keep_alive_s: u16,
    /// User name for the broker's login.
    pub username: Option<String>,
    /// Prefer `password_file` or `EDGEINFER_MQTT__PASSWORD`; never logged.
    pub password: Option<Secret>,
    /// A file holding the broker password (its first line); never logged.
    pub password_file: Option<PathBuf>,
    /// PEM CA bundle for mqtts://; default: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and key for mutual TLS.
    pub client_cert_file: Option<PathBuf>,
    /// The PEM private key of `client_cert_file`.
    pub client_key_file: Option<PathBuf>,
    /// Requests processed at once; beyond it the node answers `overloaded`.
    pub max_in_flight: usize,
    /// Topic levels replies may be published under (`["devices"]` admits
    /// `devices/cam-3/replies`); empty: any topic except `$` topics and
    /// those under `topic_prefix`, which are always refused.
    pub reply_prefixes: Vec<String>,
    /// The QoS of replies and follow-ups, 1 or 2. With 2 and the journal
    /// on, each reply to a journaled request is journaled with its packet
    /// id before it goes and sent again under it after a crash, so the
    /// broker (which keeps the session) delivers it to the device exactly
    /// once even across a kill -9; with 1 a reply whose confirmation the
    /// node did not record before a crash goes again (at least once).
    /// QoS 2 costs a round trip to the broker before it delivers a reply.
    /// QoS 2 needs the journal (without it replies go at QoS 1); a broker
    /// of Maximum QoS 1 and the embedded broker (it dies with the node) get
    /// QoS 1; the share group's replies go at QoS 1 (their requests are not
    /// journaled: unanswered, they go to another member).
    pub reply_qos: u8,
    /// The request journal: requests on the node's own topic are
    /// acknowledged once journaled, and run again after a crash.
    pub journal: JournalConfig,
}

/// `[mqtt.journal]`: the node takes ownership of a request on its own
/// topic by journaling it in `node.state_dir/journal`, acknowledges it
/// then, and runs it again at the next start if its reply was not
/// confirmed. Requests of the share group are not journaled (unanswered,
/// they go to another member of the group).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct JournalConfig {
    /// Bytes the journal's files may take; 0 turns it off (requests are
    /// then acknowledged after their reply), else at least 1 MiB. When
    /// full, requests are acknowledged after their reply until answers
    /// make room, so the broker's window slows the flow: nothing is dropped.
    pub max_bytes: u64,
    /// Sync each group of journaled requests to the disk before
    /// acknowledging them (survives a power cut). `false` spares an SD
    /// card the writes and still survives a crash of the node (the kernel
    /// has what was written), not a power cut.
    pub fsync: bool,
    /// How long a group stays open for more requests after its first,
    /// 0 to 100 ms: one write and one sync per group. Replies never wait
    /// for it, only acknowledgements do; longer means fewer syncs (less CPU
    /// per request at low load, less SD card wear).
    pub commit_window_ms: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig { max_bytes: 64 * 1024 * 1024, fsync: true, commit_window_ms: 5 }
    }
}

/// A value that never appears in logs, status or `Debug` output.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(transparent)]
pub struct Secret(pub String);

/// `config print` shows that a secret is set, never what it is; only
/// `Config::to_toml_with_secrets` (comparing two configs) sees the value.
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match SHOW_SECRETS.get() {
            true => serializer.serialize_str(&self.0),
            false => serializer.serialize_str("<redacted>"),
        }
    }
}

thread_local! {
    static SHOW_SECRETS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// `host:port` for /metrics and /v2; empty disables the HTTP server.
    pub listen: String,
    /// Bearer token for inference and model metadata; unset: open.
    pub token_file: Option<PathBuf>,
    /// Bearer token for administration (`/cache/...`); unset: answered
    /// only to a loopback peer with no proxy header.
    pub admin_token_file: Option<PathBuf>,
    /// `/metrics` needs a token too (health stays open).
    pub protect_metrics: bool,
    /// PEM certificate chain and key: the listener speaks HTTPS.
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// The longest request headers (and a TLS handshake) may take to
    /// arrive, and an idle connection stays open.
    pub header_timeout_ms: u64,
    /// The longest a request body may take to arrive.
    pub body_timeout_ms: u64,
}

/// The opt-in cloud tier. With `enabled = false` (the default) nothing
/// connects to it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CloudConfig {
    /// Escalate low-confidence answers to the cloud tier at `url`.
    pub enabled: bool,
    /// Base URL of an Open Inference Protocol server (`http://` or `https://`).
    pub url: String,
    /// Bearer token; prefer `token_file` or `EDGEINFER_CLOUD__TOKEN`; never logged.
    pub token: Option<Secret>,
    /// A file holding the bearer token (instead of `token`); never logged.
    pub token_file: Option<PathBuf>,
    /// Send the token over plain `http://` anyway (a cloud tier on the
    /// same host or a trusted link); otherwise such a config is refused.
    pub allow_insecure_token: bool,
    /// PEM CA bundle for https://; default: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// The longest a connection to the cloud tier may take to open.
    pub connect_timeout_ms: u64,
    /// The longest an escalation waits for the cloud when the request gives
    /// no deadline (each attempt and all retries together).
    pub timeout_ms: u64,
    /// Calls to the cloud at once; more escalations answer from the edge.
    pub max_concurrency: usize,
    /// Retries of a failed call (with jittered backoff), only while the
    /// request's deadline leaves time for them.
    pub retries: u32,
    /// Failed calls in a row that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker refuses calls before one probe goes out.
    pub breaker_open_ms: u64,
    /// Time kept before a request's deadline for the edge answer when the
    /// cloud is slow.
    pub reserve_ms: u64,
    /// `quality` requests get the edge answer (marked degraded) when the
    /// cloud fails; false: they get `cloud_unavailable`.
    pub fallback: bool,
    /// Async escalations kept while the cloud is away; the oldest go first.
    pub spool_max_entries: usize,
    /// Bytes of async escalations kept while the cloud is away.
    pub spool_max_bytes: u64,
    /// Error answers (5xx, 429) the cloud may give one spooled escalation
    /// before its device gets the edge answer as final; outages do not count.
    pub spool_max_attempts: u32,
    /// A spooled escalation older than this ends with the edge answer.
    pub spool_max_age_s: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Batch sizes that get an optimized plan at load, ascending, starting at 1.
    pub batch_sizes: Vec<usize>,
    /// Inference threads per model (tract runs each batch on one thread).
    pub threads_per_model: usize,
    /// Threads for everything else (MQTT, HTTP, decoding, the cache): the
    /// async runtime's workers. Two keep a small gateway's memory and
    /// wake-ups down; inference has its own threads.
    pub io_threads: usize,
    /// Requests waiting for a model's threads; beyond it they get `overloaded`.
    pub queue_capacity: usize,
    /// Most rows in one micro-batch (1 turns batching off).
    pub max_batch: usize,
    /// Longest a batch window stays open, in microseconds.
    pub max_delay_us: u64,
    /// Adaptive batching (AIMD on the batch limit) keeps batch latency inside
    /// this budget; unset: off, batches grow to max_batch.
    pub latency_budget_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request payload processed; larger ones (up to
    /// `max_packet_bytes`) are answered `too_large` without being decoded.
    pub max_payload_bytes: usize,
    /// Largest MQTT packet the node reads, announced to the broker as the
    /// Maximum Packet Size; the broker drops bigger messages for this node
    /// (MQTT 5 gives it no way to answer them).
    pub max_packet_bytes: usize,
    /// Bytes of MQTT requests held at once; a request that would go over
    /// is answered `overloaded` at once, so large requests cannot pile up.
    pub max_bytes_in_flight: usize,
    /// Most rows (`shape[0]`) in one request.
    pub max_rows: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Record Prometheus metrics (served on /metrics).
    pub metrics: bool,
    /// Every this many seconds publish PREFIX/NODE/stats (rates and
    /// percentiles per model) and refresh the retained status; 0: never.
    pub stats_interval_s: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig { metrics: true, stats_interval_s: 0 }
    }
}

/// The response cache: a memory layer over a value log indexed by sled in
/// `node.state_dir/cache`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Cache replies at all (a request can still opt out with `parameters.cache = false`).
    pub enabled: bool,
    /// Bytes the memory layer may hold; 0 turns it off.
    pub memory_bytes: u64,
    /// Bytes the disk layer's files (its segments, their index files and
    /// sled's) may take before the oldest segment goes; 0 turns it off,
    /// else at least 1 MiB (sled's own files take about 100 KiB of it).
    pub disk_bytes: u64,
    /// How long an answer stays valid, unless the model sets `models.NAME.cache_ttl_s`.
    pub ttl_s: u64,
    /// How often segments whose answers have all expired are removed.
    pub sweep_interval_s: u64,
    /// The longest a request waits for a disk read before it counts a miss
    /// and runs the model (a slow disk costs a miss, never a stall).
    pub disk_read_timeout_ms: u64,
    /// sled's own page cache for the disk layer's index, in bytes.
    pub disk_page_cache_bytes: u64,
    /// The shared layer below memory and disk.
    pub redis: RedisConfig,
}

/// `[cache.redis]`: a Redis shared by the nodes of a site, below memory
/// and disk. Off by default: nothing leaves the node unless asked.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Share answers through Redis (`url`); needs `key_file`.
    pub enabled: bool,
    /// `redis://[USER@]HOST:PORT[/DB]`, or `rediss://` for TLS (the
    /// system's roots, or `ca_file`'s).
    pub url: String,
    /// PEM CA certificate(s) a `rediss://` server's certificate must chain
    /// to, for a site CA; default: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// A file holding the password (AUTH); a user name goes in the URL.
    pub password_file: Option<PathBuf>,
    /// A file holding the site key (hex, at least 32 bytes) that signs
    /// every shared answer; required with `enabled`, the same on every
    /// node of the site.
    pub key_file: Option<PathBuf>,
    /// Every key starts with this, so nodes of one site share answers and
    /// `cache purge` finds them.
    pub key_prefix: String,
    /// Expiry of every key written; default: the cache TTL of the answer.
    pub ttl_s: Option<u64>,
    /// The longest a lookup waits before it counts a miss and runs the model.
    pub timeout_ms: u64,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            enabled: false,
            url: "redis://127.0.0.1:6379".into(),
            ca_file: None,
            password_file: None,
            key_file: None,
            key_prefix: "edgeinfer".into(),
            ttl_s: None,
            timeout_ms: 5,
        }
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: true,
            memory_bytes: 16 * 1024 * 1024,
            disk_bytes: 256 * 1024 * 1024,
            ttl_s: 24 * 3600,
            sweep_interval_s: 60,
            disk_read_timeout_ms: 5,
            disk_page_cache_bytes: 4 * 1024 * 1024,
            redis: RedisConfig::default(),
        }
    }
}

/// Capture of real inputs for `models compare`: off by default, since the
/// inputs devices send may be private. When on, a sampled share of the
/// one-row requests answered, with the answer given and the cloud's label
/// where the cloud tier answered, go to `node.state_dir/capture.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    /// Keep a sample of real inputs in `node.state_dir/capture.jsonl`.
    pub enabled: bool,
    /// The share of answered requests kept, 0 to 1.
    pub rate: f64,
    /// The file holds at most this many records (and `max_bytes`).
    pub max_records: u64,
    /// The file holds at most this many bytes; capture stops at either
    /// bound (move the file away and restart to capture more).
    pub max_bytes: u64,
}

/// `[feedback]`: field feedback on `PREFIX/feedback`, `PREFIX/NODE/feedback`
/// and `POST /v2/feedback`, joined with the answer the node gave to that
/// request id. Each answer is kept (id, model, version, label, confidence,
/// tier, config) for `window_s`, within `max_entries` and `max_bytes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FeedbackConfig {
    /// Keep answers and take feedback; off: the topics are not subscribed
    /// and `POST /v2/feedback` answers `invalid_payload` naming this key.
    pub enabled: bool,
    /// How long an answer waits for its feedback, in seconds.
    pub window_s: u64,
    /// At most this many answers are kept; past it the oldest goes.
    pub max_entries: u64,
    /// At most this many bytes of answers are kept (about 200 bytes each);
    /// past it the oldest goes.
    pub max_bytes: u64,
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        FeedbackConfig { enabled: true, window_s: 3600, max_entries: 100_000, max_bytes: 32 * 1024 * 1024 }
    }
}

/// `[tracing]`: OpenTelemetry traces over OTLP/HTTP (protobuf). Off by
/// default. A request is traced from the transport to its reply: a span
/// for each stage, its caller's W3C `traceparent` as its parent, and the
/// cloud tier asked with the same trace. `sample_ratio` of new traces are
/// exported; so is every error reply and every request slower than its
/// model's `slow_ms`, sampled or not.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// Trace requests and export the spans; off: no trace context is read,
    /// made or sent.
    pub enabled: bool,
    /// Where spans are posted: an OTLP/HTTP traces URL (an OpenTelemetry
    /// Collector's or Jaeger's `http://HOST:4318/v1/traces`); https uses
    /// the node's TLS roots.
    pub endpoint: String,
    /// A file of `Name: value` lines sent as headers with each export (an
    /// API key); `#` starts a comment. Kept out of the config for secrecy.
    pub headers_file: Option<PathBuf>,
    /// The `service.name` resource attribute; `node.id` is sent as
    /// `service.instance.id`.
    pub service_name: String,
    /// The share of new traces exported (0 to 1). A caller's trace keeps
    /// the caller's decision (its `traceparent` sampled flag).
    pub sample_ratio: f64,
    /// A request slower than this end to end (milliseconds) is exported
    /// even when not sampled: the latency SLO bucket.
    pub slow_ms: u64,
    /// Spans waiting for export; past it spans are dropped and counted in
    /// `edgeinfer_trace_spans_dropped_total`, so a slow collector never
    /// delays a reply.
    pub queue_spans: usize,
    /// The longest one export may take before its spans are dropped.
    pub timeout_ms: u64,
    /// Per model: `slow_ms` for that model (`digits = 10`).
    pub model_slow_ms: BTreeMap<String, u64>,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            enabled: false,
            endpoint: "http://127.0.0.1:4318/v1/traces".into(),
            headers_file: None,
            service_name: "edgeinfer".into(),
            sample_ratio: 0.01,
            slow_ms: 100,
            queue_spans: 8192,
            timeout_ms: 5000,
            model_slow_ms: BTreeMap::new(),
        }
    }
}

/// `[control]`: the rollout commands over MQTT on `PREFIX/NODE/control`,
/// for fleet managers without HTTP. Off by default; on, each command must
/// be signed with the key in `key_file` and recent (`max_skew_s`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ControlConfig {
    /// Take signed rollout commands on `PREFIX/NODE/control`; off: not
    /// subscribed.
    pub enabled: bool,
    /// A file whose first line (at least 32 bytes, used as written) is the
    /// HMAC-SHA256 key commands are signed with; it never travels.
    pub key_file: Option<PathBuf>,
    /// How far a command's `issued_at_s` may be from the node's clock,
    /// either way; the node remembers what it answered for as long.
    pub max_skew_s: u64,
    /// Gone: the token crossed the broker in clear. Read only to name
    /// `key_file` when an old config still sets it.
    pub token_file: Option<PathBuf>,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig { enabled: false, key_file: None, max_skew_s: 300, token_file: None }
    }
}

/// `[site]`: the nodes of one share group as one site. With `rollout` on,
/// a model's deployment state is the site's (a retained topic every node
/// reads), one node at a time judges a rollout on the figures of all of
/// them, and every node routes a device the same way.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SiteConfig {
    /// One rollout per site: the deployment state on
    /// `PREFIX/site/rollout/MODEL`, judged by one node on every node's
    /// figures; set it on every node of a share group.
    pub rollout: bool,
    /// Keep alive of the site connection: a node that dies without a TCP
    /// reset (power, cable) leaves the site after 1.5 times this.
    pub keep_alive_s: u16,
}

impl Default for SiteConfig {
    fn default() -> Self {
        SiteConfig { rollout: false, keep_alive_s: 5 }
    }
}

impl Default for CaptureConfig {
    fn default() -> Self {
        CaptureConfig { enabled: false, rate: 0.1, max_records: 100_000, max_bytes: 64 * 1024 * 1024 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Model name on the cloud tier; default: the same name.
    pub cloud_model: Option<String>,
    /// Escalate to the cloud tier when confidence is below this.
    pub threshold: f32,
    /// What "confidence" is for the threshold: `max` (the top probability)
    /// or `margin` (top minus second), taken over the worst row.
    pub confidence: crate::protocol::Confidence,
    /// `sync`: an escalated request waits for the cloud; `async`: it gets
    /// the edge answer at once (`final: false`), the cloud's follows.
    pub enrich: crate::protocol::Enrich,
    /// This model's `runtime.max_batch`; unset batching keys take the
    /// `[runtime]` ones.
    pub max_batch: Option<usize>,
    /// This model's `runtime.max_delay_us`.
    pub max_delay_us: Option<u64>,
    /// This model's `runtime.latency_budget_ms`.
    pub latency_budget_ms: Option<f64>,
    /// How long this model's answers stay cached; 0: never cache them (for a
    /// model whose answers change with time). Default: `cache.ttl_s`.
    pub cache_ttl_s: Option<u64>,
    /// The `top_k` list a reply carries when its request asks for none
    /// (`parameters.top_k`); unset or 0: none.
    pub top_k: Option<u32>,
    /// Overrides the model manifest's `preprocess.scale` (inputs are
    /// `x * scale + offset` before the model sees them).
    pub preprocess_scale: Option<f32>,
    /// Overrides the model manifest's `preprocess.offset`.
    pub preprocess_offset: Option<f32>,
    /// What a new version found by a reload starts: `off` (it is just the
    /// newest), `canary` or `shadow` (a rollout judged by `rollout`'s gates).
    pub auto_rollout: AutoRollout,
    /// How this model's rollouts step and what their gates allow.
    pub rollout: RolloutPolicy,
}

impl Default for NodeConfig {
    fn default() -> Self {
        let under_systemd = std::env::var_os("INVOCATION_ID").is_some();
        NodeConfig {
            id: host_name(),
            models_dir: if under_systemd { "/usr/share/edgeinfer/models".into() } else { "models".into() },
            state_dir: std::env::var_os("STATE_DIRECTORY")
                .map(|s| {
                    // systemd passes a colon-separated list; the first is ours.
                    let s = s.to_string_lossy().into_owned();
                    PathBuf::from(s.split(':').next().unwrap_or("state"))
                })
                .unwrap_or_else(|| "state".into()),
            drain_timeout_s: 10,
        }
    }
}

impl Default for MqttConfig {
    fn default() -> Self {
        MqttConfig {
            url: "mqtt://127.0.0.1:1883".into(),
            embedded_broker: false,
            embedded_listen: None,
            embedded_v311_listen: None,
            topic_prefix: "edgeinfer".into(),
            share_group: "edgeinfer".into(),
            client_id: None,
            session_expiry_s: 3600,
            keep_alive_s: 30,
            share_session_expiry_s: 5,
            share_keep_alive_s: 5,
            username: None,
            password: None,
            password_file: None,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            max_in_flight: 512,
            reply_prefixes: Vec::new(),
            reply_qos: 2,
            journal: JournalConfig::default(),
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
            token_file: None,
            admin_token_file: None,
            protect_metrics: false,
            tls_cert_file: None,
            tls_key_file: None,
            max_connections: 256,
            header_timeout_ms: 10_000,
            body_timeout_ms: 30_000,
        }
    }
}

impl Default for CloudConfig {
    fn default() -> Self {
        CloudConfig {
            enabled: false,
            url: String::new(),
            token: None,
            token_file: None,
            allow_insecure_token: false,
            ca_file: None,
            connect_timeout_ms: 500,
            timeout_ms: 2000,
            max_concurrency: 16,
            retries: 2,
            breaker_failures: 5,
            breaker_open_ms: 10_000,
            reserve_ms: 10,
            fallback: true,
            spool_max_entries: 10_000,
            spool_max_bytes: 64 * 1024 * 1024,
            spool_max_attempts: 10,
            spool_max_age_s: 86_400,
        }
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            batch_sizes: vec![1, 2, 4, 8, 16, 32],
            threads_per_model: 1,
            io_threads: 2,
            queue_capacity: 1024,
            max_batch: 32,
            max_delay_us: 2000,
            latency_budget_ms: None,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_payload_bytes: 256 * 1024,
            max_packet_bytes: 16 * 1024 * 1024,
            max_bytes_in_flight: 64 * 1024 * 1024,
            max_rows: 256,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            cloud_model: None,
            threshold: 0.99,
            confidence: Default::default(),
            enrich: Default::default(),
            max_batch: None,
            max_delay_us: None,
            latency_budget_ms: None,
            cache_ttl_s: None,
            top_k: None,
            preprocess_scale: None,
            preprocess_offset: None,
            auto_rollout: AutoRollout::Off,
            rollout: RolloutPolicy::default(),
        }
    }
}

/// Connections the embedded broker takes at once (each costs a file
/// descriptor; the systemd unit's LimitNOFILE leaves room for them).
pub const EMBEDDED_BROKER_MAX_CONNECTIONS: usize = 1000;

const ENV_PREFIX: &str = "EDGEINFER_";
/// Variables that are not config keys: the command line's own (`--config`,
/// `--log`) and the int8 kernel switches (docs/MODELS.md, "INT8 models"), which
/// the ops read when a model loads.
const NOT_KEYS: [&str; 7] = [
    "EDGEINFER_CONFIG",
    "EDGEINFER_LOG",
    "EDGEINFER_LOG_FORMAT",
    "EDGEINFER_INT8_OPS",
    "EDGEINFER_INT8_GEMM",
    "EDGEINFER_AVX512",
    "EDGEINFER_VNNI",
];

impl ConfigError {
    /// A few words and no paths, for the retained status.
    pub fn reason(&self) -> String {
        match self {
            ConfigError::Read { .. } => "cannot read the config file".into(),
            ConfigError::Syntax { .. } => "the config file is not valid TOML".into(),
            ConfigError::Key { key, .. } => format!("config key {key} has a bad value"),
            ConfigError::Keys(problems) => format!(
                "config keys {} have bad values",
                problems.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// (key, what is wrong and what is allowed) for each mistake; a file
    /// that cannot be read or parsed names no key.
    pub fn problems(&self) -> Vec<(String, String)> {
        match self {
            ConfigError::Key { key, message } => vec![(key.clone(), message.clone())],
            ConfigError::Keys(problems) => problems.clone(),
            other => vec![(String::new(), other.to_string())],
        }
    }

    fn from_problems(mut problems: Vec<(String, String)>) -> ConfigError {
        if problems.len() == 1 {
            let (key, message) = problems.remove(0);
            ConfigError::Key { key, message }
        } else {
            ConfigError::Keys(problems)
        }
    }
}

impl Config {
    /// The file (if any) with the process environment's overrides on top.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError::Syntax { path: path.to_owned(), message: e.to_string() })?
            }
            None => toml::Table::new(),
        };
        Self::from_table(table_with_env(&mut table, env)?)
    }

    /// A config file's text alone (no environment), as `serve` would read it.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut table = text
            .parse::<toml::Table>()
            .map_err(|e| ConfigError::Syntax { path: "(text)".into(), message: e.to_string() })?;
        Self::from_table(table_with_env(&mut table, std::iter::empty())?)
    }

    /// The config, or every mistake in it: a key serde refuses is taken
    /// out and the rest read again (at most 32 times), then the values are
    /// checked.
    fn from_table(mut table: toml::Table) -> Result<Config, ConfigError> {
        let mut problems = Vec::new();
        let config = loop {
            match serde_path_to_error::deserialize::<_, Config>(toml::Value::Table(table.clone())) {
                Ok(config) => break config,
                Err(e) => {
                    let key = e.path().to_string();
                    // toml repeats the path after a newline: the key says it.
                    let message = e.into_inner().to_string();
                    let message = message.split("\nin `").next().unwrap_or_default().trim().to_string();
                    let removed = remove_refused(&mut table, &key, &message);
                    problems.push((key, message));
                    if !removed || problems.len() >= 32 {
                        return Err(ConfigError::from_problems(problems));
                    }
                }
            }
        };
        problems.extend(config.validate());
        if problems.is_empty() { Ok(config) } else { Err(ConfigError::from_problems(problems)) }
    }

    /// The config as TOML values, secrets redacted, for printing.
    pub fn to_toml(&self) -> toml::Value {
        toml::Value::try_from(self).expect("every config value has a TOML form")
    }

    /// The config as TOML values with the secrets in them, for comparing
    /// two configs (a changed password is a change); never for output.
    pub(crate) fn to_toml_with_secrets(&self) -> toml::Value {
        SHOW_SECRETS.set(true);
        let value = self.to_toml();
        SHOW_SECRETS.set(false);
        value
    }

    /// How `model`'s rollouts step and judge (its `[models.NAME.rollout]`).
    pub fn rollout_policy(&self, model: &str) -> RolloutPolicy {
        self.models.get(model).map(|m| m.rollout.clone()).unwrap_or_default()
    }

    /// What is wrong with the values, each as (key, what is allowed).
    fn validate(&self) -> Vec<(String, String)> {
        let problems = std::cell::RefCell::new(Vec::new());
        let bad = |key: &str, message: String| problems.borrow_mut().push((key.to_string(), message));
        if self.node.id.is_empty() || self.node.id.contains(['/', '+', '#']) {
            bad("node.id", format!("{:?}: use a non-empty name without '/', '+' or '#'", self.node.id));
        }
        if !(self.mqtt.url.starts_with("mqtt://") || self.mqtt.url.starts_with("mqtts://")) {
            bad(
                "mqtt.url",
                format!("{:?}: use mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS", self.mqtt.url),
            );
        }
        for (key, value) in
            [("mqtt.topic_prefix", &self.mqtt.topic_prefix), ("mqtt.share_group", &self.mqtt.share_group)]
        {
            if value.is_empty() || value.contains(['+', '#']) || value.starts_with('$') {
                bad(key, format!("{value:?}: use a non-empty topic level without '+', '#' or a leading '$'"));
            }
        }
        for prefix in &self.mqtt.reply_prefixes {
            if prefix.trim_end_matches('/').is_empty()
                || prefix.contains(['+', '#'])
                || prefix.starts_with('$')
            {
                bad(
                    "mqtt.reply_prefixes",
                    format!(
                        "{prefix:?}: list topic levels like \"devices\", without '+', '#' or a leading '$'"
                    ),
                );
            }
        }
        if self.mqtt.keep_alive_s < 5 {
            bad(
                "mqtt.keep_alive_s",
                format!(
                    "{}: use 5 to 65535 seconds (the MQTT client needs at least 5)",
                    self.mqtt.keep_alive_s
                ),
            );
        }
        if !(5..=60).contains(&self.mqtt.share_keep_alive_s) {
            bad(
                "mqtt.share_keep_alive_s",
                format!(
                    "{}: use 5 to 60 seconds (a node that dies silently leaves the share group after 1.5 \
                     times this plus mqtt.share_session_expiry_s)",
                    self.mqtt.share_keep_alive_s
                ),
            );
        }
        if self.mqtt.share_session_expiry_s > 300 {
            bad(
                "mqtt.share_session_expiry_s",
                format!(
                    "{}: use 0 to 300 seconds (a dead node's share of the requests waits for it this long; \
                     its own topic keeps mqtt.session_expiry_s)",
                    self.mqtt.share_session_expiry_s
                ),
            );
        }
        if !(1..=65535).contains(&self.mqtt.max_in_flight) {
            bad("mqtt.max_in_flight", format!("{}: use 1 to 65535", self.mqtt.max_in_flight));
        }
        if self.mqtt.client_cert_file.is_some() != self.mqtt.client_key_file.is_some() {
            bad(
                "mqtt.client_cert_file",
                "give both mqtt.client_cert_file and mqtt.client_key_file for mutual TLS, or neither".into(),
            );
        }
        if let Some(listen) = &self.mqtt.embedded_v311_listen
            && !listen.is_empty()
            && listen.parse::<std::net::SocketAddr>().is_err()
        {
            bad(
                "mqtt.embedded_v311_listen",
                format!("{listen:?}: use HOST:PORT, or \"\" (the default) for no 3.1.1 listener"),
            );
        }
        if let Some(listen) = &self.mqtt.embedded_listen
            && listen.parse::<std::net::SocketAddr>().is_err()
        {
            bad("mqtt.embedded_listen", format!("{listen:?}: use HOST:PORT like 0.0.0.0:1883"));
        }
        if !self.http.listen.is_empty() && self.http.listen.parse::<std::net::SocketAddr>().is_err() {
            bad(
                "http.listen",
                format!("{:?}: use HOST:PORT like 127.0.0.1:9464, or \"\" to disable", self.http.listen),
            );
        }
        let http = &self.http;
        for (key, value, range) in [
            ("http.max_connections", http.max_connections as u64, 1..=65_536),
            ("http.header_timeout_ms", http.header_timeout_ms, 100..=600_000),
            ("http.body_timeout_ms", http.body_timeout_ms, 100..=3_600_000),
        ] {
            if !range.contains(&value) {
                bad(key, format!("{value}: use {} to {}", range.start(), range.end()));
            }
        }
        if http.tls_cert_file.is_some() != http.tls_key_file.is_some() {
            bad(
                "http.tls_cert_file",
                "give both http.tls_cert_file and http.tls_key_file for HTTPS, or neither".into(),
            );
        }
        if http.protect_metrics && http.token_file.is_none() && http.admin_token_file.is_none() {
            bad(
                "http.protect_metrics",
                "true needs a token to protect with: set http.token_file (or http.admin_token_file)".into(),
            );
        }
        if self.cloud.enabled
            && !(self.cloud.url.starts_with("http://") || self.cloud.url.starts_with("https://"))
        {
            bad(
                "cloud.url",
                format!(
                    "{:?}: with cloud.enabled = true, give the http:// or https:// URL of an Open Inference Protocol server",
                    self.cloud.url
                ),
            );
        }
        let cloud = &self.cloud;
        for (key, value, range) in [
            ("cloud.connect_timeout_ms", cloud.connect_timeout_ms, 1..=60_000),
            ("cloud.timeout_ms", cloud.timeout_ms, 1..=600_000),
            ("cloud.breaker_open_ms", cloud.breaker_open_ms, 1..=3_600_000),
            ("cloud.reserve_ms", cloud.reserve_ms, 0..=10_000),
            ("cloud.max_concurrency", cloud.max_concurrency as u64, 1..=4096),
            ("cloud.retries", cloud.retries as u64, 0..=10),
            ("cloud.breaker_failures", cloud.breaker_failures as u64, 1..=1000),
            ("cloud.spool_max_entries", cloud.spool_max_entries as u64, 1..=10_000_000),
            ("cloud.spool_max_attempts", cloud.spool_max_attempts as u64, 1..=1000),
            ("cloud.spool_max_age_s", cloud.spool_max_age_s, 1..=30 * 86_400),
        ] {
            if !range.contains(&value) {
                bad(key, format!("{value}: use {} to {}", range.start(), range.end()));
            }
        }
        if cloud.token.is_some() && cloud.token_file.is_some() {
            bad("cloud.token", "give cloud.token or cloud.token_file, not both".into());
        }
        if cloud.enabled
            && cloud.url.starts_with("http://")
            && (cloud.token.is_some() || cloud.token_file.is_some())
            && !cloud.allow_insecure_token
        {
            bad(
                "cloud.url",
                format!(
                    "{:?}: a bearer token would be sent in clear text; use https://, or set \
                     cloud.allow_insecure_token = true for a cloud tier on a trusted link",
                    cloud.url
                ),
            );
        }
        let sizes = &self.runtime.batch_sizes;
        if sizes.first() != Some(&1)
            || sizes.windows(2).any(|w| w[0] >= w[1])
            || sizes.iter().any(|&s| s > 4096)
        {
            bad(
                "runtime.batch_sizes",
                format!(
                    "{sizes:?}: list ascending sizes starting at 1, at most 4096, like [1, 2, 4, 8, 16, 32]"
                ),
            );
        }
        if !(1..=64).contains(&self.runtime.threads_per_model) {
            bad("runtime.threads_per_model", format!("{}: use 1 to 64", self.runtime.threads_per_model));
        }
        if !(1..=64).contains(&self.runtime.io_threads) {
            bad("runtime.io_threads", format!("{}: use 1 to 64", self.runtime.io_threads));
        }
        if !(1..=1_000_000).contains(&self.runtime.queue_capacity) {
            bad("runtime.queue_capacity", format!("{}: use 1 to 1000000", self.runtime.queue_capacity));
        }
        if !(64..=64 * 1024 * 1024).contains(&self.limits.max_payload_bytes) {
            bad("limits.max_payload_bytes", format!("{}: use 64 to 67108864", self.limits.max_payload_bytes));
        }
        let limits = &self.limits;
        // 268435455: the largest packet MQTT's length field can carry.
        if !(limits.max_payload_bytes..=268_435_455).contains(&limits.max_packet_bytes) {
            bad(
                "limits.max_packet_bytes",
                format!(
                    "{}: use limits.max_payload_bytes ({}) to 268435455",
                    limits.max_packet_bytes, limits.max_payload_bytes
                ),
            );
        }
        if !(limits.max_packet_bytes..=1 << 36).contains(&limits.max_bytes_in_flight) {
            bad(
                "limits.max_bytes_in_flight",
                format!(
                    "{}: use limits.max_packet_bytes ({}) to 68719476736, so one largest request always fits",
                    limits.max_bytes_in_flight, limits.max_packet_bytes
                ),
            );
        }
        if self.limits.max_rows == 0 {
            bad("limits.max_rows", "0: use at least 1".into());
        }
        if self.node.drain_timeout_s > 3600 {
            bad("node.drain_timeout_s", format!("{}: use 0 to 3600 seconds", self.node.drain_timeout_s));
        }
        let redis = &self.cache.redis;
        if redis.enabled && !(redis.url.starts_with("redis://") || redis.url.starts_with("rediss://")) {
            bad(
                "cache.redis.url",
                format!("{:?}: use redis://HOST:PORT, or rediss://HOST:PORT for TLS", redis.url),
            );
        }
        // A password in the URL would reach logs and the status with it.
        if let Some((authority, _)) = redis.url.split_once("://").and_then(|(_, rest)| rest.split_once('@'))
            && authority.contains(':')
        {
            bad(
                "cache.redis.url",
                "has a password in it: put the password in cache.redis.password_file and leave it out of the URL"
                    .into(),
            );
        }
        if redis.url.contains('#') {
            bad(
                "cache.redis.url",
                format!(
                    "{:?}: no #fragment (#insecure would skip the server's certificate check); \
                     for a site CA use cache.redis.ca_file",
                    redis.url
                ),
            );
        }
        if redis.enabled && redis.ca_file.is_some() && !redis.url.starts_with("rediss://") {
            bad(
                "cache.redis.ca_file",
                format!("is set but cache.redis.url {:?} is not TLS: use rediss://HOST:PORT", redis.url),
            );
        }
        if redis.key_prefix.is_empty() || redis.key_prefix.contains(['*', '?', '[', ']', ' ']) {
            bad(
                "cache.redis.key_prefix",
                format!("{:?}: use a non-empty name without spaces or '*', '?', '[', ']'", redis.key_prefix),
            );
        }
        if !(1..=10_000).contains(&redis.timeout_ms) {
            bad(
                "cache.redis.timeout_ms",
                format!(
                    "{}: use 1 to 10000 (a lookup slower than the model is not worth waiting for)",
                    redis.timeout_ms
                ),
            );
        }
        if redis.ttl_s == Some(0) {
            bad("cache.redis.ttl_s", "0: use at least 1 second, or leave it out for the cache TTL".into());
        }
        // Unsigned shared answers would let any client that can write to
        // Redis choose what every node answers.
        if redis.enabled && redis.key_file.is_none() {
            bad(
                "cache.redis.key_file",
                "not set, and cache.redis.enabled = true needs it: the site key signs every shared answer. \
                 Make one with `head -c 32 /dev/urandom | xxd -p > /etc/edgeinfer/redis.key`, copy the file \
                 to every node of the site and set cache.redis.key_file to it"
                    .into(),
            );
        }
        let control = &self.control;
        if let Some(path) = &control.token_file {
            bad(
                "control.token_file",
                format!(
                    "{}: control commands are signed now, so no token crosses the broker; remove \
                     control.token_file and set control.key_file to a file holding a key of at least 32 \
                     bytes (openssl rand -hex 32), the one the fleet signs with",
                    path.display()
                ),
            );
        }
        if control.enabled && control.key_file.is_none() {
            bad(
                "control.enabled",
                "true without control.key_file: set control.key_file to a file holding the key commands \
                 are signed with (at least 32 bytes: openssl rand -hex 32), or leave control off"
                    .into(),
            );
        }
        if !(1..=3600).contains(&control.max_skew_s) {
            bad(
                "control.max_skew_s",
                format!(
                    "{}: use 1 to 3600 seconds (how far a command's issued_at_s may be from the \
                     node's clock)",
                    control.max_skew_s
                ),
            );
        }
        if !(5..=60).contains(&self.site.keep_alive_s) {
            bad(
                "site.keep_alive_s",
                format!(
                    "{}: use 5 to 60 seconds (a dead node leaves the site after 1.5 times this)",
                    self.site.keep_alive_s
                ),
            );
        }
        let capture = &self.capture;
        if !(0.0..=1.0).contains(&capture.rate) {
            bad(
                "capture.rate",
                format!("{}: use a share from 0 to 1 (0.1 keeps one request in ten)", capture.rate),
            );
        }
        if capture.max_records == 0 || capture.max_bytes < 4096 {
            let (key, value) = if capture.max_records == 0 {
                ("capture.max_records", capture.max_records)
            } else {
                ("capture.max_bytes", capture.max_bytes)
            };
            bad(key, format!("{value}: use at least 1 record and 4096 bytes"));
        }
        let tracing = &self.tracing;
        if !(0.0..=1.0).contains(&tracing.sample_ratio) {
            bad(
                "tracing.sample_ratio",
                format!(
                    "{}: use a share from 0 to 1 (0.01 exports one new trace in a hundred)",
                    tracing.sample_ratio
                ),
            );
        }
        if tracing.enabled
            && !(tracing.endpoint.starts_with("http://") || tracing.endpoint.starts_with("https://"))
        {
            bad(
                "tracing.endpoint",
                format!(
                    "{:?}: use an http:// or https:// URL, such as http://127.0.0.1:4318/v1/traces",
                    tracing.endpoint
                ),
            );
        }
        if tracing.service_name.trim().is_empty() {
            bad(
                "tracing.service_name",
                format!("{:?}: name the service, such as \"edgeinfer\"", tracing.service_name),
            );
        }
        for (key, ms) in std::iter::once(("tracing.slow_ms".to_string(), tracing.slow_ms))
            .chain(tracing.model_slow_ms.iter().map(|(m, ms)| (format!("tracing.model_slow_ms.{m}"), *ms)))
        {
            if !(1..=600_000).contains(&ms) {
                bad(&key, format!("{ms}: use 1 to 600000 milliseconds"));
            }
        }
        if !(64..=1_000_000).contains(&tracing.queue_spans) {
            bad("tracing.queue_spans", format!("{}: use 64 to 1000000 spans", tracing.queue_spans));
        }
        if !(100..=60_000).contains(&tracing.timeout_ms) {
            bad("tracing.timeout_ms", format!("{}: use 100 to 60000 milliseconds", tracing.timeout_ms));
        }
        let feedback = &self.feedback;
        if !(1..=7 * 24 * 3600).contains(&feedback.window_s) {
            bad("feedback.window_s", format!("{}: use 1 to 604800 seconds (a week)", feedback.window_s));
        }
        if !(1..=10_000_000).contains(&feedback.max_entries) {
            bad("feedback.max_entries", format!("{}: use 1 to 10000000 answers", feedback.max_entries));
        }
        if !(64 * 1024..=4 << 30).contains(&feedback.max_bytes) {
            bad(
                "feedback.max_bytes",
                format!("{}: use 65536 (64 KiB) to 4294967296 (4 GiB)", feedback.max_bytes),
            );
        }
        if self.cache.sweep_interval_s == 0 {
            bad("cache.sweep_interval_s", "0: use at least 1 second".into());
        }
        if self.cache.disk_read_timeout_ms == 0 || self.cache.disk_read_timeout_ms > 10_000 {
            bad(
                "cache.disk_read_timeout_ms",
                format!(
                    "{}: use 1 to 10000 (a read slower than running the model is not worth waiting for)",
                    self.cache.disk_read_timeout_ms
                ),
            );
        }
        if self.cache.disk_page_cache_bytes < 1024 * 1024 {
            bad(
                "cache.disk_page_cache_bytes",
                format!("{}: use at least 1048576 (1 MiB)", self.cache.disk_page_cache_bytes),
            );
        }
        if self.cache.memory_bytes > 0 && self.cache.memory_bytes < 64 * 1024 {
            bad("cache.memory_bytes", format!("{}: use 0 (off) or at least 65536", self.cache.memory_bytes));
        }
        if self.cache.disk_bytes > 0 && self.cache.disk_bytes < 1024 * 1024 {
            bad(
                "cache.disk_bytes",
                format!(
                    "{}: use 0 (off) or at least 1048576 (1 MiB: the index's own files take about 100 KiB)",
                    self.cache.disk_bytes
                ),
            );
        }
        if !matches!(self.mqtt.reply_qos, 1 | 2) {
            bad(
                "mqtt.reply_qos",
                format!(
                    "{}: use 1 (at least once) or 2 (exactly once to the broker, across a crash with the journal)",
                    self.mqtt.reply_qos
                ),
            );
        }
        let journal = &self.mqtt.journal;
        if journal.max_bytes > 0 && journal.max_bytes < 1024 * 1024 {
            bad(
                "mqtt.journal.max_bytes",
                format!(
                    "{}: use 0 (off) or at least 1048576 (1 MiB: room for the requests in flight and their answers)",
                    journal.max_bytes
                ),
            );
        }
        if journal.commit_window_ms > 100 {
            bad(
                "mqtt.journal.commit_window_ms",
                format!(
                    "{}: use 0 to 100 (acknowledgements wait for it; the broker redelivers what waits too long)",
                    journal.commit_window_ms
                ),
            );
        }
        // The batching keys of `[runtime]`: what a model without its own has
        // (the other keys of a model's serving settings have no `[runtime]` twin).
        let runtime = self.default_serving().problems("models.NAME");
        for (key, message) in runtime.into_iter().filter(|(k, _)| k.contains("max_") || k.contains("latency"))
        {
            bad(&key.replace("models.NAME", "runtime"), message);
        }
        for (name, model) in &self.models {
            for (key, message) in self.serving(name).problems(&format!("models.{name}")) {
                bad(&key, message);
            }
            if let Err((key, message)) = model.rollout.check() {
                bad(&format!("models.{name}.rollout.{key}"), message);
            }
        }
        problems.into_inner()
    }
}

/// `table` with the environment's `EDGEINFER_` overrides applied.
/// Takes the key serde refused (`mqtt.keep_alive_s`, or the unknown
/// `mqtt.urll` under `mqtt`) out of `table`; false if it is not there.
fn remove_refused(table: &mut toml::Table, path: &str, message: &str) -> bool {
    let mut parts: Vec<&str> = path.split('.').filter(|p| !p.is_empty() && *p != "?").collect();
    // serde names an unknown field in its message, under its table's path.
    if let Some(field) = message.strip_prefix("unknown field `").and_then(|m| m.split('`').next())
        && parts.last() != Some(&field)
    {
        parts.push(field);
    }
    let Some((last, parents)) = parts.split_last() else { return false };
    let mut here = table;
    for part in parents {
        match here.get_mut(*part).and_then(|v| v.as_table_mut()) {
            Some(inner) => here = inner,
            None => return false,
        }
    }
    here.remove(*last).is_some()
}

fn table_with_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<toml::Table, ConfigError> {
    let mut overrides: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && !NOT_KEYS.contains(&k.as_str()))
        .collect();
    overrides.sort();
    for (var, value) in overrides {
        apply_override(table, &var, &value)?;
    }
    Ok(std::mem::take(table))
}

/// `EDGEINFER_MQTT__URL=mqtt://x` sets `mqtt.url`; `EDGEINFER_MODELS__DIGITS__THRESHOLD=0.9`
/// sets `models.digits.threshold`. Values are read as TOML (`true`, `8`, `[1, 8]`),
/// and as a plain string when they are not valid TOML.
fn apply_override(table: &mut toml::Table, var: &str, value: &str) -> Result<(), ConfigError> {
    let path: Vec<String> = var[ENV_PREFIX.len()..].split("__").map(|s| s.to_ascii_lowercase()).collect();
    if path.len() < 2 || path.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::Key {
            key: var.into(),
            message: "environment overrides are named EDGEINFER_<SECTION>__<KEY>, like EDGEINFER_MQTT__URL"
                .into(),
        });
    }
    let parsed = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let mut node = table;
    for part in &path[..path.len() - 1] {
        let entry = node.entry(part.clone()).or_insert_with(|| toml::Value::Table(Default::default()));
        node = entry.as_table_mut().ok_or_else(|| ConfigError::Key {
            key: path.join("."),
            message: format!("{var}: {part} is not a section"),
        })?;
    }
    node.insert(path[path.len() - 1].clone(), parsed);
    Ok(())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "edgeinfer".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn environment_overrides_the_file_with_typed_values() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "[node]\nid = \"from-file\"\n[mqtt]\nurl = \"mqtt://a:1883\"\n").unwrap();
        let config = Config::load_with_env(
            Some(&file),
            env(&[
                ("EDGEINFER_MQTT__URL", "mqtt://10.0.0.5:1883"),
                ("EDGEINFER_MQTT__EMBEDDED_BROKER", "true"),
                ("EDGEINFER_RUNTIME__BATCH_SIZES", "[1, 8]"),
                ("EDGEINFER_MODELS__DIGITS__THRESHOLD", "0.9"),
                ("OTHER_VAR", "ignored"),
            ]),
        )
        .unwrap();
        assert_eq!(config.node.id, "from-file");
        assert_eq!(config.mqtt.url, "mqtt://10.0.0.5:1883");
        assert!(config.mqtt.embedded_broker);
        assert_eq!(config.runtime.batch_sizes, vec![1, 8]);
        assert_eq!(config.models["digits"].threshold, 0.9);
        assert_eq!(config.http.listen, "127.0.0.1:9464");
    }

    #[test]
    fn a_bad_value_names_the_key_and_the_expected_type() {
        let err =
            Config::load_with_env(None, env(&[("EDGEINFER_MQTT__EMBEDDED_BROKER", "yes")])).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("mqtt.embedded_broker") && text.contains("yes") && text.contains("bool"),
            "{text}"
        );
        let err = Config::load_with_env(None, env(&[("EDGEINFER_NOPE", "1")])).unwrap_err();
        assert!(err.to_string().contains("EDGEINFER_<SECTION>__<KEY>"), "{err}");
        // The int8 kernel switches are not config keys: a node starts with them set.
        let switches = [
            ("EDGEINFER_INT8_OPS", "off"),
            ("EDGEINFER_AVX512", "off"),
            ("EDGEINFER_VNNI", "off"),
            ("EDGEINFER_INT8_GEMM", "ours"),
        ];
        assert_eq!(
            Config::load_with_env(None, env(&switches)).unwrap(),
            Config::load_with_env(None, env(&[])).unwrap()
        );
        let err =
            Config::load_with_env(None, env(&[("EDGEINFER_MODELS__DIGITS__THRESHOLD", "1.5")])).unwrap_err();
        assert!(err.to_string().contains("models.digits.threshold"), "{err}");
        // A model's rollout policy: the bad key, its value and what is allowed.
        let err = Config::parse("[models.digits.rollout]\nsteps = [50, 25, 100]\n").unwrap_err().to_string();
        assert!(err.contains("models.digits.rollout.steps") && err.contains("ascending"), "{err}");
        let err = Config::parse("[models.digits]\nauto_rollout = \"yes\"\n").unwrap_err().to_string();
        assert!(err.contains("auto_rollout") && err.contains("canary"), "{err}");
        let config = Config::parse(
            "[models.digits]\nauto_rollout = \"shadow\"\n[models.digits.rollout]\nbake_s = 60\n",
        )
        .unwrap();
        assert_eq!(
            (config.models["digits"].auto_rollout, config.rollout_policy("digits").bake_s),
            (AutoRollout::Shadow, 60)
        );
        // The sections added for compare's capture and the Redis tier.
        for (key, value, names) in [
            ("EDGEINFER_CAPTURE__RATE", "1.5", "capture.rate"),
            ("EDGEINFER_CAPTURE__MAX_RECORDS", "0", "capture.max_records"),
            ("EDGEINFER_FEEDBACK__WINDOW_S", "0", "feedback.window_s"),
            ("EDGEINFER_FEEDBACK__MAX_ENTRIES", "0", "feedback.max_entries"),
            ("EDGEINFER_FEEDBACK__MAX_BYTES", "1024", "feedback.max_bytes"),
            ("EDGEINFER_CACHE__REDIS__TIMEOUT_MS", "0", "cache.redis.timeout_ms"),
            ("EDGEINFER_CACHE__REDIS__KEY_PREFIX", "a*", "cache.redis.key_prefix"),
            ("EDGEINFER_CACHE__REDIS__TTL_S", "0", "cache.redis.ttl_s"),
            ("EDGEINFER_TRACING__SAMPLE_RATIO", "1.5", "tracing.sample_ratio"),
            ("EDGEINFER_TRACING__SLOW_MS", "0", "tracing.slow_ms"),
            ("EDGEINFER_TRACING__QUEUE_SPANS", "8", "tracing.queue_spans"),
            ("EDGEINFER_TRACING__TIMEOUT_MS", "5", "tracing.timeout_ms"),
            ("EDGEINFER_TRACING__SERVICE_NAME", " ", "tracing.service_name"),
        ] {
            let err = Config::load_with_env(None, env(&[(key, value)])).unwrap_err().to_string();
            assert!(err.contains(names) && err.contains(value.trim_end_matches('*')), "{key}: {err}");
        }
        let err = Config::load_with_env(
            None,
            env(&[
                ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
                ("EDGEINFER_CACHE__REDIS__URL", "10.0.0.9:6379"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cache.redis.url") && err.contains("redis://"), "{err}");
        let err = Config::parse("[tracing]\nenabled = true\nendpoint = \"collector:4318\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tracing.endpoint") && err.contains("collector:4318") && err.contains("http://"),
            "{err}"
        );
        let config = Config::parse("[tracing]\nmodel_slow_ms = { digits = 10 }\n").unwrap();
        assert_eq!((config.tracing.model_slow_ms["digits"], config.tracing.sample_ratio), (10, 0.01));
        let err =
            Config::load_with_env(None, env(&[("EDGEINFER_CACHE__REDIS__URL", "redis://u:hunter2@h:6379")]))
                .unwrap_err()
                .to_string();
        assert!(err.contains("password_file") && !err.contains("hunter2"), "{err}");
        let err = Config::load_with_env(
            None,
            env(&[
                ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
                ("EDGEINFER_CACHE__REDIS__CA_FILE", "/etc/edgeinfer/site-ca.pem"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cache.redis.ca_file") && err.contains("rediss://"), "{err}");
        // Finding 2: control commands are signed with control.key_file's key.
        let err = Config::load_with_env(None, env(&[("EDGEINFER_CONTROL__ENABLED", "true")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("control.enabled") && err.contains("control.key_file"), "{err}");
        let old = [("EDGEINFER_CONTROL__TOKEN_FILE", "/etc/edgeinfer/control.token")];
        let err = Config::load_with_env(None, env(&old)).unwrap_err().to_string();
        assert!(
            err.contains("control.token_file")
                && err.contains("/etc/edgeinfer/control.token")
                && err.contains("control.key_file"),
            "{err}"
        );
        let err = Config::load_with_env(None, env(&[("EDGEINFER_CONTROL__MAX_SKEW_S", "0")])).unwrap_err();
        let err = err.to_string();
        assert!(err.contains("control.max_skew_s") && err.contains("0: use 1 to 3600"), "{err}");
        assert_eq!(Config::default().control.max_skew_s, 300);
        let insecure = [("EDGEINFER_CACHE__REDIS__URL", "rediss://10.0.0.2:6380/#insecure")];
        let err = Config::load_with_env(None, env(&insecure)).unwrap_err().to_string();
        assert!(err.contains("cache.redis.url") && err.contains("ca_file"), "{err}");
    }

    /// Issue 35, finding 8: no shared layer without the site key.
    #[test]
    fn finding_8_the_redis_layer_needs_the_site_key_file() {
        let err = Config::load_with_env(None, env(&[("EDGEINFER_CACHE__REDIS__ENABLED", "true")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cache.redis.key_file") && err.contains("head -c 32 /dev/urandom"), "{err}");
        let keyed = [
            ("EDGEINFER_CACHE__REDIS__ENABLED", "true"),
            ("EDGEINFER_CACHE__REDIS__KEY_FILE", "/etc/edgeinfer/redis.key"),
        ];
        assert!(Config::load_with_env(None, env(&keyed)).is_ok());
    }

    #[test]
    fn a_token_is_not_sent_over_plain_http_unless_allowed_and_never_shows_in_debug() {
        let cloud = [
            ("EDGEINFER_CLOUD__ENABLED", "true"),
            ("EDGEINFER_CLOUD__URL", "http://cloud.example:8080"),
            ("EDGEINFER_CLOUD__TOKEN", "s3cret-token"),
        ];
        let err = Config::load_with_env(None, env(&cloud)).unwrap_err().to_string();
        assert!(err.contains("cloud.url") && err.contains("cloud.allow_insecure_token"), "{err}");
        let mut allowed = cloud.to_vec();
        allowed.push(("EDGEINFER_CLOUD__ALLOW_INSECURE_TOKEN", "true"));
        let config = Config::load_with_env(None, env(&allowed)).unwrap();
        let options = crate::cloud::CloudOptions::from_config(&config).unwrap().unwrap();
        assert_eq!(options.token.as_ref().map(|t| t.0.as_str()), Some("s3cret-token"));
        for debug in [format!("{config:?}"), format!("{options:?}")] {
            assert!(!debug.contains("s3cret") && debug.contains("<redacted>"), "{debug}");
        }
        let mut https = cloud.to_vec();
        https[1].1 = "https://cloud.example";
        assert!(Config::load_with_env(None, env(&https)).is_ok());
    }

    /// Issue 42: rumqttc panics on a keep alive under 5 s; the share
    /// group's timers are bounded so a dead node leaves within seconds.
    #[test]
    fn keep_alives_under_5_s_and_a_long_share_session_are_refused_naming_the_key() {
        for (var, value, key, allowed) in [
            ("EDGEINFER_MQTT__KEEP_ALIVE_S", "4", "mqtt.keep_alive_s", "5 to 65535"),
            ("EDGEINFER_MQTT__SHARE_KEEP_ALIVE_S", "2", "mqtt.share_keep_alive_s", "5 to 60"),
            ("EDGEINFER_MQTT__SHARE_SESSION_EXPIRY_S", "3600", "mqtt.share_session_expiry_s", "0 to 300"),
        ] {
            let err = Config::load_with_env(None, env(&[(var, value)])).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(value) && err.contains(allowed), "{err}");
        }
        let config = Config::load_with_env(None, env(&[])).unwrap();
        assert_eq!((config.mqtt.share_keep_alive_s, config.mqtt.share_session_expiry_s), (5, 5));
    }

    /// Issue 37: the disk layer's bound counts sled's own files (about
    /// 100 KiB), so a bound under 1 MiB would hold next to nothing.
    #[test]
    fn a_disk_cache_bound_under_1_mib_is_refused_naming_the_key_and_the_minimum() {
        let err = Config::load_with_env(None, env(&[("EDGEINFER_CACHE__DISK_BYTES", "262144")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cache.disk_bytes") && err.contains("262144") && err.contains("1048576"),
            "{err}"
        );
        for allowed in ["0", "1048576"] {
            let config =
                Config::load_with_env(None, env(&[("EDGEINFER_CACHE__DISK_BYTES", allowed)])).unwrap();
            assert_eq!(config.cache.disk_bytes.to_string(), allowed);
        }
    }

    /// Issue 36: the journal's bound and commit window are checked at start.
    #[test]
    fn journal_mistakes_name_the_key_the_value_and_what_is_allowed() {
        let err = Config::load_with_env(
            None,
            env(&[
                ("EDGEINFER_MQTT__JOURNAL__MAX_BYTES", "4096"),
                ("EDGEINFER_MQTT__JOURNAL__COMMIT_WINDOW_MS", "500"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("mqtt.journal.max_bytes") && err.contains("4096") && err.contains("1048576"),
            "{err}"
        );
        assert!(
            err.contains("mqtt.journal.commit_window_ms") && err.contains("500") && err.contains("0 to 100"),
            "{err}"
        );
        let off = Config::load_with_env(None, env(&[("EDGEINFER_MQTT__JOURNAL__MAX_BYTES", "0")])).unwrap();
        assert_eq!(off.mqtt.journal.max_bytes, 0);
    }
}
