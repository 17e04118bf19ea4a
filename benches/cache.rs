//! The response cache in process: key cost, memory hit, disk hit, Redis
//! hit (where `redis-server` is installed: the bench starts one on
//! loopback) and disk write per entry, and what an entry takes on disk. Run
//! with `cargo bench --bench cache`; docs/BENCHMARKS.md records the figures.

use criterion::Criterion;
use edgeinfer::engine::cache::{Cache, CacheOptions, Key, Lookup, RedisOptions};
use edgeinfer::model::{LoadedModel, RuntimeOptions};
use edgeinfer::protocol::{Datatype, InferRequest, InferResponse, OutputTensor, TensorData};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn options(dir: &Path, memory_bytes: u64) -> CacheOptions {
    CacheOptions {
        enabled: true,
        memory_bytes,
        disk_bytes: 1 << 30,
        dir: dir.join("cache"),
        sweep_interval: Duration::from_secs(3600),
        // Long enough that every disk read is timed, not given up on.
        disk_read_timeout: Duration::from_secs(1),
        disk_page_cache_bytes: 4 << 20,
        redis: None,
    }
}

fn key(i: u64) -> Key {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.to_le_bytes());
    Key(k)
}

/// A `digits` reply as the node stores it: ten probabilities, a label.
fn reply() -> InferResponse {
    let mut r: InferResponse = serde_json::from_value(serde_json::json!({
        "model_name": "digits", "model_version": "1",
        "outputs": [{"name": "probabilities", "shape": [1, 10], "datatype": "FP32", "data": [0.0]}],
        "parameters": {"node": "gw-01", "label": "7", "confidence": 0.97}
    }))
    .unwrap();
    r.outputs = vec![OutputTensor {
        name: "probabilities".into(),
        shape: vec![1, 10],
        datatype: Datatype::Fp32,
        data: TensorData::F32((0..10).map(|i| i as f32 / 45.0).collect()),
    }];
    r
}

/// Stores `n` entries from `from` on and waits until the writer has them on
/// disk, in steps of 1000 (the writer's queue drops what overflows it).
fn fill(rt: &tokio::runtime::Runtime, cache: &Cache, from: u64, n: u64) {
    let response = reply();
    rt.block_on(async {
        for i in from..from + n {
            if let Lookup::Miss(ticket) = cache.lookup("digits", key(i), Duration::from_secs(3600)).await {
                cache.store(Some(ticket), &response);
            }
            if i % 1000 == 999 {
                cache.flush().await;
            }
        }
        cache.flush().await;
    });
}

