//! What the node publishes on its own connection, and who waits to hear the
//! broker has it. The session layer (`session::Session`) gives each QoS 1
//! publish its packet id when it takes it, keeps it across reconnects and a
//! lost session, and reports it `Delivered` or `Refused`; the outbox keeps
//! the note of each by that id: a follow-up's spool entry is let go once
//! the broker has the reply, a reply the broker refuses is logged with its
//! request id and counted. Only what the loop holds can be here (replies
//! of the requests in flight, a bounded number of follow-ups, the status
//! and the rollout events).
//!
//! With a journal and `mqtt.reply_qos = 2`, every QoS 2 publish (a reply,
//! a follow-up) is recorded `Sent` under its packet id when taken, and its
//! PUBREL waits for the record of the PUBREC: `flush_journal` writes both
//! before the loop lets the driver write (a follow-up's spool entry is let
//! go then: the journal sends it again after a crash). Every one, not only
//! the replies to journaled requests: a QoS 2 id the broker holds and a
//! new process does not know would count against the broker's Receive
//! Maximum for ever, and a new publish under it would be taken for the old.

use super::journal::{InFlight, Journal, Kept, SentReply};
use super::session::{Event, Session};
use crate::protocol::Delivery;
use crate::telemetry;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A request's reply, and the request's id for the log.
pub struct Reply {
    pub publish: Publish,
    pub id: String,
}

impl Reply {
    /// A JSON reply to a message with `asked` properties, sent to
    /// `destination` (already checked) at QoS 1 with the message's
    /// Correlation Data: what the control and feedback topics answer.
    pub fn json(
        destination: String,
        asked: &PublishProperties,
        id: String,
        body: &serde_json::Value,
    ) -> Reply {
        let properties = PublishProperties {
            correlation_data: asked.correlation_data.clone(),
            content_type: Some("application/json".into()),
            ..Default::default()
        };
        Reply { publish: Publish::new(destination, QoS::AtLeastOnce, body.to_string(), Some(properties)), id }
    }
}

/// What a publish is: who waits to hear the broker has it, and what the
/// log calls it.
pub enum Note {
    Reply {
        id: String,
        /// Released when the session takes the reply (or it is let go): a
        /// follow-up to the request waits for it, so the final reply never
        /// overtakes the provisional one, even from another connection.
        first: Option<crate::protocol::FirstReplyPending>,
        /// The request's seq in the journal: recorded answered once the
        /// broker has the reply (or never will).
        journaled: Option<u64>,
    },
    FollowUp(Delivery),
    /// A follow-up the journal holds (its spool entry is let go).
    JournaledFollowUp,
    /// The retained status.
    Status,
    /// A rollout decision on the events topic: each one goes out.
    Event,
}

pub struct Outbox {
    /// The note of each publish the broker has not confirmed, by packet id.
    notes: HashMap<u16, Note>,
    /// The broker's Maximum Packet Size (CONNACK; `usize::MAX` until one
    /// is known), shared with the request tasks, which turn a larger reply
    /// into `too_large`.
    max_packet: Arc<AtomicUsize>,
    journal: Option<Journal>,
    /// The journal's seq of each publish recorded `Sent`, by packet id.
    sent: HashMap<u16, u64>,
    /// Held publishes whose PUBREL may go once the journal is written.
    releasing: Vec<u16>,
    /// Follow-ups whose spool entry may go once their `Sent` is written.
    confirming: Vec<u16>,
    /// Something was recorded since the last `flush_journal`.
    dirty: bool,
    /// A record that must be written before the driver writes again (a
    /// reply `Sent`, a PUBREC `Released`) was recorded since.
    urgent: bool,
}

impl Default for Outbox {
    fn default() -> Outbox {
        Outbox {
            notes: HashMap::new(),
            max_packet: Arc::new(AtomicUsize::new(usize::MAX)),
            journal: None,
            sent: HashMap::new(),
            releasing: Vec::new(),
            confirming: Vec::new(),
            dirty: false,
            urgent: false,
        }
    }
}

impl Outbox {
    /// Replies of journaled requests are recorded answered in `journal`.
    pub fn with_journal(journal: Option<Journal>) -> Outbox {
        Outbox { journal, ..Outbox::default() }
    }

    /// The request (or reply) `seq` needs no more from the node (recorded
    /// in memory; `flush_journal` writes it).
    pub fn answered(&mut self, seq: Option<u64>) {
        if let (Some(journal), Some(seq)) = (&self.journal, seq) {
            journal.answered(seq);
            self.dirty = true;
        }
    }

    /// The broker completed the reply `Sent` as `seq` (PUBCOMP): recorded
    /// in memory and written with the journal's next write, not one of its
    /// own. Lost in a crash, it costs a PUBREL sent again at the next start
    /// (its `Released` was written before the first), which the broker
    /// answers PUBCOMP: nothing reaches a device twice.
    fn completed(&mut self, seq: Option<u64>) {
        if let (Some(journal), Some(seq)) = (&self.journal, seq) {
            journal.answered(seq);
        }
    }

