//! The disk layer's index: each segment's entries, written once, when the
//! segment is sealed, and a filter of its keys.
//!
//! A sealed segment's entries (20 bytes each: a model id, a 64-bit hash of
//! the key, the record's offset and length) are spread over about one
//! bucket per 32 entries, in the segment's own index file
//! (`segment_index.rs`): a lookup reads one bucket with one positioned
//! read, and nothing of the entries stays in the process. (In sled, a
//! value per bucket, they made sled's pages and their records grow with
//! the answers stored: issue 37's figures in docs/BENCHMARKS.md.)
//!
//! Which segment holds a key is told by its filter (a binary fuse filter
//! of the segment's hashes, about 9 bits an entry, 0.4% false positives),
//! kept at the end of its index file and in memory while the segment
//! lives: a lookup reads a bucket only of a segment whose filter has the
//! key. The record's full key is checked on every read.
//!
//! sled holds what is small and changes together: the figures of each
//! sealed segment, the model ids and the totals, in one tree so
//! that one batch (atomic within a tree) changes them together: after a
//! crash the figures are those of the segments that survived, never
//! recounted by a scan.

use super::segment_index::SegmentIndex;
use crate::engine::cache::key::Key;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use xorf::{BinaryFuse8, BinaryFuse8Ref, DmaSerializable, Filter as _, FilterRef as _};

/// Entries in the index (u64).
pub const ENTRIES: &[u8] = b"\0entries";
/// Segments below this id are gone (u64): an eviction interrupted before
/// its unlink finishes at the next open.
pub const MIN_LIVE: &[u8] = b"\0min_live";
/// The id the next new model name gets (u32).
pub const NEXT_MODEL: &[u8] = b"\0next_model";
/// This layout's version (u32): a tree without it was never written by it.
pub const FORMAT: &[u8] = b"\0format";
pub const FORMAT_VERSION: u32 = 5;
const MODEL: u8 = b'm';
const SEALED: u8 = b's';

/// Entries a bucket holds on average: a lookup reads one bucket.
const PER_BUCKET: u64 = 32;

/// Where a record lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub segment: u64,
    pub offset: u32,
    pub len: u32,
}

