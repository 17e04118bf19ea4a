//! The share group's own connection (issue 42). Brokers tie a subscription
//! to a session, and mosquitto hands a shared message to the next member in
//! turn whether or not it is connected: on the node's persistent session
//! (`mqtt.session_expiry_s`, an hour) a dead node kept its place in the
//! group, and its share of the site's requests queued for it, for that
//! hour. So the share group rides a second connection, `CLIENT_ID-share`,
//! whose session outlives it by `mqtt.share_session_expiry_s` (seconds:
//! long enough for a crash and a systemd restart to find the requests held
//! for it) and whose keep alive (`mqtt.share_keep_alive_s`) notices a
//! silent death: a dead node leaves the group after at most keep alive x
//! 1.5 + that expiry. The node's own topic keeps the persistent session.
//!
//! Requests are handled as on the main connection: the same admission
//! bounds (shared, so the node's memory bound holds across both), the same
//! request task, and this connection's own in-order acknowledgements and
//! outbox, because packet ids belong to a connection and a reply must leave
//! ahead of its acknowledgement on the connection that brought the request.
//!
//! On stop the node leaves the group first (UNSUBSCRIBE, so the broker sends
//! its next requests to the other members), answers and acknowledges what
//! it was handed, then disconnects.

use super::acks::{AckSlot, Finished};
use super::options::{BrokerAddress, OptionsError, session_options, tls_for};
use super::session::{Arrival, Backoff, Driver, Event, Options, Session};
use super::topics::Topics;
use super::{Admission, RequestTask};
use crate::config::Config;
use crate::engine::Engine;
use crate::telemetry::{MQTT_SHARE_CONNECTED, MQTT_SHARE_REQUESTS, ShareGroupStatus};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, Publish, SubscribeReasonCode};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// Read by the status while the share loop runs.
#[derive(Default)]
struct Live {
    joined: AtomicBool,
    requests: AtomicU64,
}

/// The status' view of the share group; cheap to clone.
#[derive(Clone)]
pub struct ShareView {
    group: String,
    live: Arc<Live>,
}

impl ShareView {
    pub fn status(&self) -> ShareGroupStatus {
        ShareGroupStatus {
            group: self.group.clone(),
            joined: self.live.joined.load(Ordering::Relaxed),
            requests: self.live.requests.load(Ordering::Relaxed),
        }
    }
}

/// How long a stopping node waits for the broker to confirm it left the
/// group (UNSUBACK), even with `node.drain_timeout_s = 0`.
const LEAVE_WITHIN: Duration = Duration::from_secs(1);

pub struct ShareLink {
    options: Options,
    address: BrokerAddress,
    tls: Option<Arc<rustls::ClientConfig>>,
    topics: Topics,
    drain_timeout: Duration,
    live: Arc<Live>,
    view: ShareView,
    /// True while the subscription is in place; the main loop is ready only
    /// with it.
    joined: watch::Sender<bool>,
}

impl ShareLink {
    pub fn new(config: &Config, topics: Topics) -> Result<ShareLink, OptionsError> {
        let mqtt = &config.mqtt;
        let client_id = format!(
            "{}-share",
            mqtt.client_id.clone().unwrap_or_else(|| format!("edgeinfer-{}", config.node.id))
        );
        let in_flight = mqtt.max_in_flight.min(u16::MAX as usize) as u16;
        let keep_alive = Duration::from_secs(u64::from(mqtt.share_keep_alive_s.max(5)));
        let options = Options {
            session_expiry_s: mqtt.share_session_expiry_s,
            keep_alive,
            ping_timeout: keep_alive,
            ..session_options(mqtt, &client_id, config.limits.max_packet_bytes as u32, in_flight)?
        };
        let live = Arc::new(Live::default());
        let view = ShareView { group: mqtt.share_group.clone(), live: live.clone() };
        Ok(ShareLink {
            options,
            address: BrokerAddress::parse(&mqtt.url)?,
            tls: tls_for(mqtt)?,
            topics,
            drain_timeout: Duration::from_secs(config.node.drain_timeout_s),
            live,
            view,
            joined: watch::channel(false).0,
        })
    }

    pub fn view(&self) -> ShareView {
        self.view.clone()
    }

    /// Whether the subscription is in place, as it changes.
    pub fn joined(&self) -> watch::Receiver<bool> {
        self.joined.subscribe()
    }

