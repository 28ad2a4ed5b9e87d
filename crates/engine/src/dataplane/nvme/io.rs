//! A connected queue's commands: Fabrics commands, admin commands (the `nvme` core's
//! controller, answering from the namespaces the LUN map gives), and NVM commands run as the
//! SCSI commands they translate to, through the session backend every iSCSI command takes.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use nvme::controller::{Answer, Notice, View};
use nvme::fabrics::fctype;
use nvme::nvm::IoCommand;
use nvme::queue::{Data, Received};
use nvme::sqe::{Status, FABRICS};
use nvme::translate::{self, ScsiCommand};
use seam::{DataOutBuf, DeferredCommand, Execution, ScsiBackend, ScsiRequest};

use super::discovery;
use super::view::{self, Namespaces};
use super::{Driver, Role};
use crate::admission::controllers::ControllerEntry;
use crate::dataplane::backend::{Backend, Completed};
use crate::dataplane::closed::Ended;

/// SIMPLE task attribute (the iSCSI ATTR field's value): NVMe has no ordering attributes.
const TASK_SIMPLE: u8 = 1;

/// A queue's clock and what its admin queue last showed the host.
pub(super) struct Life {
    admin: bool,
    last_keep_alive: Instant,
    /// When the admin queue last received a command (a discovery controller without
    /// keep-alive is closed after `DISCOVERY_IDLE` of none).
    last_command: Instant,
    kato: Duration,
    /// The namespaces as last compared (for notices).
    /// Boxed: only an admin queue has them, and an I/O queue, parked, keeps its `Life`.
    shown: Option<Box<Namespaces>>,
    /// A discovery controller's log as last compared (for its change notice).
    listed: Option<Vec<nvme::log::DiscoveryEntry>>,
}

impl Life {
    pub(super) fn new(admin: bool) -> Life {
        let now = Instant::now();
        Life {
            admin,
            last_keep_alive: now,
            last_command: now,
            kato: Duration::ZERO,
            shown: None,
            listed: None,
        }
    }

    fn kept_alive(&mut self, now: Instant, kato_ms: u32) {
        self.last_keep_alive = now;
        self.kato = Duration::from_millis(kato_ms.into());
    }

    /// No Keep Alive within the timeout (plus `slack`): the host is gone.
    pub(super) fn keep_alive_late(&self, now: Instant, slack: Duration) -> bool {
        self.keep_alive_deadline(slack).is_some_and(|d| now >= d)
    }

    /// An admin queue without keep-alive (KATO 0) that has received nothing for `idle`.
    pub(super) fn idle_without_keep_alive(&self, now: Instant, idle: Duration) -> bool {
        self.idle_deadline(idle).is_some_and(|d| now >= d)
    }

    /// When [`Life::keep_alive_late`] turns true, if no Keep Alive comes before.
    pub(super) fn keep_alive_deadline(&self, slack: Duration) -> Option<Instant> {
        (self.admin && !self.kato.is_zero()).then(|| self.last_keep_alive + self.kato + slack)
    }

    /// When [`Life::idle_without_keep_alive`] turns true, if no command comes before.
    pub(super) fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        (self.admin && self.kato.is_zero()).then(|| self.last_command + idle)
    }
}

impl Driver {
    /// One command of a connected queue.
    pub(super) fn command(
        &mut self,
        role: &Role,
        backend: &mut Backend<'_>,
        life: &mut Life,
        r: &mut Received,
        input: &[u8],
    ) {
        let sqe = &r.sqe;
        if life.admin {
            life.last_command = Instant::now();
        }
        if !self.may_run(sqe) {
            self.answer(sqe.cid(), Status::AUTH_REQUIRED, 0, &[]);
            return;
        }
        if sqe.opcode() == FABRICS {
            self.fabrics(role, backend, life, r, r.data(input));
            return;
        }
        match role {
            Role::Admin(entry) => self.admin(entry, backend, life, r),
            Role::Io(_) => self.nvm(backend, r, input),
        }
    }

