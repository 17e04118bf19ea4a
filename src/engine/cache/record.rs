//! A stored answer with a checksum over its key and contents: one torn by
//! a crash, damaged on disk, or written by something else under our key
//! is detected on read and never served.

use super::key::Key;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One stored answer, postcard-encoded: the sled value (Redis holds
/// signed values instead: `signed.rs`).
#[derive(Debug, Serialize, Deserialize)]
pub struct Record {
    /// Insertion number: the eviction order.
    pub seq: u64,
    pub stored_at_ms: u64,
    pub expires_at_ms: u64,
    checksum: u64,
    /// The reply, postcard-encoded.
    pub body: Vec<u8>,
}

impl Record {
    /// A record of `body` under `key`, with its checksum.
    pub fn seal(key: &Key, seq: u64, stored_at_ms: u64, expires_at_ms: u64, body: Vec<u8>) -> Record {
        let checksum = Record::checksum(key, stored_at_ms, expires_at_ms, &body);
        Record { seq, stored_at_ms, expires_at_ms, checksum, body }
    }

    fn checksum(key: &Key, stored_at_ms: u64, expires_at_ms: u64, body: &[u8]) -> u64 {
        let mut h = Sha256::new();
        h.update(key.0);
        h.update(stored_at_ms.to_le_bytes());
        h.update(expires_at_ms.to_le_bytes());
        h.update(body);
        u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
    }

    /// The record under `key`, if its bytes decode and its checksum holds.
    pub fn decode(key: &Key, bytes: &[u8]) -> Option<Record> {
        let r: Record = postcard::from_bytes(bytes).ok()?;
        (r.checksum == Record::checksum(key, r.stored_at_ms, r.expires_at_ms, &r.body)).then_some(r)
    }
}
