//! The request journal: the node takes ownership of a request on its own
//! topic [MQTT-4.3.2-4] by journaling it in `node.state_dir/journal`, and
//! acknowledges it then, not after its reply: a slow request no longer
//! holds back the acknowledgements of those behind it (they must go in
//! arrival order), and a request the node dies on is run again at the next
//! start from the journal instead of from the broker.
//!
//! One thread owns the files (`log.rs`) and commits in groups: the
//! requests that arrived while it was busy go in one `write`; their replies
//! may go once it returns (a kill -9 keeps what the kernel has). A second
//! thread syncs (`mqtt.journal.fsync`: a power cut keeps it), one sync for
//! every request written in `mqtt.journal.commit_window_ms`, and only then
//! may their acknowledgements go; the writer goes on meanwhile, so no reply
//! waits for a sync.
//! A request's final reply confirmed by the broker is recorded `Answered`;
//! at a start, those without are run again. A re-delivery (DUP) of a
//! request the journal holds or answered is acknowledged and not run.
//!
//! The share group's requests are not journaled: left unacknowledged
//! until answered, they go to another member if this node dies.

mod log;

use log::Log;
pub use log::Waiting;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
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
            received_unix_ms: unix_ms(),
        }
    }

    /// The request as it arrived, its expiry shortened by the time since
    /// (zero once it passed: the engine answers `deadline_exceeded`).
    pub fn to_publish(&self) -> Publish {
        let elapsed_s = unix_ms().saturating_sub(self.received_unix_ms).div_ceil(1000);
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

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// `[mqtt.journal]`.
#[derive(Debug, Clone)]
pub struct JournalOptions {
    pub dir: PathBuf,
    pub max_bytes: u64,
    pub fsync: bool,
    /// How long a batch stays open for more arrivals after its first.
    pub commit_window: Duration,
    /// Keys of answered requests remembered to tell re-deliveries.
    pub answered_capacity: usize,
}

/// The journal's answer to a request.
pub enum Kept {
    /// Journaled and written: its reply may go; `durable` resolves once it
    /// is synced (its acknowledgement may go then), or fails if syncing did.
    Journaled { seq: u64, durable: oneshot::Receiver<()> },
    /// A re-delivery of a request the journal holds or answered: acknowledge
    /// it and run nothing.
    Duplicate,
    /// Not journaled (no room within `max_bytes`, the disk failed, or it
    /// was slower than `KEEP_WAIT`): the request is acknowledged after its
    /// reply, as without a journal.
    NotKept,
}

enum Command {
    Keep { request: Request, key: Key, redelivered: bool, reply: oneshot::Sender<Kept> },
    Answered { seq: u64 },
}

/// How long a request waits for the journal to write it before it goes
/// unjournaled (acknowledged after its reply): a hung disk must not stall
/// the requests on the node's own topic.
const KEEP_WAIT: Duration = Duration::from_secs(2);

/// A handle to the journal's thread.
#[derive(Clone)]
pub struct Journal {
    tx: std_mpsc::Sender<Command>,
}

/// The journal's threads, to wait for once every `Journal` is dropped: the
/// last answers are written and synced before the process exits.
pub struct JournalThread(std::thread::JoinHandle<()>);

impl JournalThread {
    /// Waits for the threads to finish what was sent, up to `limit`.
    pub fn finish(self, limit: Duration) {
        let started = std::time::Instant::now();
        while !self.0.is_finished() && started.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        if self.0.is_finished() {
            let _ = self.0.join();
        } else {
            tracing::warn!(
                "the request journal did not finish in {limit:?}; its last answers may be run again"
            );
        }
    }
}

impl Journal {
    /// Opens the journal and starts its threads; answers the requests a
    /// previous run left waiting, oldest first, to be run again.
    pub fn open(options: JournalOptions) -> Result<(Journal, Vec<Waiting>, JournalThread), JournalError> {
        let (log, waiting) =
            Log::open(&options.dir, options.max_bytes, options.fsync, options.answered_capacity)?;
        metrics::gauge!(crate::telemetry::JOURNAL_BYTES).set(log.bytes() as f64);
        let (tx, rx) = std_mpsc::channel();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| JournalError::io(&options.dir, e))
        };
        let syncer = match options.fsync {
            true => {
                let (sync_tx, sync_rx) = std_mpsc::channel();
                Some((sync_tx, spawn("journal-sync", Box::new(move || sync_loop(sync_rx)))?))
            }
            false => None,
        };
        let window = options.commit_window;
        let writer = spawn("journal", Box::new(move || commit_loop(log, rx, window, syncer)))?;
        Ok((Journal { tx }, waiting, JournalThread(writer)))
    }

    /// Journals `publish` (a request on the node's own topic).
    pub async fn keep(&self, publish: &Publish) -> Kept {
        let (reply, kept) = oneshot::channel();
        let request = Request::from_publish(publish);
        let key = request.key();
        if self.tx.send(Command::Keep { request, key, redelivered: publish.dup, reply }).is_err() {
            return Kept::NotKept;
        }
        match tokio::time::timeout(KEEP_WAIT, kept).await {
            Ok(kept) => kept.unwrap_or(Kept::NotKept),
            // The journal records it answered when it gets to it (nobody
            // waits for it any more), so it is never run again.
            Err(_) => {
                metrics::counter!(crate::telemetry::JOURNAL_NOT_KEPT, "reason" => "slow").increment(1);
                Kept::NotKept
            }
        }
    }

    /// The broker confirmed request `seq`'s final reply (or it will never
    /// get one): not to be run again.
    pub fn answered(&self, seq: u64) {
        let _ = self.tx.send(Command::Answered { seq });
    }
}

