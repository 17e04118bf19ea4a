//! The disk layer's files as the writer thread owns them: the value log's
//! segments (`vlog.rs`) and the sled index over them (`index.rs`). No
//! threads here: `writer.rs` drives it, `reader.rs` reads beside it.
//!
//! Crash order: a group of records is appended to the active segment, then
//! its entries go into the in-memory catalog, where reads find them. When
//! the segment is full it is sealed: its entries and filter go into its
//! index file (on disk first), then its figures into sled in one batch. A
//! restart seals whatever segment was left unsealed, or whose index file is
//! missing or damaged (the records are the truth), and starts a new one.
//! An eviction removes a sealed segment's figures and raises the live
//! watermark in one batch, flushes, then unlinks its files; a restart
//! unlinks files below the watermark and index files without a segment.
//! So the figures are never recounted by a scan, and open time does not
//! grow with the entries.

use super::index::{self, Catalog, Location, Sealed, SealedView, SegmentFilter};
use super::segment_index::{self, Bucket, Entry, SegmentIndex};
use super::{DiskError, vlog};
use crate::engine::cache::key::Key;
use crate::telemetry;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockWriteGuard};

/// What an entry of the active segment is charged against
/// `cache.disk_bytes` beside its record until the segment is sealed and its
/// index file's real length is counted instead: its 20 bytes and its
/// filter's 9 bits, twice over for the bucket bounds and the file's header.
pub const INDEX_CHARGE: u64 = 2 * (segment_index::ENTRY_LEN as u64 + 2);

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
    /// Its figures in sled, once sealed.
    sealed: Option<Sealed>,
    /// Its index file's length, once sealed.
    index_file_bytes: u64,
}

impl Segment {
    /// A segment of `bytes` not (yet) sealed.
    fn unsealed(bytes: u64) -> Segment {
        Segment { bytes, max_expires_at_ms: 0, sealed: None, index_file_bytes: 0 }
    }
}

/// The segment being appended to.
struct Active {
    id: u64,
    file: File,
    /// Bytes in the file (the group not yet written is not).
    len: u64,
    /// Entries in the catalog (written, not sealed).
    entries: u64,
}

/// An entry appended and not yet written: model id, key hash, location.
type Pending = (u32, u64, Location);

