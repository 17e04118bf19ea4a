//! Async escalations waiting for the cloud, in sled under `state_dir/spool`,
//! so an outage or a restart loses none. One task owns the store: requests
//! hand it entries over a channel; it sends them to the cloud oldest first
//! and hands each settled one to the engine, which writes the final reply.
//! An entry leaves the store only once the broker acknowledged that reply:
//! a crash before then sends it again after the restart.

use super::{Cloud, CloudError};
use crate::protocol::{Delivery, FirstReply, InferResponse, ReplyRoute};
use crate::telemetry;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// One escalation waiting for the cloud.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpoolEntry {
    /// The edge model that answered first.
    pub model: String,
    pub cloud_model: String,
    /// The request as JSON (OIP), as the cloud will get it.
    pub request: Vec<u8>,
    /// The edge answer as JSON: the final reply if the cloud never answers.
    pub edge: Vec<u8>,
    pub route: ReplyRoute,
}

/// An escalation the spool is done with: the cloud's answer, or `None`
/// when the cloud will not give one (refused, out of attempts or time, or
/// dropped to make room). The engine turns it into the reply that ends the
/// request; `delivery` tells the spool when the broker has it.
#[derive(Debug)]
pub struct Settled {
    pub entry: SpoolEntry,
    pub cloud: Option<InferResponse>,
    pub delivery: Delivery,
    /// The request's first reply, which this final one must not overtake
    /// (none for entries from before a restart).
    pub after: Option<FirstReply>,
    /// The follow-up's spans in its request's trace (none untraced, and
    /// for entries from before a restart).
    pub trace: Option<Arc<crate::trace::Active>>,
}

/// An entry, what its final reply waits for, and who waits to hear it is
/// on disk.
type Arrival = (SpoolEntry, FirstReply, Option<String>, tokio::sync::oneshot::Sender<bool>);

/// Final replies out for delivery at once; the spool asks the cloud for no
/// more until the broker acknowledged some (this bounds every queue between
/// here and the broker).
const MAX_UNDELIVERED: usize = 64;

/// The tree that holds the escalations.
const TREE: &str = "escalations";

/// Room in each channel between the spool and the broker (settled
/// escalations, then follow-up replies): the finals out for delivery, and
/// as many again for entries pushed out by new ones. When they are full
/// (the broker is away), a final waits in the spool and a pushed-out
/// entry's final is dropped (counted with `reason="room"`).
pub const FOLLOW_UP_QUEUE: usize = 2 * MAX_UNDELIVERED;

/// The requests' side: hands entries to the spool task.
#[derive(Clone)]
pub struct Spool {
    tx: mpsc::Sender<Arrival>,
}

impl Spool {
    /// Queues an entry and waits until it is on disk, so a provisional reply
    /// is only sent for an escalation that survives a restart. False when
    /// the task is too far behind or could not store it.
    /// `traceparent`: the request's root span, where it is traced.
    pub async fn push(&self, entry: SpoolEntry, after: FirstReply, traceparent: Option<String>) -> bool {
        let (done, stored) = tokio::sync::oneshot::channel();
        if self.tx.try_send((entry, after, traceparent, done)).is_err() {
            return false;
        }
        stored.await.unwrap_or(false)
    }
}

pub struct SpoolTask {
    db: sled::Db,
    dir: std::path::PathBuf,
    /// On a stand-in store, after a rebuild could not reopen the real one.
    detached: bool,
    /// When the size of the store's files was last checked.
    size_checked: Instant,
    /// The escalations, keyed by arrival (sled's monotonic ids, big-endian).
    tree: sled::Tree,
    rx: mpsc::Receiver<Arrival>,
    limits: SpoolLimits,
    entries: usize,
    bytes: u64,
    /// Entries the cloud answered with an error, and when each may be tried
    /// again; the ones behind go first meanwhile (in memory: a restart tries
    /// them at once, their attempt counts are on disk).
    backoff: HashMap<Vec<u8>, Instant>,
    /// The whole spool waits until then (the uplink or the cloud is down).
    paused_until: Option<Instant>,
    /// Entries whose final reply is on its way to the broker.
    undelivered: HashSet<Vec<u8>>,
    /// Stored entries whose request's first reply may not have left yet
    /// (one per entry at most; in memory, like the requests).
    first_replies: HashMap<Vec<u8>, FirstReply>,
    /// The traced entries' follow-up traces, their cloud calls' spans
    /// recorded into them (in memory, like the first replies).
    traces: HashMap<Vec<u8>, Arc<crate::trace::Active>>,
    /// Where `Delivery` handles report back: (key, delivered).
    delivered_tx: mpsc::UnboundedSender<(Vec<u8>, bool)>,
    delivered_rx: mpsc::UnboundedReceiver<(Vec<u8>, bool)>,
    settled: mpsc::Sender<Settled>,
}

