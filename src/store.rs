//! sled stores on disk (the cloud spool; the cache's disk layer rebuilds its
//! index from its own segments instead, `engine/cache/disk`): sled
//! reclaims the space of removed records lazily, so under churn its files
//! grow to several times what it holds. A store whose files outgrow their
//! bound is rebuilt: its live records copied into a fresh store beside it,
//! which then takes its place.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How large a store's files may grow for `logical` bytes of records:
/// twice that, and never less than sled's own floor of a few segments.
pub fn disk_bound(logical: u64) -> u64 {
    logical.saturating_mul(2).max(logical.saturating_add(4 * 1024 * 1024))
}

/// Opens the store at `path`, waiting up to 2 s for a dropped handle's
/// flusher thread to let go of the file lock.
pub fn open(config: sled::Config) -> sled::Result<sled::Db> {
    let mut tries = 0;
    loop {
        match config.open() {
            Err(sled::Error::Io(e)) if e.to_string().contains("could not acquire lock") && tries < 40 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// Why a rebuild did not take, with the store to go on with (the old one,
/// or the rebuilt one reopened) when there is one.
pub struct NotRebuilt {
    pub db: Option<sled::Db>,
    pub why: String,
}

/// Rebuilds the store at `path`: `copy` fills a fresh store from `old`,
/// then `old` is dropped (the caller holds no other handle to it) and the
/// fresh one takes its place. On an error before the swap, `old` comes
/// back unchanged.
pub fn rebuild(
    path: &Path,
    old: sled::Db,
    config: impl Fn(&Path) -> sled::Config,
    copy: impl FnOnce(&sled::Db, &sled::Db) -> sled::Result<()>,
) -> Result<sled::Db, NotRebuilt> {
    let (fresh_path, old_path) = (beside(path, "rebuilding"), beside(path, "replaced"));
    let _ = std::fs::remove_dir_all(&fresh_path);
    let built = (|| -> sled::Result<()> {
        let fresh = open(config(&fresh_path))?;
        copy(&old, &fresh)?;
        fresh.flush()?;
        Ok(())
    })();
    if let Err(e) = built {
        let _ = std::fs::remove_dir_all(&fresh_path);
        return Err(NotRebuilt { db: Some(old), why: format!("copying into {}: {e}", fresh_path.display()) });
    }
    let _ = old.flush();
    drop(old);
    let _ = std::fs::remove_dir_all(&old_path);
    if let Err(e) = std::fs::rename(path, &old_path) {
        let _ = std::fs::remove_dir_all(&fresh_path);
        let db = open(config(path)).ok();
        return Err(NotRebuilt { db, why: format!("moving the old store aside: {e}") });
    }
    if let Err(e) = std::fs::rename(&fresh_path, path) {
        // The old one goes back where it was; if even that fails, both stay
        // on disk for `recover` at the next open, and nothing is opened at
        // `path` (sled would make an empty store there).
        let why = format!("swapping in the rebuilt store: {e}");
        if std::fs::rename(&old_path, path).is_err() {
            return Err(NotRebuilt { db: None, why });
        }
        let _ = std::fs::remove_dir_all(&fresh_path);
        return Err(NotRebuilt { db: open(config(path)).ok(), why });
    }
    let _ = std::fs::remove_dir_all(&old_path);
    open(config(path)).map_err(|e| NotRebuilt { db: None, why: format!("opening the rebuilt store: {e}") })
}

fn beside(path: &Path, suffix: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!("{name}.{suffix}"))
}

/// Before opening `path`: a rebuild interrupted between its two renames
/// (a crash, a failed rename) left the store beside it. The old one, which
/// is complete, goes back; a half-built copy is removed.
pub fn recover(path: &Path) {
    let (fresh_path, old_path) = (beside(path, "rebuilding"), beside(path, "replaced"));
    if !path.exists() && old_path.exists() && std::fs::rename(&old_path, path).is_ok() {
        tracing::warn!("{}: restored the store an interrupted rebuild had moved aside", path.display());
    }
    if path.exists() {
        let _ = std::fs::remove_dir_all(&fresh_path);
        let _ = std::fs::remove_dir_all(&old_path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupted_rebuild_is_undone_at_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        {
            let db = open(sled::Config::new().path(beside(&path, "replaced"))).unwrap();
            db.insert(b"k", b"v").unwrap();
            db.flush().unwrap();
        }
        std::fs::create_dir(beside(&path, "rebuilding")).unwrap();
        recover(&path);
        assert!(!beside(&path, "replaced").exists() && !beside(&path, "rebuilding").exists());
        let db = open(sled::Config::new().path(&path)).unwrap();
        assert_eq!(db.get(b"k").unwrap().as_deref(), Some(&b"v"[..]), "the old store is back");
    }
}
