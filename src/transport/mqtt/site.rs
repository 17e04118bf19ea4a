//! The site link (`site.rollout`): a second MQTT connection, apart from the
//! request path, with a clean session and a short keep alive, over which
//! the nodes of a site share one rollout per model:
//!
//! - `PREFIX/site/rollout/MODEL` (retained, QoS 1): the site's deployment
//!   of the model; every node adopts it when newer (`rollout::site`);
//! - `PREFIX/site/figures/MODEL/NODE` (QoS 0, once a second): a node's
//!   figures of the running step, which the judge pools;
//! - `PREFIX/site/members/NODE` (retained): the node is online. Its will
//!   (retained, empty) removes it when the connection dies: at once on a
//!   TCP reset, after 1.5 x `site.keep_alive_s` on a silent death.
//!
//! The member with the smallest node id judges. A node that is not
//! connected, or not yet past the retained messages, serves stable alone.

use super::options::{BrokerAddress, OptionsError, session_options, tls_for};
use super::session::{Driver, Event, Options, Session};
use crate::config::Config;
use crate::engine::Engine;
use crate::rollout::{Deployment, Rollout, SiteIn, SiteOut, StepFigures};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, LastWill, Publish};
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// After the subscriptions are confirmed, how long the retained messages
/// may take to arrive before the node counts itself synced.
const RETAINED_WITHIN: Duration = Duration::from_millis(500);
/// The largest site message read: a deployment with its history, or a
/// step's figures. Larger ones are dropped.
const MAX_MESSAGE: usize = 256 * 1024;
/// How long a lost connection waits before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The first MQTT connection of the node on its own session layer
/// (issue 36, `super::session`): no session kept, QoS 1 and 0 out, the
/// site's retained messages in.
pub struct SiteLink {
    options: Options,
    address: BrokerAddress,
    tls: Option<Arc<rustls::ClientConfig>>,
    prefix: String,
    node: String,
}

/// What woke the link's loop.
enum Wake {
    Stop,
    Synced,
    Out(SiteOut),
    Session(Event),
}

impl SiteLink {
    pub fn new(config: &Config) -> Result<SiteLink, OptionsError> {
        let (mqtt, node) = (&config.mqtt, config.node.id.clone());
        let client_id =
            format!("{}-site", mqtt.client_id.clone().unwrap_or_else(|| format!("edgeinfer-{node}")));
        let prefix = mqtt.topic_prefix.clone();
        let keep_alive = Duration::from_secs(u64::from(config.site.keep_alive_s));
        let will = LastWill::new(member_topic(&prefix, &node), "", QoS::AtLeastOnce, true, None);
        let options = Options {
            keep_alive,
            ping_timeout: keep_alive,
            // Nothing of this connection outlives it: the site's state is
            // retained, and a node that returns reads it again.
            clean_start: true,
            session_expiry_s: 0,
            will: Some(will),
            ..session_options(mqtt, &client_id, MAX_MESSAGE as u32 + 1024, 64)?
        };
        Ok(SiteLink { options, address: BrokerAddress::parse(&mqtt.url)?, tls: tls_for(mqtt)?, prefix, node })
    }

