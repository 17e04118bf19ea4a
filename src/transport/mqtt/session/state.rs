//! `Session`: one MQTT 5 session across its connections. Inputs are
//! `connect`, `handle_read`, `handle_closed`, `handle_timeout` and the
//! application's `publish`, `subscribe` and `acknowledge`; outputs are
//! pulled with `poll_transmit`, `poll_event` and `poll_timeout`, which the
//! driver calls after every input.

use super::inflight::{Ack, Incoming, IncomingTable, OutgoingTable, Stage};
use super::timers::{Timer, Timers};
use super::{Arrival, Closed, Event, Options, PublishError};
use bytes::Buf;
use bytes::BytesMut;
use rumqttc::v5::mqttbytes::v5::check;
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, Connect, ConnectProperties, ConnectReturnCode, Disconnect, DisconnectProperties,
    DisconnectReasonCode, Filter, Packet, PingReq, PubAck, PubAckReason, PubComp, PubCompReason, PubRec,
    PubRecReason, PubRel, Publish, Subscribe, Unsubscribe,
};
use rumqttc::v5::mqttbytes::{Error as CodecError, QoS};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Down,
    /// CONNECT queued or written, CONNACK not yet heard.
    Connecting,
    Up,
}

pub struct Session {
    options: Options,
    link: Link,
    /// Whether a connection got as far as CONNACK: later CONNECTs resume.
    resumed_once: bool,
    rx: BytesMut,
    /// Packets not yet handed to the driver, in the order they go.
    tx: VecDeque<Packet>,
    /// The DISCONNECT that says why we close, written alone.
    goodbye: Option<Packet>,
    /// Bytes handed to the driver and bytes it reports written on this
    /// connection; the PUBACKs and PUBCOMPs handed over and not yet
    /// written, each with where it ends: owed if the connection drops.
    encoded: u64,
    written: u64,
    in_transit: VecDeque<(u64, Packet)>,
    /// PUBACKs and PUBCOMPs queued or in transit: their publishes are in
    /// flight for the broker until they are written, so they count
    /// against our Receive Maximum.
    unwritten_acks: usize,
    /// Whether this connection's CONNECT asked for a clean start.
    clean_start_sent: bool,
    events: VecDeque<Event>,
    timers: Timers,
    outgoing: OutgoingTable,
    incoming: IncomingTable,
    /// Of the broker's Receive Maximum, what our publishes do not hold.
    send_quota: u16,
    /// The broker's Maximum Packet Size, Maximum QoS and Retain
    /// Available, once it said them.
    peer_max_packet: Option<u32>,
    peer_max_qos: QoS,
    peer_retain: bool,
    keep_alive: Duration,
}

impl Session {
    pub fn new(options: Options) -> Session {
        Session {
            keep_alive: options.keep_alive,
            options,
            link: Link::Down,
            resumed_once: false,
            rx: BytesMut::new(),
            tx: VecDeque::new(),
            goodbye: None,
            encoded: 0,
            written: 0,
            in_transit: VecDeque::new(),
            unwritten_acks: 0,
            clean_start_sent: false,
            events: VecDeque::new(),
            timers: Timers::default(),
            outgoing: OutgoingTable::default(),
            incoming: IncomingTable::default(),
            send_quota: 0,
            peer_max_packet: None,
            peer_max_qos: QoS::ExactlyOnce,
            peer_retain: true,
        }
    }

    pub fn is_connected(&self) -> bool {
        self.link == Link::Up
    }

    /// Our QoS 1 and 2 publishes the broker has not confirmed.
    pub fn unconfirmed(&self) -> usize {
        self.outgoing.len()
    }

    /// Broker publishes not yet acknowledged (or, QoS 2, released).
    pub fn incoming_in_flight(&self) -> usize {
        self.incoming.in_flight() + self.unwritten_acks
    }

    /// Broker publishes whose acknowledgement is not yet queued to be
    /// written: held for their request (or one before it, in arrival
    /// order), QoS 2 ones awaiting PUBREL, and acknowledgements owed to the
    /// next connection. One queued is written at the driver's next turn,
    /// which the owner of the session does not see: a gauge set from
    /// `incoming_in_flight` would stay at the count before that write.
    pub fn awaiting_acknowledgement(&self) -> usize {
        self.incoming.in_flight()
    }

