//! The session against a scripted broker and a fake clock: exact packets
//! for each rule, then random interleavings (proptest) checked against the
//! rules a broker enforces. The helpers are the crate's, for the tests of
//! what sits on the session (`acks.rs`).

use super::*;
use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, ConnAckProperties, Packet, PingResp, PubAck, PubComp, PubCompReason, PubRec, PubRel, Publish,
    PublishProperties,
};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

fn options() -> Options {
    Options {
        client_id: "node".into(),
        keep_alive: Duration::from_secs(30),
        clean_start: true,
        session_expiry_s: 300,
        receive_maximum: 8,
        max_packet_size: 4096,
        connect_timeout: Duration::from_secs(10),
        ping_timeout: Duration::from_secs(5),
        login: None,
        will: None,
    }
}

fn connack(session_present: bool, receive_max: Option<u16>) -> Packet {
    let properties = ConnAckProperties {
        session_expiry_interval: None,
        receive_max,
        max_qos: None,
        retain_available: None,
        max_packet_size: None,
        assigned_client_identifier: None,
        topic_alias_max: None,
        reason_string: None,
        user_properties: Vec::new(),
        wildcard_subscription_available: None,
        subscription_identifiers_available: None,
        shared_subscription_available: None,
        server_keep_alive: None,
        response_information: None,
        server_reference: None,
        authentication_method: None,
        authentication_data: None,
    };
    Packet::ConnAck(ConnAck {
        session_present,
        code: ConnectReturnCode::Success,
        properties: Some(properties),
    })
}

fn bytes_of(packets: &[Packet]) -> BytesMut {
    let mut buf = BytesMut::new();
    for p in packets {
        p.write(&mut buf, None).unwrap();
    }
    buf
}

/// Everything the session writes now, decoded; and how many writes it took.
pub(crate) fn written(session: &mut Session, now: Instant) -> Vec<Packet> {
    let mut buf = BytesMut::new();
    let n = session.poll_transmit(&mut buf);
    session.wrote(now, n);
    decode_all(&mut buf)
}

fn goodbye(session: &mut Session) -> Vec<Packet> {
    let mut buf = BytesMut::new();
    session.poll_goodbye(&mut buf);
    decode_all(&mut buf)
}

fn decode_all(buf: &mut BytesMut) -> Vec<Packet> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        out.push(Packet::read(buf, None).expect("the session writes whole packets"));
    }
    out
}

pub(crate) fn events(session: &mut Session) -> Vec<Event> {
    std::iter::from_fn(|| session.poll_event()).collect()
}

pub(crate) fn feed(session: &mut Session, now: Instant, packets: &[Packet]) {
    session.handle_read(now, &bytes_of(packets));
}

fn publish(topic: &str, qos: QoS, payload: &str) -> Publish {
    Publish::new(topic, qos, payload.to_string(), None)
}

pub(crate) fn broker_publish(pkid: u16, qos: QoS, payload: &str) -> Packet {
    let mut p = publish("edgeinfer/node/infer/m", qos, payload);
    p.pkid = pkid;
    Packet::Publish(p)
}

/// What a resumed session sent, as (packet id, DUP, PUBLISH or PUBREL).
fn resent(packets: &[Packet]) -> Vec<(u16, bool, &'static str)> {
    packets
        .iter()
        .map(|p| match p {
            Packet::Publish(p) => (p.pkid, p.dup, "publish"),
            Packet::PubRel(r) => (r.pkid, false, "pubrel"),
            other => panic!("{other:?}"),
        })
        .collect()
}

pub(crate) fn up(receive_max: Option<u16>) -> (Session, Instant) {
    let now = Instant::now();
    let mut session = Session::new(options());
    session.connect(now);
    let first = written(&mut session, now);
    let Packet::Connect(connect, _, _) = &first[0] else { panic!("{first:?}") };
    let properties = connect.properties.as_ref().unwrap();
    assert!(connect.clean_start);
    assert_eq!(
        (properties.receive_maximum, properties.max_packet_size, properties.topic_alias_max),
        (Some(8), Some(4096), Some(0))
    );
    feed(&mut session, now, &[connack(false, receive_max)]);
    assert_eq!(events(&mut session), vec![Event::Connected { session_present: false }]);
    (session, now)
}

#[test]
fn acknowledgements_leave_in_arrival_order_whatever_order_requests_finish_in() {
    let (mut s, now) = up(None);
    feed(&mut s, now, &[broker_publish(7, QoS::AtLeastOnce, "a"), broker_publish(3, QoS::AtLeastOnce, "b")]);
    feed(&mut s, now, &[broker_publish(9, QoS::ExactlyOnce, "c")]);
    let arrivals: Vec<Arrival> = events(&mut s)
        .into_iter()
        .map(|e| match e {
            Event::Publish { arrival: Some(a), .. } => a,
            other => panic!("{other:?}"),
        })
        .collect();
    s.acknowledge(arrivals[2]);
    s.acknowledge(arrivals[1]);
    assert!(written(&mut s, now).is_empty(), "nothing before the first is taken");
    s.acknowledge(arrivals[0]);
    assert_eq!(
        written(&mut s, now),
        vec![
            Packet::PubAck(PubAck::new(7, None)),
            Packet::PubAck(PubAck::new(3, None)),
            Packet::PubRec(PubRec::new(9, None))
        ],
        "all three in one write, in arrival order"
    );
    // QoS 2: a PUBLISH sent again after PUBREC is answered PUBREC again,
    // not handed over; PUBREL completes; an unknown PUBREL gets 0x92.
    feed(&mut s, now, &[broker_publish(9, QoS::ExactlyOnce, "c")]);
    assert!(events(&mut s).is_empty());
    feed(&mut s, now, &[Packet::PubRel(PubRel::new(9, None)), Packet::PubRel(PubRel::new(44, None))]);
    let mut unknown = PubComp::new(44, None);
    unknown.reason = PubCompReason::PacketIdentifierNotFound;
    assert_eq!(
        written(&mut s, now),
        vec![
            Packet::PubRec(PubRec::new(9, None)),
            Packet::PubComp(PubComp::new(9, None)),
            Packet::PubComp(unknown)
        ]
    );
}

