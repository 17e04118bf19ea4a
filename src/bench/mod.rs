//! `edgeinfer bench`: a load generator over MQTT that works against any
//! broker and any node speaking the contract. Closed loop (each connection
//! keeps C requests in flight) or open loop (Poisson arrivals at a fixed rate,
//! latency measured from the intended send time, so a stalled node cannot
//! hide its queueing). `--echo` starts a trivial responder on the same broker
//! so the broker's own round-trip floor is measured with the same client.

mod cascade;
mod client;
mod echo;
mod load;
mod report;

pub use cascade::{CascadeReport, read_split, run_cascade};
pub use echo::{EchoClient, run_echo};
pub use load::run;
pub use report::Report;

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub url: String,
    /// Requests go to this topic.
    pub topic: String,
    pub payload: Payload,
    pub connections: usize,
    /// Closed loop: requests in flight per connection.
    pub concurrency: usize,
    /// Open loop: total requests per second over all connections.
    pub rate: Option<f64>,
    pub duration: Duration,
    pub warmup: Duration,
    pub qos1: bool,
    /// Print a progress line each second on standard error.
    pub progress: bool,
    /// Count the replies by the node that answered and the cache layer
    /// (`parameters.node`, `parameters.cache`): a site's spread.
    pub tally: bool,
}

/// What each request carries.
#[derive(Debug, Clone)]
pub enum Payload {
    /// The same bytes every time (after the first, a node answers from its
    /// cache). Shared, so each request clones a reference, not the bytes.
    Fixed(bytes::Bytes),
    /// `head`, a number unique to the request (counted from `first`),
    /// `tail`: every request differs, so each one misses a node's cache.
    /// With `keys`, the numbers repeat after that many: each input is asked
    /// again and again, as a site's devices do.
    Numbered { head: bytes::Bytes, tail: bytes::Bytes, first: u64, keys: Option<u64> },
}

impl Payload {
    /// Request `seq` of connection `k` of `of`.
    pub fn bytes(&self, k: usize, of: usize, seq: u64) -> bytes::Bytes {
        match self {
            Payload::Fixed(b) => b.clone(),
            Payload::Numbered { head, tail, first, keys } => {
                let n = seq * of as u64 + k as u64;
                let n = first + keys.map_or(n, |keys| n % keys.max(1));
                let mut out = Vec::with_capacity(head.len() + tail.len() + 20);
                out.extend_from_slice(head);
                out.extend_from_slice(n.to_string().as_bytes());
                out.extend_from_slice(tail);
                out.into()
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Options(#[from] crate::transport::mqtt::OptionsError),
    #[error("cannot connect to {url}: {message}")]
    Connect { url: String, message: String },
    #[error("{0}")]
    Cascade(String),
}

#[cfg(test)]
mod tests {
    use super::Payload;

    /// A soak numbers each minute's requests from a new offset
    /// (`--distinct-from`), so no request repeats one of an earlier minute.
    #[test]
    fn numbered_requests_count_from_the_offset_without_overlap_across_connections() {
        let payload = |first| Payload::Numbered { head: "[".into(), tail: "]".into(), first, keys: None };
        let text = |p: &Payload, k, seq| String::from_utf8(p.bytes(k, 2, seq).to_vec()).unwrap();
        let (first_run, later_run) = (payload(0), payload(200_000));
        assert_eq!(text(&first_run, 0, 0), "[0]");
        assert_eq!(text(&first_run, 1, 0), "[1]");
        assert_eq!(text(&first_run, 0, 1), "[2]");
        assert_eq!(text(&later_run, 1, 3), "[200007]");
        // With --keys the inputs come round again.
        let site = Payload::Numbered { head: "[".into(), tail: "]".into(), first: 5, keys: Some(3) };
        let seen: Vec<String> = (0..4).map(|seq| text(&site, 0, seq)).collect();
        assert_eq!(seen, ["[5]", "[7]", "[6]", "[5]"]);
    }
}