    /// Whether the queue may run `sqe` now: anything once it authenticated (or need not),
    /// before that only the authentication itself and a Disconnect. Every command of a
    /// connected queue passes here.
    fn may_run(&self, sqe: &nvme::sqe::Sqe) -> bool {
        self.auth.as_ref().is_none_or(|a| a.authenticated())
            || (sqe.opcode() == FABRICS
                && matches!(
                    sqe.fctype(),
                    fctype::AUTH_SEND | fctype::AUTH_RECEIVE | fctype::DISCONNECT
                ))
    }

    fn fabrics(
        &mut self,
        role: &Role,
        backend: &mut Backend<'_>,
        life: &mut Life,
        r: &Received,
        data: &[u8],
    ) {
        let sqe = &r.sqe;
        match (sqe.fctype(), role) {
            (fctype::PROPERTY_GET | fctype::PROPERTY_SET, Role::Admin(entry)) => {
                let (value, status) = entry.state().property(sqe);
                if sqe.fctype() == fctype::PROPERTY_SET {
                    // Enabling the controller starts its keep-alive clock.
                    life.kept_alive(Instant::now(), entry.state().kato_ms());
                }
                self.answer_wide(sqe.cid(), status, value);
            }
            (fctype::DISCONNECT, _) => {
                self.answer(sqe.cid(), Status::SUCCESS, 0, &[]);
                self.closing = true;
            }
            (fctype::CONNECT, _) => {
                self.answer(sqe.cid(), nvme::controller::COMMAND_SEQUENCE_ERROR, 0, &[]);
            }
            (fctype::AUTH_SEND, _) => self.auth_send(role, backend, r, data),
            (fctype::AUTH_RECEIVE, _) => self.auth_receive(role, backend, r),
            _ => self.answer(sqe.cid(), Status::INVALID_OPCODE, 0, &[]),
        }
    }

    /// Authentication Send: the host's next DH-HMAC-CHAP message, for a queue that must
    /// authenticate (any other refuses the command).
    fn auth_send(&mut self, role: &Role, backend: &mut Backend<'_>, r: &Received, data: &[u8]) {
        let cid = r.sqe.cid();
        let Some(auth) = self.auth.as_mut() else {
            return self.answer(cid, Status::INVALID_FIELD, 0, &[]);
        };
        match nvme::fabrics::auth_length(&r.sqe) {
            Ok(tl) if tl as usize == data.len() => {}
            _ => return self.answer(cid, Status::INVALID_FIELD, 0, &[]),
        }
        let was = auth.authenticated();
        auth.send(data);
        self.answer(cid, Status::SUCCESS, 0, &[]);
        self.after_auth_step(role, backend, was);
    }

    /// Authentication Receive: the controller's next message, in the `AL` bytes asked.
    fn auth_receive(&mut self, role: &Role, backend: &mut Backend<'_>, r: &Received) {
        let cid = r.sqe.cid();
        let Some(auth) = self.auth.as_mut() else {
            return self.answer(cid, Status::INVALID_FIELD, 0, &[]);
        };
        let al = match nvme::fabrics::auth_length(&r.sqe) {
            Ok(al) if al == r.data_in_len => al as usize,
            _ => return self.answer(cid, Status::INVALID_FIELD, 0, &[]),
        };
        let was = auth.authenticated();
        let mut random_failed = false;
        let mut message = auth.receive(&mut |buf: &mut [u8]| {
            random_failed |= crate::dataplane::login::os_random(buf).is_err();
        });
        if random_failed {
            tracing::error!(peer = %self.at.peer, "cannot read the OS random source: NVMe authentication failed");
            self.closing = true;
            return self.answer(cid, Status::INTERNAL_ERROR, 0, &[]);
        }
        if message.len() > al {
            // The host's buffer cannot hold the message: nothing of it is sent.
            self.closing = true;
            return self.answer(cid, Status::INVALID_FIELD, 0, &[]);
        }
        message.resize(al, 0);
        self.answer(cid, Status::SUCCESS, 0, &message);
        self.after_auth_step(role, backend, was);
    }

