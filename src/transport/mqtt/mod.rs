//! The MQTT 5 request/response adapter. One task owns the connection (the
//! session layer of our own, `session/`) and everything published on it
//! (the outbox); each
//! request runs in its own task and hands its reply back to that loop, which
//! sends the reply and then the request's acknowledgement, so a node that
//! dies mid-request leaves the request with the broker for redelivery.

mod acks;
mod ask;
mod control;
mod feedback;
pub mod journal;
mod options;
mod outbox;
mod replay;
pub mod session;
mod share;
mod signed;
mod site;
mod topics;

pub use ask::{AskError, ControlAsk, ask};
pub use control::ControlAuth;
pub use options::{
    BrokerAddress, OptionsError, client_options, credentials, reply_qos, session_options, tls_for,
};
pub use signed::{ControlCommand, ControlKey, KeyError, MIN_KEY_BYTES, SCHEME};
pub use site::SiteLink;
pub use topics::{ReplyRefusal, Topics, valid_reply_topic};

use crate::engine::{Engine, Envelope};
use crate::lifecycle::Heartbeat;
use crate::protocol::{Encoding, FollowUp, FollowUpTo, InferError, ReplyRoute, first_reply};
use crate::rollout::Decision;
use crate::telemetry::{State, Status};
use acks::{AckSlot, Finished, JournaledAcks};
use journal::{InFlight, Journal, Kept, Waiting};
use outbox::{Note, Outbox, Reply};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, LastWill, Publish, PublishProperties, SubscribeReasonCode};
use session::{Arrival, Backoff, Driver, Event, Session};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Semaphore, watch};

pub struct MqttService {
    engine: Arc<Engine>,
    topics: Topics,
    status: Status,
    max_in_flight: usize,
    /// `limits.max_bytes_in_flight`: the payload bytes requests may hold.
    max_bytes_in_flight: usize,
    stats_interval: Option<Duration>,
    options: session::Options,
    address: BrokerAddress,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// True while connected with our subscriptions in place; the HTTP
    /// readiness check holds the receiving end.
    ready_tx: watch::Sender<bool>,
    drain_timeout: Duration,
    heartbeat: Heartbeat,
    /// Asks for the retained status to be published again (after a reload).
    refresh: Arc<tokio::sync::Notify>,
    /// Replies after the first (async enrichment), from the cloud spool.
    follow_ups: Option<tokio::sync::mpsc::Receiver<FollowUp>>,
    /// Rollout decisions, each published once on the events topic.
    events: Option<tokio::sync::mpsc::Receiver<Decision>>,
    /// With `control.enabled`: the key commands on the control topic are
    /// signed with, and the ones already answered.
    control: Option<ControlAuth>,
    /// The share group's connection (`share.rs`), run beside this one.
    share: Option<share::ShareLink>,
    share_view: share::ShareView,
    /// The request journal (`mqtt.journal`), and what a previous run left
    /// in it unanswered.
    journal: Option<Journal>,
    replay: Vec<Waiting>,
    /// Replies the journal holds `Sent` and unconfirmed from a previous
    /// run: sent again under their packet ids.
    resend: Vec<InFlight>,
    /// `mqtt.reply_qos`.
    reply_qos: QoS,
    /// The broker is the embedded one, in this process.
    broker_in_process: bool,
}

impl MqttService {
    pub fn new(
        engine: Arc<Engine>,
        config: &crate::config::Config,
        status: Status,
    ) -> Result<(MqttService, watch::Receiver<bool>), OptionsError> {
        let mqtt = &config.mqtt;
        let topics = Topics::new(&mqtt.topic_prefix, &config.node.id, &mqtt.share_group)
            .with_reply_prefixes(&mqtt.reply_prefixes);
        let client_id = mqtt.client_id.clone().unwrap_or_else(|| format!("edgeinfer-{}", config.node.id));
        // Well above the payload limit, so an oversized request still
        // reaches the node and gets `too_large`.
        let max_packet = config.limits.max_packet_bytes as u32;
        let in_flight = mqtt.max_in_flight.min(u16::MAX as usize) as u16;
        let will =
            LastWill::new(topics.status(), status.with_state(State::Offline), QoS::AtLeastOnce, true, None);
        let options = session::Options {
            will: Some(will),
            ..session_options(mqtt, &client_id, max_packet, in_flight)?
        };
        let (ready_tx, ready_rx) = watch::channel(false);
        let share = share::ShareLink::new(config, topics.clone())?;
        Ok((
            MqttService {
                engine,
                topics,
                status,
                max_in_flight: mqtt.max_in_flight,
                max_bytes_in_flight: config.limits.max_bytes_in_flight,
                stats_interval: (config.telemetry.stats_interval_s > 0)
                    .then(|| Duration::from_secs(config.telemetry.stats_interval_s)),
                options,
                address: BrokerAddress::parse(&mqtt.url)?,
                tls: tls_for(mqtt)?,
                ready_tx,
                drain_timeout: Duration::from_secs(config.node.drain_timeout_s),
                heartbeat: Heartbeat::default(),
                refresh: Default::default(),
                follow_ups: None,
                events: None,
                control: None,
                share_view: share.view(),
                share: Some(share),
                journal: None,
                replay: Vec::new(),
                resend: Vec::new(),
                reply_qos: reply_qos(mqtt),
                broker_in_process: false,
            },
            ready_rx,
        ))
    }