    /// Bytes read and not yet a whole packet: at most one packet of
    /// `max_packet_size` and the read that brought it.
    pub fn buffered(&self) -> usize {
        self.rx.len()
    }

    /// A new connection is open: CONNECT goes first. What the last one did
    /// not get to write is kept where it matters: our publishes wait in
    /// their table, and an acknowledgement never written is owed again.
    pub fn connect(&mut self, now: Instant) {
        let in_transit = std::mem::take(&mut self.in_transit).into_iter().map(|(_, p)| p);
        let unsent: Vec<Packet> = in_transit.chain(std::mem::take(&mut self.tx)).collect();
        self.unwritten_acks = 0;
        for packet in unsent {
            match packet {
                // Answered when the broker sends the PUBLISH or PUBREL
                // again, as it must on resuming: sent unasked, a PUBACK
                // could reach it after it gave the id to a new message.
                Packet::PubAck(ack) => self.incoming.owe_puback(ack.pkid),
                Packet::PubComp(comp) if comp.reason == PubCompReason::Success => {
                    self.incoming.owe_pubcomp(comp.pkid)
                }
                // PUBREC: the id still awaits PUBREL, and the PUBLISH sent
                // again is answered PUBREC again. The rest goes by its
                // table or belonged to that connection only.
                _ => {}
            }
        }
        (self.goodbye, self.encoded, self.written) = (None, 0, 0);
        self.rx.clear();
        self.timers.stop_all();
        self.outgoing.forget_subscribes();
        // Until the broker says whether it kept the session, nothing held
        // is acknowledged: kept, it sends each again first.
        self.incoming.resume();
        for entry in self.outgoing.iter_mut() {
            entry.holds_quota = false;
            entry.stage = match entry.stage {
                Stage::Sent | Stage::Waiting => Stage::Waiting,
                Stage::Released | Stage::ReleaseWaiting => Stage::ReleaseWaiting,
            };
        }
        let clean_start = self.options.clean_start && !self.resumed_once;
        self.clean_start_sent = clean_start;
        let properties = ConnectProperties {
            session_expiry_interval: Some(self.options.session_expiry_s),
            receive_maximum: Some(self.options.receive_maximum),
            max_packet_size: Some(self.options.max_packet_size),
            topic_alias_max: Some(0),
            ..ConnectProperties::new()
        };
        let connect = Connect {
            keep_alive: self.options.keep_alive.as_secs().min(u16::MAX as u64) as u16,
            client_id: self.options.client_id.clone(),
            clean_start,
            properties: Some(properties),
        };
        self.tx.push_back(Packet::Connect(connect, self.options.will.clone(), self.options.login.clone()));
        self.link = Link::Connecting;
        self.timers.set(Timer::ConnAck, now + self.options.connect_timeout);
    }

    /// Leaves the broker cleanly (DISCONNECT, normal: no will): the
    /// driver writes it (`poll_goodbye`) and closes.
    pub fn disconnect(&mut self) {
        if self.link != Link::Down {
            let normal = Disconnect::new(DisconnectReasonCode::NormalDisconnection);
            self.goodbye = Some(Packet::Disconnect(normal));
            self.link = Link::Down;
            self.timers.stop_all();
        }
    }

    /// The broker's Maximum Packet Size, once its CONNACK said one.
    pub fn peer_max_packet(&self) -> Option<u32> {
        self.peer_max_packet
    }

    /// How long a CONNACK may take; the driver bounds its connect by it too.
    pub fn connect_timeout(&self) -> Duration {
        self.options.connect_timeout
    }

    /// The connection closed under us (EOF, an error, or after `Closed`).
    pub fn handle_closed(&mut self) {
        self.link = Link::Down;
        self.timers.stop_all();
    }

