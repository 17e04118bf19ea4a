//! The disk layer: a sled store under `node.state_dir/cache`.
//!
//! Two threads own it. Every write (store, remove, evict, sweep, purge)
//! goes through the writer, so the byte count it keeps is exact. Every
//! read goes through the reader: a request waits for it at most
//! `cache.disk_read_timeout_ms`, then counts a miss and runs the model, so
//! a slow disk (or sled paging in, or cleaning its segments) costs a miss
//! and never holds a runtime worker or a reply. Each record carries a checksum over
//! its key and contents: a record torn by a crash, or damaged on disk, is
//! detected on read, deleted and counted, never served.
//!
//! An I/O error (a full disk, a failing card) turns the layer off instead
//! of failing requests. sled keeps such an error for the life of the store,
//! so the writer reopens it, with backoff, until a probe write succeeds:
//! then the layer is back on its own.

use super::key::Key;
use super::record::Record;
use crate::telemetry;
use serde::{Deserialize, Serialize};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Writes waiting for the writer; beyond it new entries are dropped (the
/// answer is still in memory) and counted.
const QUEUE: usize = 4096;
/// Lookups waiting for the reader; beyond it a lookup is a miss at once.
const READ_QUEUE: usize = 256;
const ORDER_TREE: &[u8] = b"order";
const MODEL_TREE_PREFIX: &str = "m:";
/// Probes of a layer turned off by an error: the first after this, then
/// twice as long each time, up to `PROBE_MAX`.
const PROBE_FIRST: Duration = Duration::from_secs(1);
const PROBE_MAX: Duration = Duration::from_secs(30);

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
    /// Bytes of keys and records the bound counts.
    pub bytes: u64,
    pub capacity_bytes: u64,
    /// What sled's files take, garbage included.
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

struct Shared {
    enabled: AtomicBool,
    entries: AtomicU64,
    bytes: AtomicU64,
    problem: Mutex<Option<Problem>>,
    /// The store; `None` only while the writer reopens it.
    db: RwLock<Option<sled::Db>>,
}

impl Shared {
    /// Only the writer changes the counts; saturating keeps a miscount
    /// (a record removed twice) from wrapping.
    fn sub_bytes(&self, n: u64) {
        let _ = self.bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_sub(n)));
    }

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

    /// The store as it is now (a cheap handle), if the layer is on.
    fn db(&self) -> Option<sled::Db> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        self.db.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A writer-side sled error, as the status words it.
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
    Remove {
        model: String,
        key: Key,
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
    /// Bytes of entries before the oldest go (`cache.disk_bytes`).
    pub capacity: u64,
    /// sled's own page cache (`cache.disk_page_cache_bytes`): small, the
    /// memory layer is the hot one.
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
    /// Opens (or creates) the store at `path`. A store that cannot be opened
    /// is moved aside and replaced by a fresh one; only when even that fails
    /// (or another process holds the store) is there no disk layer.
    pub fn open(path: &Path, options: DiskOptions) -> Result<Disk, DiskError> {
        let DiskOptions { capacity, page_cache_bytes, read_timeout, sweep } = options;
        let mut problem = None;
        let db = match open_db(path, page_cache_bytes) {
            Ok(db) => db,
            Err(locked @ DiskError::Locked(_)) => return Err(locked),
            Err(broken) => {
                let aside = quarantine_path(path);
                std::fs::rename(path, &aside).map_err(|r| DiskError::NotMovedAside {
                    broken: Box::new(broken.clone()),
                    aside: aside.clone(),
                    reason: r.to_string(),
                })?;
                let detail =
                    format!("{broken}; moved it aside to {} and started a fresh store", aside.display());
                tracing::error!("cache store {}: {detail}", path.display());
                metrics::counter!(telemetry::CACHE_QUARANTINED).increment(1);
                let reason = "the store could not be opened; moved it aside and started a fresh one";
                problem = Some(Problem { reason, detail });
                open_db(path, page_cache_bytes)?
            }
        };
        let shared = Arc::new(Shared {
            enabled: AtomicBool::new(true),
            entries: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            problem: Mutex::new(problem),
            db: RwLock::new(Some(db.clone())),
        });
        metrics::gauge!(telemetry::CACHE_DISK_ENABLED).set(1.0);
        let (ops, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let writer = Writer {
            db: Some(db),
            path: path.to_path_buf(),
            capacity,
            page_cache_bytes,
            shared: shared.clone(),
            seq: 0,
        };
        std::thread::Builder::new()
            .name("cache-writer".into())
            .spawn(move || writer.run(rx, sweep))
            .map_err(|e| DiskError::Thread(e.to_string()))?;
        let (reads, read_rx) = std::sync::mpsc::sync_channel(READ_QUEUE);
        let reader = Reader { path: path.to_path_buf(), shared: shared.clone(), ops: ops.clone() };
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
            self.send(Op::Put { model: model.to_string(), key, stored_at_ms, expires_at_ms, body });
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
            size_on_disk: self.shared.db().and_then(|db| db.size_on_disk().ok()).unwrap_or(0),
            path: self.path.clone(),
            reason: problem.as_ref().map(|p| p.reason),
            problem: problem.map(|p| p.detail),
        }
    }

    fn send(&self, op: Op) {
        to_writer(&self.ops, op);
    }
}

