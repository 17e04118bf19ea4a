//! The journal's files: numbered append-only files of checksummed records in
//! `node.state_dir/journal`. A request is `Arrived` (with what it takes to
//! run it again) and later `Answered`, in the same file or a newer one.
//! With `mqtt.reply_qos = 2` its reply is `Sent` instead (with its packet
//! id, before it is written to the broker; the request needs no `Answered`
//! then), `Released` once the broker's PUBREC is heard (before the PUBREL
//! goes) and `Answered` at PUBCOMP: at a start, a reply `Sent` and not
//! `Answered` goes again under its packet id, as a PUBLISH or, `Released`,
//! as a PUBREL, so the broker, which keeps the session, delivers it once.
//! Files go oldest first, once none of their requests is waiting for an
//! answer (a newer file may hold the answers to an older one's requests,
//! so one is never removed before those older) and two newer files hold
//! the last ones answered (their keys tell a re-delivery from a new
//! request). A request that waits long pins the files after it; when they
//! fill the bound, requests go unjournaled until it is answered.
//!
//! Record: length (u32 LE, of what follows the checksum), CRC-32 (u32 LE)
//! of kind, seq and body, kind (u8), seq (u64 LE), body. A torn or
//! corrupt record ends what is read of its file: it was being written when
//! the node died, and nothing after it was acknowledged.

use super::{JournalError, Key, Request, SentReply};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const ARRIVED: u8 = 1;
const ANSWERED: u8 = 2;
const SENT: u8 = 3;
const RELEASED: u8 = 4;
/// Length, checksum, kind and seq.
const HEADER: u64 = 4 + 4 + 1 + 8;
/// An `Answered` record, reserved for every request waiting for one, so a
/// full journal can always record answers and so make room.
pub const ANSWERED_BYTES: u64 = HEADER;
/// A record longer than this is corruption, not a request (the node reads
/// no MQTT packet over 256 MiB).
const MAX_RECORD: u32 = 256 << 20;

/// A request the journal holds and no answer has been confirmed for.
pub struct Waiting {
    pub seq: u64,
    pub request: Request,
}

/// A reply `Sent` and not confirmed when the node stopped.
pub struct InFlight {
    pub seq: u64,
    pub reply: SentReply,
    /// The broker's PUBREC was heard: only the PUBREL is owed.
    pub released: bool,
}

/// What a previous run left: requests to run again and replies to send
/// again, oldest first, and every follow-up the files hold as `Sent` (the
/// spool may not have heard before the node stopped), by spool key, with
/// the topic and correlation data it went to: a spool rebuilt since may
/// have given the key to another escalation.
#[derive(Default)]
pub struct Recovered {
    pub requests: Vec<Waiting>,
    pub replies: Vec<InFlight>,
    pub follow_ups_sent: HashMap<Vec<u8>, (String, Option<Vec<u8>>)>,
}

struct Segment {
    bytes: u64,
    /// Its requests still waiting for an answer.
    waiting: usize,
}

struct Entry {
    segment: u64,
    /// A request's (a reply `Sent` has none).
    key: Option<Key>,
}

pub struct Log {
    dir: PathBuf,
    fsync: bool,
    max_bytes: u64,
    segment_bytes: u64,
    segments: BTreeMap<u64, Segment>,
    /// The newest segment's file, appended to (shared with the sync thread).
    active: Arc<File>,
    active_no: u64,
    /// Files written since the last `take_unsynced`.
    unsynced: Vec<Arc<File>>,
    /// Records encoded and not yet written, and what they record.
    buffer: Vec<u8>,
    buffered_arrivals: Vec<u64>,
    buffered_answers: Vec<u64>,
    /// Replies `Sent` (seq) and the journaled request each answers.
    buffered_sent: Vec<(u64, Option<u64>)>,
    buffered_released: Vec<u64>,
    /// Requests waiting for an answer, and replies `Sent` waiting for PUBCOMP.
    waiting: HashMap<u64, Entry>,
    /// The keys of `waiting`, counted (a device may send the same request twice).
    waiting_keys: HashMap<Key, u32>,
    /// The keys of the last requests answered, oldest first.
    answered: VecDeque<Key>,
    answered_keys: HashSet<Key>,
    answered_capacity: usize,
    next_seq: u64,
    /// A write failed: nothing more is journaled until a restart reads
    /// what is whole.
    pub failing: bool,
}

