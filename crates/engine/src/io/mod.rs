//! The ways a command reaches its medium besides a store's own call: the io_uring ring, group
//! commit of flushes, the watch that moves stalling buffered writes off the workers, and
//! shipping to the gateway that owns an image (`peer`).

pub mod group_commit;
pub mod peer;
pub mod ring;
pub mod stall;
