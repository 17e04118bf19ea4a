//! The one owner of reads: lookups wait here, in order, for one index
//! lookup and one positioned read each. What a read gets is checked (the
//! record's CRC, its key and model) before it is served; a damaged or
//! dangling entry is a miss, counted, and the writer removes it.

use super::index::{self, Catalog, Location};
use super::{Op, READ_FAILED, Read, ReadOp, Shared, vlog};
use crate::engine::cache::key::Key;
use crate::telemetry;
use std::collections::HashMap;
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, RwLock};

pub(super) struct Reader {
    path: PathBuf,
    shared: Arc<Shared>,
    /// To the writer: an entry to remove, or a wake-up to probe.
    ops: SyncSender<Op>,
    /// Open segments, by id; closed once evicted, so their space is freed.
    files: HashMap<u64, File>,
    /// Model ids as the index has them, until `generation` changes.
    models: HashMap<String, u32>,
    generation: u64,
    /// The watermark `files` was last pruned at.
    min_live: u64,
}

impl Reader {
    pub fn new(path: &Path, shared: Arc<Shared>, ops: SyncSender<Op>) -> Reader {
        Reader {
            path: path.to_path_buf(),
            shared,
            ops,
            files: HashMap::new(),
            models: HashMap::new(),
            generation: u64::MAX,
            min_live: 0,
        }
    }

    pub fn run(mut self, rx: Receiver<ReadOp>) {
        // Ends when the `Disk` (its sender) is dropped.
        while let Ok(ReadOp { model, key, now_ms, reply }) = rx.recv() {
            if reply.is_closed() {
                continue; // the request stopped waiting
            }
            slow_disk_read();
            let _ = reply.send(self.read(&model, &key, now_ms));
        }
    }

    fn read(&mut self, model: &str, key: &Key, now_ms: u64) -> Read {
        let Some((tree, catalog)) = self.shared.index() else { return Read::Miss };
        let generation = self.shared.generation.load(Ordering::Relaxed);
        if generation != self.generation {
            (self.models, self.generation) = (HashMap::new(), generation);
        }
        let min_live = self.shared.min_live.load(Ordering::Relaxed);
        if min_live != self.min_live {
            self.files.retain(|id, _| *id >= min_live);
            self.min_live = min_live;
        }
        let found = std::panic::catch_unwind(AssertUnwindSafe(|| self.locate(&tree, &catalog, model, key)));
        let at = match found {
            Ok(Ok(Some(at))) => at,
            Ok(Ok(None)) => return Read::Miss,
            Ok(Err(e)) => return self.failed(format!("reading the index in {}: {e}", self.path.display())),
            Err(_) => {
                return self.failed(format!("reading the index in {}: sled panicked", self.path.display()));
            }
        };
        if at.segment < min_live {
            return self.dangling(model, key, at);
        }
        let file = match self.files.entry(at.segment) {
            std::collections::hash_map::Entry::Occupied(f) => f.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                match File::open(vlog::path(&self.path, at.segment)) {
                    Ok(f) => v.insert(f),
                    Err(e) if e.kind() == ErrorKind::NotFound => return self.dangling(model, key, at),
                    Err(e) => return self.failed(format!("opening segment {:016x}: {e}", at.segment)),
                }
            }
        };
        let mut bytes = vec![0u8; at.len as usize];
        match file.read_exact_at(&mut bytes, at.offset as u64) {
            Ok(()) => {}
            // Shorter than the index says: written after a crash lost it.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return self.damaged(model, key, at),
            Err(e) => return self.failed(format!("reading segment {:016x}: {e}", at.segment)),
        }
        match vlog::decode(&bytes) {
            Some(r) if r.key != *key || r.model != model => self.damaged(model, key, at),
            Some(r) if r.expires_at_ms <= now_ms => Read::Miss,
            Some(r) => Read::Hit { body: r.body, expires_at_ms: r.expires_at_ms },
            _ => self.damaged(model, key, at),
        }
    }

    /// Where `key`'s record lies, if the index has it.
    fn locate(
        &mut self,
        tree: &sled::Tree,
        catalog: &RwLock<Catalog>,
        model: &str,
        key: &Key,
    ) -> std::io::Result<Option<Location>> {
        let model_id = match self.models.get(model) {
            Some(id) => *id,
            None => match index::u32_of(tree.get(index::model_key(model)).map_err(std::io::Error::other)?) {
                Some(id) => *self.models.entry(model.to_string()).or_insert(id),
                None => return Ok(None),
            },
        };
        index::lookup(catalog, model_id, key)
    }

    /// A record that does not check: never served, counted, removed.
    fn damaged(&self, model: &str, key: &Key, at: Location) -> Read {
        tracing::warn!("cache entry {} of model {model} failed its check; removed", key.hex());
        metrics::counter!(telemetry::CACHE_CORRUPT).increment(1);
        self.dangling(model, key, at)
    }

    /// An entry whose record is gone: a miss, and the writer removes it.
    fn dangling(&self, model: &str, key: &Key, at: Location) -> Read {
        super::to_writer(&self.ops, Op::Remove { model: model.to_string(), key: *key, at });
        Read::Miss
    }

    fn failed(&self, detail: String) -> Read {
        self.shared.disable(READ_FAILED, detail);
        super::to_writer(&self.ops, Op::Wake);
        Read::Miss
    }
}

/// Fail point `disk_read_delay`: `return(MS)` makes every disk read take
/// that much longer (a slow card, for the test that it costs a miss, not
/// a stall).
fn slow_disk_read() {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("disk_read_delay", |ms: Option<String>| {
        if let Some(ms) = ms.and_then(|ms| ms.parse().ok()) {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    });
}
