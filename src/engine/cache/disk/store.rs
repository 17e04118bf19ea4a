//! The disk layer's files as the writer thread owns them: the value log's
//! segments (`vlog.rs`) and the sled index over them (`index.rs`). No
//! threads here: `writer.rs` drives it, `reader.rs` reads beside it.
//!
//! Crash order: a group of records is appended to the active segment, then
//! indexed in one sled batch that also moves the checkpoint; a restart
//! indexes whatever lies after the checkpoint (written, its batch lost) and
//! starts a new segment. An eviction removes a segment's entries and
//! raises the live watermark in one batch, flushes, then unlinks the file;
//! a restart unlinks files below the watermark. So the figures are never
//! recounted by a scan, and open time does not grow with the entries.

use super::index::{self, Bucket, Location};
use super::{DiskError, vlog};
use crate::engine::cache::key::Key;
use crate::telemetry;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What an index entry is charged against `cache.disk_bytes` beside its
/// record: its 24 bytes in a bucket, four times over, as far as sled's
/// files may grow before the index is built again (`index_outgrown`), so
/// that the bound is the state directory's, not the log's alone.
pub const INDEX_CHARGE: u64 = 4 * index::ENTRY_LEN as u64;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Index(#[from] sled::Error),
}

struct Segment {
    bytes: u64,
    /// The latest expiry of its records: past it, the segment goes whole.
    max_expires_at_ms: u64,
}

/// The segment being appended to.
struct Active {
    id: u64,
    file: File,
    /// Bytes in the file (the group not yet written is not).
    len: u64,
}

/// An entry's identity: its model's id and its key.
type Entry = (u32, Key);

pub struct Store {
    dir: PathBuf,
    capacity: u64,
    segment_target: u64,
    db: sled::Db,
    /// Live segments, oldest first; the active one is the last.
    segments: BTreeMap<u64, Segment>,
    active: Active,
    /// Records appended since the last commit, and their index entries.
    group: Vec<u8>,
    pending: Vec<(Entry, Location)>,
    /// Bytes of every live segment, the group included.
    log_bytes: u64,
    entries: u64,
    models: HashMap<String, u32>,
    next_model: u32,
    min_live: u64,
    /// How many buckets the index's entries are spread over.
    buckets: u32,
    /// The format and figures of a fresh index, written with its first batch.
    meta_pending: bool,
}

/// A segment's size for a bound: 64 segments to the bound, so an eviction
/// drops 1/64 of the cache; a few MiB at most ("a few MiB each").
pub(super) fn segment_target(capacity: u64) -> u64 {
    (capacity / 64).clamp(1024, 4 << 20)
}

