//! In-order acknowledgements. MQTT requires PUBACKs in the order the
//! PUBLISHes arrived [MQTT-4.6.0-2] (rumqttd disconnects a client that breaks
//! this), while requests finish in any order. One task owns the queue: the
//! event loop registers each request as it arrives, the request's task
//! reports it finished, and acknowledgements go out from the head.

use rumqttc::v5::AsyncClient;
use rumqttc::v5::mqttbytes::v5::Publish;
use std::collections::VecDeque;
use tokio::sync::mpsc;

enum Message {
    Arrived(u64, Box<Publish>),
    Done(u64),
    /// Stop after handing out what is releasable now; later requests stay
    /// unacknowledged, so the broker redelivers them.
    Close(tokio::sync::oneshot::Sender<()>),
}

pub struct AckQueue {
    tx: mpsc::UnboundedSender<Message>,
    next: u64,
}

/// A request's place in the queue; dropping it reports the request finished.
pub struct AckSlot {
    seq: u64,
    tx: mpsc::UnboundedSender<Message>,
}

impl Drop for AckSlot {
    fn drop(&mut self) {
        // The engine answers a panicking request `internal` itself; a panic
        // here is in the adapter, after that. Acknowledgements must leave in
        // order, so this one still goes, but not silently.
        if std::thread::panicking() {
            tracing::error!("a request task panicked before its reply was sent; acknowledging it anyway");
        }
        let _ = self.tx.send(Message::Done(self.seq));
    }
}

impl AckQueue {
    pub fn start(client: AsyncClient) -> AckQueue {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(client, rx));
        AckQueue { tx, next: 0 }
    }

    /// Call in arrival order, from the task that reads the connection.
    pub fn arrived(&mut self, publish: &Publish) -> AckSlot {
        let seq = self.next;
        self.next += 1;
        let _ = self.tx.send(Message::Arrived(seq, Box::new(publish.clone())));
        AckSlot { seq, tx: self.tx.clone() }
    }

    /// Acknowledges every request finished so far (in order), then stops:
    /// requests still running, or finishing later, are never acknowledged.
    /// Returns once the acknowledgements are queued on the client.
    pub async fn close(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Message::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

async fn run(client: AsyncClient, mut rx: mpsc::UnboundedReceiver<Message>) {
    let mut order = Sequencer::default();
    while let Some(message) = rx.recv().await {
        let released = match message {
            Message::Arrived(seq, p) => order.arrived(seq, p),
            Message::Done(seq) => order.done(seq),
            Message::Close(done) => {
                let _ = done.send(());
                return;
            }
        };
        for publish in released {
            if client.ack(&publish).await.is_err() {
                return;
            }
        }
    }
}

/// Items numbered in arrival order, released in that order once each is done
/// (an item may be reported done before its arrival is seen).
struct Sequencer<T> {
    base: u64,
    queue: VecDeque<(Option<T>, bool)>,
}

impl<T> Default for Sequencer<T> {
    fn default() -> Self {
        Sequencer { base: 0, queue: VecDeque::new() }
    }
}

impl<T> Sequencer<T> {
    fn arrived(&mut self, seq: u64, item: T) -> Vec<T> {
        if let Some(entry) = self.entry(seq) {
            entry.0 = Some(item);
        }
        self.release()
    }

    fn done(&mut self, seq: u64) -> Vec<T> {
        if let Some(entry) = self.entry(seq) {
            entry.1 = true;
        }
        self.release()
    }

    fn entry(&mut self, seq: u64) -> Option<&mut (Option<T>, bool)> {
        let index = seq.checked_sub(self.base)? as usize;
        if self.queue.len() <= index {
            self.queue.resize_with(index + 1, || (None, false));
        }
        self.queue.get_mut(index)
    }

    fn release(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        while self.queue.front().is_some_and(|(item, done)| item.is_some() && *done) {
            let (item, _) = self.queue.pop_front().expect("front exists");
            self.base += 1;
            out.extend(item);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Sequencer;

    #[test]
    fn acknowledgements_leave_in_arrival_order_whatever_order_requests_finish() {
        for round in 0..200u64 {
            let n = 1 + (round % 37);
            let mut order = Sequencer::default();
            let mut released = Vec::new();
            for seq in 0..n {
                released.extend(order.arrived(seq, seq));
            }
            // A shuffled completion order, deterministic per round.
            let mut finish: Vec<u64> = (0..n).collect();
            let mut x = round.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            for i in (1..finish.len()).rev() {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                finish.swap(i, (x >> 33) as usize % (i + 1));
            }
            for (k, seq) in finish.iter().enumerate() {
                released.extend(order.done(*seq));
                let all_before_done = (0..=*seq).all(|s| finish[..=k].contains(&s));
                if all_before_done {
                    assert!(released.contains(seq));
                }
            }
            assert_eq!(released, (0..n).collect::<Vec<_>>(), "round {round}");
        }
    }

    #[test]
    fn done_before_arrival_is_held_until_the_arrival() {
        let mut order = Sequencer::default();
        assert!(order.done(0).is_empty());
        assert_eq!(order.arrived(0, "a"), vec!["a"]);
    }
}
