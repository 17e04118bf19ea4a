//! In-order acknowledgements. MQTT requires PUBACKs in the order the
//! PUBLISHes arrived [MQTT-4.6.0-2] (rumqttd disconnects a client that breaks
//! this), while requests finish in any order. The MQTT loop owns `Acks`:
//! it registers each request as it arrives and hears each finish (with its
//! reply) over a channel; acknowledgements leave from the head, after the
//! reply, through the same outbox.
//!
//! A session has an epoch: when the broker lost our session (CONNACK with
//! `session_present = false`) the packet ids of the old one mean nothing, so
//! none of its acknowledgements is sent into the new one.

use super::session::Arrival;
use rumqttc::v5::mqttbytes::v5::Publish;
use std::collections::{HashMap, VecDeque};
use tokio::sync::mpsc;

/// A request finished: its reply (if it has one), and its place in line.
pub struct Finished {
    /// Its place in the session layer's line (`session::Session`), for a
    /// connection on it; `None` for one on rumqttc or a QoS 0 request.
    pub arrival: Option<Arrival>,
    pub seq: u64,
    pub epoch: u64,
    pub pkid: u16,
    pub reply: Option<super::outbox::Reply>,
    /// Held until the reply is handed to rumqttc on its connection: a
    /// follow-up to this request waits for it, and may go out on another
    /// connection (the share group's requests, `share.rs`).
    pub first: Option<crate::protocol::FirstReplyPending>,
}

/// A request's place in line; `send` (or dropping it, e.g. when its task
/// was aborted) reports it finished.
pub struct AckSlot {
    arrival: Option<Arrival>,
    seq: u64,
    epoch: u64,
    pkid: u16,
    tx: Option<mpsc::UnboundedSender<Finished>>,
}

impl AckSlot {
    /// The slot of a request on a connection of the session layer: its
    /// place in line is the session's (`acknowledge_after`).
    pub fn for_arrival(arrival: Option<Arrival>, tx: mpsc::UnboundedSender<Finished>) -> AckSlot {
        AckSlot { arrival, seq: 0, epoch: 0, pkid: 0, tx: Some(tx) }
    }

    pub fn send(mut self, reply: Option<super::outbox::Reply>) {
        self.report(reply, None);
    }

    /// `send`, with the guard a follow-up to this request waits on: released
    /// once the reply is handed to rumqttc.
    pub fn send_first(mut self, reply: super::outbox::Reply, first: crate::protocol::FirstReplyPending) {
        self.report(Some(reply), Some(first));
    }

    /// Once: `send` and then `Drop` report nothing twice.
    fn report(
        &mut self,
        reply: Option<super::outbox::Reply>,
        first: Option<crate::protocol::FirstReplyPending>,
    ) {
        if let Some(tx) = self.tx.take() {
            let finished = Finished {
                arrival: self.arrival,
                seq: self.seq,
                epoch: self.epoch,
                pkid: self.pkid,
                reply,
                first,
            };
            let _ = tx.send(finished);
        }
    }
}

impl Drop for AckSlot {
    fn drop(&mut self) {
        // The engine answers a panicking request `internal` itself; a panic
        // here is in the adapter, after that. Acknowledgements must leave in
        // order, so this one still goes, but not silently.
        if std::thread::panicking() {
            tracing::error!("a request task panicked before its reply was sent; acknowledging it anyway");
        }
        self.report(None, None);
    }
}

/// What this session knows of a packet id the broker used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Seen {
    Running,
    /// Answered; its acknowledgement waits for earlier requests.
    Answered,
    /// Its acknowledgement was released to the outbox.
    Acked,
}

pub struct Acks {
    order: Sequencer<Publish>,
    next: u64,
    epoch: u64,
    /// Requests of this session by packet id, so a redelivery (DUP) of one
    /// is not run twice: rumqttc drops acknowledgements still queued when a
    /// connection breaks, and the broker then sends those requests again.
    seen: HashMap<u16, Seen>,
    tx: mpsc::UnboundedSender<Finished>,
}

impl Acks {
    pub fn new() -> (Acks, mpsc::UnboundedReceiver<Finished>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Acks { order: Sequencer::default(), next: 0, epoch: 0, seen: HashMap::new(), tx }, rx)
    }

    /// What this session already knows of a request that arrived again.
    pub fn redelivered(&self, publish: &Publish) -> Option<Seen> {
        publish.dup.then(|| self.seen.get(&publish.pkid).copied()).flatten()
    }

    /// Call in arrival order, from the task that reads the connection.
    pub fn arrived(&mut self, publish: &Publish) -> AckSlot {
        let seq = self.next_seq();
        self.seen.insert(publish.pkid, Seen::Running);
        let released = self.order.arrived(seq, ack_of(publish));
        debug_assert!(released.is_empty(), "nothing is done before it arrived");
        AckSlot { arrival: None, seq, epoch: self.epoch, pkid: publish.pkid, tx: Some(self.tx.clone()) }
    }

    /// A redelivered request acknowledged before (the acknowledgement was
    /// lost): acknowledged again, in line.
    pub fn again(&mut self, publish: &Publish) -> Vec<Publish> {
        let seq = self.next_seq();
        self.order.arrived(seq, ack_of(publish));
        self.released(seq)
    }

    fn next_seq(&mut self) -> u64 {
        self.next += 1;
        self.next - 1
    }

    /// The acknowledgements `finished` releases, in order; none for a
    /// request of a lost session.
    pub fn finished(&mut self, finished: &Finished) -> Vec<Publish> {
        if finished.epoch != self.epoch {
            return Vec::new();
        }
        self.seen.insert(finished.pkid, Seen::Answered);
        self.released(finished.seq)
    }

    fn released(&mut self, seq: u64) -> Vec<Publish> {
        let released = self.order.done(seq);
        for request in &released {
            self.seen.insert(request.pkid, Seen::Acked);
        }
        released
    }

    /// Requests whose acknowledgement has not left yet (running, or
    /// answered and waiting for earlier ones): at most the Receive Maximum
    /// the node announces, since the broker sends no more unacknowledged.
    pub fn waiting(&self) -> usize {
        self.order.queue.len()
    }

    /// The broker lost our session: forget its requests' packet ids.
    pub fn new_session(&mut self) {
        self.epoch += 1;
        self.order = Sequencer { base: self.next, queue: VecDeque::new() };
        self.seen.clear();
    }
}

