//! The shared layer: a Redis the nodes of a site share, below memory and
//! disk (`[cache.redis]`, off by default).
//!
//! A lookup waits at most `cache.redis.timeout_ms`, then counts a miss and
//! the model runs: a slow or dead Redis costs misses, never a stall. After
//! `TRIPS` failed lookups in a row the layer rests (lookups are misses at
//! once) and its connection is renewed; the rest doubles from `REST` up to
//! `MAX_REST` while Redis stays away. When a rest ends one lookup probes,
//! the others still miss at once; one answer ends the rests. Only lookups
//! decide whether the layer is up: a Redis that refuses writes (full,
//! under `noeviction`) still serves what it holds. Stores go to a writer
//! task over a bounded channel, off the request path; every key gets an
//! expiry. Values are signed with the site's key (`signed.rs`) under a key
//! that carries a format version and, through `Key`, the model's content:
//! a forged, foreign, torn or oversized value is a miss, counted, never
//! served, and a lookup reads at most `MAX_VALUE_BYTES` of it.

use super::key::Key;
use super::signed::{self, MAX_VALUE_BYTES, Rejected, SharedAnswer, SiteKey};
use crate::telemetry::{self, RedisState};
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::{TcpSettings, socket2};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The key format: bump it when `Key` or the value change meaning. v2:
/// keys cover the model's and manifest's sha256, values are signed; v1
/// values (unsigned) are simply never looked up.
const FORMAT: &str = "v2";
/// Failed lookups in a row after which the layer rests, and for how long:
/// `REST`, doubling while Redis stays away, up to `MAX_REST`.
const TRIPS: u32 = 3;
const REST: Duration = Duration::from_secs(1);
const MAX_REST: Duration = Duration::from_secs(5);
/// Stores waiting for the writer; beyond it they are dropped and counted.
const QUEUE: usize = 1024;
/// At most one log line per this long about rejected values: a planted
/// value looked up on every request must not flood the journal.
const REJECTION_LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub url: String,
    pub password_file: Option<std::path::PathBuf>,
    /// PEM roots for `rediss://`; `None`: the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// The site key that signs and checks every value; without one the
    /// layer does not open (nothing unsigned is ever written or served).
    pub key_file: Option<std::path::PathBuf>,
    pub key_prefix: String,
    /// Expiry of every key; `None`: the answer's own TTL.
    pub ttl: Option<Duration>,
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("cache.redis.url {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("cache.redis.ca_file {path}: {reason}")]
    Ca { path: String, reason: String },
    #[error("cache.redis.password_file {path}: {reason}")]
    Password { path: String, reason: String },
    #[error(
        "cache.redis.key_file is not set: the site key signs every shared answer; make one with \
         `head -c 32 /dev/urandom | xxd -p > /etc/edgeinfer/redis.key`, copy it to every node and set \
         cache.redis.key_file"
    )]
    NoKey,
    #[error("cache.redis.key_file {path}: {reason}")]
    Key { path: String, reason: String },
}

/// Whether the layer answers lookups, shared by the lookups (which
/// decide it), the writer and the status.
struct Health {
    /// Failed lookups since the last answer.
    failures: AtomicU32,
    /// Rests since the last answer: each one twice as long as the one before.
    rests: AtomicU32,
    /// 0 while the layer is up. Else, in milliseconds since `born`
    /// (monotonic), when the rest ends; a lookup after that claims the one
    /// probe by moving it on by `probe_ms`.
    resting_until_ms: AtomicU64,
    probe_ms: u64,
    born: Instant,
    /// What the status shows, changed together with the gauge.
    view: Mutex<View>,
}

