//! The request journal: the node takes ownership of a request on its own
//! topic [MQTT-4.3.2-4] by journaling it in `node.state_dir/journal`, and
//! acknowledges it then, not after its reply: a slow request no longer
//! holds back the acknowledgements of those behind it (they must go in
//! arrival order), and a request the node dies on is run again at the next
//! start from the journal instead of from the broker.
//!
//! The request task that takes a request writes its record itself, under
//! the journal's lock, with the answers recorded since the last write: one
//! `write` call, no thread between the request and the disk (a hop to a
//! writer thread and back cost the node a quarter of its saturated
//! throughput on a 2-core gateway). Its reply may go once that returns (a
//! kill -9 keeps what the kernel has). A sync thread syncs
//! (`mqtt.journal.fsync`: a power cut keeps it), once for every request
//! written in `mqtt.journal.commit_window_ms`, and only then may their
//! acknowledgements go. The broker's confirmation of a reply is recorded
//! `Answered` in memory and written by the MQTT loop once it has handled
//! what the socket brought (`Journal::flush`), or with the next request.
//! At a start the journaled requests without `Answered` run again. A
//! re-delivery (DUP) of a request the journal holds or answered is
//! acknowledged and not run.
//!
//! With `mqtt.reply_qos = 2` the journal keeps the replies too: the MQTT
//! loop records each reply (and follow-up) `Sent` with its packet id
//! before the write that carries it (`Journal::sent`, one write for all a
//! wakeup sends), `Released` before its PUBREL, `Answered` at PUBCOMP. A
//! start sends each reply not `Answered` again under its packet id
//! (`Recovered::replies`), so a kill -9 between a reply and the record of
//! its confirmation no longer answers twice. These records are written
//! before the packets go (a crash keeps them) and synced after (a power
//! cut in that moment may still send one twice).
//!
//! The share group's requests are not journaled: left unacknowledged
//! until answered, they go to another member if this node dies.

mod log;

use crate::telemetry::unix_now_ms;
use log::Log;
pub use log::{InFlight, Recovered, Waiting};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;

/// What tells a re-delivery from a new request: a hash of what the device
/// sent (topic, payload, reply topic, correlation data). Never stored: a
/// restart hashes the journaled requests again, so the hash need not be
/// stable across builds.
pub type Key = u64;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("the request journal at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("the request journal's thread has stopped")]
    Stopped,
}

impl JournalError {
    fn io(path: &Path, source: std::io::Error) -> JournalError {
        JournalError::Io { path: path.to_path_buf(), source }
    }
}

/// What it takes to run a request again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub topic: String,
    pub payload: Vec<u8>,
    pub response_topic: Option<String>,
    pub correlation: Option<Vec<u8>>,
    pub content_type: Option<String>,
    /// MQTT 5 Message Expiry, counted from `received_unix_ms`.
    pub expiry_s: Option<u32>,
    pub user_properties: Vec<(String, String)>,
    pub received_unix_ms: u64,
}

impl Request {
    pub fn from_publish(publish: &Publish) -> Request {
        let props = publish.properties.clone().unwrap_or_default();
        Request {
            topic: String::from_utf8_lossy(&publish.topic).into_owned(),
            payload: publish.payload.to_vec(),
            response_topic: props.response_topic,
            correlation: props.correlation_data.map(|c| c.to_vec()),
            content_type: props.content_type,
            expiry_s: props.message_expiry_interval,
            user_properties: props.user_properties,
            received_unix_ms: unix_now_ms(),
        }
    }

    /// The request as it arrived, its expiry shortened by the time since
    /// (zero once it passed: the engine answers `deadline_exceeded`).
    pub fn to_publish(&self) -> Publish {
        let elapsed_s = unix_now_ms().saturating_sub(self.received_unix_ms).div_ceil(1000);
        let props = PublishProperties {
            response_topic: self.response_topic.clone(),
            correlation_data: self.correlation.clone().map(Into::into),
            content_type: self.content_type.clone(),
            message_expiry_interval: self
                .expiry_s
                .map(|s| s.saturating_sub(elapsed_s.min(u32::MAX as u64) as u32)),
            user_properties: self.user_properties.clone(),
            ..Default::default()
        };
        Publish::new(self.topic.clone(), QoS::AtLeastOnce, self.payload.clone(), Some(props))
    }

