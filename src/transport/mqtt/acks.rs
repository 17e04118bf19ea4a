//! A request's place in line. MQTT requires PUBACKs in the order the
//! PUBLISHes arrived [MQTT-4.6.0-2] (rumqttd disconnects a client that breaks
//! this), while requests finish in any order: the session layer
//! (`session::Session`) holds that line; each request task holds an
//! `AckSlot` and reports through it, with its reply, to the loop that owns
//! the connection, which publishes the reply and then acknowledges the
//! request, the acknowledgement written after the reply.

use super::session::Arrival;
use tokio::sync::mpsc;

/// A request finished: its reply (if it has one), and its place in line.
pub struct Finished {
    /// Its place in the session's line; `None` for a QoS 0 request.
    pub arrival: Option<Arrival>,
    pub reply: Option<super::outbox::Reply>,
    /// Held until the reply is handed to the session of its connection: a
    /// follow-up to this request waits for it, and may go out on another
    /// connection (the share group's requests, `share.rs`).
    pub first: Option<crate::protocol::FirstReplyPending>,
}

/// A request's place in line; `send` (or dropping it, e.g. when its task
/// was aborted) reports it finished.
pub struct AckSlot {
    arrival: Option<Arrival>,
    tx: Option<mpsc::UnboundedSender<Finished>>,
}

impl AckSlot {
    /// The slot of the request the session handed over as `arrival`; it
    /// reports to `tx`.
    pub fn new(arrival: Option<Arrival>, tx: mpsc::UnboundedSender<Finished>) -> AckSlot {
        AckSlot { arrival, tx: Some(tx) }
    }

    pub fn send(mut self, reply: Option<super::outbox::Reply>) {
        self.report(reply, None);
    }

    /// `send`, with the guard a follow-up to this request waits on: released
    /// once the reply is handed to the session.
    pub fn send_first(mut self, reply: super::outbox::Reply, first: crate::protocol::FirstReplyPending) {
        self.report(Some(reply), Some(first));
    }

    /// Once: `send` and then `Drop` report nothing twice.
    fn report(
        &mut self,
        reply: Option<super::outbox::Reply>,
        first: Option<crate::protocol::FirstReplyPending>,
    ) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Finished { arrival: self.arrival, reply, first });
        }
    }
}

impl Drop for AckSlot {
    fn drop(&mut self) {
        // The engine answers a panicking request `internal` itself; a panic
        // here is in the adapter, after that. Acknowledgements must leave in
        // order, so this one still goes, but not silently.
        if std::thread::panicking() {
            tracing::error!("a request task panicked before its reply was sent; acknowledging it anyway");
        }
        self.report(None, None);
    }
}
