//! Everything the node publishes leaves through the outbox, in order. The
//! MQTT loop is the one writer into rumqttc, so the n-th QoS 1 publish it
//! hands over is the n-th new `Outgoing::Publish(pkid)` rumqttc reports,
//! and each PUBACK from the broker can be matched to what it acknowledges:
//! a follow-up's spool entry is kept until the broker has the reply, a
//! reply the broker refuses is logged with its request id and counted, and
//! the replies of a lost session are sent again. The loop never waits on
//! rumqttc's channel (rumqttc drains it only while connected): what does not
//! fit stays here, and only what the loop holds can be here (replies and
//! acknowledgements of the requests in flight, a bounded number of
//! follow-ups, one status).

use crate::protocol::Delivery;
use crate::telemetry;
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, Publish};
use rumqttc::v5::{AsyncClient, Event};
use std::collections::{HashMap, VecDeque};
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
        /// Released when rumqttc takes the reply (or it is let go): a
        /// follow-up to the request waits for it, so the final reply never
        /// overtakes the provisional one, even from another connection.
        first: Option<crate::protocol::FirstReplyPending>,
    },
    FollowUp(Delivery),
    /// The retained status: a newer one replaces one still queued.
    Status,
    /// A rollout decision on the events topic: each one goes out.
    Event,
}

enum Item {
    Publish {
        publish: Publish,
        note: Note,
    },
    /// The acknowledgement of this request.
    Ack(Publish),
}

/// A QoS 1 publish rumqttc took, in the order it took them.
struct Tracked {
    order: u64,
    publish: Publish,
    note: Note,
}

pub struct Outbox {
    queue: VecDeque<Item>,
    /// Taken by rumqttc, packet id not yet reported.
    handed: VecDeque<Tracked>,
    /// Written with this packet id, waiting for the broker's PUBACK.
    written: HashMap<u16, Tracked>,
    next_order: u64,
    /// The broker's Maximum Packet Size (CONNACK; `usize::MAX` until one
    /// is known); a larger packet would fail the write and drop the
    /// connection, with the packet replayed after every reconnect. Shared
    /// with the request tasks, which turn a larger reply into `too_large`.
    max_packet: Arc<AtomicUsize>,
}

impl Default for Outbox {
    fn default() -> Outbox {
        Outbox {
            queue: VecDeque::new(),
            handed: VecDeque::new(),
            written: HashMap::new(),
            next_order: 0,
            max_packet: Arc::new(AtomicUsize::new(usize::MAX)),
        }
    }
}

impl Outbox {
    pub fn publish(&mut self, publish: Publish, note: Note) {
        if matches!(note, Note::Status) {
            // Only the newest status matters.
            self.queue.retain(|i| !matches!(i, Item::Publish { note: Note::Status, .. }));
        }
        self.queue.push_back(Item::Publish { publish, note });
    }

    pub fn ack(&mut self, request: Publish) {
        self.queue.push_back(Item::Ack(request));
    }

    /// An acknowledgement of packet id `pkid` waits here still.
    pub fn acks(&self, pkid: u16) -> bool {
        self.queue.iter().any(|i| matches!(i, Item::Ack(p) if p.pkid == pkid))
    }

    pub fn set_max_packet(&mut self, max: Option<u32>) {
        self.max_packet.store(max.map_or(usize::MAX, |m| m as usize), Ordering::Relaxed);
    }

    /// The broker's Maximum Packet Size as it becomes known, for readers
    /// elsewhere.
    pub fn max_packet(&self) -> Arc<AtomicUsize> {
        self.max_packet.clone()
    }

    /// Publishes and acknowledgements held: waiting, handed to rumqttc, or
    /// written and waiting for the broker's PUBACK.
    pub fn len(&self) -> usize {
        self.queue.len() + self.handed.len() + self.written.len()
    }

