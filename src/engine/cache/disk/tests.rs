//! The disk layer through its handle, and the crashes the value log must
//! survive (docs: `../shared/design/value-log.md`, "five crash tests").

use super::index::{self, Location};
use super::store::Store;
use super::*;
use std::time::Instant;

fn key(i: u32) -> Key {
    let mut k = [0u8; 32];
    k[..4].copy_from_slice(&i.to_le_bytes());
    Key(k)
}

/// The disk layer over `dir`, once the handle dropped before it let go of
/// the store.
fn open(dir: &Path, capacity: u64) -> Disk {
    once_unlocked(|| Disk::open(&dir.join("cache"), options(capacity, Duration::from_secs(3600))))
}

/// What `open` gives once the store is free: sled's flusher thread holds
/// its lock a moment after a drop, longer on a loaded machine.
fn once_unlocked<T>(open: impl Fn() -> Result<T, DiskError>) -> T {
    for _ in 0..40 {
        match open() {
            Ok(opened) => return opened,
            Err(DiskError::Locked(_)) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("{e}"),
        }
    }
    panic!("the store stayed locked");
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

fn hit(disk: &Disk, model: &str, i: u32) -> Option<Vec<u8>> {
    match rt().block_on(disk.get(model, &key(i), 20)) {
        Read::Hit { body, .. } => Some(body),
        Read::Miss => None,
    }
}

/// A store in `dir` holding answers 0..n of model `m`, written, on disk
/// and let go of; what its handle last said of it.
fn filled(dir: &Path, capacity: u64, n: u32) -> DiskStats {
    let disk = open(dir, capacity);
    for i in 0..n {
        disk.put("m", key(i), 10, u64::MAX, body(i));
    }
    rt().block_on(disk.flush());
    let stats = disk.stats();
    closed(disk);
    stats
}

/// Waits until the handle's threads let go of the store (its lock).
fn closed(disk: Disk) {
    drop(disk);
    std::thread::sleep(Duration::from_millis(300));
}

/// The store itself, as the writer would have it, once no handle holds it.
fn store(dir: &Path, capacity: u64) -> Store {
    once_unlocked(|| Store::open(&dir.join("cache"), capacity, 4 << 20)).0
}

fn segments(dir: &Path) -> Vec<(u64, u64)> {
    vlog::list(&dir.join("cache")).unwrap()
}

#[test]
fn a_record_that_fails_its_check_is_a_miss_and_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    disk.put("m", key(1), 10, u64::MAX, body(1));
    disk.put("m", key(2), 10, u64::MAX, body(2));
    rt().block_on(disk.flush());
    assert_eq!(hit(&disk, "m", 1), Some(body(1)));
    // Flip one byte of the first record's body, as a bad card would.
    let (id, _) = segments(dir.path())[0];
    let path = vlog::path(&dir.path().join("cache"), id);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(8).position(|w| w == b"answer 1").unwrap();
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    assert_eq!(hit(&disk, "m", 1), None);
    rt().block_on(disk.flush());
    assert_eq!(disk.stats().entries, 1, "the damaged entry is gone, the other stays");
    assert_eq!(hit(&disk, "m", 2), Some(body(2)));
}

/// Issue 19: reads ran on the caller's thread, so a store held up (here
/// by holding the index's lock, as a reopen does) held up the request.
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
    let held = disk.shared.index.write().unwrap();
    let started = Instant::now();
    assert!(matches!(rt().block_on(disk.get("m", &key(1), 20)), Read::Miss));
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    drop(held);
    // 20 ms is short on a busy machine: a few tries.
    let hit = (0..50).any(|_| matches!(rt().block_on(disk.get("m", &key(1), 20)), Read::Hit { .. }));
    assert!(hit, "served once free");
}

#[test]
fn eviction_keeps_the_bytes_within_the_bound_and_drops_the_oldest_segment_first() {
    let dir = tempfile::tempdir().unwrap();
    // 4 KiB segments; sled's files take about 100 KiB of the bound.
    let capacity = 256 * 1024;
    let disk = open(dir.path(), capacity);
    for i in 0..4000 {
        disk.put("m", key(i), 10, u64::MAX, body(i));
        if i % 500 == 499 {
            rt().block_on(disk.flush());
            assert!(disk.stats().bytes <= capacity, "{:?}", disk.stats());
        }
    }
    rt().block_on(disk.flush());
    let stats = disk.stats();
    assert!(stats.bytes <= capacity && stats.bytes > capacity / 2, "{stats:?}");
    assert!(stats.entries > 200 && stats.entries < 4000, "{stats:?}");
    assert_eq!(hit(&disk, "m", 3999), Some(body(3999)), "the newest stays");
    assert_eq!(hit(&disk, "m", 0), None, "the oldest went");
    assert!(stats.size_on_disk <= capacity, "every file ({}) is within the bound", stats.size_on_disk);
}

