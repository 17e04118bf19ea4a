//! Stage between preprocess and batch: answers already known.
//!
//! A memory layer (hot entries, bounded by bytes) over a disk layer (a value
//! log indexed by sled in `node.state_dir/cache`, bounded by bytes,
//! surviving restarts). A disk hit
//! is promoted to memory. Identical concurrent misses run the model once.
//! Only successful answers are stored, and only for models with a TTL.

mod disk;
mod key;
mod memory;
mod redis;
mod signed;

pub use disk::{CheckReport, DiskError, DiskStats};
pub use key::Key;
pub use redis::{RedisError, RedisOptions};

use crate::config::Config;
use crate::model::LoadedModel;
use crate::protocol::postcard::WireResponse;
use crate::protocol::{CacheStatus, InferRequest, InferResponse, TensorData, Tier};
use crate::telemetry::{self, CacheHealth, RedisState};
use memory::{Entry, Flight, Found, Memory};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A cache layer's span in the request's trace, with what it found.
fn layer_span(name: &'static str, asked: Instant, result: &'static str) {
    crate::trace::span(name, asked, || vec![opentelemetry::KeyValue::new("edgeinfer.cache.result", result)]);
}

#[derive(Debug, Clone)]
pub struct CacheOptions {
    pub enabled: bool,
    pub memory_bytes: u64,
    /// 0: no disk layer.
    pub disk_bytes: u64,
    /// The store's directory.
    pub dir: PathBuf,
    pub sweep_interval: Duration,
    pub disk_read_timeout: Duration,
    pub disk_page_cache_bytes: u64,
    /// The shared layer, when `cache.redis.enabled`.
    pub redis: Option<RedisOptions>,
}

impl CacheOptions {
    pub fn from_config(config: &Config) -> CacheOptions {
        let c = &config.cache;
        CacheOptions {
            enabled: c.enabled,
            memory_bytes: c.memory_bytes,
            disk_bytes: c.disk_bytes,
            dir: config.node.state_dir.join("cache"),
            sweep_interval: Duration::from_secs(c.sweep_interval_s.max(1)),
            disk_read_timeout: Duration::from_millis(c.disk_read_timeout_ms),
            disk_page_cache_bytes: c.disk_page_cache_bytes,
            redis: c.redis.enabled.then(|| RedisOptions {
                url: c.redis.url.clone(),
                ca_file: c.redis.ca_file.clone(),
                password_file: c.redis.password_file.clone(),
                key_file: c.redis.key_file.clone(),
                key_prefix: c.redis.key_prefix.clone(),
                ttl: c.redis.ttl_s.map(Duration::from_secs),
                timeout: Duration::from_millis(c.redis.timeout_ms),
            }),
        }
    }

    /// No cache at all (one-shot commands, tests of the bare pipeline).
    pub fn off() -> CacheOptions {
        CacheOptions {
            enabled: false,
            memory_bytes: 0,
            disk_bytes: 0,
            dir: PathBuf::new(),
            sweep_interval: Duration::from_secs(60),
            disk_read_timeout: Duration::ZERO,
            disk_page_cache_bytes: 0,
            redis: None,
        }
    }
}

/// What a lookup found.
pub enum Lookup<'a> {
    /// A reply to send as is, after setting its `id`.
    Hit(InferResponse),
    /// Run the model, then `store` the answer through the ticket.
    Miss(Ticket<'a>),
    /// Not cached: the request said `parameters.cache = false`, or the
    /// model has no TTL.
    Bypass,
}

/// The right (and duty) to compute one key's answer; identical requests wait
/// for it. Dropping it unfilled (an error) lets the next waiter compute.
pub struct Ticket<'a> {
    key: Key,
    model: String,
    ttl: Duration,
    flight: Flight<'a>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheStats {
    pub enabled: bool,
    pub memory_entries: u64,
    pub memory_bytes: u64,
    pub memory_capacity_bytes: u64,
    pub disk: Option<DiskStats>,
    #[serde(default)]
    pub redis: Option<RedisState>,
}