    /// Nothing waits to be handed over or acknowledged.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.handed.is_empty() && self.written.is_empty()
    }

    /// Hands rumqttc what it takes now, in order. Call only while connected:
    /// what rumqttc holds across a reconnect is then exactly what it took
    /// before the break.
    pub fn flush(&mut self, client: &AsyncClient) {
        let max_packet = self.max_packet.load(Ordering::Relaxed);
        while let Some(item) = self.queue.front() {
            let sent = match item {
                Item::Ack(request) => client.try_ack(request).is_ok(),
                Item::Publish { publish, .. } if publish.size() > max_packet => {
                    let Some(Item::Publish { publish, note }) = self.queue.pop_front() else {
                        unreachable!()
                    };
                    let why = format!(
                        "{} bytes, more than the broker's Maximum Packet Size {max_packet}",
                        publish.size()
                    );
                    refused(note, "too_large", &why);
                    continue;
                }
                Item::Publish { publish, .. } => {
                    let topic = String::from_utf8_lossy(&publish.topic).into_owned();
                    let properties = publish.properties.clone().unwrap_or_default();
                    client
                        .try_publish_with_properties(
                            topic,
                            publish.qos,
                            publish.retain,
                            publish.payload.clone(),
                            properties,
                        )
                        .is_ok()
                }
            };
            if !sent {
                return;
            }
            if let Some(Item::Publish { publish, mut note }) = self.queue.pop_front() {
                if let Note::Reply { first, .. } = &mut note {
                    drop(first.take());
                }
                if publish.qos != QoS::AtMostOnce {
                    self.handed.push_back(Tracked { order: self.next_order, publish, note });
                    self.next_order += 1;
                }
            }
        }
    }

    /// Follows what rumqttc reports of our publishes: written with a
    /// packet id, acknowledged by the broker.
    pub fn track(&mut self, event: &Event) {
        match event {
            Event::Outgoing(Outgoing::Publish(pkid)) => self.written(*pkid),
            Event::Incoming(Packet::PubAck(ack)) => self.acknowledged(ack.pkid, ack.reason),
            _ => {}
        }
    }

    /// rumqttc wrote a publish with this packet id (`Outgoing::Publish`).
    fn written(&mut self, pkid: u16) {
        // 0: QoS 0. Known: a publish resent after a reconnect.
        if pkid == 0 || self.written.contains_key(&pkid) {
            return;
        }
        if let Some(tracked) = self.handed.pop_front() {
            self.written.insert(pkid, tracked);
        }
    }

    /// The broker's PUBACK for `pkid`.
    fn acknowledged(&mut self, pkid: u16, reason: PubAckReason) {
        let Some(tracked) = self.written.remove(&pkid) else { return };
        match reason {
            PubAckReason::Success | PubAckReason::NoMatchingSubscribers => {
                if let Note::FollowUp(delivery) = tracked.note {
                    delivery.confirm();
                }
            }
            refusal => refused(tracked.note, "broker", &format!("PUBACK reason {refusal:?}")),
        }
    }

    /// The broker lost our session, and rumqttc dropped what it had not seen
    /// acknowledged: send it again, in the order it first went. The queued
    /// acknowledgements belonged to that session's requests.
    pub fn session_lost(&mut self) {
        let mut again: Vec<Tracked> = self.written.drain().map(|(_, t)| t).collect();
        again.extend(self.handed.drain(..));
        again.sort_by_key(|t| t.order);
        self.queue.retain(|i| !matches!(i, Item::Ack(_)));
        for Tracked { mut publish, note, .. } in again.into_iter().rev() {
            publish.pkid = 0;
            publish.dup = false;
            self.queue.push_front(Item::Publish { publish, note });
        }
    }
}

