//! A controller's admin side, sans I/O: its properties (Property Get / Set), the admin
//! commands (Identify, Get Log Page, Get / Set Features, Abort, Asynchronous Event Request,
//! Keep Alive) answered from a [`View`] of the subsystem the engine gives with each command,
//! and the asynchronous events it owes the host. What a namespace holds, and who may reach it,
//! is the engine's; this module only speaks the admin protocol.

use std::collections::VecDeque;

use crate::admin::{self, AdminCommand, Feature, Select};
use crate::fabrics::{self, Registers};
use crate::identify::{self, ControllerType};
use crate::log::{self, lid, AnaGroup, DiscoveryEntry, Health};
use crate::sqe::{Sqe, Status};

/// One namespace as a controller shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceView {
    pub nsid: u32,
    pub identify: identify::Namespace,
    pub uuid: [u8; 16],
}

/// What the controller answers from: the subsystem as its host sees it through this
/// controller's port, at the moment of the command.
#[derive(Clone, Debug, Default)]
pub struct View<'a> {
    pub subnqn: &'a str,
    pub serial: &'a str,
    pub model: &'a str,
    pub firmware: &'a str,
    pub namespaces: &'a [NamespaceView],
    pub ana_groups: &'a [AnaGroup],
    pub ana_change_count: u64,
    /// Some namespace has its write cache on (Identify Controller's VWC, the feature's value).
    pub volatile_write_cache: bool,
    /// A discovery controller's log entries.
    pub discovery: &'a [DiscoveryEntry],
    pub discovery_generation: u64,
    pub health: Health,
    /// The highest NSID (and ANA group ID) the subsystem could ever show (Identify's NN,
    /// ANAGRPMAX, NANAGRPID): hosts size their ANA log buffers from it once. 0: the highest
    /// present.
    pub nsid_max: u32,
}

/// What a controller is made with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControllerLimits {
    /// I/O queues a host may connect, at most.
    pub io_queues_max: u16,
    /// Entries per queue, 0's based (CAP.MQES).
    pub mqes: u16,
    /// Maximum data transfer size, a power of two of 4 KiB pages (Identify's MDTS).
    pub mdts: u8,
    /// In-capsule data a command capsule may carry, in bytes.
    pub in_capsule: u32,
    /// The keep-alive timeout a host may ask for at most, milliseconds (0 asks for none).
    pub kato_ms_max: u32,
}

/// The admin and I/O opcodes an I/O controller runs, and those that change blocks.
const ADMIN_OPS: &[u8] = &[0x02, 0x06, 0x08, 0x09, 0x0A, 0x0C, 0x18];
const IO_OPS: &[u8] = &[0x00, 0x01, 0x02, 0x05, 0x08, 0x09, 0x0D, 0x0E, 0x11, 0x15];
const IO_CHANGES: &[u8] = &[0x01, 0x08, 0x09];

/// Asynchronous Event Requests a controller holds at once (AERL + 1).
pub const AER_MAX: usize = 4;

/// The highest controller ID a host may be given: 0 and FFF0h and above are reserved (NVMe
/// base specification, Identify Controller CNTLID; FFFFh and FFFEh mean "any" in Connect).
pub const CNTLID_MAX: u16 = 0xFFEF;
/// Keep-alive granularity: 100 ms units (KAS).
const KAS_100MS: u16 = 1;
/// The ANA transition time the controller reports, seconds.
const ANATT_S: u8 = 10;

/// Abort commands a host may have outstanding (Identify Controller ACL, 0's based there).
pub const ABORTS_MAX: u8 = 4;
/// Abort Command Limit Exceeded (command specific 03h).
pub const ABORT_LIMIT_EXCEEDED: Status = Status {
    sct: 1,
    sc: 0x03,
    dnr: true,
};
/// Command Sequence Error (generic 0Ch): an admin command before the host enabled the
/// controller, or Number of Queues changed after I/O queues connected.
pub const COMMAND_SEQUENCE_ERROR: Status = Status {
    sct: 0,
    sc: 0x0C,
    dnr: true,
};
/// Asynchronous Event Request Limit Exceeded (command specific 05h).
pub const AER_LIMIT_EXCEEDED: Status = Status {
    sct: 1,
    sc: 0x05,
    dnr: true,
};

