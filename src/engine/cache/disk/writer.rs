//! The one owner of every write to the disk layer: a thread that drains
//! its queue in groups, appends them per 256 answers or 5 ms (one write
//! each, then the catalog, where reads find them), seals a segment into
//! the index once it is full, flushes a while after the first unflushed
//! write, sweeps expired segments, and reopens the store after an error
//! until a probe write succeeds.

use super::store::{Store, StoreError};
use super::{Op, Shared, WRITE_FAILED};
use crate::telemetry;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Probes of a layer turned off by an error: the first after this, then
/// twice as long each time, up to `PROBE_MAX`.
const PROBE_FIRST: Duration = Duration::from_secs(1);
const PROBE_MAX: Duration = Duration::from_secs(30);
/// How long a write may wait before the writer puts it on disk for good
/// (the segment synced, the index flushed): what a crash can lose.
const FLUSH_AFTER: Duration = Duration::from_millis(500);
/// Most ops taken into one group before it is written.
const GROUP: usize = 1024;
/// How long appended answers may wait to be written in one `write` with
/// those that follow: at 2,000 req/s a wake holds one or two, and a system
/// call and the catalog's lock per answer cost more than the answer.
/// Until written, an answer is served from the memory layer, or computed.
const COMMIT_AFTER: Duration = Duration::from_millis(5);
/// Answers that make a batch worth writing at once.
const COMMIT_AT: usize = 256;

pub(super) struct Writer {
    /// `None` while the layer is off after an error.
    store: Option<Store>,
    path: PathBuf,
    page_cache_bytes: u64,
    capacity: u64,
    shared: Arc<Shared>,
    /// What the index's files took after its last rebuild.
    rebuilt_sled_bytes: u64,
}

impl Writer {
    pub fn new(
        store: Store,
        path: &Path,
        page_cache_bytes: u64,
        capacity: u64,
        shared: Arc<Shared>,
    ) -> Writer {
        Writer {
            store: Some(store),
            path: path.to_path_buf(),
            page_cache_bytes,
            capacity,
            shared,
            rebuilt_sled_bytes: 0,
        }
    }

