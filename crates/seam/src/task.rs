//! Task management (SAM-5 §7): the functions either door asks for, and the backend's answer.

/// Task management functions (SAM-5 §7; iSCSI numbers them in RFC 7143 §11.5.1, an NVMe Abort
/// is an [`TmfFunction::AbortTask`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmfFunction {
    AbortTask,
    AbortTaskSet,
    ClearAca,
    ClearTaskSet,
    LogicalUnitReset,
    TargetWarmReset,
    TargetColdReset,
    TaskReassign,
}

/// TMF response codes (SAM-5's service responses, numbered as RFC 7143 §11.6.1 does).
pub mod tmf_response {
    pub const COMPLETE: u8 = 0;
    pub const TASK_DOES_NOT_EXIST: u8 = 1;
    pub const LUN_DOES_NOT_EXIST: u8 = 2;
    pub const REASSIGN_NOT_SUPPORTED: u8 = 4;
    pub const NOT_SUPPORTED: u8 = 5;
    pub const REJECTED: u8 = 255;
}

/// The backend's part of a task management function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmfAnswer {
    /// Done; this is the response (a [`tmf_response`] code).
    Now(u8),
    /// Commands of other nexuses are still running: the engine answers later.
    Later,
}