struct View {
    up: bool,
    /// Why lookups fail, while they do.
    lookup_error: Option<String>,
    /// Why Redis refuses writes while it answers lookups (a full Redis).
    write_error: Option<String>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Health {
    fn new(timeout: Duration) -> Health {
        Health {
            failures: AtomicU32::new(0),
            rests: AtomicU32::new(0),
            resting_until_ms: AtomicU64::new(0),
            probe_ms: timeout.as_millis() as u64 + 50,
            born: Instant::now(),
            view: Mutex::new(View {
                up: false,
                lookup_error: Some("not connected yet".into()),
                write_error: None,
            }),
        }
    }

    fn now_ms(&self) -> u64 {
        // Never 0, which means "not resting".
        self.born.elapsed().as_millis() as u64 + 1
    }

    fn answered(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.rests.store(0, Ordering::Relaxed);
        self.resting_until_ms.store(0, Ordering::Relaxed);
        let mut view = locked(&self.view);
        if !view.up {
            tracing::info!("cache: Redis layer up");
            view.up = true;
            view.lookup_error = None;
        }
        metrics::gauge!(telemetry::CACHE_REDIS_UP).set(1.0);
    }

    /// Counts a failed lookup; true when it starts a rest (the caller
    /// renews the connection).
    fn lookup_failed(&self, reason: &'static str, error: String) -> bool {
        metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => reason).increment(1);
        let rests = self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= TRIPS;
        if rests {
            let n = self.rests.fetch_add(1, Ordering::Relaxed).min(8);
            let rest = REST.saturating_mul(1 << n).min(MAX_REST);
            self.resting_until_ms.store(self.now_ms() + rest.as_millis() as u64, Ordering::Relaxed);
        }
        let mut view = locked(&self.view);
        if view.up {
            tracing::warn!("cache: Redis layer down ({error}); lookups are misses until it answers");
            view.up = false;
        }
        view.lookup_error = Some(error);
        metrics::gauge!(telemetry::CACHE_REDIS_UP).set(0.0);
        rests
    }

    /// Whether this lookup may go to Redis: always while the layer is up;
    /// while it rests, never; after a rest, only the one lookup that claims
    /// the probe.
    fn may_look_up(&self) -> bool {
        let until = self.resting_until_ms.load(Ordering::Relaxed);
        if until == 0 {
            return true;
        }
        let now = self.now_ms();
        now >= until
            && self
                .resting_until_ms
                .compare_exchange(until, now + self.probe_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Rested and not yet answering again: the writer does not try.
    fn resting(&self) -> bool {
        self.resting_until_ms.load(Ordering::Relaxed) != 0
    }

    fn wrote(&self) {
        let mut view = locked(&self.view);
        if view.write_error.take().is_some() {
            tracing::info!("cache: Redis takes answers again");
        }
    }

    /// A refused or failed write: counted, and logged when it starts; the
    /// lookups alone say whether the layer is up.
    fn write_failed(&self, error: redis::RedisError) {
        let reason = if error.code() == Some("OOM") { "full" } else { "error" };
        metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => reason).increment(1);
        let mut view = locked(&self.view);
        if view.write_error.is_none() {
            tracing::warn!("cache: Redis refuses answers ({error}); they stay on this node");
        }
        view.write_error = Some(format!("writes refused: {error}"));
    }

    fn state(&self) -> RedisState {
        let view = locked(&self.view);
        let error = if view.up { view.write_error.clone() } else { view.lookup_error.clone() };
        RedisState { up: view.up, error }
    }
}

/// Values Redis gave that were not served: each counted, and logged at
/// most once per `REJECTION_LOG_EVERY` with how many went by unlogged.
struct Rejections {
    born: Instant,
    /// Milliseconds since `born` before which no line is logged.
    next_log_ms: AtomicU64,
    unlogged: AtomicU64,
}

impl Rejections {
    fn new() -> Rejections {
        Rejections { born: Instant::now(), next_log_ms: AtomicU64::new(0), unlogged: AtomicU64::new(0) }
    }

