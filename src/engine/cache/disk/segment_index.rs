//! A sealed segment's entries in a file of its own beside its records
//! (`seg-ID.idx`): written once when the segment is sealed, read with one
//! positioned read per lookup. The entries live in the OS page cache, not
//! in the process, and so does the segment's filter until it is loaded
//! at open: sled keeps only each segment's figures, so nothing it holds
//! grows with the answers stored (docs/BENCHMARKS.md,
//! "Which layer grows"). The rare change (a damaged record removed, a
//! model purged) writes the whole file again beside it and renames it
//! over, so a reader has the old file or the new one, never half of each.
//!
//! Layout: `EIX1`, the bucket count and the filter's length (u32 BE
//! each), each bucket's end (u32 BE, counted from the first bucket), the
//! buckets (`index::Bucket`), then the filter (`index::SegmentFilter`).

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// One entry of a bucket: 20 bytes big-endian.
pub const ENTRY_LEN: usize = 20;

/// An entry: its model's id, its key's hash, and where its record lies in
/// the bucket's segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub model_id: u32,
    pub hash: u64,
    pub offset: u32,
    pub len: u32,
}

/// A bucket's entries, decoded to be looked at or changed, then written
/// back whole.
#[derive(Debug, Default, Clone)]
pub struct Bucket(pub Vec<Entry>);

impl Bucket {
    pub fn decode(bytes: &[u8]) -> Bucket {
        let entry = |e: &[u8]| {
            let u32_at = |i: usize| u32::from_be_bytes(e[i..i + 4].try_into().expect("4 bytes"));
            Entry {
                model_id: u32_at(0),
                hash: u64::from_be_bytes(e[4..12].try_into().expect("8 bytes")),
                offset: u32_at(12),
                len: u32_at(16),
            }
        };
        Bucket(bytes.chunks_exact(ENTRY_LEN).map(entry).collect())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.0.len() * ENTRY_LEN);
        for e in &self.0 {
            out.extend_from_slice(&e.model_id.to_be_bytes());
            out.extend_from_slice(&e.hash.to_be_bytes());
            out.extend_from_slice(&e.offset.to_be_bytes());
            out.extend_from_slice(&e.len.to_be_bytes());
        }
        out
    }

    /// The entry of `model_id` and `hash`, if the bucket has it.
    pub fn find(&self, model_id: u32, hash: u64) -> Option<&Entry> {
        self.0.iter().find(|e| e.model_id == model_id && e.hash == hash)
    }
}

const MAGIC: &[u8; 4] = b"EIX1";
const HEAD: u64 = 12;

pub fn path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:016x}.idx"))
}

/// The segment an index file's name (as `path` makes it) belongs to.
pub fn id_of(name: &str) -> Option<u64> {
    u64::from_str_radix(name.strip_prefix("seg-")?.strip_suffix(".idx")?, 16).ok()
}

/// An open index file and where its buckets end.
#[derive(Debug)]
pub struct SegmentIndex {
    file: File,
    ends: Box<[u32]>,
    filter_len: u32,
}

fn damaged(id: u64, what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("the index file of segment {id:016x} {what}"))
}