/// Bounds of the spool (`cloud.spool_*`).
#[derive(Debug, Clone, Copy)]
pub struct SpoolLimits {
    pub max_entries: usize,
    pub max_bytes: u64,
    /// Error answers from the cloud an entry may get before it ends with the
    /// edge answer; connection failures and timeouts (an outage) do not count.
    pub max_attempts: u32,
    /// An entry older than this ends with the edge answer, outage or not.
    pub max_age: Duration,
}

/// What the store keeps per escalation.
#[derive(Serialize, Deserialize)]
struct Stored {
    attempts: u32,
    /// When it was spooled, in milliseconds since the Unix epoch.
    queued_at_ms: u64,
    entry: SpoolEntry,
}

#[derive(Debug, thiserror::Error)]
#[error("the cloud spool {path}: {message}")]
pub struct SpoolError {
    path: String,
    message: String,
}

/// Why an entry ends without the cloud's answer, for the log and the metric.
#[derive(Debug, Clone, Copy)]
enum GiveUp {
    /// Dropped to make room for newer ones.
    Room,
    /// The cloud refused it (4xx, or an answer that is not OIP).
    Refused,
    Attempts,
    Age,
}

impl GiveUp {
    fn as_str(self) -> &'static str {
        match self {
            GiveUp::Room => "room",
            GiveUp::Refused => "refused",
            GiveUp::Attempts => "attempts",
            GiveUp::Age => "age",
        }
    }
}

/// One cloud call at a time, polled beside new arrivals.
type Call =
    std::pin::Pin<Box<dyn Future<Output = (Vec<u8>, Stored, Result<InferResponse, CloudError>)> + Send>>;

/// Opens (or creates) the store; what it holds from before a restart is
/// sent first. Settled escalations go to `settled`.
pub fn open(
    dir: &Path,
    limits: SpoolLimits,
    settled: mpsc::Sender<Settled>,
) -> Result<(Spool, SpoolTask), SpoolError> {
    let err = |e: sled::Error| SpoolError { path: dir.display().to_string(), message: e.to_string() };
    crate::store::recover(dir);
    let db = crate::store::open(spool_config(dir)).map_err(err)?;
    let tree = db.open_tree(TREE).map_err(err)?;
    migrate(&db, &tree).map_err(err)?;
    let (mut entries, mut bytes) = (0usize, 0u64);
    for item in tree.iter() {
        let (_, v) = item.map_err(err)?;
        entries += 1;
        bytes += v.len() as u64;
    }
    if entries > 0 {
        tracing::info!("cloud spool: {entries} escalations from before the restart wait for the cloud");
    }
    let (tx, rx) = mpsc::channel(1024);
    let limits = SpoolLimits {
        max_entries: limits.max_entries.max(1),
        max_attempts: limits.max_attempts.max(1),
        ..limits
    };
    let (delivered_tx, delivered_rx) = mpsc::unbounded_channel();
    let task = SpoolTask {
        db,
        dir: dir.to_path_buf(),
        detached: false,
        size_checked: Instant::now(),
        tree,
        rx,
        limits,
        entries,
        bytes,
        backoff: HashMap::new(),
        paused_until: None,
        undelivered: HashSet::new(),
        first_replies: HashMap::new(),
        traces: HashMap::new(),
        delivered_tx,
        delivered_rx,
        settled,
    };
    task.gauges();
    Ok((Spool { tx }, task))
}

fn spool_config(dir: &Path) -> sled::Config {
    sled::Config::new().path(dir).cache_capacity(1024 * 1024)
}

/// Entries written by 0.x releases (bare `SpoolEntry`s in the default tree)
/// move into the current tree under the same keys, counted from now.
fn migrate(db: &sled::Db, tree: &sled::Tree) -> sled::Result<()> {
    let now = unix_ms();
    for item in db.iter() {
        let (key, value) = item?;
        if let Ok(entry) = postcard::from_bytes::<SpoolEntry>(&value) {
            tree.insert(&key, encode(&Stored { attempts: 0, queued_at_ms: now, entry }))?;
        }
        db.remove(&key)?;
    }
    db.flush()?;
    Ok(())
}

