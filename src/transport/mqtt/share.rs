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

use super::acks::{Acks, Finished, Seen};
use super::options::{OptionsError, client_options};
use super::outbox::Outbox;
use super::topics::Topics;
use super::{Admission, Backoff, Connection, RequestTask};
use crate::config::Config;
use crate::engine::Engine;
use crate::telemetry::{MQTT_SHARE_CONNECTED, MQTT_SHARE_REQUESTS, ShareGroupStatus};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish, SubscribeReasonCode};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    options: MqttOptions,
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
        let mut options = client_options(mqtt, &client_id, config.limits.max_packet_bytes as u32, in_flight)?;
        options
            .set_session_expiry_interval(Some(mqtt.share_session_expiry_s))
            .set_keep_alive(Duration::from_secs(u64::from(mqtt.share_keep_alive_s.max(5))));
        let live = Arc::new(Live::default());
        let view = ShareView { group: mqtt.share_group.clone(), live: live.clone() };
        Ok(ShareLink {
            options,
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
        let (client, mut eventloop) = AsyncClient::new(self.options.clone(), 256);
        let mut line = Line {
            conn: Connection { client, outbox: Outbox::default(), connected: false },
            acks: Acks::new(),
            tasks: JoinSet::new(),
            engine,
            admission,
        };
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut session = "new";
        tokio::pin!(stop);
        loop {
            line.conn.flush();
            let event = tokio::select! {
                _ = &mut stop => break,
                Some(_) = line.tasks.join_next(), if !line.tasks.is_empty() => continue,
                Some(done) = line.acks.1.recv() => {
                    line.conn.finished(&mut line.acks.0, done);
                    continue;
                }
                event = eventloop.poll() => event,
            };
            match event {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                    backoff.reset();
                    line.conn.connected = true;
                    let max_packet = ack.properties.as_ref().and_then(|p| p.max_packet_size);
                    line.conn.outbox.set_max_packet(max_packet);
                    session = if ack.session_present { "resumed" } else { "new" };
                    if !ack.session_present {
                        line.acks.0.new_session();
                        line.conn.outbox.session_lost();
                    }
                    // Also on a resumed session: the session a stopping node
                    // left has no subscription, and subscribing again to a
                    // filter it holds changes nothing.
                    let filter = self.topics.shared_requests();
                    if let Err(e) = line.conn.client.try_subscribe(filter, QoS::AtLeastOnce) {
                        tracing::error!("share group: subscribing: {e}");
                    }
                }
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
                    if ack.return_codes.iter().any(|c| !matches!(c, SubscribeReasonCode::Success(_))) {
                        tracing::error!(
                            "share group: the broker refused {}: {:?}; not ready",
                            self.topics.shared_requests(),
                            ack.return_codes
                        );
                    } else {
                        tracing::info!(
                            "share group {} joined (session {session}): serving {}",
                            self.view.group,
                            self.topics.shared_requests()
                        );
                        self.set_joined(true);
                    }
                }
                Ok(Event::Incoming(Packet::Publish(publish))) => line.take(publish, &self.topics, &self.live),
                Ok(event) => line.conn.outbox.track(&event),
                Err(e) => {
                    if line.conn.connected {
                        tracing::warn!(
                            "share group connection: {e}; the broker keeps this node's share for it up to \
                             mqtt.share_session_expiry_s, then hands it to the other members"
                        );
                    }
                    line.conn.connected = false;
                    self.set_joined(false);
                    metrics::counter!(crate::telemetry::MQTT_RECONNECTS).increment(1);
                    tokio::time::sleep(backoff.next_wait()).await;
                }
            }
        }
        self.leave(&mut line, &mut eventloop).await;
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
    async fn leave(&self, line: &mut Line, eventloop: &mut EventLoop) {
        let filter = self.topics.shared_requests();
        let mut left = false;
        if line.conn.connected {
            if let Err(e) = line.conn.client.try_unsubscribe(filter.clone()) {
                tracing::error!("share group: unsubscribing: {e}");
            }
        } else {
            // Not connected: the session's subscription goes with the session.
            left = true;
        }
        let running = line.tasks.len();
        let now = tokio::time::Instant::now();
        // Leaving is tried even with no time to drain: without it the
        // session keeps the node in the group for its expiry.
        let (drain_by, leave_by) = (now + self.drain_timeout, now + LEAVE_WITHIN);
        let mut after_leaving = 0usize;
        loop {
            while let Ok(done) = line.acks.1.try_recv() {
                line.conn.finished(&mut line.acks.0, done);
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
            let drained = (line.tasks.is_empty() && line.conn.outbox.is_idle()) || now >= drain_by;
            if drained && left {
                break;
            }
            let deadline = match (drained, left) {
                (true, _) => leave_by,
                (false, true) => drain_by,
                (false, false) => drain_by.min(leave_by),
            };
            line.conn.flush();
            tokio::select! {
                _ = line.tasks.join_next(), if !line.tasks.is_empty() => {}
                Some(done) = line.acks.1.recv() => line.conn.finished(&mut line.acks.0, done),
                event = eventloop.poll() => match event {
                    Ok(Event::Incoming(Packet::UnsubAck(_))) if !left => {
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
                    Ok(Event::Incoming(Packet::Publish(publish))) => {
                        after_leaving += usize::from(left);
                        line.take(publish, &self.topics, &self.live);
                    }
                    // Back while draining: a resumed session still holds
                    // the subscription (also when the node was away at the
                    // stop), a new one has none.
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                        line.conn.connected = true;
                        if !ack.session_present {
                            line.acks.0.new_session();
                            line.conn.outbox.session_lost();
                            left = true;
                        } else {
                            left = false;
                            let _ = line.conn.client.try_unsubscribe(filter.clone());
                        }
                    }
                    Ok(event) => line.conn.outbox.track(&event),
                    Err(_) => {
                        line.conn.connected = false;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
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
        if line.conn.connected {
            super::disconnect(&line.conn.client, eventloop).await;
        }
    }
}

/// The share loop's side of the request path: its connection, its
/// acknowledgements in arrival order, and the requests running.
struct Line {
    conn: Connection,
    acks: (Acks, mpsc::UnboundedReceiver<Finished>),
    tasks: JoinSet<()>,
    engine: Arc<Engine>,
    admission: Admission,
}

impl Line {
    /// A request from the group: run it, unless it is a redelivery of one
    /// this session already runs or answered.
    fn take(&mut self, publish: Publish, topics: &Topics, live: &Live) {
        match self.acks.0.redelivered(&publish) {
            // Acknowledged, but rumqttc dropped the acknowledgement at a
            // reconnect: again, without running it twice.
            Some(Seen::Acked) if !self.conn.outbox.acks(publish.pkid) => {
                self.acks.0.again(&publish).into_iter().for_each(|p| self.conn.outbox.ack(p))
            }
            Some(_) => {}
            None => {
                live.requests.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(MQTT_SHARE_REQUESTS).increment(1);
                let admitted = self.admission.admit(publish.payload.len());
                let slot = self.acks.0.arrived(&publish);
                let task = RequestTask {
                    engine: self.engine.clone(),
                    topics: topics.clone(),
                    max_reply: self.conn.outbox.max_packet(),
                };
                self.tasks.spawn(async move {
                    let refusal = admitted.as_ref().err().cloned();
                    task.handle(publish, refusal, slot).await;
                    drop(admitted);
                });
            }
        }
    }
}