    /// After a step of the transaction: a log line when the queue authenticated; a transaction
    /// abandoned midway, and one that failed, counted toward the source's failed logins when
    /// it happens; a failed one closes the queue once its answer is sent.
    fn after_auth_step(&mut self, role: &Role, backend: &mut Backend<'_>, was: bool) {
        let Some(auth) = self.auth.as_mut() else {
            return;
        };
        let entry = role.entry();
        for _ in 0..auth.take_abandoned() {
            tracing::warn!(peer = %self.at.peer, host = %entry.host, cntlid = entry.cntlid, qid = self.qid, "NVMe authentication restarted before it ended: counted as a failed login");
            backend.shared.metrics.nvme_auth("restarted");
            backend
                .shared
                .doors
                .record_login_failure(self.at.peer.ip(), Instant::now());
        }
        if let Some(reason) = auth.failed() {
            tracing::warn!(peer = %self.at.peer, host = %entry.host, cntlid = entry.cntlid, qid = self.qid, reason = reason.name(), "NVMe authentication failed");
            backend.shared.metrics.nvme_auth(reason.name());
            backend
                .shared
                .doors
                .record_login_failure(self.at.peer.ip(), Instant::now());
            backend.close_reason = Some(Ended::AuthenticationFailed);
            self.closing = true;
        } else if auth.authenticated() && !was {
            let (hash, group) = self.auth_chosen.take().unzip();
            tracing::info!(peer = %self.at.peer, host = %entry.host, cntlid = entry.cntlid, qid = self.qid, hash = hash.map(|h| h.name()), dh_group = group.map(|g| g.name()), "NVMe queue authenticated (DH-HMAC-CHAP)");
            backend.shared.metrics.nvme_auth("success");
            self.auth_deadline = None;
            if let Role::Io(entry) = role {
                if !self.qid_held && !entry.add_io_queue(self.qid) {
                    // Another queue took the ID meanwhile: this one cannot run.
                    tracing::warn!(peer = %self.at.peer, host = %entry.host, cntlid = entry.cntlid, qid = self.qid, "NVMe I/O queue closed: its queue ID was taken while it authenticated");
                    backend.close_reason = Some(Ended::QueueIdTaken);
                    self.closing = true;
                    return;
                }
                self.qid_held = true;
            }
            if matches!(role, Role::Admin(_)) {
                self.describe(entry, entry.admitted.chap_user());
            }
        }
        if let Some(chosen) = self.auth.as_ref().and_then(|a| a.chosen()) {
            self.auth_chosen = Some(chosen);
        }
    }

    /// A completion whose dword 0 and 1 carry a 64-bit property.
    fn answer_wide(&mut self, cid: u16, status: Status, value: u64) {
        let cqe = nvme::sqe::Cqe {
            dw0: value as u32,
            dw1: (value >> 32) as u32,
            sqhd: self.queue.next_sqhd(),
            sqid: self.qid,
            cid,
            status,
        };
        self.queue.answer(&cqe, &[], &mut self.out);
    }