fn encode(stored: &Stored) -> Vec<u8> {
    postcard::to_stdvec(stored).expect("postcard encoding into a Vec cannot fail")
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The wait before an entry the cloud answered with an error is tried
/// again: 1 s doubling per attempt, at most a minute.
fn retry_delay(attempts: u32) -> Duration {
    Duration::from_secs(1 << attempts.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// What the spool does next.
enum Next {
    Call(Vec<u8>, Stored),
    WaitUntil(Instant),
    Idle,
}

impl SpoolTask {
    /// Runs until every `Spool` handle is gone (the entries left stay on
    /// disk for the next start). New escalations are stored while a cloud
    /// call is in flight, so a request never waits for the cloud here.
    pub async fn run(mut self, cloud: Arc<Cloud>) {
        let mut call: Option<Call> = None;
        loop {
            let mut wake = None;
            if call.is_none() {
                self.rebuild_if_grown();
                self.expire();
                match self.next(&cloud) {
                    Next::Call(key, stored) => {
                        let cloud = cloud.clone();
                        // Its cloud calls are spans of the request's trace.
                        let trace = self.traces.get(&key).cloned();
                        call = Some(Box::pin(crate::trace::within(trace, async move {
                            let result = match serde_json::from_slice(&stored.entry.request) {
                                Ok(request) => {
                                    let e = &stored.entry;
                                    cloud.infer(&e.model, &e.cloud_model, &request, None).await
                                }
                                Err(e) => Err(CloudError::Invalid(format!("the spooled request: {e}"))),
                            };
                            (key, stored, result)
                        })));
                    }
                    Next::WaitUntil(at) => wake = Some(at),
                    Next::Idle => {}
                }
            }
            tokio::select! {
                arrival = self.rx.recv() => {
                    let Some(arrival) = arrival else { return };
                    let mut arrived = vec![arrival];
                    while let Ok(more) = self.rx.try_recv() {
                        arrived.push(more);
                    }
                    self.store_all(arrived).await;
                }
                Some((key, delivered)) = self.delivered_rx.recv() => {
                    self.delivered(key, delivered);
                    self.delivery_reports();
                    let _ = self.db.flush_async().await;
                }
                (key, stored, result) = async { call.as_mut().expect("polled only with a call").await }, if call.is_some() => {
                    call = None;
                    self.settle(key, stored, result).await;
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now).into()), if wake.is_some() => {}
            }
        }
    }

    /// sled's files outgrew `store::disk_bound` of `cloud.spool_max_bytes`
    /// (it reclaims removed entries lazily): rebuild the store, checked at
    /// most every 10 s and only while no final is out for delivery (those
    /// are tracked by key, and the rebuilt store numbers entries afresh,
    /// in the same order).
    fn rebuild_if_grown(&mut self) {
        if self.size_checked.elapsed() < Duration::from_secs(10) || !self.undelivered.is_empty() {
            return;
        }
        self.size_checked = Instant::now();
        if self.detached {
            // A rebuild could not reopen the store: try again.
            crate::store::recover(&self.dir);
            match crate::store::open(spool_config(&self.dir)) {
                Ok(db) => self.adopt(db),
                Err(e) => tracing::warn!("cloud spool: reopening {}: {e}", self.dir.display()),
            }
            return;
        }
        let on_disk = self.db.size_on_disk().unwrap_or(0);
        if on_disk <= crate::store::disk_bound(self.limits.max_bytes) {
            return;
        }
        let mut rebuild = || {
            // sled needs every handle of the old store gone: a throwaway
            // one stands in meanwhile.
            let standin = sled::Config::new().temporary(true).open().ok()?;
            self.tree = standin.open_tree(TREE).ok()?;
            let old = std::mem::replace(&mut self.db, standin);
            let copy = |old: &sled::Db, fresh: &sled::Db| -> sled::Result<()> {
                let (from, to) = (old.open_tree(TREE)?, fresh.open_tree(TREE)?);
                for item in from.iter() {
                    let (_, v) = item?;
                    to.insert(fresh.generate_id()?.to_be_bytes(), v)?;
                }
                Ok(())
            };
            Some(crate::store::rebuild(&self.dir, old, spool_config, copy))
        };
        let rebuilt = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(rebuild),
            _ => rebuild(),
        };
        match rebuilt {
            None => {}
            Some(Ok(db)) => {
                let now = db.size_on_disk().unwrap_or(0);
                tracing::info!("cloud spool store rebuilt: its files took {on_disk} bytes, now {now}");
                metrics::counter!(telemetry::STORE_REBUILDS, "store" => "spool").increment(1);
                self.adopt(db);
            }
            Some(Err(not)) => {
                tracing::warn!("cloud spool store not rebuilt: {}", not.why);
                match not.db {
                    Some(db) => self.adopt(db),
                    None => {
                        tracing::error!(
                            "cloud spool: its store cannot be reopened; escalations are kept in memory until it can"
                        );
                        self.detached = true;
                    }
                }
            }
        }
    }

    /// Serves from `db` from now on, with its entries counted afresh.
    fn adopt(&mut self, db: sled::Db) {
        let tree = match db.open_tree(TREE) {
            Ok(tree) => tree,
            Err(e) => {
                tracing::error!("cloud spool: opening its tree: {e}");
                self.detached = true;
                return;
            }
        };
        let (mut entries, mut bytes) = (0usize, 0u64);
        for (_, v) in tree.iter().flatten() {
            entries += 1;
            bytes += v.len() as u64;
        }
        (self.db, self.tree, self.entries, self.bytes, self.detached) = (db, tree, entries, bytes, false);
        // Entries are numbered afresh: their pauses start over.
        self.backoff.clear();
        self.gauges();
    }

    /// The oldest entry that may go to the cloud now, or when to look again.
    fn next(&mut self, cloud: &Cloud) -> Next {
        let now = Instant::now();
        if let Some(at) = self.paused_until.filter(|at| *at > now) {
            return Next::WaitUntil(at);
        }
        self.paused_until = None;
        if self.undelivered.len() >= MAX_UNDELIVERED {
            // A delivery report wakes the task.
            return Next::Idle;
        }
        if self.settled.capacity() == 0 {
            // The way to the broker is full (it is away): an answer now
            // could not be handed on, so no cloud call until there is room.
            return Next::WaitUntil(now + Duration::from_millis(500));
        }
        self.backoff.retain(|_, at| *at > now);
        let mut earliest: Option<Instant> = None;
        for item in self.tree.iter() {
            let Ok((key, value)) = item else { break };
            if self.undelivered.contains(&key[..]) {
                continue;
            }
            if let Some(at) = self.backoff.get(&key[..]) {
                earliest = Some(earliest.map_or(*at, |e| e.min(*at)));
                continue;
            }
            let Ok(stored) = postcard::from_bytes::<Stored>(&value) else {
                tracing::warn!("cloud spool: an unreadable entry was dropped");
                self.remove(&key, value.len());
                continue;
            };
            let retry_in = cloud.retry_in();
            if !retry_in.is_zero() {
                return Next::WaitUntil(now + retry_in);
            }
            return Next::Call(key.to_vec(), stored);
        }
        earliest.map_or(Next::Idle, Next::WaitUntil)
    }

    /// Ends the entries older than `cloud.spool_max_age_s`, oldest first.
    fn expire(&mut self) {
        let oldest_allowed = unix_ms().saturating_sub(self.limits.max_age.as_millis() as u64);
        for item in self.tree.iter() {
            let Ok((key, value)) = item else { return };
            if self.undelivered.contains(&key[..]) {
                continue;
            }
            match postcard::from_bytes::<Stored>(&value) {
                Ok(stored) if stored.queued_at_ms < oldest_allowed => {
                    self.give_up(GiveUp::Age, key.to_vec(), stored);
                }
                _ => return,
            }
        }
    }

    /// What a cloud call's outcome does to its entry.
    async fn settle(&mut self, key: Vec<u8>, mut stored: Stored, result: Result<InferResponse, CloudError>) {
        if !matches!(self.tree.get(&key), Ok(Some(_))) {
            // Dropped to make room while the call was out: it has its reply.
            return;
        }
        match result {
            Ok(response) => self.finish(key, stored.entry, Some(response)),
            Err(e) if !e.retryable() && matches!(e, CloudError::Status { .. } | CloudError::Invalid(_)) => {
                tracing::warn!("cloud spool: the cloud refused an escalation of {}: {e}", stored.entry.model);
                self.give_up(GiveUp::Refused, key, stored);
            }
            Err(e @ CloudError::Status { .. }) => {
                // The cloud answered, with an error: this entry's attempt.
                stored.attempts += 1;
                if stored.attempts >= self.limits.max_attempts {
                    tracing::warn!(
                        "cloud spool: an escalation of {} failed {} times (last: {e}); \
                         its device gets the edge answer",
                        stored.entry.model,
                        stored.attempts
                    );
                    self.give_up(GiveUp::Attempts, key, stored);
                } else {
                    let value = encode(&stored);
                    if self.tree.insert(&key[..], value).is_ok() {
                        self.backoff.insert(key, Instant::now() + retry_delay(stored.attempts));
                    }
                }
            }
            Err(_) => {
                // Kept, in its place: the uplink or the cloud is down; the
                // breaker (or this pause) spaces the retries.
                self.paused_until = Some(Instant::now() + Duration::from_millis(200));
            }
        }
        let _ = self.db.flush_async().await;
    }

    /// The entry ends without the cloud's answer: its device gets the edge
    /// answer, marked degraded, as the final reply.
    fn give_up(&mut self, why: GiveUp, key: Vec<u8>, stored: Stored) {
        metrics::counter!(telemetry::CLOUD_SPOOL_DROPPED, "reason" => why.as_str()).increment(1);
        self.finish(key, stored.entry, None);
    }

    /// Hands the entry's final reply on; the entry stays stored until the
    /// broker acknowledged it.
    fn finish(&mut self, key: Vec<u8>, entry: SpoolEntry, cloud: Option<InferResponse>) {
        self.undelivered.insert(key.clone());
        let after = self.first_replies.remove(&key);
        let trace = self.traces.remove(&key);
        let delivery = Delivery::new(key, self.delivered_tx.clone());
        // Full: the delivery handle drops unconfirmed, and the entry is sent
        // again after a pause.
        let _ = self.settled.try_send(Settled { entry, cloud, delivery, after, trace });
    }

    /// Drops the entries whose final reply the request journal holds as
    /// sent (it sends them again itself): the node stopped before the
    /// spool heard the journal had them. `sent`: by key, the topic and
    /// correlation data the final reply went to; an entry under that key
    /// for another route is another escalation (a rebuilt store gives keys
    /// again) and stays. Called before `run`.
    pub fn drop_sent(&mut self, sent: &HashMap<Vec<u8>, (String, Option<Vec<u8>>)>) {
        let mut dropped = 0;
        for (key, (topic, correlation)) in sent {
            let Ok(Some(value)) = self.tree.get(key) else { continue };
            let route = postcard::from_bytes::<Stored>(&value).map(|s| s.entry.route);
            if route.is_ok_and(|r| &r.topic == topic && &r.correlation == correlation) {
                self.remove(key, value.len());
                dropped += 1;
            }
        }
        if dropped > 0 {
            let _ = self.db.flush();
            tracing::info!("cloud spool: {dropped} escalations the request journal sends again itself");
        }
    }

    /// A final reply reached the broker: the entry is done. Or it did not
    /// (the node is stopping, the session was lost with it): it is sent
    /// again, after a pause.
    fn delivered(&mut self, key: Vec<u8>, delivered: bool) {
        if !self.undelivered.remove(&key) {
            return;
        }
        if delivered {
            if let Ok(Some(value)) = self.tree.get(&key) {
                self.remove(&key, value.len());
            }
        } else {
            self.backoff.insert(key, Instant::now() + Duration::from_secs(1));
        }
    }

    /// The delivery reports waiting now.
    fn delivery_reports(&mut self) {
        while let Ok((key, delivered)) = self.delivered_rx.try_recv() {
            self.delivered(key, delivered);
        }
    }

    /// Stores what arrived, flushes, then tells each sender. An entry whose
    /// sender stopped waiting (its request ran out of time and got an
    /// error reply) or that did not reach the disk is taken out again: it
    /// must not produce a second final reply.
    async fn store_all(&mut self, arrived: Vec<Arrival>) {
        let mut stored = Vec::with_capacity(arrived.len());
        for (entry, after, traceparent, done) in arrived {
            let key = self.store(entry, Some(after));
            if let (Some((key, _)), Some(trace)) =
                (&key, traceparent.as_deref().and_then(crate::trace::follow))
            {
                self.traces.insert(key.to_vec(), trace);
            }
            stored.push((key, done));
        }
        let flushed = self.db.flush_async().await.is_ok();
        let mut withdrawn = false;
        for (key, done) in stored {
            let Some((key, len)) = key else {
                let _ = done.send(false);
                continue;
            };
            if !flushed || done.send(true).is_err() {
                self.remove(&key, len);
                withdrawn = true;
            }
        }
        if withdrawn {
            let _ = self.db.flush_async().await;
        }
    }

    /// Keeps the entry, dropping the oldest to stay within the bounds; a
    /// dropped one's device gets the edge answer as the final reply.
    /// Returns its key and size, or `None` where it could not be stored.
    fn store(&mut self, entry: SpoolEntry, after: Option<FirstReply>) -> Option<([u8; 8], usize)> {
        let value = encode(&Stored { attempts: 0, queued_at_ms: unix_ms(), entry });
        let len = value.len() as u64;
        while self.entries > 0
            && (self.entries >= self.limits.max_entries || self.bytes + len > self.limits.max_bytes)
        {
            let Ok(Some((key, old))) = self.tree.pop_min() else { break };
            self.entries -= 1;
            self.bytes = self.bytes.saturating_sub(old.len() as u64);
            self.backoff.remove(&key[..]);
            let after = self.first_replies.remove(&key[..]);
            let trace = self.traces.remove(&key[..]);
            // One whose final reply is already on its way needs no other.
            if !self.undelivered.remove(&key[..])
                && let Ok(old) = postcard::from_bytes::<Stored>(&old)
            {
                metrics::counter!(telemetry::CLOUD_SPOOL_DROPPED, "reason" => GiveUp::Room.as_str())
                    .increment(1);
                let delivery = Delivery::untracked();
                let ended = Settled { entry: old.entry, cloud: None, delivery, after, trace };
                if self.settled.try_send(ended).is_err() {
                    tracing::warn!(
                        "cloud spool: full while the broker is away; an escalation pushed out for room gets \
                         no final reply"
                    );
                }
            }
        }
        let key = self.db.generate_id().unwrap_or(0).to_be_bytes();
        let stored = match self.tree.insert(key, value) {
            Ok(_) => {
                self.entries += 1;
                self.bytes += len;
                if let Some(after) = after {
                    self.first_replies.insert(key.to_vec(), after);
                }
                Some((key, len as usize))
            }
            Err(e) => {
                tracing::warn!("cloud spool: cannot store an escalation ({e}); it is answered synchronously");
                None
            }
        };
        self.gauges();
        stored
    }

    fn remove(&mut self, key: &[u8], len: usize) {
        self.first_replies.remove(key);
        self.traces.remove(key);
        if let Ok(Some(_)) = self.tree.remove(key) {
            self.entries = self.entries.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub(len as u64);
        }
        self.backoff.remove(key);
        self.gauges();
    }

    fn gauges(&self) {
        metrics::gauge!(telemetry::CLOUD_SPOOL_DEPTH).set(self.entries as f64);
        metrics::gauge!(telemetry::CLOUD_SPOOL_BYTES).set(self.bytes as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: usize) -> SpoolEntry {
        SpoolEntry {
            model: "digits".into(),
            cloud_model: "digits-large".into(),
            request: format!("{{\"id\":\"r{n}\",\"inputs\":[]}}").into_bytes(),
            edge: vec![b'x'; 100],
            route: ReplyRoute {
                topic: format!("dev/{n}"),
                correlation: Some(vec![n as u8]),
                content_type: None,
            },
        }
    }

    fn limits(max_entries: usize, max_bytes: u64) -> SpoolLimits {
        SpoolLimits { max_entries, max_bytes, max_attempts: 3, max_age: Duration::from_secs(3600) }
    }

    type Ended = mpsc::Receiver<Settled>;

    /// `open` again after a drop: sled's flusher thread can hold the file
    /// lock a moment after its `Db` is gone (seen under full-suite load).
    fn reopen(dir: &Path, limits: SpoolLimits) -> (Spool, SpoolTask, Ended) {
        let start = std::time::Instant::now();
        loop {
            let (tx, rx) = mpsc::channel(FOLLOW_UP_QUEUE);
            match open(dir, limits, tx) {
                Ok((spool, task)) => return (spool, task, rx),
                Err(e) if start.elapsed() > Duration::from_secs(5) => panic!("{e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// What ended since the last call: (topic, with the cloud's answer), and
    /// the delivery handles, in order.
    fn ended(rx: &mut Ended) -> (Vec<(String, bool)>, Vec<Delivery>) {
        let mut what = Vec::new();
        let mut deliveries = Vec::new();
        while let Ok(s) = rx.try_recv() {
            what.push((s.entry.route.topic, s.cloud.is_some()));
            deliveries.push(s.delivery);
        }
        (what, deliveries)
    }

    fn topics(task: &SpoolTask) -> Vec<String> {
        task.tree
            .iter()
            .map(|kv| postcard::from_bytes::<Stored>(&kv.unwrap().1).unwrap().entry.route.topic)
            .collect()
    }

    /// A cloud nothing listens on: only its breaker is consulted here.
    fn cloud() -> Cloud {
        Cloud::new(crate::cloud::CloudOptions {
            url: "http://127.0.0.1:9".into(),
            token: None,
            ca_file: None,
            connect_timeout: Duration::from_millis(100),
            timeout: Duration::from_millis(100),
            max_concurrency: 1,
            retries: 0,
            breaker_failures: 5,
            breaker_open: Duration::from_secs(1),
            reserve: Duration::ZERO,
            fallback: true,
        })
        .unwrap()
    }

    fn answer() -> InferResponse {
        serde_json::from_str(r#"{"model_name": "digits-large", "outputs": []}"#).unwrap()
    }

    fn server_error() -> Result<InferResponse, CloudError> {
        Err(CloudError::Status { url: "u".into(), status: 500, body: "poison".into() })
    }

    #[test]
    fn the_oldest_make_room_and_end_with_the_edge_answer_and_the_rest_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (_spool, mut task, mut rx) = reopen(dir.path(), limits(3, u64::MAX));
            for n in 0..5 {
                assert!(task.store(entry(n), None).is_some());
            }
            assert_eq!(task.entries, 3);
            task.db.flush().unwrap();
            let (what, _) = ended(&mut rx);
            assert_eq!(what, vec![("dev/0".into(), false), ("dev/1".into(), false)], "oldest first");
        }
        let (_spool, task, _rx) = reopen(dir.path(), limits(3, u64::MAX));
        assert_eq!(task.entries, 3, "counted again at open");
        assert_eq!(topics(&task), vec!["dev/2", "dev/3", "dev/4"], "in arrival order");
        let one = encode(&Stored { attempts: 0, queued_at_ms: unix_ms(), entry: entry(0) }).len() as u64;
        drop(task);
        let (_spool, mut task, _rx) = reopen(dir.path(), limits(100, 2 * one));
        assert!(task.store(entry(9), None).is_some());
        assert_eq!(task.entries, 2, "the byte bound holds too");
        assert!(task.bytes <= 2 * one);
    }

    /// Issue 36: an entry whose final reply the request journal holds as
    /// sent goes at open; one under the same key for another route (a
    /// rebuilt store gives keys again) stays.
    #[test]
    fn entries_the_journal_sent_go_and_another_route_under_a_sent_key_stays() {
        let dir = tempfile::tempdir().unwrap();
        let (_spool, mut task, _rx) = reopen(dir.path(), limits(10, u64::MAX));
        let keys: Vec<Vec<u8>> = (0..3).map(|n| task.store(entry(n), None).unwrap().0.to_vec()).collect();
        let sent = HashMap::from([
            (keys[0].clone(), ("dev/0".to_string(), Some(vec![0]))),
            (keys[1].clone(), ("dev/other".to_string(), Some(vec![1]))),
            (b"gone".to_vec(), ("dev/9".to_string(), None)),
        ]);
        task.drop_sent(&sent);
        assert_eq!(topics(&task), vec!["dev/1", "dev/2"]);
        assert_eq!(task.entries, 2);
    }

    #[test]
    fn a_full_channel_to_the_broker_keeps_the_entry_for_later() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::channel(1);
        let (_spool, mut task) = open(dir.path(), limits(10, u64::MAX), tx).unwrap();
        let keys: Vec<Vec<u8>> = (0..2).map(|n| task.store(entry(n), None).unwrap().0.to_vec()).collect();
        task.finish(keys[0].clone(), entry(0), None);
        task.finish(keys[1].clone(), entry(1), None);
        let (what, _deliveries) = ended(&mut rx);
        assert_eq!(what, vec![("dev/0".into(), false)], "one fits the channel");
        task.delivery_reports();
        assert_eq!(task.entries, 2, "the one that did not fit is still stored");
        assert!(task.backoff.contains_key(&keys[1]), "and goes again after a pause");
        assert!(!task.undelivered.contains(&keys[1]));
    }

    #[test]
    fn a_store_whose_files_outgrow_their_bound_is_rebuilt_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let max_bytes = 256 * 1024;
        let (_spool, mut task, mut rx) = reopen(dir.path(), limits(100, max_bytes));
        let big = |n: usize| SpoolEntry { edge: vec![b'x'; 2000], ..entry(n) };
        let mut peak = 0;
        for n in 0..6000 {
            assert!(task.store(big(n), None).is_some());
            while rx.try_recv().is_ok() {}
            if n % 500 == 499 {
                task.db.flush().unwrap();
                peak = peak.max(task.db.size_on_disk().unwrap());
            }
        }
        let bound = crate::store::disk_bound(max_bytes);
        assert!(peak > bound, "the churn grew the files past the bound ({peak} <= {bound})");
        let before = topics(&task);
        task.size_checked = Instant::now() - Duration::from_secs(11);
        task.rebuild_if_grown();
        let after = task.db.size_on_disk().unwrap();
        assert!(after <= bound, "{after} > {bound}");
        assert_eq!(topics(&task), before, "the same entries, in the same order");
        assert_eq!(task.entries, 100);
        // New arrivals go after them.
        assert!(task.store(big(7000), None).is_some());
        assert_eq!(topics(&task).last().map(String::as_str), Some("dev/7000"));
        drop(task);
        let (_spool, task, _rx) = reopen(dir.path(), limits(100, max_bytes));
        assert_eq!(task.entries, 100, "the rebuilt store is the one opened next time");
    }

    #[test]
    fn entries_of_the_previous_format_are_kept_across_the_upgrade() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = sled::open(dir.path()).unwrap();
            for n in 0..2u64 {
                db.insert(n.to_be_bytes(), postcard::to_stdvec(&entry(n as usize)).unwrap()).unwrap();
            }
            db.flush().unwrap();
        }
        let (_spool, task, _rx) = reopen(dir.path(), limits(10, u64::MAX));
        assert_eq!(topics(&task), vec!["dev/0", "dev/1"]);
        assert_eq!(task.entries, 2);
        assert!(task.db.iter().next().is_none(), "the old tree is empty");
    }

    #[tokio::test]
    async fn an_escalation_whose_request_stopped_waiting_is_withdrawn() {
        let dir = tempfile::tempdir().unwrap();
        let (_spool, mut task, _rx) = reopen(dir.path(), limits(10, u64::MAX));
        let (waiting, stored) = tokio::sync::oneshot::channel();
        let (gone, dropped) = tokio::sync::oneshot::channel::<bool>();
        drop(dropped);
        let after = || crate::protocol::first_reply().1;
        task.store_all(vec![(entry(1), after(), None, waiting), (entry(2), after(), None, gone)]).await;
        assert!(stored.await.unwrap(), "the waiting request hears it is on disk");
        assert_eq!(topics(&task), vec!["dev/1"], "the abandoned one would have been a second final");
        assert_eq!(task.entries, 1);
        assert_eq!(task.first_replies.len(), 1, "the withdrawn one's first reply is forgotten with it");
    }

    /// Issue 16, finding 1: an entry used to leave the store as soon as its
    /// reply was handed on, before the broker had it.
    #[tokio::test]
    async fn an_entry_stays_until_the_broker_has_its_final_reply() {
        let dir = tempfile::tempdir().unwrap();
        let cloud = cloud();
        {
            let (_spool, mut task, mut rx) = reopen(dir.path(), limits(10, u64::MAX));
            task.store(entry(0), None).unwrap();
            let Next::Call(key, stored) = task.next(&cloud) else { panic!("due") };
            task.settle(key, stored, Ok(answer())).await;
            let (what, deliveries) = ended(&mut rx);
            assert_eq!(what, vec![("dev/0".into(), true)]);
            assert!(matches!(task.next(&cloud), Next::Idle), "not asked of the cloud twice");
            // Not delivered (the session was lost with it): asked again later.
            drop(deliveries);
            task.delivery_reports();
            assert_eq!(task.entries, 1);
            task.backoff.clear();
            let Next::Call(key, stored) = task.next(&cloud) else { panic!("due again") };
            task.settle(key, stored, Ok(answer())).await;
            let (_, deliveries) = ended(&mut rx);
            // The node dies before the broker acknowledged: kept on disk.
            std::mem::forget(deliveries);
            task.db.flush().unwrap();
        }
        let (_spool, mut task, mut rx) = reopen(dir.path(), limits(10, u64::MAX));
        assert_eq!(topics(&task), vec!["dev/0"], "still there after a restart");
        let Next::Call(key, stored) = task.next(&cloud) else { panic!("due after the restart") };
        task.settle(key, stored, Ok(answer())).await;
        let (_, deliveries) = ended(&mut rx);
        deliveries.into_iter().for_each(Delivery::confirm);
        task.delivery_reports();
        assert_eq!(task.entries, 0, "gone once the broker has it");
        assert!(matches!(task.next(&cloud), Next::Idle));
    }

    /// A fast cloud answered before the provisional reply had left, and the
    /// device got the final reply first (seen once in a full test run).
    #[tokio::test]
    async fn a_final_reply_carries_its_request_s_first_reply_and_waits_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let (_spool, mut task, mut rx) = reopen(dir.path(), limits(10, u64::MAX));
        let (pending, after) = crate::protocol::first_reply();
        task.store(entry(0), Some(after)).unwrap();
        let Next::Call(key, stored) = task.next(&cloud()) else { panic!("due") };
        task.settle(key, stored, Ok(answer())).await;
        let settled = rx.try_recv().expect("settled");
        assert!(task.first_replies.is_empty(), "handed on with the entry");
        let mut sent = Box::pin(settled.after.expect("the request's first reply").sent());
        let waited = tokio::time::timeout(Duration::from_millis(50), &mut sent).await;
        assert!(waited.is_err(), "the provisional reply has not been handed on yet");
        drop(pending);
        tokio::time::timeout(Duration::from_secs(1), sent).await.expect("resolves once handed on");
    }

    #[tokio::test]
    async fn an_entry_the_cloud_keeps_failing_steps_aside_then_ends_after_its_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let (_spool, mut task, mut rx) = reopen(dir.path(), limits(10, u64::MAX));
        for n in 0..3 {
            task.store(entry(n), None).unwrap();
        }
        let cloud = cloud();
        let Next::Call(poison, stored) = task.next(&cloud) else { panic!("the oldest is due") };
        assert_eq!(stored.entry.route.topic, "dev/0");
        task.settle(poison.clone(), stored, server_error()).await;
        // The failed one waits its turn; the ones behind it go meanwhile.
        let Next::Call(key, stored) = task.next(&cloud) else { panic!("the next is due") };
        assert_eq!(stored.entry.route.topic, "dev/1");
        task.settle(key, stored, Ok(answer())).await;
        // An outage (no answer at all) keeps the entry in its place, unpunished.
        let Next::Call(key, stored) = task.next(&cloud) else { panic!("dev/2 is due") };
        let unreachable = Err(CloudError::Unreachable { url: "u".into(), reason: "refused".into() });
        task.settle(key, stored, unreachable).await;
        assert!(matches!(task.next(&cloud), Next::WaitUntil(_)), "paused");
        task.paused_until = None;
        let Next::Call(key, stored) = task.next(&cloud) else { panic!("dev/2 again") };
        assert_eq!((stored.entry.route.topic.as_str(), stored.attempts), ("dev/2", 0));
        task.settle(key, stored, Ok(answer())).await;
        // The poison one: its attempts are on disk; the third ends it.
        for attempt in 2..=3 {
            assert!(matches!(task.next(&cloud), Next::WaitUntil(_)), "backing off");
            task.backoff.clear();
            let Next::Call(key, stored) = task.next(&cloud) else { panic!("due again") };
            assert_eq!((key.as_slice(), stored.attempts), (poison.as_slice(), attempt - 1));
            task.settle(key, stored, server_error()).await;
        }
        let (what, deliveries) = ended(&mut rx);
        assert_eq!(what, vec![("dev/1".into(), true), ("dev/2".into(), true), ("dev/0".into(), false)]);
        deliveries.into_iter().for_each(Delivery::confirm);
        task.delivery_reports();
        assert_eq!(task.entries, 0);
        assert!(matches!(task.next(&cloud), Next::Idle));
    }

    #[tokio::test]
    async fn an_entry_past_its_age_ends_with_the_edge_answer_even_in_an_outage() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = limits(10, u64::MAX);
        l.max_age = Duration::from_millis(1);
        let (_spool, mut task, mut rx) = reopen(dir.path(), l);
        task.store(entry(0), None).unwrap();
        task.paused_until = Some(Instant::now() + Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(10)).await;
        task.expire();
        task.expire();
        let (what, _deliveries) = ended(&mut rx);
        assert_eq!(what, vec![("dev/0".into(), false)], "once");
    }
}
