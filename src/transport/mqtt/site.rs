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

use super::options::{OptionsError, client_options};
use crate::config::Config;
use crate::engine::Engine;
use crate::rollout::{Deployment, Rollout, SiteIn, SiteOut, StepFigures};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, LastWill, Packet, Publish};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
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

pub struct SiteLink {
    options: MqttOptions,
    prefix: String,
    node: String,
}

impl SiteLink {
    pub fn new(config: &Config) -> Result<SiteLink, OptionsError> {
        let (mqtt, node) = (&config.mqtt, config.node.id.clone());
        let client_id =
            format!("{}-site", mqtt.client_id.clone().unwrap_or_else(|| format!("edgeinfer-{node}")));
        let mut options = client_options(mqtt, &client_id, MAX_MESSAGE as u32 + 1024, 64)?;
        let prefix = mqtt.topic_prefix.clone();
        options
            // Nothing of this connection outlives it: the site's state is
            // retained, and a node that returns reads it again.
            .set_clean_start(true)
            .set_session_expiry_interval(None)
            .set_manual_acks(false)
            .set_keep_alive(Duration::from_secs(u64::from(config.site.keep_alive_s)))
            .set_last_will(LastWill::new(member_topic(&prefix, &node), "", QoS::AtLeastOnce, true, None));
        Ok(SiteLink { options, prefix, node })
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
        let (client, mut eventloop) = AsyncClient::new(self.options.clone(), 256);
        let mut members = BTreeSet::new();
        let (mut connected, mut judge) = (false, false);
        let synced_at = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(synced_at, shutdown);
        let mut awaiting_sync = false;
        loop {
            let event = tokio::select! {
                _ = &mut shutdown => break,
                () = &mut synced_at, if awaiting_sync => {
                    awaiting_sync = false;
                    rollout.site_in(SiteIn::Synced(true)).await;
                    judge = self.judge_now(rollout, &members, judge).await;
                    continue;
                }
                Some(out) = to_site.recv() => {
                    // While away, what is decided here is sent again on sync.
                    if connected {
                        self.send(&client, out);
                    }
                    continue;
                }
                event = eventloop.poll() => event,
            };
            match event {
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    connected = true;
                    let filters = ["rollout/+", "figures/+/+", "members/+"]
                        .map(|t| Filter::new(format!("{}/site/{t}", self.prefix), QoS::AtLeastOnce));
                    if let Err(e) = client.try_subscribe_many(filters) {
                        tracing::error!("site link: subscribing: {e}");
                    }
                    let member = serde_json::json!({"node": self.node}).to_string();
                    let _ = client.try_publish(
                        member_topic(&self.prefix, &self.node),
                        QoS::AtLeastOnce,
                        true,
                        member,
                    );
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    synced_at.as_mut().reset(tokio::time::Instant::now() + RETAINED_WITHIN);
                    awaiting_sync = true;
                }
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    if let Some(heard) = self.read(&publish, &mut members) {
                        rollout.site_in(heard).await;
                    } else if !awaiting_sync && connected {
                        judge = self.judge_now(rollout, &members, judge).await;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    if connected {
                        tracing::warn!("site link: {e}; serving stable alone until it is back");
                        rollout.site_in(SiteIn::Synced(false)).await;
                        if judge {
                            judge = false;
                            rollout.site_in(SiteIn::Judge(false)).await;
                        }
                    }
                    (connected, awaiting_sync) = (false, false);
                    members.clear();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        self.leave(&client, &mut eventloop).await;
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

    fn send(&self, client: &AsyncClient, out: SiteOut) {
        let (topic, qos, retain, payload) = match out {
            SiteOut::State { model, deployment } => {
                let payload = serde_json::to_vec(&*deployment).expect("a deployment is plain data");
                (format!("{}/site/rollout/{model}", self.prefix), QoS::AtLeastOnce, true, payload)
            }
            SiteOut::Figures { model, figures } => {
                let payload = serde_json::to_vec(&*figures).expect("figures are plain data");
                (
                    format!("{}/site/figures/{model}/{}", self.prefix, self.node),
                    QoS::AtMostOnce,
                    false,
                    payload,
                )
            }
        };
        if let Err(e) = client.try_publish(topic, qos, retain, payload) {
            tracing::warn!("site link: publishing: {e}");
        }
    }

    /// Removes this node from the members, so the judging moves at once.
    async fn leave(&self, client: &AsyncClient, eventloop: &mut EventLoop) {
        let _ = client.try_publish(member_topic(&self.prefix, &self.node), QoS::AtLeastOnce, true, "");
        super::disconnect(client, eventloop).await;
    }
}

fn member_topic(prefix: &str, node: &str) -> String {
    format!("{prefix}/site/members/{node}")
}