pub struct Cache {
    options: CacheOptions,
    memory: Memory,
    disk: Option<disk::Disk>,
    /// Why there is no disk layer, when one was asked for.
    disk_error: Option<DiskError>,
    redis: Option<redis::Redis>,
    /// Why there is no Redis layer, when one was asked for.
    redis_error: Option<RedisError>,
}

impl Cache {
    /// Opens the layers `options` ask for. A disk layer that cannot be had
    /// is logged and left out; the node serves without it.
    pub fn open(options: CacheOptions) -> Cache {
        let memory = Memory::new(if options.enabled { options.memory_bytes } else { 0 });
        let (mut disk, mut disk_error) = (None, None);
        if options.enabled && options.disk_bytes > 0 {
            let dir = &options.dir;
            let opened = std::fs::create_dir_all(dir.parent().unwrap_or(dir))
                .map_err(|e| DiskError::Create { path: dir.clone(), reason: e.to_string() })
                .and_then(|()| {
                    disk::Disk::open(
                        dir,
                        disk::DiskOptions {
                            capacity: options.disk_bytes,
                            page_cache_bytes: options.disk_page_cache_bytes,
                            read_timeout: options.disk_read_timeout,
                            sweep: options.sweep_interval,
                        },
                    )
                });
            match opened {
                Ok(d) => disk = Some(d),
                Err(e) => {
                    tracing::error!("disk cache off: {e}; serving from memory and the model");
                    metrics::gauge!(telemetry::CACHE_DISK_ENABLED).set(0.0);
                    disk_error = Some(e);
                }
            }
        }
        let (mut redis, mut redis_error) = (None, None);
        if let Some(redis_options) = options.redis.clone().filter(|_| options.enabled) {
            match redis::Redis::open(redis_options) {
                Ok(r) => redis = Some(r),
                Err(e) => {
                    tracing::error!("Redis cache layer off: {e}");
                    redis_error = Some(e);
                }
            }
        }
        Cache { options, memory, disk, disk_error, redis, redis_error }
    }

    pub fn off() -> Cache {
        Cache::open(CacheOptions::off())
    }

    /// Reads every segment and index entry of the disk store `options`
    /// name (no node may hold it); `repair` rebuilds the index from the
    /// segments first (`edgeinfer cache check`).
    pub fn check_store(options: &CacheOptions, repair: bool) -> Result<CheckReport, DiskError> {
        disk::check(&options.dir, options.disk_bytes.max(1), options.disk_page_cache_bytes, repair)
    }

    /// Why the disk layer asked for could not be opened.
    pub fn disk_error(&self) -> Option<&DiskError> {
        self.disk_error.as_ref()
    }