/// The one owner of reads: lookups wait here, in order, for sled.
struct Reader {
    path: PathBuf,
    shared: Arc<Shared>,
    /// To the writer: a damaged record to remove, or a wake-up to probe.
    ops: SyncSender<Op>,
}

impl Reader {
    fn run(self, rx: Receiver<ReadOp>) {
        // Ends when the `Disk` (its sender) is dropped.
        while let Ok(ReadOp { model, key, now_ms, reply }) = rx.recv() {
            if reply.is_closed() {
                continue; // the request stopped waiting
            }
            slow_disk_read();
            let _ = reply.send(self.read(&model, &key, now_ms));
        }
    }

    /// The live record under `key`; a damaged one is deleted, counted and
    /// reported as a miss.
    fn read(&self, model: &str, key: &Key, now_ms: u64) -> Read {
        let Some(db) = self.shared.db() else { return Read::Miss };
        let tree = tree_name(model);
        let got = std::panic::catch_unwind(AssertUnwindSafe(|| db.open_tree(&tree)?.get(key.0)));
        let bytes = match got {
            Ok(Ok(Some(bytes))) => bytes,
            Ok(Ok(None)) => return Read::Miss,
            Ok(Err(e)) => {
                self.shared.disable(READ_FAILED, format!("reading {}: {e}", self.path.display()));
                self.send(Op::Wake);
                return Read::Miss;
            }
            Err(_) => {
                self.shared.disable(READ_FAILED, format!("reading {}: sled panicked", self.path.display()));
                self.send(Op::Wake);
                return Read::Miss;
            }
        };
        match Record::decode(key, &bytes) {
            Some(r) if r.expires_at_ms > now_ms => Read::Hit { body: r.body, expires_at_ms: r.expires_at_ms },
            Some(_) => Read::Miss,
            None => {
                tracing::warn!("cache entry {} of model {model} failed its checksum; deleted", key.hex());
                metrics::counter!(telemetry::CACHE_CORRUPT).increment(1);
                self.send(Op::Remove { model: model.to_string(), key: *key });
                Read::Miss
            }
        }
    }

    fn send(&self, op: Op) {
        to_writer(&self.ops, op);
    }
}

/// Fail point `disk_read_delay`: `return(MS)` makes every disk read take
/// that much longer (a slow card, for the test that it costs a miss, not
/// a stall).
fn slow_disk_read() {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("disk_read_delay", |ms: Option<String>| {
        if let Some(ms) = ms.and_then(|ms| ms.parse().ok()) {
            std::thread::sleep(Duration::from_millis(ms));
        }
    });
}

/// Queues `op` for the writer without waiting; a full queue drops it, counted.
fn to_writer(ops: &SyncSender<Op>, op: Op) {
    if let Err(TrySendError::Full(_)) = ops.try_send(op) {
        metrics::counter!(telemetry::CACHE_WRITES_DROPPED).increment(1);
    }
}

