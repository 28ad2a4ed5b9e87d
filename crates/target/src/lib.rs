//! The ferrosan engine: config model, portals, connection drivers, session registry.
#![forbid(unsafe_code)]

pub mod config;