#[test]
fn publishes_wait_for_the_brokers_receive_maximum_and_keep_their_order() {
    let (mut s, now) = up(Some(2));
    let ids: Vec<u16> =
        (0..4).map(|i| s.publish(publish("r", QoS::AtLeastOnce, &i.to_string())).unwrap()).collect();
    let first = written(&mut s, now);
    assert_eq!(first.len(), 2, "{first:?}");
    feed(&mut s, now, &[Packet::PubAck(PubAck::new(ids[1], None))]);
    assert_eq!(events(&mut s), vec![Event::Delivered { pkid: ids[1] }]);
    let next = written(&mut s, now);
    assert!(matches!(&next[..], [Packet::Publish(p)] if p.pkid == ids[2] && p.payload == "2"), "{next:?}");
    assert_eq!(s.unconfirmed(), 3);
}

#[test]
fn a_resumed_session_sends_unconfirmed_publishes_again_in_order_marked_dup_under_the_same_ids() {
    let (mut s, now) = up(None);
    let q1 = s.publish(publish("r", QoS::AtLeastOnce, "one")).unwrap();
    let q2 = s.publish(publish("r", QoS::ExactlyOnce, "two")).unwrap();
    let q3 = s.publish(publish("r", QoS::ExactlyOnce, "three")).unwrap();
    assert_eq!(written(&mut s, now).len(), 3);
    feed(&mut s, now, &[Packet::PubRec(PubRec::new(q3, None))]);
    assert_eq!(written(&mut s, now), vec![Packet::PubRel(PubRel::new(q3, None))]);
    s.handle_closed();

    s.connect(now);
    let Packet::Connect(connect, ..) = &written(&mut s, now)[0] else { panic!() };
    assert!(!connect.clean_start, "a reconnect resumes the session");
    feed(&mut s, now, &[connack(true, None)]);
    let shape = resent(&written(&mut s, now));
    assert_eq!(shape, vec![(q1, true, "publish"), (q2, true, "publish"), (q3, false, "pubrel")]);

    // The broker lost the session: what it PUBREC'd it had; the rest goes
    // again as new messages.
    s.handle_closed();
    s.connect(now);
    written(&mut s, now);
    events(&mut s);
    feed(&mut s, now, &[connack(false, None)]);
    let evs = events(&mut s);
    assert_eq!(evs, vec![Event::Delivered { pkid: q3 }, Event::Connected { session_present: false }]);
    let fresh = written(&mut s, now);
    assert!(fresh.iter().all(|p| matches!(p, Packet::Publish(p) if !p.dup)) && fresh.len() == 2, "{fresh:?}");
}

/// Issue 36, exactly one reply across a kill -9: a QoS 2 publish a journal
/// keeps reports its PUBREC and holds its PUBREL until released (the
/// journal records the PUBREC first); a new process restores what the
/// journal kept under the same ids, a PUBLISH marked DUP or a PUBREL, and
/// gives new publishes other ids.
#[test]
fn a_held_publish_waits_for_its_release_and_a_restored_one_goes_again_under_its_id() {
    let (mut s, now) = up(None);
    let held = s.publish_held(publish("r", QoS::ExactlyOnce, "held")).unwrap();
    let plain = s.publish(publish("r", QoS::ExactlyOnce, "plain")).unwrap();
    assert_eq!(written(&mut s, now).len(), 2);
    feed(&mut s, now, &[Packet::PubRec(PubRec::new(held, None)), Packet::PubRec(PubRec::new(plain, None))]);
    assert_eq!(events(&mut s), vec![Event::Received { pkid: held }], "only the held one is reported");
    assert_eq!(written(&mut s, now), vec![Packet::PubRel(PubRel::new(plain, None))], "the held PUBREL waits");
    s.release(held);
    assert_eq!(written(&mut s, now), vec![Packet::PubRel(PubRel::new(held, None))]);
    feed(&mut s, now, &[Packet::PubComp(PubComp::new(held, None))]);
    assert_eq!(events(&mut s), vec![Event::Delivered { pkid: held }]);

    // A new process (the node's sessions never start clean): what the
    // journal kept, restored before connecting.
    let mut fresh = Session::new(Options { clean_start: false, ..options() });
    let mut sent = publish("r", QoS::ExactlyOnce, "sent");
    sent.pkid = 700;
    let mut released = publish("r", QoS::ExactlyOnce, "released");
    released.pkid = 701;
    fresh.restore(sent, false);
    fresh.restore(released, true);
    fresh.connect(now);
    written(&mut fresh, now);
    feed(&mut fresh, now, &[connack(true, None)]);
    assert_eq!(events(&mut fresh), vec![Event::Connected { session_present: true }]);
    let new = fresh.publish(publish("r", QoS::ExactlyOnce, "new")).unwrap();
    assert!(new != 700 && new != 701, "a restored id is not given again: {new}");
    let shape = resent(&written(&mut fresh, now));
    assert_eq!(shape, vec![(700, true, "publish"), (701, false, "pubrel"), (new, false, "publish")]);
    // A PUBCOMP 0x92 to the PUBREL (the broker completed it before the
    // crash) settles it all the same.
    let mut comp = PubComp::new(701, None);
    comp.reason = PubCompReason::PacketIdentifierNotFound;
    feed(&mut fresh, now, &[Packet::PubComp(comp)]);
    assert_eq!(events(&mut fresh), vec![Event::Delivered { pkid: 701 }]);
}

