//! The value log's files: the disk layer's answers in append-only segments
//! `seg-<id>.vlog` beside the index (the WiscKey / Bitcask design). A
//! record carries its full key, its model, its expiry and a CRC-32 over all
//! of it, so a read checks what it got before answering, and the index can
//! be rebuilt from the segments alone.
//!
//! A segment: a 16-byte header (magic, id), then records, each
//! `crc32 u32 | len u32 | stored_at_ms u64 | expires_at_ms u64 |
//! model_len u16 | key [32] | model | body`, little-endian, the CRC over
//! everything after it. Segments are only ever appended to by the node
//! that created them in this run: a restart starts a new one, so a torn
//! tail is never written after.

use crate::engine::cache::key::Key;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"EIVLOG01";
/// Magic and id.
pub const HEADER_LEN: u64 = 16;
/// Everything of a record before its model and body.
const HEAD_LEN: usize = 4 + 4 + 8 + 8 + 2 + 32;
/// No answer is longer; a length beyond it is damage, not an allocation.
pub const MAX_RECORD: usize = 64 << 20;

/// One stored answer, as read back and checked.
#[derive(Debug, PartialEq)]
pub struct Record {
    pub model: String,
    pub key: Key,
    pub stored_at_ms: u64,
    pub expires_at_ms: u64,
    pub body: Vec<u8>,
}

pub fn path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:016x}.vlog"))
}

fn id_of(name: &str) -> Option<u64> {
    u64::from_str_radix(name.strip_prefix("seg-")?.strip_suffix(".vlog")?, 16).ok()
}

/// The segments in `dir`, oldest first: id and length.
pub fn list(dir: &Path) -> io::Result<Vec<(u64, u64)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(id) = entry.file_name().to_str().and_then(id_of) {
            found.push((id, entry.metadata()?.len()));
        }
    }
    found.sort_unstable();
    Ok(found)
}

/// A new segment, its header written, for appending.
pub fn create(dir: &Path, id: u64) -> io::Result<File> {
    let mut file = OpenOptions::new().write(true).create_new(true).open(path(dir, id))?;
    let mut header = [0u8; HEADER_LEN as usize];
    header[..8].copy_from_slice(MAGIC);
    header[8..].copy_from_slice(&id.to_le_bytes());
    file.write_all(&header)?;
    Ok(file)
}

/// The length `encode` gives a record of `model` and `body`, if storable.
pub fn encoded_len(model: &str, body: &[u8]) -> Option<usize> {
    let len = HEAD_LEN + model.len() + body.len();
    (model.len() <= u16::MAX as usize && len <= MAX_RECORD).then_some(len)
}

/// Appends a record to `out`; its length, or `None` when it is too long to store.
pub fn encode(
    out: &mut Vec<u8>,
    model: &str,
    key: &Key,
    stored_at_ms: u64,
    expires_at_ms: u64,
    body: &[u8],
) -> Option<u32> {
    let len = encoded_len(model, body)?;
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&stored_at_ms.to_le_bytes());
    out.extend_from_slice(&expires_at_ms.to_le_bytes());
    out.extend_from_slice(&(model.len() as u16).to_le_bytes());
    out.extend_from_slice(&key.0);
    out.extend_from_slice(model.as_bytes());
    out.extend_from_slice(body);
    let crc = crc32fast::hash(&out[start + 4..]);
    out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    Some(len as u32)
}

/// The record `bytes` hold (exactly one), if its length and CRC hold.
pub fn decode(bytes: &[u8]) -> Option<Record> {
    let len = claimed_len(bytes)?;
    if len != bytes.len() || crc32fast::hash(&bytes[4..]) != u32::from_le_bytes(bytes[..4].try_into().ok()?) {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let model_end = HEAD_LEN + u16::from_le_bytes([bytes[24], bytes[25]]) as usize;
    Some(Record {
        stored_at_ms: u64_at(8),
        expires_at_ms: u64_at(16),
        key: Key(bytes[26..HEAD_LEN].try_into().expect("32 bytes")),
        model: String::from_utf8(bytes.get(HEAD_LEN..model_end)?.to_vec()).ok()?,
        body: bytes[model_end..].to_vec(),
    })
}

/// The length a record at the start of `bytes` claims, when plausible.
fn claimed_len(bytes: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?) as usize;
    (HEAD_LEN..=MAX_RECORD).contains(&len).then_some(len)
}

/// Segment `id` whole, if its header says it is that segment.
pub fn read(dir: &Path, id: u64) -> io::Result<Vec<u8>> {
    let bytes = std::fs::read(path(dir, id))?;
    let header_ok =
        bytes.len() >= HEADER_LEN as usize && &bytes[..8] == MAGIC && bytes[8..16] == id.to_le_bytes();
    if !header_ok {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("segment {id:016x} has no valid header"),
        ));
    }
    Ok(bytes)
}

/// The records of a segment's `bytes` from offset `from` on, with their
/// offsets and lengths, up to the first one that does not check: a torn
/// tail or damage, after which nothing can be framed.
pub fn records(bytes: &[u8], from: u64) -> impl Iterator<Item = (u64, u32, Record)> + '_ {
    let mut at = from.max(HEADER_LEN) as usize;
    std::iter::from_fn(move || {
        let len = claimed_len(bytes.get(at..)?)?;
        let record = decode(bytes.get(at..at + len)?)?;
        let found = (at as u64, len as u32, record);
        at += len;
        Some(found)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: u8) -> (String, Key, Vec<u8>) {
        (format!("model-{i}"), Key([i; 32]), vec![i; 40 + i as usize])
    }

    #[test]
    fn records_round_trip_and_any_flipped_bit_or_cut_is_refused() {
        let mut bytes = vec![0u8; HEADER_LEN as usize];
        for i in 0..3 {
            let (model, key, body) = record(i);
            encode(&mut bytes, &model, &key, 10, 20 + i as u64, &body).unwrap();
        }
        let found: Vec<_> = records(&bytes, 0).collect();
        assert_eq!(found.len(), 3);
        assert_eq!(
            found[2].2,
            Record {
                model: "model-2".into(),
                key: Key([2; 32]),
                stored_at_ms: 10,
                expires_at_ms: 22,
                body: vec![2; 42]
            }
        );
        let (offset, len) = (found[1].0 as usize, found[1].1 as usize);
        let one = &bytes[offset..offset + len];
        assert!(decode(one).is_some());
        for bit in 0..one.len() * 8 {
            let mut flipped = one.to_vec();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&flipped).is_none(), "bit {bit} flipped and not noticed");
        }
        // A torn tail, cut at every byte of the last record: the earlier
        // records still read, the torn one does not.
        let last = found[2].0 as usize;
        for cut in last..bytes.len() {
            assert_eq!(records(&bytes[..cut], 0).count(), 2, "cut at {cut}");
        }
    }

    #[test]
    fn a_claimed_length_beyond_the_bound_is_not_allocated() {
        let mut bytes = vec![0u8; 64];
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&bytes).is_none());
        assert_eq!(records(&bytes, 0).count(), 0);
    }
}