    /// Bytes read from the connection. The read buffer holds at most one
    /// packet of `max_packet_size`: a larger one is refused by its header.
    pub fn handle_read(&mut self, now: Instant, bytes: &[u8]) {
        if self.link == Link::Down {
            return;
        }
        self.rx.extend_from_slice(bytes);
        while self.link != Link::Down {
            let frame = match check(self.rx.iter(), Some(self.options.max_packet_size)) {
                Ok(header) => header.frame_length(),
                Err(CodecError::InsufficientBytes(_)) => return,
                Err(CodecError::PayloadSizeLimitExceeded { .. }) => {
                    return self
                        .protocol_error(DisconnectReasonCode::PacketTooLarge, "a packet over our maximum");
                }
                Err(_) => {
                    return self.protocol_error(DisconnectReasonCode::MalformedPacket, "a malformed packet");
                }
            };
            // A whole packet is here: whatever does not read is malformed.
            let packet = match short_disconnect(&self.rx[..frame]) {
                Some(reason) => {
                    self.rx.advance(frame);
                    reason.map(|reason_code| Packet::Disconnect(Disconnect { reason_code, properties: None }))
                }
                None => Packet::read(&mut self.rx, None).ok(),
            };
            match packet {
                Some(packet) => self.handle_packet(now, packet),
                None => {
                    return self.protocol_error(DisconnectReasonCode::MalformedPacket, "a malformed packet");
                }
            }
        }
    }

    fn handle_packet(&mut self, now: Instant, packet: Packet) {
        if self.link == Link::Connecting && !matches!(packet, Packet::ConnAck(_) | Packet::Disconnect(_)) {
            return self.protocol_error(DisconnectReasonCode::ProtocolError, "a packet before CONNACK");
        }
        match packet {
            Packet::ConnAck(connack) => self.handle_connack(now, connack),
            Packet::Publish(publish) => self.handle_publish(publish),
            Packet::PubAck(ack) => {
                let code = puback_code(ack.reason);
                self.confirm(ack.pkid, QoS::AtLeastOnce, code);
            }
            Packet::PubRec(rec) => self.handle_pubrec(rec),
            Packet::PubRel(rel) => {
                let mut comp = PubComp::new(rel.pkid, None);
                if !self.incoming.release(rel.pkid) {
                    comp.reason = PubCompReason::PacketIdentifierNotFound;
                }
                self.queue_ack(Packet::PubComp(comp));
            }
            // PUBREC was heard, so the broker has it: a PUBCOMP 0x92 to a
            // PUBREL sent again means the broker completed it before.
            Packet::PubComp(comp) => self.confirm(comp.pkid, QoS::ExactlyOnce, 0),
            Packet::SubAck(ack) => {
                if self.outgoing.subscribed(ack.pkid) {
                    self.events.push_back(Event::Subscribed { pkid: ack.pkid, codes: ack.return_codes });
                }
            }
            Packet::UnsubAck(ack) => {
                if self.outgoing.subscribed(ack.pkid) {
                    self.events.push_back(Event::Unsubscribed { pkid: ack.pkid });
                }
            }
            Packet::PingResp(_) => self.timers.stop(Timer::PingResp),
            Packet::Disconnect(disconnect) => self.close(Closed::ByBroker(disconnect.reason_code)),
            _ => self.protocol_error(DisconnectReasonCode::ProtocolError, "a packet only a client sends"),
        }
    }

    fn handle_connack(&mut self, now: Instant, connack: ConnAck) {
        if self.link != Link::Connecting {
            return self.protocol_error(DisconnectReasonCode::ProtocolError, "a second CONNACK");
        }
        self.timers.stop(Timer::ConnAck);
        if connack.code != ConnectReturnCode::Success {
            return self.close(Closed::Refused(connack.code));
        }
        if connack.session_present && self.clean_start_sent {
            return self
                .protocol_error(DisconnectReasonCode::ProtocolError, "a session kept on a clean start");
        }
        let properties = connack.properties.as_ref();
        self.send_quota = properties.and_then(|p| p.receive_max).unwrap_or(u16::MAX).max(1);
        self.peer_max_packet = properties.and_then(|p| p.max_packet_size);
        self.peer_max_qos = match properties.and_then(|p| p.max_qos) {
            Some(0) => QoS::AtMostOnce,
            Some(1) => QoS::AtLeastOnce,
            _ => QoS::ExactlyOnce,
        };
        self.peer_retain = properties.and_then(|p| p.retain_available) != Some(0);
        self.keep_alive = match properties.and_then(|p| p.server_keep_alive) {
            Some(secs) => Duration::from_secs(secs.into()),
            None => self.options.keep_alive,
        };
        self.link = Link::Up;
        self.resumed_once = true;
        if !connack.session_present {
            // The broker forgot its publishes to us, so their ids mean
            // nothing; it had taken ours that it PUBREC'd; the others go
            // again as new messages.
            self.incoming.clear();
            for pkid in self.outgoing.remove_where(|o| o.stage == Stage::ReleaseWaiting) {
                self.events.push_back(Event::Delivered { pkid });
            }
            for entry in self.outgoing.iter_mut() {
                entry.written = false;
            }
        } else {
            self.incoming.resume();
        }
        self.events.push_back(Event::Connected { session_present: connack.session_present });
        // A QoS 2 publish to a broker of QoS 1 goes at QoS 1; what waits
        // and this broker would still refuse (it disconnects for it, and
        // the same publish first in line would go again each time) is
        // refused here.
        // Written ones too: a reply restored from a journal at QoS 2 goes
        // again at QoS 1 rather than have this broker disconnect for it.
        let max_qos = self.peer_max_qos;
        for entry in self.outgoing.iter_mut().filter(|o| o.stage == Stage::Waiting) {
            downgrade(&mut entry.publish, max_qos);
        }
        let refusals: Vec<(u16, u8)> = self
            .outgoing
            .iter()
            .filter(|o| o.stage == Stage::Waiting && !o.written)
            .filter_map(|o| self.refusal(&o.publish).map(|code| (o.publish.pkid, code)))
            .collect();
        for (pkid, reason) in refusals {
            self.outgoing.remove(pkid);
            self.events.push_back(Event::Refused { pkid, reason });
        }
        self.schedule();
        self.arm_ping(now);
    }