/// Found in review: a reply restored from a journal at QoS 2 went again at
/// QoS 2 to a broker that now takes QoS 1, which disconnects for it at
/// every reconnect. It goes at QoS 1, marked DUP.
#[test]
fn a_restored_qos_2_publish_goes_at_qos_1_to_a_broker_of_qos_1() {
    let now = Instant::now();
    let mut s = Session::new(Options { clean_start: false, ..options() });
    let mut restored = publish("r", QoS::ExactlyOnce, "restored");
    restored.pkid = 700;
    s.restore(restored, false);
    s.connect(now);
    written(&mut s, now);
    let Packet::ConnAck(mut limited) = connack(true, None) else { unreachable!() };
    limited.properties.as_mut().unwrap().max_qos = Some(1);
    feed(&mut s, now, &[Packet::ConnAck(limited)]);
    assert_eq!(events(&mut s), vec![Event::Connected { session_present: true }]);
    let sent = written(&mut s, now);
    assert!(
        matches!(&sent[..], [Packet::Publish(p)] if p.pkid == 700 && p.dup && p.qos == QoS::AtLeastOnce),
        "{sent:?}"
    );
}

#[test]
fn a_publish_sent_again_while_held_is_not_handed_over_twice_and_an_unwritten_puback_is_owed() {
    let (mut s, now) = up(None);
    feed(&mut s, now, &[broker_publish(5, QoS::AtLeastOnce, "x")]);
    let [Event::Publish { arrival: Some(arrival), .. }] = events(&mut s)[..] else { panic!() };
    let mut again = publish("edgeinfer/node/infer/m", QoS::AtLeastOnce, "x");
    (again.pkid, again.dup) = (5, true);
    feed(&mut s, now, &[Packet::Publish(again.clone())]);
    assert!(events(&mut s).is_empty(), "held: not handed over again");
    // Taken, but the connection dropped before its PUBACK was written.
    s.acknowledge(arrival);
    s.handle_closed();
    s.connect(now);
    assert!(matches!(&written(&mut s, now)[..], [Packet::Connect(..)]), "the PUBACK does not go unasked");
    feed(&mut s, now, &[connack(true, None)]);
    events(&mut s);
    feed(&mut s, now, &[Packet::Publish(again)]);
    assert!(events(&mut s).is_empty(), "the broker's re-send is answered, not handed over");
    assert_eq!(written(&mut s, now), vec![Packet::PubAck(PubAck::new(5, None))]);
}

#[test]
fn an_acknowledgement_waits_for_its_reply_to_be_written_and_unsubscribe_is_confirmed() {
    let (mut s, now) = up(Some(1));
    let first = s.publish(publish("r", QoS::AtLeastOnce, "first")).unwrap();
    written(&mut s, now);
    feed(&mut s, now, &[broker_publish(8, QoS::AtLeastOnce, "request")]);
    let [Event::Publish { arrival: Some(arrival), .. }] = events(&mut s)[..] else { panic!() };
    // Its reply waits for the broker's quota; so does its acknowledgement.
    let reply = s.publish(publish("r", QoS::AtLeastOnce, "reply")).unwrap();
    s.acknowledge_after(arrival, Some(reply));
    assert!(written(&mut s, now).is_empty());
    feed(&mut s, now, &[Packet::PubAck(PubAck::new(first, None))]);
    let out = written(&mut s, now);
    assert!(
        matches!(&out[..], [Packet::Publish(p), Packet::PubAck(a)] if p.pkid == reply && a.pkid == 8),
        "the reply, then the acknowledgement, in one write: {out:?}"
    );
    let id = s.unsubscribe(vec!["a/#".into()]).unwrap();
    assert!(
        matches!(&written(&mut s, now)[..], [Packet::Unsubscribe(u)] if u.pkid == id && u.filters == ["a/#"])
    );
    let reasons = vec![rumqttc::v5::mqttbytes::v5::UnsubAckReason::Success];
    let unsuback = rumqttc::v5::mqttbytes::v5::UnsubAck { pkid: id, reasons, properties: None };
    feed(&mut s, now, &[Packet::UnsubAck(unsuback)]);
    assert!(events(&mut s).contains(&Event::Unsubscribed { pkid: id }));
}

#[test]
fn keep_alive_pings_when_idle_and_a_missing_pingresp_closes_the_connection() {
    let (mut s, now) = up(None);
    let ping_at = s.poll_timeout().expect("the keep alive is armed");
    assert_eq!(ping_at, now + Duration::from_secs(30));
    s.handle_timeout(now + Duration::from_secs(29));
    assert!(written(&mut s, now).is_empty(), "an early call fires nothing");
    s.handle_timeout(ping_at);
    assert!(matches!(&written(&mut s, ping_at)[..], [Packet::PingReq(_)]));
    feed(&mut s, ping_at, &[Packet::PingResp(PingResp)]);
    let next = s.poll_timeout().unwrap();
    assert_eq!(
        next,
        ping_at + Duration::from_secs(30),
        "answered: the next ping a keep alive after the write"
    );
    s.handle_timeout(next);
    written(&mut s, next);
    s.handle_timeout(next + Duration::from_secs(5));
    assert_eq!(events(&mut s), vec![Event::Closed(Closed::PingTimeout)]);
    assert!(!s.is_connected());
}