/// A notice the controller owes its host through an Asynchronous Event Request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// A namespace's attributes (its size) changed, or namespaces came or went.
    NamespaceAttribute,
    /// An ANA group's state changed.
    AnaChange,
    /// The discovery log changed.
    DiscoveryChange,
}

impl Notice {
    /// The completion's dword 0: event type Notice (2), its information, its log page.
    pub fn dw0(self) -> u32 {
        let (info, page): (u8, u8) = match self {
            Notice::NamespaceAttribute => (0x00, lid::CHANGED_NAMESPACES),
            Notice::AnaChange => (0x03, lid::ANA),
            Notice::DiscoveryChange => (0xF0, lid::DISCOVERY),
        };
        0x2 | u32::from(info) << 8 | u32::from(page) << 16
    }

    /// The Asynchronous Event Configuration bit that enables it.
    fn enabled_by(self) -> u32 {
        match self {
            Notice::NamespaceAttribute => identify::OAES_NS_ATTRIBUTE,
            Notice::AnaChange => identify::OAES_ANA_CHANGE,
            Notice::DiscoveryChange => 1 << 31,
        }
    }

    fn page(self) -> u8 {
        (self.dw0() >> 16) as u8
    }
}

/// An admin command's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Completion dword 0, the status, and data for the host.
    Now {
        dw0: u32,
        status: Status,
        data: Vec<u8>,
    },
    /// An Asynchronous Event Request kept until a notice completes it
    /// ([`Controller::notify`]).
    Held,
    /// Abort of command `cid` of I/O queue `sqid`: only that queue knows whether the command
    /// still waits for its data (`queue::Aborting`); the transport answers (dword 0 bit 0:
    /// 0 aborted, 1 not).
    Abort { sqid: u16, cid: u16 },
    /// Abort of the held Asynchronous Event Request `cid`: withdrawn here; the transport
    /// answers it Command Abort Requested, then the Abort with dword 0 bit 0 clear.
    EventRequestAborted { cid: u16 },
    /// Set Features (Volatile Write Cache): the write cache of every namespace of the
    /// controller on or off. A namespace's device may be shared with other hosts and with
    /// iSCSI initiators, so the transport applies it to the device as MODE SELECT does (one
    /// setting, whichever door) and answers when it is done.
    WriteCache { on: bool },
}

impl Answer {
    fn status(status: Status) -> Answer {
        Answer::Now {
            dw0: 0,
            status,
            data: Vec::new(),
        }
    }

    fn data(data: Vec<u8>) -> Answer {
        Answer::Now {
            dw0: 0,
            status: Status::SUCCESS,
            data,
        }
    }

    fn value(dw0: u32) -> Answer {
        Answer::Now {
            dw0,
            status: Status::SUCCESS,
            data: Vec::new(),
        }
    }
}

/// One controller: its properties, its features, its held event requests.
#[derive(Debug)]
pub struct Controller {
    pub cntlid: u16,
    pub kind: ControllerType,
    pub regs: Registers,
    limits: ControllerLimits,
    kato_ms: u32,
    /// Asynchronous Event Configuration.
    aec: u32,
    /// I/O queue pairs granted by Number of Queues (all of `io_queues_max` until asked).
    queues: u16,
    /// Event requests held (their command identifiers), oldest first.
    held: VecDeque<u16>,
    /// Notices not yet sent (no request held), and notices sent whose log page the host has
    /// not read yet (masked: not sent again until it has).
    owed: Vec<Notice>,
    masked: Vec<Notice>,
    /// Namespaces whose attributes changed since the host last read the list.
    changed: Vec<u32>,
}