impl Store {
    /// Opens the store in `dir`: an index that cannot be opened is moved
    /// aside (returned: what happened) and rebuilt from the segments.
    pub fn open(
        dir: &Path,
        capacity: u64,
        page_cache_bytes: u64,
    ) -> Result<(Store, Option<String>), DiskError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| DiskError::Create { path: dir.into(), reason: e.to_string() })?;
        remove_old_format(dir);
        let index_path = dir.join("index");
        let mut quarantined = None;
        let db = match open_index(&index_path, page_cache_bytes) {
            Ok(db) => db,
            Err(locked @ DiskError::Locked(_)) => return Err(locked),
            Err(broken) => {
                let aside = quarantine_path(&index_path);
                std::fs::rename(&index_path, &aside).map_err(|r| DiskError::NotMovedAside {
                    broken: Box::new(broken.clone()),
                    aside: aside.clone(),
                    reason: r.to_string(),
                })?;
                quarantined = Some(format!(
                    "{broken}; moved it aside to {} and rebuilt the index from the segments",
                    aside.display()
                ));
                metrics::counter!(telemetry::CACHE_QUARANTINED).increment(1);
                open_index(&index_path, page_cache_bytes)?
            }
        };
        let store = Store::load(dir, capacity, db).map_err(|e| DiskError::Store(e.to_string()))?;
        Ok((store, quarantined))
    }

    fn load(dir: &Path, capacity: u64, db: sled::Db) -> Result<Store, StoreError> {
        // An index of another layout (or none) is built again from the segments.
        let fresh = index::u32_of(db.get(index::FORMAT)?) != Some(index::FORMAT_VERSION);
        let mut min_live = index::u64_of(db.get(index::MIN_LIVE)?).unwrap_or(0);
        let mut segments = BTreeMap::new();
        for (id, bytes) in vlog::list(dir)? {
            // An eviction stopped between its batch and the unlink; or a
            // segment that never got a record (each open starts one).
            if id < min_live || bytes <= vlog::HEADER_LEN {
                remove_segment(dir, id)?;
                continue;
            }
            let max_expires_at_ms = index::u64_of(db.get(index::segment_key(id))?).unwrap_or(0);
            segments.insert(id, Segment { bytes, max_expires_at_ms });
        }
        let checkpoint = index::checkpoint_of(db.get(index::CHECKPOINT)?);
        // A purge stopped between unlinking the segments and clearing the
        // index leaves entries with nothing to point at.
        let orphaned = segments.is_empty() && index::u64_of(db.get(index::ENTRIES)?).unwrap_or(0) > 0;
        if fresh || orphaned {
            db.clear()?;
        }
        let last = segments.keys().next_back().copied().unwrap_or(0);
        let id = last.max(min_live).max(checkpoint.map_or(0, |c| c.0)) + 1;
        min_live = min_live.max(segments.keys().next().copied().unwrap_or(id));
        let active = Active { id, file: vlog::create(dir, id)?, len: vlog::HEADER_LEN };
        segments.insert(id, Segment { bytes: vlog::HEADER_LEN, max_expires_at_ms: 0 });
        let mut models = HashMap::new();
        for item in db.scan_prefix(index::models()) {
            let (k, v) = item?;
            if let (Ok(name), Some(model_id)) = (std::str::from_utf8(&k[1..]), index::u32_of(Some(v))) {
                models.insert(name.to_string(), model_id);
            }
        }
        let mut store = Store {
            dir: dir.to_path_buf(),
            capacity,
            segment_target: segment_target(capacity),
            log_bytes: segments.values().map(|s: &Segment| s.bytes).sum(),
            entries: index::u64_of(db.get(index::ENTRIES)?).unwrap_or(0),
            next_model: index::u32_of(db.get(index::NEXT_MODEL)?).unwrap_or(0),
            buckets: index::u32_of(db.get(index::BUCKETS)?).unwrap_or_else(|| index::buckets_for(capacity)),
            db,
            segments,
            active,
            group: Vec::new(),
            pending: Vec::new(),
            models,
            min_live,
            meta_pending: false,
        };
        let from = match checkpoint {
            Some(at) if !fresh && !orphaned => at,
            // A new or lost index: every segment is read into it.
            _ => (0, 0),
        };
        // A fresh index gets its format with its first batch, not now: a
        // write to sled starts its seven I/O threads (issue 43: they sleep
        // since vendor/sled, but an idle node need not start them).
        store.meta_pending = fresh || orphaned;
        let indexed = store.replay(from)?;
        if indexed > 0 {
            tracing::info!("disk cache: indexed {indexed} answers written after the last checkpoint");
        }
        Ok(store)
    }

    /// The format and the figures of an empty index.
    fn write_meta(&mut self) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        self.meta(&mut batch);
        self.db.apply_batch(batch)?;
        Ok(())
    }

    fn meta(&mut self, batch: &mut sled::Batch) {
        batch.insert(index::FORMAT, &index::FORMAT_VERSION.to_be_bytes()[..]);
        batch.insert(index::NEXT_MODEL, &self.next_model.to_be_bytes()[..]);
        batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
        batch.insert(index::MIN_LIVE, &self.min_live.to_be_bytes()[..]);
        batch.insert(index::BUCKETS, &self.buckets.to_be_bytes()[..]);
        self.meta_pending = false;
    }

    /// Indexes the records after `from` (segment, offset) in the segments
    /// before the active one: the later of two records of a key wins, and
    /// an expired one is left out. Answers how many entries it wrote.
    fn replay(&mut self, from: (u64, u64)) -> Result<u64, StoreError> {
        let now = crate::telemetry::unix_now_ms();
        let ids: Vec<u64> = self.segments.range(from.0..self.active.id).map(|(id, _)| *id).collect();
        let mut indexed = 0;
        for id in ids {
            let bytes = match vlog::read(&self.dir, id) {
                Ok(bytes) => bytes,
                Err(e) => {
                    tracing::warn!("disk cache: {e}; its answers are not served");
                    continue;
                }
            };
            let start = if id == from.0 { from.1 } else { 0 };
            let mut found = Vec::new();
            let mut end = start.max(vlog::HEADER_LEN);
            for (offset, len, record) in vlog::records(&bytes, start) {
                end = offset + len as u64;
                let segment = self.segments.get_mut(&id).expect("listed");
                segment.max_expires_at_ms = segment.max_expires_at_ms.max(record.expires_at_ms);
                if record.expires_at_ms <= now {
                    continue;
                }
                let model_id = self.model_id(&record.model)?;
                found.push(((model_id, record.key), Location { segment: id, offset: offset as u32, len }));
            }
            if !found.is_empty() || end > start.max(vlog::HEADER_LEN) {
                indexed += self.index(&found, (id, end), true)?;
            }
        }
        Ok(indexed)
    }

    /// Writes `items` to the index in one batch with the entry count, the
    /// checkpoint and that segment's latest expiry. `newer_only`: an entry
    /// that already points later in the log stays (a replay).
    fn index(
        &mut self,
        items: &[(Entry, Location)],
        checkpoint: (u64, u64),
        newer_only: bool,
    ) -> Result<u64, StoreError> {
        let mut batch = sled::Batch::default();
        if self.meta_pending {
            self.meta(&mut batch);
        }
        let mut touched: HashMap<[u8; 5], Bucket> = HashMap::new();
        let mut written = 0;
        for ((model_id, key), at) in items {
            let bucket = self.bucket(&mut touched, key)?;
            if newer_only && bucket.get(*model_id, key).is_some_and(|c| c.place() >= at.place()) {
                continue;
            }
            self.entries += bucket.set(*model_id, key, *at).is_none() as u64;
            written += 1;
        }
        Self::write_buckets(&mut batch, touched);
        batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
        batch.insert(index::CHECKPOINT, &index::checkpoint(checkpoint.0, checkpoint.1)[..]);
        if let Some(segment) = self.segments.get(&checkpoint.0) {
            batch.insert(&index::segment_key(checkpoint.0)[..], &segment.max_expires_at_ms.to_be_bytes()[..]);
        }
        self.db.apply_batch(batch)?;
        Ok(written)
    }

    /// The bucket `key` falls in, read once into `touched` and changed there.
    fn bucket<'a>(
        &self,
        touched: &'a mut HashMap<[u8; 5], Bucket>,
        key: &Key,
    ) -> Result<&'a mut Bucket, StoreError> {
        Ok(match touched.entry(index::bucket_key(self.buckets, key)) {
            std::collections::hash_map::Entry::Occupied(bucket) => bucket.into_mut(),
            std::collections::hash_map::Entry::Vacant(place) => {
                let read = self.db.get(place.key())?;
                place.insert(read.map(|v| Bucket::decode(&v)).unwrap_or_default())
            }
        })
    }

    /// Writes the buckets back in `batch`, an emptied one removed.
    fn write_buckets(batch: &mut sled::Batch, touched: HashMap<[u8; 5], Bucket>) {
        for (k, bucket) in touched {
            match bucket.len() {
                0 => batch.remove(&k[..]),
                _ => batch.insert(&k[..], bucket.encode()),
            }
        }
    }

    /// The id of `model`'s entries, given one on first use.
    fn model_id(&mut self, model: &str) -> Result<u32, StoreError> {
        if let Some(id) = self.models.get(model) {
            return Ok(*id);
        }
        let id = self.next_model;
        self.next_model += 1;
        let mut batch = sled::Batch::default();
        batch.insert(index::model_key(model), &id.to_be_bytes()[..]);
        batch.insert(index::NEXT_MODEL, &self.next_model.to_be_bytes()[..]);
        self.db.apply_batch(batch)?;
        self.models.insert(model.to_string(), id);
        Ok(id)
    }

    /// What the bound counts: the live segments' bytes and each entry's
    /// charge for the index.
    pub fn bytes(&self) -> u64 {
        self.log_bytes + (self.entries + self.pending.len() as u64) * INDEX_CHARGE
    }

    pub fn entries(&self) -> u64 {
        self.entries
    }

    pub fn min_live(&self) -> u64 {
        self.min_live
    }

    /// The index, for the reader.
    pub fn index_tree(&self) -> sled::Tree {
        (*self.db).clone()
    }

    /// What sled's files take.
    pub fn index_bytes(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }

    /// The index's files outgrew four times what it holds (and a floor:
    /// sled's own for a fresh store is a few of its 512 KiB segments, and
    /// `at_least`, twice what the last rebuild left): time to build it
    /// again from the segments. Four times its entries is what
    /// `INDEX_CHARGE` counts against the bound.
    pub fn index_outgrown(&self, at_least: u64) -> bool {
        let floor = (self.capacity / 16).clamp(2 << 20, 16 << 20);
        let held = self.entries * index::ENTRY_LEN as u64 + self.buckets as u64 * 32;
        self.index_bytes() > (4 * held).max(floor).max(at_least)
    }

    /// What the files take: the segments and sled's.
    pub fn size_on_disk(&self) -> u64 {
        self.log_bytes + self.index_bytes()
    }

    fn active_bytes(&self) -> u64 {
        self.active.len + self.group.len() as u64
    }

    /// Appends an answer to the group (written and indexed at the next
    /// `commit`), making room first so the bound holds at every moment.
    pub fn put(
        &mut self,
        model: &str,
        key: &Key,
        stored_at_ms: u64,
        expires_at_ms: u64,
        body: &[u8],
    ) -> Result<(), StoreError> {
        let Some(len) = vlog::encoded_len(model, body) else { return Ok(()) };
        let cost = len as u64 + INDEX_CHARGE;
        if cost > self.capacity {
            return Ok(());
        }
        self.make_room(cost)?;
        if self.active_bytes() + len as u64 > self.segment_target && self.active_bytes() > vlog::HEADER_LEN {
            self.rotate()?;
        }
        let model_id = self.model_id(model)?;
        let offset = self.active_bytes();
        vlog::encode(&mut self.group, model, key, stored_at_ms, expires_at_ms, body);
        let at = Location { segment: self.active.id, offset: offset as u32, len: len as u32 };
        self.pending.push(((model_id, *key), at));
        let segment = self.segments.get_mut(&self.active.id).expect("the active segment is listed");
        segment.bytes += len as u64;
        segment.max_expires_at_ms = segment.max_expires_at_ms.max(expires_at_ms);
        self.log_bytes += len as u64;
        Ok(())
    }

    /// Answers appended since the last commit.
    pub fn uncommitted(&self) -> usize {
        self.pending.len()
    }

    /// Writes the group to the active segment, then indexes it: data first.
    pub fn commit(&mut self) -> Result<(), StoreError> {
        if self.group.is_empty() {
            return Ok(());
        }
        self.active.file.write_all(&self.group)?;
        self.active.len += self.group.len() as u64;
        self.group.clear();
        let pending = std::mem::take(&mut self.pending);
        self.index(&pending, (self.active.id, self.active.len), false)?;
        Ok(())
    }

    /// Everything written so far on disk: the segment, then the index.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.commit()?;
        self.active.file.sync_data()?;
        self.db.flush()?;
        Ok(())
    }

    fn rotate(&mut self) -> Result<(), StoreError> {
        self.commit()?;
        let id = self.active.id + 1;
        let file = vlog::create(&self.dir, id)?;
        self.active = Active { id, file, len: vlog::HEADER_LEN };
        self.segments.insert(id, Segment { bytes: vlog::HEADER_LEN, max_expires_at_ms: 0 });
        self.log_bytes += vlog::HEADER_LEN;
        Ok(())
    }

    /// Drops the oldest segments until `incoming` more bytes fit the bound.
    fn make_room(&mut self, incoming: u64) -> Result<(), StoreError> {
        while self.bytes() + incoming > self.capacity {
            let oldest = *self.segments.keys().next().expect("the active segment is listed");
            if oldest == self.active.id {
                if self.active_bytes() <= vlog::HEADER_LEN {
                    break;
                }
                self.rotate()?;
                continue;
            }
            self.evict(oldest)?;
        }
        Ok(())
    }

    /// Drops the oldest segment whole: its entries and the watermark in
    /// one batch, on disk before the file goes.
    fn evict(&mut self, id: u64) -> Result<(), StoreError> {
        self.commit()?;
        let mut touched = HashMap::new();
        let mut removed = 0;
        match vlog::read(&self.dir, id) {
            Ok(bytes) => {
                for (_, _, record) in vlog::records(&bytes, 0) {
                    self.bucket(&mut touched, &record.key)?;
                }
                for bucket in touched.values_mut() {
                    removed += bucket.remove(|_, at| at.segment == id);
                }
            }
            // Its entries, if any, point at nothing now: misses, removed when read.
            Err(e) => tracing::warn!("disk cache: evicting {e}"),
        }
        let mut batch = sled::Batch::default();
        Self::write_buckets(&mut batch, touched);
        self.entries = self.entries.saturating_sub(removed);
        batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
        batch.insert(index::MIN_LIVE, &(id + 1).to_be_bytes()[..]);
        batch.remove(&index::segment_key(id)[..]);
        self.db.apply_batch(batch)?;
        self.db.flush()?;
        remove_segment(&self.dir, id)?;
        self.min_live = id + 1;
        if let Some(gone) = self.segments.remove(&id) {
            self.log_bytes -= gone.bytes;
        }
        metrics::counter!(telemetry::CACHE_EVICTIONS, "layer" => "disk").increment(removed);
        Ok(())
    }

    /// Drops the oldest segments whose every answer has expired.
    pub fn sweep(&mut self, now_ms: u64) -> Result<(), StoreError> {
        self.commit()?;
        while let Some((&id, segment)) = self.segments.iter().next() {
            if id == self.active.id || segment.max_expires_at_ms > now_ms {
                break;
            }
            self.evict(id)?;
        }
        Ok(())
    }

    /// Removes `key`'s entry if it still points at `at` (a damaged or
    /// dangling one a read found).
    pub fn remove(&mut self, model: &str, key: &Key, at: Location) -> Result<(), StoreError> {
        let Some(&model_id) = self.models.get(model) else { return Ok(()) };
        self.commit()?;
        let mut touched = HashMap::new();
        let removed = self.bucket(&mut touched, key)?.remove(|m, here| m == model_id && here == at);
        if removed > 0 {
            self.entries = self.entries.saturating_sub(removed);
            let mut batch = sled::Batch::default();
            Self::write_buckets(&mut batch, touched);
            batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
            self.db.apply_batch(batch)?;
        }
        Ok(())
    }

    /// Removes every entry (of one model, or all); answers how many went.
    pub fn purge(&mut self, model: Option<&str>) -> Result<u64, StoreError> {
        self.commit()?;
        let removed = match model {
            Some(model) => {
                let Some(&model_id) = self.models.get(model) else { return Ok(0) };
                let mut batch = sled::Batch::default();
                let mut removed = 0;
                for item in self.db.scan_prefix(index::all_buckets()) {
                    let (k, v) = item?;
                    let mut bucket = Bucket::decode(&v);
                    let gone = bucket.remove(|m, _| m == model_id);
                    if gone > 0 {
                        removed += gone;
                        match bucket.len() {
                            0 => batch.remove(k),
                            _ => batch.insert(k, bucket.encode()),
                        }
                    }
                }
                self.entries = self.entries.saturating_sub(removed);
                batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
                self.db.apply_batch(batch)?;
                removed
            }
            None => {
                // The files first: an index left without segments is
                // cleared at the next open, while segments left without
                // an index would be read back into one.
                let removed = self.entries;
                let next = self.active.id + 1;
                for id in self.segments.keys() {
                    remove_segment(&self.dir, *id)?;
                }
                self.db.clear()?;
                (self.entries, self.min_live, self.log_bytes) = (0, next, vlog::HEADER_LEN);
                self.segments.clear();
                self.models.clear();
                self.active =
                    Active { id: next, file: vlog::create(&self.dir, next)?, len: vlog::HEADER_LEN };
                self.segments.insert(next, Segment { bytes: vlog::HEADER_LEN, max_expires_at_ms: 0 });
                self.write_meta()?;
                removed
            }
        };
        self.db.flush()?;
        Ok(removed)
    }

    /// Reads every segment and every index entry: what `cache check`
    /// reports. `repair`: the index is rebuilt from the segments first.
    pub fn check(&mut self, repair: bool) -> Result<CheckReport, StoreError> {
        self.commit()?;
        let mut report = CheckReport::default();
        if repair {
            self.db.clear()?;
            (self.entries, self.models) = (0, HashMap::new());
            self.write_meta()?;
            report.reindexed = self.replay((0, 0))?;
            self.flush()?;
        }
        for (&id, segment) in &self.segments {
            report.segments += 1;
            let bytes = match vlog::read(&self.dir, id) {
                Ok(bytes) => bytes,
                Err(_) => {
                    report.damaged_segments += 1;
                    continue;
                }
            };
            let mut end = vlog::HEADER_LEN;
            for (offset, len, _) in vlog::records(&bytes, 0) {
                report.records += 1;
                end = offset + len as u64;
            }
            report.torn_tails += (end < segment.bytes.min(bytes.len() as u64)) as u64;
        }
        let mut files: HashMap<u64, Option<File>> = HashMap::new();
        for item in self.db.scan_prefix(index::all_buckets()) {
            for at in Bucket::decode(&item?.1).locations() {
                report.entries += 1;
                let file = files
                    .entry(at.segment)
                    .or_insert_with(|| File::open(vlog::path(&self.dir, at.segment)).ok());
                let mut buf = vec![0u8; at.len as usize];
                let intact =
                    file.as_ref().is_some_and(|f| f.read_exact_at(&mut buf, at.offset as u64).is_ok())
                        && vlog::decode(&buf).is_some();
                report.dangling += !intact as u64;
            }
        }
        report.counted = self.entries;
        Ok(report)
    }
}

