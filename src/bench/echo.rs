//! The broker floor: answer every request with its own payload, at once.
//! On rumqttc's event loop (one write per packet) or on the node's own
//! session layer (`transport::mqtt::session`: each wakeup's packets in one
//! write), so what the session layer saves can be measured on its own.

use super::BenchError;
use super::client::subscribed;
use crate::config::MqttConfig;
use crate::transport::mqtt::session::{Driver, Event, Options, Session};
use crate::transport::mqtt::{BrokerAddress, session_options, tls_for};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, Publish, PublishProperties};
use std::time::Duration;

/// Which MQTT client the echo responder runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EchoClient {
    /// rumqttc's event loop, as the node's request connections today.
    Rumqttc,
    /// The node's own session layer (issue 36).
    Session,
}

/// Subscribes to `topic` at `qos` and replies to each request's Response
/// Topic with its payload and Correlation Data, at `reply_qos` (QoS 2: the
/// floor of a node with `mqtt.reply_qos = 2`, whose replies a broker
/// delivers once it has the PUBREL). Returns once subscribed; runs until
/// the process ends.
pub async fn run_echo(
    url: &str,
    topic: &str,
    qos: QoS,
    reply_qos: QoS,
    on: EchoClient,
) -> Result<(), BenchError> {
    let id = format!("edgeinfer-bench-echo-{}", std::process::id());
    if on == EchoClient::Session {
        return echo_on_session(url, &id, topic, qos, reply_qos).await;
    }
    let (client, mut inbox) = subscribed(url, &id, topic, qos).await?;
    tokio::spawn(async move {
        while let Some(p) = inbox.recv().await {
            if let Some((reply_to, payload, props)) = echo_of(p) {
                let _ = client.try_publish_with_properties(reply_to, reply_qos, false, payload, props);
            }
        }
    });
    Ok(())
}

/// The reply to a request: its Response Topic, payload and Correlation Data.
fn echo_of(request: Publish) -> Option<(String, bytes::Bytes, PublishProperties)> {
    let props = request.properties.unwrap_or_default();
    let reply = PublishProperties { correlation_data: props.correlation_data, ..Default::default() };
    Some((props.response_topic?, request.payload, reply))
}

async fn echo_on_session(
    url: &str,
    id: &str,
    topic: &str,
    qos: QoS,
    reply_qos: QoS,
) -> Result<(), BenchError> {
    let failed = |message: String| BenchError::Connect { url: url.into(), message };
    let config = MqttConfig { url: url.into(), session_expiry_s: 0, ..Default::default() };
    let options = Options { clean_start: true, ..session_options(&config, id, 16 << 20, u16::MAX)? };
    let address = BrokerAddress::parse(url)?;
    let mut echo = Driver::new(Session::new(options), address.host, address.port, tls_for(&config)?);
    echo.connect().await.map_err(|e| failed(e.to_string()))?;
    let subscribing = async {
        loop {
            match echo.next().await {
                Event::Connected { .. } => {
                    echo.session().subscribe(vec![Filter::new(topic, qos)]);
                }
                Event::Subscribed { .. } => return Ok(()),
                Event::Closed(why) => return Err(failed(why.to_string())),
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), subscribing)
        .await
        .map_err(|_| failed("no SUBACK within 10 s".into()))??;
    tokio::spawn(async move {
        loop {
            match echo.next().await {
                Event::Publish { arrival, publish } => {
                    if let Some((reply_to, payload, props)) = echo_of(*publish) {
                        let _ =
                            echo.session().publish(Publish::new(reply_to, reply_qos, payload, Some(props)));
                    }
                    if let Some(arrival) = arrival {
                        echo.session().acknowledge(arrival);
                    }
                }
                Event::Closed(why) => {
                    tracing::warn!("echo responder: {why}; stopped");
                    return;
                }
                _ => {}
            }
        }
    });
    Ok(())
}