    fn note(&self, name: &str, why: Rejected) {
        metrics::counter!(telemetry::CACHE_REDIS_REJECTED, "reason" => why.reason()).increment(1);
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        let now = self.born.elapsed().as_millis() as u64;
        let next = self.next_log_ms.load(Ordering::Relaxed);
        let every = REJECTION_LOG_EVERY.as_millis() as u64;
        if now >= next
            && self
                .next_log_ms
                .compare_exchange(next, now + every, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let count = self.unlogged.swap(0, Ordering::Relaxed);
            tracing::warn!(
                "cache: Redis value under {name} not served ({}: {}); the model ran instead. {count} value(s) \
                 rejected since the last such line (at most one every {} s; all counted in \
                 edgeinfer_cache_redis_rejected_total)",
                why.reason(),
                why.describe(),
                REJECTION_LOG_EVERY.as_secs()
            );
        }
    }
}

/// The connection, renewed whole when the layer starts a rest: the
/// connection manager reconnects by itself only after an I/O error, not
/// after a refused AUTH (a password fixed later) or a hung socket.
struct Link {
    client: redis::Client,
    config: ConnectionManagerConfig,
    current: RwLock<ConnectionManager>,
}

impl Link {
    fn connection(&self) -> ConnectionManager {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn renew(&self) {
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh,
            Err(e) => tracing::warn!("cache: Redis connection not renewed: {e}"),
        }
    }
}

struct Store {
    key: String,
    value: Vec<u8>,
    ttl_s: u64,
}

pub struct Redis {
    link: Arc<Link>,
    site_key: SiteKey,
    rejections: Rejections,
    prefix: String,
    ttl: Option<Duration>,
    timeout: Duration,
    health: Arc<Health>,
    stores: mpsc::Sender<Store>,
}

impl Redis {
    /// Connects lazily: a Redis down at start is a layer that is down, not
    /// a node that cannot start. Needs a tokio runtime.
    pub fn open(options: RedisOptions) -> Result<Redis, RedisError> {
        let site_key = read_site_key(options.key_file.as_deref())?;
        let url_error =
            |e: redis::RedisError| RedisError::Url { url: options.url.clone(), reason: e.to_string() };
        let info =
            redis::IntoConnectionInfo::into_connection_info(options.url.as_str()).map_err(url_error)?;
        let info = match &options.password_file {
            Some(path) => {
                let password = std::fs::read_to_string(path).map_err(|e| RedisError::Password {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?;
                let settings = info.redis_settings().clone().set_password(password.trim_end());
                info.set_redis_settings(settings)
            }
            None => info,
        };
        // No Nagle: a lookup is one small write that waits for its answer.
        // Keepalive: a Redis host that vanishes is noticed by the writer too.
        // User timeout: data unacknowledged for 5 s (a host gone mid-lookup)
        // ends the connection.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(10));
        let tcp = TcpSettings::default()
            .set_nodelay(true)
            .set_keepalive(keepalive)
            .set_user_timeout(Duration::from_secs(5));
        let info = info.set_tcp_settings(tcp);
        let client = match &options.ca_file {
            Some(path) => {
                let ca_error = |reason: String| RedisError::Ca { path: path.display().to_string(), reason };
                let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
                // An empty root store would fail every handshake far from here.
                let certificates = CertificateDer::pem_slice_iter(&pem).filter(Result::is_ok).count();
                if certificates == 0 {
                    return Err(ca_error("no PEM certificate in it".into()));
                }
                let certificates = redis::TlsCertificates { client_tls: None, root_cert: Some(pem) };
                redis::Client::build_with_tls(info, certificates)
                    .map_err(|e| RedisError::Ca { path: path.display().to_string(), reason: e.to_string() })?
            }
            None => redis::Client::open(info).map_err(url_error)?,
        };
        // One try per command: a lookup has milliseconds, and the manager
        // reconnects in the background after a failure anyway.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.timeout.max(Duration::from_millis(200))))
            .set_response_timeout(Some(options.timeout.max(Duration::from_millis(200))))
            .set_number_of_retries(0)
            .set_min_delay(Duration::from_millis(100))
            .set_max_delay(Duration::from_secs(5));
        let connection =
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone()).map_err(url_error)?;
        let link = Arc::new(Link { client, config, current: RwLock::new(connection) });
        let health = Arc::new(Health::new(options.timeout));
        metrics::gauge!(telemetry::CACHE_REDIS_UP).set(0.0);
        let (stores, queued) = mpsc::channel(QUEUE);
        tokio::spawn(write(link.clone(), health.clone(), queued));
        let redis = Redis {
            link,
            site_key,
            rejections: Rejections::new(),
            prefix: options.key_prefix,
            ttl: options.ttl,
            timeout: options.timeout,
            health,
            stores,
        };
        // Connect now, so the status says at once whether the layer is up.
        let mut probe = redis.link.connection();
        let health = redis.health.clone();
        tokio::spawn(async move {
            match redis::cmd("PING").query_async::<String>(&mut probe).await {
                Ok(_) => health.answered(),
                Err(e) => {
                    health.lookup_failed("error", e.to_string());
                }
            }
        });
        Ok(redis)
    }

    fn key(&self, model: &str, key: &Key) -> String {
        format!("{}:{FORMAT}:{model}:{}", self.prefix, key.hex())
    }

    /// The answer under `key`, if Redis answers in time with a value
    /// signed with the site key for this very key.
    pub async fn get(&self, model: &str, key: &Key) -> Option<SharedAnswer> {
        if !self.health.may_look_up() {
            return None;
        }
        let mut connection = self.link.connection();
        let name = self.key(model, key);
        // GETRANGE, not GET: Redis sends at most one byte more than the
        // cap, so refusing a planted giant value costs what a hit costs.
        let mut read = redis::cmd("GETRANGE");
        read.arg(&name).arg(0).arg(MAX_VALUE_BYTES);
        let got = tokio::time::timeout(self.timeout, read.query_async::<Vec<u8>>(&mut connection)).await;
        let failed = |reason, error| {
            if self.health.lookup_failed(reason, error) {
                self.link.renew();
            }
        };
        match got {
            Ok(Ok(value)) => {
                self.health.answered();
                // No key reads as an empty string: a plain miss.
                if value.is_empty() {
                    return None;
                }
                signed::open(&self.site_key, &name, &value)
                    .map_err(|why| self.rejections.note(&name, why))
                    .ok()
            }
            // Something else under our key (a list, a hash): Redis answered,
            // so the layer is up; the value is simply not ours.
            Ok(Err(e)) if e.code() == Some("WRONGTYPE") => {
                self.health.answered();
                self.rejections.note(&name, Rejected::Unsigned);
                None
            }
            Ok(Err(e)) => {
                failed("error", e.to_string());
                None
            }
            Err(_) => {
                failed("timeout", format!("no answer within {} ms", self.timeout.as_millis()));
                None
            }
        }
    }

    /// Queues an answer for Redis; never waits.
    pub fn put(&self, model: &str, key: &Key, stored_at_ms: u64, expires_at_ms: u64, body: &[u8]) {
        let ttl_s = match self.ttl {
            Some(ttl) => ttl.as_secs(),
            None => expires_at_ms.saturating_sub(stored_at_ms).div_ceil(1000),
        }
        .max(1);
        let name = self.key(model, key);
        let answer = SharedAnswer { stored_at_ms, expires_at_ms, body: body.to_vec() };
        let Some(value) = signed::seal(&self.site_key, &name, &answer) else {
            // No node would read it: the answer stays on this node.
            metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => "oversized").increment(1);
            return;
        };
        let store = Store { key: name, value, ttl_s };
        if self.stores.try_send(store).is_err() {
            metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => "busy").increment(1);
        }
    }