#[test]
fn expired_answers_are_misses_and_a_segment_whose_answers_all_expired_goes() {
    let dir = tempfile::tempdir().unwrap();
    // 4 KiB segments: the two short-lived answers fill one, the long-lived one the next.
    let disk = Disk::open(&dir.path().join("cache"), options(256 * 1024, Duration::from_millis(50))).unwrap();
    let now = crate::telemetry::unix_now_ms();
    let long = |i: u32| format!("answer {i}").into_bytes().repeat(200);
    disk.put("m", key(1), now, now + 1, long(1));
    disk.put("m", key(2), now, now + 1, long(2));
    disk.put("m", key(3), now, now + 3_600_000, long(3));
    rt().block_on(disk.flush());
    assert_eq!(disk.stats().entries, 3);
    assert!(matches!(rt().block_on(disk.get("m", &key(1), now + 2)), Read::Miss));
    std::thread::sleep(Duration::from_millis(300));
    rt().block_on(disk.flush());
    assert_eq!(disk.stats().entries, 1, "{:?}", disk.stats());
    assert!(matches!(rt().block_on(disk.get("m", &key(3), now + 2)), Read::Hit { .. }));
}

#[test]
fn counts_survive_a_reopen_and_purge_by_model_leaves_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    for i in 0..10 {
        disk.put(if i % 2 == 0 { "a" } else { "b" }, key(i), 10, u64::MAX, body(i));
    }
    rt().block_on(disk.flush());
    closed(disk);
    let disk = open(dir.path(), 1 << 20);
    let before = disk.stats();
    assert_eq!(before.entries, 10);
    assert_eq!(rt().block_on(disk.purge(Some("a"))), Ok(5));
    assert_eq!(disk.stats().entries, 5);
    assert_eq!(rt().block_on(disk.purge(Some("never-stored"))), Ok(0));
    assert_eq!(hit(&disk, "b", 1), Some(body(1)));
    assert_eq!(hit(&disk, "a", 0), None);
    closed(disk);
    let mut store = store(dir.path(), 1 << 20);
    let report = store.check(false).unwrap();
    assert_eq!((report.entries, report.counted, report.dangling), (5, 5, 0), "{report:?}");
    drop(store);
    let disk = open(dir.path(), 1 << 20);
    assert_eq!(rt().block_on(disk.purge(None)), Ok(5));
    assert_eq!(disk.stats().entries, 0);
    assert_eq!(hit(&disk, "b", 1), None);
    assert_eq!(segments(dir.path()).len(), 1, "only the new active segment is left");
}

/// The active segment's entries are only in memory until it is sealed: a
/// purge there must not come back from the file at the next open.
#[test]
fn answers_purged_from_the_active_segment_stay_gone_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    for i in 0..6 {
        disk.put(if i % 2 == 0 { "a" } else { "b" }, key(i), 10, u64::MAX, body(i));
    }
    rt().block_on(disk.flush());
    assert_eq!(rt().block_on(disk.purge(Some("a"))), Ok(3));
    assert_eq!((hit(&disk, "a", 0), hit(&disk, "b", 1)), (None, Some(body(1))));
    closed(disk);
    let disk = open(dir.path(), 1 << 20);
    assert_eq!(disk.stats().entries, 3, "{:?}", disk.stats());
    assert_eq!((hit(&disk, "a", 0), hit(&disk, "a", 2), hit(&disk, "b", 3)), (None, None, Some(body(3))));
}