impl Controller {
    pub fn new(
        cntlid: u16,
        kind: ControllerType,
        limits: ControllerLimits,
        kato_ms: u32,
    ) -> Controller {
        assert!(limits.io_queues_max > 0 || kind == ControllerType::Discovery);
        Controller {
            cntlid,
            kind,
            regs: Registers::new(limits.mqes),
            limits,
            kato_ms: kato_ms.min(limits.kato_ms_max),
            aec: 0,
            queues: limits.io_queues_max,
            held: VecDeque::new(),
            owed: Vec::new(),
            masked: Vec::new(),
            changed: Vec::new(),
        }
    }

    /// The keep-alive timeout in force, milliseconds (0: none).
    pub fn kato_ms(&self) -> u32 {
        self.kato_ms
    }

    /// I/O queues the host may connect (their IDs are 1..=this).
    pub fn io_queues(&self) -> u16 {
        self.queues
    }

    /// Property Get (`value` in dword 0 and 1) or Set, on the admin queue.
    pub fn property(&mut self, sqe: &Sqe) -> (u64, Status) {
        let (offset, size8) = match fabrics::property(sqe) {
            Ok(p) => p,
            Err(s) => return (0, s),
        };
        if sqe.fctype() == fabrics::fctype::PROPERTY_GET {
            return match self.regs.get(offset, size8) {
                Ok(v) => (v, Status::SUCCESS),
                Err(s) => (0, s),
            };
        }
        let value = sqe.u64_at(48);
        let was_ready = self.regs.ready();
        match self.regs.set(offset, size8, value) {
            Ok(()) => {
                if was_ready && !self.regs.ready() {
                    // A controller reset: held requests end with it (the host knows).
                    self.held.clear();
                }
                (0, Status::SUCCESS)
            }
            Err(s) => (0, s),
        }
    }

    /// Runs an admin command against `view`.
    pub fn admin(&mut self, sqe: &Sqe, view: &View<'_>) -> Answer {
        if !self.regs.ready() {
            return Answer::status(COMMAND_SEQUENCE_ERROR);
        }
        let command = match AdminCommand::decode(sqe) {
            Ok(c) => c,
            Err(s) => return Answer::status(s),
        };
        match command {
            AdminCommand::Identify {
                cns, nsid, csi: 0, ..
            } => self.identify(cns, nsid, view),
            AdminCommand::Identify { .. } => Answer::status(Status::INVALID_FIELD),
            AdminCommand::GetLogPage(page) => self.log_page(&page, view),
            AdminCommand::GetFeatures { feature, select } => {
                self.get_feature(feature, select, view)
            }
            AdminCommand::SetFeatures { feature, value, .. } => self.set_feature(feature, value),
            AdminCommand::Abort { sqid: 0, cid } => self.abort_admin(cid),
            AdminCommand::Abort { sqid, cid } => Answer::Abort { sqid, cid },
            AdminCommand::AsyncEventRequest => self.hold(sqe.cid()),
            AdminCommand::KeepAlive => Answer::value(0),
        }
    }

