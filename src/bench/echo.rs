//! The broker floor: answer every request with its own payload, at once.

use super::BenchError;
use crate::transport::mqtt::client_options;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::{AsyncClient, Event};

/// Subscribes to `topic` and replies to each request's Response Topic with
/// its payload and Correlation Data. Returns once subscribed; runs until the
/// process ends.
pub async fn run_echo(url: &str, topic: &str, qos1: bool) -> Result<(), BenchError> {
    let mut config = crate::config::MqttConfig { url: url.into(), ..Default::default() };
    config.session_expiry_s = 0;
    let mut options =
        client_options(&config, &format!("edgeinfer-bench-echo-{}", std::process::id()), 1 << 20, 1024)?;
    options.set_clean_start(true).set_manual_acks(false);
    let (client, mut eventloop) = AsyncClient::new(options, 65_536);
    let qos = if qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
    client
        .subscribe(topic, qos)
        .await
        .map_err(|e| BenchError::Connect { url: url.into(), message: e.to_string() })?;
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut ready_tx = Some(ready_tx);
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(Ok(()));
                    }
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let props = p.properties.unwrap_or_default();
                    if let Some(reply_to) = props.response_topic {
                        let reply = PublishProperties {
                            correlation_data: props.correlation_data,
                            ..Default::default()
                        };
                        let _ = client.try_publish_with_properties(reply_to, qos, false, p.payload, reply);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
            }
        }
    });
    match ready.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(message)) => Err(BenchError::Connect { url: url.into(), message }),
        Err(_) => Err(BenchError::Connect { url: url.into(), message: "the echo responder stopped".into() }),
    }
}
