//! The ferrosan engine: config model, portals, connection drivers, session registry.
#![forbid(unsafe_code)]

pub mod config;
pub mod connection;
pub mod metrics;
pub mod registry;
pub mod server;

pub use server::Server;
