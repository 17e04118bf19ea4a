//! The memory layer: hot answers, bounded by bytes (quick_cache's CLOCK-Pro
//! eviction), with single flight for identical concurrent misses.

use super::key::Key;
use crate::protocol::InferResponse;
use crate::telemetry;
use quick_cache::sync::{Cache, PlaceholderGuard};
use quick_cache::{DefaultHashBuilder, Lifecycle, Weighter};
use std::sync::Arc;

/// A cached answer, shared by the layers and every request it serves.
#[derive(Debug)]
pub struct Entry {
    /// The model the request named (a purge by model removes its entries;
    /// a cloud answer's `model_name` is the cloud's model).
    pub(super) model: Arc<str>,
    /// The reply with an empty `id`.
    pub(super) response: InferResponse,
    pub(super) expires_at_ms: u64,
    /// Bytes it stands for in the memory bound.
    pub(super) weight: u64,
}

impl Entry {
    fn live_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<Key, Arc<Entry>> for ByBytes {
    fn weight(&self, _: &Key, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

/// Counts evictions for `/metrics`.
#[derive(Clone, Default)]
struct CountEvictions;

impl Lifecycle<Key, Arc<Entry>> for CountEvictions {
    type RequestState = ();

    fn on_evict(&self, _: &mut (), _: Key, _: Arc<Entry>) {
        metrics::counter!(telemetry::CACHE_EVICTIONS, "layer" => "memory").increment(1);
    }
}

type Inner = Cache<Key, Arc<Entry>, ByBytes, DefaultHashBuilder, CountEvictions>;

/// Held by the one request that computes an answer others are waiting for;
/// dropping it without `fill` hands the work to the next waiter.
pub struct Flight<'a>(PlaceholderGuard<'a, Key, Arc<Entry>, ByBytes, DefaultHashBuilder, CountEvictions>);

impl Flight<'_> {
    pub fn fill(self, entry: Arc<Entry>) {
        let _ = self.0.insert(entry);
    }
}

pub enum Found<'a> {
    /// An answer computed earlier.
    Hit(Arc<Entry>),
    /// An answer another request computed while this one waited.
    Joined(Arc<Entry>),
    /// Nothing yet: this request computes it.
    Lead(Flight<'a>),
}

pub struct Memory {
    cache: Inner,
}

impl Memory {
    /// `bytes` of capacity; at 0 entries are never kept but single flight still works.
    pub fn new(bytes: u64) -> Memory {
        // A guess of the entry count only sizes the initial tables.
        let items = (bytes / 512).clamp(16, 1 << 20) as usize;
        Memory {
            cache: Cache::with(items, bytes.max(1), ByBytes, DefaultHashBuilder::default(), CountEvictions),
        }
    }

    /// The live answer under `key`, or the right to compute it. An expired
    /// entry is removed and treated as absent.
    pub async fn find(&self, key: &Key, now_ms: u64) -> Found<'_> {
        if let Some(entry) = self.cache.get(key)
            && entry.live_at(now_ms)
        {
            return Found::Hit(entry);
        }
        loop {
            self.cache.remove_if(key, |e| !e.live_at(now_ms));
            // Waits while another request leads the computation of this key.
            match self.cache.get_value_or_guard_async(key).await {
                Ok(entry) if entry.live_at(now_ms) => return Found::Joined(entry),
                Ok(_) => continue,
                Err(guard) => return Found::Lead(Flight(guard)),
            }
        }
    }

    pub fn clear(&self) {
        self.cache.clear();
    }

    /// Keeps only the entries `keep` selects.
    pub fn retain(&self, keep: impl Fn(&Arc<Entry>) -> bool) {
        self.cache.retain(|_, e| keep(e));
    }

    pub fn entries(&self) -> usize {
        self.cache.len()
    }

    pub fn bytes(&self) -> u64 {
        self.cache.weight()
    }

    pub fn capacity(&self) -> u64 {
        self.cache.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::InferResponse;

    fn entry(expires_at_ms: u64) -> Arc<Entry> {
        let response = InferResponse {
            id: String::new(),
            model_name: "m".into(),
            model_version: "1".into(),
            outputs: vec![],
            parameters: Default::default(),
        };
        Arc::new(Entry { model: "m".into(), response, expires_at_ms, weight: 100 })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_leader_computes_and_waiters_join_it_or_take_over_when_it_fails() {
        let memory = Arc::new(Memory::new(1 << 20));
        let key = Key([7; 32]);
        let Found::Lead(flight) = memory.find(&key, 0).await else { panic!("the first lookup leads") };
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let m = memory.clone();
                tokio::spawn(async move {
                    match m.find(&key, 0).await {
                        Found::Joined(_) => "joined",
                        Found::Hit(_) => "hit",
                        Found::Lead(f) => {
                            f.fill(entry(u64::MAX));
                            "led"
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // The leader fails: dropping its ticket hands the work to one waiter.
        drop(flight);
        let mut results = Vec::new();
        for w in waiters {
            results.push(w.await.unwrap());
        }
        results.sort();
        assert_eq!(results, ["joined", "joined", "joined", "led"]);
        assert!(matches!(memory.find(&key, 0).await, Found::Hit(_)));
    }

    #[tokio::test]
    async fn an_expired_entry_is_not_served() {
        let memory = Memory::new(1 << 20);
        let key = Key([1; 32]);
        let Found::Lead(flight) = memory.find(&key, 0).await else { panic!() };
        flight.fill(entry(100));
        assert!(matches!(memory.find(&key, 99).await, Found::Hit(_)));
        assert!(matches!(memory.find(&key, 100).await, Found::Lead(_)));
    }
}
