//! The disk layer's index: one sled tree from key to where its record lies
//! in the value log, and the few figures the layer keeps (entries, the
//! oldest live segment, how far the log is indexed).
//!
//! One tree, not one per model, so that one sled batch (atomic within a
//! tree) changes entries and the figures together: after a crash the
//! figures are those of the entries that survived, never recounted by a
//! scan. An entry is 37 bytes of key and 24 of value: small enough to stay
//! inline in sled's leaves, so the index is a small fraction of the log.

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
pub const FORMAT_VERSION: u32 = 2;
const MODEL: u8 = b'm';
const SEGMENT: u8 = b's';
const ENTRY: u8 = b'k';

/// Where a record lies: 24 bytes big-endian in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub segment: u64,
    pub offset: u32,
    pub len: u32,
    pub expires_at_ms: u64,
}

impl Location {
    pub fn encode(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.segment.to_be_bytes());
        out[8..12].copy_from_slice(&self.offset.to_be_bytes());
        out[12..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..].copy_from_slice(&self.expires_at_ms.to_be_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Location> {
        let bytes: &[u8; 24] = bytes.try_into().ok()?;
        Some(Location {
            segment: u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes")),
            offset: u32::from_be_bytes(bytes[8..12].try_into().expect("4 bytes")),
            len: u32::from_be_bytes(bytes[12..16].try_into().expect("4 bytes")),
            expires_at_ms: u64::from_be_bytes(bytes[16..].try_into().expect("8 bytes")),
        })
    }

    /// Log order: a later record of a key wins over an earlier one.
    pub fn place(&self) -> (u64, u32) {
        (self.segment, self.offset)
    }
}

/// An entry's key: the model's id, then the cache key.
pub type EntryKey = [u8; 37];

pub fn entry_key(model_id: u32, key: &Key) -> EntryKey {
    let mut out = [0u8; 37];
    out[0] = ENTRY;
    out[1..5].copy_from_slice(&model_id.to_be_bytes());
    out[5..].copy_from_slice(&key.0);
    out
}

/// Every entry of one model starts with this.
pub fn model_entries(model_id: u32) -> [u8; 5] {
    let mut out = [ENTRY; 5];
    out[1..].copy_from_slice(&model_id.to_be_bytes());
    out
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
