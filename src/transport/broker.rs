//! The embedded broker (rumqttd) for a single node with no site broker: the
//! README's first run, and tests. Production sites run mosquitto, EMQX or
//! similar. rumqttd serves MQTT 5 and 3.1.1 on separate listeners, and does
//! not set TCP_NODELAY on its sockets: clients that do not set it themselves
//! see Nagle delays through it (docs/PROTOCOL.md, "Brokers").

use rumqttd::{Config, ConnectionSettings, RouterConfig, ServerSettings};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error(
        "embedded broker: cannot listen on {addr}: {source}; stop whatever uses it, or set mqtt.url to another port"
    )]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("embedded broker: did not accept connections on {0} within 5 s")]
    NotStarted(SocketAddr),
}

/// Where the broker takes clients: MQTT 5, and MQTT 3.1.1 when asked for.
pub struct Listeners {
    pub v5: SocketAddr,
    pub v311: Option<SocketAddr>,
}

/// Starts the broker on its own threads and returns once it accepts
/// connections. `login` (user, password), when given, is required of every
/// client; `max_packet` bounds the packets it takes from clients.
pub fn start(
    listeners: Listeners,
    login: Option<(String, String)>,
    max_packet: usize,
) -> Result<(), BrokerError> {
    let Listeners { v5, v311 } = listeners;
    // rumqttd only logs a failed bind from its own thread; check first so the
    // operator gets the error.
    for addr in std::iter::once(v5).chain(v311) {
        TcpListener::bind(addr).map_err(|source| BrokerError::Listen { addr, source })?;
    }
    let server = |name: &str, listen: SocketAddr| ServerSettings {
        name: name.into(),
        listen,
        tls: None,
        next_connection_delay_ms: 1,
        connections: ConnectionSettings {
            connection_timeout_ms: 60_000,
            max_payload_size: max_packet,
            max_inflight_count: 1024,
            auth: login.clone().map(|pair| HashMap::from([pair])),
            external_auth: None,
            dynamic_filters: true,
        },
    };
    let config = Config {
        id: 0,
        router: RouterConfig {
            max_connections: crate::config::EMBEDDED_BROKER_MAX_CONNECTIONS,
            max_outgoing_packet_count: 1024,
            max_segment_size: 100 * 1024 * 1024,
            max_segment_count: 10,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        },
        v4: v311.map(|addr| HashMap::from([("v311".to_string(), server("v311", addr))])),
        v5: Some(HashMap::from([("v5".to_string(), server("v5", v5))])),
        ws: None,
        cluster: None,
        console: None,
        bridge: None,
        prometheus: None,
        metrics: None,
    };
    std::thread::Builder::new()
        .name("embedded-broker".into())
        .spawn(move || {
            let mut broker = rumqttd::Broker::new(config);
            if let Err(e) = broker.start() {
                tracing::error!("embedded broker stopped: {e}");
            }
        })
        .expect("spawning the embedded broker thread");
    // Listening once the address is taken; a test connection instead would
    // make rumqttd log an aborted CONNECT as an error at every start.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if TcpListener::bind(v5).is_err() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(BrokerError::NotStarted(v5))
}

/// Whether something accepts TCP connections at `addr` (a broker, probably).
pub fn listening(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_ok()
}
