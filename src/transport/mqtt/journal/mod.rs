//! The request journal: the node takes ownership of a request on its own
//! topic [MQTT-4.3.2-4] by journaling it in `node.state_dir/journal`, and
//! acknowledges it then, not after its reply: a slow request no longer
//! holds back the acknowledgements of those behind it (they must go in
//! arrival order), and a request the node dies on is run again at the next
//! start from the journal instead of from the broker.
//!
//! The loop of the node's own connection records each request as it hands
//! it to its task (in memory). A sync thread, woken by the first record
//! and waiting `mqtt.journal.commit_window_ms` for more, writes what was
//! recorded in one `write` (a kill -9 keeps what the kernel has), syncs
//! (`mqtt.journal.fsync`: a power cut keeps it) and then publishes how far
//! it got (`Journal::synced_through`), waking the loop once: it
//! acknowledges every request up to there, in arrival order
//! (`acks::JournaledAcks`). One write, one sync and one wake-up a window,
//! not a write and two hand-offs a request: at one request in flight
//! those cost the node half again its CPU per request. The broker's
//! confirmation of a reply is recorded `Answered` in memory and written
//! the same way. At a start the journaled requests without `Answered` run
//! again. A re-delivery (DUP) of a request the journal holds or answered
//! is acknowledged and not run. A request unacknowledged is the broker's
//! to deliver again: if the node dies before its record is written, it
//! comes back from the broker, not the journal.
//!
//! With `mqtt.reply_qos = 2` the journal keeps the replies too: the MQTT
//! loop records each reply (and follow-up) `Sent` with its packet id
//! and writes it itself before the socket write that carries it
//! (`Journal::flush`, one write for all a wakeup sends, with the requests
//! recorded before), `Released` before its PUBREL, `Answered` at PUBCOMP. A
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
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// How long the sync thread gathers records before one write and sync.
    pub commit_window: Duration,
    /// Keys of answered requests remembered to tell re-deliveries.
    pub answered_capacity: usize,
}

/// The journal's answer to a request.
pub enum Kept {
    /// Recorded as `seq`: written with the loop's next write, before
    /// anything the request causes can leave; its acknowledgement may go
    /// once `Journal::synced_through` reaches `seq`.
    Journaled { seq: u64 },
    /// A re-delivery of a request the journal holds or answered:
    /// acknowledge it and run nothing.
    Duplicate,
    /// Not journaled (no room within `max_bytes`, or the disk failed): the
    /// request is acknowledged after its reply, as without a journal.
    NotKept,
}

/// How far the sync thread got: every record up to `synced` is on disk
/// (without fsync: its window passed); every record up to `failed` was in
/// a group whose sync failed. Both only grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncedThrough {
    pub synced: u64,
    pub failed: u64,
}

/// A handle to the journal.
#[derive(Clone)]
pub struct Journal {
    shared: Arc<Shared>,
}

struct Shared {
    /// Also the sync thread's, which writes what need not wait (below).
    log: Arc<Mutex<Log>>,
    /// To the sync thread.
    to_sync: std_mpsc::Sender<SyncJob>,
    progress: Arc<Progress>,
}

/// The sync thread's side of `SyncedThrough`, and the wake-up it gives.
#[derive(Default)]
struct Progress {
    synced: AtomicU64,
    failed: AtomicU64,
    woken: tokio::sync::Notify,
}

/// Files written, and the last seq written to them.
struct SyncJob {
    files: Vec<Arc<File>>,
    through: u64,
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
        let progress = Arc::new(Progress::default());
        let log = Arc::new(Mutex::new(log));
        let syncer = Syncer { log: log.clone(), progress: progress.clone(), window, fsync };
        let thread = std::thread::Builder::new()
            .name("journal-sync".into())
            .spawn(move || syncer.run(rx))
            .map_err(|e| JournalError::io(&options.dir, e))?;
        let shared = Arc::new(Shared { log, to_sync, progress });
        Ok((Journal { shared }, recovered, JournalThread(Some(thread))))
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        lock(&self.shared.log)
    }

    /// Journals `publish` (a request on the node's own topic): recorded,
    /// written by the next `flush` or `write_soon`.
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
        match log.arrived(key, &request) {
            Some(seq) => Kept::Journaled { seq },
            None => not_kept("full"),
        }
    }

    /// How far the sync thread got.
    pub fn synced_through(&self) -> SyncedThrough {
        let progress = &self.shared.progress;
        SyncedThrough {
            synced: progress.synced.load(Ordering::Acquire),
            failed: progress.failed.load(Ordering::Acquire),
        }
    }

    /// Resolves once the sync thread got further than when it last woke
    /// someone (at once if it did since).
    pub async fn synced(&self) {
        self.shared.progress.woken.notified().await
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

    /// Has the sync thread write what was recorded (requests, answers)
    /// within `commit_window`, with its sync: nothing waits for these
    /// records but acknowledgements, which wait for the sync anyway, so
    /// the loop makes no `write` for them (at one request in flight two
    /// writes a request were a third of the node's CPU). A request's reply
    /// may go before its record is written: a crash before then leaves the
    /// request unacknowledged, for the broker to deliver again, as
    /// without a journal.
    pub fn write_soon(&self) {
        let _ = self.shared.to_sync.send(SyncJob { files: Vec::new(), through: 0 });
    }

    /// Writes what was recorded since the last write (requests, answers,
    /// replies sent, releases) now, for what must not go before its
    /// record: a QoS 2 reply, a PUBREL. The sync thread syncs it soon
    /// after.
    /// `false` once a write failed, this one or an earlier one (whose
    /// requests and replies `Sent` were dropped with it): the journal then
    /// keeps nothing more (requests are acknowledged after their reply,
    /// replies go unjournaled) until a restart.
    pub fn flush(&self) -> bool {
        let mut log = self.log();
        if !log.has_buffered() {
            return !log.failing;
        }
        if !write_recorded(&mut log) {
            return false;
        }
        let (files, through, whole) = (log.take_unsynced(), log.last_seq(), !log.failing);
        drop(log);
        let _ = self.shared.to_sync.send(SyncJob { files, through });
        whole
    }
}