/// Files written and the requests that wait for them to be synced.
struct SyncJob {
    files: Vec<Arc<File>>,
    durable: Vec<oneshot::Sender<()>>,
}

/// The writing thread: writes what has arrived in one call and answers
/// (replies may go), goes on taking arrivals for `window` after the first
/// of a group, then hands the group to the sync thread (or, without fsync,
/// says it is durable); until every handle is gone.
fn commit_loop(
    mut log: Log,
    rx: std_mpsc::Receiver<Command>,
    window: Duration,
    syncer: Option<(std_mpsc::Sender<SyncJob>, std::thread::JoinHandle<()>)>,
) {
    let mut failing = false;
    while let Ok(first) = rx.recv() {
        let closes = std::time::Instant::now() + window;
        let mut durable = Vec::new();
        let mut next = Some(first);
        while let Some(first) = next.take() {
            let batch = std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok()));
            write_batch(&mut log, batch, &mut failing, &mut durable);
            let left = closes.saturating_duration_since(std::time::Instant::now());
            if !left.is_zero() {
                next = rx.recv_timeout(left).ok();
            }
        }
        metrics::gauge!(crate::telemetry::JOURNAL_BYTES).set(log.bytes() as f64);
        // A group of answers alone is not synced: nothing waits for it,
        // and the next group's sync covers it (a power cut before then
        // costs a reply sent again, never a request lost). At low load
        // this halves the syncs, and an SD card's writes.
        if durable.is_empty() {
            continue;
        }
        match &syncer {
            Some((to_sync, _)) => {
                let _ = to_sync.send(SyncJob { files: log.take_unsynced(), durable });
            }
            None => durable.into_iter().for_each(|tx| {
                let _ = tx.send(());
            }),
        }
    }
    if let Some((to_sync, thread)) = syncer {
        let _ = to_sync.send(SyncJob { files: log.take_unsynced(), durable: Vec::new() });
        drop(to_sync);
        let _ = thread.join();
    }
}

/// The sync thread: one sync of each file for every group that queued
/// while the last sync ran, then their acknowledgements may go. A failed
/// sync leaves them to go after their replies (the records are written:
/// a crash of the node keeps them; a power cut may not).
fn sync_loop(rx: std_mpsc::Receiver<SyncJob>) {
    while let Ok(job) = rx.recv() {
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
        match files.iter().try_for_each(|f| f.sync_data()) {
            Ok(()) => jobs.into_iter().flat_map(|j| j.durable).for_each(|tx| {
                let _ = tx.send(());
            }),
            Err(e) => tracing::error!(
                "the request journal cannot sync: {e}; the requests of this group are acknowledged after their reply"
            ),
        }
    }
}

/// Records `batch` with one write and answers each request in it; the
/// journaled ones' `durable` senders go to `durable`.
fn write_batch(
    log: &mut Log,
    batch: impl Iterator<Item = Command>,
    failing: &mut bool,
    durable: &mut Vec<oneshot::Sender<()>>,
) {
    let mut kept = Vec::new();
    for command in batch {
        match command {
            Command::Answered { seq } => log.answered(seq),
            Command::Keep { request, key, redelivered, reply } => {
                if redelivered && log.knows(&key) {
                    metrics::counter!(crate::telemetry::JOURNAL_DUPLICATES).increment(1);
                    let _ = reply.send(Kept::Duplicate);
                } else if *failing {
                    not_kept(reply, "error");
                } else {
                    match log.arrived(key, &request) {
                        Some(seq) => kept.push((seq, reply)),
                        None => not_kept(reply, "full"),
                    }
                }
            }
        }
    }
    if let Err(e) = log.write() {
        // Nothing of this batch was journaled (the log undid it), and
        // nothing more is until a restart reads what is whole.
        tracing::error!("{e}; requests are acknowledged after their reply until the node restarts");
        *failing = true;
        kept.drain(..).for_each(|(_, reply)| not_kept(reply, "error"));
    }
    for (seq, reply) in kept {
        let (tx, rx) = oneshot::channel();
        match reply.send(Kept::Journaled { seq, durable: rx }) {
            Ok(()) => durable.push(tx),
            // Its request stopped waiting (`KEEP_WAIT`) and goes on
            // unjournaled: never to be run again.
            Err(_) => log.answered(seq),
        }
    }
}

fn not_kept(reply: oneshot::Sender<Kept>, reason: &'static str) {
    metrics::counter!(crate::telemetry::JOURNAL_NOT_KEPT, "reason" => reason).increment(1);
    let _ = reply.send(Kept::NotKept);
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
                durable.await.expect("synced");
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
        let (journal, waiting, thread) = Journal::open(options(dir.path())).unwrap();
        assert!(waiting.is_empty());
        let first = journaled(journal.keep(&publish(1, false)).await).await;
        assert!(matches!(journal.keep(&publish(1, true)).await, Kept::Duplicate), "held: a re-delivery");
        let again = journaled(journal.keep(&publish(1, false)).await).await;
        assert_ne!(first, again, "sent again by the device: a request of its own");
        let other = journaled(journal.keep(&publish(2, false)).await).await;
        journal.answered(first);
        journal.answered(again);
        assert!(matches!(journal.keep(&publish(1, true)).await, Kept::Duplicate), "answered: a re-delivery");
        let third = journaled(journal.keep(&publish(3, true)).await).await;
        drop(journal);
        thread.finish(Duration::from_secs(5));
        let (_journal, waiting, _thread) = Journal::open(options(dir.path())).unwrap();
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