    /// Deletes this node's prefix's keys, of one model or all; how many went.
    pub async fn purge(&self, model: Option<&str>) -> Result<u64, String> {
        let pattern = match model {
            Some(m) => format!("{}:{FORMAT}:{m}:*", self.prefix),
            None => format!("{}:{FORMAT}:*", self.prefix),
        };
        let mut connection = self.link.connection();
        let (mut cursor, mut removed) = (0u64, 0u64);
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(500)
                .query_async(&mut connection)
                .await
                .map_err(|e| e.to_string())?;
            if !keys.is_empty() {
                removed += connection.unlink::<_, u64>(&keys).await.map_err(|e| e.to_string())?;
            }
            if next == 0 {
                return Ok(removed);
            }
            cursor = next;
        }
    }

    pub fn health(&self) -> RedisState {
        self.health.state()
    }
}

/// The site key in `path`, hex (see `SiteKey::from_hex`). The reasons
/// never quote the file's contents.
fn read_site_key(path: Option<&std::path::Path>) -> Result<SiteKey, RedisError> {
    let path = path.ok_or(RedisError::NoKey)?;
    let bad = |reason: String| RedisError::Key { path: path.display().to_string(), reason };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    // Raw random bytes (`head -c 32 /dev/urandom` without `xxd -p`) are
    // rarely UTF-8: name the layout wanted, not the encoding.
    let text = String::from_utf8(bytes).map_err(|_| bad(signed::BadKey::NotHex.to_string()))?;
    SiteKey::from_hex(&text).map_err(|e| bad(e.to_string()))
}

/// The writer task: each queued answer with its expiry, while Redis takes
/// them; while it rests, what comes is dropped (the answer is local anyway).
async fn write(link: Arc<Link>, health: Arc<Health>, mut queued: mpsc::Receiver<Store>) {
    while let Some(Store { key, value, ttl_s }) = queued.recv().await {
        if health.resting() {
            metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => "skipped").increment(1);
            continue;
        }
        match link.connection().set_ex::<_, _, ()>(&key, value, ttl_s).await {
            Ok(()) => health.wrote(),
            Err(e) => health.write_failed(e),
        }
    }
}
