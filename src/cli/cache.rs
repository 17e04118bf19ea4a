//! `edgeinfer cache stats|purge`: through the running node, or the store
//! itself; `edgeinfer cache check`: the store itself, with the node stopped.

use anyhow::Result;
use clap::Subcommand;
use edgeinfer::config::Config;

#[derive(Subcommand)]
pub enum CacheCommand {
    /// Entries, bytes and capacity of the memory and disk layers, and any
    /// problem the disk layer had (a store moved aside, an I/O error).
    Stats {
        /// The node's HTTP address; default: http://<http.listen>.
        #[arg(long)]
        url: Option<String>,
        /// Print the figures as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove cached answers from every layer (memory, disk, and this
    /// node's prefix in the shared Redis layer when it is on): all of
    /// them, or one model's.
    Purge {
        /// Only this model's answers.
        #[arg(long, short)]
        model: Option<String>,
        /// The node's HTTP address; default: http://<http.listen>.
        #[arg(long)]
        url: Option<String>,
    },
    /// Read the disk store whole, with the node stopped: every segment's
    /// records and every index entry against its record. Exits 1 when the
    /// index and the segments disagree (entries whose record is missing or
    /// damaged, or a count that is off); `--repair` rebuilds the index
    /// from the segments first (after a lost or damaged index, or a disk
    /// that was restored from a backup).
    Check {
        /// Rebuild the index from the segments, then check.
        #[arg(long)]
        repair: bool,
        /// Print the findings as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(config: &Config, command: CacheCommand) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        match command {
            CacheCommand::Stats { url, json } => stats(config, url, json).await,
            CacheCommand::Check { repair, json } => check(config, repair, json),
            CacheCommand::Purge { model, url } => {
                let (n, source) =
                    edgeinfer::admin::cache_purge(config, url.as_deref(), model.as_deref()).await?;
                let what = model.map(|m| format!("model {m}'s")).unwrap_or_else(|| "all".into());
                let layers = if config.cache.redis.enabled {
                    "entries removed from disk and Redis"
                } else {
                    "disk entries removed"
                };
                println!("purged {what} cached answers from the {source}: {n} {layers}");
                Ok(0)
            }
        }
    })
}

async fn stats(config: &Config, url: Option<String>, json: bool) -> Result<i32> {
    let (stats, source) = edgeinfer::admin::cache_stats(config, url.as_deref()).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
        return Ok(0);
    }
    println!("cache of the {source}{}", if stats.enabled { "" } else { " (cache.enabled = false)" });
    println!(
        "  memory: {} entries, {} of {} bytes",
        stats.memory_entries, stats.memory_bytes, stats.memory_capacity_bytes
    );
    match &stats.disk {
        Some(d) => {
            println!(
                "  disk:   {} entries, {} of {} bytes ({} bytes of files) in {}{}",
                d.entries,
                d.bytes,
                d.capacity_bytes,
                d.size_on_disk,
                d.path.display(),
                if d.enabled { "" } else { ", DISABLED" }
            );
            if let Some(p) = &d.problem {
                println!("  problem: {p}");
            }
        }
        None => println!("  disk:   off"),
    }
    Ok(0)
}

fn check(config: &Config, repair: bool, json: bool) -> Result<i32> {
    let (r, path) = edgeinfer::admin::cache_check(config, repair)?;
    let sound = r.dangling == 0 && r.damaged_segments == 0 && r.counted == r.entries;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("cache store {}", path.display());
        if repair {
            println!("  repaired: the index was rebuilt from the segments ({} entries)", r.reindexed);
        }
        println!(
            "  segments: {} ({} without a valid header, {} with a torn tail), {} records that check",
            r.segments, r.damaged_segments, r.torn_tails, r.records
        );
        println!(
            "  index:    {} entries ({} counted), {} pointing at a missing or damaged record",
            r.entries, r.counted, r.dangling
        );
        println!("  {}", if sound { "sound" } else { "NOT sound: run `edgeinfer cache check --repair`" });
    }
    Ok(if sound { 0 } else { 1 })
}