    /// Publishes what arrives here to its reply route.
    pub fn with_follow_ups(mut self, rx: tokio::sync::mpsc::Receiver<FollowUp>) -> MqttService {
        self.follow_ups = Some(rx);
        self
    }

    /// Publishes each decision that arrives here on `PREFIX/NODE/events`
    /// and refreshes the retained status.
    pub fn with_events(mut self, rx: tokio::sync::mpsc::Receiver<Decision>) -> MqttService {
        self.events = Some(rx);
        self
    }

    /// Journals the requests on the node's own topic in `journal` and
    /// acknowledges them once it has them; runs `replay` (what an earlier
    /// run left unanswered) again first.
    pub fn with_journal(
        mut self,
        journal: Journal,
        replay: Vec<Waiting>,
        resend: Vec<InFlight>,
    ) -> MqttService {
        self.journal = Some(journal);
        (self.replay, self.resend) = (replay, resend);
        self
    }

    /// The broker is the embedded one: it dies with this process, so QoS 2
    /// replies would buy nothing across a crash and cost a round trip.
    pub fn with_broker_in_process(mut self) -> MqttService {
        self.broker_in_process = true;
        self
    }

    /// Takes rollout commands on `PREFIX/NODE/control` signed as `auth` checks.
    pub fn with_control(mut self, auth: ControlAuth) -> MqttService {
        self.control = Some(auth);
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
        if self.journal.is_none() && self.reply_qos == QoS::ExactlyOnce {
            // Without the journal's record of their packet ids, QoS 2 would
            // promise nothing more across a crash, and a new process could
            // send under an id the broker still holds for the old one.
            tracing::warn!(
                "mqtt.reply_qos = 2 needs the request journal (mqtt.journal); replies go at QoS 1"
            );
            self.reply_qos = QoS::AtLeastOnce;
        } else if self.broker_in_process && self.reply_qos == QoS::ExactlyOnce {
            // Its sessions die with this process: nothing to send again into.
            tracing::info!("replies go at QoS 1 to the embedded broker, which keeps nothing across a crash");
            self.reply_qos = QoS::AtLeastOnce;
        }
        let mut follow_ups = self.follow_ups.take();
        let mut events = self.events.take();
        let mut session = Session::new(self.options.clone());
        let mut outbox = Outbox::with_journal(self.journal.clone());
        let resend = std::mem::take(&mut self.resend);
        if !resend.is_empty() {
            tracing::info!(
                "sending {} journaled replies again under their packet ids (the node stopped before the \
                 broker confirmed them)",
                resend.len()
            );
            outbox.restore(&mut session, resend);
        }
        let link = Driver::new(session, self.address.host.clone(), self.address.port, self.tls.clone());
        let mut conn = Connection { link, outbox, acks: JournaledAcks::default() };
        let admission = Admission {
            requests: Arc::new(Semaphore::new(self.max_in_flight)),
            bytes: Arc::new(Semaphore::new(self.max_bytes_in_flight)),
            max_bytes: self.max_bytes_in_flight,
        };
        let (finished_tx, mut finished) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = tokio::task::JoinSet::new();
        self.replay(&mut tasks, &admission, &finished_tx, conn.outbox.max_packet());
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut awaiting_suback = false;
        // The share group rides a connection of its own (`share.rs`), which
        // stops with this loop; the node is ready once both connections'
        // subscriptions are in place.
        let share = self.share.take().expect("run takes the service");
        let mut share_joined = share.joined();
        let (share_stop, share_stopped) = tokio::sync::oneshot::channel::<()>();
        let share_task = tokio::spawn(share.run(self.engine.clone(), admission.clone(), async move {
            let _ = share_stopped.await;
        }));
        let (mut subscribed, mut session, mut share_gone) = (false, "new", false);
        tokio::pin!(shutdown);
        let mut stats_tick = tokio::time::interval(self.stats_interval.unwrap_or(Duration::from_secs(3600)));
        stats_tick.tick().await;
        // Acknowledgements that waited `SYNC_WAIT` for the journal go after
        // their replies: looked for twice a wait.
        let mut overdue = tokio::time::interval(acks::SYNC_WAIT / 2);
        overdue.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let unacknowledged = metrics::gauge!(crate::telemetry::MQTT_UNACKNOWLEDGED);
        let outbox_held = metrics::gauge!(crate::telemetry::MQTT_OUTBOX);
        loop {
            self.heartbeat.beat();
            conn.flush_journal();
            unacknowledged.set(conn.link.session().awaiting_acknowledgement() as f64);
            outbox_held.set(conn.outbox.len() as f64);
            if !conn.link.is_open() {
                let connecting = tokio::select! {
                    _ = &mut shutdown => break,
                    connected = conn.link.connect() => connected,
                };
                if let Err(e) = connecting {
                    let wait = backoff.next_wait();
                    self.lost(&e.to_string(), wait, (&mut awaiting_suback, &mut subscribed));
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            }
            let event = tokio::select! {
                _ = &mut shutdown => break,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
                Some(done) = finished.recv() => {
                    conn.finished(done);
                    continue;
                }
                _ = journal_synced(&self.journal), if !conn.acks.is_empty() => {
                    conn.acknowledge_synced(&self.journal);
                    continue;
                }
                _ = overdue.tick(), if !conn.acks.is_empty() => {
                    conn.acks.overdue(std::time::Instant::now(), conn.link.session());
                    continue;
                }
                // Only while connected: while the broker is away they wait
                // upstream, in bounded channels and then in the spool.
                Some(follow_up) = next_follow_up(&mut follow_ups), if conn.link.is_connected() => {
                    // Its provisional reply was handed on before it came
                    // (`FirstReply`): publish that first.
                    while let Ok(done) = finished.try_recv() {
                        conn.finished(done);
                    }
                    let props = PublishProperties {
                        correlation_data: follow_up.route.correlation.map(Into::into),
                        content_type: follow_up.route.content_type,
                        ..Default::default()
                    };
                    let publish =
                        Publish::new(follow_up.route.topic, self.reply_qos, follow_up.payload, Some(props));
                    conn.publish(publish, Note::FollowUp(follow_up.delivery));
                    continue;
                }
                // While the broker is away they wait in their channel.
                Some(decision) = next_event(&mut events), if conn.link.is_connected() => {
                    self.publish_event(&mut conn, &decision);
                    if *self.ready_tx.borrow() {
                        self.publish_status(&mut conn, State::Online);
                    }
                    continue;
                }
                _ = self.refresh.notified() => {
                    if *self.ready_tx.borrow() {
                        self.publish_status(&mut conn, State::Online);
                    }
                    continue;
                }
                _ = stats_tick.tick(), if self.stats_interval.is_some() => {
                    self.publish_stats(&mut conn).await;
                    continue;
                }
                changed = share_joined.changed(), if !share_gone && conn.link.is_connected() => {
                    share_gone = changed.is_err();
                    let joined = !share_gone && *share_joined.borrow();
                    self.update_ready(&mut conn, subscribed, joined, session);
                    continue;
                }
                event = conn.link.next() => event,
            };
            match event {
                Event::Connected { session_present } => {
                    backoff.reset();
                    conn.outbox.set_max_packet(conn.link.session().peer_max_packet());
                    if !session_present {
                        // The broker lost our session: the requests it held
                        // for us are gone with their packet ids (the session
                        // forgot them); our replies go again as new messages.
                        self.subscribe(conn.link.session());
                        awaiting_suback = true;
                    } else {
                        // The session resumed with its subscriptions, and
                        // the session layer resends the unconfirmed replies.
                        // The control topic follows the config in service,
                        // not the one the session was made with.
                        self.resubscribe_switched_topics(conn.link.session());
                        self.leave_share_on_own_session(conn.link.session());
                        self.resubscribe_own_topic(conn.link.session());
                        (subscribed, session) = (true, "resumed");
                        self.update_ready(&mut conn, subscribed, *share_joined.borrow(), session);
                    }
                }
                Event::Subscribed { codes, .. } => {
                    if codes.iter().any(|c| !matches!(c, SubscribeReasonCode::Success(_))) {
                        tracing::error!("the broker refused a subscription: {codes:?}; not ready");
                    } else if std::mem::take(&mut awaiting_suback) {
                        // Ready only now: a request published before the
                        // broker took the subscription would reach no one.
                        (subscribed, session) = (true, "new");
                        self.update_ready(&mut conn, subscribed, *share_joined.borrow(), session);
                    }
                }
                // The session hands each request over once: a re-send of
                // one it holds or took is not a new one.
                Event::Publish { arrival, publish } if publish.topic == self.topics.control().as_bytes() => {
                    let slot = AckSlot::new(arrival, finished_tx.clone());
                    // Control off: a subscription left from an earlier
                    // run may still bring one; it gets nothing.
                    let Some(auth) = self.control.clone() else {
                        slot.send(None);
                        continue;
                    };
                    // Bounded like requests; one over the bound is answered `overloaded`.
                    let admitted = admission.admit(publish.payload.len());
                    let task = control::ControlTask {
                        engine: self.engine.clone(),
                        topics: self.topics.clone(),
                        auth,
                    };
                    tasks.spawn(async move {
                        slot.send(task.handle(&publish, admitted.is_ok()).await);
                        drop(admitted);
                    });
                }
                Event::Publish { arrival, publish } if self.topics.feedback_of(&publish.topic).is_some() => {
                    let slot = AckSlot::new(arrival, finished_tx.clone());
                    let addressed = self.topics.feedback_of(&publish.topic).expect("matched");
                    let admitted = admission.admit(publish.payload.len());
                    let task =
                        feedback::FeedbackTask { engine: self.engine.clone(), topics: self.topics.clone() };
                    tasks.spawn(async move {
                        slot.send(task.handle(&publish, addressed, admitted.is_ok()).await);
                        drop(admitted);
                    });
                }
                Event::Publish { arrival, publish } => {
                    let admitted = admission.admit(publish.payload.len());
                    // The node's own topic only: a share group's request an
                    // old session still delivers here stays unacknowledged
                    // until answered. A refused one is answered at once.
                    let own = self.topics.is_node_request(&publish.topic);
                    let journal = own && publish.qos != QoS::AtMostOnce && admitted.is_ok();
                    let Some((arrival, journaled)) = conn.keep(&publish, arrival, journal) else { continue };
                    let slot = AckSlot::new(arrival, finished_tx.clone());
                    let task = RequestTask {
                        engine: self.engine.clone(),
                        topics: self.topics.clone(),
                        max_reply: conn.outbox.max_packet(),
                        reply_qos: self.reply_qos,
                        journaled,
                    };
                    tasks.spawn(async move {
                        let refusal = admitted.as_ref().err().cloned();
                        task.handle(*publish, refusal, slot, admitted).await;
                    });
                }
                Event::Closed(why) => {
                    let wait = backoff.next_wait();
                    self.lost(&why.to_string(), wait, (&mut awaiting_suback, &mut subscribed));
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                other => conn.outbox.settled(&other),
            }
        }
        // The share group is left first (its loop unsubscribes at once) and
        // drains beside this connection.
        let _ = share_stop.send(());
        let share_drained = async {
            if let Err(e) = share_task.await {
                tracing::error!("the share group's loop ended: {e}");
            }
        };
        tokio::join!(self.drain(&mut conn, &mut tasks, &mut finished), share_drained);
        let offline = self.status_now().snapshot(State::Offline, self.engine.live());
        let mut publish = Publish::new(self.topics.status(), QoS::AtLeastOnce, offline, None);
        publish.retain = true;
        conn.publish(publish, Note::Status);
        // Whatever events wait, `Driver::flush` writes what is queued: the
        // records first.
        conn.outbox.flush_journal(conn.link.session());
        // Its last words, and a clean DISCONNECT (no will over them), in 2 s at most.
        if conn.link.is_open() {
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.link.flush()).await;
            conn.link.disconnect().await;
        }
    }

    /// Runs the journaled requests an earlier run left unanswered, oldest
    /// first, each as admission allows (they wait for room rather than
    /// being refused); their replies wait in the session until connected.
    fn replay(
        &mut self,
        tasks: &mut tokio::task::JoinSet<()>,
        admission: &Admission,
        finished_tx: &tokio::sync::mpsc::UnboundedSender<Finished>,
        max_reply: Arc<AtomicUsize>,
    ) {
        let replay = std::mem::take(&mut self.replay);
        if replay.is_empty() {
            return;
        }
        tracing::info!(
            "running {} journaled requests again (the node stopped before their reply was confirmed)",
            replay.len()
        );
        metrics::counter!(crate::telemetry::JOURNAL_REPLAYED).increment(replay.len() as u64);
        // In their order: each is admitted once the one before it was.
        let mut before: Option<tokio::sync::oneshot::Receiver<()>> = None;
        for waiting in replay {
            let publish = waiting.request.to_publish();
            let task = RequestTask {
                engine: self.engine.clone(),
                topics: self.topics.clone(),
                max_reply: max_reply.clone(),
                reply_qos: self.reply_qos,
                journaled: Some(waiting.seq),
            };
            let (admission, slot) = (admission.clone(), AckSlot::new(None, finished_tx.clone()));
            let (admitted_tx, admitted_rx) = tokio::sync::oneshot::channel();
            let turn = before.replace(admitted_rx);
            tasks.spawn(async move {
                if let Some(turn) = turn {
                    let _ = turn.await;
                }
                let admitted = admission.wait(publish.payload.len()).await;
                let _ = admitted_tx.send(());
                task.handle(publish, None, slot, admitted).await;
            });
        }
    }

    /// The connection is gone (or never came): not ready, and why; the
    /// next try in `wait`.
    fn lost(&self, why: &str, wait: Duration, pending: (&mut bool, &mut bool)) {
        self.ready_tx.send_replace(false);
        (*pending.0, *pending.1) = (false, false);
        metrics::gauge!(crate::telemetry::MQTT_CONNECTED).set(0.0);
        metrics::counter!(crate::telemetry::MQTT_RECONNECTS).increment(1);
        tracing::warn!("MQTT connection: {why}; reconnecting in {} ms", wait.as_millis());
    }

    /// Finishes the requests in flight while the connection keeps carrying
    /// their replies, and waits for the broker to confirm what the outbox
    /// holds and for the journal to sync what it took (their
    /// acknowledgements go then, or after their replies if the sync takes
    /// over `SYNC_WAIT`); requests arriving meanwhile are left
    /// unacknowledged.
    /// Follow-ups not confirmed by then stay in the spool for the next
    /// start.
    async fn drain(
        &self,
        conn: &mut Connection,
        tasks: &mut tokio::task::JoinSet<()>,
        finished: &mut tokio::sync::mpsc::UnboundedReceiver<Finished>,
    ) {
        self.ready_tx.send_replace(false);
        self.publish_status(conn, State::Draining);
        let running = tasks.len();
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        let mut held_back = 0usize;
        loop {
            // A task sends its reply before it ends: take what is there
            // before deciding nothing is left.
            while let Ok(done) = finished.try_recv() {
                conn.finished(done);
            }
            conn.flush_journal();
            // A sync that hangs holds the drain no longer than the loop.
            conn.acks.overdue(std::time::Instant::now(), conn.link.session());
            if tasks.is_empty() && conn.outbox.len() == 0 && conn.acks.is_empty() {
                break;
            }
            if !conn.link.is_open() {
                let reconnecting = tokio::select! {
                    connected = conn.link.connect() => connected,
                    _ = tokio::time::sleep_until(deadline) => break,
                };
                if reconnecting.is_err() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
            tokio::select! {
                _ = tasks.join_next(), if !tasks.is_empty() => {}
                Some(done) = finished.recv() => conn.finished(done),
                _ = journal_synced(&self.journal), if !conn.acks.is_empty() => {
                    conn.acknowledge_synced(&self.journal);
                }
                _ = tokio::time::sleep(acks::SYNC_WAIT / 4), if !conn.acks.is_empty() => {}
                event = conn.link.next() => match event {
                    // Left with the broker: never acknowledged.
                    Event::Publish { .. } => held_back += 1,
                    Event::Closed(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    other => conn.outbox.settled(&other),
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let unfinished = tasks.len();
        tasks.abort_all();
        tracing::info!(
            "drained: {} of {running} requests in flight finished; {unfinished} unfinished and {held_back} \
             arrived while draining, left with the broker for redelivery",
            running - unfinished
        );
    }

    /// A rollout decision on the events topic: QoS 1, not retained.
    fn publish_event(&self, conn: &mut Connection, decision: &Decision) {
        let mut event = serde_json::to_value(decision).expect("a decision is plain data");
        event["node"] = self.status.node.clone().into();
        let payload = event.to_string();
        let publish = Publish::new(self.topics.events(), QoS::AtLeastOnce, payload, None);
        conn.publish(publish, Note::Event);
    }

    /// The retained status, through the outbox.
    fn publish_status(&self, conn: &mut Connection, state: State) {
        let status = self.status_now().snapshot(state, self.engine.live());
        let mut publish = Publish::new(self.topics.status(), QoS::AtLeastOnce, status, None);
        publish.retain = true;
        conn.publish(publish, Note::Status);
    }

    /// The status with the share group's connection as it is now.
    fn status_now(&self) -> Status {
        Status { share_group: Some(self.share_view.status()), ..self.status.clone() }
    }

    /// The periodic `stats` message, and the retained status refreshed with
    /// uptime and request counts, for fleets that cannot scrape.
    async fn publish_stats(&self, conn: &mut Connection) {
        let interval = self.stats_interval.unwrap_or(Duration::from_secs(1));
        let stats = serde_json::json!({
            "node": self.status.node,
            "interval_s": interval.as_secs(),
            "models": self.engine.take_stats(interval).await,
        });
        if conn.link.is_connected() {
            // QoS 0: on this connection or not at all.
            let stats = Publish::new(self.topics.stats(), QoS::AtMostOnce, stats.to_string(), None);
            let _ = conn.link.session().publish(stats);
        }
        if *self.ready_tx.borrow() {
            self.publish_status(conn, State::Online);
        }
    }

    /// Every filter in one SUBSCRIBE, so one SUBACK confirms them; the
    /// control topic only with `control.enabled`, the feedback topics only
    /// with `feedback.enabled`. The share group is not among them: it rides
    /// its own connection (`share.rs`).
    fn subscribe(&self, session: &mut Session) {
        let mut topics = vec![self.topics.node_requests()];
        if self.control.is_some() {
            topics.push(self.topics.control());
        }
        if self.engine.takes_feedback() {
            topics.extend([self.topics.feedback(), self.topics.site_feedback()]);
        }
        session.subscribe(topics.into_iter().map(|f| Filter::new(f, QoS::AtLeastOnce)).collect());
    }

    /// On a resumed session: the control and feedback topics subscribed
    /// exactly when they are on (a restart may have turned them on or off).
    fn resubscribe_switched_topics(&self, session: &mut Session) {
        let switched = [
            (vec![self.topics.control()], self.control.is_some()),
            (vec![self.topics.feedback(), self.topics.site_feedback()], self.engine.takes_feedback()),
        ];
        for (topics, on) in switched {
            match on {
                true => {
                    session.subscribe(topics.into_iter().map(|t| Filter::new(t, QoS::AtLeastOnce)).collect())
                }
                false => session.unsubscribe(topics),
            };
        }
    }

    /// On a resumed session too: a session whose first connection broke
    /// before its SUBSCRIBE resumes without the subscription. Subscribing
    /// again replaces it and loses nothing queued [MQTT-3.8.4-3].
    fn resubscribe_own_topic(&self, session: &mut Session) {
        session.subscribe(vec![Filter::new(self.topics.node_requests(), QoS::AtLeastOnce)]);
    }

    /// A session resumed from before issue 42 may still hold the share
    /// group, which would keep a dead node's place in it for
    /// `mqtt.session_expiry_s`: dropped (a no-op once it is gone).
    fn leave_share_on_own_session(&self, session: &mut Session) {
        session.unsubscribe(vec![self.topics.shared_requests()]);
    }

    /// Ready while this connection's subscriptions and the share group's
    /// are both in place; the status says so whenever that changes.
    fn update_ready(&self, conn: &mut Connection, subscribed: bool, share_joined: bool, session: &str) {
        let was = *self.ready_tx.borrow();
        if subscribed && share_joined && !was {
            self.announce_ready(conn, session);
        } else if subscribed && !share_joined {
            metrics::gauge!(crate::telemetry::MQTT_CONNECTED).set(1.0);
            if was {
                self.ready_tx.send_replace(false);
                self.publish_status(conn, State::Online);
                tracing::warn!(
                    "not ready: the share group's connection is down; serving {} only",
                    self.topics.node_requests()
                );
            }
        }
    }

    /// Subscriptions are in place: status online, readiness, one log line.
    fn announce_ready(&self, conn: &mut Connection, session: &str) {
        self.publish_status(conn, State::Online);
        metrics::gauge!(crate::telemetry::MQTT_CONNECTED).set(1.0);
        self.ready_tx.send_replace(true);
        tracing::info!(
            "MQTT connected (session {session}); serving {} and {}",
            self.topics.node_requests(),
            self.topics.shared_requests()
        );
    }
}

/// The connection as the loop holds it: the session on its socket, the
/// notes of what it published and the journaled requests' place in line.
struct Connection {
    link: Driver,
    outbox: Outbox,
    acks: JournaledAcks,
}

impl Connection {
    /// What the outbox recorded in the journal is written before the
    /// driver writes what it is about: called before each turn of the
    /// driver. Not while the session has events for the loop (the driver
    /// hands those over before it writes): one write for what the socket
    /// brought.
    fn flush_journal(&mut self) {
        if !self.link.session().has_events() && !self.outbox.flush_journal(self.link.session()) {
            self.acks.not_written(self.link.session());
        }
    }

    /// Journals a request when `journal` says it may be (its place in
    /// line then waits here for the sync): answers the arrival its task
    /// acknowledges after its reply (none once journaled) and its seq, or
    /// `None` for a re-delivery of a request the journal holds or
    /// answered, acknowledged here and not run again.
    fn keep(
        &mut self,
        publish: &Publish,
        arrival: Option<Arrival>,
        journal: bool,
    ) -> Option<(Option<Arrival>, Option<u64>)> {
        let kept = if journal { self.outbox.keep(publish) } else { Kept::NotKept };
        match kept {
            Kept::Duplicate => {
                tracing::debug!("a re-delivery of a journaled request; acknowledged, not run again");
                if let Some(arrival) = arrival {
                    self.link.session().acknowledge(arrival);
                }
                None
            }
            Kept::Journaled { seq } => {
                if let Some(arrival) = arrival {
                    self.acks.push(seq, arrival);
                }
                Some((None, Some(seq)))
            }
            Kept::NotKept => Some((arrival, None)),
        }
    }

    /// The journal's sync got further: the requests it made durable are
    /// acknowledged, in arrival order.
    fn acknowledge_synced(&mut self, journal: &Option<Journal>) {
        if let Some(journal) = journal {
            self.acks.synced(journal.synced_through(), self.link.session());
        }
    }

    fn publish(&mut self, publish: Publish, note: Note) {
        self.outbox.publish(self.link.session(), publish, note);
    }

    /// A request finished: its reply goes out, then (once the reply is
    /// written) its acknowledgement, in arrival order.
    fn finished(&mut self, done: Finished) {
        if done.reply.is_none() && done.journaled.is_some() {
            // Dropped, with nowhere to reply: nothing more to do for it.
            self.outbox.answered(done.journaled);
        }
        let reply = done.reply.and_then(|Reply { publish, id }| {
            let note = Note::Reply { id, first: done.first, journaled: done.journaled };
            self.outbox.publish(self.link.session(), publish, note)
        });
        if let Some(arrival) = done.arrival {
            self.link.session().acknowledge_after(arrival, reply);
        }
        if let Some(seq) = done.journaled {
            self.acks.replied(seq, reply, self.link.session());
        }
    }
}

/// Resolves when the journal's sync got further, or never without one.
async fn journal_synced(journal: &Option<Journal>) {
    match journal {
        Some(journal) => journal.synced().await,
        None => std::future::pending().await,
    }
}

/// The next rollout decision, or never without a rollout.
async fn next_event(rx: &mut Option<tokio::sync::mpsc::Receiver<Decision>>) -> Option<Decision> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The next follow-up, or never when there is no spool.
async fn next_follow_up(rx: &mut Option<tokio::sync::mpsc::Receiver<FollowUp>>) -> Option<FollowUp> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// What requests may hold at once: a count (`mqtt.max_in_flight`) and
/// payload bytes (`limits.max_bytes_in_flight`).
#[derive(Clone)]
struct Admission {
    requests: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    /// `bytes`' size.
    max_bytes: usize,
}

type Admitted = (tokio::sync::OwnedSemaphorePermit, tokio::sync::OwnedSemaphorePermit);

impl Admission {
    /// Permits for a request of `len` payload bytes, or the `overloaded`
    /// error that names the limit it would cross.
    fn admit(&self, len: usize) -> Result<Admitted, InferError> {
        let request =
            self.requests.clone().try_acquire_owned().map_err(|_| {
                InferError::overloaded("the node is at mqtt.max_in_flight requests; retry later")
            })?;
        let bytes = u32::try_from(len.max(1))
            .ok()
            .and_then(|n| self.bytes.clone().try_acquire_many_owned(n).ok())
            .ok_or_else(|| {
                InferError::overloaded(format!(
                    "the node holds limits.max_bytes_in_flight bytes of requests and this one has {len}; \
                     retry later"
                ))
            })?;
        Ok((request, bytes))
    }

    /// Permits for a request of `len` payload bytes, once there is room.
    async fn wait(&self, len: usize) -> Admitted {
        let request = self.requests.clone().acquire_owned().await.expect("never closed");
        let n = len.clamp(1, self.max_bytes.max(1)).min(u32::MAX as usize) as u32;
        let bytes = self.bytes.clone().acquire_many_owned(n).await.expect("never closed");
        (request, bytes)
    }
}

/// The W3C trace context of an MQTT 5 request (user properties
/// `traceparent`, `tracestate`).
fn trace_context(properties: &[(String, String)]) -> crate::trace::Caller<'_> {
    let find = |name: &str| properties.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    crate::trace::Caller { traceparent: find("traceparent"), tracestate: find("tracestate") }
}

struct RequestTask {
    engine: Arc<Engine>,
    topics: Topics,
    max_reply: Arc<AtomicUsize>,
    /// `mqtt.reply_qos`.
    reply_qos: QoS,
    /// The journal's seq of the request (kept by the loop, or run again at
    /// a start): whatever becomes of it ends it in the journal.
    journaled: Option<u64>,
}

impl RequestTask {
    /// Answers one request, handing its reply (or none, with nowhere to
    /// send one) back to the loop, which acknowledges the request after it.
    /// `admitted` (its admission permits) goes with the reply.
    async fn handle<A>(self, publish: Publish, refusal: Option<InferError>, mut ack: AckSlot, admitted: A) {
        if let Some(seq) = self.journaled {
            // Even dropped, for a reply topic the config no longer allows.
            ack.journaled(seq);
        }
        let topic = String::from_utf8_lossy(&publish.topic).into_owned();
        let props = publish.properties.clone().unwrap_or_default();
        let encoding = Encoding::from_content_type(props.content_type.as_deref());
        let model = self.topics.model_of(&topic);
        // Read the payload once: fully for a request we will run, only its
        // id and reply_to for one we refuse. An MQTT 3.1.1 request names
        // its reply topic in the payload.
        let decoded = match (&refusal, model) {
            (None, Some(_)) => Ok(self.engine.decode(&publish.payload, encoding)),
            _ => Err(crate::engine::peek(&publish.payload, encoding)),
        };
        let (id, reply_to) = match &decoded {
            Ok(d) => (&d.id, &d.reply_to),
            Err(peek) => (&peek.id, &peek.reply_to),
        };
        let destination = props.response_topic.clone().or_else(|| reply_to.clone());
        let refused = match destination.as_deref().map(|d| self.topics.check_reply(d)) {
            None | Some(Err(ReplyRefusal::Invalid)) => {
                metrics::counter!(crate::telemetry::MQTT_NO_REPLY_TOPIC).increment(1);
                Some("has no valid reply topic")
            }
            Some(Err(refusal)) => {
                metrics::counter!(crate::telemetry::MQTT_REPLY_TOPICS_REFUSED, "reason" => refusal.as_str())
                    .increment(1);
                Some("names a reply topic replies may not go to")
            }
            Some(Ok(())) => None,
        };
        let (Some(destination), None) = (destination, refused) else {
            tracing::debug!(id = %id, "request on {topic} {}; dropped", refused.unwrap_or_default());
            ack.send(None);
            return;
        };
        // A device is its reply topic: each has its own, and keeps it.
        let device = Some(destination.as_str());
        let trace = trace_context(&props.user_properties);
        let envelope = Envelope { transport: "mqtt", device, trace, ..Envelope::model(model.unwrap_or("")) };
        let mut first_reply_pending = None;
        let reply = match (decoded, refusal) {
            (Ok(decoded), _) => {
                let route = ReplyRoute {
                    topic: destination.clone(),
                    correlation: props.correlation_data.as_ref().map(|c| c.to_vec()),
                    content_type: props.content_type.clone(),
                };
                let (pending, after) = first_reply();
                first_reply_pending = Some(pending);
                let route = FollowUpTo { route, after };
                let deadline = props.message_expiry_interval.map(|s| Duration::from_secs(s as u64));
                let envelope = Envelope { deadline, follow_up: Some(&route), ..envelope };
                self.engine.answer(envelope, decoded, encoding).await
            }
            (Err(peek), Some(refusal)) => self.engine.reject(envelope, peek.id, encoding, refusal),
            (Err(peek), None) => self.engine.reject(
                envelope,
                peek.id,
                encoding,
                InferError::unknown_model(format!("topic {topic} does not name a model")),
            ),
        };
        if let Err(code) = reply.outcome {
            tracing::debug!(id = %reply.id, "request on {topic} answered {code}");
        }
        let publishing = std::time::Instant::now();
        // The device can log the trace its request joined.
        let user_properties = match &reply.trace {
            Some(trace) => vec![("traceresponse".to_string(), trace.traceresponse())],
            None => Vec::new(),
        };
        let reply_props = PublishProperties {
            correlation_data: props.correlation_data.clone(),
            content_type: props.content_type.clone(),
            user_properties,
            ..Default::default()
        };
        let mut publish = Publish::new(destination, self.reply_qos, reply.payload, Some(reply_props));
        let max = self.max_reply.load(Ordering::Relaxed);
        if publish.size() > max {
            // Sent as it is, it would fail the write and drop the connection.
            let error = InferError::too_large(format!(
                "the reply has {} bytes, more than the broker's Maximum Packet Size {max}; \
                 send fewer rows per request",
                publish.size()
            ));
            publish.payload = crate::protocol::codec::encode_reply(&reply.id, Err(error), encoding).into();
        }
        // A follow-up to this request goes out only once the session has this
        // reply: the outbox releases the guard then.
        ack.send_reply(Reply { publish, id: reply.id }, first_reply_pending);
        if let Some(trace) = &reply.trace {
            trace.span("reply.publish", publishing);
        }
        // Let go with the reply: what waits for the journal's sync is
        // bounded by the broker's window, not by `mqtt.max_in_flight`.
        drop(admitted);
    }
}