    pub fn run(mut self, rx: Receiver<Op>, sweep: Duration) {
        let mut next_sweep = Instant::now() + sweep;
        let mut probe = Probe::default();
        // When the oldest write not yet flushed is due on disk.
        let mut flush_due: Option<Instant> = None;
        // When the oldest answer not yet indexed is due in the index.
        let mut commit_due: Option<Instant> = None;
        loop {
            let wake = probe.due(self.live()).map_or(next_sweep, |at| at.min(next_sweep));
            let wake = flush_due.map_or(wake, |at| at.min(wake));
            let wake = commit_due.map_or(wake, |at| at.min(wake));
            let first = match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                Ok(op) => op,
                Err(RecvTimeoutError::Timeout) if commit_due.is_some_and(|at| at <= Instant::now()) => {
                    commit_due = None;
                    self.guard("writing answers", Store::commit);
                    continue;
                }
                Err(RecvTimeoutError::Timeout) if flush_due.is_some_and(|at| at <= Instant::now()) => {
                    flush_due = None;
                    commit_due = None;
                    self.flush();
                    if self.store.as_ref().is_some_and(|s| s.sled_outgrown(2 * self.rebuilt_sled_bytes)) {
                        self.rebuild_index();
                    }
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
                    self.guard("dropping expired segments", |s| s.sweep(crate::telemetry::unix_now_ms()));
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    if let Some(store) = &mut self.store {
                        let _ = store.flush();
                    }
                    return;
                }
            };
            // The op and whatever else is queued: one group, one write.
            let mut next = Some(first);
            let mut taken = 0;
            while let Some(op) = next.take() {
                if matches!(op, Op::Put { .. } | Op::Remove { .. }) && flush_due.is_none() {
                    flush_due = Some(Instant::now() + FLUSH_AFTER);
                }
                self.apply(op);
                taken += 1;
                if taken < GROUP {
                    next = rx.try_recv().ok();
                }
            }
            match self.store.as_ref().map_or(0, Store::uncommitted) {
                0 => commit_due = None,
                n if n >= COMMIT_AT => {
                    commit_due = None;
                    self.guard("writing answers", Store::commit);
                }
                _ => {
                    commit_due.get_or_insert_with(|| Instant::now() + COMMIT_AFTER);
                }
            }
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Put { model, key, stored_at_ms, expires_at_ms, body } => {
                self.guard("writing an answer", |s| s.put(&model, &key, stored_at_ms, expires_at_ms, &body))
            }
            Op::Remove { model, key, at } => self.guard("removing an entry", |s| s.remove(&model, &key, at)),
            Op::Purge { model, done } => {
                let result = match self.store.as_mut().filter(|_| self.shared.enabled.load(Ordering::Relaxed))
                {
                    Some(store) => {
                        store.purge(model.as_deref()).map_err(|e| super::DiskError::Store(e.to_string()))
                    }
                    None => Err(super::DiskError::Store("the disk cache is disabled".into())),
                };
                self.shared.generation.fetch_add(1, Ordering::Relaxed);
                self.publish();
                let _ = done.send(result);
            }
            Op::Flush(done) => {
                self.flush();
                let _ = done.send(());
            }
            Op::Wake => {}
        }
    }

    /// Everything written on disk for good; the files' size is looked up
    /// here, not after every group (a `stat` and a directory read).
    fn flush(&mut self) {
        self.guard("flushing", Store::flush);
        if let Some(store) = &self.store {
            self.shared.size_on_disk.store(store.size_on_disk(), Ordering::Relaxed);
        }
    }

    fn live(&self) -> bool {
        self.shared.enabled.load(Ordering::Relaxed)
    }

    /// After an error: opens the store again (a new segment, the index
    /// checked) and turns the layer back on once a probe write reaches the
    /// disk.
    fn reopen(&mut self) -> Result<(), String> {
        self.store = None;
        self.shared.set_index(None);
        let store = self.open_store()?;
        probe_write(&self.path).map_err(|e| format!("probe write: {e}"))?;
        self.install(store);
        self.shared.set_problem(None);
        self.shared.enabled.store(true, Ordering::SeqCst);
        metrics::gauge!(telemetry::CACHE_DISK_ENABLED).set(1.0);
        tracing::info!("disk cache re-enabled: {} is writable again", self.path.display());
        self.publish();
        Ok(())
    }

    /// Opens the store, waiting for a reader that may still hold the index
    /// a moment (sled's file lock goes with the last handle).
    fn open_store(&self) -> Result<Store, String> {
        let mut attempts = 0;
        loop {
            match Store::open(&self.path, self.capacity, self.page_cache_bytes) {
                Ok((store, _)) => return Ok(store),
                Err(super::DiskError::Locked(_)) if attempts < 40 => {
                    attempts += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    fn install(&mut self, store: Store) {
        self.shared.set_index(Some(store.index_view()));
        self.shared.min_live.store(store.min_live(), Ordering::Relaxed);
        self.shared.size_on_disk.store(store.size_on_disk(), Ordering::Relaxed);
        self.store = Some(store);
        self.publish();
    }

    /// sled reclaims the space of replaced entries lazily, so under churn
    /// the index's files grow far past what it holds: past the segments'
    /// own size the index is dropped and built again from the segments
    /// (reads miss and writes wait meanwhile), as after a lost index.
    fn rebuild_index(&mut self) {
        let before = self.store.as_ref().map_or(0, Store::sled_bytes);
        let started = Instant::now();
        self.store = None;
        self.shared.set_index(None);
        // A read in flight lets go of the index.
        std::thread::sleep(Duration::from_millis(100));
        if let Err(e) = std::fs::remove_dir_all(self.path.join("index")) {
            return self.fail(format!("rebuilding the index: {e}"));
        }
        match self.open_store() {
            Ok(store) => {
                let after = store.sled_bytes();
                tracing::info!(
                    "disk cache index rebuilt from the segments in {:?}: its files took {before} bytes, now {after}",
                    started.elapsed()
                );
                metrics::counter!(telemetry::STORE_REBUILDS, "store" => "cache").increment(1);
                self.shared.index_rebuilds.fetch_add(1, Ordering::Relaxed);
                self.rebuilt_sled_bytes = after;
                self.install(store);
            }
            Err(e) => self.fail(format!("rebuilding the index: {e}")),
        }
    }

    /// Runs a write; an error (a full disk, a failing card) turns the layer
    /// off instead of failing requests, and lets go of the store: the
    /// probe opens it afresh.
    fn guard(&mut self, what: &str, f: impl FnOnce(&mut Store) -> Result<(), StoreError>) {
        if !self.live() {
            return;
        }
        let Some(store) = self.store.as_mut() else { return };
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(store))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.fail(format!("{what}: {e}")),
            Err(_) => self.fail(format!("{what}: the store panicked")),
        }
        self.publish();
    }

    fn fail(&mut self, detail: String) {
        self.shared.disable(WRITE_FAILED, detail);
        self.shared.set_index(None);
        self.store = None;
    }

    fn publish(&self) {
        let Some(store) = &self.store else { return };
        let (entries, bytes) = (store.entries(), store.bytes());
        self.shared.entries.store(entries, Ordering::Relaxed);
        self.shared.bytes.store(bytes, Ordering::Relaxed);
        self.shared.min_live.store(store.min_live(), Ordering::Relaxed);
        metrics::gauge!(telemetry::CACHE_ENTRIES, "layer" => "disk").set(entries as f64);
        metrics::gauge!(telemetry::CACHE_BYTES, "layer" => "disk").set(bytes as f64);
    }
}

/// A page written and synced beside the store, then removed: the disk
/// takes writes again.
fn probe_write(dir: &Path) -> std::io::Result<()> {
    use std::io::Write;
    let path = dir.join("probe");
    let result = std::fs::File::create(&path).and_then(|mut f| {
        f.write_all(&[0u8; 4096])?;
        f.sync_data()
    });
    let _ = std::fs::remove_file(&path);
    result
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