    /// Stage 4a: the answer to `req` if it is known. Waits while an
    /// identical request computes it. `tier`: where the node has a cloud
    /// tier, each tier caches its own answers; `ttl`: how long this model's
    /// answers are kept (zero: not cached); `config`: the config version
    /// serving it, whose answers are its own (a threshold, a scale or a
    /// `top_k` changes them).
    pub async fn check(
        &self,
        model: &LoadedModel,
        req: &InferRequest,
        input: &TensorData,
        (tier, ttl, config): (Option<Tier>, Duration, &str),
    ) -> Lookup<'_> {
        if req.parameters.cache == Some(false) || !self.options.enabled || ttl.is_zero() {
            return Lookup::Bypass;
        }
        let key = Key::new(model, req, input).for_config(config);
        let key = match tier {
            Some(tier) => key.for_tier(tier),
            None => key,
        };
        let started = Instant::now();
        // The layers' spans nest under the lookup's.
        let traced = crate::trace::open("cache.lookup");
        let found = self.lookup(model.name(), key, ttl).await;
        drop(traced);
        telemetry::observe_stage(
            model.name(),
            telemetry::Stage::CacheLookup,
            started.elapsed().as_secs_f64(),
        );
        found
    }

    /// Memory, then disk, by key; on a miss, the ticket to compute the answer.
    pub async fn lookup(&self, model: &str, key: Key, ttl: Duration) -> Lookup<'_> {
        let now = telemetry::unix_now_ms();
        let asked = Instant::now();
        let found = self.memory.find(&key, now).await;
        let result = match found {
            Found::Hit(_) => "hit",
            Found::Joined(_) => "coalesced",
            Found::Lead(_) => "miss",
        };
        layer_span("cache.memory", asked, result);
        let flight = match found {
            Found::Hit(entry) => return from_memory(model, &entry, "memory"),
            Found::Joined(entry) => return from_memory(model, &entry, "coalesced"),
            Found::Lead(flight) => flight,
        };
        let disk_read = match &self.disk {
            Some(disk) => {
                let asked = Instant::now();
                let read = disk.get(model, &key, now).await;
                layer_span(
                    "cache.disk",
                    asked,
                    if matches!(read, disk::Read::Hit { .. }) { "hit" } else { "miss" },
                );
                Some(read)
            }
            None => None,
        };
        if let Some(disk::Read::Hit { body, expires_at_ms }) = disk_read
            && let Ok(wire) = postcard::from_bytes::<WireResponse>(&body)
        {
            flight.fill(Arc::new(Entry { model: model.into(), body: body.into(), expires_at_ms }));
            self.publish_memory();
            return answer(model, wire, CacheStatus::Disk, "disk");
        }
        let shared = match &self.redis {
            Some(redis) => {
                let asked = Instant::now();
                let shared = redis.get(model, &key).await;
                layer_span("cache.redis", asked, if shared.is_some() { "hit" } else { "miss" });
                shared
            }
            None => None,
        };
        if let Some(shared) = shared
            && shared.expires_at_ms > now
            && let Ok(wire) = postcard::from_bytes::<WireResponse>(&shared.body)
        {
            // Promoted: the next lookup here is a local hit.
            let expires_at_ms = shared.expires_at_ms;
            flight.fill(Arc::new(Entry {
                model: model.into(),
                body: shared.body.as_slice().into(),
                expires_at_ms,
            }));
            self.publish_memory();
            if let Some(disk) = &self.disk {
                disk.put(model, key, shared.stored_at_ms, expires_at_ms, shared.body);
            }
            return answer(model, wire, CacheStatus::Redis, "redis");
        }
        count(model, "miss");
        Lookup::Miss(Ticket { key, model: model.to_string(), ttl, flight })
    }

    /// The store stage: keeps an answer that ends its request, in memory
    /// now (waking identical requests) and on disk through the writer. Not
    /// a degraded one (the cloud may be back next time), not a provisional
    /// one (`final: false`). An unused ticket lets the next waiter compute.
    pub fn store(&self, ticket: Option<Ticket<'_>>, response: &InferResponse) {
        let Some(ticket) = ticket else { return };
        if response.parameters.degraded || response.parameters.is_final == Some(false) {
            return;
        }
        let mut response = response.clone();
        response.id.clear();
        response.parameters.cache = CacheStatus::Miss;
        let body = postcard::to_stdvec(&WireResponse::from(response)).expect("a reply always encodes");
        let stored_at_ms = telemetry::unix_now_ms();
        let expires_at_ms = stored_at_ms.saturating_add(ticket.ttl.as_millis() as u64);
        ticket.flight.fill(Arc::new(Entry {
            model: ticket.model.as_str().into(),
            body: body.as_slice().into(),
            expires_at_ms,
        }));
        self.publish_memory();
        if let Some(redis) = &self.redis {
            redis.put(&ticket.model, &ticket.key, stored_at_ms, expires_at_ms, &body);
        }
        if let Some(disk) = &self.disk {
            disk.put(&ticket.model, ticket.key, stored_at_ms, expires_at_ms, body);
        }
    }

    /// Removes every answer (of one model, or all) from both layers;
    /// answers how many disk entries went.
    pub async fn purge(&self, model: Option<&str>) -> Result<u64, DiskError> {
        match model {
            Some(m) => self.memory.retain(|e| &*e.model != m),
            None => self.memory.clear(),
        }
        self.publish_memory();
        // This node's prefix in the shared layer too; a Redis that does not
        // answer leaves its keys to their expiry.
        let shared = match &self.redis {
            Some(redis) => redis.purge(model).await.unwrap_or_else(|e| {
                tracing::warn!("cache purge: Redis keys left to their expiry: {e}");
                0
            }),
            None => 0,
        };
        let local = match &self.disk {
            Some(disk) if disk.enabled() => disk.purge(model).await?,
            _ => 0,
        };
        Ok(local + shared)
    }

    /// Waits until every answer queued for disk is written.
    pub async fn flush(&self) {
        if let Some(disk) = &self.disk {
            disk.flush().await;
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            enabled: self.options.enabled,
            memory_entries: self.memory.entries() as u64,
            memory_bytes: self.memory.bytes(),
            memory_capacity_bytes: if self.options.enabled { self.memory.capacity() } else { 0 },
            disk: self.disk.as_ref().map(|d| d.stats()),
            redis: self.redis_state(),
        }
    }

    pub fn health(&self) -> CacheHealth {
        let disk = self.disk.as_ref().map(|d| d.stats());
        CacheHealth {
            enabled: self.options.enabled,
            memory_entries: self.memory.entries() as u64,
            disk_enabled: disk.as_ref().is_some_and(|d| d.enabled),
            disk_entries: disk.as_ref().map(|d| d.entries).unwrap_or(0),
            problem: disk.and_then(|d| d.reason).or_else(|| self.disk_error.as_ref().map(DiskError::reason)),
            redis: self.redis_state(),
        }
    }

    /// The Redis layer's state, when one was asked for.
    fn redis_state(&self) -> Option<RedisState> {
        match (&self.redis, &self.redis_error) {
            (Some(redis), _) => Some(redis.health()),
            (None, Some(e)) => Some(RedisState { up: false, error: Some(e.to_string()) }),
            (None, None) => None,
        }
    }

    fn publish_memory(&self) {
        metrics::gauge!(telemetry::CACHE_ENTRIES, "layer" => "memory").set(self.memory.entries() as f64);
        metrics::gauge!(telemetry::CACHE_BYTES, "layer" => "memory").set(self.memory.bytes() as f64);
    }
}

