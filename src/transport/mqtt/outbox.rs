//! What the node publishes on its own connection, and who waits to hear the
//! broker has it. The session layer (`session::Session`) gives each QoS 1
//! publish its packet id when it takes it, keeps it across reconnects and a
//! lost session, and reports it `Delivered` or `Refused`; the outbox keeps
//! the note of each by that id: a follow-up's spool entry is let go once
//! the broker has the reply, a reply the broker refuses is logged with its
//! request id and counted. Only what the loop holds can be here (replies
//! of the requests in flight, a bounded number of follow-ups, the status
//! and the rollout events).

use super::journal::Journal;
use super::session::{Event, Session};
use crate::protocol::Delivery;
use crate::telemetry;
use rumqttc::v5::mqttbytes::v5::Publish;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A request's reply, and the request's id for the log.
pub struct Reply {
    pub publish: Publish,
    pub id: String,
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
}

impl Default for Outbox {
    fn default() -> Outbox {
        Outbox { notes: HashMap::new(), max_packet: Arc::new(AtomicUsize::new(usize::MAX)), journal: None }
    }
}

impl Outbox {
    /// Replies of journaled requests are recorded answered in `journal`.
    pub fn with_journal(journal: Option<Journal>) -> Outbox {
        Outbox { journal, ..Outbox::default() }
    }

    /// The request `seq` needs no more from the node (recorded in memory;
    /// `flush_journal` writes it).
    pub fn answered(&self, seq: Option<u64>) {
        if let (Some(journal), Some(seq)) = (&self.journal, seq) {
            journal.answered(seq);
        }
    }

    pub fn flush_journal(&self) {
        if let Some(journal) = &self.journal {
            journal.flush();
        }
    }

    /// Hands `publish` to the session (it goes now, or when connected);
    /// answers its packet id (none for QoS 0, or for one refused here).
    pub fn publish(&mut self, session: &mut Session, publish: Publish, mut note: Note) -> Option<u16> {
        match session.publish(publish) {
            Ok(0) => None,
            Ok(pkid) => {
                if let Note::Reply { first, .. } = &mut note {
                    drop(first.take());
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
            Event::Delivered { pkid } => match self.notes.remove(pkid) {
                Some(Note::FollowUp(delivery)) => delivery.confirm(),
                Some(Note::Reply { journaled, .. }) => self.answered(journaled),
                _ => {}
            },
            Event::Refused { pkid, reason } => {
                if let Some(note) = self.notes.remove(pkid) {
                    self.answered(journaled(&note));
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
        Note::Status => tracing::warn!("the status message was not delivered: {why}"),
        Note::Event => tracing::warn!("a rollout event was not delivered: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::mqtt::session::Options;
    use rumqttc::v5::mqttbytes::QoS;
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
