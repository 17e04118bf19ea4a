//! Async escalations waiting for the cloud, in sled under `state_dir/spool`,
//! so an outage or a restart loses none. One task owns the store: requests
//! hand it entries over a channel; it sends them to the cloud oldest first
//! and hands each settled one to the engine, which writes the final reply.

use super::{Cloud, CloudError};
use crate::protocol::{InferResponse, ReplyRoute};
use crate::telemetry;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
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
/// when the cloud will not give one (refused, or the entry was dropped to
/// make room). The engine turns it into the reply that ends the request.
#[derive(Debug)]
pub struct Settled {
    pub entry: SpoolEntry,
    pub cloud: Option<InferResponse>,
}

/// An entry, and who waits to hear it is on disk.
type Arrival = (SpoolEntry, tokio::sync::oneshot::Sender<bool>);

/// The requests' side: hands entries to the spool task.
#[derive(Clone)]
pub struct Spool {
    tx: mpsc::Sender<Arrival>,
}

impl Spool {
    /// Queues an entry and waits until it is on disk, so a provisional reply
    /// is only sent for an escalation that survives a restart. False when
    /// the task is too far behind or could not store it.
    pub async fn push(&self, entry: SpoolEntry) -> bool {
        let (done, stored) = tokio::sync::oneshot::channel();
        if self.tx.try_send((entry, done)).is_err() {
            return false;
        }
        stored.await.unwrap_or(false)
    }
}

pub struct SpoolTask {
    db: sled::Db,
    rx: mpsc::Receiver<Arrival>,
    max_entries: usize,
    max_bytes: u64,
    entries: usize,
    bytes: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("the cloud spool {path}: {message}")]
pub struct SpoolError {
    path: String,
    message: String,
}

/// Opens (or creates) the store; what it holds from before a restart is
/// sent first.
pub fn open(dir: &Path, max_entries: usize, max_bytes: u64) -> Result<(Spool, SpoolTask), SpoolError> {
    let err = |e: sled::Error| SpoolError { path: dir.display().to_string(), message: e.to_string() };
    let db = sled::Config::new().path(dir).cache_capacity(1024 * 1024).open().map_err(err)?;
    let (mut entries, mut bytes) = (0usize, 0u64);
    for item in db.iter() {
        let (_, v) = item.map_err(err)?;
        entries += 1;
        bytes += v.len() as u64;
    }
    if entries > 0 {
        tracing::info!("cloud spool: {entries} escalations from before the restart wait for the cloud");
    }
    let (tx, rx) = mpsc::channel(1024);
    let task = SpoolTask { db, rx, max_entries: max_entries.max(1), max_bytes, entries, bytes };
    task.gauges();
    Ok((Spool { tx }, task))
}

impl SpoolTask {
    /// Runs until every `Spool` handle is gone (the entries left stay on
    /// disk for the next start).
    pub async fn run(mut self, cloud: Arc<Cloud>, settled: mpsc::UnboundedSender<Settled>) {
        let send = |entry: SpoolEntry, cloud: Option<InferResponse>| {
            let _ = settled.send(Settled { entry, cloud });
        };
        let mut resume_at: Option<tokio::time::Instant> = None;
        loop {
            let mut arrived = Vec::new();
            while let Ok(arrival) = self.rx.try_recv() {
                arrived.push(arrival);
            }
            self.store_all(arrived, &send).await;
            let oldest = self.db.first().ok().flatten();
            let wake = match (&oldest, resume_at) {
                (None, _) => Some(None),
                (Some(_), Some(at)) if tokio::time::Instant::now() < at => Some(Some(at)),
                _ => None,
            };
            if let Some(until) = wake {
                let arrived = match until {
                    None => self.rx.recv().await,
                    Some(at) => match tokio::time::timeout_at(at, self.rx.recv()).await {
                        Ok(arrived) => arrived,
                        Err(_) => continue,
                    },
                };
                match arrived {
                    Some(arrival) => {
                        self.store_all(vec![arrival], &send).await;
                        continue;
                    }
                    None => return,
                }
            }
            resume_at = None;
            let Some((key, value)) = oldest else { continue };
            let Ok(entry) = postcard::from_bytes::<SpoolEntry>(&value) else {
                tracing::warn!("cloud spool: an unreadable entry was dropped");
                self.remove(&key, value.len());
                continue;
            };
            let retry_in = cloud.retry_in();
            if !retry_in.is_zero() {
                resume_at = Some(tokio::time::Instant::now() + retry_in);
                continue;
            }
            let Ok(request) = serde_json::from_slice(&entry.request) else {
                send(entry, None);
                self.remove(&key, value.len());
                continue;
            };
            match cloud.infer(&entry.model, &entry.cloud_model, &request, None).await {
                Ok(response) => send(entry, Some(response)),
                Err(e @ (CloudError::Status { .. } | CloudError::Invalid(_))) if !e.retryable() => {
                    tracing::warn!("cloud spool: the cloud refused an escalation of {}: {e}", entry.model);
                    send(entry, None);
                }
                Err(_) => {
                    // Kept: the uplink or the cloud is down; the breaker
                    // (or this pause) spaces the retries.
                    resume_at = Some(tokio::time::Instant::now() + Duration::from_millis(200));
                    continue;
                }
            }
            self.remove(&key, value.len());
            let _ = self.db.flush_async().await;
        }
    }

