//! The disk layer: answers in a value log under `node.state_dir/cache`
//! (append-only segments, `vlog.rs`), found through a small sled index
//! (`index.rs`), so the OS page cache, not the process, holds the data and
//! the node's memory does not follow the size of its files.
//!
//! Two threads own it. Every write (store, remove, evict, sweep, purge)
//! goes through the writer (`writer.rs`, driving `store.rs`), so the
//! figures it keeps are exact. Every read goes through the reader
//! (`reader.rs`): one index lookup and one positioned read, checked
//! against the record's key and CRC. A request waits for it at most
//! `cache.disk_read_timeout_ms`, then counts a miss and runs the model, so
//! a slow disk costs a miss and never holds a runtime worker or a reply.
//!
//! An I/O error (a full disk, a failing card) turns the layer off instead
//! of failing requests; the writer reopens the store, with backoff, until a
//! probe write succeeds: then the layer is back on its own.

mod index;
mod reader;
mod segment_index;
mod store;
mod vlog;
mod writer;

pub use store::CheckReport;

use super::key::Key;
use crate::telemetry;
use index::Location;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Writes waiting for the writer; beyond it new entries are dropped (the
/// answer is still in memory) and counted.
const QUEUE: usize = 4096;
/// Lookups waiting for the reader; beyond it a lookup is a miss at once.
const READ_QUEUE: usize = 256;

/// What a read found.
pub enum Read {
    Hit { body: Vec<u8>, expires_at_ms: u64 },
    Miss,
}

/// Where the disk layer stands, for status and `cache stats`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DiskStats {
    pub enabled: bool,
    pub entries: u64,
    /// Bytes the bound counts: every file of the layer, with room for
    /// what sled has not written yet.
    pub bytes: u64,
    pub capacity_bytes: u64,
    /// What its files take: the segments, their index files and sled's.
    pub size_on_disk: u64,
    pub path: PathBuf,
    /// Why the layer is off, or what happened when it was opened, with the
    /// details (`cache stats`, answered on loopback only).
    pub problem: Option<String>,
    /// The same in a few words and no paths, for the retained status.
    #[serde(skip)]
    pub reason: Option<&'static str>,
}

/// What went wrong: a short reason for the status, the details for the
/// log and `cache stats`.
#[derive(Debug, Clone)]
struct Problem {
    reason: &'static str,
    detail: String,
}

/// sled's tree and the catalog beside it (`index.rs`).
type IndexView = (sled::Tree, Arc<RwLock<index::Catalog>>);

/// What the writer publishes and the reader and the handle read.
struct Shared {
    enabled: AtomicBool,
    entries: AtomicU64,
    bytes: AtomicU64,
    size_on_disk: AtomicU64,
    /// Segments below it are gone; the reader lets go of their files.
    min_live: AtomicU64,
    /// Changes whenever model ids may have (a purge, a repair, a reopen):
    /// the reader forgets the ids it kept.
    generation: AtomicU64,
    /// Times the writer built the index again because its files outgrew it.
    index_rebuilds: AtomicU64,
    problem: Mutex<Option<Problem>>,
    /// The index; `None` while the layer is off or reopening.
    index: RwLock<Option<IndexView>>,
}

impl Shared {
    /// Turns the layer off until the writer's probe finds the store
    /// writable again: serving goes on from memory and the model.
    fn disable(&self, reason: &'static str, detail: String) {
        if self.enabled.swap(false, Ordering::SeqCst) {
            tracing::error!(
                "disk cache disabled: {detail}; serving continues without it, and the store is probed until it works again"
            );
            metrics::gauge!(telemetry::CACHE_DISK_ENABLED).set(0.0);
            metrics::counter!(telemetry::CACHE_DISK_ERRORS).increment(1);
        }
        self.set_problem(Some(Problem { reason, detail }));
    }

    fn set_problem(&self, problem: Option<Problem>) {
        *self.problem.lock().unwrap_or_else(|e| e.into_inner()) = problem;
    }