/// Opens the store once the previous owner's threads have let go of its lock.
fn reopen(options: CacheOptions) -> Cache {
    for _ in 0..100 {
        let cache = Cache::open(options.clone());
        if cache.health().disk_enabled {
            return cache;
        }
        drop(cache);
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the store stayed locked");
}

fn main() {
    let mut c = Criterion::default().configure_from_args().warm_up_time(Duration::from_millis(500));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    if let Some(answers) = std::env::var("DISK_RSS").ok().and_then(|n| n.parse().ok()) {
        return disk_rss(&rt, answers);
    }
    let n = 20_000;

    let model_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/digits/1");
    let model = LoadedModel::load(&model_dir, &RuntimeOptions::default()).unwrap();
    let req =
        InferRequest::single("a", "input", vec![1, 64], Datatype::Fp32, TensorData::Number(vec![3.0; 64]));
    let input = TensorData::F32(vec![0.1875; 64]);
    c.bench_function("cache/key (sha256 of a 64-pixel request)", |b| {
        b.iter(|| Key::new(&model, &req, &input))
    });

    // Memory hits: everything fits in memory.
    let dir = tempfile::tempdir().unwrap();
    let warm = Cache::open(options(dir.path(), 64 << 20));
    fill(&rt, &warm, 0, n);
    let mut i = 0;
    c.bench_function("cache/memory hit", |b| {
        b.iter(|| {
            i = (i + 1) % n;
            rt.block_on(warm.lookup("digits", key(i), Duration::from_secs(3600)))
        })
    });
    drop(warm);

    // Disk hits: no memory layer to promote into, so every lookup reads sled.
    let cold = reopen(options(dir.path(), 0));
    rt.block_on(cold.flush());
    let mut i = 0;
    c.bench_function("cache/disk hit (read, checksum, decode)", |b| {
        b.iter(|| {
            i = (i + 1) % n;
            let found = rt.block_on(cold.lookup("digits", key(i), Duration::from_secs(3600)));
            assert!(matches!(found, Lookup::Hit(_)));
        })
    });
    drop(cold);

    redis_hits(&mut c, &rt, n);

    // Disk writes: the writer's cost per entry, measured to the flush.
    let dir = tempfile::tempdir().unwrap();
    let fresh = Cache::open(options(dir.path(), 0));
    let mut next = 0;
    c.bench_function("cache/disk write per entry (1000 stores + flush, / 1000)", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                fill(&rt, &fresh, next, 1000);
                next += 1000;
            }
            start.elapsed() / 1000
        })
    });
    let stats = fresh.stats();
    let disk = stats.disk.unwrap();
    println!(
        "\ndisk bytes per entry after {} entries: {:.0} counted against cache.disk_bytes, {:.0} of files (segments, index files, sled)",
        disk.entries,
        disk.bytes as f64 / disk.entries as f64,
        disk.size_on_disk as f64 / disk.entries as f64
    );
    let warm = Cache::open(options(tempfile::tempdir().unwrap().path(), 64 << 20));
    fill(&rt, &warm, 0, n);
    let s = warm.stats();
    println!("memory bytes per entry: {:.0}", s.memory_bytes as f64 / s.memory_entries as f64);
    drop(warm);

    hit_ratios(&rt);
}