/// A memory entry as the answer to send. Its body was encoded by this
/// process (or decoded once from disk), so it decodes; were it ever not to,
/// the request runs uncached rather than fail.
fn from_memory(model: &str, entry: &Entry, result: &'static str) -> Lookup<'static> {
    match postcard::from_bytes::<WireResponse>(&entry.body) {
        Ok(wire) => answer(model, wire, CacheStatus::Memory, result),
        Err(_) => {
            count(model, "miss");
            Lookup::Bypass
        }
    }
}

fn answer(model: &str, wire: WireResponse, status: CacheStatus, result: &'static str) -> Lookup<'static> {
    count(model, result);
    let mut response = InferResponse::from(wire);
    response.parameters.cache = status;
    Lookup::Hit(response)
}

fn count(model: &str, result: &'static str) {
    metrics::counter!(telemetry::CACHE_LOOKUPS, "model" => model.to_string(), "result" => result)
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_purge_by_model_removes_the_cloud_answers_kept_for_it_too() {
        let cache = Cache::open(CacheOptions {
            enabled: true,
            memory_bytes: 1 << 20,
            disk_bytes: 0,
            dir: PathBuf::new(),
            sweep_interval: Duration::from_secs(60),
            disk_read_timeout: Duration::ZERO,
            disk_page_cache_bytes: 0,
            redis: None,
        });
        let ttl = Duration::from_secs(60);
        // An escalated `digits` request answered by the cloud's `digits-large`.
        let Lookup::Miss(ticket) = cache.lookup("digits", Key([7; 32]), ttl).await else { panic!() };
        let cloud: InferResponse =
            serde_json::from_str(r#"{"model_name": "digits-large", "outputs": []}"#).unwrap();
        cache.store(Some(ticket), &cloud);
        assert!(matches!(cache.lookup("digits", Key([7; 32]), ttl).await, Lookup::Hit(_)));
        cache.purge(Some("digits")).await.unwrap();
        assert!(matches!(cache.lookup("digits", Key([7; 32]), ttl).await, Lookup::Miss(_)), "purged");
    }
}