    fn problem(&self) -> Option<Problem> {
        self.problem.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The index as it is now (cheap handles), if the layer is on.
    fn index(&self) -> Option<IndexView> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        self.index.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the index certainly lacks `key` (`index::certainly_absent`),
    /// told without waiting on a lock: a held one leaves it to the reader.
    fn certainly_absent(&self, model: &str, key: &Key) -> bool {
        let Ok(index) = self.index.try_read() else { return false };
        index.as_ref().is_some_and(|(_, catalog)| index::certainly_absent(catalog, model, key))
    }

    fn set_index(&self, index: Option<IndexView>) {
        *self.index.write().unwrap_or_else(|e| e.into_inner()) = index;
        self.generation.fetch_add(1, Ordering::Relaxed);
    }
}

/// A writer-side error, as the status words it.
const WRITE_FAILED: &str =
    "writing to the disk failed (full, or failing); the disk layer is off until a probe write succeeds";
const READ_FAILED: &str = "reading from the disk failed; the disk layer is off until a probe write succeeds";

/// Why the disk layer could not be had, or could not do what was asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DiskError {
    #[error("{0} is in use by another process (another edgeinfer node?)")]
    Locked(PathBuf),
    #[error("cannot open {path}: {reason}")]
    Broken { path: PathBuf, reason: String },
    #[error("{broken}; moving it aside to {aside} failed too: {reason}")]
    NotMovedAside { broken: Box<DiskError>, aside: PathBuf, reason: String },
    #[error("cannot create {path}: {reason}")]
    Create { path: PathBuf, reason: String },
    #[error("cannot start the cache writer thread: {0}")]
    Thread(String),
    #[error("the cache writer has stopped")]
    WriterStopped,
    #[error("{0}")]
    Store(String),
}

impl DiskError {
    /// A few words and no paths, for the retained status (the log and
    /// `cache stats` have the rest).
    pub fn reason(&self) -> &'static str {
        match self {
            DiskError::Locked(_) => "the store is in use by another process",
            DiskError::Broken { .. } | DiskError::NotMovedAside { .. } => "the store cannot be opened",
            DiskError::Create { .. } => "the store's directory cannot be created",
            DiskError::Thread(_) => "the cache writer thread cannot start",
            DiskError::WriterStopped => "the cache writer has stopped",
            DiskError::Store(_) => "the store failed",
        }
    }
}

enum Op {
    Put {
        model: String,
        key: Key,
        stored_at_ms: u64,
        expires_at_ms: u64,
        body: Vec<u8>,
    },
    /// A read found the entry damaged or pointing at nothing.
    Remove {
        model: String,
        key: Key,
        at: Location,
    },
    Purge {
        model: Option<String>,
        done: tokio::sync::oneshot::Sender<Result<u64, DiskError>>,
    },
    Flush(tokio::sync::oneshot::Sender<()>),
    /// Nothing to do but look again when to probe (a reader turned the
    /// layer off).
    Wake,
}

/// How the disk layer is sized and how long a request waits for it.
#[derive(Debug, Clone, Copy)]
pub struct DiskOptions {
    /// Bytes of segments and index before the oldest segment goes
    /// (`cache.disk_bytes`).
    pub capacity: u64,
    /// sled's own page cache for the index (`cache.disk_page_cache_bytes`).
    pub page_cache_bytes: u64,
    /// The longest a request waits for a read (`cache.disk_read_timeout_ms`).
    pub read_timeout: Duration,
    pub sweep: Duration,
}

/// A lookup for the reader: the model, the key, the time it was asked, and
/// where the answer goes (nobody listens once the request stopped waiting).
struct ReadOp {
    model: String,
    key: Key,
    now_ms: u64,
    reply: tokio::sync::oneshot::Sender<Read>,
}

pub struct Disk {
    path: PathBuf,
    capacity: u64,
    read_timeout: Duration,
    shared: Arc<Shared>,
    ops: SyncSender<Op>,
    reads: SyncSender<ReadOp>,
}

/// Why a request did not wait for the disk layer's answer (the
/// `reason` of `edgeinfer_cache_disk_reads_skipped_total`).
fn skipped(reason: &'static str) -> Read {
    metrics::counter!(telemetry::CACHE_DISK_READS_SKIPPED, "reason" => reason).increment(1);
    Read::Miss
}