    fn handle_publish(&mut self, publish: Publish) {
        if publish.properties.as_ref().is_some_and(|p| p.topic_alias.is_some()) {
            return self
                .protocol_error(DisconnectReasonCode::TopicAliasInvalid, "a topic alias (we allow none)");
        }
        if publish.qos == QoS::AtMostOnce {
            return self.events.push_back(Event::Publish { arrival: None, publish: Box::new(publish) });
        }
        match self.incoming.arrive(publish.pkid, publish.qos) {
            Incoming::New(arrival) => {
                self.events.push_back(Event::Publish { arrival: Some(arrival), publish: Box::new(publish) })
            }
            Incoming::Again => {
                self.release_acks();
            }
        }
    }

    fn handle_pubrec(&mut self, rec: PubRec) {
        let code = pubrec_code(rec.reason);
        let Some(entry) = self.outgoing.get_mut(rec.pkid) else { return };
        if entry.publish.qos != QoS::ExactlyOnce || entry.stage != Stage::Sent {
            return;
        }
        if code >= 0x80 {
            return self.confirm(rec.pkid, QoS::ExactlyOnce, code);
        }
        entry.stage = Stage::ReleaseWaiting;
        if entry.hold_release {
            self.events.push_back(Event::Received { pkid: rec.pkid });
        }
        self.schedule();
    }

    /// The broker settled one of our publishes (`code` its reason).
    fn confirm(&mut self, pkid: u16, qos: QoS, code: u8) {
        let settles = |stage: Stage| match qos {
            QoS::ExactlyOnce => stage == Stage::Released || (code >= 0x80 && stage == Stage::Sent),
            _ => stage == Stage::Sent,
        };
        let Some(entry) = self.outgoing.get_mut(pkid) else { return };
        if entry.publish.qos != qos || !settles(entry.stage) {
            return;
        }
        let entry = self.outgoing.remove(pkid).expect("looked up above");
        if entry.holds_quota {
            self.send_quota += 1;
        }
        self.events.push_back(if code >= 0x80 {
            Event::Refused { pkid, reason: code }
        } else {
            Event::Delivered { pkid }
        });
        self.schedule();
    }

    /// Writes what the broker's quota allows, oldest first; one that must
    /// wait holds back those after it, so the order stays.
    fn schedule(&mut self) {
        if self.link != Link::Up {
            return;
        }
        for entry in self.outgoing.iter_mut() {
            let needs_quota =
                !entry.holds_quota && matches!(entry.stage, Stage::Waiting | Stage::ReleaseWaiting);
            if needs_quota {
                if self.send_quota == 0 {
                    break;
                }
                self.send_quota -= 1;
                entry.holds_quota = true;
            }
            match entry.stage {
                Stage::Waiting => {
                    let mut publish = entry.publish.clone();
                    publish.dup = entry.written;
                    entry.written = true;
                    entry.stage = Stage::Sent;
                    self.tx.push_back(Packet::Publish(publish));
                }
                Stage::ReleaseWaiting if entry.hold_release => {}
                Stage::ReleaseWaiting => {
                    entry.stage = Stage::Released;
                    self.tx.push_back(Packet::PubRel(PubRel::new(entry.publish.pkid, None)));
                }
                Stage::Sent | Stage::Released => {}
            }
        }
        // Replies now on their way release the acknowledgements behind them.
        self.release_acks();
    }

