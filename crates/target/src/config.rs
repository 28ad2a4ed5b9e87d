//! Configuration model (filled in by the config work).