#[test]
fn what_the_broker_gets_wrong_is_answered_with_a_disconnect_naming_it() {
    let cases: Vec<(Packet, DisconnectReasonCode)> = vec![
        (broker_publish(1, QoS::AtLeastOnce, &"x".repeat(5000)), DisconnectReasonCode::PacketTooLarge),
        (
            {
                let mut p = publish("t", QoS::AtMostOnce, "x");
                p.properties = Some(PublishProperties { topic_alias: Some(1), ..Default::default() });
                Packet::Publish(p)
            },
            DisconnectReasonCode::TopicAliasInvalid,
        ),
        (connack(true, None), DisconnectReasonCode::ProtocolError),
    ];
    for (packet, reason) in cases {
        let (mut s, now) = up(None);
        feed(&mut s, now, &[packet]);
        assert!(matches!(&events(&mut s)[..], [Event::Closed(Closed::Protocol(r, _))] if *r == reason));
        let out = goodbye(&mut s);
        assert!(matches!(&out[..], [Packet::Disconnect(d)] if d.reason_code == reason), "{out:?}");
    }
    // More in flight than our Receive Maximum (8): mosquitto 2.0 sends
    // them; taken (the node answers what it cannot run `overloaded`).
    let (mut s, now) = up(None);
    let nine: Vec<Packet> = (1..=9).map(|i| broker_publish(i, QoS::AtLeastOnce, "x")).collect();
    feed(&mut s, now, &nine);
    assert_eq!(events(&mut s).len(), 9, "all handed over, none refused");
    assert!(s.is_connected() && goodbye(&mut s).is_empty());
    assert_eq!(s.incoming_in_flight(), 9);
    // Bytes split anywhere read the same.
    let (mut s, now) = up(None);
    let bytes =
        bytes_of(&[broker_publish(2, QoS::AtLeastOnce, "split"), broker_publish(4, QoS::AtMostOnce, "z")]);
    for chunk in bytes.chunks(3) {
        s.handle_read(now, chunk);
    }
    assert_eq!(events(&mut s).len(), 2);
}

/// Review findings: an acknowledgement handed to the driver but not
/// written is owed like one never handed over; nothing held is
/// acknowledged between CONNECT and CONNACK.
#[test]
fn an_acknowledgement_not_written_or_taken_while_reconnecting_waits_for_the_brokers_resend() {
    let (mut s, now) = up(None);
    feed(&mut s, now, &[broker_publish(5, QoS::AtLeastOnce, "a"), broker_publish(6, QoS::AtLeastOnce, "b")]);
    let arrivals: Vec<Arrival> = events(&mut s)
        .into_iter()
        .filter_map(|e| match e {
            Event::Publish { arrival, .. } => arrival,
            _ => None,
        })
        .collect();
    s.acknowledge(arrivals[0]);
    // Handed to the driver, which wrote none of it before the drop.
    let mut buf = BytesMut::new();
    assert!(s.poll_transmit(&mut buf) > 0);
    s.handle_closed();
    s.connect(now);
    written(&mut s, now);
    // Taken while the broker has not yet said whether it kept the session.
    s.acknowledge(arrivals[1]);
    assert!(written(&mut s, now).is_empty(), "nothing before CONNACK");
    feed(&mut s, now, &[connack(true, None)]);
    assert!(written(&mut s, now).is_empty(), "nothing before the broker's re-sends");
    let resend = |pkid, text| {
        let mut p = publish("edgeinfer/node/infer/m", QoS::AtLeastOnce, text);
        (p.pkid, p.dup) = (pkid, true);
        Packet::Publish(p)
    };
    feed(&mut s, now, &[resend(5, "a"), resend(6, "b")]);
    assert!(events(&mut s).iter().all(|e| !matches!(e, Event::Publish { .. })), "neither handed over again");
    assert_eq!(
        written(&mut s, now),
        vec![Packet::PubAck(PubAck::new(5, None)), Packet::PubAck(PubAck::new(6, None))]
    );
}