    /// Stores what arrived, flushes, then tells each sender.
    async fn store_all(&mut self, arrived: Vec<Arrival>, send: &impl Fn(SpoolEntry, Option<InferResponse>)) {
        if arrived.is_empty() {
            return;
        }
        let outcomes: Vec<_> = arrived.into_iter().map(|(e, done)| (self.store(e, send), done)).collect();
        let flushed = self.db.flush_async().await.is_ok();
        for (stored, done) in outcomes {
            let _ = done.send(stored && flushed);
        }
    }

    /// Keeps the entry, dropping the oldest to stay within the bounds; a
    /// dropped one's device gets the edge answer as the final reply.
    fn store(&mut self, entry: SpoolEntry, send: &impl Fn(SpoolEntry, Option<InferResponse>)) -> bool {
        let value = postcard::to_stdvec(&entry).expect("postcard encoding into a Vec cannot fail");
        let len = value.len() as u64;
        while self.entries > 0 && (self.entries >= self.max_entries || self.bytes + len > self.max_bytes) {
            let Ok(Some((_, old))) = self.db.pop_min() else { break };
            self.entries -= 1;
            self.bytes = self.bytes.saturating_sub(old.len() as u64);
            metrics::counter!(telemetry::CLOUD_SPOOL_DROPPED).increment(1);
            if let Ok(old) = postcard::from_bytes::<SpoolEntry>(&old) {
                send(old, None);
            }
        }
        let id = self.db.generate_id().unwrap_or(0);
        let stored = match self.db.insert(id.to_be_bytes(), value) {
            Ok(_) => {
                self.entries += 1;
                self.bytes += len;
                true
            }
            Err(e) => {
                tracing::warn!("cloud spool: cannot store an escalation ({e}); it is answered synchronously");
                false
            }
        };
        self.gauges();
        stored
    }

    fn remove(&mut self, key: &[u8], len: usize) {
        if let Ok(Some(_)) = self.db.remove(key) {
            self.entries = self.entries.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub(len as u64);
        }
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
    use std::sync::Mutex;

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

    /// `open` again after a drop: sled's flusher thread can hold the file
    /// lock a moment after its `Db` is gone (seen under full-suite load).
    fn reopen(dir: &Path, max_entries: usize, max_bytes: u64) -> (Spool, SpoolTask) {
        let start = std::time::Instant::now();
        loop {
            match open(dir, max_entries, max_bytes) {
                Ok(opened) => return opened,
                Err(e) if start.elapsed() > Duration::from_secs(5) => panic!("{e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    #[test]
    fn the_oldest_make_room_and_end_with_the_edge_answer_and_the_rest_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let ended = Mutex::new(Vec::new());
        let send = |e: SpoolEntry, cloud: Option<InferResponse>| {
            assert!(cloud.is_none(), "a dropped entry never had the cloud's answer");
            ended.lock().unwrap().push(e.route.topic);
        };
        {
            let (_spool, mut task) = open(dir.path(), 3, u64::MAX).unwrap();
            for n in 0..5 {
                assert!(task.store(entry(n), &send));
            }
            assert_eq!(task.entries, 3);
            task.db.flush().unwrap();
        }
        assert_eq!(*ended.lock().unwrap(), vec!["dev/0", "dev/1"], "oldest first");
        let (_spool, task) = reopen(dir.path(), 3, u64::MAX);
        assert_eq!(task.entries, 3, "counted again at open");
        let kept: Vec<String> = task
            .db
            .iter()
            .map(|kv| postcard::from_bytes::<SpoolEntry>(&kv.unwrap().1).unwrap().route.topic)
            .collect();
        assert_eq!(kept, vec!["dev/2", "dev/3", "dev/4"], "in arrival order");
        let one = postcard::to_stdvec(&entry(0)).unwrap().len() as u64;
        drop(task);
        drop(_spool);
        let (_spool, mut task) = reopen(dir.path(), 100, 2 * one);
        assert!(task.store(entry(9), &send));
        assert_eq!(task.entries, 2, "the byte bound holds too");
        assert!(task.bytes <= 2 * one);
    }
}