/// What an acknowledgement needs of a request (its packet id and QoS):
/// answered requests wait here for the ones before them, without payloads.
fn ack_of(publish: &Publish) -> Publish {
    let mut ack = Publish::new("", publish.qos, Vec::new(), None);
    ack.pkid = publish.pkid;
    ack
}

/// Items numbered in arrival order, released in that order once each is done
/// (an item may be reported done before its arrival is seen).
struct Sequencer<T> {
    base: u64,
    queue: VecDeque<(Option<T>, bool)>,
}

impl<T> Default for Sequencer<T> {
    fn default() -> Self {
        Sequencer { base: 0, queue: VecDeque::new() }
    }
}

impl<T> Sequencer<T> {
    fn arrived(&mut self, seq: u64, item: T) -> Vec<T> {
        if let Some(entry) = self.entry(seq) {
            entry.0 = Some(item);
        }
        self.release()
    }

    fn done(&mut self, seq: u64) -> Vec<T> {
        if let Some(entry) = self.entry(seq) {
            entry.1 = true;
        }
        self.release()
    }

    fn entry(&mut self, seq: u64) -> Option<&mut (Option<T>, bool)> {
        let index = seq.checked_sub(self.base)? as usize;
        if self.queue.len() <= index {
            self.queue.resize_with(index + 1, || (None, false));
        }
        self.queue.get_mut(index)
    }

    fn release(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        while self.queue.front().is_some_and(|(item, done)| item.is_some() && *done) {
            let (item, _) = self.queue.pop_front().expect("front exists");
            self.base += 1;
            out.extend(item);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Sequencer;

    #[test]
    fn acknowledgements_leave_in_arrival_order_whatever_order_requests_finish() {
        for round in 0..200u64 {
            let n = 1 + (round % 37);
            let mut order = Sequencer::default();
            let mut released = Vec::new();
            for seq in 0..n {
                released.extend(order.arrived(seq, seq));
            }
            // A shuffled completion order, deterministic per round.
            let mut finish: Vec<u64> = (0..n).collect();
            let mut x = round.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            for i in (1..finish.len()).rev() {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                finish.swap(i, (x >> 33) as usize % (i + 1));
            }
            for (k, seq) in finish.iter().enumerate() {
                released.extend(order.done(*seq));
                let all_before_done = (0..=*seq).all(|s| finish[..=k].contains(&s));
                if all_before_done {
                    assert!(released.contains(seq));
                }
            }
            assert_eq!(released, (0..n).collect::<Vec<_>>(), "round {round}");
        }
    }

    /// Issue 16, finding 6: the queue used to outlive a lost session, so an
    /// old request's acknowledgement could carry a packet id the broker had
    /// since given to a new request.
    #[tokio::test]
    async fn a_lost_session_sends_none_of_its_acknowledgements_and_redeliveries_run_once() {
        use super::{Acks, Seen};
        use rumqttc::v5::mqttbytes::QoS;
        use rumqttc::v5::mqttbytes::v5::Publish;
        let request = |pkid: u16, dup: bool| {
            let mut p = Publish::new("edgeinfer/n/infer/digits", QoS::AtLeastOnce, "{}", None);
            p.pkid = pkid;
            p.dup = dup;
            p
        };
        let (mut acks, mut finished) = Acks::new();
        let old = acks.arrived(&request(1, false));
        let answered = acks.arrived(&request(2, false));
        answered.send(None);
        let done = finished.recv().await.unwrap();
        assert!(acks.finished(&done).is_empty(), "1 is still running, 2 waits behind it");
        // The connection broke; the session resumed: the broker sends both again.
        assert_eq!(acks.redelivered(&request(1, true)), Some(Seen::Running), "not run twice");
        assert_eq!(acks.redelivered(&request(2, true)), Some(Seen::Answered), "its PUBACK is still to come");
        assert_eq!(acks.redelivered(&request(2, false)), None, "a new message reusing the id");
        // Then the session is lost: packet id 1 now belongs to a new request.
        acks.new_session();
        assert_eq!(acks.redelivered(&request(1, true)), None);
        let new = acks.arrived(&request(1, false));
        old.send(None);
        let done = finished.recv().await.unwrap();
        assert!(acks.finished(&done).is_empty(), "the old request's PUBACK would acknowledge the new one");
        new.send(None);
        let done = finished.recv().await.unwrap();
        let released: Vec<u16> = acks.finished(&done).iter().map(|p| p.pkid).collect();
        assert_eq!(released, vec![1]);
    }

    #[test]
    fn done_before_arrival_is_held_until_the_arrival() {
        let mut order = Sequencer::default();
        assert!(order.done(0).is_empty());
        assert_eq!(order.arrived(0, "a"), vec!["a"]);
    }
}
