//! Issue 36, stage 1: the session layer of our own (`transport::mqtt::session`)
//! on a socket against both real brokers: QoS 1 and 2 both ways, a burst
//! written in few writes, acknowledgements released in arrival order
//! however the requests finish (rumqttd disconnects a client that breaks
//! it), and a resumed session getting what the broker kept for it.

use super::support::{Mosquitto, free_port_pair};
use edgeinfer::transport::mqtt::session::{Arrival, Driver, Event, Options, Session};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, Publish};
use std::time::Duration;

fn driver(port: u16, client_id: &str) -> Driver {
    let options = Options {
        client_id: client_id.into(),
        keep_alive: Duration::from_secs(30),
        // As the node: rumqttd keeps a session only for a client that
        // connected without a clean start.
        clean_start: false,
        session_expiry_s: 300,
        receive_maximum: 64,
        max_packet_size: 1 << 20,
        connect_timeout: Duration::from_secs(10),
        ping_timeout: Duration::from_secs(10),
        login: None,
        will: None,
    };
    Driver::new(Session::new(options), "127.0.0.1".into(), port, None)
}

async fn next(d: &mut Driver) -> Event {
    tokio::time::timeout(Duration::from_secs(10), d.next()).await.expect("an event within 10 s")
}

async fn connected(d: &mut Driver) -> bool {
    d.connect().await.expect("the broker takes the connection");
    match next(d).await {
        Event::Connected { session_present } => session_present,
        other => panic!("{other:?}"),
    }
}

/// Runs `d` until `n` publishes arrive; answers them in arrival order.
async fn receive(d: &mut Driver, n: usize) -> Vec<(Option<Arrival>, Publish)> {
    let mut got = Vec::new();
    while got.len() < n {
        match next(d).await {
            Event::Publish { arrival, publish } => got.push((arrival, *publish)),
            Event::Closed(why) => panic!("closed: {why:?}"),
            _ => {}
        }
    }
    got
}

/// Lets `d` run for `how_long`, answering every event; panics if it closes.
async fn settle(d: &mut Driver, how_long: Duration) -> Vec<Event> {
    let mut events = Vec::new();
    let _ = tokio::time::timeout(how_long, async {
        loop {
            let event = d.next().await;
            assert!(!matches!(event, Event::Closed(_)), "{event:?}");
            events.push(event);
        }
    })
    .await;
    events
}

async fn exercise(port: u16, broker: &str) {
    let mut device = driver(port, &format!("{broker}-device"));
    let mut node = driver(port, &format!("{broker}-node"));
    assert!(!connected(&mut node).await, "a new client has no session");
    node.session().subscribe(vec![Filter::new("s/#", QoS::ExactlyOnce)]).unwrap();
    assert!(matches!(next(&mut node).await, Event::Subscribed { .. }));
    connected(&mut device).await;

    // A burst of 20, QoS 1 and 2 alternately: few writes, all confirmed.
    let before = device.writes();
    let mut ids = Vec::new();
    for i in 0..20 {
        let qos = if i % 2 == 0 { QoS::AtLeastOnce } else { QoS::ExactlyOnce };
        ids.push(device.session().publish(Publish::new("s/x", qos, format!("m{i}"), None)).unwrap());
    }
    let mut delivered = 0;
    while delivered < 20 {
        match next(&mut device).await {
            Event::Delivered { .. } => delivered += 1,
            other => assert!(!matches!(other, Event::Closed(_)), "{other:?}"),
        }
    }
    // Everything ready at a wakeup goes in one write: the 20 PUBLISHes, then
    // the PUBRELs as the PUBRECs come back.
    let writes = device.writes() - before;
    eprintln!("{broker}: 20 publishes and 10 PUBRELs in {writes} writes");
    assert!(writes <= 12, "{broker}: {writes} writes for 30 packets");

    // The node takes them last first; the acknowledgements still go in
    // arrival order (rumqttd would disconnect it otherwise).
    let got = receive(&mut node, 20).await;
    // In order within each QoS (rumqttd forwards a QoS 2 message at PUBREL).
    let numbers: Vec<usize> =
        got.iter().map(|(_, p)| String::from_utf8_lossy(&p.payload)[1..].parse().unwrap()).collect();
    for parity in [0, 1] {
        let of: Vec<usize> = numbers.iter().copied().filter(|n| n % 2 == parity).collect();
        assert_eq!(of, (parity..20).step_by(2).collect::<Vec<_>>(), "{broker}: {numbers:?}");
    }
    for (arrival, _) in got.iter().rev() {
        node.session().acknowledge(arrival.expect("QoS 1 and 2"));
    }
    settle(&mut node, Duration::from_millis(500)).await;
    assert_eq!(node.session().incoming_in_flight(), 0, "{broker}: every PUBREL came and was completed");

    // The node goes away; what is published meanwhile waits in its session.
    node.close();
    for i in 0..3 {
        device.session().publish(Publish::new("s/y", QoS::AtLeastOnce, format!("late{i}"), None)).unwrap();
    }
    settle(&mut device, Duration::from_millis(300)).await;
    assert_eq!(device.session().unconfirmed(), 0);
    assert!(connected(&mut node).await, "{broker}: the session resumed");
    let late = receive(&mut node, 3).await;
    assert!(
        late.iter().all(|(_, p)| p.payload.starts_with(b"late")),
        "{broker}: nothing acknowledged came again"
    );
    for (arrival, _) in &late {
        node.session().acknowledge(arrival.unwrap());
    }
    let more = settle(&mut node, Duration::from_millis(500)).await;
    assert!(!more.iter().any(|e| matches!(e, Event::Publish { .. })), "{broker}: {more:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_layer_keeps_the_rules_on_the_embedded_broker_and_mosquitto() {
    let port = free_port_pair();
    let listeners = edgeinfer::transport::broker::Listeners { v5: ([127, 0, 0, 1], port).into(), v311: None };
    edgeinfer::transport::broker::start(listeners, None, 1 << 20).unwrap();
    exercise(port, "rumqttd").await;
    if let Some(mosquitto) = Mosquitto::start() {
        exercise(mosquitto.port, "mosquitto").await;
    }
}
