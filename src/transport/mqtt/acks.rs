//! A request's place in line. MQTT requires PUBACKs in the order the
//! PUBLISHes arrived [MQTT-4.6.0-2] (rumqttd disconnects a client that breaks
//! this), while requests finish in any order: the session layer
//! (`session::Session`) holds that line; each request task holds an
//! `AckSlot` and reports through it, with its reply, to the loop that owns
//! the connection, which publishes the reply and then acknowledges the
//! request, the acknowledgement written after the reply. A journaled
//! request (`journal.rs`) is acknowledged once the journal has it durably,
//! which may be before its reply: the loop holds its place in line
//! (`JournaledAcks`), not its task.

use super::journal::SyncedThrough;
use super::session::{Arrival, Session};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A request finished: its reply (if it has one), and its place in line.
pub struct Finished {
    /// Its place in the session's line; `None` for a QoS 0 request.
    pub arrival: Option<Arrival>,
    pub reply: Option<super::outbox::Reply>,
    /// Held until the reply is handed to the session of its connection: a
    /// follow-up to this request waits for it, and may go out on another
    /// connection (the share group's requests, `share.rs`).
    pub first: Option<crate::protocol::FirstReplyPending>,
    /// The journal's seq of the request: recorded answered once the
    /// broker confirms the reply.
    pub journaled: Option<u64>,
}

/// A request's place in line; `send` (or dropping it, e.g. when its task
/// was aborted) reports it finished.
pub struct AckSlot {
    arrival: Option<Arrival>,
    tx: mpsc::UnboundedSender<Finished>,
    journaled: Option<u64>,
    /// Its reply (or that it has none) was reported: `Drop` reports nothing.
    reported: bool,
}

impl AckSlot {
    /// The slot of the request the session handed over as `arrival`; it
    /// reports to `tx`.
    pub fn new(arrival: Option<Arrival>, tx: mpsc::UnboundedSender<Finished>) -> AckSlot {
        AckSlot { arrival, tx, journaled: None, reported: false }
    }

    /// The journal holds the request as `seq`: its reply, once confirmed,
    /// is recorded answered.
    pub fn journaled(&mut self, seq: u64) {
        self.journaled = Some(seq);
    }

    pub fn send(mut self, reply: Option<super::outbox::Reply>) {
        self.report(reply, None);
    }

    /// The reply; `first` is the guard a follow-up to this request waits
    /// on, released once the reply is handed to the session.
    pub fn send_reply(
        mut self,
        reply: super::outbox::Reply,
        first: Option<crate::protocol::FirstReplyPending>,
    ) {
        self.report(Some(reply), first);
    }

    /// Once: `send` and then `Drop` report nothing twice.
    fn report(
        &mut self,
        reply: Option<super::outbox::Reply>,
        first: Option<crate::protocol::FirstReplyPending>,
    ) {
        if !std::mem::replace(&mut self.reported, true) {
            let _ = self.tx.send(Finished {
                arrival: self.arrival.take(),
                reply,
                first,
                journaled: self.journaled,
            });
        }
    }
}

impl Drop for AckSlot {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The engine answers a panicking request `internal` itself; a
            // panic here is in the adapter, after that. Acknowledgements
            // must leave in order, so this one still goes, but not
            // silently; a journaled request is recorded answered, so a
            // request that panics is not run again at every start.
            tracing::error!("a request task panicked before its reply was sent; acknowledging it anyway");
        } else if !self.reported {
            // Aborted by a drain: a journaled request stays waiting, to be
            // run again at the next start.
            self.journaled = None;
        }
        self.report(None, None);
    }
}

/// How long a journaled request's acknowledgement waits for the journal's
/// sync before it goes after its reply instead: a hung disk must not hold
/// the broker's window (and with it every request) for ever.
pub const SYNC_WAIT: Duration = Duration::from_secs(2);

/// The acknowledgements of journaled requests, in arrival order, each
/// waiting for the sync of its record; the loop of the node's own
/// connection owns them and acknowledges every one the journal's sync
/// passed at once (one wake-up a commit window).
#[derive(Default)]
pub struct JournaledAcks {
    waiting: VecDeque<WaitingAck>,
    /// Acknowledged after their reply instead: their sync failed or was
    /// slow, or their record was never written.
    after_reply: HashMap<u64, Arrival>,
}

struct WaitingAck {
    seq: u64,
    arrival: Arrival,
    since: Instant,
    /// Its reply was handed to the session.
    replied: bool,
}

impl JournaledAcks {
    /// The request journaled as `seq` (seqs grow with arrivals) waits.
    pub fn push(&mut self, seq: u64, arrival: Arrival) {
        self.waiting.push_back(WaitingAck { seq, arrival, since: Instant::now(), replied: false });
    }

    /// Whether an acknowledgement waits for a sync.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The journal's sync got to `through`: the requests it made durable
    /// are acknowledged; those whose sync failed go after their replies.
    pub fn synced(&mut self, through: SyncedThrough, session: &mut Session) {
        while let Some(front) = self.waiting.front() {
            if front.seq <= through.failed {
                let ack = self.waiting.pop_front().expect("a front");
                self.after_reply_or_now(ack, session);
            } else if front.seq <= through.synced {
                session.acknowledge(self.waiting.pop_front().expect("a front").arrival);
            } else {
                break;
            }
        }
    }

