//! `edgeinfer bench`: a load generator over MQTT that works against any
//! broker and any node speaking the contract. Closed loop (each connection
//! keeps C requests in flight) or open loop (Poisson arrivals at a fixed rate,
//! latency measured from the intended send time, so a stalled node cannot
//! hide its queueing). `--echo` starts a trivial responder on the same broker
//! so the broker's own round-trip floor is measured with the same client.

mod client;
mod echo;
mod load;
mod report;

pub use echo::run_echo;
pub use load::run;
pub use report::Report;

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub url: String,
    /// Requests go to this topic.
    pub topic: String,
    /// Shared, so each request clones a reference, not the bytes.
    pub payload: bytes::Bytes,
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
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Options(#[from] crate::transport::mqtt::OptionsError),
    #[error("cannot connect to {url}: {message}")]
    Connect { url: String, message: String },
}
