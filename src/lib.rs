//! edgeinfer: an edge inference appliance.
//!
//! The request path is one pipeline shared by every transport
//! ([`engine::Engine`]): decode, route, preprocess, run, postprocess, reply.
//! Transports (the `infer` command now, MQTT and HTTP later) only move bytes
//! in and out of it.

pub mod admin;
pub mod bench;
pub mod cloud;
pub mod config;
pub mod engine;
pub mod lifecycle;
pub mod model;
pub mod node;
pub mod protocol;
pub mod telemetry;
pub mod tls;
pub mod transport;