    /// Serves the share group until `stop`, then leaves it and drains.
    pub async fn run(self, engine: Arc<Engine>, admission: Admission, stop: impl Future<Output = ()>) {
        let session = Session::new(self.options.clone());
        let (finished_tx, finished) = mpsc::unbounded_channel();
        let mut line = Line {
            link: Driver::new(session, self.address.host.clone(), self.address.port, self.tls.clone()),
            replies: HashMap::new(),
            max_reply: Arc::new(AtomicUsize::new(usize::MAX)),
            finished_tx,
            finished,
            tasks: JoinSet::new(),
            engine,
            admission,
            connected: false,
        };
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        tokio::pin!(stop);
        loop {
            if !line.link.is_open() {
                let connecting = tokio::select! {
                    _ = &mut stop => break,
                    connected = line.link.connect() => connected,
                };
                if let Err(e) = connecting {
                    metrics::counter!(crate::telemetry::MQTT_RECONNECTS).increment(1);
                    tracing::debug!("share group connection: {e}");
                    tokio::select! {
                        _ = &mut stop => break,
                        _ = tokio::time::sleep(backoff.next_wait()) => continue,
                    }
                }
            }
            let event = tokio::select! {
                _ = &mut stop => break,
                Some(_) = line.tasks.join_next(), if !line.tasks.is_empty() => continue,
                Some(done) = line.finished.recv() => {
                    line.finished(done);
                    continue;
                }
                event = line.link.next() => event,
            };
            match event {
                Event::Connected { session_present } => {
                    backoff.reset();
                    line.connected(session_present);
                    // Also on a resumed session: the session a stopping node
                    // left has no subscription, and subscribing again to a
                    // filter it holds changes nothing.
                    let filter = Filter::new(self.topics.shared_requests(), QoS::AtLeastOnce);
                    line.link.session().subscribe(vec![filter]);
                }
                Event::Subscribed { codes, .. } => {
                    if codes.iter().any(|c| !matches!(c, SubscribeReasonCode::Success(_))) {
                        tracing::error!(
                            "share group: the broker refused {}: {codes:?}; not ready",
                            self.topics.shared_requests()
                        );
                    } else {
                        tracing::info!(
                            "share group {} joined: serving {}",
                            self.view.group,
                            self.topics.shared_requests()
                        );
                        self.set_joined(true);
                    }
                }
                Event::Publish { arrival, publish } => line.take(arrival, *publish, &self.topics, &self.live),
                Event::Closed(why) => {
                    if std::mem::replace(&mut line.connected, false) {
                        tracing::warn!(
                            "share group connection: {why}; the broker keeps this node's share for it up to \
                             mqtt.share_session_expiry_s, then hands it to the other members"
                        );
                    }
                    self.set_joined(false);
                    metrics::counter!(crate::telemetry::MQTT_RECONNECTS).increment(1);
                    tokio::select! {
                        _ = &mut stop => break,
                        _ = tokio::time::sleep(backoff.next_wait()) => {}
                    }
                }
                other => line.settled(other),
            }
        }
        self.leave(&mut line).await;
    }

    fn set_joined(&self, joined: bool) {
        self.live.joined.store(joined, Ordering::Relaxed);
        metrics::gauge!(MQTT_SHARE_CONNECTED).set(if joined { 1.0 } else { 0.0 });
        self.joined.send_if_modified(|was| std::mem::replace(was, joined) != joined);
    }