impl Disk {
    /// Opens (or creates) the store at `path`. An index that cannot be
    /// opened is moved aside and rebuilt from the segments; only when even
    /// that fails (or another process holds the store) is there no disk
    /// layer.
    pub fn open(path: &Path, options: DiskOptions) -> Result<Disk, DiskError> {
        let DiskOptions { capacity, page_cache_bytes, read_timeout, sweep } = options;
        let (store, quarantined) = store::Store::open(path, capacity, page_cache_bytes)?;
        let problem = quarantined.map(|detail| {
            tracing::error!("cache store {}: {detail}", path.display());
            let reason = "the index could not be opened; moved it aside and rebuilt it from the segments";
            Problem { reason, detail }
        });
        let shared = Arc::new(Shared {
            enabled: AtomicBool::new(true),
            entries: AtomicU64::new(store.entries()),
            bytes: AtomicU64::new(store.bytes()),
            size_on_disk: AtomicU64::new(store.size_on_disk()),
            min_live: AtomicU64::new(store.min_live()),
            generation: AtomicU64::new(0),
            index_rebuilds: AtomicU64::new(0),
            problem: Mutex::new(problem),
            index: RwLock::new(Some(store.index_view())),
        });
        metrics::gauge!(telemetry::CACHE_DISK_ENABLED).set(1.0);
        let (ops, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let writer = writer::Writer::new(store, path, page_cache_bytes, capacity, shared.clone());
        std::thread::Builder::new()
            .name("cache-writer".into())
            .spawn(move || writer.run(rx, sweep))
            .map_err(|e| DiskError::Thread(e.to_string()))?;
        let (reads, read_rx) = std::sync::mpsc::sync_channel(READ_QUEUE);
        let reader = reader::Reader::new(path, shared.clone(), ops.clone());
        std::thread::Builder::new()
            .name("cache-reader".into())
            .spawn(move || reader.run(read_rx))
            .map_err(|e| DiskError::Thread(e.to_string()))?;
        Ok(Disk { path: path.to_path_buf(), capacity, read_timeout, shared, ops, reads })
    }

    pub fn enabled(&self) -> bool {
        self.shared.enabled.load(Ordering::Relaxed)
    }

    /// The live record under `key`, from the reader, if it answers within
    /// the read timeout; otherwise a miss (counted), and the request goes on.
    pub async fn get(&self, model: &str, key: &Key, now_ms: u64) -> Read {
        if !self.enabled() {
            return Read::Miss;
        }
        if self.shared.certainly_absent(model, key) {
            return Read::Miss;
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let op = ReadOp { model: model.to_string(), key: *key, now_ms, reply };
        if self.reads.try_send(op).is_err() {
            return skipped("busy");
        }
        match tokio::time::timeout(self.read_timeout, answer).await {
            Ok(Ok(read)) => read,
            Ok(Err(_)) => Read::Miss,
            Err(_) => skipped("slow"),
        }
    }

    /// Queues an answer for the writer; never blocks.
    pub fn put(&self, model: &str, key: Key, stored_at_ms: u64, expires_at_ms: u64, body: Vec<u8>) {
        if self.enabled() {
            to_writer(
                &self.ops,
                Op::Put { model: model.to_string(), key, stored_at_ms, expires_at_ms, body },
            );
        }
    }

    /// Removes every entry (of one model, or all); answers how many went.
    pub async fn purge(&self, model: Option<&str>) -> Result<u64, DiskError> {
        let (done, rx) = tokio::sync::oneshot::channel();
        let op = Op::Purge { model: model.map(str::to_string), done };
        self.ops.send(op).map_err(|_| DiskError::WriterStopped)?;
        rx.await.map_err(|_| DiskError::WriterStopped)?
    }

    /// Waits until every queued write is on disk.
    pub async fn flush(&self) {
        let (done, rx) = tokio::sync::oneshot::channel();
        if self.ops.send(Op::Flush(done)).is_ok() {
            let _ = rx.await;
        }
    }

    pub fn stats(&self) -> DiskStats {
        let problem = self.shared.problem();
        DiskStats {
            enabled: self.enabled(),
            entries: self.shared.entries.load(Ordering::Relaxed),
            bytes: self.shared.bytes.load(Ordering::Relaxed),
            capacity_bytes: self.capacity,
            size_on_disk: self.shared.size_on_disk.load(Ordering::Relaxed),
            path: self.path.clone(),
            reason: problem.as_ref().map(|p| p.reason),
            problem: problem.map(|p| p.detail),
        }
    }
}

/// Reads every segment and index entry of the store at `path` (no node
/// may hold it): `edgeinfer cache check`. `repair` rebuilds the index from
/// the segments first.
pub fn check(
    path: &Path,
    capacity: u64,
    page_cache_bytes: u64,
    repair: bool,
) -> Result<CheckReport, DiskError> {
    let (mut store, _) = store::Store::open(path, capacity, page_cache_bytes)?;
    let report = store.check(repair).map_err(|e| DiskError::Store(e.to_string()))?;
    store.flush().map_err(|e| DiskError::Store(e.to_string()))?;
    Ok(report)
}

/// Queues `op` for the writer without waiting; a full queue drops it, counted.
fn to_writer(ops: &SyncSender<Op>, op: Op) {
    if let Err(TrySendError::Full(_)) = ops.try_send(op) {
        metrics::counter!(telemetry::CACHE_WRITES_DROPPED).increment(1);
    }
}

#[cfg(test)]
mod tests;