/// Crash test 1: a segment's tail torn at every byte of its last record.
#[test]
fn a_torn_tail_keeps_the_records_before_it_and_new_writes_go_to_a_new_segment() {
    let dir = tempfile::tempdir().unwrap();
    filled(dir.path(), 1 << 20, 3);
    let (id, len) = *segments(dir.path()).iter().find(|(_, len)| *len > vlog::HEADER_LEN).unwrap();
    let path = vlog::path(&dir.path().join("cache"), id);
    let whole = std::fs::read(&path).unwrap();
    let last = vlog::records(&whole, 0).last().unwrap().0 as usize;
    for cut in (last..len as usize).step_by(7) {
        std::fs::write(&path, &whole[..cut]).unwrap();
        let disk = open(dir.path(), 1 << 20);
        assert_eq!(hit(&disk, "m", 0), Some(body(0)), "cut at {cut}");
        assert_eq!(hit(&disk, "m", 1), Some(body(1)), "cut at {cut}");
        assert_eq!(hit(&disk, "m", 2), None, "cut at {cut}: the torn record is a miss");
        closed(disk);
    }
    let torn = std::fs::metadata(&path).unwrap().len();
    let disk = open(dir.path(), 1 << 20);
    disk.put("m", key(9), 10, u64::MAX, body(9));
    rt().block_on(disk.flush());
    assert_eq!(hit(&disk, "m", 9), Some(body(9)));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), torn, "a torn segment is never appended to");
}

/// Crash test 2 and 5: an index entry ahead of its data, or pointing at
/// another record, is a miss, never another answer.
#[test]
fn an_entry_pointing_past_its_data_or_at_another_record_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    filled(dir.path(), 1 << 20, 3);
    // Reopened, the segment the handle wrote is sealed, its entries in its index file.
    let mut store = store(dir.path(), 1 << 20);
    let (tree, catalog) = store.index_view();
    let model_id = index::u32_of(tree.get(index::model_key("m")).unwrap()).unwrap();
    let at = |i| index::lookup(&catalog, model_id, &key(i)).unwrap().unwrap();
    let point = |i, to: Location| {
        let hash = index::hash(model_id, &key(i));
        let file = catalog.read().unwrap().sealed[&to.segment].index.clone().unwrap();
        let mut buckets = file.all().unwrap();
        let entry = buckets.iter_mut().flat_map(|b| b.0.iter_mut()).find(|e| e.hash == hash).unwrap();
        (entry.offset, entry.len) = (to.offset, to.len);
        let filter = file.filter().unwrap();
        let cache = dir.path().join("cache");
        let rewritten =
            super::segment_index::SegmentIndex::write(&cache, to.segment, &buckets, &filter).unwrap();
        catalog.write().unwrap().sealed.get_mut(&to.segment).unwrap().index = Some(Arc::new(rewritten));
    };
    let (zero, one) = (at(0), at(1));
    point(0, one);
    point(1, Location { offset: one.offset + 1_000_000, ..one });
    assert!(zero != one);
    store.flush().unwrap();
    drop((tree, catalog, store));
    let disk = open(dir.path(), 1 << 20);
    assert_eq!(hit(&disk, "m", 0), None, "key 0 pointing at key 1's record");
    assert_eq!(hit(&disk, "m", 1), None, "key 1 pointing past the end");
    assert_eq!(hit(&disk, "m", 2), Some(body(2)));
    rt().block_on(disk.flush());
    assert_eq!(disk.stats().entries, 1, "both bad entries were removed");
}

/// Crash test 3: records on disk whose segment was never sealed into the
/// index (the node stopped first) are indexed at the next open, and the
/// later record of a key wins.
#[test]
fn records_of_a_segment_never_sealed_are_indexed_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    filled(dir.path(), 1 << 20, 1);
    let mut store = store(dir.path(), 1 << 20);
    store.put("m", &key(1), 10, u64::MAX, &body(1)).unwrap();
    store.put("m", &key(0), 10, u64::MAX, &body(100)).unwrap();
    store.flush().unwrap();
    assert_eq!(store.entries(), 3, "key 0 counts in the sealed segment and the active one");
    let sealed_before = store.index_view().1.read().unwrap().sealed.len();
    // Dropped as a crash would leave it: nothing seals on the way out.
    drop(store);
    let disk = open(dir.path(), 1 << 20);
    let (_, catalog) = disk.shared.index().unwrap();
    assert_eq!(catalog.read().unwrap().sealed.len(), sealed_before + 1, "the unsealed segment was sealed");
    assert_eq!(disk.stats().entries, 3, "{:?}", disk.stats());
    assert_eq!(hit(&disk, "m", 1), Some(body(1)));
    assert_eq!(hit(&disk, "m", 0), Some(body(100)), "the later record of a key wins");
}