impl SegmentIndex {
    /// Writes `buckets` and `filter` as segment `id`'s index file, on disk
    /// before it returns (the segment's sealed figures go to sled after it).
    pub fn write(dir: &Path, id: u64, buckets: &[Bucket], filter: &[u8]) -> io::Result<SegmentIndex> {
        let mut bytes =
            Vec::with_capacity(HEAD as usize + 4 * buckets.len() + 640 * buckets.len() + filter.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(buckets.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&(filter.len() as u32).to_be_bytes());
        let encoded: Vec<Vec<u8>> = buckets.iter().map(Bucket::encode).collect();
        let mut end = 0u32;
        let ends: Box<[u32]> = encoded
            .iter()
            .map(|bucket| {
                end += bucket.len() as u32;
                end
            })
            .collect();
        for end in &ends {
            bytes.extend_from_slice(&end.to_be_bytes());
        }
        for bucket in &encoded {
            bytes.extend_from_slice(bucket);
        }
        bytes.extend_from_slice(filter);
        let final_path = path(dir, id);
        let fresh = final_path.with_extension("idx.new");
        {
            let mut file = File::create(&fresh)?;
            file.write_all(&bytes)?;
            file.sync_data()?;
        }
        std::fs::rename(&fresh, &final_path)?;
        Ok(SegmentIndex { file: File::open(&final_path)?, ends, filter_len: filter.len() as u32 })
    }

    /// Opens segment `id`'s index file, which must hold `buckets` buckets
    /// whose ends lie within it: anything else is refused, and the store
    /// indexes the segment again from its records.
    pub fn open(dir: &Path, id: u64, buckets: u32) -> io::Result<SegmentIndex> {
        let file = File::open(path(dir, id))?;
        let len = file.metadata()?.len();
        let mut head = [0u8; HEAD as usize];
        file.read_exact_at(&mut head, 0).map_err(|_| damaged(id, "is shorter than its header"))?;
        if &head[..4] != MAGIC || u32::from_be_bytes(head[4..8].try_into().unwrap()) != buckets {
            return Err(damaged(id, "does not have the header its segment's figures expect"));
        }
        let filter_len = u32::from_be_bytes(head[8..12].try_into().unwrap());
        let area = HEAD + 4 * buckets as u64;
        let mut raw = vec![0u8; 4 * buckets as usize];
        file.read_exact_at(&mut raw, HEAD).map_err(|_| damaged(id, "is cut short"))?;
        let ends: Box<[u32]> =
            raw.chunks_exact(4).map(|c| u32::from_be_bytes(c.try_into().unwrap())).collect();
        let ordered = ends.windows(2).all(|w| w[0] <= w[1]);
        if !ordered || area + ends.last().copied().unwrap_or(0) as u64 + filter_len as u64 != len {
            return Err(damaged(id, "has bucket bounds that do not fit it"));
        }
        Ok(SegmentIndex { file, ends, filter_len })
    }

    /// The filter's bytes as written (checked by `SegmentFilter::load`).
    pub fn filter(&self) -> io::Result<Vec<u8>> {
        let mut bytes = vec![0u8; self.filter_len as usize];
        self.file.read_exact_at(&mut bytes, self.len() - self.filter_len as u64)?;
        Ok(bytes)
    }

    /// The file's length.
    pub fn len(&self) -> u64 {
        HEAD + 4 * self.ends.len() as u64
            + self.ends.last().copied().unwrap_or(0) as u64
            + self.filter_len as u64
    }

    pub fn buckets(&self) -> u32 {
        self.ends.len() as u32
    }

    /// Bucket `b`: one positioned read.
    pub fn bucket(&self, b: u32) -> io::Result<Bucket> {
        let b = b as usize;
        let (start, end) = (if b == 0 { 0 } else { self.ends[b - 1] }, self.ends[b]);
        let mut bytes = vec![0u8; (end - start) as usize];
        self.file.read_exact_at(&mut bytes, HEAD + 4 * self.ends.len() as u64 + start as u64)?;
        Ok(Bucket::decode(&bytes))
    }

    /// Every bucket, in order: for a purge, a removal and `cache check`.
    pub fn all(&self) -> io::Result<Vec<Bucket>> {
        (0..self.buckets()).map(|b| self.bucket(b)).collect()
    }
}

pub fn remove(dir: &Path, id: u64) -> io::Result<()> {
    match std::fs::remove_file(path(dir, id)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u32) -> Entry {
        Entry { model_id: 1, hash: u64::from(i) * 7919, offset: i * 100, len: 90 }
    }

    #[test]
    fn buckets_read_back_as_written_and_a_changed_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let buckets: Vec<Bucket> =
            (0..5).map(|b| Bucket((0..b).map(|i| entry(b * 10 + i)).collect())).collect();
        let index = SegmentIndex::write(dir.path(), 3, &buckets, b"filter").unwrap();
        assert_eq!(index.buckets(), 5);
        assert_eq!(index.filter().unwrap(), b"filter");
        assert_eq!(index.len(), std::fs::metadata(path(dir.path(), 3)).unwrap().len());
        for (b, bucket) in buckets.iter().enumerate() {
            assert_eq!(index.bucket(b as u32).unwrap().0, bucket.0);
        }
        assert_eq!(index.all().unwrap().iter().map(|b| b.0.len()).sum::<usize>(), 10);
        assert!(SegmentIndex::open(dir.path(), 3, 4).is_err(), "another bucket count");
        let file = path(dir.path(), 3);
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 1]).unwrap();
        assert!(SegmentIndex::open(dir.path(), 3, 5).is_err(), "a torn file");
        std::fs::write(&file, b"EIX").unwrap();
        assert!(SegmentIndex::open(dir.path(), 3, 5).is_err(), "a header cut short");
        remove(dir.path(), 3).unwrap();
        assert!(SegmentIndex::open(dir.path(), 3, 5).is_err(), "a missing file");
    }
}
