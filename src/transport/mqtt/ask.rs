//! The sender's side of the control topic (`edgeinfer models ...
//! --via-mqtt`): signs a command with the key in `control.key_file`,
//! publishes it on the node's `PREFIX/NODE/control` through the broker at
//! `mqtt.url` (with the config's login and TLS), and waits a bounded time
//! for the node's answer on a reply topic of its own.

use super::options::{OptionsError, client_options};
use super::signed::{ControlCommand, ControlKey, KeyError, Unsignable};
use super::topics::Topics;
use crate::config::Config;
use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, PublishProperties, SubscribeReasonCode};
use rumqttc::v5::{AsyncClient, Event};
use serde_json::Value;
use std::time::Duration;

/// How long the answer is waited for: the node answers a command within
/// 5 s even on a hung disk (`overloaded`), so this leaves the broker 5 s.
pub const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// One command for one node.
pub struct ControlAsk {
    /// NODE in the node's topics (its `node.id`).
    pub node: String,
    /// The command; `issued_at_s` and `signature` are set when it is sent.
    pub command: ControlCommand,
    /// Where the node answers; default `REPLY_PREFIX/CLIENT_ID/replies`,
    /// REPLY_PREFIX the first of `mqtt.reply_prefixes`, else `edgeinfer-ctl`.
    pub reply_topic: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error(
        "--via-mqtt signs commands with the key in control.key_file, and --config sets none: set \
         control.key_file to a file holding the node's key"
    )]
    NoKey,
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    Options(#[from] OptionsError),
    #[error("the command cannot be signed: {0}")]
    Unsignable(#[from] Unsignable),
    #[error("the broker at {url}: {reason}")]
    Broker { url: String, reason: String },
    #[error(
        "the broker at {url} says no one subscribes to {topic}: node {node} takes no control commands \
         (control.enabled is off there) or its node.id is not {node:?} (--node)"
    )]
    NoListener { url: String, topic: String, node: String },
    #[error(
        "no answer from node {node} within {waited_s} s (sent on {topic} through {url}, awaited on \
         {reply_topic}): check that the node is up on that broker with control.enabled = true, that the \
         broker lets this client publish to {topic} and subscribe to {reply_topic} (--reply-topic), and \
         that the node's mqtt.reply_prefixes admit {reply_topic}"
    )]
    NoAnswer { node: String, waited_s: u64, topic: String, url: String, reply_topic: String },
    #[error("node {node} refused the command ({code}): {message}")]
    Refused { node: String, code: String, message: String },
    #[error("node {node} answered something unexpected: {reason}")]
    Unexpected { node: String, reason: String },
}

/// Sends `asked` and returns the node's `result`; the node's `error` is
/// `AskError::Refused`.
pub async fn ask(config: &Config, asked: ControlAsk) -> Result<Value, AskError> {
    let path = config.control.key_file.as_ref().ok_or(AskError::NoKey)?;
    let key = ControlKey::read(path)?;
    let mqtt = &config.mqtt;
    let topic = Topics::new(&mqtt.topic_prefix, &asked.node, &mqtt.share_group).control();
    let client_id = format!("edgeinfer-ctl-{:016x}", fastrand::u64(..));
    let reply_topic = asked.reply_topic.clone().unwrap_or_else(|| {
        let prefix = mqtt.reply_prefixes.first().map_or("edgeinfer-ctl", |p| p.trim_end_matches('/'));
        format!("{prefix}/{client_id}/replies")
    });
    let command = asked.command.signed(&key, &topic, crate::telemetry::unix_now())?;
    // A passing client: nothing for the broker to keep once it leaves.
    let session = crate::config::MqttConfig { session_expiry_s: 0, ..mqtt.clone() };
    let mut options = client_options(&session, &client_id, 16 << 20, 16)?;
    options.set_clean_start(true).set_manual_acks(false);
    let (client, mut eventloop) = AsyncClient::new(options, 16);
    let broker = |reason: String| AskError::Broker { url: mqtt.url.clone(), reason };
    client.subscribe(&reply_topic, QoS::AtLeastOnce).await.map_err(|e| broker(e.to_string()))?;
    let correlation = Bytes::from(fastrand::u128(..).to_be_bytes().to_vec());
    let no_answer = || AskError::NoAnswer {
        node: asked.node.clone(),
        waited_s: ANSWER_WAIT.as_secs(),
        topic: topic.clone(),
        url: mqtt.url.clone(),
        reply_topic: reply_topic.clone(),
    };
    let deadline = tokio::time::Instant::now() + ANSWER_WAIT;
    let answer = loop {
        let event = tokio::time::timeout_at(deadline, eventloop.poll()).await.map_err(|_| no_answer())?;
        match event.map_err(|e| broker(e.to_string()))? {
            Event::Incoming(Packet::SubAck(ack)) => {
                if ack.return_codes.iter().any(|c| !matches!(c, SubscribeReasonCode::Success(_))) {
                    return Err(broker(format!(
                        "refused the subscription to {reply_topic} ({:?}): give --reply-topic a topic \
                         this client may subscribe to",
                        ack.return_codes
                    )));
                }
                // Published only now: an answer before the subscription
                // would reach no one.
                let props = PublishProperties {
                    response_topic: Some(reply_topic.clone()),
                    correlation_data: Some(correlation.clone()),
                    content_type: Some("application/json".into()),
                    ..Default::default()
                };
                let payload = serde_json::to_vec(&command).expect("a command serializes");
                client
                    .publish_with_properties(&topic, QoS::AtLeastOnce, false, payload, props)
                    .await
                    .map_err(|e| broker(e.to_string()))?;
            }
            Event::Incoming(Packet::PubAck(ack)) => match ack.reason {
                PubAckReason::Success => {}
                PubAckReason::NoMatchingSubscribers => {
                    return Err(AskError::NoListener {
                        url: mqtt.url.clone(),
                        topic,
                        node: asked.node.clone(),
                    });
                }
                refused => {
                    return Err(broker(format!(
                        "refused the command on {topic} ({refused:?}): its ACL must let this client \
                         publish there"
                    )));
                }
            },
            Event::Incoming(Packet::Publish(reply))
                if reply.topic == reply_topic.as_bytes()
                    && reply.properties.as_ref().and_then(|p| p.correlation_data.as_ref())
                        == Some(&correlation) =>
            {
                break reply.payload;
            }
            _ => {}
        }
    };
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(200), eventloop.poll()).await;
    let unexpected = |reason: String| AskError::Unexpected { node: asked.node.clone(), reason };
    let mut reply: Value = serde_json::from_slice(&answer).map_err(|e| unexpected(e.to_string()))?;
    if let Some(error) = reply.get("error") {
        let text = |field: &str| error[field].as_str().unwrap_or_default().to_string();
        return Err(AskError::Refused {
            node: asked.node.clone(),
            code: text("code"),
            message: text("message"),
        });
    }
    match reply.get_mut("result") {
        Some(result) => Ok(result.take()),
        None => Err(unexpected(format!("neither result nor error in {reply}"))),
    }
}