/// Crash test 4: an eviction that raised the watermark but did not unlink
/// its file; and a lost index, rebuilt from the segments.
#[test]
fn an_unfinished_eviction_and_a_lost_index_are_finished_and_rebuilt_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let capacity = 256 * 1024;
    let entries = filled(dir.path(), capacity, 3000).entries;
    let cache = dir.path().join("cache");
    let oldest = segments(dir.path())[0].0;
    assert!(oldest > 1, "the bound evicted segments");
    std::fs::write(vlog::path(&cache, oldest - 1), b"an evicted segment left behind").unwrap();
    let disk = open(dir.path(), capacity);
    assert!(segments(dir.path()).iter().all(|(id, _)| *id >= oldest), "the evicted file is gone");
    assert_eq!(disk.stats().entries, entries);
    closed(disk);
    std::fs::remove_dir_all(cache.join("index")).unwrap();
    let disk = open(dir.path(), capacity);
    assert_eq!(disk.stats().entries, entries, "every live answer was indexed again");
    assert_eq!(hit(&disk, "m", 2999), Some(body(2999)));
    closed(disk);
    // A segment's index file lost, another's cut short: each segment is
    // indexed again from its records; an index file without a segment goes.
    let sealed: Vec<u64> = segments(dir.path())
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| super::segment_index::path(&cache, *id).exists())
        .collect();
    assert!(sealed.len() >= 2, "{sealed:?}");
    std::fs::remove_file(super::segment_index::path(&cache, sealed[0])).unwrap();
    let torn = super::segment_index::path(&cache, sealed[1]);
    let len = std::fs::metadata(&torn).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&torn).unwrap().set_len(len - 3).unwrap();
    let stray = super::segment_index::path(&cache, 1_000_000);
    std::fs::write(&stray, b"EIX1").unwrap();
    let disk = open(dir.path(), capacity);
    assert_eq!(disk.stats().entries, entries, "every live answer was indexed again");
    let served = (0..3000).filter(|i| hit(&disk, "m", *i).is_some()).count() as u64;
    assert_eq!(served, entries, "each indexed answer is served");
    assert!(super::segment_index::path(&cache, sealed[0]).exists() && !stray.exists());
}

#[test]
fn a_damaged_index_is_moved_aside_and_rebuilt_and_cache_check_repairs_a_count() {
    let dir = tempfile::tempdir().unwrap();
    filled(dir.path(), 1 << 20, 20);
    let index_dir = dir.path().join("cache/index");
    std::fs::write(index_dir.join("conf"), b"segment_size: banana\n\x00\xff garbage").unwrap();
    std::fs::write(index_dir.join("db"), vec![0xa5u8; 4096]).unwrap();
    let disk = open(dir.path(), 1 << 20);
    let stats = disk.stats();
    assert!(stats.problem.as_deref().is_some_and(|p| p.contains("moved it aside")), "{stats:?}");
    assert_eq!(stats.entries, 20);
    assert_eq!(hit(&disk, "m", 7), Some(body(7)));
    closed(disk);
    // A count gone wrong (an index from a backup): check finds it, repair mends it.
    let mut store = store(dir.path(), 1 << 20);
    store.index_view().0.insert(index::ENTRIES, &7u64.to_be_bytes()[..]).unwrap();
    store.flush().unwrap();
    drop(store);
    let path = dir.path().join("cache");
    // sled lets go of its lock once its I/O threads finish their last
    // write, a moment after the handle is dropped.
    let checked = |repair| {
        for _ in 0..40 {
            match check(&path, 1 << 20, 4 << 20, repair) {
                Err(DiskError::Locked(_)) => std::thread::sleep(Duration::from_millis(50)),
                done => return done.unwrap(),
            }
        }
        panic!("the store stayed locked");
    };
    let found = checked(false);
    assert_eq!((found.entries, found.counted), (20, 7), "{found:?}");
    let repaired = checked(true);
    assert_eq!((repaired.entries, repaired.counted, repaired.reindexed, repaired.dangling), (20, 20, 20, 0));
}

