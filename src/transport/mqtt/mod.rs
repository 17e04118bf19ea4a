//! The MQTT 5 request/response adapter. One task owns the connection (the
//! rumqttc event loop); each request runs in its own task and is acknowledged
//! only after its reply has been handed to the client, so a node that dies
//! mid-request leaves the request with the broker for redelivery.

mod acks;
mod options;
mod topics;

pub use options::{BrokerAddress, OptionsError, client_options};
pub use topics::{Topics, valid_reply_topic};

use crate::engine::{Engine, Envelope};
use crate::lifecycle::Heartbeat;
use crate::protocol::{Encoding, FollowUp, InferError, ReplyRoute};
use crate::telemetry::{State, Status};
use acks::{AckQueue, AckSlot};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{LastWill, Packet, Publish, PublishProperties, SubscribeReasonCode};
use rumqttc::v5::{AsyncClient, Event, EventLoop, Request};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Semaphore, watch};

pub struct MqttService {
    engine: Arc<Engine>,
    topics: Topics,
    status: Status,
    max_in_flight: usize,
    stats_interval: Option<Duration>,
    options: rumqttc::v5::MqttOptions,
    /// True while connected with our subscriptions in place; the HTTP
    /// readiness check holds the receiving end.
    ready_tx: watch::Sender<bool>,
    drain_timeout: Duration,
    heartbeat: Heartbeat,
    /// Asks for the retained status to be published again (after a reload).
    refresh: Arc<tokio::sync::Notify>,
    /// Replies after the first (async enrichment), from the cloud spool.
    follow_ups: Option<tokio::sync::mpsc::UnboundedReceiver<FollowUp>>,
}

impl MqttService {
    pub fn new(
        engine: Arc<Engine>,
        config: &crate::config::Config,
        status: Status,
    ) -> Result<(MqttService, watch::Receiver<bool>), OptionsError> {
        let mqtt = &config.mqtt;
        let topics = Topics::new(&mqtt.topic_prefix, &config.node.id, &mqtt.share_group);
        let client_id = mqtt.client_id.clone().unwrap_or_else(|| format!("edgeinfer-{}", config.node.id));
        // Room above the payload limit for topic and properties, so an
        // oversized request still reaches the engine and gets `too_large`.
        let max_packet = (config.limits.max_payload_bytes + 64 * 1024) as u32;
        let in_flight = mqtt.max_in_flight.min(u16::MAX as usize) as u16;
        let mut options = client_options(mqtt, &client_id, max_packet, in_flight)?;
        options.set_last_will(LastWill::new(
            topics.status(),
            status.with_state(State::Offline),
            QoS::AtLeastOnce,
            true,
            None,
        ));
        let (ready_tx, ready_rx) = watch::channel(false);
        Ok((
            MqttService {
                engine,
                topics,
                status,
                max_in_flight: mqtt.max_in_flight,
                stats_interval: (config.telemetry.stats_interval_s > 0)
                    .then(|| Duration::from_secs(config.telemetry.stats_interval_s)),
                options,
                ready_tx,
                drain_timeout: Duration::from_secs(config.node.drain_timeout_s),
                heartbeat: Heartbeat::default(),
                refresh: Default::default(),
                follow_ups: None,
            },
            ready_rx,
        ))
    }

    /// Publishes what arrives here to its reply route.
    pub fn with_follow_ups(mut self, rx: tokio::sync::mpsc::UnboundedReceiver<FollowUp>) -> MqttService {
        self.follow_ups = Some(rx);
        self
    }

    /// Notify it to have the retained status published again.
    pub fn status_refresher(&self) -> Arc<tokio::sync::Notify> {
        self.refresh.clone()
    }

    /// Turns with the event loop; the watchdog reads it.
    pub fn heartbeat(&self) -> Heartbeat {
        self.heartbeat.clone()
    }