/// All 32 bytes of a key and its model's id folded and mixed
/// (splitmix64's finaliser), so that keys which differ anywhere differ
/// here: real keys are sha256 digests, but nothing should rely on it.
pub fn hash(model_id: u32, key: &Key) -> u64 {
    let word = |i: usize| u64::from_le_bytes(key.0[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let mut z = word(0) ^ word(1).rotate_left(17) ^ word(2).rotate_left(31) ^ word(3).rotate_left(47);
    z ^= (model_id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Buckets for a segment of `entries`.
pub fn buckets_for(entries: u64) -> u32 {
    entries.div_ceil(PER_BUCKET).clamp(1, u32::MAX as u64) as u32
}

/// The bucket a hash falls in (its high half, scaled: no division).
pub fn bucket_of(hash: u64, buckets: u32) -> u32 {
    (((hash >> 32) * buckets as u64) >> 32) as u32
}

/// The key of a sealed segment's figures (`Sealed`).
pub fn sealed_key(segment: u64) -> [u8; 9] {
    segment_scoped(SEALED, segment)
}

/// Every sealed segment's figures start with this.
pub fn all_sealed() -> [u8; 1] {
    [SEALED]
}

fn segment_scoped(tag: u8, segment: u64) -> [u8; 9] {
    let mut out = [tag; 9];
    out[1..].copy_from_slice(&segment.to_be_bytes());
    out
}

/// The segment a key of `all_sealed` names.
pub fn segment_of(key: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(key.get(1..9)?.try_into().ok()?))
}

/// A sealed segment's figures: written when its index file is, changed
/// when an entry is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sealed {
    /// The latest expiry of its records: past it, the segment goes whole.
    pub max_expires_at_ms: u64,
    pub entries: u64,
    pub buckets: u32,
}

impl Sealed {
    pub fn encode(&self) -> [u8; 20] {
        let mut out = [0u8; 20];
        out[..8].copy_from_slice(&self.max_expires_at_ms.to_be_bytes());
        out[8..16].copy_from_slice(&self.entries.to_be_bytes());
        out[16..].copy_from_slice(&self.buckets.to_be_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Sealed> {
        let bytes: &[u8; 20] = bytes.try_into().ok()?;
        Some(Sealed {
            max_expires_at_ms: u64::from_be_bytes(bytes[..8].try_into().ok()?),
            entries: u64::from_be_bytes(bytes[8..16].try_into().ok()?),
            buckets: u32::from_be_bytes(bytes[16..].try_into().ok()?).max(1),
        })
    }
}

/// A sealed segment's filter: the bytes as read (the descriptor, then
/// the fingerprints), checked once so that a lookup cannot index past it.
#[derive(Clone)]
pub struct SegmentFilter(sled::IVec);

const DESCRIPTOR_LEN: usize = <BinaryFuse8 as DmaSerializable>::DESCRIPTOR_LEN;

impl SegmentFilter {
    /// The filter of `hashes` (deduplicated here), as sled will hold it.
    pub fn build(mut hashes: Vec<u64>) -> Option<Vec<u8>> {
        hashes.sort_unstable();
        hashes.dedup();
        let filter = BinaryFuse8::try_from(&hashes).ok()?;
        let mut out = vec![0u8; DESCRIPTOR_LEN];
        filter.dma_copy_descriptor_to(&mut out);
        out.extend_from_slice(filter.dma_fingerprints());
        Some(out)
    }

    /// The filter in `bytes`, if they hold one whose lookups stay inside it.
    pub fn load(bytes: sled::IVec) -> Option<SegmentFilter> {
        let u32_at = |i: usize| Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?) as usize);
        // The descriptor: seed u64, segment length, its mask, segment count
        // times length (xorf's DMA layout); fingerprints fill the segments
        // and two more.
        let (length, mask, count_length) = (u32_at(8)?, u32_at(12)?, u32_at(16)?);
        let sound = length.is_power_of_two()
            && mask == length - 1
            && bytes.len() - DESCRIPTOR_LEN == count_length.checked_add(2 * length)?;
        sound.then_some(SegmentFilter(bytes))
    }

    pub fn contains(&self, hash: u64) -> bool {
        BinaryFuse8Ref::from_dma(&self.0[..DESCRIPTOR_LEN], &self.0[DESCRIPTOR_LEN..]).contains(&hash)
    }

    /// Bytes it holds in memory.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// The part of the index in memory, shared by the writer (its one
/// changer) and the reader: the active segment's entries, indexed as they
/// are written, and each sealed segment's filter and open index file.
#[derive(Default)]
pub struct Catalog {
    /// Each model name's id, as the index has them.
    pub models: HashMap<String, u32>,
    pub active_id: u64,
    pub active: HashMap<(u32, u64), Location>,
    pub sealed: BTreeMap<u64, SealedView>,
}

/// What a lookup needs of a sealed segment. No filter (one that could not
/// be built or read): every lookup reads the segment's bucket. No index
/// file: the segment has no entries.
#[derive(Clone)]
pub struct SealedView {
    pub filter: Option<SegmentFilter>,
    pub index: Option<Arc<SegmentIndex>>,
}

/// Whether the index certainly lacks `key` of `model` (no entry in the
/// active segment, no sealed segment's filter has it), so that a miss is
/// answered on the asking thread without the reader's round trip: in a
/// stream of new inputs nearly every lookup is one. Never waits: with the
/// catalog's lock held by the writer, it says no and the reader decides.
pub fn certainly_absent(catalog: &RwLock<Catalog>, model: &str, key: &Key) -> bool {
    let Ok(catalog) = catalog.try_read() else { return false };
    let Some(&model_id) = catalog.models.get(model) else { return true };
    let hash = hash(model_id, key);
    !catalog.active.contains_key(&(model_id, hash))
        && !catalog.sealed.values().any(|view| view.filter.as_ref().is_none_or(|f| f.contains(hash)))
}

/// Where `key` of `model_id` lies, if the index has it: the active
/// segment's entry, else the newest sealed segment whose filter has it and
/// whose bucket holds it.
pub fn lookup(catalog: &RwLock<Catalog>, model_id: u32, key: &Key) -> std::io::Result<Option<Location>> {
    let hash = hash(model_id, key);
    let candidates: Vec<(u64, Arc<SegmentIndex>)> = {
        let catalog = catalog.read().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = catalog.active.get(&(model_id, hash)) {
            return Ok(Some(*at));
        }
        catalog
            .sealed
            .iter()
            .rev()
            .filter(|(_, view)| view.filter.as_ref().is_none_or(|f| f.contains(hash)))
            .filter_map(|(id, view)| Some((*id, view.index.clone()?)))
            .collect()
    };
    for (segment, index) in candidates {
        if let Some(e) = index.bucket(bucket_of(hash, index.buckets()))?.find(model_id, hash) {
            return Ok(Some(Location { segment, offset: e.offset, len: e.len }));
        }
    }
    Ok(None)
}

/// Every model name's id starts with this.
pub fn models() -> [u8; 1] {
    [MODEL]
}

pub fn model_key(model: &str) -> Vec<u8> {
    let mut out = vec![MODEL];
    out.extend_from_slice(model.as_bytes());
    out
}

pub fn u64_of(bytes: Option<sled::IVec>) -> Option<u64> {
    Some(u64::from_be_bytes(bytes?.as_ref().try_into().ok()?))
}

pub fn u32_of(bytes: Option<sled::IVec>) -> Option<u32> {
    Some(u32::from_be_bytes(bytes?.as_ref().try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Key {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        Key(k)
    }

    #[test]
    fn a_filter_has_every_hash_it_was_built_from_and_few_others() {
        let hashes: Vec<u64> = (0..20_000).map(|i| hash(1, &key(i))).collect();
        let filter = SegmentFilter::load(SegmentFilter::build(hashes.clone()).unwrap().into()).unwrap();
        assert!(hashes.iter().all(|h| filter.contains(*h)));
        let others = (0..100_000).filter(|i| filter.contains(hash(2, &key(*i)))).count();
        assert!(others < 1_000, "{others} of 100,000 absent hashes found");
        assert!(filter.len() < 20_000 * 10 / 8, "{} bytes for 20,000 entries", filter.len());
    }

    #[test]
    fn a_damaged_filter_is_refused_not_read_past_its_end() {
        let mut bytes = SegmentFilter::build((0..1000).collect()).unwrap();
        assert!(SegmentFilter::load(bytes.clone().into()).is_some());
        bytes.truncate(bytes.len() - 1);
        assert!(SegmentFilter::load(bytes.clone().into()).is_none());
        assert!(SegmentFilter::load(vec![0u8; 5].into()).is_none());
    }

    #[test]
    fn buckets_round_trip_and_hashes_spread_over_them() {
        use super::super::segment_index::{Bucket, Entry};
        let entry = |i: u32| Entry { model_id: i % 3, hash: hash(i % 3, &key(i)), offset: i, len: 7 };
        let bucket = Bucket((0..40).map(entry).collect());
        let back = Bucket::decode(&bucket.encode());
        assert_eq!(back.0, bucket.0);
        assert_eq!(back.find(1, entry(4).hash), Some(&entry(4)));
        assert_eq!(back.find(2, entry(4).hash), None, "another model's entry");
        let mut counts = [0u32; 16];
        for i in 0..16_000 {
            counts[bucket_of(hash(0, &key(i)), 16) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }
}