impl Log {
    /// Reads what `dir` holds and starts a new file after it; answers the
    /// requests still waiting, oldest first.
    pub fn open(
        dir: &Path,
        max_bytes: u64,
        fsync: bool,
        answered_capacity: usize,
    ) -> Result<(Log, Recovered), JournalError> {
        std::fs::create_dir_all(dir).map_err(|e| JournalError::io(dir, e))?;
        let mut numbers = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| JournalError::io(dir, e))? {
            let name = entry.map_err(|e| JournalError::io(dir, e))?.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = name.strip_suffix(".log").and_then(|n| u64::from_str_radix(n, 16).ok()) {
                numbers.push(n);
            }
        }
        numbers.sort_unstable();
        // Appended to: a new file after what is there, so a torn tail
        // stays behind its last whole record.
        let active_no = numbers.last().map_or(1, |n| n + 1);
        let mut log = Log {
            dir: dir.to_path_buf(),
            fsync,
            max_bytes,
            // Small enough that answered files go soon, large enough that
            // a file holds many requests.
            segment_bytes: (max_bytes / 8).clamp(64 << 10, 8 << 20),
            segments: BTreeMap::new(),
            active: Arc::new(create_file(dir, active_no, fsync)?),
            active_no,
            unsynced: Vec::new(),
            buffer: Vec::new(),
            buffered_arrivals: Vec::new(),
            buffered_answers: Vec::new(),
            buffered_sent: Vec::new(),
            buffered_released: Vec::new(),
            waiting: HashMap::new(),
            waiting_keys: HashMap::new(),
            answered: VecDeque::new(),
            answered_keys: HashSet::new(),
            answered_capacity,
            next_seq: 1,
            failing: false,
        };
        let mut requests: BTreeMap<u64, Request> = BTreeMap::new();
        let mut replies: BTreeMap<u64, InFlight> = BTreeMap::new();
        let mut follow_ups_sent = HashMap::new();
        for &no in &numbers {
            let path = log.path(no);
            let mut bytes = Vec::new();
            File::open(&path)
                .and_then(|mut f| f.read_to_end(&mut bytes))
                .map_err(|e| JournalError::io(&path, e))?;
            let (records, read) = decode_all(&bytes);
            if read < bytes.len() {
                tracing::warn!(
                    "journal file {}: {} bytes after the last whole record ignored (written when the node stopped)",
                    path.display(),
                    bytes.len() - read
                );
            }
            log.segments.insert(no, Segment { bytes: bytes.len() as u64, waiting: 0 });
            for (kind, seq, body) in records {
                log.next_seq = log.next_seq.max(seq + 1);
                match kind {
                    ARRIVED => {
                        let Ok(request) = postcard::from_bytes::<Request>(body) else { continue };
                        log.wait(seq, no, Some(request.key()));
                        requests.insert(seq, request);
                    }
                    SENT => {
                        let Ok(reply) = postcard::from_bytes::<SentReply>(body) else { continue };
                        if let Some(request) = reply.request {
                            requests.remove(&request);
                            log.settle(request);
                        }
                        if let Some(key) = &reply.spool_key {
                            follow_ups_sent
                                .insert(key.clone(), (reply.topic.clone(), reply.correlation.clone()));
                        }
                        log.wait(seq, no, None);
                        replies.insert(seq, InFlight { seq, reply, released: false });
                    }
                    RELEASED => {
                        if let Some(reply) = replies.get_mut(&seq) {
                            reply.released = true;
                        }
                    }
                    ANSWERED => {
                        requests.remove(&seq);
                        replies.remove(&seq);
                        log.settle(seq);
                    }
                    _ => {}
                }
            }
        }
        log.segments.insert(active_no, Segment { bytes: 0, waiting: 0 });
        log.drop_settled_segments();
        let recovered = Recovered {
            requests: requests.into_iter().map(|(seq, request)| Waiting { seq, request }).collect(),
            replies: replies.into_values().collect(),
            follow_ups_sent,
        };
        Ok((log, recovered))
    }

    /// `seq` waits (for an answer, or its reply for PUBCOMP) in `segment`.
    fn wait(&mut self, seq: u64, segment: u64, key: Option<Key>) {
        self.waiting.insert(seq, Entry { segment, key });
        if let Some(key) = key {
            *self.waiting_keys.entry(key).or_default() += 1;
        }
        if let Some(segment) = self.segments.get_mut(&segment) {
            segment.waiting += 1;
        }
    }

    /// `Arrived` for `request`, encoded; written by `write`. `None` if it
    /// does not fit within the bound (with a place for every answer owed).
    pub fn arrived(&mut self, key: Key, request: &Request) -> Option<u64> {
        let body = postcard::to_allocvec(request).expect("a request is plain data");
        let size = HEADER + body.len() as u64;
        let owed = (self.waiting.len() as u64 + 1) * ANSWERED_BYTES;
        if self.bytes() + self.buffer.len() as u64 + size + owed > self.max_bytes {
            return None;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        encode(&mut self.buffer, ARRIVED, seq, &body);
        self.buffered_arrivals.push(seq);
        self.wait(seq, self.active_no, Some(key));
        Some(seq)
    }

    /// `Sent` for `reply`, encoded; written by `write`. Its request (if
    /// journaled) is answered by it. Outside the bound: a reply in flight
    /// is bounded by the session's window, and refusing to record it would
    /// only answer its request twice after a crash.
    pub fn sent(&mut self, reply: &SentReply) -> u64 {
        let body = postcard::to_allocvec(reply).expect("a reply is plain data");
        let seq = self.next_seq;
        self.next_seq += 1;
        encode(&mut self.buffer, SENT, seq, &body);
        self.buffered_sent.push((seq, reply.request));
        if let Some(request) = reply.request {
            self.settle(request);
        }
        self.wait(seq, self.active_no, None);
        seq
    }

    /// `Released` for the reply `Sent` as `seq`, encoded; written by `write`.
    pub fn released(&mut self, seq: u64) {
        if self.waiting.contains_key(&seq) {
            encode(&mut self.buffer, RELEASED, seq, &[]);
            self.buffered_released.push(seq);
        }
    }

    /// `Answered` for `seq`, encoded; written by `write`.
    pub fn answered(&mut self, seq: u64) {
        if self.waiting.contains_key(&seq) {
            encode(&mut self.buffer, ANSWERED, seq, &[]);
            self.buffered_answers.push(seq);
            self.settle(seq);
        }
    }

    /// Whether a re-delivered request with `key` is one the journal holds
    /// or answered.
    pub fn knows(&self, key: &Key) -> bool {
        self.waiting_keys.contains_key(key) || self.answered_keys.contains(key)
    }

    /// Writes what was encoded, in one call; once this returns, a kill -9
    /// keeps it (the kernel has it). On an error nothing of it counts: the
    /// file is cut back to its last whole record (or left for a new one),
    /// the arrivals are forgotten (their requests are not journaled) and
    /// the answers are kept for the next write.
    pub fn write(&mut self) -> Result<(), JournalError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let path = self.path(self.active_no);
        if let Err(e) = write_all(&self.active, &path, &self.buffer) {
            self.undo_write();
            return Err(JournalError::io(&path, e));
        }
        self.segments.get_mut(&self.active_no).expect("the active segment").bytes += self.buffer.len() as u64;
        self.buffer.clear();
        self.buffered_arrivals.clear();
        self.buffered_answers.clear();
        self.buffered_sent.clear();
        self.buffered_released.clear();
        if !self.unsynced.iter().any(|f| Arc::ptr_eq(f, &self.active)) {
            self.unsynced.push(self.active.clone());
        }
        if self.segments[&self.active_no].bytes >= self.segment_bytes {
            // The full file stays in `unsynced` until the sync thread has it.
            if let Err(e) = self.next_file() {
                tracing::warn!("{e}; the journal goes on in its current file");
            }
        }
        self.drop_settled_segments();
        Ok(())
    }

    /// A write failed: the file back to its last whole record (else a new
    /// file, so nothing lands after a torn one), the arrivals and replies
    /// sent forgotten, the answers and releases encoded again.
    fn undo_write(&mut self) {
        let whole = self.segments[&self.active_no].bytes;
        if self.active.set_len(whole).is_err() {
            let _ = self.next_file();
        }
        self.buffer.clear();
        for seq in std::mem::take(&mut self.buffered_arrivals) {
            self.forget(seq);
        }
        // A reply `Sent` answered its request: that answer is kept for the
        // next write as an `Answered`, though the reply goes unjournaled.
        let mut answers = std::mem::take(&mut self.buffered_answers);
        for (seq, request) in std::mem::take(&mut self.buffered_sent) {
            self.forget(seq);
            answers.extend(request);
        }
        for seq in answers {
            encode(&mut self.buffer, ANSWERED, seq, &[]);
            self.buffered_answers.push(seq);
        }
        for seq in std::mem::take(&mut self.buffered_released) {
            if self.waiting.contains_key(&seq) {
                encode(&mut self.buffer, RELEASED, seq, &[]);
                self.buffered_released.push(seq);
            }
        }
    }

    fn next_file(&mut self) -> Result<(), JournalError> {
        self.active = Arc::new(create_file(&self.dir, self.active_no + 1, self.fsync)?);
        self.active_no += 1;
        self.segments.insert(self.active_no, Segment { bytes: 0, waiting: 0 });
        Ok(())
    }

    /// The seq of the last record encoded (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Whether records wait for `write`.
    pub fn has_buffered(&self) -> bool {
        !self.buffer.is_empty()
    }

    /// The files written since the last call: what a sync must cover.
    pub fn take_unsynced(&mut self) -> Vec<Arc<File>> {
        std::mem::take(&mut self.unsynced)
    }

    /// Bytes of the files, as written.
    pub fn bytes(&self) -> u64 {
        self.segments.values().map(|s| s.bytes).sum()
    }

    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// `seq` is no longer waiting, and was never answered.
    fn forget(&mut self, seq: u64) {
        let Some(entry) = self.waiting.remove(&seq) else { return };
        self.unwait(&entry);
    }

    fn unwait(&mut self, entry: &Entry) {
        if let Some(key) = entry.key
            && let Some(count) = self.waiting_keys.get_mut(&key)
        {
            *count -= 1;
            if *count == 0 {
                self.waiting_keys.remove(&key);
            }
        }
        if let Some(segment) = self.segments.get_mut(&entry.segment) {
            segment.waiting -= 1;
        }
    }

    fn settle(&mut self, seq: u64) {
        let Some(entry) = self.waiting.remove(&seq) else { return };
        self.unwait(&entry);
        if let Some(key) = entry.key
            && self.answered_keys.insert(key)
        {
            self.answered.push_back(key);
        }
        while self.answered.len() > self.answered_capacity {
            let old = self.answered.pop_front().expect("non-empty");
            self.answered_keys.remove(&old);
        }
    }

    /// Removes the oldest files while none of their requests waits, up to
    /// the newest two (they keep the keys of the last answers).
    fn drop_settled_segments(&mut self) {
        let keep_from = self.active_no.saturating_sub(1);
        let settled: Vec<u64> = self
            .segments
            .iter()
            .take_while(|(no, s)| **no < keep_from && s.waiting == 0)
            .map(|(no, _)| *no)
            .collect();
        for no in settled {
            let path = self.path(no);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    self.segments.remove(&no);
                }
                Err(e) => {
                    tracing::warn!("journal: cannot remove {}: {e}", path.display());
                    break;
                }
            }
        }
    }

    fn path(&self, no: u64) -> PathBuf {
        segment_path(&self.dir, no)
    }
}