    fn identify(&self, cns: u8, nsid: u32, view: &View<'_>) -> Answer {
        let find = || view.namespaces.iter().find(|n| n.nsid == nsid);
        match cns {
            identify::cns::CONTROLLER => Answer::data(self.identity(view).encode()),
            identify::cns::NAMESPACE => match (nsid, find()) {
                (0 | u32::MAX, _) => Answer::status(Status::INVALID_NAMESPACE),
                (_, Some(ns)) => Answer::data(ns.identify.encode()),
                // A valid NSID that is not active here: zeros.
                (_, None) => Answer::data(vec![0; identify::IDENTIFY_LEN]),
            },
            identify::cns::ACTIVE_NAMESPACES => {
                if nsid >= u32::MAX - 1 {
                    return Answer::status(Status::INVALID_NAMESPACE);
                }
                let nsids: Vec<u32> = view.namespaces.iter().map(|n| n.nsid).collect();
                Answer::data(identify::active_namespaces(&nsids, nsid))
            }
            identify::cns::NS_INDEPENDENT => match (nsid, find()) {
                (0 | u32::MAX, _) => Answer::status(Status::INVALID_NAMESPACE),
                (_, Some(ns)) => Answer::data(ns.identify.encode_independent()),
                (_, None) => Answer::data(vec![0; identify::IDENTIFY_LEN]),
            },
            identify::cns::NS_DESCRIPTORS => match find() {
                Some(ns) => Answer::data(identify::ns_descriptors(
                    &ns.identify.eui64,
                    &ns.identify.nguid,
                    &ns.uuid,
                )),
                None => Answer::status(Status::INVALID_NAMESPACE),
            },
            _ => Answer::status(Status::INVALID_FIELD),
        }
    }

    /// Identify Controller's data.
    pub fn identity(&self, view: &View<'_>) -> identify::Controller {
        let io = self.kind == ControllerType::Io;
        identify::Controller {
            serial: view.serial.to_string(),
            model: view.model.to_string(),
            firmware: view.firmware.to_string(),
            cntlid: self.cntlid,
            kind: self.kind,
            mdts: self.limits.mdts,
            maxcmd: self.limits.mqes.saturating_add(1),
            nn: self.nsid_max(view),
            oncs: if io {
                identify::ONCS_COMPARE
                    | identify::ONCS_DSM
                    | identify::ONCS_WRITE_ZEROES
                    | identify::ONCS_RESERVATIONS
            } else {
                0
            },
            fused_compare_write: io,
            volatile_write_cache: view.volatile_write_cache,
            cmic: if io {
                identify::CMIC_MULTI_PORT | identify::CMIC_MULTI_CONTROLLER | identify::CMIC_ANA
            } else {
                0
            },
            oaes: if io {
                identify::OAES_NS_ATTRIBUTE | identify::OAES_ANA_CHANGE
            } else {
                1 << 31
            },
            aerl: (AER_MAX - 1) as u8,
            elpe: 0,
            kas: KAS_100MS,
            anatt: ANATT_S,
            anagrpmax: if io { self.nsid_max(view) } else { 0 },
            nanagrpid: if io { self.nsid_max(view) } else { 0 },
            subnqn: view.subnqn.to_string(),
            in_capsule: self.limits.in_capsule,
        }
    }

