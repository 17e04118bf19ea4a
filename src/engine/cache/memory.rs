//! The memory layer: hot answers, bounded by bytes (quick_cache's CLOCK-Pro
//! eviction), with single flight for identical concurrent misses.

use super::key::Key;
use crate::telemetry;
use quick_cache::sync::{Cache, PlaceholderGuard};
use quick_cache::{DefaultHashBuilder, Lifecycle, Weighter};
use std::sync::Arc;

/// What an entry costs beside its body: the `Arc<Entry>` block, the model
/// name's `Arc<str>`, quick_cache's slot, index and spare room for the key,
/// and the size-class rounding of the body's block. Measured with counted
/// allocations (the test below): a `digits` reply of 65 bytes took 308.
const ENTRY_OVERHEAD: u64 = 256;

/// A cached answer, shared by the layers and every request it serves.
#[derive(Debug)]
pub struct Entry {
    /// The model the request named (a purge by model removes its entries;
    /// a cloud answer's `model_name` is the cloud's model).
    pub(super) model: Arc<str>,
    /// The reply with an empty `id`, postcard-encoded (`WireResponse`) as
    /// the disk layer keeps it. Kept encoded because a decoded reply is a
    /// dozen small blocks, 3-4 times its encoded size: the bound held 4
    /// times its bytes under load when entries were decoded. A hit decodes
    /// it, which costs what cloning a decoded one did.
    pub(super) body: Box<[u8]>,
    pub(super) expires_at_ms: u64,
}

impl Entry {
    fn live_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }

    /// Bytes it stands for in the memory bound.
    fn weight(&self) -> u64 {
        self.body.len() as u64 + ENTRY_OVERHEAD
    }
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<Key, Arc<Entry>> for ByBytes {
    fn weight(&self, _: &Key, entry: &Arc<Entry>) -> u64 {
        entry.weight()
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
    use crate::protocol::postcard::WireResponse;
    use crate::protocol::{Datatype, InferResponse, OutputTensor, TensorData};
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    /// The lib's unit tests allocate through this: the system allocator,
    /// counting the bytes each thread holds, rounded up to size classes
    /// four to a doubling as mimalloc's are, so a test can weigh what a
    /// structure really takes.
    struct Counting;

    thread_local! {
        static HELD: Cell<i64> = const { Cell::new(0) };
    }

    fn class(size: usize) -> i64 {
        let size = size.max(8);
        let step = (size.next_power_of_two() / 8).max(8);
        size.div_ceil(step) as i64 * step as i64
    }

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let _ = HELD.try_with(|h| h.set(h.get() + class(layout.size())));
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            let _ = HELD.try_with(|h| h.set(h.get() - class(layout.size())));
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    fn held_here() -> i64 {
        HELD.with(|h| h.get())
    }

    fn entry(expires_at_ms: u64) -> Arc<Entry> {
        Arc::new(Entry { model: "m".into(), body: Box::new([]), expires_at_ms })
    }

    /// A reply of the shipped `digits` model as the cache keeps it.
    fn digits_body(i: u32) -> Box<[u8]> {
        let response = InferResponse {
            id: String::new(),
            model_name: "digits".into(),
            model_version: "1".into(),
            outputs: vec![OutputTensor {
                name: "probabilities".into(),
                shape: vec![1, 10],
                datatype: Datatype::Fp32,
                data: TensorData::F32((0..10).map(|j| (i + j) as f32 / 100.0).collect()),
            }],
            parameters: Default::default(),
        };
        postcard::to_stdvec(&WireResponse::from(response)).unwrap().into()
    }

    #[test]
    fn the_bound_covers_what_the_entries_really_take() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let capacity = 1 << 20;
        let before = held_here();
        let memory = Memory::new(capacity);
        rt.block_on(async {
            for i in 0..20_000u32 {
                let mut key = Key([0; 32]);
                key.0[..4].copy_from_slice(&i.to_le_bytes());
                let Found::Lead(flight) = memory.find(&key, 0).await else { panic!("a new key leads") };
                flight.fill(Arc::new(Entry {
                    model: "digits".into(),
                    body: digits_body(i),
                    expires_at_ms: 1,
                }));
            }
        });
        let held = (held_here() - before) as u64;
        assert!(memory.bytes() <= capacity && memory.bytes() > capacity * 9 / 10, "{}", memory.bytes());
        assert!(
            held <= capacity * 11 / 10,
            "{} entries hold {held} bytes against a bound of {capacity}",
            memory.entries()
        );
        drop(memory);
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