/// sled's own flusher thread wakes every `flush_every_ms` whether or not
/// anything was written (5 wake-ups a second on an idle node); the writer
/// flushes instead, `FLUSH_AFTER` after the first write not yet flushed.
fn db_config(path: &Path, page_cache_bytes: u64) -> sled::Config {
    sled::Config::new()
        .path(path)
        .cache_capacity(page_cache_bytes)
        .mode(sled::Mode::LowSpace)
        .flush_every_ms(None)
}

/// How long a write may wait in sled's buffers before the writer flushes
/// it: sled's default flush interval, so a crash loses what it always did.
const FLUSH_AFTER: Duration = Duration::from_millis(500);

fn open_db(path: &Path, page_cache_bytes: u64) -> Result<sled::Db, DiskError> {
    crate::store::recover(path);
    let config = db_config(path, page_cache_bytes);
    let broken = |reason: String| DiskError::Broken { path: path.to_path_buf(), reason };
    // sled can panic on some kinds of damage rather than return an error.
    match std::panic::catch_unwind(AssertUnwindSafe(|| config.open())) {
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
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "cache".into());
    let mut aside = path.with_file_name(format!("{name}.quarantined-{stamp}"));
    let mut n = 1;
    while aside.exists() {
        aside = path.with_file_name(format!("{name}.quarantined-{stamp}-{n}"));
        n += 1;
    }
    aside
}

fn tree_name(model: &str) -> String {
    format!("{MODEL_TREE_PREFIX}{model}")
}

/// What one entry counts against the bound: its key and record, and its
/// place in the eviction order.
fn footprint(tree: &[u8], record_len: usize) -> u64 {
    (32 + record_len + 8 + tree.len() + 32) as u64
}

/// The one owner of every write to the store.
struct Writer {
    /// `None` only while a reopen after an error is under way.
    db: Option<sled::Db>,
    path: PathBuf,
    capacity: u64,
    page_cache_bytes: u64,
    shared: Arc<Shared>,
    seq: u64,
}

impl Writer {
    fn run(mut self, rx: Receiver<Op>, sweep: Duration) {
        if let Err(e) = self.count() {
            self.shared.disable(READ_FAILED, format!("scanning the store: {e}"));
        }
        let mut next_sweep = Instant::now() + sweep;
        let mut probe = Probe::default();
        // When the oldest write not yet flushed is due on disk.
        let mut flush_due: Option<Instant> = None;
        loop {
            let wake = probe.due(self.live()).map_or(next_sweep, |at| at.min(next_sweep));
            let wake = flush_due.map_or(wake, |at| at.min(wake));
            let op = match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                Ok(op) => op,
                Err(RecvTimeoutError::Timeout) if flush_due.is_some_and(|at| at <= Instant::now()) => {
                    flush_due = None;
                    self.guard("flushing", |w| w.db()?.flush().map(drop));
                    continue;
                }
                Err(RecvTimeoutError::Timeout)
                    if probe.due(self.live()).is_some_and(|at| at <= Instant::now()) =>
                {
                    match self.reopen() {
                        Ok(()) => probe = Probe::default(),
                        Err(e) => {
                            tracing::debug!("disk cache probe: {e}");
                            probe.failed();
                        }
                    }
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {
                    next_sweep = Instant::now() + sweep;
                    self.guard("sweeping expired entries", |w| w.sweep(crate::telemetry::unix_now_ms()));
                    self.rebuild_if_grown();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    if let Some(db) = &self.db {
                        let _ = db.flush();
                    }
                    return;
                }
            };
            if matches!(op, Op::Put { .. } | Op::Remove { .. }) && flush_due.is_none() {
                flush_due = Some(Instant::now() + FLUSH_AFTER);
            }
            match op {
                Op::Put { model, key, stored_at_ms, expires_at_ms, body } => {
                    self.guard("writing an entry", |w| w.put(&model, &key, stored_at_ms, expires_at_ms, body))
                }
                Op::Remove { model, key } => self.guard("removing an entry", |w| w.remove(&model, &key)),
                Op::Purge { model, done } => {
                    let result = self.purge(model.as_deref()).map_err(|e| DiskError::Store(e.to_string()));
                    let _ = done.send(result);
                }
                Op::Flush(done) => {
                    self.guard("flushing", |w| w.db()?.flush().map(drop));
                    let _ = done.send(());
                }
                Op::Wake => {}
            }
        }
    }