    fn admin(
        &mut self,
        entry: &ControllerEntry,
        backend: &mut Backend<'_>,
        life: &mut Life,
        r: &Received,
    ) {
        let namespaces = self.namespaces_of(backend);
        let discovery = self.discovery_entries(entry, backend);
        let subnqn = entry
            .subsystem
            .as_ref()
            .map_or(nvme::fabrics::DISCOVERY_NQN, |s| s.as_str());
        let serial = view::serial_of(subnqn);
        let v = View {
            subnqn,
            serial: &serial,
            model: "ferrosan",
            firmware: env!("CARGO_PKG_VERSION"),
            namespaces: &namespaces.views,
            ana_groups: &namespaces.ana,
            ana_change_count: backend.view.topology.generation,
            volatile_write_cache: namespaces.write_cache,
            discovery: &discovery,
            discovery_generation: backend.view.topology.generation,
            health: Default::default(),
            nsid_max: view::NSID_MAX,
        };
        let answer = entry.state().admin(&r.sqe, &v);
        if r.sqe.opcode() == nvme::admin::opcode::KEEP_ALIVE {
            life.kept_alive(Instant::now(), entry.state().kato_ms());
        }
        match answer {
            Answer::Now {
                dw0,
                status,
                mut data,
            } => {
                // Exactly what the host asked for: a page read past its end reads zeros.
                data.resize(r.data_in_len as usize, 0);
                self.answer(r.sqe.cid(), status, dw0, &data);
            }
            Answer::Held => {
                if let Some((cid, dw0)) = entry.state().pending_notice() {
                    self.answer(cid, Status::SUCCESS, dw0, &[]);
                }
            }
            Answer::WriteCache { on } => {
                self.set_write_cache(backend, r.sqe.cid(), &namespaces, on);
            }
            Answer::Abort { sqid, cid } => self.abort_asked(entry, r.sqe.cid(), sqid, cid),
            Answer::EventRequestAborted { cid } => {
                self.answer(cid, Status::ABORTED_BY_REQUEST, 0, &[]);
                self.answer(r.sqe.cid(), Status::SUCCESS, 0, &[]);
            }
        }
        if life.shown.is_none() {
            life.shown = Some(Box::new(namespaces));
        }
    }

    /// Set Features (Volatile Write Cache): MODE SELECT of the caching page on each
    /// namespace's device, one after another (`synced`), through the route and gate every
    /// command takes, so an iSCSI initiator's WCE and this are one setting; answered when the
    /// last is back, or at the first that fails.
    fn set_write_cache(
        &mut self,
        backend: &mut Backend<'_>,
        cid: u16,
        namespaces: &Namespaces,
        on: bool,
    ) {
        let mut luns = namespaces.views.iter().filter_map(|v| view::lun_of(v.nsid));
        let Some(first) = luns.next() else {
            return self.answer(cid, Status::SUCCESS, 0, &[]);
        };
        for lun in luns {
            self.synced.push((cid, lun, translate::write_cache(on)));
        }
        self.run(backend, cid, first, &translate::write_cache(on));
    }

    fn namespaces_of(&self, backend: &Backend<'_>) -> Namespaces {
        match (&backend.view.luns, &backend.view.nexus) {
            (Some(luns), Some(nexus)) => view::namespaces(luns, &nexus.target_port),
            _ => Namespaces::default(),
        }
    }

    /// The discovery log this controller's host may read (none for an I/O controller).
    fn discovery_entries(
        &self,
        entry: &ControllerEntry,
        backend: &Backend<'_>,
    ) -> Vec<nvme::log::DiscoveryEntry> {
        if entry.subsystem.is_some() {
            return Vec::new();
        }
        let asker = discovery::Asker {
            host: &entry.host,
            peer: self.at.peer.ip(),
            local: self.at.local,
            portal_group_tag: self.at.portal_group_tag,
        };
        discovery::entries(&backend.view.topology, &asker)
    }

