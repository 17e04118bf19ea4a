//! From `[mqtt]` config to client options (the session layer's, and
//! rumqttc's for the tools): address, TLS, credentials and the session
//! settings that let the broker hold requests while the node is away.

use crate::config::MqttConfig;
use crate::tls::{Identity, TlsError, client_config};
use rumqttc::v5::MqttOptions;
use rumqttc::{NetworkOptions, TlsConfiguration, Transport};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    #[error("mqtt.url {url:?}: {why}; use mqtt://HOST:PORT or mqtts://HOST:PORT")]
    Url { url: String, why: String },
    #[error("{key} = {path}: cannot read: {source}")]
    File { key: &'static str, path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// Where the broker is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddress {
    pub host: String,
    pub port: u16,
    pub tls: bool,
}

impl BrokerAddress {
    pub fn parse(url: &str) -> Result<BrokerAddress, OptionsError> {
        let err = |why: &str| OptionsError::Url { url: url.into(), why: why.into() };
        let (tls, rest) = if let Some(rest) = url.strip_prefix("mqtts://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("mqtt://") {
            (false, rest)
        } else {
            return Err(err("unknown scheme"));
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                (h, p.parse::<u16>().map_err(|_| err("the port is not a number from 1 to 65535"))?)
            }
            _ => (rest, if tls { 8883 } else { 1883 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains('/') {
            return Err(err("no host"));
        }
        Ok(BrokerAddress { host: host.to_string(), port, tls })
    }

    pub fn socket_addr(&self) -> Option<std::net::SocketAddr> {
        use std::net::ToSocketAddrs;
        (self.host.as_str(), self.port).to_socket_addrs().ok()?.next()
    }
}

/// `mqtt.username` and its password (from `mqtt.password_file`,
/// `mqtt.password`, or empty), when a username is set.
pub fn credentials(config: &MqttConfig) -> Result<Option<(String, String)>, OptionsError> {
    let Some(user) = &config.username else { return Ok(None) };
    let password = match (&config.password, &config.password_file) {
        (_, Some(path)) => std::fs::read_to_string(path)
            .map_err(|source| OptionsError::File { key: "mqtt.password_file", path: path.clone(), source })?
            .trim_end_matches(['\n', '\r'])
            .to_string(),
        (Some(secret), None) => secret.0.clone(),
        (None, None) => String::new(),
    };
    Ok(Some((user.clone(), password)))
}

/// Unacknowledged publishes the node keeps out beyond one reply per request
/// in flight: follow-ups (`cloud::spool::FOLLOW_UP_QUEUE`, 128, bounds them;
/// the spool has at most 64 out) and the status.
const OWN_PUBLISHES_BEYOND_REPLIES: u16 = 128;

/// Builds the client options. `max_packet` is the largest request the node
/// accepts on the wire (the broker must not send bigger ones).
pub fn client_options(
    config: &MqttConfig,
    client_id: &str,
    max_packet: u32,
    max_in_flight: u16,
) -> Result<MqttOptions, OptionsError> {
    let address = BrokerAddress::parse(&config.url)?;
    let mut options = MqttOptions::new(client_id, &address.host, address.port);
    options
        .set_clean_start(false)
        .set_session_expiry_interval(Some(config.session_expiry_s))
        .set_keep_alive(Duration::from_secs(config.keep_alive_s.max(5) as u64))
        .set_manual_acks(true)
        // The broker never has more unacknowledged requests out to us than we
        // process at once: the bound on the node's memory.
        .set_receive_maximum(Some(max_in_flight))
        // Our own unacknowledged publishes: replies to the requests in
        // flight, follow-ups and the status. rumqttc keeps a slot per
        // allowed one (216 bytes each, all written when it creates the
        // client): its default of 65,535 held 14 MB resident from the
        // start; more wait in the outbox.
        .set_outgoing_inflight_upper_limit(max_in_flight.saturating_add(OWN_PUBLISHES_BEYOND_REPLIES))
        .set_max_packet_size(Some(max_packet))
        .set_request_channel_capacity(4096)
        .set_connection_timeout(10);
    let mut network = NetworkOptions::new();
    // Nagle against delayed ACKs costs 44-88 ms per request (shared/PRODUCT.md).
    network.set_tcp_nodelay(true);
    options.set_network_options(network);
    if let Some((user, password)) = credentials(config)? {
        options.set_credentials(user, password);
    }
    if address.tls {
        options.set_transport(Transport::Tls(TlsConfiguration::Rustls(Arc::new(tls_config(config)?))));
    }
    Ok(options)
}

/// The same session settings for the session layer of our own
/// (`super::session`): a persistent session (no clean start, the session
/// kept `mqtt.session_expiry_s`), `receive_maximum` requests in flight,
/// packets up to `max_packet`, the login; no will (a caller sets one).
pub fn session_options(
    config: &MqttConfig,
    client_id: &str,
    max_packet: u32,
    receive_maximum: u16,
) -> Result<super::session::Options, OptionsError> {
    let keep_alive = Duration::from_secs(config.keep_alive_s.max(5) as u64);
    Ok(super::session::Options {
        client_id: client_id.to_string(),
        keep_alive,
        clean_start: false,
        session_expiry_s: config.session_expiry_s,
        receive_maximum,
        max_packet_size: max_packet,
        connect_timeout: Duration::from_secs(10),
        // As rumqttc: a PINGRESP missing by the next keep alive ends it.
        ping_timeout: keep_alive,
        login: credentials(config)?
            .map(|(user, password)| rumqttc::v5::mqttbytes::v5::Login::new(user, password)),
        will: None,
    })
}

/// The TLS config of a `mqtts://` broker URL, `None` for `mqtt://`.
/// `mqtt.reply_qos` (checked to be 1 or 2 when the config loads).
pub fn reply_qos(config: &MqttConfig) -> rumqttc::v5::mqttbytes::QoS {
    match config.reply_qos {
        1 => rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        _ => rumqttc::v5::mqttbytes::QoS::ExactlyOnce,
    }
}

pub fn tls_for(config: &MqttConfig) -> Result<Option<Arc<rustls::ClientConfig>>, OptionsError> {
    Ok(match BrokerAddress::parse(&config.url)?.tls {
        true => Some(Arc::new(tls_config(config)?)),
        false => None,
    })
}

fn tls_config(config: &MqttConfig) -> Result<rustls::ClientConfig, TlsError> {
    let identity = match (&config.client_cert_file, &config.client_key_file) {
        (Some(cert), Some(key)) => {
            Some(Identity { cert_key: "mqtt.client_cert_file", cert, key_key: "mqtt.client_key_file", key })
        }
        _ => None,
    };
    client_config("mqtt.ca_file", config.ca_file.as_deref(), identity, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_urls() {
        let a = BrokerAddress::parse("mqtt://10.0.0.5:1884").unwrap();
        assert_eq!((a.host.as_str(), a.port, a.tls), ("10.0.0.5", 1884, false));
        let a = BrokerAddress::parse("mqtts://broker.site").unwrap();
        assert_eq!((a.host.as_str(), a.port, a.tls), ("broker.site", 8883, true));
        let a = BrokerAddress::parse("mqtt://[::1]:1883").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("::1", 1883));
        assert!(BrokerAddress::parse("mqtt://host:99999").unwrap_err().to_string().contains("port"));
        assert!(BrokerAddress::parse("http://host").is_err());
    }

    /// The session layer of our own is asked for what rumqttc was.
    #[test]
    fn session_options_carry_the_same_session_settings_as_the_client_options() {
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "s3cret\n").unwrap();
        let config = MqttConfig {
            url: "mqtt://127.0.0.1:1883".into(),
            keep_alive_s: 2,
            session_expiry_s: 900,
            username: Some("node".into()),
            password_file: Some(password),
            ..MqttConfig::default()
        };
        let ours = session_options(&config, "n", 1 << 20, 512).unwrap();
        let theirs = client_options(&config, "n", 1 << 20, 512).unwrap();
        assert_eq!(ours.keep_alive, theirs.keep_alive());
        assert_eq!(
            (ours.clean_start, Some(ours.session_expiry_s)),
            (theirs.clean_start(), theirs.session_expiry_interval())
        );
        assert_eq!((ours.receive_maximum, ours.max_packet_size), (512, 1 << 20));
        let login = ours.login.unwrap();
        assert_eq!((login.username.as_str(), login.password.as_str()), ("node", "s3cret"));
    }

    #[test]
    fn the_node_keeps_out_only_as_many_publishes_as_it_can_have() {
        let config = MqttConfig { url: "mqtt://127.0.0.1:1883".into(), ..MqttConfig::default() };
        let options = client_options(&config, "n", 1 << 20, 512).unwrap();
        assert_eq!(options.get_outgoing_inflight_upper_limit(), Some(640));
        let options = client_options(&config, "n", 1 << 20, u16::MAX).unwrap();
        assert_eq!(options.get_outgoing_inflight_upper_limit(), Some(u16::MAX), "saturates");
    }
}