    /// Journals a request the loop hands to its task: recorded now,
    /// written by the sync thread, or by `flush_journal` if a record that
    /// must go first (its reply `Sent`) comes before.
    pub fn keep(&mut self, request: &Publish) -> Kept {
        let Some(journal) = &self.journal else { return Kept::NotKept };
        let kept = journal.keep(request);
        self.dirty |= matches!(kept, Kept::Journaled { .. });
        kept
    }

    /// Writes what was recorded since the last call, then lets go what
    /// waited for it: PUBRELs, and the spool entries of follow-ups the
    /// journal now holds. The loop calls it before the driver writes.
    /// Requests and answers alone are left to the sync thread to write
    /// with its next sync (`Journal::write_soon`). `false` when the write
    /// failed (its requests were not journaled).
    pub fn flush_journal(&mut self, session: &mut Session) -> bool {
        let Some(journal) = self.journal.as_ref().filter(|_| std::mem::take(&mut self.dirty)) else {
            return true;
        };
        if !std::mem::take(&mut self.urgent) {
            journal.write_soon();
            return true;
        }
        let written = journal.flush();
        for pkid in self.releasing.drain(..) {
            session.release(pkid);
        }
        for pkid in self.confirming.drain(..) {
            // Not written: the entry stays until the broker has the reply.
            let Some(note) = self.notes.get_mut(&pkid).filter(|_| written) else { continue };
            if let Note::FollowUp(delivery) = std::mem::replace(note, Note::JournaledFollowUp) {
                delivery.confirm();
            }
        }
        written
    }

    /// Replies a previous run journaled `Sent` and never saw confirmed:
    /// back in the session under their packet ids, before it connects.
    pub fn restore(&mut self, session: &mut Session, replies: Vec<InFlight>) {
        for InFlight { seq, reply, released } in replies {
            let pkid = reply.pkid;
            let note = match reply.spool_key {
                Some(_) => Note::JournaledFollowUp,
                None => Note::Reply { id: "(sent before the restart)".into(), first: None, journaled: None },
            };
            session.restore(reply.to_publish(), released);
            self.notes.insert(pkid, note);
            self.sent.insert(pkid, seq);
        }
    }

    /// Hands `publish` to the session (it goes now, or when connected);
    /// answers its packet id (none for QoS 0, or for one refused here).
    /// A QoS 2 publish is recorded `Sent` first (with a journal).
    pub fn publish(&mut self, session: &mut Session, publish: Publish, mut note: Note) -> Option<u16> {
        let record = self.journal.clone().filter(|_| publish.qos == QoS::ExactlyOnce);
        let (request, spool_key) = match &note {
            Note::Reply { journaled, .. } => (*journaled, None),
            Note::FollowUp(delivery) => (None, Some(delivery.key().to_vec())),
            _ => (None, None),
        };
        // Its record, taken before the session has the publish; the packet
        // id is the session's to give.
        let mut reply = record.as_ref().map(|_| SentReply::new(&publish, request, spool_key));
        let taken = match &record {
            Some(_) => session.publish_held(publish),
            None => session.publish(publish),
        };
        match taken {
            Ok(0) => None,
            Ok(pkid) => {
                if let Note::Reply { first, .. } = &mut note {
                    drop(first.take());
                }
                if let (Some(journal), Some(reply)) = (record, reply.as_mut()) {
                    reply.pkid = pkid;
                    match journal.sent(reply) {
                        Some(seq) => {
                            self.sent.insert(pkid, seq);
                            if let Note::FollowUp(_) = note {
                                self.confirming.push(pkid);
                            }
                        }
                        // Failing: it goes as a plain QoS 2 publish.
                        None => self.releasing.push(pkid),
                    }
                    (self.dirty, self.urgent) = (true, true);
                }
                self.notes.insert(pkid, note);
                Some(pkid)
            }
            Err(e) => {
                self.answered(journaled(&note));
                refused(note, "too_large", &e.to_string());
                None
            }
        }
    }

    /// The session's word on one of our publishes.
    pub fn settled(&mut self, event: &Event) {
        match event {
            Event::Received { pkid } => {
                if let (Some(journal), Some(seq)) = (&self.journal, self.sent.get(pkid)) {
                    journal.released(*seq);
                }
                self.releasing.push(*pkid);
                (self.dirty, self.urgent) = (true, true);
            }
            Event::Delivered { pkid } => {
                let sent = self.sent.remove(pkid);
                match (self.notes.remove(pkid), sent) {
                    (Some(Note::FollowUp(delivery)), _) => delivery.confirm(),
                    // QoS 1: the confirmation answers the request, written
                    // before the next turn (until then a crash answers it
                    // twice). Recorded `Sent`, it was answered by that.
                    (Some(Note::Reply { journaled: Some(seq), .. }), None) => self.answered(Some(seq)),
                    _ => {}
                }
                self.completed(sent);
            }
            Event::Refused { pkid, reason } => {
                let sent = self.sent.remove(pkid);
                if let Some(note) = self.notes.remove(pkid) {
                    self.answered(sent.or(journaled(&note)));
                    refused(note, "broker", &format!("the broker refused it (reason {reason:#04x})"));
                }
            }
            _ => {}
        }
    }