    fn live(&self) -> bool {
        self.shared.enabled.load(Ordering::Relaxed)
    }

    /// sled's files outgrew `store::disk_bound` of the entries' bound
    /// (it reclaims removed records lazily): rebuild the store. Reads miss
    /// meanwhile and writes wait in the queue.
    fn rebuild_if_grown(&mut self) {
        let Some(old) = self.db.as_ref().filter(|_| self.live()) else { return };
        let on_disk = old.size_on_disk().unwrap_or(0);
        if on_disk <= crate::store::disk_bound(self.capacity) {
            return;
        }
        *self.shared.db.write().unwrap_or_else(|e| e.into_inner()) = None;
        let old = self.db.take().expect("checked");
        let copy = |old: &sled::Db, fresh: &sled::Db| -> sled::Result<()> {
            for name in old.tree_names() {
                let (from, to) = (old.open_tree(&name)?, fresh.open_tree(&name)?);
                for item in from.iter() {
                    let (k, v) = item?;
                    to.insert(k, v)?;
                }
            }
            Ok(())
        };
        let rebuilt = std::panic::catch_unwind(AssertUnwindSafe(|| {
            crate::store::rebuild(&self.path, old, |p| db_config(p, self.page_cache_bytes), copy)
        }));
        let db = match rebuilt {
            Ok(Ok(db)) => {
                let now = db.size_on_disk().unwrap_or(0);
                tracing::info!("disk cache store rebuilt: its files took {on_disk} bytes, now {now}");
                metrics::counter!(telemetry::STORE_REBUILDS, "store" => "cache").increment(1);
                Some(db)
            }
            Ok(Err(not)) => {
                tracing::warn!("disk cache store not rebuilt: {}", not.why);
                not.db
            }
            Err(_) => None,
        };
        match db {
            Some(db) => {
                self.db = Some(db.clone());
                *self.shared.db.write().unwrap_or_else(|e| e.into_inner()) = Some(db);
                if let Err(e) = self.count() {
                    self.shared.disable(READ_FAILED, format!("scanning the rebuilt store: {e}"));
                }
            }
            // The probe reopens it.
            None => self.shared.disable(WRITE_FAILED, "rebuilding the store failed".into()),
        }
    }

    fn db(&self) -> sled::Result<&sled::Db> {
        self.db.as_ref().ok_or_else(|| sled::Error::Unsupported("the disk cache is being reopened".into()))
    }