    /// Carries `to_site` out and what the site says in to `rollout`, until
    /// `shutdown`; then leaves the site (its member record removed) first.
    pub async fn run(
        self,
        engine: Arc<Engine>,
        mut to_site: mpsc::Receiver<SiteOut>,
        shutdown: impl Future<Output = ()>,
    ) {
        let Some(rollout) = engine.rollout() else { return };
        let session = Session::new(self.options.clone());
        let mut link = Driver::new(session, self.address.host.clone(), self.address.port, self.tls.clone());
        let mut members = BTreeSet::new();
        let (mut connected, mut judge) = (false, false);
        let synced_at = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(synced_at, shutdown);
        let (mut awaiting_sync, mut said_down) = (false, false);
        loop {
            if !link.is_open() {
                let connecting = tokio::select! {
                    _ = &mut shutdown => break,
                    connected = link.connect() => connected,
                };
                if let Err(e) = connecting {
                    // Once until it is back: a broker that is away is retried every second.
                    if !std::mem::replace(&mut said_down, true) {
                        tracing::warn!("site link: connecting: {e}; serving stable alone until it is back");
                    }
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(RETRY_AFTER) => continue,
                    }
                }
            }
            let wake = tokio::select! {
                _ = &mut shutdown => Wake::Stop,
                () = &mut synced_at, if awaiting_sync => Wake::Synced,
                Some(out) = to_site.recv() => Wake::Out(out),
                event = link.next() => Wake::Session(event),
            };
            match wake {
                Wake::Stop => break,
                Wake::Synced => {
                    awaiting_sync = false;
                    rollout.site_in(SiteIn::Synced(true)).await;
                    judge = self.judge_now(rollout, &members, judge).await;
                }
                // While away, what is decided here is sent again on sync.
                Wake::Out(out) if connected => self.send(link.session(), out),
                Wake::Out(_) => {}
                Wake::Session(Event::Connected { .. }) => {
                    (connected, said_down) = (true, false);
                    let filters = ["rollout/+", "figures/+/+", "members/+"]
                        .map(|t| Filter::new(format!("{}/site/{t}", self.prefix), QoS::AtLeastOnce));
                    link.session().subscribe(filters.to_vec());
                    let member = serde_json::json!({"node": self.node}).to_string();
                    self.publish(
                        link.session(),
                        member_topic(&self.prefix, &self.node),
                        QoS::AtLeastOnce,
                        true,
                        member,
                    );
                }
                Wake::Session(Event::Subscribed { .. }) => {
                    synced_at.as_mut().reset(tokio::time::Instant::now() + RETAINED_WITHIN);
                    awaiting_sync = true;
                }
                Wake::Session(Event::Publish { arrival, publish }) => {
                    // Nothing here needs redelivery: acknowledged as read.
                    if let Some(arrival) = arrival {
                        link.session().acknowledge(arrival);
                    }
                    if let Some(heard) = self.read(&publish, &mut members) {
                        rollout.site_in(heard).await;
                    } else if !awaiting_sync && connected {
                        judge = self.judge_now(rollout, &members, judge).await;
                    }
                }
                Wake::Session(Event::Closed(why)) => {
                    if connected {
                        said_down = true;
                        tracing::warn!("site link: {why}; serving stable alone until it is back");
                        rollout.site_in(SiteIn::Synced(false)).await;
                        if judge {
                            judge = false;
                            rollout.site_in(SiteIn::Judge(false)).await;
                        }
                    }
                    (connected, awaiting_sync) = (false, false);
                    members.clear();
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(RETRY_AFTER) => {}
                    }
                }
                Wake::Session(_) => {}
            }
        }
        if connected {
            self.leave(&mut link).await;
        }
    }

    /// A site message as the owner thread takes it; `None` for a member
    /// coming or going (kept in `members`) and for what is not ours.
    fn read(&self, publish: &Publish, members: &mut BTreeSet<String>) -> Option<SiteIn> {
        let topic = std::str::from_utf8(&publish.topic).ok()?;
        let rest = topic.strip_prefix(&self.prefix)?.strip_prefix("/site/")?;
        let parts: Vec<&str> = rest.split('/').collect();
        if publish.payload.len() > MAX_MESSAGE {
            tracing::warn!(
                "site link: {topic}: {} bytes, over {MAX_MESSAGE}; dropped",
                publish.payload.len()
            );
            return None;
        }
        match parts.as_slice() {
            ["members", node] => {
                if publish.payload.is_empty() {
                    members.remove(*node);
                } else {
                    members.insert(node.to_string());
                }
                None
            }
            ["rollout", model] if !publish.payload.is_empty() => {
                match serde_json::from_slice::<Deployment>(&publish.payload) {
                    Ok(deployment) => {
                        Some(SiteIn::State { model: model.to_string(), deployment: Box::new(deployment) })
                    }
                    Err(e) => {
                        tracing::warn!("site link: {topic}: not a deployment ({e}); ignored");
                        None
                    }
                }
            }
            ["figures", model, node] if *node != self.node => {
                let figures = serde_json::from_slice::<StepFigures>(&publish.payload).ok()?;
                Some(SiteIn::Figures {
                    node: node.to_string(),
                    model: model.to_string(),
                    figures: Box::new(figures),
                })
            }
            _ => None,
        }
    }

    /// Tells the owner whether this node judges now, when that changed.
    async fn judge_now(&self, rollout: &Rollout, members: &BTreeSet<String>, was: bool) -> bool {
        let judge =
            crate::rollout::site::judge(members.iter().map(String::as_str)) == Some(self.node.as_str());
        if judge != was {
            rollout.site_in(SiteIn::Judge(judge)).await;
        }
        judge
    }

    fn send(&self, session: &mut Session, out: SiteOut) {
        match out {
            SiteOut::State { model, deployment } => {
                let payload = serde_json::to_vec(&*deployment).expect("a deployment is plain data");
                let topic = format!("{}/site/rollout/{model}", self.prefix);
                self.publish(session, topic, QoS::AtLeastOnce, true, payload);
            }
            SiteOut::Figures { model, figures } => {
                let payload = serde_json::to_vec(&*figures).expect("figures are plain data");
                let topic = format!("{}/site/figures/{model}/{}", self.prefix, self.node);
                self.publish(session, topic, QoS::AtMostOnce, false, payload);
            }
        }
    }

    fn publish(
        &self,
        session: &mut Session,
        topic: String,
        qos: QoS,
        retain: bool,
        payload: impl Into<bytes::Bytes>,
    ) {
        let mut publish = Publish::new(topic, qos, payload.into(), None);
        publish.retain = retain;
        if let Err(e) = session.publish(publish) {
            tracing::warn!("site link: publishing: {e}");
        }
    }

    /// Removes this node from the members, so the judging moves at once:
    /// the empty record confirmed (at most 2 s), then a clean DISCONNECT,
    /// so the will is not published over it.
    async fn leave(&self, link: &mut Driver) {
        self.publish(link.session(), member_topic(&self.prefix, &self.node), QoS::AtLeastOnce, true, "");
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while link.session().unconfirmed() > 0 {
                if let Event::Closed(_) = link.next().await {
                    return;
                }
            }
        })
        .await;
        link.disconnect().await;
    }
}

fn member_topic(prefix: &str, node: &str) -> String {
    format!("{prefix}/site/members/{node}")
}