    /// Those that waited `SYNC_WAIT` by `now` go after their replies.
    pub fn overdue(&mut self, now: Instant, session: &mut Session) {
        while self.waiting.front().is_some_and(|a| now.duration_since(a.since) >= SYNC_WAIT) {
            metrics::counter!(crate::telemetry::JOURNAL_NOT_KEPT, "reason" => "slow").increment(1);
            let ack = self.waiting.pop_front().expect("a front");
            self.after_reply_or_now(ack, session);
        }
    }

    /// The journal's write failed: no record waiting here will be synced.
    pub fn not_written(&mut self, session: &mut Session) {
        while let Some(ack) = self.waiting.pop_front() {
            self.after_reply_or_now(ack, session);
        }
    }

    /// Request `seq`'s reply went to the session as `reply` (a packet id;
    /// `None` without one): its acknowledgement follows if it waited for
    /// that.
    pub fn replied(&mut self, seq: u64, reply: Option<u16>, session: &mut Session) {
        if let Some(arrival) = self.after_reply.remove(&seq) {
            session.acknowledge_after(arrival, reply);
        } else if let Ok(i) = self.waiting.binary_search_by_key(&seq, |a| a.seq) {
            self.waiting[i].replied = true;
        }
    }

    fn after_reply_or_now(&mut self, ack: WaitingAck, session: &mut Session) {
        if ack.replied {
            session.acknowledge(ack.arrival);
        } else {
            self.after_reply.insert(ack.seq, ack.arrival);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::mqtt::session::Event;
    use crate::transport::mqtt::session::tests::{broker_publish, events, feed, up, written};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Packet, PubAck};

    /// A session with requests 1..=n (packet ids 1..=n, QoS 1) handed over,
    /// each journaled as its packet id.
    fn journaled(n: u16) -> (Session, Instant, JournaledAcks) {
        let (mut session, now) = up(None);
        let packets: Vec<Packet> = (1..=n).map(|i| broker_publish(i, QoS::AtLeastOnce, "r")).collect();
        feed(&mut session, now, &packets);
        let mut acks = JournaledAcks::default();
        for (i, event) in events(&mut session).into_iter().enumerate() {
            let Event::Publish { arrival: Some(arrival), .. } = event else { panic!("{event:?}") };
            acks.push(i as u64 + 1, arrival);
        }
        (session, now, acks)
    }

    fn pubacks(ids: &[u16]) -> Vec<Packet> {
        ids.iter().map(|&i| Packet::PubAck(PubAck::new(i, None))).collect()
    }

    fn through(synced: u64, failed: u64) -> SyncedThrough {
        SyncedThrough { synced, failed }
    }

    /// A sync acknowledges every request up to where it got, in one write
    /// and in arrival order, whether or not their replies went.
    #[test]
    fn a_sync_acknowledges_every_request_it_made_durable_at_once() {
        let (mut s, now, mut acks) = journaled(4);
        acks.replied(2, Some(100), &mut s);
        acks.synced(through(0, 0), &mut s);
        assert!(written(&mut s, now).is_empty(), "nothing synced yet");
        acks.synced(through(3, 0), &mut s);
        assert_eq!(written(&mut s, now), pubacks(&[1, 2, 3]));
        assert!(!acks.is_empty(), "4 waits");
        acks.synced(through(4, 0), &mut s);
        assert_eq!(written(&mut s, now), pubacks(&[4]));
        assert!(acks.is_empty());
    }

    /// A failed sync, a slow one and a failed write each leave the
    /// acknowledgement to go after the reply: at once for a request whose
    /// reply went, with its reply for the others.
    #[test]
    fn what_a_sync_did_not_make_durable_is_acknowledged_after_its_reply() {
        let (mut s, now, mut acks) = journaled(6);
        acks.replied(1, None, &mut s);
        acks.synced(through(0, 2), &mut s);
        assert_eq!(written(&mut s, now), pubacks(&[1]), "1 replied; 2 waits for its reply");
        acks.synced(through(3, 2), &mut s);
        assert!(written(&mut s, now).is_empty(), "3 is durable, but behind 2 in line");
        acks.replied(2, None, &mut s);
        assert_eq!(written(&mut s, now), pubacks(&[2, 3]));
        // (Pushed after `now`: overdue counts from then.)
        acks.overdue(Instant::now() + SYNC_WAIT / 2, &mut s);
        assert!(written(&mut s, now).is_empty(), "not overdue yet");
        acks.overdue(Instant::now() + SYNC_WAIT, &mut s);
        assert!(acks.is_empty(), "4-6 waited too long: they go after their replies");
        acks.replied(5, None, &mut s);
        assert!(written(&mut s, now).is_empty(), "5 is behind 4 in line");
        acks.replied(4, None, &mut s);
        assert_eq!(written(&mut s, now), pubacks(&[4, 5]));
        let (mut s, now, mut acks) = journaled(2);
        acks.replied(2, None, &mut s);
        acks.not_written(&mut s);
        assert!(acks.is_empty());
        acks.synced(through(2, 0), &mut s);
        assert!(written(&mut s, now).is_empty(), "never written: a sync says nothing of them");
        acks.replied(1, None, &mut s);
        assert_eq!(written(&mut s, now), pubacks(&[1, 2]));
    }
}