impl Drop for Shared {
    /// The last answers, written and synced before the process exits.
    fn drop(&mut self) {
        let mut log = lock(&self.log);
        let _ = log.write();
        let _ = self.to_sync.send(SyncJob { files: log.take_unsynced(), through: log.last_seq() });
    }
}

fn lock(log: &Mutex<Log>) -> std::sync::MutexGuard<'_, Log> {
    log.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes what was recorded: whether that write went. What a failing disk
/// wrote cannot be trusted until a restart reads what is whole: nothing of
/// a failed write was journaled (the log undid it), and nothing more is.
fn write_recorded(log: &mut Log) -> bool {
    if let Err(e) = log.write() {
        tracing::error!(
            "{e}; the journal keeps nothing more until the node restarts (requests are acknowledged after \
             their reply)"
        );
        log.failing = true;
        return false;
    }
    metrics::gauge!(crate::telemetry::JOURNAL_BYTES).set(log.bytes() as f64);
    true
}

/// The sync thread.
struct Syncer {
    log: Arc<Mutex<Log>>,
    progress: Arc<Progress>,
    window: Duration,
    fsync: bool,
}

impl Syncer {
    /// Gathers what is written for `window` after the first job, writes
    /// what waits to be written (`Journal::write_soon`), syncs each file
    /// once (with `fsync`), then publishes how far that got and wakes the
    /// loop that acknowledges. A failed write or sync is published as
    /// such: those requests are acknowledged after their replies (a
    /// record written survives a crash of the node; a power cut may not).
    fn run(self, rx: std_mpsc::Receiver<SyncJob>) {
        while let Ok(job) = rx.recv() {
            if !self.window.is_zero() {
                std::thread::sleep(self.window);
            }
            let mut jobs = vec![job];
            jobs.extend(rx.try_iter());
            let mut through = jobs.iter().map(|j| j.through).max().unwrap_or(0);
            let mut files: Vec<Arc<File>> = jobs.into_iter().flat_map(|j| j.files).collect();
            let written = {
                let mut log = lock(&self.log);
                let written = write_recorded(&mut log) && !log.failing;
                files.extend(log.take_unsynced());
                through = through.max(log.last_seq());
                written
            };
            let mut unique: Vec<Arc<File>> = Vec::with_capacity(files.len());
            for file in files {
                if !unique.iter().any(|u| Arc::ptr_eq(u, &file)) {
                    unique.push(file);
                }
            }
            // `FAILPOINTS=journal_sync=sleep(MS)`: a slow disk, for the tests.
            fail::fail_point!("journal_sync");
            let synced = unique.iter().filter(|_| self.fsync).try_for_each(|f| f.sync_data());
            if let Err(e) = &synced {
                tracing::error!(
                    "the request journal cannot sync: {e}; the requests of this group are acknowledged after \
                     their reply"
                );
            }
            match written && synced.is_ok() {
                true => self.progress.synced.fetch_max(through, Ordering::Release),
                false => self.progress.failed.fetch_max(through, Ordering::Release),
            };
            self.progress.woken.notify_one();
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

    /// The seq of a request kept, once written and synced.
    async fn journaled(journal: &Journal, kept: Kept) -> u64 {
        match kept {
            Kept::Journaled { seq } => {
                // Written by the sync thread, with its sync.
                journal.write_soon();
                while journal.synced_through().synced < seq {
                    journal.synced().await;
                }
                assert_eq!(journal.synced_through().failed, 0);
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
        let first = journaled(&journal, journal.keep(&publish(1, false))).await;
        assert!(matches!(journal.keep(&publish(1, true)), Kept::Duplicate), "held: a re-delivery");
        let again = journaled(&journal, journal.keep(&publish(1, false))).await;
        assert_ne!(first, again, "sent again by the device: a request of its own");
        let other = journaled(&journal, journal.keep(&publish(2, false))).await;
        journal.answered(first);
        journal.answered(again);
        assert!(matches!(journal.keep(&publish(1, true)), Kept::Duplicate), "answered: a re-delivery");
        let third = journaled(&journal, journal.keep(&publish(3, true))).await;
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