    /// SipHash-1-3 with fixed keys: a few GB/s, and 64 bits leave a
    /// collision among the few thousand keys remembered at about 1 in 10^12.
    fn key(&self) -> Key {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        (&self.topic, &self.response_topic, &self.correlation, &self.payload).hash(&mut hasher);
        hasher.finish()
    }
}

/// A reply (or follow-up) published QoS 2 and journaled before it went:
/// what it takes to send it again under the same packet id.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SentReply {
    /// The journaled request it answers: answered by this record.
    pub request: Option<u64>,
    pub pkid: u16,
    /// A follow-up's entry in the cloud spool: the spool may still hold it
    /// after a crash, and must not send it again.
    pub spool_key: Option<Vec<u8>>,
    pub topic: String,
    pub payload: Vec<u8>,
    pub correlation: Option<Vec<u8>>,
    pub content_type: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

impl SentReply {
    pub fn new(publish: &Publish, request: Option<u64>, spool_key: Option<Vec<u8>>) -> SentReply {
        let props = publish.properties.as_ref();
        SentReply {
            request,
            pkid: publish.pkid,
            spool_key,
            topic: String::from_utf8_lossy(&publish.topic).into_owned(),
            payload: publish.payload.to_vec(),
            correlation: props.and_then(|p| p.correlation_data.as_ref()).map(|c| c.to_vec()),
            content_type: props.and_then(|p| p.content_type.clone()),
            user_properties: props.map(|p| p.user_properties.clone()).unwrap_or_default(),
        }
    }

    /// The publish as it went, with its packet id.
    pub fn to_publish(&self) -> Publish {
        let props = PublishProperties {
            correlation_data: self.correlation.clone().map(Into::into),
            content_type: self.content_type.clone(),
            user_properties: self.user_properties.clone(),
            ..Default::default()
        };
        let mut publish =
            Publish::new(self.topic.clone(), QoS::ExactlyOnce, self.payload.clone(), Some(props));
        publish.pkid = self.pkid;
        publish
    }
}

/// `[mqtt.journal]`.
#[derive(Debug, Clone)]
pub struct JournalOptions {
    pub dir: PathBuf,
    pub max_bytes: u64,
    pub fsync: bool,
    /// How long the sync thread gathers requests written before one sync.
    pub commit_window: Duration,
    /// Keys of answered requests remembered to tell re-deliveries.
    pub answered_capacity: usize,
}

/// The journal's answer to a request.
pub enum Kept {
    /// Journaled and written: its reply may go; `durable` says when it is
    /// synced (its acknowledgement may go then).
    Journaled { seq: u64, durable: Durable },
    /// A re-delivery of a request the journal holds or answered: acknowledge
    /// it and run nothing.
    Duplicate,
    /// Not journaled (no room within `max_bytes`, or the disk failed): the
    /// request is acknowledged after its reply, as without a journal.
    NotKept,
}

/// How long a request's acknowledgement waits for the journal's sync
/// before it goes after its reply instead: a hung disk must not hold the
/// requests on the node's own topic (their admission permits) for ever.
const SYNC_WAIT: Duration = Duration::from_secs(2);

/// Resolves `true` once the journal has synced a request, `false` if the
/// sync failed or took longer than `SYNC_WAIT`.
pub struct Durable {
    synced: oneshot::Receiver<()>,
    give_up: Pin<Box<tokio::time::Sleep>>,
}

impl Durable {
    fn new(synced: oneshot::Receiver<()>) -> Durable {
        Durable { synced, give_up: Box::pin(tokio::time::sleep(SYNC_WAIT)) }
    }
}

impl Future for Durable {
    type Output = bool;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        if let Poll::Ready(synced) = Pin::new(&mut self.synced).poll(cx) {
            return Poll::Ready(synced.is_ok());
        }
        if self.give_up.as_mut().poll(cx).is_ready() {
            metrics::counter!(crate::telemetry::JOURNAL_NOT_KEPT, "reason" => "slow").increment(1);
            return Poll::Ready(false);
        }
        Poll::Pending
    }
}

/// A handle to the journal.
#[derive(Clone)]
pub struct Journal {
    shared: Arc<Shared>,
}

struct Shared {
    log: Mutex<Log>,
    /// To the sync thread.
    to_sync: std_mpsc::Sender<SyncJob>,
}

/// Files written and the requests that wait for them to be synced.
struct SyncJob {
    files: Vec<Arc<File>>,
    durable: Option<oneshot::Sender<()>>,
}

/// The sync thread, to wait for once every `Journal` is dropped.
pub struct JournalThread(Option<std::thread::JoinHandle<()>>);