    fn nsid_max(&self, view: &View<'_>) -> u32 {
        let present = view.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0);
        view.nsid_max.max(present)
    }

    fn log_page(&mut self, page: &log::GetLogPage, view: &View<'_>) -> Answer {
        let io = self.kind == ControllerType::Io;
        let bytes = match (page.lid, io) {
            (lid::ERROR, _) => log::error_log(1),
            (lid::SMART, true) => log::smart(&view.health),
            (lid::COMMAND_EFFECTS, true) => log::command_effects(ADMIN_OPS, IO_OPS, IO_CHANGES),
            (lid::CHANGED_NAMESPACES, true) => {
                let list = log::changed_namespaces(&self.changed);
                if !page.rae {
                    self.changed.clear();
                }
                list
            }
            (lid::ANA, true) => log::ana(view.ana_change_count, view.ana_groups, page.lsp & 1 != 0),
            (lid::DISCOVERY, false) => log::discovery(view.discovery_generation, view.discovery),
            _ => return Answer::status(Status::INVALID_FIELD),
        };
        if !page.rae {
            // Reading the page clears its notice: the next change is reported again.
            self.masked.retain(|n| n.page() != page.lid);
        }
        match page.window(&bytes) {
            Ok(w) => Answer::data(w.to_vec()),
            Err(s) => Answer::status(s),
        }
    }

    fn get_feature(&self, feature: Feature, select: Select, view: &View<'_>) -> Answer {
        if select == Select::Capabilities {
            // Not saveable, not per namespace, changeable.
            return Answer::value(1 << 2);
        }
        let current = select == Select::Current;
        Answer::value(match feature {
            Feature::VolatileWriteCache => u32::from(view.volatile_write_cache),
            Feature::NumberOfQueues => {
                let n = if current {
                    self.queues
                } else {
                    self.limits.io_queues_max
                };
                let n = u32::from(n.saturating_sub(1));
                n | n << 16
            }
            Feature::AsyncEventConfig => {
                if current {
                    self.aec
                } else {
                    0
                }
            }
            Feature::KeepAliveTimer => {
                if current {
                    self.kato_ms
                } else {
                    0
                }
            }
        })
    }

    fn set_feature(&mut self, feature: Feature, value: u32) -> Answer {
        match feature {
            Feature::VolatileWriteCache => Answer::WriteCache { on: value & 1 != 0 },
            Feature::NumberOfQueues => {
                match admin::number_of_queues(value, self.limits.io_queues_max) {
                    Ok(granted) => {
                        self.queues = (granted & 0xFFFF) as u16 + 1;
                        Answer::value(granted)
                    }
                    Err(s) => Answer::status(s),
                }
            }
            Feature::AsyncEventConfig => {
                self.aec = value;
                Answer::value(0)
            }
            Feature::KeepAliveTimer => {
                if value > self.limits.kato_ms_max {
                    return Answer::status(Status::INVALID_FIELD);
                }
                self.kato_ms = value;
                Answer::value(0)
            }
        }
    }

    /// An admin command other than a held event request has its answer already: "not
    /// aborted" (dword 0 bit 0).
    fn abort_admin(&mut self, cid: u16) -> Answer {
        match self.held.iter().position(|&c| c == cid) {
            Some(i) => {
                self.held.remove(i);
                Answer::EventRequestAborted { cid }
            }
            None => Answer::value(1),
        }
    }

    fn hold(&mut self, cid: u16) -> Answer {
        if self.held.len() >= AER_MAX {
            return Answer::status(AER_LIMIT_EXCEEDED);
        }
        self.held.push_back(cid);
        Answer::Held
    }

    /// A notice for the host: the held request it completes (its command identifier and
    /// dword 0), if one is held and the host enabled the notice and has read the last one.
    /// Otherwise it is kept for the next request. `nsids`: the namespaces a
    /// [`Notice::NamespaceAttribute`] is about.
    pub fn notify(&mut self, notice: Notice, nsids: &[u32]) -> Option<(u16, u32)> {
        if notice == Notice::NamespaceAttribute {
            for n in nsids {
                if !self.changed.contains(n) {
                    self.changed.push(*n);
                }
            }
        }
        if self.aec & notice.enabled_by() == 0 && self.kind == ControllerType::Io {
            return None;
        }
        if self.masked.contains(&notice) || self.owed.contains(&notice) {
            return None;
        }
        self.owed.push(notice);
        self.deliver()
    }

    /// The oldest owed notice, if a request is held to carry it.
    fn deliver(&mut self) -> Option<(u16, u32)> {
        if self.owed.is_empty() {
            return None;
        }
        let cid = self.held.pop_front()?;
        let notice = self.owed.remove(0);
        self.masked.push(notice);
        Some((cid, notice.dw0()))
    }

    /// After an Asynchronous Event Request was held: a notice owed meanwhile completes it.
    pub fn pending_notice(&mut self) -> Option<(u16, u32)> {
        self.deliver()
    }

    /// How many event requests it holds (their commands stay open in the admin queue).
    pub fn held_requests(&self) -> usize {
        self.held.len()
    }

    /// The held requests, answered Aborted – SQ Deletion when the controller goes away.
    pub fn take_held(&mut self) -> Vec<u16> {
        self.held.drain(..).collect()
    }
}

#[cfg(test)]
mod tests;
