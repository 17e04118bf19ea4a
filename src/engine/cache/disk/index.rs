//! The disk layer's index: one sled tree from key to where its record lies
//! in the value log, and the few figures the layer keeps (entries, the
//! oldest live segment, how far the log is indexed).
//!
//! Entries are kept in hash buckets, a sled value each (about 16 entries
//! of 24 bytes at the default bound), not a sled entry per answer: sled
//! 0.34 splits a leaf past 16 entries and keeps a heap record per page, so
//! a million one-answer entries cost it 100+ MiB of memory and 360 bytes an
//! entry on disk (docs/BENCHMARKS.md). A bucket holds a model id and an
//! 8-byte fingerprint of each key; the record's full key is checked on
//! every read.
//!
//! One tree, so that one sled batch (atomic within a tree) changes buckets
//! and the figures together: after a crash the figures are those of the
//! entries that survived, never recounted by a scan.

use crate::engine::cache::key::Key;

/// Entries in the index (u64).
pub const ENTRIES: &[u8] = b"\0entries";
/// Segment and offset (u64, u64) before which every record is indexed: a
/// restart indexes the records after it (written, their batch lost).
pub const CHECKPOINT: &[u8] = b"\0checkpoint";
/// Segments below this id are gone (u64): an eviction interrupted before
/// its unlink finishes at the next open.
pub const MIN_LIVE: &[u8] = b"\0min_live";
/// The id the next new model name gets (u32).
pub const NEXT_MODEL: &[u8] = b"\0next_model";
/// This layout's version (u32): a tree without it was never written by it.
pub const FORMAT: &[u8] = b"\0format";
pub const FORMAT_VERSION: u32 = 3;
/// How many buckets the entries are spread over (u32), fixed when the
/// index is created.
pub const BUCKETS: &[u8] = b"\0buckets";
const MODEL: u8 = b'm';
const SEGMENT: u8 = b's';
const BUCKET: u8 = b'b';

/// Where a record lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub segment: u64,
    pub offset: u32,
    pub len: u32,
}

impl Location {
    /// Log order: a later record of a key wins over an earlier one.
    pub fn place(&self) -> (u64, u32) {
        (self.segment, self.offset)
    }
}

/// Buckets for a bound: about one per 4 KiB of it (16 answers of a
/// `digits` size), a power of two.
pub fn buckets_for(capacity: u64) -> u32 {
    (capacity / 4096).clamp(64, 1 << 20).next_power_of_two() as u32
}

/// All 32 bytes of a key folded and mixed (splitmix64's finaliser), so
/// that keys which differ anywhere spread over buckets: real keys are
/// sha256 digests, but nothing here should rely on it.
fn mixed(key: &Key, salt: u64) -> u64 {
    let word = |i: usize| u64::from_le_bytes(key.0[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let mut z =
        (word(0) ^ word(1).rotate_left(17) ^ word(2).rotate_left(31) ^ word(3).rotate_left(47)) ^ salt;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The sled key of the bucket `key` falls in.
pub fn bucket_key(buckets: u32, key: &Key) -> [u8; 5] {
    let mut out = [BUCKET; 5];
    out[1..].copy_from_slice(&((mixed(key, 0x9e37_79b9_7f4a_7c15) >> 32) as u32 % buckets).to_be_bytes());
    out
}

/// Every bucket's key starts with this.
pub fn all_buckets() -> [u8; 1] {
    [BUCKET]
}

/// One entry of a bucket: 24 bytes big-endian.
pub const ENTRY_LEN: usize = 24;

/// A bucket's entries, decoded to be looked at or changed, then written
/// back whole.
#[derive(Debug, Default, Clone)]
pub struct Bucket(Vec<(u32, [u8; 8], Location)>);

/// The 8 bytes a bucket keeps of a key: two keys alike in them are told
/// apart by the record's full key, checked on every read.
fn fingerprint(key: &Key) -> [u8; 8] {
    mixed(key, 0).to_be_bytes()
}

impl Bucket {
    pub fn decode(bytes: &[u8]) -> Bucket {
        let entry = |e: &[u8]| {
            let u32_at = |i: usize| u32::from_be_bytes(e[i..i + 4].try_into().expect("4 bytes"));
            let fingerprint = e[4..12].try_into().expect("8 bytes");
            (
                u32_at(0),
                fingerprint,
                Location { segment: u32_at(12) as u64, offset: u32_at(16), len: u32_at(20) },
            )
        };
        Bucket(bytes.chunks_exact(ENTRY_LEN).map(entry).collect())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.0.len() * ENTRY_LEN);
        for (model_id, fingerprint, at) in &self.0 {
            out.extend_from_slice(&model_id.to_be_bytes());
            out.extend_from_slice(fingerprint);
            out.extend_from_slice(&(at.segment as u32).to_be_bytes());
            out.extend_from_slice(&at.offset.to_be_bytes());
            out.extend_from_slice(&at.len.to_be_bytes());
        }
        out
    }

    pub fn get(&self, model_id: u32, key: &Key) -> Option<Location> {
        let fingerprint = fingerprint(key);
        self.0.iter().find(|(m, f, _)| *m == model_id && *f == fingerprint).map(|(_, _, at)| *at)
    }

    /// Points `key` at `at`; what it pointed at before.
    pub fn set(&mut self, model_id: u32, key: &Key, at: Location) -> Option<Location> {
        let fingerprint = fingerprint(key);
        match self.0.iter_mut().find(|(m, f, _)| *m == model_id && *f == fingerprint) {
            Some(entry) => Some(std::mem::replace(&mut entry.2, at)),
            None => {
                self.0.push((model_id, fingerprint, at));
                None
            }
        }
    }

    /// Drops the entries `gone` picks; how many went.
    pub fn remove(&mut self, mut gone: impl FnMut(u32, Location) -> bool) -> u64 {
        let before = self.0.len();
        self.0.retain(|(m, _, at)| !gone(*m, *at));
        (before - self.0.len()) as u64
    }

    pub fn locations(&self) -> impl Iterator<Item = Location> + '_ {
        self.0.iter().map(|(_, _, at)| *at)
    }

    pub fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

/// Where `key`'s record lies, if the index has it.
pub fn get(tree: &sled::Tree, buckets: u32, model_id: u32, key: &Key) -> sled::Result<Option<Location>> {
    Ok(tree.get(bucket_key(buckets, key))?.and_then(|v| Bucket::decode(&v).get(model_id, key)))
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

/// A segment's latest record expiry (u64): a segment whose records have
/// all expired goes whole.
pub fn segment_key(id: u64) -> [u8; 9] {
    let mut out = [SEGMENT; 9];
    out[1..].copy_from_slice(&id.to_be_bytes());
    out
}

pub fn u64_of(bytes: Option<sled::IVec>) -> Option<u64> {
    Some(u64::from_be_bytes(bytes?.as_ref().try_into().ok()?))
}

pub fn u32_of(bytes: Option<sled::IVec>) -> Option<u32> {
    Some(u32::from_be_bytes(bytes?.as_ref().try_into().ok()?))
}

pub fn checkpoint(segment: u64, offset: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&segment.to_be_bytes());
    out[8..].copy_from_slice(&offset.to_be_bytes());
    out
}

pub fn checkpoint_of(bytes: Option<sled::IVec>) -> Option<(u64, u64)> {
    let bytes = bytes?;
    let bytes: &[u8; 16] = bytes.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(bytes[..8].try_into().ok()?), u64::from_be_bytes(bytes[8..].try_into().ok()?)))
}