impl JournalThread {
    /// Waits for the sync thread to finish what was sent, up to `limit`.
    pub fn finish(self, limit: Duration) {
        let Some(thread) = self.0 else { return };
        let started = std::time::Instant::now();
        while !thread.is_finished() && started.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            tracing::warn!("the request journal did not finish syncing in {limit:?}");
        }
    }
}

impl Journal {
    /// Opens the journal and starts its sync thread; answers what a
    /// previous run left: requests to run again, replies to send again.
    pub fn open(options: JournalOptions) -> Result<(Journal, Recovered, JournalThread), JournalError> {
        let (log, recovered) =
            Log::open(&options.dir, options.max_bytes, options.fsync, options.answered_capacity)?;
        metrics::gauge!(crate::telemetry::JOURNAL_BYTES).set(log.bytes() as f64);
        // Without fsync too: the thread then only gathers each window's
        // requests, so their acknowledgements leave together (one write)
        // rather than one by one ahead of their replies.
        let (to_sync, rx) = std_mpsc::channel();
        let (window, fsync) = (options.commit_window, options.fsync);
        let thread = std::thread::Builder::new()
            .name("journal-sync".into())
            .spawn(move || sync_loop(rx, window, fsync))
            .map_err(|e| JournalError::io(&options.dir, e))?;
        let shared = Arc::new(Shared { log: Mutex::new(log), to_sync });
        Ok((Journal { shared }, recovered, JournalThread(Some(thread))))
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.shared.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Journals `publish` (a request on the node's own topic): written when
    /// this returns, synced when its `durable` says so.
    pub fn keep(&self, publish: &Publish) -> Kept {
        let request = Request::from_publish(publish);
        let key = request.key();
        let mut log = self.log();
        if publish.dup && log.knows(&key) {
            metrics::counter!(crate::telemetry::JOURNAL_DUPLICATES).increment(1);
            return Kept::Duplicate;
        }
        if log.failing {
            return not_kept("error");
        }
        let Some(seq) = log.arrived(key, &request) else { return not_kept("full") };
        if let Err(e) = log.write() {
            // Nothing of this write was journaled (the log undid it), and
            // nothing more is until a restart reads what is whole.
            tracing::error!("{e}; requests are acknowledged after their reply until the node restarts");
            log.failing = true;
            return not_kept("error");
        }
        metrics::gauge!(crate::telemetry::JOURNAL_BYTES).set(log.bytes() as f64);
        let (tx, rx) = oneshot::channel();
        let files = log.take_unsynced();
        drop(log);
        let _ = self.shared.to_sync.send(SyncJob { files, durable: Some(tx) });
        Kept::Journaled { seq, durable: Durable::new(rx) }
    }

    /// The broker confirmed request `seq`'s final reply (or it will never
    /// get one): not to be run again. Written by the next `flush` or
    /// `keep`.
    pub fn answered(&self, seq: u64) {
        self.log().answered(seq);
    }

    /// Records `reply` `Sent` (written by the next `flush` or `keep`);
    /// answers its seq, or `None` when the journal is failing.
    pub fn sent(&self, reply: &SentReply) -> Option<u64> {
        let mut log = self.log();
        (!log.failing).then(|| log.sent(reply))
    }

    /// The broker's PUBREC of the reply `Sent` as `seq`: recorded, written
    /// by the next `flush`, and only then may its PUBREL go.
    pub fn released(&self, seq: u64) {
        self.log().released(seq);
    }

    /// Writes what was recorded since the last write (answers, replies
    /// sent, releases); the sync thread syncs it soon after. `false` once
    /// a write failed, this one or an earlier one (whose replies `Sent`
    /// were dropped with it): the journal then keeps nothing more
    /// (requests are acknowledged after their reply, replies go
    /// unjournaled) until a restart.
    pub fn flush(&self) -> bool {
        let mut log = self.log();
        if !log.has_buffered() {
            return !log.failing;
        }
        if let Err(e) = log.write() {
            // As in `keep`: what a failing disk wrote cannot be trusted
            // until a restart reads what is whole.
            tracing::error!("{e}; the journal keeps nothing more until the node restarts");
            log.failing = true;
            return false;
        }
        let (files, whole) = (log.take_unsynced(), !log.failing);
        drop(log);
        let _ = self.shared.to_sync.send(SyncJob { files, durable: None });
        whole
    }
}

impl Drop for Shared {
    /// The last answers, written and synced before the process exits.
    fn drop(&mut self) {
        let log = self.log.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = log.write();
        let _ = self.to_sync.send(SyncJob { files: log.take_unsynced(), durable: None });
    }
}

/// The sync thread: gathers what is written for `window`, syncs each file
/// once (with `fsync`), then the acknowledgements of every request in it
/// may go. A failed sync leaves them to go after their replies (the
/// records are written: a crash of the node keeps them; a power cut may
/// not).
fn sync_loop(rx: std_mpsc::Receiver<SyncJob>, window: Duration, fsync: bool) {
    while let Ok(job) = rx.recv() {
        if !window.is_zero() {
            std::thread::sleep(window);
        }
        let mut jobs = vec![job];
        jobs.extend(rx.try_iter());
        // `FAILPOINTS=journal_sync=sleep(MS)`: a slow disk, for the tests.
        fail::fail_point!("journal_sync");
        let mut files: Vec<&Arc<File>> = Vec::new();
        for file in jobs.iter().flat_map(|j| &j.files) {
            if !files.iter().any(|f| Arc::ptr_eq(f, file)) {
                files.push(file);
            }
        }
        match files.iter().filter(|_| fsync).try_for_each(|f| f.sync_data()) {
            Ok(()) => jobs.into_iter().filter_map(|j| j.durable).for_each(|tx| {
                let _ = tx.send(());
            }),
            Err(e) => tracing::error!(
                "the request journal cannot sync: {e}; the requests of this group are acknowledged after their reply"
            ),
        }
    }
}

fn not_kept(reason: &'static str) -> Kept {
    metrics::counter!(crate::telemetry::JOURNAL_NOT_KEPT, "reason" => reason).increment(1);
    Kept::NotKept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(dir: &Path) -> JournalOptions {
        JournalOptions {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 20,
            fsync: true,
            commit_window: Duration::from_millis(1),
            answered_capacity: 64,
        }
    }

    fn publish(n: u8, dup: bool) -> Publish {
        let props = PublishProperties {
            response_topic: Some(format!("dev/{n}/replies")),
            correlation_data: Some(vec![n].into()),
            message_expiry_interval: Some(60),
            ..Default::default()
        };
        let mut publish =
            Publish::new(format!("edge/gw/infer/m{n}"), QoS::AtLeastOnce, vec![n; 32], Some(props));
        publish.dup = dup;
        publish
    }

    async fn journaled(kept: Kept) -> u64 {
        match kept {
            Kept::Journaled { seq, durable } => {
                assert!(durable.await, "synced");
                seq
            }
            Kept::Duplicate => panic!("a duplicate"),
            Kept::NotKept => panic!("not kept"),
        }
    }

    /// Only a re-delivery (DUP) of a request the journal holds or answered
    /// is a duplicate: the same bytes sent again by a device are run again.
    /// What was not answered comes back at the next open, as it arrived.
    #[tokio::test]
    async fn a_redelivery_is_a_duplicate_a_new_copy_is_not_and_the_unanswered_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, recovered, thread) = Journal::open(options(dir.path())).unwrap();
        assert!(recovered.requests.is_empty());
        let first = journaled(journal.keep(&publish(1, false))).await;
        assert!(matches!(journal.keep(&publish(1, true)), Kept::Duplicate), "held: a re-delivery");
        let again = journaled(journal.keep(&publish(1, false))).await;
        assert_ne!(first, again, "sent again by the device: a request of its own");
        let other = journaled(journal.keep(&publish(2, false))).await;
        journal.answered(first);
        journal.answered(again);
        assert!(matches!(journal.keep(&publish(1, true)), Kept::Duplicate), "answered: a re-delivery");
        let third = journaled(journal.keep(&publish(3, true))).await;
        drop(journal);
        thread.finish(Duration::from_secs(5));
        let (_journal, recovered, _thread) = Journal::open(options(dir.path())).unwrap();
        let waiting = recovered.requests;
        let back: Vec<u64> = waiting.iter().map(|w| w.seq).collect();
        assert_eq!(back, vec![other, third]);
        let replayed = waiting[0].request.to_publish();
        let original = publish(2, false);
        assert_eq!((replayed.topic, replayed.payload), (original.topic, original.payload));
        let props = replayed.properties.unwrap();
        assert_eq!(props.response_topic.as_deref(), Some("dev/2/replies"));
        assert_eq!(props.correlation_data.as_deref(), Some(&[2u8][..]));
        assert!(matches!(props.message_expiry_interval, Some(59 | 60)), "{props:?}");
    }
}