    /// Takes a publish to the broker. QoS 1 and 2 get their packet id now
    /// (answered) and go when the broker's quota allows, on this
    /// connection or the next; QoS 0 goes only on this one.
    pub fn publish(&mut self, publish: Publish) -> Result<u16, PublishError> {
        self.take_publish(publish, false)
    }

    /// `publish` for a QoS 2 publish a journal keeps: its PUBREC is
    /// reported (`Event::Received`) and its PUBREL waits for `release`.
    pub fn publish_held(&mut self, publish: Publish) -> Result<u16, PublishError> {
        self.take_publish(publish, true)
    }

    /// The journal recorded the PUBREC of our publish `pkid` (or will not):
    /// its PUBREL may go.
    pub fn release(&mut self, pkid: u16) {
        if let Some(entry) = self.outgoing.get_mut(pkid) {
            entry.hold_release = false;
            self.schedule();
        }
    }

    /// A publish of ours a journal kept from before a restart, with its
    /// packet id: it goes again (DUP) on the first connection and its
    /// PUBREC is reported as for `publish_held`, or its PUBREL goes once
    /// the broker had it (`released`). Called before the first `connect`,
    /// oldest first.
    pub fn restore(&mut self, publish: Publish, released: bool) {
        let stage = if released { Stage::ReleaseWaiting } else { Stage::Waiting };
        self.outgoing.insert(publish, stage, true, !released);
    }

    fn take_publish(&mut self, mut publish: Publish, hold_release: bool) -> Result<u16, PublishError> {
        publish.dup = false;
        downgrade(&mut publish, self.peer_max_qos);
        // We allow the broker no aliases, and use none.
        if let Some(properties) = publish.properties.as_mut() {
            properties.topic_alias = None;
        }
        publish.pkid = if publish.qos == QoS::AtMostOnce { 0 } else { 1 };
        let size = publish.size();
        let max = self.peer_max_packet.unwrap_or(MAX_PACKET);
        if size > max as usize {
            return Err(PublishError::TooLarge { size, max });
        }
        if let Some(reason) = self.refusal(&publish) {
            return Err(PublishError::Unsupported { reason });
        }
        if publish.qos == QoS::AtMostOnce {
            if self.link != Link::Up {
                return Err(PublishError::NotConnected);
            }
            self.tx.push_back(Packet::Publish(publish));
            return Ok(0);
        }
        let pkid = self.outgoing.free_pkid().ok_or(PublishError::NoPacketId)?;
        publish.pkid = pkid;
        let hold_release = hold_release && publish.qos == QoS::ExactlyOnce;
        self.outgoing.insert(publish, Stage::Waiting, false, hold_release);
        self.schedule();
        Ok(pkid)
    }

    /// Why the broker would refuse `publish` (its reason code), by what
    /// its CONNACK said.
    fn refusal(&self, publish: &Publish) -> Option<u8> {
        if self.peer_max_packet.is_some_and(|max| publish.size() > max as usize) {
            Some(0x95)
        } else if publish.qos as u8 > self.peer_max_qos as u8 {
            Some(0x9B)
        } else if publish.retain && !self.peer_retain {
            Some(0x9A)
        } else {
            None
        }
    }

    /// Subscribes on this connection (a new one subscribes again unless
    /// the broker kept the session): the packet id `Subscribed` will name.
    pub fn subscribe(&mut self, filters: Vec<Filter>) -> Option<u16> {
        if self.link != Link::Up || filters.is_empty() {
            return None;
        }
        let pkid = self.outgoing.free_pkid()?;
        self.outgoing.subscribe(pkid);
        let mut subscribe = Subscribe::new_many(filters, None);
        subscribe.pkid = pkid;
        self.tx.push_back(Packet::Subscribe(subscribe));
        Some(pkid)
    }