/// What `edgeinfer cache check` found.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct CheckReport {
    pub segments: u64,
    /// Segments without a valid header (their answers are not served).
    pub damaged_segments: u64,
    /// Records that check (CRC, length), live or replaced.
    pub records: u64,
    /// Segments with bytes after their last record that checks (a write
    /// cut by a crash or a full disk): harmless, never appended to.
    pub torn_tails: u64,
    /// Index entries, and those whose record is missing or does not check.
    pub entries: u64,
    pub dangling: u64,
    /// The entry count the index keeps (equal to `entries` when sound).
    pub counted: u64,
    /// Entries written by a repair.
    pub reindexed: u64,
}

fn remove_segment(dir: &Path, id: u64) -> std::io::Result<()> {
    match std::fs::remove_file(vlog::path(dir, id)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The store before the value log was sled alone, in `dir` itself: it
/// cannot be read cheaply, and it is a cache, so it goes.
fn remove_old_format(dir: &Path) {
    let old = ["conf", "db", "blobs"];
    let Ok(listing) = std::fs::read_dir(dir) else { return };
    let mut removed = false;
    for entry in listing.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if old.contains(&name.as_str()) || name.starts_with("snap.") {
            let path = entry.path();
            let _ = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed = true;
        }
    }
    if removed {
        tracing::info!(
            "disk cache: removed the store of an earlier version in {} (answers are recomputed)",
            dir.display()
        );
    }
}

/// sled's own flusher thread wakes every `flush_every_ms` whether or not
/// anything was written; the writer flushes instead.
fn index_config(path: &Path, page_cache_bytes: u64) -> sled::Config {
    sled::Config::new()
        .path(path)
        .cache_capacity(page_cache_bytes)
        .mode(sled::Mode::LowSpace)
        .flush_every_ms(None)
}

fn open_index(path: &Path, page_cache_bytes: u64) -> Result<sled::Db, DiskError> {
    let config = index_config(path, page_cache_bytes);
    let broken = |reason: String| DiskError::Broken { path: path.to_path_buf(), reason };
    // sled can panic on some kinds of damage rather than return an error.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| config.open())) {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(sled::Error::Io(e))) if e.to_string().contains("could not acquire lock") => {
            Err(DiskError::Locked(path.to_path_buf()))
        }
        Ok(Err(e)) => Err(broken(e.to_string())),
        Err(_) => Err(broken("sled panicked reading it".into())),
    }
}

fn quarantine_path(path: &Path) -> PathBuf {
    let stamp = crate::telemetry::unix_now();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "index".into());
    let mut aside = path.with_file_name(format!("{name}.quarantined-{stamp}"));
    let mut n = 1;
    while aside.exists() {
        aside = path.with_file_name(format!("{name}.quarantined-{stamp}-{n}"));
        n += 1;
    }
    aside
}