#[test]
fn the_brokers_limits_and_its_short_disconnects_are_understood() {
    // A broker of QoS 1 and no retain (as AWS IoT Core): what it would
    // refuse is refused here, not sent for it to disconnect us over.
    let now = Instant::now();
    let mut s = Session::new(options());
    let waiting = s.publish(publish("r", QoS::ExactlyOnce, "2")).unwrap();
    s.connect(now);
    written(&mut s, now);
    let Packet::ConnAck(mut limited) = connack(false, None) else { unreachable!() };
    let properties = limited.properties.as_mut().unwrap();
    (properties.max_qos, properties.retain_available) = (Some(1), Some(0));
    feed(&mut s, now, &[Packet::ConnAck(limited)]);
    assert_eq!(events(&mut s), vec![Event::Connected { session_present: false }]);
    // QoS 2 goes at QoS 1, all such a broker takes (the node's replies
    // default to QoS 2): waiting ones and new ones, held or not.
    let later = s.publish_held(publish("r", QoS::ExactlyOnce, "x")).unwrap();
    let sent = written(&mut s, now);
    let qos: Vec<(u16, QoS)> = sent
        .iter()
        .filter_map(|p| match p {
            Packet::Publish(p) => Some((p.pkid, p.qos)),
            _ => None,
        })
        .collect();
    assert_eq!(qos, vec![(waiting, QoS::AtLeastOnce), (later, QoS::AtLeastOnce)]);
    feed(
        &mut s,
        now,
        &[Packet::PubAck(PubAck::new(waiting, None)), Packet::PubAck(PubAck::new(later, None))],
    );
    assert_eq!(events(&mut s), vec![Event::Delivered { pkid: waiting }, Event::Delivered { pkid: later }]);
    // A broker of QoS 0 takes neither.
    let (mut q0, now) = up(None);
    q0.handle_closed();
    q0.connect(now);
    written(&mut q0, now);
    let Packet::ConnAck(mut qos0) = connack(true, None) else { unreachable!() };
    qos0.properties.as_mut().unwrap().max_qos = Some(0);
    feed(&mut q0, now, &[Packet::ConnAck(qos0)]);
    events(&mut q0);
    assert_eq!(
        q0.publish(publish("r", QoS::ExactlyOnce, "x")),
        Err(PublishError::Unsupported { reason: 0x9B })
    );
    let mut retained = publish("r", QoS::AtLeastOnce, "x");
    retained.retain = true;
    assert_eq!(s.publish(retained), Err(PublishError::Unsupported { reason: 0x9A }));
    // PUBCOMP 0x92 to a PUBREL sent again: the broker had it (PUBREC heard).
    let (mut s, now) = up(None);
    let id = s.publish(publish("r", QoS::ExactlyOnce, "2")).unwrap();
    written(&mut s, now);
    feed(&mut s, now, &[Packet::PubRec(PubRec::new(id, None))]);
    written(&mut s, now);
    let mut comp = PubComp::new(id, None);
    comp.reason = PubCompReason::PacketIdentifierNotFound;
    feed(&mut s, now, &[Packet::PubComp(comp)]);
    assert_eq!(events(&mut s), vec![Event::Delivered { pkid: id }]);
    // DISCONNECT without properties, as mosquitto sends it.
    for (bytes, reason) in [
        (&[0xE0, 0x00][..], DisconnectReasonCode::NormalDisconnection),
        (&[0xE0, 0x01, 0x8E][..], DisconnectReasonCode::SessionTakenOver),
    ] {
        let (mut s, now) = up(None);
        s.handle_read(now, bytes);
        assert_eq!(events(&mut s), vec![Event::Closed(Closed::ByBroker(reason))]);
        assert!(goodbye(&mut s).is_empty(), "the broker closed: no DISCONNECT back");
    }
    // A session kept although we asked for a clean start.
    let mut s = Session::new(options());
    s.connect(now);
    written(&mut s, now);
    feed(&mut s, now, &[connack(true, None)]);
    assert!(matches!(
        &events(&mut s)[..],
        [Event::Closed(Closed::Protocol(DisconnectReasonCode::ProtocolError, _))]
    ));
}

/// A broker as the session's peer would be, with the rules it enforces
/// checked on every packet.
#[derive(Default)]
struct Broker {
    receive_max: u16,
    /// The session's publishes it holds unacknowledged, in arrival order.
    unacked_in: VecDeque<(u16, QoS)>,
    /// QoS 2 ids it holds from their PUBLISH until PUBREL.
    recd_in: HashSet<u16>,
    /// Of those, the ones sent on this connection: the Receive Maximum
    /// counts afresh on each connection [MQTT-4.9].
    recd_here: HashSet<u16>,
    /// Payloads it received (a QoS 2 re-send under a PUBREC'd id is not).
    received: Vec<Bytes>,
    /// Its publishes to the session, in the order sent, awaiting PUBACK or PUBREC.
    out: BTreeMap<u64, (u16, QoS, Bytes)>,
    /// Its QoS 2 ids PUBREC'd by the session, awaiting PUBCOMP.
    released_out: HashSet<u16>,
    next_order: u64,
    next_pkid: u16,
    /// Payloads whose acknowledgement was lost on the wire: the broker
    /// sends them again, and the session may take them twice.
    ack_lost: HashSet<Bytes>,
    /// Payloads the broker forgot with the session.
    forgotten: HashSet<Bytes>,
    /// The reply the session sends to each of the broker's publishes it
    /// answers: it must arrive before that publish's acknowledgement.
    reply_for: HashMap<Bytes, Bytes>,
    pending: Vec<Packet>,
}

impl Broker {
    fn take(&mut self, packet: Packet) -> Result<(), String> {
        match packet {
            Packet::Publish(p) if p.qos != QoS::AtMostOnce => {
                if self.unacked_in.iter().any(|(id, _)| *id == p.pkid) && !self.recd_in.contains(&p.pkid) {
                    if !p.dup {
                        return Err(format!("packet id {} reused while in flight", p.pkid));
                    }
                    return Ok(());
                }
                if p.qos == QoS::ExactlyOnce && self.recd_in.contains(&p.pkid) {
                    if !p.dup {
                        return Err(format!("packet id {} reused before its PUBREL", p.pkid));
                    }
                    // Held since it arrived (until PUBREL), whether or not
                    // its PUBREC got out: a re-send is the same message.
                    self.count_here(p.pkid)?;
                    if !self.unacked_in.iter().any(|(id, _)| *id == p.pkid) {
                        self.unacked_in.push_back((p.pkid, p.qos));
                    }
                    return Ok(());
                }
                if p.qos == QoS::ExactlyOnce {
                    self.count_here(p.pkid)?;
                    self.recd_in.insert(p.pkid);
                } else if self.in_flight_here() >= self.receive_max as usize {
                    return Err("the session exceeded the broker's Receive Maximum".into());
                }
                self.received.push(p.payload.clone());
                self.unacked_in.push_back((p.pkid, p.qos));
            }
            Packet::PubRel(r) => {
                self.recd_in.remove(&r.pkid);
                self.recd_here.remove(&r.pkid);
                self.pending.push(Packet::PubComp(PubComp::new(r.pkid, None)));
            }
            Packet::PubAck(a) => self.acked(a.pkid, QoS::AtLeastOnce)?,
            Packet::PubRec(r) => {
                self.acked(r.pkid, QoS::ExactlyOnce)?;
                self.released_out.insert(r.pkid);
                self.pending.push(Packet::PubRel(PubRel::new(r.pkid, None)));
            }
            Packet::PubComp(c) => {
                self.released_out.remove(&c.pkid);
            }
            Packet::PingReq(_) => self.pending.push(Packet::PingResp(PingResp)),
            _ => {}
        }
        Ok(())
    }