    /// Leaves the group (UNSUBSCRIBE: from its UNSUBACK on, the broker sends
    /// the group's requests to the other members), then answers and
    /// acknowledges every request it was handed, up to
    /// `node.drain_timeout_s`, and disconnects. Requests it could not
    /// finish stay unacknowledged in this connection's session, which the
    /// broker keeps `mqtt.share_session_expiry_s`.
    async fn leave(&self, line: &mut Line) {
        let filter = self.topics.shared_requests();
        // Not connected: the session's subscription goes with the session.
        let mut left = line.link.session().unsubscribe(vec![filter.clone()]).is_none();
        let running = line.tasks.len();
        let now = tokio::time::Instant::now();
        // Leaving is tried even with no time to drain: without it the
        // session keeps the node in the group for its expiry.
        let (drain_by, leave_by) = (now + self.drain_timeout, now + LEAVE_WITHIN);
        let mut after_leaving = 0usize;
        loop {
            while let Ok(done) = line.finished.try_recv() {
                line.finished(done);
            }
            let now = tokio::time::Instant::now();
            if !left && now >= leave_by {
                left = true;
                tracing::warn!(
                    "share group: the broker did not confirm the node left {}; its session keeps it there \
                     for mqtt.share_session_expiry_s",
                    self.view.group
                );
            }
            let idle = line.tasks.is_empty() && line.link.session().unconfirmed() == 0;
            let drained = idle || now >= drain_by;
            if drained && left {
                break;
            }
            let deadline = match (drained, left) {
                (true, _) => leave_by,
                (false, true) => drain_by,
                (false, false) => drain_by.min(leave_by),
            };
            if !line.link.is_open() {
                let reconnecting = tokio::select! {
                    connected = line.link.connect() => connected,
                    _ = tokio::time::sleep_until(deadline) => continue,
                };
                if reconnecting.is_err() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
            tokio::select! {
                _ = line.tasks.join_next(), if !line.tasks.is_empty() => {}
                Some(done) = line.finished.recv() => line.finished(done),
                event = line.link.next() => match event {
                    Event::Unsubscribed { .. } if !left => {
                        left = true;
                        self.set_joined(false);
                        tracing::info!(
                            "left share group {}: the broker hands its requests to the other members; \
                             answering the {} this node holds",
                            self.view.group,
                            line.tasks.len()
                        );
                    }
                    // Handed to this node: answered, even after it left.
                    Event::Publish { arrival, publish } => {
                        after_leaving += usize::from(left);
                        line.take(arrival, *publish, &self.topics, &self.live);
                    }
                    // Back while draining: a resumed session still holds
                    // the subscription (also when the node was away at the
                    // stop), a new one has none.
                    Event::Connected { session_present } => {
                        line.connected(session_present);
                        left = !session_present
                            || line.link.session().unsubscribe(vec![filter.clone()]).is_none();
                    }
                    Event::Closed(_) => {
                        line.connected = false;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    other => line.settled(other),
                },
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
        self.set_joined(false);
        let unfinished = line.tasks.len();
        line.tasks.abort_all();
        tracing::info!(
            "share group drained: {} of {running} requests in flight answered, {after_leaving} arrived after \
             leaving; {unfinished} unfinished, left with the broker",
            running - unfinished.min(running)
        );
        if line.link.is_open() {
            line.link.disconnect().await;
        }
    }
}

/// The share loop's side of the request path: its connection, the
/// replies out on it, and the requests running.
struct Line {
    link: Driver,
    /// The request id of each reply the broker has not confirmed, for the log.
    replies: HashMap<u16, String>,
    /// The broker's Maximum Packet Size, for the request tasks' replies.
    max_reply: Arc<AtomicUsize>,
    finished_tx: mpsc::UnboundedSender<Finished>,
    finished: mpsc::UnboundedReceiver<Finished>,
    tasks: JoinSet<()>,
    engine: Arc<Engine>,
    admission: Admission,
    connected: bool,
}

impl Line {
    /// A request from the group: run it. The session hands over each
    /// request once: a re-send of one it holds or took is not a new one.
    fn take(&mut self, arrival: Option<Arrival>, publish: Publish, topics: &Topics, live: &Live) {
        live.requests.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(MQTT_SHARE_REQUESTS).increment(1);
        let admitted = self.admission.admit(publish.payload.len());
        let slot = AckSlot::new(arrival, self.finished_tx.clone());
        let task = RequestTask {
            engine: self.engine.clone(),
            topics: topics.clone(),
            max_reply: self.max_reply.clone(),
            // QoS 1 whatever `mqtt.reply_qos` says: this connection has no
            // journal to keep QoS 2 ids across a crash (its requests are
            // not journaled either: unanswered, they go to another member).
            reply_qos: QoS::AtLeastOnce,
            // Unjournaled: unacknowledged until answered, a request goes to
            // another member of the group if this node dies.
            journaled: None,
        };
        self.tasks.spawn(async move {
            let refusal = admitted.as_ref().err().cloned();
            task.handle(publish, refusal, slot, admitted).await;
        });
    }

    /// A request finished: its reply goes out, then (once the reply is
    /// written) its acknowledgement, in arrival order.
    fn finished(&mut self, done: Finished) {
        let session = self.link.session();
        let mut reply_pkid = None;
        if let Some(reply) = done.reply {
            match session.publish(reply.publish) {
                Ok(pkid) => {
                    self.replies.insert(pkid, reply.id);
                    reply_pkid = Some(pkid);
                }
                Err(e) => super::outbox::not_delivered(&reply.id, &e.to_string()),
            }
        }
        // Handed to the session: a follow-up may follow it now.
        drop(done.first);
        if let Some(arrival) = done.arrival {
            session.acknowledge_after(arrival, reply_pkid);
        }
    }

    /// The broker confirmed or refused a reply.
    fn settled(&mut self, event: Event) {
        match event {
            Event::Delivered { pkid } => {
                self.replies.remove(&pkid);
            }
            Event::Refused { pkid, reason } => {
                if let Some(id) = self.replies.remove(&pkid) {
                    super::outbox::not_delivered(
                        &id,
                        &format!("the broker refused it (reason {reason:#04x})"),
                    );
                }
            }
            _ => {}
        }
    }

    /// The broker's limits, as this connection's CONNACK gave them.
    fn connected(&mut self, _session_present: bool) {
        self.connected = true;
        let max = self.link.session().peer_max_packet().map_or(usize::MAX, |m| m as usize);
        self.max_reply.store(max, Ordering::Relaxed);
    }
}
