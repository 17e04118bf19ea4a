//! The MQTT 5 session as a state machine of our own (issue 36): bytes
//! read and the time go in; packets to write, events and the next deadline
//! come out. No socket, no clock, no task: a driver owns those, and tests
//! drive it with a scripted broker and a fake clock. rumqttc's codec
//! (`mqttbytes`) reads and writes the packets; the rules of the session
//! are here:
//!
//! - our QoS 1 and 2 publishes get their packet id when handed over (so a
//!   journal can keep it), wait for the broker's Receive Maximum, and after
//!   a resume go again in their order, marked DUP, under the same id;
//! - the broker's publishes are acknowledged in arrival order once the
//!   application takes them [MQTT-4.6.0-2], however they finish; a re-send
//!   of one still held is not handed over twice; a PUBREL for an unknown id
//!   is answered PUBCOMP 0x92;
//! - everything ready is encoded into one buffer per `poll_transmit`, so
//!   the driver writes once per wakeup;
//! - keep alive with a PINGRESP deadline, a CONNACK deadline, and a
//!   DISCONNECT with the reason for whatever the broker gets wrong.
//!
//! `driver.rs` runs it on a socket (TCP or TLS); reconnect backoff and
//! jitter are its owner's (`backoff.rs`).
//!
//! Stage 1 of issue 36: the node's connections still run on rumqttc's
//! event loop (`super::MqttService`); they move onto this next.

mod backoff;
mod driver;
mod inflight;
mod state;
#[cfg(test)]
pub(crate) mod tests;
mod timers;

pub use backoff::Backoff;
pub use driver::Driver;
pub use state::Session;

use rumqttc::v5::mqttbytes::v5::{
    ConnectReturnCode, DisconnectReasonCode, LastWill, Login, Publish, SubscribeReasonCode,
};
use std::time::Duration;

/// What the session asks of the broker.
#[derive(Debug, Clone)]
pub struct Options {
    pub client_id: String,
    /// Zero turns keep alive off (the broker may still set one).
    pub keep_alive: Duration,
    pub clean_start: bool,
    pub session_expiry_s: u32,
    /// Broker publishes we take in flight at once.
    pub receive_maximum: u16,
    /// The largest packet we read.
    pub max_packet_size: u32,
    /// How long a CONNACK may take.
    pub connect_timeout: Duration,
    /// How long a PINGRESP may take.
    pub ping_timeout: Duration,
    pub login: Option<Login>,
    pub will: Option<LastWill>,
}

/// A broker publish the application took, to acknowledge with
/// `Session::acknowledge` (its PUBACK or PUBREC then leaves in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arrival(pub u64);

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// CONNACK success. Without a session the broker forgot our
    /// subscriptions and its publishes in flight to us.
    Connected {
        session_present: bool,
    },
    /// A publish from the broker; `None` for QoS 0 (nothing to acknowledge).
    Publish {
        arrival: Option<Arrival>,
        publish: Box<Publish>,
    },
    /// The broker has our QoS 2 publish held for a journal (PUBREC): its
    /// PUBREL goes once the owner calls `Session::release`.
    Received {
        pkid: u16,
    },
    /// The broker has our publish: PUBACK (QoS 1) or PUBCOMP (QoS 2), or
    /// the broker lost our session after it had taken it (PUBREC heard).
    Delivered {
        pkid: u16,
    },
    /// The broker refused our publish (reason code >= 0x80).
    Refused {
        pkid: u16,
        reason: u8,
    },
    Subscribed {
        pkid: u16,
        codes: Vec<SubscribeReasonCode>,
    },
    Unsubscribed {
        pkid: u16,
    },
    /// The connection is over: write what `poll_goodbye` gives (a
    /// DISCONNECT saying why), then close it. The session's publishes, and
    /// the acknowledgements not yet written, stay for the next connection.
    Closed(Closed),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Closed {
    Refused(ConnectReturnCode),
    ConnAckTimeout,
    PingTimeout,
    /// The broker sent DISCONNECT.
    ByBroker(DisconnectReasonCode),
    /// The broker broke the protocol; we sent DISCONNECT with this reason.
    Protocol(DisconnectReasonCode, &'static str),
    /// The connection failed under us (from the driver).
    Lost(&'static str),
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closed::Refused(code) => write!(f, "the broker refused the connection ({code:?})"),
            Closed::ConnAckTimeout => f.write_str("no CONNACK in time"),
            Closed::PingTimeout => f.write_str("no PINGRESP in time"),
            Closed::ByBroker(reason) => write!(f, "the broker disconnected ({reason:?})"),
            Closed::Protocol(reason, what) => {
                write!(f, "the broker sent {what} (we sent DISCONNECT {reason:?})")
            }
            Closed::Lost(what) => f.write_str(what),
        }
    }
}

/// Why `Session::publish` did not take a publish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    #[error("all 65,535 packet ids are in use")]
    NoPacketId,
    #[error("the packet ({size} bytes) is larger than the broker takes ({max})")]
    TooLarge { size: usize, max: u32 },
    #[error("a QoS 0 publish needs a connection")]
    NotConnected,
    #[error("the broker takes no such publish (reason {reason:#04x}: QoS or retain it does not support)")]
    Unsupported { reason: u8 },
}