    /// The session's publishes this connection carries unacknowledged.
    fn in_flight_here(&self) -> usize {
        self.unacked_in.iter().filter(|(_, q)| *q == QoS::AtLeastOnce).count() + self.recd_here.len()
    }

    /// A QoS 2 publish on this connection, new or sent again: within the
    /// Receive Maximum.
    fn count_here(&mut self, pkid: u16) -> Result<(), String> {
        if !self.recd_here.contains(&pkid) && self.in_flight_here() >= self.receive_max as usize {
            return Err("the session exceeded the broker's Receive Maximum".into());
        }
        self.recd_here.insert(pkid);
        Ok(())
    }

    /// [MQTT-4.6.0-2/3]: acknowledgements in the order the publishes went.
    fn acked(&mut self, pkid: u16, qos: QoS) -> Result<(), String> {
        let Some((&order, &(front, front_qos, _))) = self.out.iter().next() else {
            return Err(format!("an acknowledgement for {pkid} with nothing in flight"));
        };
        if front != pkid || front_qos != qos {
            return Err(format!("acknowledged {pkid} before {front}"));
        }
        let payload = &self.out[&order].2;
        if let Some(reply) = self.reply_for.get(payload)
            && !self.received.contains(reply)
        {
            return Err(format!("{payload:?} acknowledged before its reply"));
        }
        self.out.remove(&order);
        Ok(())
    }

    fn send(&mut self, qos: QoS, payload: Bytes) -> Option<Packet> {
        if self.out.len() + self.released_out.len() >= 8 {
            return None;
        }
        let used = |id: u16| self.out.values().any(|(p, ..)| *p == id) || self.released_out.contains(&id);
        loop {
            self.next_pkid = self.next_pkid.checked_add(1).unwrap_or(1);
            if !used(self.next_pkid) {
                break;
            }
        }
        self.out.insert(self.next_order, (self.next_pkid, qos, payload.clone()));
        self.next_order += 1;
        let mut p = Publish::new("edgeinfer/node/infer/m", qos, payload, None);
        p.pkid = self.next_pkid;
        Some(Packet::Publish(p))
    }

    /// The session reconnected: resume (send again, in order, DUP) or forget.
    fn resume(&mut self, session_present: bool) -> Vec<Packet> {
        self.pending.clear();
        self.recd_here.clear();
        if !session_present {
            self.forgotten.extend(self.out.values().map(|(_, _, b)| b.clone()));
            self.out.clear();
            self.released_out.clear();
            self.unacked_in.clear();
            self.recd_in.clear();
            return Vec::new();
        }
        // What it had not acknowledged, it never will: the session sends it again.
        self.unacked_in.clear();
        let mut again: Vec<Packet> = self
            .out
            .values()
            .map(|(pkid, qos, payload)| {
                let mut p = Publish::new("edgeinfer/node/infer/m", *qos, payload.clone(), None);
                (p.pkid, p.dup) = (*pkid, true);
                Packet::Publish(p)
            })
            .collect();
        again.extend(self.released_out.iter().map(|id| Packet::PubRel(PubRel::new(*id, None))));
        again
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// QoS 1, or QoS 2: a node with a journal journals every QoS 2 publish
    /// of its own connection (a reply, a follow-up) and holds its PUBREL.
    AppPublish(bool),
    /// The journal is written: the PUBRELs it held may go.
    JournalWritten,
    /// The process dies (kill -9), losing the last n packets on the wire,
    /// and a new one starts from the journal; the broker kept the session.
    Restart {
        lost: usize,
    },
    BrokerPublish(bool),
    /// The application takes the n-th arrival it holds.
    AppTakes(usize),
    /// The wire delivers what the session wrote, and the broker answers.
    Deliver,
    /// The connection drops, losing the last n packets on the wire.
    Drop {
        lost: usize,
        session_present: bool,
    },
    Tick(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<bool>().prop_map(Op::AppPublish),
        2 => Just(Op::JournalWritten),
        1 => (0usize..4).prop_map(|lost| Op::Restart { lost }),
        3 => any::<bool>().prop_map(Op::BrokerPublish),
        3 => (0usize..8).prop_map(Op::AppTakes),
        4 => Just(Op::Deliver),
        1 => (0usize..4, proptest::bool::weighted(0.8)).prop_map(|(lost, session_present)| Op::Drop { lost, session_present }),
        1 => (0u8..40).prop_map(Op::Tick),
    ]
}

struct World {
    session: Session,
    broker: Broker,
    now: Instant,
    /// Packets the session wrote that the broker has not read.
    wire: VecDeque<Packet>,
    held: Vec<(Arrival, Bytes)>,
    handed: HashMap<Bytes, usize>,
    pkid_payload: HashMap<u16, Bytes>,
    confirmed: HashMap<Bytes, usize>,
    /// What the journal holds: each journaled publish not yet confirmed,
    /// in order, and whether its PUBREC was recorded.
    journal: Vec<(u16, Bytes, bool)>,
    journaled: HashSet<Bytes>,
    /// Journaled publishes in flight when the broker lost the session: it
    /// takes them again as new messages (at least once, as documented).
    at_least_once: HashSet<Bytes>,
    /// PUBRECs recorded, to release once the journal is written.
    to_release: Vec<u16>,
    /// Publishes confirmed, recorded at the next write (by what they carry:
    /// a packet id is free for the next publish once confirmed).
    to_answer: Vec<Bytes>,
    next: u64,
}

impl World {
    fn new(receive_max: u16) -> World {
        let mut w = World {
            session: Session::new(options()),
            broker: Broker { receive_max, ..Broker::default() },
            now: Instant::now(),
            wire: VecDeque::new(),
            held: Vec::new(),
            handed: HashMap::new(),
            pkid_payload: HashMap::new(),
            confirmed: HashMap::new(),
            journal: Vec::new(),
            journaled: HashSet::new(),
            at_least_once: HashSet::new(),
            to_release: Vec::new(),
            to_answer: Vec::new(),
            next: 0,
        };
        w.reconnect(false).unwrap();
        w
    }

