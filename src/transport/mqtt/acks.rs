//! A request's place in line. MQTT requires PUBACKs in the order the
//! PUBLISHes arrived [MQTT-4.6.0-2] (rumqttd disconnects a client that breaks
//! this), while requests finish in any order: the session layer
//! (`session::Session`) holds that line; each request task holds an
//! `AckSlot` and reports through it, with its reply, to the loop that owns
//! the connection, which publishes the reply and then acknowledges the
//! request, the acknowledgement written after the reply. A journaled
//! request (`journal.rs`) is acknowledged once the journal has it durably,
//! which may be before its reply.

use super::journal::Durable;
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
    /// The journal's seq of the request: recorded answered once the
    /// broker confirms the reply.
    pub journaled: Option<u64>,
}

/// A request's place in line; `send` (or dropping it, e.g. when its task
/// was aborted) reports it finished.
pub struct AckSlot {
    arrival: Option<Arrival>,
    tx: mpsc::UnboundedSender<Finished>,
    journaled: Option<u64>,
    /// Its reply (or that it has none) was reported: `Drop` reports nothing.
    reported: bool,
}

impl AckSlot {
    /// The slot of the request the session handed over as `arrival`; it
    /// reports to `tx`.
    pub fn new(arrival: Option<Arrival>, tx: mpsc::UnboundedSender<Finished>) -> AckSlot {
        AckSlot { arrival, tx, journaled: None, reported: false }
    }

    /// The journal holds the request as `seq`: its reply, once confirmed,
    /// is recorded answered.
    pub fn journaled(&mut self, seq: u64) {
        self.journaled = Some(seq);
    }

    /// The journal has the request durably: its acknowledgement goes now
    /// (in arrival order), whenever its reply does.
    fn acknowledge(&mut self) {
        if let Some(arrival) = self.arrival.take() {
            let _ =
                self.tx.send(Finished { arrival: Some(arrival), reply: None, first: None, journaled: None });
        }
    }

    /// Runs `work`, acknowledging the request as soon as `durable` says the
    /// journal has it on disk: a slow request holds back no other's
    /// acknowledgement. If `work` ends first, `durable` comes back, for
    /// `send_then_acknowledge`. A failed sync leaves the acknowledgement to
    /// follow the reply, as without a journal.
    pub async fn acknowledge_when<T>(
        &mut self,
        durable: Option<Durable>,
        work: impl std::future::Future<Output = T>,
    ) -> (T, Option<Durable>) {
        let Some(mut durable) = durable else { return (work.await, None) };
        tokio::pin!(work);
        tokio::select! {
            biased;
            synced = &mut durable => {
                if synced {
                    self.acknowledge();
                }
                (work.await, None)
            }
            done = &mut work => (done, Some(durable)),
        }
    }

    pub fn send(mut self, reply: Option<super::outbox::Reply>) {
        self.report(reply, None);
    }

    /// The reply now (it waits for nothing but the journal's write), then,
    /// with `durable`, the acknowledgement once the journal's sync is done;
    /// `first` is the guard a follow-up to this request waits on, released
    /// once the reply is handed to the session. `admitted` (the request's
    /// place under `mqtt.max_in_flight`) is let go with the reply: waiting
    /// for a sync is not work, and holding it would turn a slow disk into
    /// `overloaded` replies (the broker's window bounds what waits).
    pub async fn send_then_acknowledge<A>(
        mut self,
        reply: super::outbox::Reply,
        first: Option<crate::protocol::FirstReplyPending>,
        durable: Option<Durable>,
        admitted: A,
    ) {
        let Some(durable) = durable else { return self.report(Some(reply), first) };
        let arrival = self.arrival.take();
        self.report(Some(reply), first);
        drop(admitted);
        // After a failed or slow sync too: the reply is ahead of it in the
        // channel, and the written record survives a crash of the node.
        let _synced = durable.await;
        self.arrival = arrival;
        self.acknowledge();
    }

    /// Once: `send` and then `Drop` report nothing twice.
    fn report(
        &mut self,
        reply: Option<super::outbox::Reply>,
        first: Option<crate::protocol::FirstReplyPending>,
    ) {
        if !std::mem::replace(&mut self.reported, true) {
            let _ = self.tx.send(Finished {
                arrival: self.arrival.take(),
                reply,
                first,
                journaled: self.journaled,
            });
        }
    }
}

impl Drop for AckSlot {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The engine answers a panicking request `internal` itself; a
            // panic here is in the adapter, after that. Acknowledgements
            // must leave in order, so this one still goes, but not
            // silently; a journaled request is recorded answered, so a
            // request that panics is not run again at every start.
            tracing::error!("a request task panicked before its reply was sent; acknowledging it anyway");
        } else if !self.reported {
            // Aborted by a drain: a journaled request stays waiting, to be
            // run again at the next start.
            self.journaled = None;
        }
        // (Aborted while its acknowledgement waited for the journal's sync,
        // in `send_then_acknowledge`, it goes unacknowledged: the broker
        // delivers it again at the next start, and the journal knows it.)
        self.report(None, None);
    }
}
