//! `edgeinfer serve` against real brokers: the embedded one always, mosquitto
//! where installed.

mod cache;
mod canary;
mod cascade;
mod control;
mod doctor;
mod embedded;
mod exactly_once;
#[cfg(feature = "failpoints")]
mod faults;
mod feedback;
mod http_access;
mod http_split;
mod idle;
mod journal;
mod lifecycle;
mod mosquitto;
mod observability;
mod redis;
mod rollout;
#[cfg(feature = "failpoints")]
mod rollout_faults;
mod session;
mod share_failover;
mod site_rollout;
pub mod support;
mod traces;
#[cfg(feature = "failpoints")]
mod watchdog;

use crate::{digits_request, heldout};

/// A JSON request for held-out row `i`, and the label it should get.
pub fn labelled_request(id: &str, i: usize) -> (Vec<u8>, String) {
    let split = heldout();
    let (label, px) = &split[i % split.len()];
    (digits_request(id, std::slice::from_ref(px)).to_string().into_bytes(), label.to_string())
}
