//! Transports: thin adapters that move bytes between the network and the
//! engine. They decide nothing about a request's content.

pub mod broker;
pub mod http;
pub mod mqtt;