/// `FAILPOINTS=journal_write=return`: a failing disk, for the tests;
/// `return(DIR)` fails only the journal in DIR (unit tests run side by
/// side in one process).
fn write_all(
    mut file: &File,
    #[cfg_attr(not(feature = "failpoints"), allow(unused_variables))] path: &Path,
    bytes: &[u8],
) -> std::io::Result<()> {
    fail::fail_point!("journal_write", |dir: Option<String>| {
        match dir.is_none_or(|dir| path.starts_with(dir)) {
            true => Err(std::io::Error::other("fail point")),
            false => file.write_all(bytes),
        }
    });
    file.write_all(bytes)
}

fn segment_path(dir: &Path, no: u64) -> PathBuf {
    dir.join(format!("{no:016x}.log"))
}

fn create_file(dir: &Path, no: u64, fsync: bool) -> Result<File, JournalError> {
    let path = segment_path(dir, no);
    let file =
        OpenOptions::new().create(true).append(true).open(&path).map_err(|e| JournalError::io(&path, e))?;
    if fsync {
        // The new file's name, not only its contents, must survive a power cut.
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| JournalError::io(dir, e))?;
    }
    Ok(file)
}

fn encode(out: &mut Vec<u8>, kind: u8, seq: u64, body: &[u8]) {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[kind]);
    hasher.update(&seq.to_le_bytes());
    hasher.update(body);
    out.extend_from_slice(&((1 + 8 + body.len()) as u32).to_le_bytes());
    out.extend_from_slice(&hasher.finalize().to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(body);
}