    /// When nudged, on an admin queue: an ANA state or a namespace that changed since the
    /// last look is owed a notice (it completes a held Asynchronous Event Request); on a
    /// discovery controller, a discovery log that changed (a subsystem, a portal or a mapping
    /// the host may reach added or removed, live) is owed *discovery log page change*.
    pub(super) fn notices(
        &mut self,
        entry: &ControllerEntry,
        backend: &Backend<'_>,
        life: &mut Life,
    ) {
        if entry.subsystem.is_none() {
            let now = self.discovery_entries(entry, backend);
            if life
                .listed
                .replace(now.clone())
                .is_some_and(|before| before != now)
            {
                let owed = entry.state().notify(Notice::DiscoveryChange, &[]);
                if let Some((cid, dw0)) = owed {
                    self.answer(cid, Status::SUCCESS, dw0, &[]);
                }
            }
            return;
        }
        let now = self.namespaces_of(backend);
        let Some(before) = life.shown.replace(Box::new(now.clone())) else {
            return;
        };
        let (ana_moved, changed) = view::changes(&before, &now);
        let mut owed = Vec::new();
        {
            let mut state = entry.state();
            if ana_moved {
                owed.extend(state.notify(Notice::AnaChange, &[]));
            }
            if !changed.is_empty() {
                owed.extend(state.notify(Notice::NamespaceAttribute, &changed));
            }
        }
        for (cid, dw0) in owed {
            self.answer(cid, Status::SUCCESS, dw0, &[]);
        }
    }

    /// An NVM command: decoded, its namespace found, translated and run.
    /// `input`: what the receive call that returned `r` was given (its in-capsule data).
    fn nvm(&mut self, backend: &mut Backend<'_>, r: &mut Received, input: &[u8]) {
        let cid = r.sqe.cid();
        let decoded = IoCommand::decode(&r.sqe);
        let command = match &decoded {
            Ok(c) => c,
            Err(status) => return self.answer(cid, *status, 0, &[]),
        };
        if self.fusing(backend, r, command, input) {
            return;
        }
        let Some((lun, block_size)) = namespace(backend, r.sqe.nsid()) else {
            return self.answer(cid, Status::INVALID_NAMESPACE, 0, &[]);
        };
        match command {
            IoCommand::DatasetManagement {
                deallocate: false, ..
            } => {
                // Hints only: nothing to do.
                return self.answer(cid, Status::SUCCESS, 0, &[]);
            }
            &IoCommand::ReservationReport { dwords, extended } => {
                // READ FULL STATUS, its answer reshaped when it is back (`finish`).
                let len = (dwords as usize)
                    .saturating_mul(4)
                    .min(r.data_in_len as usize);
                // APTPL, which READ FULL STATUS does not carry, from the LU itself.
                let ptpl = backend
                    .view
                    .luns
                    .as_ref()
                    .and_then(|l| l.get(lun))
                    .is_some_and(|e| e.lu.persistent_reservations().aptpl);
                self.reports.push((cid, extended, len, ptpl));
                return self.run(backend, cid, lun, &translate::reservation_report());
            }
            _ => {}
        }
        // A write's data gathered from H2CData is the command's own buffer (memory its direct
        // I/O writes from, when the queue placed it so): handed over, not copied.
        if let (IoCommand::Write { .. }, Data::Gathered(buf)) = (command, &mut r.data) {
            let buf = std::mem::take(buf);
            return self.gathered_write(backend, (cid, lun, block_size), command, buf);
        }
        // Results matched by reference, not moved: a command's CDB is read where it was built.
        let split = translate::split_fua_write_zeroes(command);
        let command = split.as_ref().map_or(command, |(plain, _)| plain);
        let scsi = translate::scsi_command(command, r.data(input), block_size);
        let scsi = match &scsi {
            Ok(s) => s,
            Err(status) => return self.answer(cid, *status, 0, &[]),
        };
        if scsi.read && scsi.data_in_len != r.data_in_len {
            return self.answer(cid, Status::DATA_SGL_LENGTH_INVALID, 0, &[]);
        }
        if let Some((_, sync)) = split {
            self.synced.push((cid, lun, sync));
        }
        self.run(backend, cid, lun, scsi);
    }