    /// Unsubscribes on this connection: the packet id `Unsubscribed` will
    /// name.
    pub fn unsubscribe(&mut self, filters: Vec<String>) -> Option<u16> {
        if self.link != Link::Up || filters.is_empty() {
            return None;
        }
        let pkid = self.outgoing.free_pkid()?;
        self.outgoing.subscribe(pkid);
        self.tx.push_back(Packet::Unsubscribe(Unsubscribe { pkid, filters, properties: None }));
        Some(pkid)
    }

    /// The application took a broker publish: its PUBACK or PUBREC goes
    /// once every earlier one's has.
    pub fn acknowledge(&mut self, arrival: Arrival) {
        self.acknowledge_after(arrival, None);
    }

    /// `acknowledge`, but not before our publish `reply` (a packet id
    /// `publish` gave) is written: the reply leaves ahead of the
    /// acknowledgement on this connection.
    pub fn acknowledge_after(&mut self, arrival: Arrival, reply: Option<u16>) {
        let outgoing = &self.outgoing;
        let acks = self.incoming.take(arrival, reply, |pkid| written(outgoing, pkid));
        for ack in acks {
            self.queue_ack(ack_packet(ack));
        }
    }

    /// The acknowledgements that may go now.
    fn release_acks(&mut self) {
        let outgoing = &self.outgoing;
        let acks = self.incoming.ready(|pkid| written(outgoing, pkid));
        for ack in acks {
            self.queue_ack(ack_packet(ack));
        }
    }

    /// Encodes every packet ready into `buf`, in order: the driver writes
    /// it in one go. Answers the bytes added.
    pub fn poll_transmit(&mut self, buf: &mut BytesMut) -> usize {
        // Nothing goes on a connection the session gave up on: what waits
        // is for the next one (acknowledgements owed, publishes again).
        if self.link == Link::Down {
            return 0;
        }
        let before = buf.len();
        while let Some(packet) = self.tx.pop_front() {
            // rumqttc counts CONNECT's flags byte from the buffer's start.
            debug_assert!(!matches!(packet, Packet::Connect(..)) || buf.is_empty());
            let start = buf.len();
            // Our own packets: within the sizes checked when taken.
            let _ = packet.write(buf, None);
            self.encoded += (buf.len() - start) as u64;
            if completes(&packet) {
                self.in_transit.push_back((self.encoded, packet));
            }
        }
        buf.len() - before
    }

    /// The driver wrote `bytes` more of what `poll_transmit` gave it: the
    /// acknowledgements in them are no longer owed, and the next PINGREQ
    /// is a keep alive away.
    pub fn wrote(&mut self, now: Instant, bytes: usize) {
        self.written += bytes as u64;
        while self.in_transit.front().is_some_and(|(end, _)| *end <= self.written) {
            self.in_transit.pop_front();
            self.unwritten_acks -= 1;
        }
        if bytes > 0 && self.link == Link::Up {
            self.arm_ping(now);
        }
    }

    fn queue_ack(&mut self, packet: Packet) {
        self.unwritten_acks += completes(&packet) as usize;
        self.tx.push_back(packet);
    }

    /// The DISCONNECT saying why the session closed the connection, once.
    pub fn poll_goodbye(&mut self, buf: &mut BytesMut) -> usize {
        let before = buf.len();
        if let Some(packet) = self.goodbye.take() {
            let _ = packet.write(buf, None);
        }
        buf.len() - before
    }