    pub fn set_max_packet(&mut self, max: Option<u32>) {
        self.max_packet.store(max.map_or(usize::MAX, |m| m as usize), Ordering::Relaxed);
    }

    /// The broker's Maximum Packet Size as it becomes known, for readers
    /// elsewhere.
    pub fn max_packet(&self) -> Arc<AtomicUsize> {
        self.max_packet.clone()
    }

    /// Publishes the broker has not confirmed.
    pub fn len(&self) -> usize {
        self.notes.len()
    }
}

fn journaled(note: &Note) -> Option<u64> {
    match note {
        Note::Reply { journaled, .. } => *journaled,
        _ => None,
    }
}

/// A reply that will never reach the broker (a connection on the session
/// layer): counted and logged with its request's id.
pub fn not_delivered(id: &str, why: &str) {
    refused(Note::Reply { id: id.to_string(), first: None, journaled: None }, "broker", why);
}

/// A publish that will never reach the broker: counted and logged with what
/// it was. A follow-up's spool entry is let go (it cannot be delivered).
fn refused(note: Note, reason: &'static str, why: &str) {
    metrics::counter!(telemetry::MQTT_REPLIES_REFUSED, "reason" => reason).increment(1);
    match note {
        Note::Reply { id, .. } => {
            tracing::error!(id = %id, "the reply to request {id:?} was not delivered: {why}")
        }
        Note::FollowUp(delivery) => {
            tracing::error!("a final (follow-up) reply was not delivered: {why}");
            delivery.confirm();
        }
        Note::JournaledFollowUp => tracing::error!("a final (follow-up) reply was not delivered: {why}"),
        Note::Status => tracing::warn!("the status message was not delivered: {why}"),
        Note::Event => tracing::warn!("a rollout event was not delivered: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::mqtt::session::Options;
    use tokio::sync::mpsc;

    fn reply(n: u8) -> Publish {
        Publish::new(format!("dev/{n}"), QoS::AtLeastOnce, vec![n], None)
    }

    fn session() -> Session {
        Session::new(Options {
            client_id: "t".into(),
            keep_alive: std::time::Duration::from_secs(30),
            clean_start: false,
            session_expiry_s: 60,
            receive_maximum: 8,
            max_packet_size: 1 << 20,
            connect_timeout: std::time::Duration::from_secs(10),
            ping_timeout: std::time::Duration::from_secs(10),
            login: None,
            will: None,
        })
    }

    /// Each confirmation settles the publish it names; a follow-up's spool
    /// entry is let go when the broker has it, or when it never will.
    #[test]
    fn each_confirmation_settles_the_publish_it_names() {
        let (mut session, mut outbox) = (session(), Outbox::default());
        let (tx, mut reports) = mpsc::unbounded_channel();
        let r1 = outbox
            .publish(&mut session, reply(1), Note::Reply { id: "r1".into(), first: None, journaled: None })
            .unwrap();
        let f2 =
            outbox.publish(&mut session, reply(2), Note::FollowUp(Delivery::new(b"k2".to_vec(), tx.clone())));
        let f3 =
            outbox.publish(&mut session, reply(3), Note::FollowUp(Delivery::new(b"k3".to_vec(), tx.clone())));
        assert_eq!(outbox.len(), 3, "held while away, with their packet ids");
        outbox.settled(&Event::Delivered { pkid: f2.unwrap() });
        assert_eq!(reports.try_recv().unwrap(), (b"k2".to_vec(), true), "2 is delivered");
        outbox.settled(&Event::Refused { pkid: f3.unwrap(), reason: 0x87 });
        assert_eq!(reports.try_recv().unwrap(), (b"k3".to_vec(), true), "3 never will be: let go");
        outbox.settled(&Event::Delivered { pkid: r1 });
        assert_eq!(outbox.len(), 0);
        assert!(reports.try_recv().is_err());
    }

    /// Issue 42: a request of the share group is answered on the share
    /// connection and its follow-up on the node's own; the follow-up waits
    /// until the session has the provisional reply.
    #[tokio::test]
    async fn a_follow_up_waits_until_the_session_took_the_provisional_reply() {
        let (mut session, mut outbox) = (session(), Outbox::default());
        let (pending, after) = crate::protocol::first_reply();
        let sent = after.sent();
        outbox.publish(
            &mut session,
            reply(1),
            Note::Reply { id: "r1".into(), first: Some(pending), journaled: None },
        );
        tokio::time::timeout(std::time::Duration::from_secs(1), sent).await.expect("handed to the session");
        assert_eq!(outbox.len(), 1, "still waiting for its confirmation");
    }
}
