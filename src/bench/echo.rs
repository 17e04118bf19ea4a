//! The broker floor: answer every request with its own payload, at once.

use super::BenchError;
use super::client::subscribed;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::PublishProperties;

/// Subscribes to `topic` and replies to each request's Response Topic with
/// its payload and Correlation Data. Returns once subscribed; runs until the
/// process ends.
pub async fn run_echo(url: &str, topic: &str, qos1: bool) -> Result<(), BenchError> {
    let qos = if qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
    let id = format!("edgeinfer-bench-echo-{}", std::process::id());
    let (client, mut inbox) = subscribed(url, &id, topic, qos).await?;
    tokio::spawn(async move {
        while let Some(p) = inbox.recv().await {
            let props = p.properties.unwrap_or_default();
            if let Some(reply_to) = props.response_topic {
                let reply =
                    PublishProperties { correlation_data: props.correlation_data, ..Default::default() };
                let _ = client.try_publish_with_properties(reply_to, qos, false, p.payload, reply);
            }
        }
    });
    Ok(())
}