    /// Packets waiting for the driver: it stops reading past a bound, so a
    /// broker that does not read cannot grow them.
    pub fn queued(&self) -> usize {
        self.tx.len()
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether `poll_event` has more to give now.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// When `handle_timeout` next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        for timer in self.timers.expired(now) {
            match timer {
                Timer::ConnAck => self.close(Closed::ConnAckTimeout),
                Timer::PingResp => self.close(Closed::PingTimeout),
                Timer::Ping if self.link == Link::Up => {
                    self.tx.push_back(Packet::PingReq(PingReq));
                    // The first unanswered PINGREQ's deadline holds.
                    if !self.timers.is_set(Timer::PingResp) {
                        self.timers.set(Timer::PingResp, now + self.options.ping_timeout);
                    }
                }
                Timer::Ping => {}
            }
        }
    }

    /// Something was written: the next PINGREQ is a keep alive away.
    fn arm_ping(&mut self, now: Instant) {
        if !self.keep_alive.is_zero() {
            self.timers.set(Timer::Ping, now + self.keep_alive);
        }
    }

    fn protocol_error(&mut self, reason: DisconnectReasonCode, what: &'static str) {
        // With properties: rumqttc 0.25 writes a reason code without them
        // one byte longer than its remaining length says.
        let properties = DisconnectProperties {
            session_expiry_interval: None,
            reason_string: Some(what.to_string()),
            user_properties: Vec::new(),
            server_reference: None,
        };
        self.goodbye =
            Some(Packet::Disconnect(Disconnect { reason_code: reason, properties: Some(properties) }));
        self.close(Closed::Protocol(reason, what));
    }

    fn close(&mut self, why: Closed) {
        self.link = Link::Down;
        self.timers.stop_all();
        self.rx.clear();
        self.events.push_back(Event::Closed(why));
    }
}

/// A QoS 2 publish to a broker whose Maximum QoS is 1 (AWS IoT Core, Azure
/// Event Grid) goes at QoS 1, which is all it can take: at least once
/// instead of exactly once, rather than not at all.
fn downgrade(publish: &mut Publish, max_qos: QoS) {
    if publish.qos == QoS::ExactlyOnce && max_qos == QoS::AtLeastOnce {
        publish.qos = QoS::AtLeastOnce;
    }
}

/// The largest packet MQTT can frame (remaining length 268,435,455).
const MAX_PACKET: u32 = 268_435_455;

/// A DISCONNECT without properties, which rumqttc 0.25 cannot read: with
/// remaining length 0 it asks for a payload, with 1 for properties. Its
/// reason (`None`: not one MQTT defines); `None` for any other packet.
fn short_disconnect(frame: &[u8]) -> Option<Option<DisconnectReasonCode>> {
    match frame {
        [0xE0, 0] => Some(Some(DisconnectReasonCode::NormalDisconnection)),
        [0xE0, 1, reason] => Some(DisconnectReasonCode::try_from(*reason).ok()),
        _ => None,
    }
}

/// Whether our publish `pkid` has been queued to go on this connection
/// (after the packets before it), or is settled.
fn written(outgoing: &OutgoingTable, pkid: u16) -> bool {
    outgoing.get(pkid).is_none_or(|o| o.stage != Stage::Waiting)
}

/// A PUBACK, or a PUBCOMP that completes a publish: once written, the
/// broker's publish is no longer in flight.
fn completes(packet: &Packet) -> bool {
    match packet {
        Packet::PubAck(_) => true,
        Packet::PubComp(comp) => comp.reason == PubCompReason::Success,
        _ => false,
    }
}

fn ack_packet(ack: Ack) -> Packet {
    match ack {
        Ack::PubAck(pkid) => Packet::PubAck(PubAck::new(pkid, None)),
        Ack::PubRec(pkid) => Packet::PubRec(PubRec::new(pkid, None)),
    }
}

/// The reason codes of MQTT 5 (3.4.2.1), which rumqttc keeps as enums.
fn puback_code(reason: PubAckReason) -> u8 {
    match reason {
        PubAckReason::Success => 0x00,
        PubAckReason::NoMatchingSubscribers => 0x10,
        PubAckReason::UnspecifiedError => 0x80,
        PubAckReason::ImplementationSpecificError => 0x83,
        PubAckReason::NotAuthorized => 0x87,
        PubAckReason::TopicNameInvalid => 0x90,
        PubAckReason::PacketIdentifierInUse => 0x91,
        PubAckReason::QuotaExceeded => 0x97,
        PubAckReason::PayloadFormatInvalid => 0x99,
    }
}

fn pubrec_code(reason: PubRecReason) -> u8 {
    match reason {
        PubRecReason::Success => 0x00,
        PubRecReason::NoMatchingSubscribers => 0x10,
        PubRecReason::UnspecifiedError => 0x80,
        PubRecReason::ImplementationSpecificError => 0x83,
        PubRecReason::NotAuthorized => 0x87,
        PubRecReason::TopicNameInvalid => 0x90,
        PubRecReason::PacketIdentifierInUse => 0x91,
        PubRecReason::QuotaExceeded => 0x97,
        PubRecReason::PayloadFormatInvalid => 0x99,
    }
}