    fn pump(&mut self) -> Result<(), String> {
        let mut buf = BytesMut::new();
        let n = self.session.poll_transmit(&mut buf);
        self.session.wrote(self.now, n);
        self.wire.extend(decode_all(&mut buf));
        while let Some(event) = self.session.poll_event() {
            match event {
                Event::Publish { arrival: Some(a), publish } => {
                    let n = self.handed.entry(publish.payload.clone()).or_default();
                    *n += 1;
                    if *n > 1 && !self.broker.ack_lost.contains(&publish.payload) {
                        return Err(format!("{:?} handed over twice", publish.payload));
                    }
                    self.held.push((a, publish.payload));
                }
                Event::Delivered { pkid } => {
                    let payload = self.pkid_payload.remove(&pkid).ok_or(format!("{pkid} delivered twice"))?;
                    *self.confirmed.entry(payload.clone()).or_default() += 1;
                    self.to_answer.push(payload);
                }
                Event::Received { pkid } => {
                    if !self.journal.iter().any(|(id, ..)| *id == pkid) {
                        return Err(format!("PUBREC of {pkid} reported, not journaled"));
                    }
                    self.to_release.push(pkid);
                }
                Event::Closed(_) => self.drop_connection(0, true)?,
                _ => {}
            }
        }
        Ok(())
    }

    fn reconnect(&mut self, session_present: bool) -> Result<(), String> {
        self.wire.clear();
        self.session.connect(self.now);
        self.pump()?;
        self.wire.clear();
        let again = self.broker.resume(session_present);
        feed(&mut self.session, self.now, &[connack(session_present, Some(self.broker.receive_max))]);
        if !session_present {
            self.held.clear();
        }
        feed(&mut self.session, self.now, &again);
        self.pump()
    }

    fn drop_connection(&mut self, lost: usize, session_present: bool) -> Result<(), String> {
        // The last `lost` packets never reached the broker.
        let keep = self.wire.len().saturating_sub(lost);
        let gone: Vec<Packet> = self.wire.drain(keep..).collect();
        for packet in gone {
            if let Packet::PubAck(PubAck { pkid, .. }) | Packet::PubRec(PubRec { pkid, .. }) = packet
                && let Some((.., b)) = self.broker.out.values().find(|(p, ..)| *p == pkid)
            {
                self.broker.ack_lost.insert(b.clone());
            }
        }
        self.deliver()?;
        self.session.handle_closed();
        if !session_present {
            self.at_least_once.extend(self.journal.iter().map(|(_, b, _)| b.clone()));
        }
        self.reconnect(session_present)
    }

    /// The journal's buffer is written: confirmations and PUBRECs recorded
    /// are on disk, and the PUBRELs held for them may go.
    fn journal_written(&mut self) {
        let answered = std::mem::take(&mut self.to_answer);
        self.journal.retain(|(_, b, _)| !answered.contains(b));
        for pkid in std::mem::take(&mut self.to_release) {
            if let Some(entry) = self.journal.iter_mut().find(|(id, ..)| *id == pkid) {
                entry.2 = true;
            }
            self.session.release(pkid);
        }
    }

    /// kill -9 and a new process: the last `lost` packets never left; the
    /// new session holds only what the journal kept, under the same ids
    /// (the rest in flight died with the process, unconfirmed); the broker
    /// sends its unacknowledged publishes again, and the new process may
    /// take them again (the node's request journal tells those apart).
    fn restart(&mut self, lost: usize) -> Result<(), String> {
        let keep = self.wire.len().saturating_sub(lost);
        self.wire.truncate(keep);
        self.deliver()?;
        self.session = Session::new(Options { clean_start: false, ..options() });
        for (pkid, payload, released) in &self.journal {
            let mut publish = Publish::new("r", QoS::ExactlyOnce, payload.clone(), None);
            publish.pkid = *pkid;
            self.session.restore(publish, *released);
        }
        // What the journal holds is owed again (its confirmation may come
        // a second time, harmlessly); the rest died with the process.
        self.pkid_payload = self.journal.iter().map(|(pkid, b, _)| (*pkid, b.clone())).collect();
        self.to_release.clear();
        self.to_answer.clear();
        self.held.clear();
        // The broker's publishes not acknowledged come again to a process
        // that knows nothing of the replies the dead one sent for them.
        let resent = self.broker.out.values().map(|(.., b)| b.clone()).collect::<Vec<_>>();
        self.broker.reply_for.retain(|b, _| !resent.contains(b));
        self.broker.ack_lost.extend(resent);
        self.reconnect(true)
    }