pub struct Store {
    dir: PathBuf,
    capacity: u64,
    segment_target: u64,
    db: sled::Db,
    catalog: Arc<RwLock<Catalog>>,
    /// Live segments, oldest first; the active one is the last.
    segments: BTreeMap<u64, Segment>,
    active: Active,
    /// Records appended since the last commit, and their entries.
    group: Vec<u8>,
    pending: Vec<Pending>,
    /// Bytes of every live segment, the group included.
    log_bytes: u64,
    /// Entries of the sealed segments (what sled's count holds).
    entries: u64,
    models: HashMap<String, u32>,
    next_model: u32,
    min_live: u64,
    /// The format and figures of a fresh index, written with its first batch.
    meta_pending: bool,
    /// A batch went to sled since its last flush: most flushes find none
    /// (sled is written per segment), and need not sync it.
    index_dirty: bool,
    /// sled's files as measured after its last write.
    sled_bytes: u64,
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
        remove_other_layout(&index_path);
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
        if fresh {
            db.clear()?;
        }
        let min_live = index::u64_of(db.get(index::MIN_LIVE)?).unwrap_or(0);
        let mut segments = BTreeMap::new();
        for (id, bytes) in vlog::list(dir)? {
            // An eviction stopped between its batch and the unlink; or a
            // segment that never got a record (each open starts one).
            if id < min_live || bytes <= vlog::HEADER_LEN {
                remove_segment(dir, id)?;
                continue;
            }
            segments.insert(id, Segment::unsealed(bytes));
        }
        remove_orphan_indexes(dir, &segments);
        let last = segments.keys().next_back().copied().unwrap_or(0);
        let id = last.max(min_live) + 1;
        let active = Active { id, file: vlog::create(dir, id)?, len: vlog::HEADER_LEN, entries: 0 };
        segments.insert(id, Segment::unsealed(vlog::HEADER_LEN));
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
            db,
            catalog: Arc::new(RwLock::new(Catalog {
                active_id: id,
                models: models.clone(),
                ..Catalog::default()
            })),
            segments,
            active,
            group: Vec::new(),
            pending: Vec::new(),
            models,
            min_live,
            meta_pending: fresh,
            index_dirty: false,
            sled_bytes: 0,
        };
        store.measure_sled();
        store.min_live = min_live.max(*store.segments.keys().next().expect("the active segment is listed"));
        store.load_sealed()?;
        // Segments the index does not have: the one that was active when
        // the node stopped, or all of them for a new or lost index.
        let unsealed: Vec<u64> =
            store.segments.iter().filter(|(i, s)| **i != id && s.sealed.is_none()).map(|(i, _)| *i).collect();
        let mut indexed = 0;
        for segment in unsealed {
            indexed += store.seal_from_file(segment)?;
        }
        if indexed > 0 {
            tracing::info!("disk cache: indexed {indexed} answers of segments the index did not have");
        }
        Ok(store)
    }

    /// The sealed segments' figures, filters and index files; those of
    /// segments whose file is gone (a purge cut short, a file removed by
    /// hand) are dropped, and those whose index file is missing or damaged
    /// too, so that the segment is indexed again from its records.
    fn load_sealed(&mut self) -> Result<(), StoreError> {
        let mut orphans = Vec::new();
        for item in self.db.scan_prefix(index::all_sealed()) {
            let (k, v) = item?;
            let (Some(id), Some(sealed)) = (index::segment_of(&k), Sealed::decode(&v)) else { continue };
            if !self.segments.contains_key(&id) || id == self.active.id {
                orphans.push((id, sealed));
                continue;
            }
            let index = match SegmentIndex::open(&self.dir, id, sealed.buckets) {
                Ok(index) => Some(index),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && sealed.entries == 0 => None,
                Err(e) => {
                    tracing::warn!("disk cache: {e}; indexing the segment again from its records");
                    orphans.push((id, sealed));
                    continue;
                }
            };
            let filter = match &index {
                Some(index) => SegmentFilter::load(index.filter()?.into()),
                None => None,
            };
            let segment = self.segments.get_mut(&id).expect("looked up above");
            segment.max_expires_at_ms = sealed.max_expires_at_ms;
            segment.sealed = Some(sealed);
            segment.index_file_bytes = index.as_ref().map_or(0, SegmentIndex::len);
            let index = index.map(Arc::new);
            self.catalog_mut().sealed.insert(id, SealedView { filter, index });
        }
        for (id, sealed) in orphans {
            let mut batch = sled::Batch::default();
            self.unindex(&mut batch, id, sealed);
            self.apply(batch)?;
        }
        Ok(())
    }

    fn apply(&mut self, batch: sled::Batch) -> Result<(), StoreError> {
        self.db.apply_batch(batch)?;
        self.index_dirty = true;
        self.measure_sled();
        Ok(())
    }

    /// sled writes its buffers when they fill or at a flush, so its files
    /// are measured after each write to it (a few a segment of ours).
    fn measure_sled(&mut self) {
        self.sled_bytes = self.db.size_on_disk().unwrap_or(self.sled_bytes);
    }

    fn flush_sled(&mut self) -> Result<(), StoreError> {
        self.db.flush()?;
        self.measure_sled();
        Ok(())
    }

    fn catalog_mut(&self) -> RwLockWriteGuard<'_, Catalog> {
        self.catalog.write().unwrap_or_else(|e| e.into_inner())
    }

    fn meta(&mut self, batch: &mut sled::Batch) {
        batch.insert(index::FORMAT, &index::FORMAT_VERSION.to_be_bytes()[..]);
        batch.insert(index::NEXT_MODEL, &self.next_model.to_be_bytes()[..]);
        batch.insert(index::MIN_LIVE, &self.min_live.to_be_bytes()[..]);
        batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
        self.meta_pending = false;
    }

    /// Reads a segment the index does not have and seals it: its live
    /// records (the later of two of a key wins, an expired one is left
    /// out). Answers how many entries it indexed.
    fn seal_from_file(&mut self, id: u64) -> Result<u64, StoreError> {
        let now = crate::telemetry::unix_now_ms();
        let bytes = match vlog::read(&self.dir, id) {
            Ok(bytes) => bytes,
            Err(e) => {
                // Sealed empty, so that it is not read again; evicted in turn.
                tracing::warn!("disk cache: {e}; its answers are not served");
                self.seal(id, Vec::new(), 0)?;
                return Ok(0);
            }
        };
        let mut found: HashMap<(u32, u64), Location> = HashMap::new();
        let mut max_expires_at_ms = 0;
        for (offset, len, record) in vlog::records(&bytes, 0) {
            max_expires_at_ms = max_expires_at_ms.max(record.expires_at_ms);
            if record.expires_at_ms <= now {
                continue;
            }
            let model_id = self.model_id(&record.model)?;
            let at = Location { segment: id, offset: offset as u32, len };
            found.insert((model_id, index::hash(model_id, &record.key)), at);
        }
        let entries: Vec<Pending> = found.into_iter().map(|((m, h), at)| (m, h, at)).collect();
        let indexed = entries.len() as u64;
        self.seal(id, entries, max_expires_at_ms)?;
        Ok(indexed)
    }

    /// Writes a segment's entries and filter to its index file, then its
    /// figures to sled in one batch, then hands them to the catalog.
    fn seal(&mut self, id: u64, entries: Vec<Pending>, max_expires_at_ms: u64) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        if self.meta_pending {
            self.meta(&mut batch);
        }
        let count = entries.len() as u64;
        let buckets = index::buckets_for(count);
        let (mut filter, mut index) = (None, None);
        if count > 0 {
            let mut by_bucket: Vec<Bucket> = vec![Bucket::default(); buckets as usize];
            let mut hashes = Vec::with_capacity(entries.len());
            for (model_id, hash, at) in entries {
                by_bucket[index::bucket_of(hash, buckets) as usize].0.push(Entry {
                    model_id,
                    hash,
                    offset: at.offset,
                    len: at.len,
                });
                hashes.push(hash);
            }
            let filter_bytes = SegmentFilter::build(hashes).unwrap_or_default();
            index = Some(Arc::new(SegmentIndex::write(&self.dir, id, &by_bucket, &filter_bytes)?));
            filter = SegmentFilter::load(filter_bytes.into());
        }
        let sealed = Sealed { max_expires_at_ms, entries: count, buckets };
        batch.insert(&index::sealed_key(id)[..], &sealed.encode()[..]);
        self.entries += count;
        batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
        self.apply(batch)?;
        if let Some(segment) = self.segments.get_mut(&id) {
            segment.sealed = Some(sealed);
            segment.max_expires_at_ms = max_expires_at_ms;
            segment.index_file_bytes = index.as_ref().map_or(0, |i| i.len());
        }
        self.catalog_mut().sealed.insert(id, SealedView { filter, index });
        Ok(())
    }

    /// Removes a sealed segment's figures in `batch` (its index file goes
    /// with its records).
    fn unindex(&mut self, batch: &mut sled::Batch, id: u64, sealed: Sealed) {
        batch.remove(&index::sealed_key(id)[..]);
        self.entries = self.entries.saturating_sub(sealed.entries);
        batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
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
        self.apply(batch)?;
        self.models.insert(model.to_string(), id);
        self.catalog_mut().models.insert(model.to_string(), id);
        Ok(id)
    }

    /// What the bound counts: every file of the store. The segments, the
    /// sealed ones' index files, a charge for the index file the active one
    /// will get, and sled's files with room for the buffers it has not
    /// written yet.
    pub fn bytes(&self) -> u64 {
        let active_entries = self.active.entries + self.pending.len() as u64;
        self.log_bytes + self.index_file_bytes() + active_entries * INDEX_CHARGE + self.sled_charge()
    }

    fn index_file_bytes(&self) -> u64 {
        self.segments.values().map(|s| s.index_file_bytes).sum()
    }

    /// sled's files and two of its segments: the buffer it fills and the
    /// one it may be writing out, which the last measure did not see.
    fn sled_charge(&self) -> u64 {
        self.sled_bytes + 2 * INDEX_SEGMENT as u64
    }

    /// Entries a read can find: the sealed segments' and the active one's.
    pub fn entries(&self) -> u64 {
        self.entries + self.active.entries
    }

    pub fn min_live(&self) -> u64 {
        self.min_live
    }

    /// The index, for the reader: sled's tree and the catalog beside it.
    pub fn index_view(&self) -> (sled::Tree, Arc<RwLock<Catalog>>) {
        ((*self.db).clone(), self.catalog.clone())
    }

    /// What sled's files take.
    pub fn sled_bytes(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }

    /// sled's files outgrew a floor (a sixteenth of the bound, 256 KiB to
    /// 16 MiB) and `at_least` (twice what the last rebuild left): time to
    /// build it again from the segments, as the bound that counts them
    /// squeezes the answers. It holds a few bytes a segment, so only a
    /// fault would get it there; the writer checks on its timer.
    pub fn sled_outgrown(&self, at_least: u64) -> bool {
        let floor = (self.capacity / 16).clamp(256 << 10, 16 << 20);
        self.sled_bytes() > floor.max(at_least)
    }

    /// What the files take: the segments, their index files and sled's.
    pub fn size_on_disk(&self) -> u64 {
        self.log_bytes + self.index_file_bytes() + self.sled_bytes()
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
        self.pending.push((model_id, index::hash(model_id, key), at));
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

    /// Writes the group to the active segment, then lets reads find it:
    /// data first.
    pub fn commit(&mut self) -> Result<(), StoreError> {
        if self.group.is_empty() {
            return Ok(());
        }
        self.active.file.write_all(&self.group)?;
        self.active.len += self.group.len() as u64;
        self.group.clear();
        let pending = std::mem::take(&mut self.pending);
        let mut catalog = self.catalog.write().unwrap_or_else(|e| e.into_inner());
        for (model_id, hash, at) in pending {
            self.active.entries += catalog.active.insert((model_id, hash), at).is_none() as u64;
        }
        Ok(())
    }

    /// Everything written so far on disk: the segment, then the index.
    /// sled's files, measured again, may have grown into the bound: the
    /// oldest segments make room for them.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.commit()?;
        self.active.file.sync_data()?;
        if std::mem::take(&mut self.index_dirty) {
            self.flush_sled()?;
            self.make_room(0)?;
        }
        Ok(())
    }

    /// Seals the active segment and starts the next.
    fn rotate(&mut self) -> Result<(), StoreError> {
        self.commit()?;
        let id = self.active.id;
        let entries: Vec<Pending> = {
            let catalog = self.catalog.read().unwrap_or_else(|e| e.into_inner());
            catalog.active.iter().map(|((m, h), at)| (*m, *h, *at)).collect()
        };
        let max_expires_at_ms = self.segments.get(&id).map_or(0, |s| s.max_expires_at_ms);
        // The records before their entries: a crash between the two
        // seals the segment again at the next open.
        self.active.file.sync_data()?;
        self.seal(id, entries, max_expires_at_ms)?;
        let next = id + 1;
        let file = vlog::create(&self.dir, next)?;
        self.active = Active { id: next, file, len: vlog::HEADER_LEN, entries: 0 };
        {
            let mut catalog = self.catalog_mut();
            catalog.active.clear();
            catalog.active_id = next;
        }
        self.segments.insert(next, Segment::unsealed(vlog::HEADER_LEN));
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

    /// Drops a sealed segment whole: its entries and the watermark in one
    /// batch, on disk before the file goes.
    fn evict(&mut self, id: u64) -> Result<(), StoreError> {
        let sealed = self.segments.get(&id).and_then(|s| s.sealed);
        let removed = sealed.map_or(0, |s| s.entries);
        self.catalog_mut().sealed.remove(&id);
        let mut batch = sled::Batch::default();
        if let Some(sealed) = sealed {
            self.unindex(&mut batch, id, sealed);
        }
        batch.insert(index::MIN_LIVE, &(id + 1).to_be_bytes()[..]);
        self.apply(batch)?;
        self.flush_sled()?;
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
        let hash = index::hash(model_id, key);
        if at.segment == self.active.id {
            self.commit()?;
            let mut catalog = self.catalog.write().unwrap_or_else(|e| e.into_inner());
            if catalog.active.get(&(model_id, hash)) == Some(&at) {
                catalog.active.remove(&(model_id, hash));
                self.active.entries -= 1;
            }
            return Ok(());
        }
        let gone = self.drop_entries(at.segment, |e| {
            e.model_id == model_id && e.hash == hash && e.offset == at.offset
        })?;
        if gone > 0 {
            let mut batch = sled::Batch::default();
            self.entries = self.entries.saturating_sub(gone);
            batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
            self.apply(batch)?;
        }
        Ok(())
    }

    /// Writes sealed segment `id`'s index file again without the entries
    /// `drop` picks, then its figures in sled (the caller writes the total):
    /// the file first, so that after a crash a removed entry stays removed
    /// and at worst the figures count it. Answers how many went.
    fn drop_entries(&mut self, id: u64, drop: impl Fn(&Entry) -> bool) -> Result<u64, StoreError> {
        let Some(mut sealed) = self.segments.get(&id).and_then(|s| s.sealed) else { return Ok(0) };
        let index = self
            .catalog
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .sealed
            .get(&id)
            .and_then(|v| v.index.clone());
        let Some(index) = index else { return Ok(0) };
        let mut buckets: Vec<Bucket> = index.all()?;
        let before: usize = buckets.iter().map(|b| b.0.len()).sum();
        for bucket in &mut buckets {
            bucket.0.retain(|e| !drop(e));
        }
        let gone = (before - buckets.iter().map(|b| b.0.len()).sum::<usize>()) as u64;
        if gone == 0 {
            return Ok(0);
        }
        // The filter of more keys than are left only answers "maybe" more.
        let rewritten = Arc::new(SegmentIndex::write(&self.dir, id, &buckets, &index.filter()?)?);
        let index_file_bytes = rewritten.len();
        if let Some(view) = self.catalog_mut().sealed.get_mut(&id) {
            view.index = Some(rewritten);
        }
        sealed.entries = sealed.entries.saturating_sub(gone);
        let mut batch = sled::Batch::default();
        batch.insert(&index::sealed_key(id)[..], &sealed.encode()[..]);
        self.apply(batch)?;
        let segment = self.segments.get_mut(&id).expect("looked up above");
        (segment.sealed, segment.index_file_bytes) = (Some(sealed), index_file_bytes);
        Ok(gone)
    }

    /// Removes every entry (of one model, or all); answers how many went.
    pub fn purge(&mut self, model: Option<&str>) -> Result<u64, StoreError> {
        self.commit()?;
        let removed = match model {
            Some(model) => {
                let Some(&model_id) = self.models.get(model) else { return Ok(0) };
                // The active segment's entries live only in the catalog and
                // its records would be indexed again from the file at the
                // next open: sealed first, its entries are purged below
                // like every other segment's.
                let in_active = self
                    .catalog
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .active
                    .keys()
                    .any(|(m, _)| *m == model_id);
                if in_active {
                    self.rotate()?;
                }
                let sealed: Vec<u64> =
                    self.segments.iter().filter(|(_, s)| s.sealed.is_some()).map(|(id, _)| *id).collect();
                let mut removed = 0;
                for id in sealed {
                    removed += self.drop_entries(id, |e| e.model_id == model_id)?;
                }
                let mut batch = sled::Batch::default();
                self.entries = self.entries.saturating_sub(removed);
                batch.insert(index::ENTRIES, &self.entries.to_be_bytes()[..]);
                self.apply(batch)?;
                removed
            }
            None => {
                // The files first: sealed figures left without their
                // segments are dropped at the next open, while segments
                // left without an index would be read back into one.
                let removed = self.entries();
                let next = self.active.id + 1;
                for id in self.segments.keys() {
                    remove_segment(&self.dir, *id)?;
                }
                self.db.clear()?;
                (self.entries, self.min_live, self.log_bytes) = (0, next, vlog::HEADER_LEN);
                self.segments.clear();
                self.models.clear();
                self.active = Active {
                    id: next,
                    file: vlog::create(&self.dir, next)?,
                    len: vlog::HEADER_LEN,
                    entries: 0,
                };
                self.segments.insert(next, Segment::unsealed(vlog::HEADER_LEN));
                *self.catalog_mut() = Catalog { active_id: next, ..Catalog::default() };
                let mut batch = sled::Batch::default();
                self.meta(&mut batch);
                self.apply(batch)?;
                removed
            }
        };
        self.flush_sled()?;
        Ok(removed)
    }

    /// Reads every segment and every index entry: what `cache check`
    /// reports. `repair`: the index is rebuilt from the segments first.
    pub fn check(&mut self, repair: bool) -> Result<CheckReport, StoreError> {
        self.commit()?;
        let mut report = CheckReport::default();
        if repair {
            self.db.clear()?;
            (self.entries, self.models, self.next_model) = (0, HashMap::new(), 0);
            self.meta_pending = true;
            {
                let mut catalog = self.catalog_mut();
                catalog.sealed.clear();
                catalog.models.clear();
            }
            let ids: Vec<u64> = self.segments.keys().copied().filter(|id| *id != self.active.id).collect();
            for id in ids {
                report.reindexed += self.seal_from_file(id)?;
            }
            if self.meta_pending {
                let mut batch = sled::Batch::default();
                self.meta(&mut batch);
                self.apply(batch)?;
            }
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
        let mut intact = |at: Location| {
            let file =
                files.entry(at.segment).or_insert_with(|| File::open(vlog::path(&self.dir, at.segment)).ok());
            let mut buf = vec![0u8; at.len as usize];
            file.as_ref().is_some_and(|f| f.read_exact_at(&mut buf, at.offset as u64).is_ok())
                && vlog::decode(&buf).is_some()
        };
        let indexes: Vec<(u64, Arc<SegmentIndex>)> = {
            let catalog = self.catalog.read().unwrap_or_else(|e| e.into_inner());
            catalog.sealed.iter().filter_map(|(id, view)| Some((*id, view.index.clone()?))).collect()
        };
        for (segment, index) in indexes {
            for e in index.all()?.into_iter().flat_map(|b| b.0) {
                report.entries += 1;
                report.dangling += !intact(Location { segment, offset: e.offset, len: e.len }) as u64;
            }
        }
        let active: Vec<Location> =
            self.catalog.read().unwrap_or_else(|e| e.into_inner()).active.values().copied().collect();
        for at in active {
            report.entries += 1;
            report.dangling += !intact(at) as u64;
        }
        report.counted = self.entries();
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

/// A segment's records, then its index file.
fn remove_segment(dir: &Path, id: u64) -> std::io::Result<()> {
    match std::fs::remove_file(vlog::path(dir, id)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    segment_index::remove(dir, id)
}

/// Index files whose segment is gone (an eviction or purge cut short
/// between its two unlinks), and rewrites a crash cut short.
fn remove_orphan_indexes(dir: &Path, segments: &BTreeMap<u64, Segment>) {
    let Ok(listing) = std::fs::read_dir(dir) else { return };
    for entry in listing.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let id = segment_index::id_of(&name);
        let orphan = match id {
            Some(id) => !segments.contains_key(&id),
            None => name.starts_with("seg-") && name.ends_with(".idx.new"),
        };
        if orphan {
            let _ = std::fs::remove_file(entry.path());
        }
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

/// sled's segment size: it holds a few bytes per segment of ours and the
/// model ids, so its own segments can be small, and its files (four
/// segments at least: 64 KiB, all counted in the bound) and I/O buffers
/// (one segment each) with them.
const INDEX_SEGMENT: usize = 16 << 10;

/// sled refuses files written with another segment size: those of the
/// layouts before this one (512 and 64 KiB), whose index is built again from the
/// segments anyway, go.
fn remove_other_layout(index_path: &Path) {
    let Ok(conf) = std::fs::read_to_string(index_path.join("conf")) else { return };
    if !conf.lines().any(|l| l.trim() == format!("segment_size: {INDEX_SEGMENT}")) {
        tracing::info!("disk cache: {} is of an earlier layout; building it again", index_path.display());
        let _ = std::fs::remove_dir_all(index_path);
    }
}

/// sled's own flusher thread wakes every `flush_every_ms` whether or not
/// anything was written; the writer flushes instead.
fn index_config(path: &Path, page_cache_bytes: u64) -> sled::Config {
    sled::Config::new()
        .path(path)
        .segment_size(INDEX_SEGMENT)
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
