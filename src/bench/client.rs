//! The MQTT client both sides of `bench` use: connected, subscribed, with the
//! event loop on a task of its own (so senders never stall it) forwarding
//! what arrives.

use super::BenchError;
use crate::transport::mqtt::client_options;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
use rumqttc::v5::{AsyncClient, Event};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Connects as `id` (clean session, automatic acks), subscribes to `topic`
/// and returns once the broker confirmed the subscription.
pub async fn subscribed(
    url: &str,
    id: &str,
    topic: &str,
    qos: QoS,
) -> Result<(AsyncClient, mpsc::UnboundedReceiver<Publish>), BenchError> {
    let connect_error = |message: String| BenchError::Connect { url: url.into(), message };
    let config = crate::config::MqttConfig { url: url.into(), session_expiry_s: 0, ..Default::default() };
    let mut options = client_options(&config, id, 16 << 20, u16::MAX)?;
    options.set_clean_start(true).set_manual_acks(false);
    let (client, mut eventloop) = AsyncClient::new(options, 1 << 16);
    client.subscribe(topic, qos).await.map_err(|e| connect_error(e.to_string()))?;
    let (tx, inbox) = mpsc::unbounded_channel();
    let (ready_tx, ready) = oneshot::channel();
    tokio::spawn(async move {
        let mut ready_tx = Some(ready_tx);
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    if let Some(t) = ready_tx.take() {
                        let _ = t.send(Ok(()));
                    }
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    if tx.send(p).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    if let Some(t) = ready_tx.take() {
                        let _ = t.send(Err(e.to_string()));
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    match ready.await {
        Ok(Ok(())) => Ok((client, inbox)),
        Ok(Err(m)) => Err(connect_error(m)),
        Err(_) => Err(connect_error("the connection task stopped".into())),
    }
}