/// A record as read: kind, seq, body.
type Record<'a> = (u8, u64, &'a [u8]);

/// The whole records at the start of `bytes`, and how many bytes they take.
fn decode_all(bytes: &[u8]) -> (Vec<Record<'_>>, usize) {
    let mut records = Vec::new();
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
        if !(9..=MAX_RECORD).contains(&len) {
            break;
        }
        let Some(record) = bytes.get(at + 8..at + 8 + len as usize) else { break };
        if crc32fast::hash(record) != crc {
            break;
        }
        let seq = u64::from_le_bytes(record[1..9].try_into().expect("8 bytes"));
        records.push((record[0], seq, &record[9..]));
        at += 8 + len as usize;
    }
    (records, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(n: u8) -> Request {
        Request {
            topic: format!("edge/node/infer/m{n}"),
            payload: vec![n; 100],
            received_unix_ms: 1_000 + n as u64,
            ..Request::default()
        }
    }

    fn open(dir: &Path, max: u64) -> (Log, Vec<Waiting>) {
        let (log, recovered) = Log::open(dir, max, true, 16).unwrap();
        (log, recovered.requests)
    }

    /// Whatever the node wrote before it stopped comes back waiting unless
    /// answered; a record torn by the stop ends its file and loses nothing
    /// whole before it.
    #[test]
    fn the_requests_not_answered_come_back_after_a_restart_and_a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, waiting) = open(dir.path(), 1 << 20);
        assert!(waiting.is_empty());
        let seqs: Vec<u64> = (0..5).map(|n| log.arrived(request(n).key(), &request(n)).unwrap()).collect();
        log.answered(seqs[1]);
        log.answered(seqs[3]);
        log.write().unwrap();
        drop(log);
        // A record half written when the node died.
        let file = dir.path().join(format!("{:016x}.log", 1));
        let mut f = OpenOptions::new().append(true).open(&file).unwrap();
        f.write_all(&[40, 0, 0, 0, 1, 2, 3]).unwrap();
        let (log, waiting) = open(dir.path(), 1 << 20);
        let back: Vec<(u64, Request)> = waiting.into_iter().map(|w| (w.seq, w.request)).collect();
        assert_eq!(
            back,
            vec![(seqs[0], request(0)), (seqs[2], request(2)), (seqs[4], request(4))],
            "the unanswered ones, oldest first"
        );
        assert!(
            log.knows(&request(1).key()) && log.knows(&request(0).key()),
            "answered and waiting keys are both known"
        );
        assert!(!log.knows(&request(9).key()));
        assert!(log.next_seq > seqs[4], "a seq is never given twice");
    }

    fn reply(request: Option<u64>, pkid: u16, spool_key: Option<&[u8]>) -> SentReply {
        SentReply {
            request,
            pkid,
            spool_key: spool_key.map(<[u8]>::to_vec),
            topic: format!("dev/{pkid}/replies"),
            payload: vec![pkid as u8; 20],
            correlation: Some(vec![1, 2]),
            ..SentReply::default()
        }
    }

    /// Issue 36, QoS 2 replies: a reply `Sent` answers its request (not
    /// run again, and its re-delivery is known); at a start every reply
    /// `Sent` and not `Answered` comes back in order with its packet id,
    /// `Released` where the PUBREC was recorded; the spool keys of the
    /// follow-ups the files hold come back whatever became of them.
    #[test]
    fn replies_sent_and_not_confirmed_come_back_with_their_packet_ids() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), 1 << 20);
        let answered_by_reply = log.arrived(request(1).key(), &request(1)).unwrap();
        let unanswered = log.arrived(request(2).key(), &request(2)).unwrap();
        let a = log.sent(&reply(Some(answered_by_reply), 11, None));
        let b = log.sent(&reply(None, 12, Some(b"follow-up-b")));
        let c = log.sent(&reply(None, 13, Some(b"follow-up-c")));
        log.released(a);
        log.released(c);
        log.answered(c);
        log.write().unwrap();
        assert!(log.knows(&request(1).key()), "answered by its reply: a re-delivery is known");
        drop(log);
        let (log, recovered) = Log::open(dir.path(), 1 << 20, true, 16).unwrap();
        let requests: Vec<u64> = recovered.requests.iter().map(|w| w.seq).collect();
        assert_eq!(requests, vec![unanswered], "the request its reply answered does not run again");
        let replies: Vec<(u64, u16, bool)> =
            recovered.replies.iter().map(|r| (r.seq, r.reply.pkid, r.released)).collect();
        assert_eq!(replies, vec![(a, 11, true), (b, 12, false)]);
        assert_eq!(recovered.replies[0].reply, reply(Some(answered_by_reply), 11, None), "as it was sent");
        let keys: HashSet<&Vec<u8>> = recovered.follow_ups_sent.keys().collect();
        assert_eq!(keys, [&b"follow-up-b".to_vec(), &b"follow-up-c".to_vec()].into());
        assert_eq!(
            recovered.follow_ups_sent[&b"follow-up-b".to_vec()],
            ("dev/12/replies".into(), Some(vec![1, 2]))
        );
        assert!(log.knows(&request(1).key()) && log.knows(&request(2).key()));
        assert_eq!(log.waiting(), 3, "the unanswered request and the two replies in flight");
    }

    /// The bound holds with a place for every answer owed; answering makes
    /// room once the files the answers settle can go.
    #[test]
    fn a_full_journal_refuses_until_answers_let_its_files_go() {
        let dir = tempfile::tempdir().unwrap();
        let max = 256 << 10;
        let (mut log, _) = open(dir.path(), max);
        let mut seqs = Vec::new();
        while let Some(seq) = log.arrived(seqs.len() as u64, &request(1)) {
            seqs.push(seq);
            log.write().unwrap();
        }
        assert!(seqs.len() > 1000, "{} requests", seqs.len());
        assert!(log.bytes() + log.waiting() as u64 * ANSWERED_BYTES <= max, "{} bytes", log.bytes());
        for &seq in &seqs {
            log.answered(seq);
            log.write().unwrap();
        }
        assert!(log.arrived(request(1).key(), &request(1)).is_some(), "room again");
        log.write().unwrap();
        let files = std::fs::read_dir(dir.path()).unwrap().count();
        assert!(files <= 3, "settled files removed: {files} left");
        let on_disk: u64 =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
        assert_eq!(on_disk, log.bytes(), "the count is the files' real size");
    }

    /// Only the newest keys are remembered as answered: a re-delivery can
    /// only be of the last requests the broker sent.
    #[test]
    fn answered_keys_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), 1 << 20);
        for n in 0..40u8 {
            let seq = log.arrived(request(n).key(), &request(n)).unwrap();
            log.answered(seq);
        }
        assert!(
            !log.knows(&request(0).key()) && log.knows(&request(39).key()) && log.knows(&request(24).key())
        );
        assert_eq!(log.answered.len(), 16);
    }

    fn filler(n: u64) -> Request {
        Request { topic: format!("edge/node/infer/f{n}"), payload: vec![7; 1000], ..Request::default() }
    }

    /// Writes answered fillers until the active file is `file`.
    fn fill_until(log: &mut Log, file: u64, n: &mut u64) {
        while log.active_no < file {
            *n += 1;
            let seq = log.arrived(filler(*n).key(), &filler(*n)).unwrap();
            log.answered(seq);
            log.write().unwrap();
        }
    }

    /// Found in review: a file was removed once its own requests were all
    /// answered, though it held the answers to an older file's requests;
    /// those came back after a restart. Files now go oldest first only.
    #[test]
    fn a_file_holding_answers_to_an_older_file_stays_while_that_file_does() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), 1 << 20);
        let slow = log.arrived(request(1).key(), &request(1)).unwrap();
        let fast = log.arrived(request(2).key(), &request(2)).unwrap();
        log.write().unwrap();
        let mut n = 0;
        fill_until(&mut log, 2, &mut n);
        log.answered(fast);
        log.write().unwrap();
        fill_until(&mut log, 6, &mut n);
        assert!(log.segments.contains_key(&1), "the slow request's file stays");
        assert!(log.segments.contains_key(&2), "and so does the file with the fast one's answer");
        drop(log);
        let (mut log, waiting) = open(dir.path(), 1 << 20);
        assert_eq!(waiting.iter().map(|w| w.seq).collect::<Vec<_>>(), vec![slow], "only the slow one waits");
        log.answered(slow);
        log.write().unwrap();
        let next = log.active_no + 1;
        fill_until(&mut log, next, &mut n);
        assert_eq!(
            log.segments.len(),
            2,
            "answered, the old files go: {:?}",
            log.segments.keys().collect::<Vec<_>>()
        );
    }

    /// Found in review: the sync after a write that moved to a new file
    /// synced only the new, empty one.
    #[test]
    fn a_sync_covers_the_file_written_before_a_move_to_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), 1 << 20);
        let mut n = 0;
        fill_until(&mut log, 2, &mut n);
        let files = log.take_unsynced();
        assert_eq!(files.len(), 1, "the full file, written");
        assert!(!Arc::ptr_eq(&files[0], &log.active), "not the new, empty one");
        assert!(log.take_unsynced().is_empty());
    }

    /// Found in review: a failed write left its arrivals waiting and its
    /// bytes in the buffer, to be written by the next write.
    #[cfg(feature = "failpoints")]
    #[test]
    fn a_failed_write_journals_none_of_its_arrivals_and_keeps_its_answers() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), 1 << 20);
        let answered_later = log.arrived(request(1).key(), &request(1)).unwrap();
        let replied = log.arrived(request(3).key(), &request(3)).unwrap();
        log.write().unwrap();
        let before = log.bytes();
        log.answered(answered_later);
        // Found in review: a reply `Sent` in a failed write was dropped
        // with the answer it carried, and its request ran again.
        log.sent(&reply(Some(replied), 9, None));
        let lost = log.arrived(request(2).key(), &request(2)).unwrap();
        fail::cfg("journal_write", &format!("return({})", dir.path().display())).unwrap();
        let failed = log.write();
        fail::remove("journal_write");
        assert!(failed.is_err());
        assert_eq!(log.bytes(), before, "nothing of it counted");
        assert!(!log.waiting.contains_key(&lost), "its arrival is not journaled");
        log.write().unwrap();
        drop(log);
        let (_log, recovered) = Log::open(dir.path(), 1 << 20, true, 16).unwrap();
        assert!(
            recovered.requests.is_empty(),
            "the answers were written at the next write (the reply's as `Answered`); the failed arrival never"
        );
        assert!(recovered.replies.is_empty(), "the reply went unjournaled");
    }
}
