//! The session's two tables of QoS 1 and 2 publishes: ours on their way to
//! the broker (packet ids, order, the broker's Receive Maximum) and the
//! broker's on their way to us (acknowledged in arrival order, QoS 2 ids
//! held until PUBREL). Plain data: `state.rs` drives them.

use super::Arrival;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Publish;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

/// Where one of our publishes stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Not written on this connection: waiting for a connection, the
    /// broker's quota, or (after a resume) its turn to be sent again.
    Waiting,
    /// PUBLISH written; PUBACK (QoS 1) or PUBREC (QoS 2) not yet heard.
    Sent,
    /// QoS 2: PUBREC heard, PUBREL owed (not written on this connection).
    ReleaseWaiting,
    /// QoS 2: PUBREL written, PUBCOMP not yet heard.
    Released,
}

#[derive(Debug, Clone)]
pub struct Outgoing {
    pub publish: Publish,
    pub stage: Stage,
    /// Counted against the broker's Receive Maximum on this connection.
    pub holds_quota: bool,
    /// Written once already, on this connection or an earlier one: a
    /// re-send is marked DUP.
    pub written: bool,
    /// QoS 2 held for a journal: its PUBREL waits for `Session::release`
    /// (the journal must record the PUBREC first, or a restart would send
    /// the PUBLISH again after the broker let its id go).
    pub hold_release: bool,
}

/// Our QoS 1 and 2 publishes, in the order they were handed over.
#[derive(Debug, Default)]
pub struct OutgoingTable {
    by_order: BTreeMap<u64, Outgoing>,
    order_of: HashMap<u16, u64>,
    next_order: u64,
    next_pkid: u16,
    /// Packet ids of SUBSCRIBEs and UNSUBSCRIBEs awaiting their SUBACK or
    /// UNSUBACK: the same id space.
    subscribing: HashSet<u16>,
}

impl OutgoingTable {
    pub fn len(&self) -> usize {
        self.by_order.len()
    }

    /// A packet id no publish or subscribe of ours holds, if there is one.
    pub fn free_pkid(&mut self) -> Option<u16> {
        if self.by_order.len() + self.subscribing.len() >= u16::MAX as usize {
            return None;
        }
        loop {
            self.next_pkid = self.next_pkid.checked_add(1).unwrap_or(1);
            let pkid = self.next_pkid;
            if !self.order_of.contains_key(&pkid) && !self.subscribing.contains(&pkid) {
                return Some(pkid);
            }
        }
    }

    /// Takes a publish whose packet id came from `free_pkid` (or was kept
    /// from before a restart, at `stage`): it waits its turn.
    pub fn insert(&mut self, publish: Publish, stage: Stage, written: bool, hold_release: bool) {
        let order = self.next_order;
        self.next_order += 1;
        self.order_of.insert(publish.pkid, order);
        let outgoing = Outgoing { publish, stage, holds_quota: false, written, hold_release };
        self.by_order.insert(order, outgoing);
    }

    pub fn get(&self, pkid: u16) -> Option<&Outgoing> {
        self.by_order.get(self.order_of.get(&pkid)?)
    }

    pub fn get_mut(&mut self, pkid: u16) -> Option<&mut Outgoing> {
        let order = self.order_of.get(&pkid)?;
        self.by_order.get_mut(order)
    }

    pub fn remove(&mut self, pkid: u16) -> Option<Outgoing> {
        let order = self.order_of.remove(&pkid)?;
        self.by_order.remove(&order)
    }

    pub fn subscribe(&mut self, pkid: u16) {
        self.subscribing.insert(pkid);
    }

    pub fn subscribed(&mut self, pkid: u16) -> bool {
        self.subscribing.remove(&pkid)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Outgoing> {
        self.by_order.values()
    }

    /// Every entry, oldest first.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Outgoing> {
        self.by_order.values_mut()
    }

    /// Forgets the SUBACKs owed on a connection that is gone.
    pub fn forget_subscribes(&mut self) {
        self.subscribing.clear();
    }

    /// Removes every entry `drop` says goes; answers their packet ids.
    pub fn remove_where(&mut self, drop: impl Fn(&Outgoing) -> bool) -> Vec<u16> {
        let gone: Vec<u64> = self.by_order.iter().filter(|(_, o)| drop(o)).map(|(k, _)| *k).collect();
        gone.into_iter()
            .filter_map(|k| self.by_order.remove(&k))
            .map(|o| {
                self.order_of.remove(&o.publish.pkid);
                o.publish.pkid
            })
            .collect()
    }
}

/// One of the broker's QoS 1 or 2 publishes, in arrival order.
#[derive(Debug)]
struct Held {
    arrival: Arrival,
    pkid: u16,
    qos: QoS,
    /// The application took it: its acknowledgement may go once those
    /// before it have.
    taken: bool,
    /// Held across a resume: the broker sends it again, and where that
    /// comes in its re-sends decides its place in line.
    resend_due: bool,
    /// Our publish (its reply) that must be written before this
    /// acknowledgement: a node that dies between the two leaves the
    /// request with the broker, not answered by no one.
    after: Option<u16>,
}