/// A reply that will never reach the broker (a connection on the session
/// layer): counted and logged with its request's id.
pub fn not_delivered(id: &str, why: &str) {
    refused(Note::Reply { id: id.to_string(), first: None }, "broker", why);
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
    use tokio::sync::mpsc;

    fn reply(n: u8) -> Publish {
        Publish::new(format!("dev/{n}"), QoS::AtLeastOnce, vec![n], None)
    }

    fn client() -> (AsyncClient, rumqttc::v5::EventLoop) {
        AsyncClient::new(rumqttc::v5::MqttOptions::new("t", "127.0.0.1", 1), 16)
    }

    #[tokio::test]
    async fn each_puback_settles_the_publish_it_acknowledges_and_a_lost_session_sends_the_rest_again() {
        let (client, eventloop) = client();
        let mut outbox = Outbox::default();
        let (tx, mut reports) = mpsc::unbounded_channel();
        outbox.publish(reply(1), Note::Reply { id: "r1".into(), first: None });
        outbox.publish(reply(2), Note::FollowUp(Delivery::new(b"k2".to_vec(), tx.clone())));
        outbox.publish(reply(3), Note::FollowUp(Delivery::new(b"k3".to_vec(), tx.clone())));
        outbox.publish(reply(4), Note::Reply { id: "r4".into(), first: None });
        outbox.flush(&client);
        assert!(outbox.queue.is_empty());
        // rumqttc wrote 1 and 2, and 3 and 4 not yet.
        outbox.written(7);
        outbox.written(8);
        outbox.written(7);
        outbox.acknowledged(8, PubAckReason::Success);
        assert_eq!(reports.try_recv().unwrap(), (b"k2".to_vec(), true), "2 is delivered");
        assert!(reports.try_recv().is_err());
        // The session is lost: 1, 3 and 4 go again, in order, as new messages.
        outbox.ack(reply(9));
        outbox.session_lost();
        let topics: Vec<String> = outbox
            .queue
            .iter()
            .map(|i| match i {
                Item::Publish { publish, .. } => String::from_utf8_lossy(&publish.topic).into_owned(),
                Item::Ack(_) => "ack".into(),
            })
            .collect();
        assert_eq!(topics, vec!["dev/1", "dev/3", "dev/4"], "the old session's acknowledgement is gone");
        drop(eventloop);
    }

    /// Issue 42: a request of the share group is answered on the share
    /// connection and its follow-up on the node's own; the follow-up waits
    /// until rumqttc has the provisional reply, not merely the outbox.
    #[tokio::test]
    async fn a_follow_up_waits_until_rumqttc_took_the_provisional_reply() {
        let (client, _eventloop) = client();
        let mut outbox = Outbox::default();
        let (pending, after) = crate::protocol::first_reply();
        outbox.publish(reply(1), Note::Reply { id: "r1".into(), first: Some(pending) });
        let mut sent = Box::pin(after.sent());
        let early = tokio::time::timeout(std::time::Duration::from_millis(20), &mut sent).await;
        assert!(early.is_err(), "queued in the outbox is not handed on");
        outbox.flush(&client);
        tokio::time::timeout(std::time::Duration::from_secs(1), sent).await.expect("handed to rumqttc");
        assert_eq!(outbox.handed.len(), 1, "still tracked for its PUBACK");
    }

    #[tokio::test]
    async fn a_refused_or_oversized_follow_up_is_let_go_and_never_blocks_the_rest() {
        let (client, _eventloop) = client();
        let mut outbox = Outbox::default();
        outbox.set_max_packet(Some(64));
        let (tx, mut reports) = mpsc::unbounded_channel();
        let big = Publish::new("dev/big", QoS::AtLeastOnce, vec![0u8; 100], None);
        outbox.publish(big, Note::FollowUp(Delivery::new(b"big".to_vec(), tx.clone())));
        outbox.publish(reply(1), Note::FollowUp(Delivery::new(b"acl".to_vec(), tx.clone())));
        outbox.flush(&client);
        assert_eq!(reports.try_recv().unwrap(), (b"big".to_vec(), true), "never sent, let go");
        assert_eq!(outbox.handed.len(), 1, "the next one went");
        outbox.written(3);
        outbox.acknowledged(3, PubAckReason::NotAuthorized);
        assert_eq!(reports.try_recv().unwrap(), (b"acl".to_vec(), true));
        assert!(outbox.is_idle());
    }
}