    /// After an error: lets go of the store (sled keeps an I/O error for
    /// the life of a store), opens it again, and turns the layer back on
    /// once a probe write reaches the disk.
    fn reopen(&mut self) -> Result<(), String> {
        *self.shared.db.write().unwrap_or_else(|e| e.into_inner()) = None;
        self.db = None;
        // sled's flusher thread lets go of the file lock shortly after the
        // last handle is dropped.
        let mut attempts = 0;
        let db = loop {
            match open_db(&self.path, self.page_cache_bytes) {
                Ok(db) => break db,
                Err(DiskError::Locked(_)) if attempts < 40 => {
                    attempts += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                // Damaged (as at start): moved aside, and a fresh one made.
                Err(broken @ DiskError::Broken { .. }) if attempts < 40 => {
                    attempts = 40;
                    let aside = quarantine_path(&self.path);
                    std::fs::rename(&self.path, &aside)
                        .map_err(|e| format!("{broken}; moving it aside: {e}"))?;
                    tracing::error!(
                        "cache store {}: {broken}; moved it aside to {}",
                        self.path.display(),
                        aside.display()
                    );
                    metrics::counter!(telemetry::CACHE_QUARANTINED).increment(1);
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        let probe = std::panic::catch_unwind(AssertUnwindSafe(|| -> sled::Result<()> {
            db.insert(b"probe", vec![0u8; 4096])?;
            db.flush()?;
            db.remove(b"probe")?;
            db.flush()?;
            Ok(())
        }));
        match probe {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("probe write: {e}")),
            Err(_) => return Err("probe write: sled panicked".into()),
        }
        self.db = Some(db.clone());
        *self.shared.db.write().unwrap_or_else(|e| e.into_inner()) = Some(db);
        self.count().map_err(|e| format!("scanning the store: {e}"))?;
        self.shared.set_problem(None);
        self.shared.enabled.store(true, Ordering::SeqCst);
        metrics::gauge!(telemetry::CACHE_DISK_ENABLED).set(1.0);
        tracing::info!("disk cache re-enabled: {} is writable again", self.path.display());
        Ok(())
    }

    /// Runs a write; an I/O error (a full disk, a failing card) turns the
    /// layer off instead of failing requests.
    fn guard(&mut self, what: &str, f: impl FnOnce(&mut Self) -> sled::Result<()>) {
        if !self.live() {
            return;
        }
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.shared.disable(WRITE_FAILED, format!("{what}: {e}")),
            Err(_) => self.shared.disable(WRITE_FAILED, format!("{what}: sled panicked")),
        }
        self.publish();
    }

    fn publish(&self) {
        metrics::gauge!(telemetry::CACHE_ENTRIES, "layer" => "disk")
            .set(self.shared.entries.load(Ordering::Relaxed) as f64);
        metrics::gauge!(telemetry::CACHE_BYTES, "layer" => "disk")
            .set(self.shared.bytes.load(Ordering::Relaxed) as f64);
    }

    fn model_trees(&self) -> sled::Result<Vec<sled::IVec>> {
        let names = self.db()?.tree_names();
        Ok(names.into_iter().filter(|n| n.starts_with(MODEL_TREE_PREFIX.as_bytes())).collect())
    }

    /// Visits every record of every model tree: the tree's name, the tree,
    /// the key and the stored bytes, and the record if it is intact.
    fn scan(
        &self,
        mut visit: impl FnMut(&sled::IVec, &sled::Tree, Key, &sled::IVec, Option<Record>) -> sled::Result<()>,
    ) -> sled::Result<()> {
        for name in self.model_trees()? {
            let tree = self.db()?.open_tree(&name)?;
            for item in tree.iter() {
                let (k, v) = item?;
                let key = Key(k.as_ref().try_into().unwrap_or([0; 32]));
                let record = if k.len() == 32 { Record::decode(&key, &v) } else { None };
                visit(&name, &tree, key, &v, record)?;
            }
        }
        Ok(())
    }

    /// Recounts entries and bytes, dropping damaged records on the way.
    fn count(&mut self) -> sled::Result<()> {
        let (mut entries, mut bytes, mut seq) = (0, 0, 0);
        self.scan(|name, tree, key, value, record| {
            match record {
                Some(r) => {
                    entries += 1;
                    bytes += footprint(name, value.len());
                    seq = seq.max(r.seq);
                }
                None => {
                    metrics::counter!(telemetry::CACHE_CORRUPT).increment(1);
                    tree.remove(key.0)?;
                }
            }
            Ok(())
        })?;
        self.seq = self.seq.max(seq + 1);
        self.shared.entries.store(entries, Ordering::Relaxed);
        self.shared.bytes.store(bytes, Ordering::Relaxed);
        self.publish();
        Ok(())
    }

    fn put(
        &mut self,
        model: &str,
        key: &Key,
        stored_at_ms: u64,
        expires_at_ms: u64,
        body: Vec<u8>,
    ) -> sled::Result<()> {
        let name = tree_name(model);
        let tree = self.db()?.open_tree(&name)?;
        let seq = self.seq;
        self.seq += 1;
        let record = Record::seal(key, seq, stored_at_ms, expires_at_ms, body);
        let bytes = postcard::to_stdvec(&record).expect("a record always encodes");
        let size = footprint(name.as_bytes(), bytes.len());
        if size > self.capacity {
            return Ok(());
        }
        // Room first, so that the byte bound holds at every moment, not
        // only after each write (a stats read in between saw it exceeded).
        self.evict(size)?;
        let mut order_value = name.as_bytes().to_vec();
        order_value.extend_from_slice(&key.0);
        self.db()?.open_tree(ORDER_TREE)?.insert(seq.to_be_bytes(), order_value)?;
        match tree.insert(key.0, bytes)? {
            Some(old) => self.forget(name.as_bytes(), key, &old)?,
            None => {
                self.shared.entries.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.shared.bytes.fetch_add(size, Ordering::Relaxed);
        Ok(())
    }

    /// Accounts for a record that was replaced or removed.
    fn forget(&self, tree: &[u8], key: &Key, old: &[u8]) -> sled::Result<()> {
        self.shared.sub_bytes(footprint(tree, old.len()));
        if let Some(r) = Record::decode(key, old) {
            self.db()?.open_tree(ORDER_TREE)?.remove(r.seq.to_be_bytes())?;
        }
        Ok(())
    }

    fn remove(&mut self, model: &str, key: &Key) -> sled::Result<()> {
        let name = tree_name(model);
        if let Some(old) = self.db()?.open_tree(&name)?.remove(key.0)? {
            self.forget(name.as_bytes(), key, &old)?;
            self.shared.entries.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Drops the oldest entries until `incoming` more bytes fit the bound.
    fn evict(&mut self, incoming: u64) -> sled::Result<()> {
        let order = self.db()?.open_tree(ORDER_TREE)?;
        while self.shared.bytes.load(Ordering::Relaxed) + incoming > self.capacity {
            let Some((_, place)) = order.pop_min()? else { break };
            if place.len() < 32 {
                continue;
            }
            let (tree, key) = place.split_at(place.len() - 32);
            let key = Key(key.try_into().expect("32 bytes"));
            let t = self.db()?.open_tree(tree)?;
            if let Some(old) = t.remove(key.0)? {
                self.shared.sub_bytes(footprint(tree, old.len()));
                self.shared.entries.fetch_sub(1, Ordering::Relaxed);
                metrics::counter!(telemetry::CACHE_EVICTIONS, "layer" => "disk").increment(1);
            }
        }
        Ok(())
    }

    /// Removes expired and damaged entries.
    fn sweep(&mut self, now_ms: u64) -> sled::Result<()> {
        let mut gone = Vec::new();
        self.scan(|name, _, key, _, record| {
            match record {
                Some(r) if r.expires_at_ms > now_ms => return Ok(()),
                Some(_) => {}
                None => metrics::counter!(telemetry::CACHE_CORRUPT).increment(1),
            }
            gone.push((name.clone(), key));
            Ok(())
        })?;
        for (name, key) in gone {
            if let Some(old) = self.db()?.open_tree(&name)?.remove(key.0)? {
                self.forget(&name, &key, &old)?;
                self.shared.entries.fetch_sub(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn purge(&mut self, model: Option<&str>) -> sled::Result<u64> {
        if !self.live() {
            return Err(sled::Error::Unsupported("the disk cache is disabled".into()));
        }
        // Only trees that exist: a purge of a name never stored creates none.
        let names: Vec<sled::IVec> = self
            .model_trees()?
            .into_iter()
            .filter(|n| model.is_none_or(|m| n.as_ref() == tree_name(m).as_bytes()))
            .collect();
        let mut removed = 0;
        for name in &names {
            let tree = self.db()?.open_tree(name)?;
            removed += tree.len() as u64;
            tree.clear()?;
            if model.is_some() {
                self.db()?.drop_tree(name)?;
            }
        }
        let order = self.db()?.open_tree(ORDER_TREE)?;
        match model {
            None => order.clear()?,
            // The purged entries' places in the eviction order go too.
            Some(m) => {
                let tree = tree_name(m);
                for item in order.iter() {
                    let (seq, place) = item?;
                    if place.len() == tree.len() + 32 && place.starts_with(tree.as_bytes()) {
                        order.remove(seq)?;
                    }
                }
            }
        }
        self.count()?;
        self.db()?.flush()?;
        Ok(removed)
    }
}

/// When the writer next tries to reopen a store turned off by an error.
struct Probe {
    wait: Duration,
    at: Option<Instant>,
}

impl Default for Probe {
    fn default() -> Self {
        Probe { wait: PROBE_FIRST, at: None }
    }
}

impl Probe {
    /// The next probe while the layer is off (scheduled on first ask).
    fn due(&mut self, live: bool) -> Option<Instant> {
        if live {
            return None;
        }
        Some(*self.at.get_or_insert_with(|| Instant::now() + self.wait))
    }

    fn failed(&mut self) {
        self.wait = (self.wait * 2).min(PROBE_MAX);
        self.at = Some(Instant::now() + self.wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Key {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        Key(k)
    }

    fn open(dir: &Path, capacity: u64) -> Disk {
        Disk::open(&dir.join("cache"), options(capacity, Duration::from_secs(3600))).unwrap()
    }

    fn options(capacity: u64, sweep: Duration) -> DiskOptions {
        DiskOptions { capacity, page_cache_bytes: 4 << 20, read_timeout: Duration::from_secs(5), sweep }
    }

    fn body(i: u32) -> Vec<u8> {
        format!("answer {i}").into_bytes().repeat(10)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
    }

    #[test]
    fn a_record_that_fails_its_checksum_is_a_miss_and_is_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let disk = open(dir.path(), 1 << 20);
        disk.put("m", key(1), 10, u64::MAX, body(1));
        rt().block_on(disk.flush());
        assert!(matches!(rt().block_on(disk.get("m", &key(1), 20)), Read::Hit { .. }));
        // Flip one byte of the stored record, as a torn write or a bad card would.
        let tree = disk.shared.db().unwrap().open_tree(tree_name("m")).unwrap();
        let mut bytes = tree.get(key(1).0).unwrap().unwrap().to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        tree.insert(key(1).0, bytes).unwrap();
        assert!(matches!(rt().block_on(disk.get("m", &key(1), 20)), Read::Miss));
        rt().block_on(disk.flush());
        assert_eq!(tree.get(key(1).0).unwrap(), None, "the damaged record is gone");
        assert_eq!(disk.stats().entries, 0);
    }

    /// Issue 19: reads ran on the caller's thread, so a store held up (here
    /// by holding its lock, as a reopen does) held up the request.
    #[test]
    fn a_read_the_disk_does_not_answer_in_time_is_a_miss_and_the_next_one_is_served() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Disk::open(
            &dir.path().join("cache"),
            DiskOptions {
                read_timeout: Duration::from_millis(20),
                ..options(1 << 20, Duration::from_secs(3600))
            },
        )
        .unwrap();
        disk.put("m", key(1), 10, u64::MAX, body(1));
        rt().block_on(disk.flush());
        let held = disk.shared.db.write().unwrap();
        let started = Instant::now();
        assert!(matches!(rt().block_on(disk.get("m", &key(1), 20)), Read::Miss));
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        drop(held);
        // 20 ms is short on a busy machine: a few tries.
        let hit = (0..50).any(|_| matches!(rt().block_on(disk.get("m", &key(1), 20)), Read::Hit { .. }));
        assert!(hit, "served once free");
    }

    #[test]
    fn eviction_keeps_the_bytes_within_the_bound_and_drops_the_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let capacity = 4096;
        let disk = open(dir.path(), capacity);
        for i in 0..200 {
            disk.put("m", key(i), 10, u64::MAX, body(i));
        }
        rt().block_on(disk.flush());
        let stats = disk.stats();
        assert!(stats.bytes <= capacity && stats.bytes > capacity / 2, "{stats:?}");
        assert!(stats.entries > 5 && stats.entries < 200, "{stats:?}");
        assert!(matches!(rt().block_on(disk.get("m", &key(199), 20)), Read::Hit { .. }), "the newest stays");
        assert!(matches!(rt().block_on(disk.get("m", &key(0), 20)), Read::Miss), "the oldest went");
    }

    #[test]
    fn expired_records_are_misses_and_the_sweep_removes_them() {
        let dir = tempfile::tempdir().unwrap();
        let disk =
            Disk::open(&dir.path().join("cache"), options(1 << 20, Duration::from_millis(50))).unwrap();
        let now = crate::telemetry::unix_now_ms();
        disk.put("m", key(1), now, now + 1, body(1));
        disk.put("m", key(2), now, now + 3_600_000, body(2));
        rt().block_on(disk.flush());
        assert!(matches!(rt().block_on(disk.get("m", &key(1), now + 2)), Read::Miss));
        std::thread::sleep(Duration::from_millis(200));
        rt().block_on(disk.flush());
        assert_eq!(disk.stats().entries, 1, "{:?}", disk.stats());
        assert!(matches!(rt().block_on(disk.get("m", &key(2), now + 2)), Read::Hit { .. }));
    }

    #[test]
    fn a_store_whose_files_outgrow_their_bound_under_churn_is_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let capacity = 64 * 1024;
        let disk =
            Disk::open(&dir.path().join("cache"), options(capacity, Duration::from_millis(100))).unwrap();
        let big = |i: u32| format!("answer {i}").into_bytes().repeat(200);
        let mut peak = 0;
        for i in 0..6000 {
            disk.put("m", key(i), 10, u64::MAX, big(i));
            if i % 500 == 499 {
                rt().block_on(disk.flush());
                peak = peak.max(disk.stats().size_on_disk);
            }
        }
        rt().block_on(disk.flush());
        std::thread::sleep(Duration::from_millis(500));
        rt().block_on(disk.flush());
        let stats = disk.stats();
        let bound = crate::store::disk_bound(capacity);
        eprintln!("files at most {peak} bytes under churn, {} after; bound {bound}", stats.size_on_disk);
        assert!(peak > bound, "the churn grew the files past the bound ({peak} <= {bound})");
        assert!(stats.size_on_disk <= bound, "{stats:?}");
        assert!(stats.bytes <= capacity && stats.entries > 0, "{stats:?}");
        assert!(
            matches!(rt().block_on(disk.get("m", &key(5999), 20)), Read::Hit { .. }),
            "the newest entry survived"
        );
    }

    #[test]
    fn counts_survive_a_reopen_and_purge_by_model_leaves_the_others() {
        let dir = tempfile::tempdir().unwrap();
        {
            let disk = open(dir.path(), 1 << 20);
            for i in 0..10 {
                disk.put(if i % 2 == 0 { "a" } else { "b" }, key(i), 10, u64::MAX, body(i));
            }
            rt().block_on(disk.flush());
        }
        // The writer thread lets go of the store when the sender is dropped.
        std::thread::sleep(Duration::from_millis(300));
        let disk = open(dir.path(), 1 << 20);
        rt().block_on(disk.flush());
        let before = disk.stats();
        assert_eq!(before.entries, 10);
        assert_eq!(rt().block_on(disk.purge(Some("a"))), Ok(5));
        let after = disk.stats();
        assert_eq!(after.entries, 5);
        assert!(after.bytes < before.bytes);
        // Nothing of "a" is left behind, and purging a name never stored
        // creates nothing.
        let db = disk.shared.db().unwrap();
        let order = db.open_tree(ORDER_TREE).unwrap();
        assert_eq!(order.len(), 5, "only b's places in the eviction order are left");
        assert_eq!(rt().block_on(disk.purge(Some("never-stored"))), Ok(0));
        let trees: Vec<_> = db.tree_names().into_iter().filter(|n| n.starts_with(b"m:")).collect();
        assert_eq!(trees, vec![sled::IVec::from(tree_name("b").as_bytes())]);
        assert!(matches!(rt().block_on(disk.get("b", &key(1), 20)), Read::Hit { .. }));
        assert!(matches!(rt().block_on(disk.get("a", &key(0), 20)), Read::Miss));
    }
}