    fn deliver(&mut self) -> Result<(), String> {
        while let Some(packet) = self.wire.pop_front() {
            self.broker.take(packet)?;
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), String> {
        match op {
            Op::AppPublish(false) => {
                let payload = Bytes::from(format!("m{}", self.next));
                self.next += 1;
                let publish = Publish::new("r", QoS::AtLeastOnce, payload.clone(), None);
                let pkid = self.session.publish(publish).unwrap();
                if self.pkid_payload.insert(pkid, payload).is_some() {
                    return Err(format!("packet id {pkid} given twice"));
                }
            }
            Op::BrokerPublish(qos2) => {
                let qos = if qos2 { QoS::ExactlyOnce } else { QoS::AtLeastOnce };
                let payload = Bytes::from(format!("b{}", self.next));
                self.next += 1;
                if let Some(p) = self.broker.send(qos, payload) {
                    feed(&mut self.session, self.now, &[p]);
                }
            }
            Op::AppTakes(n) => {
                if !self.held.is_empty() {
                    let (arrival, payload) = self.held.remove(n % self.held.len());
                    if n % 2 == 0 {
                        self.session.acknowledge(arrival);
                    } else {
                        // Answered: the reply goes ahead of the acknowledgement.
                        let reply = format!("reply {} to {}", self.next, String::from_utf8_lossy(&payload));
                        let reply = Bytes::from(reply);
                        self.next += 1;
                        let pkid = self
                            .session
                            .publish(Publish::new("r", QoS::AtLeastOnce, reply.clone(), None))
                            .unwrap();
                        self.pkid_payload.insert(pkid, reply.clone());
                        self.broker.reply_for.insert(payload, reply);
                        self.session.acknowledge_after(arrival, Some(pkid));
                    }
                }
            }
            Op::Deliver => {
                self.deliver()?;
                // The broker acknowledges what it holds, in order.
                while let Some((pkid, qos)) = self.broker.unacked_in.pop_front() {
                    self.broker.pending.push(match qos {
                        QoS::ExactlyOnce => {
                            self.broker.recd_in.insert(pkid);
                            Packet::PubRec(PubRec::new(pkid, None))
                        }
                        _ => Packet::PubAck(PubAck::new(pkid, None)),
                    });
                }
                let answers = std::mem::take(&mut self.broker.pending);
                feed(&mut self.session, self.now, &answers);
            }
            Op::Drop { lost, session_present } => self.drop_connection(lost, session_present)?,
            Op::AppPublish(true) => {
                // Its record goes in the one ordered log: whatever was
                // recorded before it is written with it.
                self.journal_written();
                let payload = Bytes::from(format!("j{}", self.next));
                self.next += 1;
                let publish = Publish::new("r", QoS::ExactlyOnce, payload.clone(), None);
                let pkid = self.session.publish_held(publish).unwrap();
                if self.pkid_payload.insert(pkid, payload.clone()).is_some() {
                    return Err(format!("packet id {pkid} given twice"));
                }
                self.journal.push((pkid, payload.clone(), false));
                self.journaled.insert(payload);
            }
            Op::JournalWritten => self.journal_written(),
            Op::Restart { lost } => self.restart(lost)?,
            Op::Tick(secs) => {
                self.now += Duration::from_secs(secs.into());
                self.session.handle_timeout(self.now);
            }
        }
        self.pump()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Issue 36: no interleaving of publishes both ways, acknowledgements in
    /// any order, lost packets, drops, resumed or lost sessions, restarts
    /// from the journal and timers makes the session reuse a packet id,
    /// exceed the broker's Receive Maximum, acknowledge out of order, hand
    /// a message over twice (but where its acknowledgement was lost on the
    /// wire or the process died) or lose one; and a journaled publish
    /// reaches the broker exactly once across restarts.
    #[test]
    fn random_interleavings_keep_every_rule_and_lose_nothing(
        receive_max in 1u16..6,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut w = World::new(receive_max);
        for op in ops {
            w.apply(op.clone()).map_err(|e| TestCaseError::fail(format!("{op:?}: {e}")))?;
        }
        // Quiet: the application takes everything, the wire delivers.
        for _ in 0..64 {
            while let Some((arrival, _)) = w.held.pop() {
                w.session.acknowledge(arrival);
            }
            w.apply(Op::JournalWritten).map_err(TestCaseError::fail)?;
            w.apply(Op::Deliver).map_err(TestCaseError::fail)?;
        }
        // Exactly once: each journaled publish reached the broker once,
        // however many times the process died around it.
        for payload in w.journaled.difference(&w.at_least_once) {
            let n = w.broker.received.iter().filter(|b| *b == payload).count();
            prop_assert!(n == 1, "{payload:?} received {n} times");
        }
        prop_assert!(w.pkid_payload.is_empty(), "unconfirmed: {:?}", w.pkid_payload);
        prop_assert!(w.confirmed.iter().all(|(b, n)| *n == 1 || w.journaled.contains(b)));
        prop_assert!(w.journaled.iter().all(|b| w.confirmed.contains_key(b)), "a journaled one unconfirmed");
        let sent: HashSet<&Bytes> = w.broker.received.iter().collect();
        prop_assert!(w.confirmed.keys().all(|b| sent.contains(b)), "confirmed but never received");
        prop_assert!(w.broker.out.values().all(|(_, _, b)| w.handed.contains_key(b)));
        for (payload, n) in &w.handed {
            prop_assert!(*n == 1 || w.broker.ack_lost.contains(payload), "{payload:?} {n}");
        }
        prop_assert!(w.broker.out.is_empty(), "the broker still waits for {:?}", w.broker.out);
    }
}