    /// Whether `r` belongs to a fused pair (ESXi's ATS, Linux's compare-and-write) and was
    /// taken care of: the first waits for the second; anything else in between fails the first.
    fn fusing(
        &mut self,
        backend: &mut Backend<'_>,
        r: &Received,
        command: &IoCommand,
        input: &[u8],
    ) -> bool {
        let cid = r.sqe.cid();
        match (r.sqe.fuse(), self.fused.take()) {
            (1, None) => {
                self.fused = Some((r.to_owned(input), *command));
                true
            }
            (2, Some((first, first_command))) => {
                let second = r.to_owned(input);
                self.fused_pair(backend, first, first_command, second, *command);
                true
            }
            (fuse, Some((first, _))) => {
                self.answer(first.sqe.cid(), Status::ABORTED_FUSE_MISSING, 0, &[]);
                if fuse != 0 {
                    self.answer(cid, Status::ABORTED_FUSE_MISSING, 0, &[]);
                }
                fuse != 0
            }
            (0, None) => false,
            (_, None) => {
                self.answer(cid, Status::ABORTED_FUSE_MISSING, 0, &[]);
                true
            }
        }
    }

    /// A Write whose data was gathered from H2CData into `buf`: translated, then run with the
    /// buffer handed over whole.
    fn gathered_write(
        &mut self,
        backend: &mut Backend<'_>,
        (cid, lun, block_size): (u16, u64, u32),
        command: &IoCommand,
        buf: DataOutBuf,
    ) {
        let head: ScsiCommand<'static> = match translate::scsi_command(command, &buf, block_size) {
            Ok(s) => ScsiCommand {
                // The data is `buf`'s, given to `run_with` beside the command.
                data_out: Cow::Borrowed(&[]),
                cdb: s.cdb,
                data_in_len: s.data_in_len,
                read: s.read,
                write: s.write,
            },
            Err(status) => {
                buf.recycle(&mut self.conn.out);
                return self.answer(cid, status, 0, &[]);
            }
        };
        self.run_with(backend, cid, lun, &head, Some(buf));
    }

    fn fused_pair(
        &mut self,
        backend: &mut Backend<'_>,
        first: Received,
        first_command: IoCommand,
        second: Received,
        second_command: IoCommand,
    ) {
        let (c1, c2) = (first.sqe.cid(), second.sqe.cid());
        let fail = |d: &mut Driver, status| {
            d.answer(c1, status, 0, &[]);
            d.answer(c2, Status::ABORTED_FUSE_FAILED, 0, &[]);
        };
        if first.sqe.nsid() != second.sqe.nsid() {
            return fail(self, Status::INVALID_FIELD);
        }
        let Some((lun, block_size)) = namespace(backend, first.sqe.nsid()) else {
            return fail(self, Status::INVALID_NAMESPACE);
        };
        match translate::compare_and_write(
            &first_command,
            first.data(&[]),
            &second_command,
            second.data(&[]),
            block_size,
        ) {
            Ok(scsi) => {
                self.fused_pairs.push((c2, c1));
                self.run(backend, c2, lun, &scsi);
            }
            Err(status) => fail(self, status),
        }
    }

    /// Runs a translated command on the session backend: inline, or handed to its route
    /// (`defer`), its answer then coming back through `complete`.
    fn run(&mut self, backend: &mut Backend<'_>, cid: u16, lun: u64, scsi: &ScsiCommand) {
        self.run_with(backend, cid, lun, scsi, None);
    }

    /// As [`Driver::run`]; a write's Data-Out is `owned` when given (the command's own buffer,
    /// handed over as it is if the command runs elsewhere), else `scsi.data_out`.
    fn run_with(
        &mut self,
        backend: &mut Backend<'_>,
        cid: u16,
        lun: u64,
        scsi: &ScsiCommand,
        mut owned: Option<DataOutBuf>,
    ) {
        let data_out: &[u8] = owned.as_deref().unwrap_or(&scsi.data_out);
        let write = !data_out.is_empty();
        let expected_len = if scsi.read {
            scsi.data_in_len
        } else {
            data_out.len() as u32
        };
        let wire_lun = scsi::lun_to_wire(lun);
        let req = ScsiRequest {
            tag: u32::from(cid),
            lun: wire_lun,
            cdb: &scsi.cdb,
            data_out,
            expected_len,
            read: scsi.read,
            write,
            task_attr: TASK_SIMPLE,
            // A page-cached file range goes out with sendfile, unless a data digest needs
            // its bytes.
            may_lend_file: scsi.read && !self.queue.digests().1,
        };
        // Only a command with Data-In fills a buffer: a write's answer carries none.
        let mut data_in = if scsi.read {
            self.conn.out.take_buffer()
        } else {
            Vec::new()
        };
        let mut sense = Vec::new();
        let mut lent = std::mem::take(&mut backend.loan);
        lent.clear();
        match backend.execute(&req, &mut data_in, &mut lent, &mut sense) {
            Execution::Done(outcome) => {
                if let Some(buf) = owned {
                    buf.recycle(&mut self.conn.out);
                }
                let status = translate::status_of(outcome.status, &sense);
                let payload = self.payload_of(data_in, &mut lent);
                self.finish(backend, cid, status, payload, expected_len as usize);
                lent.clear();
                backend.loan = lent;
            }
            Execution::Deferred => {
                self.conn.out.give_back(data_in);
                backend.loan = lent;
                let data_out = match owned.take() {
                    Some(buf) => buf,
                    None => self.data_out_of(backend, wire_lun, &scsi.data_out),
                };
                let command = DeferredCommand {
                    tag: u32::from(cid),
                    lun: wire_lun,
                    cdb: scsi.cdb.to_vec(),
                    data_out,
                    expected_len,
                    read: scsi.read,
                    write,
                    task_attr: TASK_SIMPLE,
                };
                backend.defer(command, self.conn.out.read_buffers());
            }
        }
    }

    /// An inline command's Data-In as an outbox payload: the file range or store memory it
    /// lent, else the bytes it filled.
    fn payload_of(&mut self, data_in: Vec<u8>, lent: &mut seam::Loan) -> Option<usize> {
        if let Some(file) = lent.file.take() {
            self.conn.out.give_back(data_in);
            Some(self.conn.out.lend_file(file))
        } else if !lent.slices.is_empty() {
            self.conn.out.give_back(data_in);
            Some(self.conn.out.lend(&mut lent.slices))
        } else {
            self.adopt(data_in)
        }
    }

    /// A deferred command's own copy of its Data-Out (in-capsule data lies in the receive
    /// buffer, which the next read reuses): in the memory its I/O path will write from when
    /// the backend has such (aligned, for direct I/O: one copy, as an iSCSI write's immediate
    /// data takes), else in a recycled buffer of the queue.
    fn data_out_of(&mut self, backend: &mut Backend<'_>, lun: [u8; 8], data: &[u8]) -> DataOutBuf {
        if data.is_empty() {
            return DataOutBuf::default();
        }
        if let Some(mut memory) = backend.data_out_memory(lun, data.len()) {
            memory.bytes_mut().copy_from_slice(data);
            return DataOutBuf::Engine(memory);
        }
        let mut buf = self.conn.out.take_buffer();
        buf.clear();
        buf.extend_from_slice(data);
        DataOutBuf::Pooled(buf)
    }

    /// A command that ran elsewhere is back: its budget and counts settled, then answered.
    pub(super) fn complete(&mut self, backend: &mut Backend<'_>, mut done: Completed) {
        backend.settle(&done);
        std::mem::take(&mut done.data_out).recycle(&mut self.conn.out);
        let status = translate::status_of(done.outcome.status, &done.sense);
        let cid = done.tag as u16;
        let payload = match done.lent {
            Some(slice) => {
                self.conn.out.give_back(done.data_in);
                Some(self.conn.out.lend(&mut vec![slice]))
            }
            None => self.adopt(done.data_in),
        };
        self.finish(backend, cid, status, payload, done.expected_len as usize);
    }

    /// A command's Data-In buffer as an outbox payload; none when it is empty (a write's), so
    /// the answer queues no payload to recycle.
    fn adopt(&mut self, data_in: Vec<u8>) -> Option<usize> {
        if data_in.is_empty() {
            self.conn.out.give_back(data_in);
            return None;
        }
        Some(self.conn.out.adopt(data_in))
    }

    /// Answers command `cid` with the first `limit` bytes of the outbox's `payload` and, for
    /// the write of a fused pair, its compare too; a Reservation Report's answer is reshaped
    /// from READ FULL STATUS's; a Write Zeroes with FUA runs its SYNCHRONIZE CACHE first.
    fn finish(
        &mut self,
        backend: &mut Backend<'_>,
        cid: u16,
        status: Status,
        payload: Option<usize>,
        limit: usize,
    ) {
        if let Some(i) = self.synced.iter().position(|(c, ..)| *c == cid) {
            let (_, lun, next) = self.synced.swap_remove(i);
            if status.is_success() {
                // Answered when the last is back (this same path, the entries gone).
                return self.run(backend, cid, lun, &next);
            }
            // The first failure answers: nothing more runs for this command.
            self.synced.retain(|(c, ..)| *c != cid);
        }
        let len = payload.map_or(0, |p| self.conn.out.payload_len(p).min(limit));
        if let Some(i) = self.reports.iter().position(|&(c, ..)| c == cid) {
            let (_, extended, asked, ptpl) = self.reports.swap_remove(i);
            let mut full_status = Vec::with_capacity(len);
            if let Some(payload) = payload {
                self.conn
                    .out
                    .for_each_payload_piece(payload, 0..len, |p| full_status.extend_from_slice(p));
            }
            let report = translate::reservation_status(&full_status, extended, ptpl, asked);
            return self.answer(cid, status, 0, &report);
        }
        if let Some(i) = self.fused_pairs.iter().position(|&(w, _)| w == cid) {
            let (_, compare) = self.fused_pairs.swap_remove(i);
            if status == Status::COMPARE_FAILURE {
                self.answer(compare, status, 0, &[]);
                self.answer(cid, Status::ABORTED_FUSE_FAILED, 0, &[]);
            } else {
                self.answer(compare, status, 0, &[]);
                self.answer(cid, status, 0, &[]);
            }
            return;
        }
        self.answer_queued(cid, status, payload, len);
    }
}