/// Hit ratio of the disk layer alone (no memory layer) on a skewed (Zipf,
/// s = 1.1) and a uniform stream of lookups over 100,000 distinct inputs,
/// each miss stored, with `cache.disk_bytes` from `HIT_RATIO_MIB` (a list,
/// default "8"): the ratio over the second half of 200,000 lookups, and
/// what the store's directory took on disk at the end, so that stores can
/// be compared at equal disk bytes (issue 37).
fn hit_ratios(rt: &tokio::runtime::Runtime) {
    let mibs = std::env::var("HIT_RATIO_MIB").unwrap_or_else(|_| "8".into());
    let (universe, lookups) = (100_000u64, 200_000u64);
    // Zipf's cumulative weights, then a binary search per draw.
    let weights: Vec<f64> = (1..=universe).map(|r| 1.0 / (r as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    let cdf: Vec<f64> = weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform01 = move || {
        // splitmix64: a fixed stream, the same for every store compared.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let response = reply();
    for mib in mibs.split(',').filter_map(|m| m.trim().parse::<u64>().ok()) {
        for workload in ["zipf", "uniform"] {
            let dir = tempfile::tempdir().unwrap();
            let cache = Cache::open(CacheOptions { disk_bytes: mib << 20, ..options(dir.path(), 0) });
            let (mut hits, mut counted, mut peak) = (0u64, 0u64, 0u64);
            rt.block_on(async {
                for i in 0..lookups {
                    let u = uniform01();
                    let k = match workload {
                        "zipf" => cdf.partition_point(|c| *c < u) as u64,
                        _ => (u * universe as f64) as u64,
                    };
                    let found = cache.lookup("digits", key(k), Duration::from_secs(3600)).await;
                    let hit = matches!(found, Lookup::Hit(_));
                    if let Lookup::Miss(ticket) = found {
                        cache.store(Some(ticket), &response);
                    }
                    if i >= lookups / 2 {
                        counted += 1;
                        hits += hit as u64;
                    }
                    // The writer's queue drops what overflows it.
                    if i % 1000 == 999 {
                        cache.flush().await;
                        peak = peak.max(dir_bytes(dir.path()));
                    }
                }
                cache.flush().await;
            });
            let on_disk = dir_bytes(dir.path());
            println!(
                "hit ratio, {workload}, cache.disk_bytes {mib} MiB: {:.1}% ({hits} of {counted}); directory {:.1} MiB, at most {:.1} MiB",
                hits as f64 * 100.0 / counted as f64,
                on_disk as f64 / (1u64 << 20) as f64,
                peak.max(on_disk) as f64 / (1u64 << 20) as f64
            );
        }
    }
}

/// `DISK_RSS=N cargo bench --bench cache`: N distinct answers through a
/// disk layer at the default bound (256 MiB) and no memory layer, each a
/// lookup (a miss) and a store, as the soak sends them but with nothing
/// else in the process: every N/10 answers, the process's RSS, the rate,
/// and what the store counts and its files take (issue 37: memory that
/// does not follow the files).
fn disk_rss(rt: &tokio::runtime::Runtime, answers: u64) {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(CacheOptions { disk_bytes: 256 << 20, ..options(dir.path(), 0) });
    let step = (answers / 10).max(1000);
    let rss_mib = || {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok());
        kib.unwrap_or(0.0) / 1024.0
    };
    println!("disk layer alone, cache.disk_bytes 256 MiB, no memory layer; RSS at open {:.1} MiB", rss_mib());
    println!("| answers | RSS | us per answer | entries | counted | files | of which the index |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut from = 0;
    while from < answers {
        let started = Instant::now();
        fill(rt, &cache, from, step);
        from += step;
        let per = started.elapsed().as_secs_f64() * 1e6 / step as f64;
        let disk = cache.stats().disk.unwrap();
        let segments: u64 = std::fs::read_dir(&disk.path)
            .map(|d| {
                d.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
            })
            .unwrap_or(0);
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "| {from} | {:.1} MiB | {per:.1} | {} | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
            rss_mib(),
            disk.entries,
            mib(disk.bytes),
            mib(dir_bytes(dir.path())),
            mib(dir_bytes(dir.path()).saturating_sub(segments))
        );
    }
}

/// Bytes of every file under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_bytes(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Redis hits: no memory or disk layer, so every lookup is one round trip
/// to a `redis-server` on loopback, the value's signature check (HMAC with
/// the site key) and the decode.
fn redis_hits(c: &mut Criterion, rt: &tokio::runtime::Runtime, n: u64) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let Ok(mut server) = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
    else {
        println!("cache/redis hit: SKIPPED, redis-server is not installed");
        return;
    };
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let keys = || -> u64 {
        let out = std::process::Command::new("redis-cli").args(["-p", &port.to_string(), "DBSIZE"]).output();
        out.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok()).unwrap_or(0)
    };
    let site_key = dir.path().join("redis.key");
    std::fs::write(&site_key, "5e".repeat(32)).unwrap();
    let options = CacheOptions {
        redis: Some(RedisOptions {
            url: format!("redis://127.0.0.1:{port}"),
            password_file: None,
            ca_file: None,
            key_file: Some(site_key),
            key_prefix: "bench".into(),
            ttl: None,
            timeout: Duration::from_millis(100),
        }),
        ..options(&dir.path().join("none"), 0)
    };
    let shared = rt.block_on(async { Cache::open(CacheOptions { disk_bytes: 0, ..options }) });
    let response = reply();
    rt.block_on(async {
        // In steps the writer's queue holds, each written before the next.
        for step in (0..n).step_by(500) {
            for i in step..(step + 500).min(n) {
                if let Lookup::Miss(ticket) = shared.lookup("digits", key(i), Duration::from_secs(3600)).await
                {
                    shared.store(Some(ticket), &response);
                }
            }
            while keys() < (step + 500).min(n) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let mut i = 0;
    c.bench_function("cache/redis hit (loopback round trip, signature, decode)", |b| {
        b.iter(|| {
            i = (i + 1) % n;
            let found = rt.block_on(shared.lookup("digits", key(i), Duration::from_secs(3600)));
            assert!(matches!(found, Lookup::Hit(_)));
        })
    });
    drop(shared);
    let _ = server.kill();
    let _ = server.wait();
}
