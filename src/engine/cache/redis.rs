//! The shared layer: a Redis the nodes of a site share, below memory and
//! disk (`[cache.redis]`, off by default).
//!
//! A lookup waits at most `cache.redis.timeout_ms`, then counts a miss and
//! the model runs: a slow or dead Redis costs misses, never a stall. After
//! `TRIPS` failed lookups in a row the layer stands aside for `REST`
//! (lookups are misses at once), then one lookup tries again and one more
//! failure rests it again; the connection manager reconnects on its own,
//! with backoff. Only lookups decide whether the layer is up: a Redis that
//! refuses writes (full, under `noeviction`) still serves what it holds.
//! Stores go to a writer task over a bounded channel, off the request path;
//! every key gets an expiry. Values are the disk layer's checksummed
//! records under a key that carries a format version, so a torn or foreign
//! value is a miss, counted, never served.

use super::key::Key;
use super::record::Record;
use crate::telemetry::{self, RedisState};
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::{TcpSettings, socket2};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The key format: bump it when `Key` or `Record` change meaning.
const FORMAT: &str = "v1";
/// Failed lookups in a row after which the layer stands aside, and for how long.
const TRIPS: u32 = 3;
const REST: Duration = Duration::from_secs(1);
/// Stores waiting for the writer; beyond it they are dropped and counted.
const QUEUE: usize = 1024;

#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub url: String,
    pub password_file: Option<std::path::PathBuf>,
    /// PEM roots for `rediss://`; `None`: the system's.
    pub ca_file: Option<std::path::PathBuf>,
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
}

/// Whether the layer answers lookups, shared by the lookups (which
/// decide it), the writer and the status.
struct Health {
    up: AtomicBool,
    /// Failed lookups since the last answer; at `TRIPS` and beyond each
    /// failure rests the layer.
    failures: AtomicU32,
    /// Lookups are misses at once until then: milliseconds since `born`
    /// (monotonic, so a clock step cannot stretch or skip a rest).
    resting_until_ms: AtomicU64,
    born: Instant,
    /// Why lookups fail, while they do.
    lookup_error: Mutex<Option<String>>,
    /// Why Redis refuses writes while it answers lookups (a full Redis).
    write_error: Mutex<Option<String>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Health {
    fn new() -> Health {
        Health {
            up: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            resting_until_ms: AtomicU64::new(0),
            born: Instant::now(),
            lookup_error: Mutex::new(Some("not connected yet".into())),
            write_error: Mutex::new(None),
        }
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn answered(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if !self.up.swap(true, Ordering::Relaxed) {
            tracing::info!("cache: Redis layer up");
            *locked(&self.lookup_error) = None;
        }
        // Set every time: a failure racing this one cannot leave it at 0.
        metrics::gauge!(telemetry::CACHE_REDIS_UP).set(1.0);
    }

    fn lookup_failed(&self, reason: &'static str, error: String) {
        metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => reason).increment(1);
        if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= TRIPS {
            self.resting_until_ms.store(self.now_ms() + REST.as_millis() as u64, Ordering::Relaxed);
        }
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!("cache: Redis layer down ({error}); lookups are misses until it answers");
        }
        metrics::gauge!(telemetry::CACHE_REDIS_UP).set(0.0);
        *locked(&self.lookup_error) = Some(error);
    }

    fn wrote(&self) {
        if locked(&self.write_error).take().is_some() {
            tracing::info!("cache: Redis takes answers again");
        }
    }

    /// A refused or failed write: counted, and logged when it starts; the
    /// lookups alone say whether the layer is up.
    fn write_failed(&self, error: redis::RedisError) {
        let reason = if error.code() == Some("OOM") { "full" } else { "error" };
        metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => reason).increment(1);
        let mut last = locked(&self.write_error);
        if last.is_none() {
            tracing::warn!("cache: Redis refuses answers ({error}); they stay on this node");
        }
        *last = Some(format!("writes refused: {error}"));
    }

    fn resting(&self) -> bool {
        self.now_ms() < self.resting_until_ms.load(Ordering::Relaxed)
    }

    fn state(&self) -> RedisState {
        let up = self.up.load(Ordering::Relaxed);
        let error = if up { locked(&self.write_error).clone() } else { locked(&self.lookup_error).clone() };
        RedisState { up, error }
    }
}

struct Store {
    key: String,
    value: Vec<u8>,
    ttl_s: u64,
}

pub struct Redis {
    connection: ConnectionManager,
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
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(10));
        let info = info.set_tcp_settings(TcpSettings::default().set_nodelay(true).set_keepalive(keepalive));
        let client = match &options.ca_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| RedisError::Ca {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?;
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
        let connection = ConnectionManager::new_lazy_with_config(client, config).map_err(url_error)?;
        let health = Arc::new(Health::new());
        metrics::gauge!(telemetry::CACHE_REDIS_UP).set(0.0);
        let (stores, queued) = mpsc::channel(QUEUE);
        tokio::spawn(write(connection.clone(), health.clone(), queued));
        let redis = Redis {
            connection,
            prefix: options.key_prefix,
            ttl: options.ttl,
            timeout: options.timeout,
            health,
            stores,
        };
        // Connect now, so the status says at once whether the layer is up.
        let mut probe = redis.connection.clone();
        let health = redis.health.clone();
        tokio::spawn(async move {
            match redis::cmd("PING").query_async::<String>(&mut probe).await {
                Ok(_) => health.answered(),
                Err(e) => health.lookup_failed("error", e.to_string()),
            }
        });
        Ok(redis)
    }

    fn key(&self, model: &str, key: &Key) -> String {
        format!("{}:{FORMAT}:{model}:{}", self.prefix, key.hex())
    }

    /// The record under `key`, if Redis answers in time with one whose
    /// checksum holds.
    pub async fn get(&self, model: &str, key: &Key) -> Option<Record> {
        if self.health.resting() {
            return None;
        }
        let mut connection = self.connection.clone();
        let name = self.key(model, key);
        let got = tokio::time::timeout(self.timeout, connection.get::<_, Option<Vec<u8>>>(&name)).await;
        match got {
            Ok(Ok(value)) => {
                self.health.answered();
                let bytes = value?;
                let record = Record::decode(key, &bytes);
                if record.is_none() {
                    metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => "corrupt").increment(1);
                }
                record
            }
            Ok(Err(e)) => {
                self.health.lookup_failed("error", e.to_string());
                None
            }
            Err(_) => {
                self.health
                    .lookup_failed("timeout", format!("no answer within {} ms", self.timeout.as_millis()));
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
        let record = Record::seal(key, 0, stored_at_ms, expires_at_ms, body.to_vec());
        let value = postcard::to_stdvec(&record).expect("a record always encodes");
        let store = Store { key: self.key(model, key), value, ttl_s };
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
        let mut connection = self.connection.clone();
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

/// The writer task: each queued answer with its expiry, while Redis takes
/// them; while it rests, what comes is dropped (the answer is local anyway).
async fn write(mut connection: ConnectionManager, health: Arc<Health>, mut queued: mpsc::Receiver<Store>) {
    while let Some(Store { key, value, ttl_s }) = queued.recv().await {
        if health.resting() {
            metrics::counter!(telemetry::CACHE_REDIS_ERRORS, "reason" => "skipped").increment(1);
            continue;
        }
        match connection.set_ex::<_, _, ()>(&key, value, ttl_s).await {
            Ok(()) => health.wrote(),
            Err(e) => health.write_failed(e),
        }
    }
}