#[test]
fn the_directory_stays_within_the_bound_plus_one_segment_under_churn() {
    let dir = tempfile::tempdir().unwrap();
    let capacity = 256 * 1024;
    let disk = Disk::open(&dir.path().join("cache"), options(capacity, Duration::from_millis(100))).unwrap();
    let big = |i: u32| format!("answer {i}").into_bytes().repeat(20);
    let (mut peak, mut all_peak) = (0, 0);
    for i in 0..20_000 {
        disk.put("m", key(i), 10, u64::MAX, big(i));
        if i % 1000 == 999 {
            rt().block_on(disk.flush());
            let files: u64 = segments(dir.path()).iter().map(|(_, len)| len).sum();
            peak = peak.max(files);
            all_peak = all_peak.max(disk.stats().size_on_disk);
        }
    }
    let stats = disk.stats();
    eprintln!("segments at most {peak} bytes under churn, all files {all_peak}; {stats:?}");
    assert!(peak <= capacity + super::store::segment_target(capacity), "{peak}");
    assert!(stats.bytes <= capacity && stats.entries > 0, "{stats:?}");
    // sled's files count against the bound too.
    assert!(all_peak <= capacity + super::store::segment_target(capacity), "{all_peak}");
    // A read waits behind the writer's seal at most: a few tries.
    let newest = (0..50).find_map(|_| {
        hit(&disk, "m", 19_999).or_else(|| {
            std::thread::sleep(Duration::from_millis(100));
            None
        })
    });
    assert_eq!(newest, Some(big(19_999)), "the newest entry survived");
}

/// Issue 37: under churn the directory stays within the bound plus one
/// segment: the entries are in the segments' index files, dropped with
/// them, and sled holds a few bytes a segment, so it never needs rebuilding.
/// When its files outgrow their floor anyway (here: junk put there by
/// hand), the writer builds it again from the segments, answers intact.
#[test]
fn the_files_stay_within_the_bound_under_churn_and_an_outgrown_index_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let capacity = 4 << 20;
    let disk = Disk::open(&dir.path().join("cache"), options(capacity, Duration::from_secs(3600))).unwrap();
    let mut peak = 0;
    for i in 0..120_000 {
        disk.put("m", key(i), 10, u64::MAX, body(i));
        if i % 2000 == 1999 {
            rt().block_on(disk.flush());
            peak = peak.max(disk.stats().size_on_disk);
        }
    }
    let stats = disk.stats();
    eprintln!("files at most {peak} bytes; {stats:?}");
    assert!(
        peak <= capacity + store::segment_target(capacity),
        "the files took {peak} bytes for a {capacity}-byte bound"
    );
    assert_eq!(disk.shared.index_rebuilds.load(Ordering::Relaxed), 0, "sled outgrew its floor under churn");
    let (tree, _) = disk.shared.index().unwrap();
    for i in 0..400u32 {
        tree.insert(format!("zjunk{i}"), vec![0xa5u8; 8 << 10]).unwrap();
    }
    tree.flush().unwrap();
    drop(tree);
    // The writer looks at sled's files when its flush timer fires, which
    // a write sets.
    let rebuilt = (120_000..120_050).any(|i| {
        disk.put("m", key(i), 10, u64::MAX, body(i));
        std::thread::sleep(Duration::from_millis(200));
        disk.shared.index_rebuilds.load(Ordering::Relaxed) > 0
    });
    assert!(rebuilt, "3 MiB of junk in sled never made the writer rebuild it");
    assert_eq!(hit(&disk, "m", 119_999), Some(body(119_999)));
    assert!(disk.stats().size_on_disk <= capacity + store::segment_target(capacity));
}

/// A lookup the index cannot hold is a miss on the asking thread; one it
/// holds, in the active segment or a sealed one, goes to the reader.
#[test]
fn the_catalog_says_no_for_absent_keys_and_never_for_stored_ones() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    for i in 0..500 {
        disk.put("m", key(i), 10, u64::MAX, body(i));
    }
    rt().block_on(disk.flush());
    let (_, catalog) = disk.shared.index().unwrap();
    assert!((0..500).all(|i| !index::certainly_absent(&catalog, "m", &key(i))), "the active segment's");
    assert!(index::certainly_absent(&catalog, "other", &key(1)), "a model never stored");
    closed(disk);
    let disk = open(dir.path(), 1 << 20);
    let (_, catalog) = disk.shared.index().unwrap();
    let sealed = catalog.read().unwrap().sealed.len();
    assert!(catalog.read().unwrap().active.is_empty() && sealed > 1, "{sealed} sealed segments");
    assert!((0..500).all(|i| !index::certainly_absent(&catalog, "m", &key(i))), "a sealed segment's");
    let said_maybe = (10_000..20_000).filter(|i| !index::certainly_absent(&catalog, "m", &key(*i))).count();
    // About 0.4% per segment's filter.
    assert!(said_maybe < 100 * sealed, "{said_maybe} of 10,000 absent keys may be held, {sealed} segments");
    assert_eq!(hit(&disk, "m", 7), Some(body(7)));
    assert_eq!(hit(&disk, "m", 10_007), None);
}