/// What an arrival became when the application took it.
#[derive(Debug, PartialEq, Eq)]
pub enum Ack {
    PubAck(u16),
    PubRec(u16),
}

/// The broker's publishes not yet acknowledged, and its QoS 2 ids between
/// our PUBREC and its PUBREL.
#[derive(Debug, Default)]
pub struct IncomingTable {
    held: VecDeque<Held>,
    /// Packet ids of `held`: a publish with one of them is a re-send of
    /// the same message (its id stays the broker's until we acknowledge).
    holding: HashSet<u16>,
    awaiting_release: HashSet<u16>,
    /// QoS 1 ids whose PUBACK the last connection never wrote: the broker
    /// sends the PUBLISH again on resuming, and gets its PUBACK then.
    owed_puback: HashSet<u16>,
    next_arrival: u64,
}

/// What a new publish from the broker is to the session.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    /// New: the application gets it.
    New(Arrival),
    /// A re-send of one the application holds or took: its
    /// acknowledgement comes in its turn.
    Again,
}

impl IncomingTable {
    /// Publishes counted against our Receive Maximum, as the broker counts
    /// them: held, QoS 2 awaiting PUBREL, or with a PUBACK owed.
    pub fn in_flight(&self) -> usize {
        self.held.len() + self.awaiting_release.len() + self.owed_puback.len()
    }

    /// A publish of the broker's: new, or a re-send of one we have. Past
    /// our Receive Maximum it is taken all the same: mosquitto 2.0 does not
    /// keep to it, and refusing it (DISCONNECT 0x93, as MQTT 5 would have
    /// it) only loops; the node's admission answers what it cannot take
    /// `overloaded`, and the broker's packet ids bound the table.
    pub fn arrive(&mut self, pkid: u16, qos: QoS) -> Incoming {
        if self.holding.contains(&pkid) {
            // Sent again on resuming, in the broker's order, which is the
            // order it wants the acknowledgements in (one whose first
            // acknowledgement was lost on the wire may now come first).
            // A copy on the same connection keeps its place.
            let at = self.held.iter().position(|h| h.pkid == pkid).expect("holding mirrors held");
            if self.held[at].resend_due {
                let mut held = self.held.remove(at).expect("found above");
                held.resend_due = false;
                self.held.push_back(held);
            }
            return Incoming::Again;
        }
        // One the application took whose PUBREC, or PUBACK never written,
        // the broker did not get: acknowledged again in its turn.
        let taken = match qos {
            QoS::ExactlyOnce => self.awaiting_release.remove(&pkid),
            _ => self.owed_puback.remove(&pkid),
        };
        let arrival = Arrival(self.next_arrival);
        self.next_arrival += 1;
        self.holding.insert(pkid);
        self.held.push_back(Held { arrival, pkid, qos, taken, resend_due: false, after: None });
        if taken { Incoming::Again } else { Incoming::New(arrival) }
    }

    /// The application took `arrival`: answers the acknowledgements that
    /// now may go, in arrival order. One not held (from a session the
    /// broker lost, or taken twice) releases nothing.
    pub fn take(&mut self, arrival: Arrival, after: Option<u16>, written: impl Fn(u16) -> bool) -> Vec<Ack> {
        if let Some(held) = self.held.iter_mut().find(|h| h.arrival == arrival) {
            (held.taken, held.after) = (true, after);
        }
        self.ready(written)
    }

    /// The acknowledgements the front of the line lets go; `written` says
    /// whether one of our publishes has been written.
    pub fn ready(&mut self, written: impl Fn(u16) -> bool) -> Vec<Ack> {
        let mut acks = Vec::new();
        while self.held.front().is_some_and(|h| h.taken && !h.resend_due && h.after.is_none_or(&written)) {
            let held = self.held.pop_front().expect("looked at the front");
            self.holding.remove(&held.pkid);
            if held.qos == QoS::ExactlyOnce {
                self.awaiting_release.insert(held.pkid);
                acks.push(Ack::PubRec(held.pkid));
            } else {
                acks.push(Ack::PubAck(held.pkid));
            }
        }
        acks
    }

    /// PUBREL: true if the id was awaiting it (PUBCOMP success), false if
    /// not (PUBCOMP 0x92, packet identifier not found).
    pub fn release(&mut self, pkid: u16) -> bool {
        self.awaiting_release.remove(&pkid)
    }

    pub fn owe_puback(&mut self, pkid: u16) {
        if !self.holding.contains(&pkid) {
            self.owed_puback.insert(pkid);
        }
    }

    /// A PUBCOMP never written: the id awaits the PUBREL sent again.
    pub fn owe_pubcomp(&mut self, pkid: u16) {
        self.awaiting_release.insert(pkid);
    }

    /// The broker kept our session: it sends again every publish we hold.
    pub fn resume(&mut self) {
        for held in &mut self.held {
            held.resend_due = true;
        }
    }

    /// The broker lost our session: its packet ids mean nothing now.
    pub fn clear(&mut self) {
        self.held.clear();
        self.holding.clear();
        self.awaiting_release.clear();
        self.owed_puback.clear();
    }
}
