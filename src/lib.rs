//! edgeinfer: an edge inference appliance.
//!
//! The request path is one pipeline shared by every transport
//! ([`engine::Engine`]): decode, resolve, preprocess, cache, run,
//! postprocess, cascade, capture, store, encode. The transports (MQTT, HTTP and the
//! `infer` command) only move bytes in and out of it; [`node::Node`] wires
//! a serving node together from a config. docs/ARCHITECTURE.md has the map.

pub mod admin;
pub mod bench;
pub mod cloud;
pub mod config;
pub mod engine;
pub mod fuzz;
pub mod lifecycle;
pub mod model;
pub mod node;
pub mod protocol;
pub mod report;
pub mod rollout;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod trace;
pub mod transport;