/// The LUN and block size of namespace `nsid` in the session's map.
fn namespace(backend: &Backend<'_>, nsid: u32) -> Option<(u64, u32)> {
    let lun = view::lun_of(nsid)?;
    let entry = backend.view.luns.as_ref()?.get(lun)?;
    Some((lun, entry.lu.settings().block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_silent_admin_queue_without_keep_alive_is_idle() {
        let idle = Duration::from_secs(60);
        let mut life = Life::new(true);
        let t0 = life.last_command;
        assert!(!life.idle_without_keep_alive(t0 + Duration::from_secs(59), idle));
        assert!(life.idle_without_keep_alive(t0 + Duration::from_secs(61), idle));
        // A command resets the clock.
        life.last_command = t0 + Duration::from_secs(30);
        assert!(!life.idle_without_keep_alive(t0 + Duration::from_secs(61), idle));
        // With keep-alive on, its own timeout rules instead.
        life.kept_alive(t0, 5_000);
        assert!(!life.idle_without_keep_alive(t0 + Duration::from_secs(600), idle));
        assert!(life.keep_alive_late(t0 + Duration::from_secs(7), Duration::from_secs(1)));
        // An I/O queue never is.
        let io = Life::new(false);
        assert!(!io.idle_without_keep_alive(t0 + Duration::from_secs(600), idle));
    }
}