    /// Serves until `shutdown` resolves, then drains: takes no new request,
    /// lets the running ones finish (up to `node.drain_timeout_s`), sends
    /// their replies and acknowledgements, publishes `offline` and
    /// disconnects. Requests it did not finish stay unacknowledged in the
    /// persistent session, so the broker redelivers them. Connection errors
    /// never end it: it reconnects with exponential backoff and jitter.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut follow_ups = self.follow_ups.take();
        let (client, mut eventloop) = AsyncClient::new(self.options.clone(), 4096);
        let permits = Arc::new(Semaphore::new(self.max_in_flight));
        let mut acks = AckQueue::start(client.clone());
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        // Replies rumqttc had not seen acknowledged when the connection broke;
        // it drops them if the broker lost our session, so we send them again.
        let mut unacked_replies: Vec<Publish> = Vec::new();
        let mut awaiting_suback = false;
        tokio::pin!(shutdown);
        let mut stats_tick = tokio::time::interval(self.stats_interval.unwrap_or(Duration::from_secs(3600)));
        stats_tick.tick().await;
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            self.heartbeat.beat();
            let event = tokio::select! {
                _ = &mut shutdown => break,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
                Some(follow_up) = next_follow_up(&mut follow_ups) => {
                    let props = PublishProperties {
                        correlation_data: follow_up.route.correlation.map(Into::into),
                        content_type: follow_up.route.content_type,
                        ..Default::default()
                    };
                    let _ = client
                        .publish_with_properties(follow_up.route.topic, QoS::AtLeastOnce, false, follow_up.payload, props)
                        .await;
                    continue;
                }
                _ = self.refresh.notified() => {
                    if *self.ready_tx.borrow() {
                        let status = self.status.snapshot(State::Online, self.engine.live());
                        let _ = client.try_publish(self.topics.status(), QoS::AtLeastOnce, true, status);
                    }
                    continue;
                }
                _ = stats_tick.tick(), if self.stats_interval.is_some() => {
                    self.publish_stats(&client).await;
                    continue;
                }
                event = eventloop.poll() => event,
            };
            match event {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                    backoff.reset();
                    if !ack.session_present {
                        self.subscribe(&client).await;
                        awaiting_suback = true;
                        for reply in unacked_replies.drain(..) {
                            let topic = String::from_utf8_lossy(&reply.topic).into_owned();
                            let props = reply.properties.clone().unwrap_or_default();
                            let _ = client
                                .publish_with_properties(topic, QoS::AtLeastOnce, false, reply.payload, props)
                                .await;
                        }
                    } else {
                        // The session resumed with its subscriptions, and
                        // rumqttc resends the unacknowledged replies itself.
                        unacked_replies.clear();
                        self.announce_ready(&client, "resumed").await;
                    }
                }
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
                    if ack.return_codes.iter().any(|c| !matches!(c, SubscribeReasonCode::Success(_))) {
                        tracing::error!(
                            "the broker refused a subscription: {:?}; not ready",
                            ack.return_codes
                        );
                    } else if std::mem::take(&mut awaiting_suback) {
                        // Ready only now: a request published before the
                        // broker took the subscription would reach no one.
                        self.announce_ready(&client, "new").await;
                    }
                }
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    let permit = permits.clone().try_acquire_owned().ok();
                    let ack = acks.arrived(&publish);
                    let task = RequestTask {
                        engine: self.engine.clone(),
                        client: client.clone(),
                        topics: self.topics.clone(),
                    };
                    tasks.spawn(async move {
                        task.handle(publish, permit.is_some(), ack).await;
                        drop(permit);
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    self.ready_tx.send_replace(false);
                    awaiting_suback = false;
                    metrics::gauge!(crate::telemetry::MQTT_CONNECTED).set(0.0);
                    metrics::counter!(crate::telemetry::MQTT_RECONNECTS).increment(1);
                    save_unacked(&eventloop, &mut unacked_replies);
                    let wait = backoff.next();
                    tracing::warn!("MQTT connection: {e}; reconnecting in {} ms", wait.as_millis());
                    tokio::time::sleep(wait).await;
                }
            }
        }
        self.drain(&client, &mut eventloop, &mut tasks, &acks).await;
        let offline = self.status.snapshot(State::Offline, self.engine.live());
        let _ = client.publish(self.topics.status(), QoS::AtLeastOnce, true, offline).await;
        let _ = client.disconnect().await;
        // Flush the offline status and the DISCONNECT.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) | Err(_) => break,
                    _ => {}
                }
            }
        })
        .await;
    }

    /// Finishes the requests in flight while the event loop keeps carrying
    /// their replies; requests arriving meanwhile are left unacknowledged.
    async fn drain(
        &self,
        client: &AsyncClient,
        eventloop: &mut EventLoop,
        tasks: &mut tokio::task::JoinSet<()>,
        acks: &AckQueue,
    ) {
        self.ready_tx.send_replace(false);
        let draining = self.status.snapshot(State::Draining, self.engine.live());
        let _ = client.try_publish(self.topics.status(), QoS::AtLeastOnce, true, draining);
        let running = tasks.len();
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        let mut held_back = 0usize;
        while !tasks.is_empty() {
            tokio::select! {
                _ = tasks.join_next() => {}
                event = eventloop.poll() => match event {
                    Ok(Event::Incoming(Packet::Publish(_))) => held_back += 1,
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let unfinished = tasks.len();
        acks.close().await;
        tasks.abort_all();
        tracing::info!(
            "drained: {} of {running} requests in flight finished; {unfinished} unfinished and {held_back} \
             arrived while draining, left with the broker for redelivery",
            running - unfinished
        );
    }

    /// The periodic `stats` message, and the retained status refreshed with
    /// uptime and request counts, for fleets that cannot scrape.
    async fn publish_stats(&self, client: &AsyncClient) {
        let interval = self.stats_interval.unwrap_or(Duration::from_secs(1));
        let stats = serde_json::json!({
            "node": self.status.node,
            "interval_s": interval.as_secs(),
            "models": self.engine.take_stats(interval).await,
        });
        let _ = client.try_publish(self.topics.stats(), QoS::AtMostOnce, false, stats.to_string());
        if *self.ready_tx.borrow() {
            let status = self.status.snapshot(State::Online, self.engine.live());
            let _ = client.try_publish(self.topics.status(), QoS::AtLeastOnce, true, status);
        }
    }

    /// Both filters in one SUBSCRIBE, so one SUBACK confirms them.
    async fn subscribe(&self, client: &AsyncClient) {
        let filters = [self.topics.node_requests(), self.topics.shared_requests()]
            .map(|f| rumqttc::v5::mqttbytes::v5::Filter::new(f, QoS::AtLeastOnce));
        if let Err(e) = client.subscribe_many(filters).await {
            tracing::error!("subscribing to the request topics: {e}");
        }
    }

    /// Subscriptions are in place: status online, readiness, one log line.
    async fn announce_ready(&self, client: &AsyncClient, session: &str) {
        let status = self.status.snapshot(State::Online, self.engine.live());
        let _ = client.publish(self.topics.status(), QoS::AtLeastOnce, true, status).await;
        metrics::gauge!(crate::telemetry::MQTT_CONNECTED).set(1.0);
        self.ready_tx.send_replace(true);
        tracing::info!(
            "MQTT connected (session {session}); serving {} and {}",
            self.topics.node_requests(),
            self.topics.shared_requests()
        );
    }
}

/// The next follow-up, or never when there is no spool.
async fn next_follow_up(rx: &mut Option<tokio::sync::mpsc::UnboundedReceiver<FollowUp>>) -> Option<FollowUp> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn save_unacked(eventloop: &EventLoop, saved: &mut Vec<Publish>) {
    for request in &eventloop.pending {
        if let Request::Publish(p) = request
            && p.qos != QoS::AtMostOnce
            // The same reply saved at an earlier disconnect (the broker has
            // not come back since); two devices' identical answers differ in
            // their correlation data, so properties are part of the identity.
            && !saved.iter().any(|s| s.topic == p.topic && s.payload == p.payload && s.properties == p.properties)
        {
            let mut p = p.clone();
            p.dup = false;
            saved.push(p);
        }
    }
}

struct RequestTask {
    engine: Arc<Engine>,
    client: AsyncClient,
    topics: Topics,
}

impl RequestTask {
    /// Answers one request; dropping `ack` at the end lets its
    /// acknowledgement go out, after the reply was handed to the client.
    async fn handle(self, publish: Publish, admitted: bool, ack: AckSlot) {
        let topic = String::from_utf8_lossy(&publish.topic).into_owned();
        let props = publish.properties.clone().unwrap_or_default();
        let encoding = Encoding::from_content_type(props.content_type.as_deref());
        let model = self.topics.model_of(&topic);
        // Read the payload once: fully for a request we will run, only its
        // id and reply_to for one we refuse. An MQTT 3.1.1 request names
        // its reply topic in the payload.
        let decoded = match (admitted, model) {
            (true, Some(_)) => Ok(self.engine.decode(&publish.payload, encoding)),
            _ => Err(crate::engine::peek(&publish.payload, encoding)),
        };
        let (id, reply_to) = match &decoded {
            Ok(d) => (&d.id, &d.reply_to),
            Err(peek) => (&peek.id, &peek.reply_to),
        };
        let destination = props.response_topic.clone().or_else(|| reply_to.clone());
        let Some(destination) = destination.filter(|t| valid_reply_topic(t)) else {
            metrics::counter!(crate::telemetry::MQTT_NO_REPLY_TOPIC).increment(1);
            tracing::debug!(id = %id, "request on {topic} has no valid reply topic; dropped");
            drop(ack);
            return;
        };
        let envelope = Envelope { transport: "mqtt", ..Envelope::model(model.unwrap_or("")) };
        let reply = match decoded {
            Ok(decoded) => {
                let route = ReplyRoute {
                    topic: destination.clone(),
                    correlation: props.correlation_data.as_ref().map(|c| c.to_vec()),
                    content_type: props.content_type.clone(),
                };
                let deadline = props.message_expiry_interval.map(|s| Duration::from_secs(s as u64));
                let envelope = Envelope { deadline, follow_up: Some(&route), ..envelope };
                self.engine.answer(envelope, decoded, encoding).await
            }
            Err(peek) if !admitted => self.engine.reject(
                envelope,
                peek.id,
                encoding,
                InferError::overloaded("the node is at mqtt.max_in_flight requests; retry later"),
            ),
            Err(peek) => self.engine.reject(
                envelope,
                peek.id,
                encoding,
                InferError::unknown_model(format!("topic {topic} does not name a model")),
            ),
        };
        if let Err(code) = reply.outcome {
            tracing::debug!(id = %reply.id, "request on {topic} answered {code}");
        }
        let reply_props = PublishProperties {
            correlation_data: props.correlation_data.clone(),
            content_type: props.content_type.clone(),
            ..Default::default()
        };
        if let Err(e) = self
            .client
            .publish_with_properties(destination, QoS::AtLeastOnce, false, reply.payload, reply_props)
            .await
        {
            // Only when the client is shutting down; the acknowledgement task
            // is gone too, so the broker keeps the request for redelivery.
            tracing::warn!(id = %reply.id, "reply not handed to the client: {e}");
        }
        drop(ack);
    }
}

/// Exponential backoff with full jitter, so a fleet does not reconnect in step.
struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    fn new(base: Duration, max: Duration) -> Backoff {
        Backoff { base, max, attempt: 0 }
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }

    fn next(&mut self) -> Duration {
        let ceiling = self.base.saturating_mul(1 << self.attempt.min(16)).min(self.max);
        self.attempt += 1;
        let jitter = fastrand::f64();
        ceiling.mul_f64(0.5 + 0.5 * jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_pending_at_a_disconnect_are_kept_once_for_republishing() {
        use rumqttc::v5::mqttbytes::v5::PubAck;
        let options = rumqttc::v5::MqttOptions::new("t", "127.0.0.1", 1);
        let mut eventloop = EventLoop::new(options, 8);
        let reply = |topic: &str, body: &'static [u8]| {
            let mut p = Publish::new(topic, QoS::AtLeastOnce, body, None);
            p.pkid = 7;
            p.dup = true;
            Request::Publish(p)
        };
        eventloop.pending.push_back(reply("devices/a/replies", b"one"));
        eventloop.pending.push_back(Request::PubAck(PubAck::new(3, None)));
        eventloop.pending.push_back(reply("devices/b/replies", b"two"));
        // Two requests on one shared reply topic, answered alike: kept apart
        // by their correlation data.
        let correlated = |c: &'static [u8]| {
            let mut p = Publish::new("devices/shared", QoS::AtLeastOnce, "same", None);
            p.properties = Some(PublishProperties {
                correlation_data: Some(bytes::Bytes::from_static(c)),
                ..Default::default()
            });
            Request::Publish(p)
        };
        eventloop.pending.push_back(correlated(b"c1"));
        eventloop.pending.push_back(correlated(b"c2"));
        eventloop.pending.push_back(Request::Publish(Publish::new("x", QoS::AtMostOnce, "qos0", None)));
        let mut saved = Vec::new();
        save_unacked(&eventloop, &mut saved);
        // A second disconnect before the broker came back saves nothing twice.
        save_unacked(&eventloop, &mut saved);
        let topics: Vec<&[u8]> = saved.iter().map(|p| &p.topic[..]).collect();
        assert_eq!(
            topics,
            vec![
                &b"devices/a/replies"[..],
                &b"devices/b/replies"[..],
                &b"devices/shared"[..],
                &b"devices/shared"[..]
            ]
        );
        assert!(saved.iter().all(|p| !p.dup), "republished as new messages");
    }

    #[test]
    fn backoff_grows_to_its_ceiling_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let first = b.next();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100), "{first:?}");
        for _ in 0..20 {
            assert!(b.next() <= Duration::from_secs(5));
        }
        assert!(b.next() >= Duration::from_millis(2500));
        b.reset();
        assert!(b.next() <= Duration::from_millis(100));
    }
}
