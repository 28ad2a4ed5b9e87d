//! `ferrosan ctl`: the control socket's client (protocol in docs/OPERATIONS.md). One request,
//! one reply; human-readable by default, the daemon's JSON reply as it is with `--json`.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
// The longest wait for the daemon's answer (a reload opening devices can take a while), and the
// verbs awaited without one: the same over the socket as over the API.
use client::{COPYING_VERBS, REPLY_TIMEOUT};
use serde_json::{json, Value};

#[derive(Args)]
pub struct CtlArgs {
    /// The daemon's control socket (default: the daemon's default for this user).
    #[arg(long, global = true, conflicts_with = "url")]
    socket: Option<PathBuf>,
    /// A daemon's remote API instead of the local socket: https://HOST:PORT (docs/OPERATIONS.md,
    /// *Remote API*).
    #[arg(long, global = true, value_name = "URL")]
    url: Option<String>,
    /// The file holding the API token (`ctl token create` prints it).
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// A client certificate (PEM) instead of a token, from a CA of the daemon's
    /// `api_client_ca`; its common name is the name of the token whose role it has.
    #[arg(long, global = true, value_name = "FILE", requires = "key_file")]
    cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM, PKCS#8).
    #[arg(long, global = true, value_name = "FILE", requires = "cert_file")]
    key_file: Option<PathBuf>,
    /// The certificate (PEM) the API's certificate must be or be signed by; default: the
    /// system's trusted roots. A daemon's self-signed one is STATE_DIR/api-cert.pem.
    #[arg(long, global = true, value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// Print the daemon's JSON reply instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Change only if the running config is still this generation (`ctl status` shows it):
    /// refused with `conflict` if anything changed since it was read.
    #[arg(long, global = true, value_name = "N")]
    if_generation: Option<u64>,
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Version, uptime, config generation, unsaved changes, counts.
    Status,
    /// Sessions of both doors: ID (iSCSI TSIH, NVMe controller ID), door, initiator, target,
    /// portal, source, digests, the door's own keys, age, I/O.
    Sessions,
    /// LUNs by target and group, with their devices.
    Luns,
    /// The running config.
    Config {
        #[command(subcommand)]
        what: ConfigVerb,
    },
    /// Re-read the config file and apply the difference (as SIGHUP does). Refused while the
    /// running config has changes made here and not saved, which it would undo (listed).
    Reload {
        /// Drop the unsaved changes: the file's config runs.
        #[arg(long)]
        discard: bool,
    },
    /// Write the running config (with changes made here) over the config file, atomically.
    Save,
    /// Sessions.
    Session {
        #[command(subcommand)]
        what: SessionVerb,
    },
    /// Devices (backing stores).
    Device {
        #[command(subcommand)]
        what: DeviceVerb,
    },
    /// Grow a file device to SIZE; without SIZE, a file or block device grown underneath
    /// (truncate, lvextend) is taken at its size now. RAM devices cannot change while running.
    Resize {
        /// The device's name.
        device: String,
        /// The new size (bytes, or with K, M, G, T: 1024-based), not smaller than now.
        size: Option<String>,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// LUN maps of initiator groups.
    Lun {
        #[command(subcommand)]
        what: LunVerb,
    },
    /// Initiators of initiator groups.
    Initiator {
        #[command(subcommand)]
        what: InitiatorVerb,
    },
    /// CHAP credentials.
    Chap {
        #[command(subcommand)]
        what: ChapVerb,
    },
    /// Portal groups: add, remove, listen, unlisten, ALUA state.
    PortalGroup {
        #[command(subcommand)]
        what: PortalGroupVerb,
    },
    /// Targets: add, remove.
    Target {
        #[command(subcommand)]
        what: TargetVerb,
    },
    /// Initiator groups of a target: add, remove.
    Group {
        #[command(subcommand)]
        what: GroupVerb,
    },
    /// Authentication of a target or a group: on (CHAP), off, or as the target's.
    Auth {
        #[command(subcommand)]
        what: AuthVerb,
    },
    /// Pools: directories volumes live in (docs/VOLUMES.md).
    Pool {
        #[command(subcommand)]
        what: PoolVerb,
    },
    /// Volumes of pools: create, snapshot, clone, roll back, delete, list (each idempotent).
    Volume {
        #[command(subcommand)]
        what: VolumeVerb,
    },
    /// Snapshots of volumes: list, delete.
    Snapshot {
        #[command(subcommand)]
        what: SnapshotVerb,
    },
    /// Tokens of the remote management API: create (shown once), list, revoke.
    Token {
        #[command(subcommand)]
        what: TokenVerb,
    },
}

#[derive(Subcommand)]
enum TokenVerb {
    /// Make token NAME: printed this once, kept by the daemon only as its hash.
    Create {
        /// The token's name (the audit log and `token list` show it).
        name: String,
        /// admin (every verb) or reader (status, sessions, luns, stats, config, volume and
        /// snapshot lists).
        #[arg(long, value_parser = ["admin", "reader"])]
        role: String,
    },
    /// Names, roles and creation times of the tokens.
    List,
    /// Revoke token NAME: refused from its next request on.
    Revoke {
        /// The token's name.
        name: String,
    },
}

#[derive(Subcommand)]
enum PoolVerb {
    /// Add pool NAME: the directory PATH (created if missing), with --rbd-pool a Ceph pool,
    /// or with --vg and --thin-pool an LVM thin pool, holds its volumes.
    Add {
        /// The pool's name.
        name: String,
        /// Its directory (absolute; XFS or btrfs for reflink snapshots and clones).
        #[arg(required_unless_present_any = ["rbd_pool", "vg"], conflicts_with_all = ["rbd_pool", "vg"])]
        path: Option<String>,
        /// An LVM volume group: the volumes are thin LVs of its --thin-pool.
        #[arg(long, requires = "thin_pool", conflicts_with = "rbd_pool")]
        vg: Option<String>,
        /// The thin pool (an LV of --vg) the volumes are made in.
        #[arg(long, requires = "vg")]
        thin_pool: Option<String>,
        /// A Ceph pool whose images are the volumes.
        #[arg(long)]
        rbd_pool: Option<String>,
        /// ceph.conf of the RBD pool's cluster.
        #[arg(long, requires = "rbd_pool")]
        ceph_conf: Option<String>,
        /// The cephx client of the RBD pool (client.NAME).
        #[arg(long, requires = "rbd_pool")]
        ceph_client: Option<String>,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// The pools (or pool NAME): what each holds and has left, and what its volumes promise.
    List {
        /// Only this pool (its failure to answer is then an error).
        name: Option<String>,
    },
}

#[derive(Subcommand)]
enum VolumeVerb {
    /// Create volume NAME of SIZE in POOL (a device, not mapped yet: `lun map`).
    Create {
        /// The pool.
        pool: String,
        /// The volume's name (its device's name).
        name: String,
        /// Its size (bytes, or with K, M, G, T: 1024-based).
        size: String,
        /// Take over the file `NAME.img` that is in the pool already (a directory pool), with
        /// its data, instead of refusing it.
        #[arg(long)]
        adopt: bool,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Grow a volume to SIZE (as `ctl resize`).
    Resize {
        /// The volume.
        volume: String,
        /// The new size, not smaller than now.
        size: String,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Snapshot a volume, crash-consistent: every write acknowledged before is in it, none
    /// after (its writes wait for the moment of the snapshot).
    Snapshot {
        /// The volume.
        volume: String,
        /// The snapshot's name.
        snapshot: String,
    },
    /// Make volume NAME a clone of VOLUME (now), or of one of its snapshots.
    Clone {
        /// The source volume.
        volume: String,
        /// The new volume's name.
        name: String,
        /// Clone this snapshot of the source instead of its present state.
        #[arg(long)]
        snapshot: Option<String>,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Put a snapshot's data back into its volume (the volume must be offline or unmapped).
    Rollback {
        /// The volume.
        volume: String,
        /// The snapshot.
        snapshot: String,
    },
    /// Make an RBD clone independent of the snapshot it was cloned from (its shared blocks
    /// are copied), so that snapshot can be deleted.
    Flatten {
        /// The volume.
        volume: String,
    },
    /// Export a volume to one host in one step: map it, at the lowest free LUN (or --lun), in
    /// the group of the target that holds the host, or in a new group of the host's own
    /// (host-…). Answers the target, group, LUN, serial and NAA; asked again, says it existed.
    Export {
        /// The volume (any device will do).
        volume: String,
        /// The host: its initiator IQN (iSCSI) or host NQN (NVMe/TCP).
        #[arg(long)]
        initiator: String,
        /// The target (needed when there is more than one).
        #[arg(long)]
        target: Option<String>,
        /// This LUN number instead of the lowest free one.
        #[arg(long)]
        lun: Option<u64>,
        /// Read-only for that host.
        #[arg(long)]
        read_only: bool,
        /// That host's alone: refused while another host sees the volume, or when the host
        /// is in a group with others (a filesystem mounted on two hosts is corrupted).
        #[arg(long)]
        exclusive: bool,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Take an exported volume away from a host (the group export made for the host goes
    /// with its last LUN); says so when it was not exported.
    Unexport {
        /// The volume.
        volume: String,
        /// The host: its initiator IQN or host NQN.
        #[arg(long)]
        initiator: String,
        /// The target (needed when there is more than one).
        #[arg(long)]
        target: Option<String>,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Delete an unmapped volume without snapshots (its file too).
    Delete {
        /// The volume.
        volume: String,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// The pools, their volumes, sizes, mappings and snapshots.
    List {
        /// Only this volume (none listed if there is no such volume).
        volume: Option<String>,
    },
}

#[derive(Subcommand)]
enum SnapshotVerb {
    /// The snapshots (of one volume).
    List {
        /// Only this volume's.
        volume: Option<String>,
    },
    /// Delete a snapshot.
    Delete {
        /// The volume.
        volume: String,
        /// The snapshot.
        snapshot: String,
    },
}

/// Who a new initiator group admits.
#[derive(Args)]
#[group(required = true, multiple = false)]
struct Admits {
    /// An initiator it admits (IQN or EUI name; an NVMe host NQN); repeat for more.
    #[arg(long = "initiator", value_name = "NAME")]
    initiators: Vec<String>,
    /// Every initiator not listed in another group of the target.
    #[arg(long)]
    any_initiator: bool,
}

/// Also write the running config over the config file (as `ctl save`).
#[derive(Args)]
struct SaveFlag {
    /// Also write the running config over the config file (as `ctl save`): the change
    /// outlives a restart.
    #[arg(long)]
    save: bool,
}

#[derive(Subcommand)]
enum TargetVerb {
    /// Add a target with one initiator group and no LUNs yet (map them with `lun map`),
    /// served on every portal group or on those given.
    Add {
        /// The target's IQN.
        target: String,
        /// The name of its initiator group.
        #[arg(long, default_value = "hosts")]
        group: String,
        #[command(flatten)]
        admits: Admits,
        /// Also serve it over NVMe/TCP under this NQN.
        #[arg(long)]
        nqn: Option<String>,
        /// Its alias (TargetAlias).
        #[arg(long)]
        alias: Option<String>,
        /// A portal group it is served on (repeat for more; default: every one).
        #[arg(long = "portal-group", value_name = "TAG")]
        portal_groups: Vec<u16>,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Remove a target: its sessions end; its devices stay.
    Remove {
        /// The target's IQN.
        target: String,
        #[command(flatten)]
        save: SaveFlag,
    },
}

#[derive(Subcommand)]
enum GroupVerb {
    /// Add an initiator group (no LUNs yet) to a target.
    Add {
        /// The target's IQN.
        target: String,
        /// The group's name.
        group: String,
        #[command(flatten)]
        admits: Admits,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Remove an initiator group: its sessions end, its LUN maps go.
    Remove {
        /// The target's IQN.
        target: String,
        /// The group's name.
        group: String,
        #[command(flatten)]
        save: SaveFlag,
    },
}

#[derive(Subcommand)]
enum AuthVerb {
    /// Set authentication of a target (or of one group with --group) to MODE: none (its CHAP
    /// users go), chap (with the users it has or inherits) or, for a group, inherit. Logins
    /// from now follow it; a session that did not authenticate as CHAP now requires ends.
    Set {
        /// The target's IQN.
        target: String,
        /// none, chap or inherit.
        #[arg(value_parser = ["none", "chap", "inherit"])]
        mode: String,
        /// Only this initiator group.
        #[arg(long)]
        group: Option<String>,
        #[command(flatten)]
        save: SaveFlag,
    },
}

#[derive(Subcommand)]
enum PortalGroupVerb {
    /// Add portal group TAG listening on ADDRESS (iSCSI, or NVMe/TCP with --nvme), served by
    /// every target (or those given): the listener is bound now.
    Add {
        /// The new group's tag (1..65535).
        tag: u16,
        /// IP:PORT to listen on.
        address: String,
        /// ADDRESS is an NVMe/TCP listener.
        #[arg(long)]
        nvme: bool,
        /// Its ALUA state (default active-optimized).
        #[arg(long)]
        state: Option<String>,
        /// A target that serves it (repeat for more; default: every target).
        #[arg(long = "target", value_name = "IQN")]
        targets: Vec<String>,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Remove portal group TAG: its listeners close and its sessions are asked to log out.
    Remove {
        /// The group's tag.
        tag: u16,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Make portal group TAG listen on ADDRESS too (bound now).
    Listen {
        /// The group's tag.
        tag: u16,
        /// IP:PORT to listen on.
        address: String,
        /// ADDRESS is an NVMe/TCP listener.
        #[arg(long)]
        nvme: bool,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Stop portal group TAG listening on ADDRESS: the listener closes and the sessions that
    /// came in through it are asked to log out (NVMe/TCP ones are closed).
    Unlisten {
        /// The group's tag.
        tag: u16,
        /// IP:PORT it listens on.
        address: String,
        /// ADDRESS is an NVMe/TCP listener.
        #[arg(long)]
        nvme: bool,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Give portal group TAG the ALUA state STATE (active-optimized, active-non-optimized,
    /// standby, unavailable), live: every initiator of the targets it serves gets ASYMMETRIC
    /// ACCESS STATE CHANGED and multipath moves its I/O (not for RBD gateways' groups).
    Alua {
        /// The portal group's tag.
        tag: u16,
        /// active-optimized, active-non-optimized, standby or unavailable.
        state: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
}

#[derive(Subcommand)]
enum ConfigVerb {
    /// Print the running config as TOML (inline secrets redacted).
    Show,
}

#[derive(Subcommand)]
enum SessionVerb {
    /// Close a session (by its ID, from `ctl sessions`).
    Close {
        /// The session's ID as `ctl sessions` lists it: an iSCSI session's TSIH, an NVMe
        /// controller's ID.
        #[arg(value_name = "ID")]
        tsih: u16,
    },
}

#[derive(Subcommand)]
enum DeviceVerb {
    /// Every device: its size, whether it is online, its I/O and errors since the start,
    /// commands in flight and the LUNs it is mapped as (a failing disk shows its errors here).
    List,
    /// Add a device: SPEC as `serve --lun` takes it (ram:SIZE, file:PATH[,size=SIZE], block:PATH,
    /// rbd:POOL/IMAGE).
    Add {
        /// The device's name.
        name: String,
        /// What backs it: ram:SIZE, file:PATH[,size=SIZE], block:PATH or rbd:POOL/IMAGE, with
        /// the options `serve --lun` takes.
        spec: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// Remove an unmapped device.
    Remove {
        /// The device's name.
        name: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// Take a device offline: its LUNs answer NOT READY (04h/03h) until it is back online;
    /// the reply comes once the commands it was running have finished and it is flushed.
    Offline {
        /// The device's name.
        name: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// Bring an offline device back (initiators see NOT READY TO READY CHANGE, 28h/00h).
    Online {
        /// The device's name.
        name: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// Change a running device's attributes: its LUNs keep serving and every initiator gets
    /// the unit attention that says what changed (MODE PARAMETERS or INQUIRY DATA CHANGED).
    Set {
        /// The device's name.
        name: String,
        /// Write-protect it (on) or not (off).
        #[arg(long, value_name = "on|off", value_parser = on_off)]
        read_only: Option<bool>,
        /// Its write cache (WCE): off flushes what it holds first.
        #[arg(long, value_name = "on|off", value_parser = on_off)]
        write_cache: Option<bool>,
        /// INQUIRY vendor (at most 8 characters; "" for ferrosan's).
        #[arg(long)]
        vendor: Option<String>,
        /// INQUIRY product (at most 16 characters; "" for ferrosan's).
        #[arg(long)]
        product: Option<String>,
        /// Unit serial number (1 to 20 characters, no spaces).
        #[arg(long)]
        serial: Option<String>,
        #[command(flatten)]
        save: SaveFlag,
    },
    /// Make this gateway the owner of an RBD image (docs/RBD.md): its ports become
    /// active/optimized, the old owner is fenced (blocklisted) first.
    Take {
        /// The device's name.
        name: String,
    },
    /// Clear a device's persistent reservation and every registration (as PERSISTENT RESERVE
    /// OUT CLEAR, without a key): each registrant gets RESERVATIONS PREEMPTED. For hosts that
    /// left registrations behind or filled the device's places.
    ClearReservations {
        /// The device's name.
        name: String,
    },
}

#[derive(Subcommand)]
enum LunVerb {
    /// Map DEVICE as LUN in a group of a target.
    Map {
        /// The target's IQN.
        target: String,
        /// The initiator group's name.
        group: String,
        /// The LUN number.
        lun: u64,
        /// The device to map.
        device: String,
        /// Write-protected through this map (reads only).
        #[arg(long)]
        read_only: bool,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// Unmap a LUN from a group.
    Unmap {
        /// The target's IQN.
        target: String,
        /// The initiator group's name.
        group: String,
        /// The LUN number.
        lun: u64,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
}

#[derive(Subcommand)]
enum InitiatorVerb {
    /// Admit an initiator (IQN or EUI name; an NVMe host NQN) to a group: it sees the group's
    /// LUNs from its next login.
    Add {
        /// The target's IQN.
        target: String,
        /// The initiator group's name.
        group: String,
        /// The initiator's name (an NVMe host's NQN).
        initiator: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
    /// Remove an initiator from a group: its sessions through the group end.
    Remove {
        /// The target's IQN.
        target: String,
        /// The initiator group's name.
        group: String,
        /// The initiator's name (an NVMe host's NQN).
        initiator: String,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
}

#[derive(Subcommand)]
enum ChapVerb {
    /// Set the CHAP user of a target, of one group or of one initiator (or, with --mutual,
    /// the name and secret the target answers mutual CHAP with); the secret is read from stdin,
    /// or by the daemon from --secret-file.
    Set {
        /// The target's IQN.
        target: String,
        /// Only for this initiator group.
        #[arg(long, conflicts_with = "initiator")]
        group: Option<String>,
        /// Only for this initiator (in the target's [[target.credentials]]).
        #[arg(long)]
        initiator: Option<String>,
        /// The target's own credentials for mutual CHAP, in that scope.
        #[arg(long)]
        mutual: bool,
        /// The CHAP user name (an NVMe host's NQN for DH-HMAC-CHAP).
        user: String,
        /// A file the daemon reads the secret from (mode 0600, or `$CREDENTIALS_DIRECTORY/NAME`
        /// under systemd's LoadCredential=); a saved config names the file, not the secret.
        #[arg(long, value_name = "PATH")]
        secret_file: Option<String>,
        /// Also write the running config over the config file (as `ctl save`): the change
        /// outlives a restart.
        #[arg(long)]
        save: bool,
    },
}

fn request(verb: &Verb) -> Result<Value, String> {
    Ok(match verb {
        Verb::Status => json!({"verb": "status"}),
        Verb::Sessions => json!({"verb": "sessions"}),
        Verb::Luns => json!({"verb": "luns"}),
        Verb::Config {
            what: ConfigVerb::Show,
        } => json!({"verb": "config"}),
        Verb::Reload { discard } => json!({"verb": "reload", "discard": discard}),
        Verb::Save => json!({"verb": "save"}),
        Verb::Token { what } => match what {
            TokenVerb::Create { name, role } => {
                json!({"verb": "token-create", "name": name, "role": role})
            }
            TokenVerb::List => json!({"verb": "token-list"}),
            TokenVerb::Revoke { name } => json!({"verb": "token-revoke", "name": name}),
        },
        Verb::Session {
            what: SessionVerb::Close { tsih },
        } => json!({"verb": "session-close", "tsih": tsih}),
        Verb::Device { what } => device_request(what),
        Verb::Resize { device, size, save } => {
            let mut r = json!({"verb": "resize", "device": device, "save": save});
            if let Some(size) = size {
                r["size"] = json!(size);
            }
            r
        }
        Verb::Lun { what } => lun_request(what),
        Verb::Initiator { what } => {
            let (verb, target, group, initiator, save) = match what {
                InitiatorVerb::Add {
                    target,
                    group,
                    initiator,
                    save,
                } => ("initiator-add", target, group, initiator, save),
                InitiatorVerb::Remove {
                    target,
                    group,
                    initiator,
                    save,
                } => ("initiator-remove", target, group, initiator, save),
            };
            json!({"verb": verb, "target": target, "group": group, "initiator": initiator, "save": save})
        }
        Verb::Chap { what } => chap_request(what)?,
        structural => structure_request(structural).ok_or("no request for this verb")?,
    })
}

fn device_request(what: &DeviceVerb) -> Value {
    match what {
        DeviceVerb::Add { name, spec, save } => {
            json!({"verb": "device-add", "name": name, "spec": spec, "save": save})
        }
        DeviceVerb::Remove { name, save } => {
            json!({"verb": "device-remove", "name": name, "save": save})
        }
        DeviceVerb::Offline { name, save } => {
            json!({"verb": "device-offline", "name": name, "save": save})
        }
        DeviceVerb::Online { name, save } => {
            json!({"verb": "device-online", "name": name, "save": save})
        }
        DeviceVerb::Take { name } => json!({"verb": "device-take", "name": name}),
        DeviceVerb::List => json!({"verb": "stats"}),
        DeviceVerb::ClearReservations { name } => {
            json!({"verb": "device-clear-reservations", "name": name})
        }
        DeviceVerb::Set {
            name,
            read_only,
            write_cache,
            vendor,
            product,
            serial,
            save,
        } => json!({"verb": "device-set", "name": name, "read_only": read_only,
                    "write_cache": write_cache, "vendor": vendor, "product": product,
                    "serial": serial, "save": save.save}),
    }
}

fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        other => Err(format!("on or off, not {other:?}")),
    }
}

fn structure_request(verb: &Verb) -> Option<Value> {
    Some(match verb {
        Verb::Target {
            what:
                TargetVerb::Add {
                    target,
                    group,
                    admits,
                    nqn,
                    alias,
                    portal_groups,
                    save,
                },
        } => {
            let mut r = json!({"verb": "target-add", "target": target, "group": group,
                               "initiators": admits.initiators, "any_initiator": admits.any_initiator,
                               "nqn": nqn, "alias": alias, "save": save.save});
            if !portal_groups.is_empty() {
                r["portal_groups"] = json!(portal_groups);
            }
            r
        }
        Verb::Target {
            what: TargetVerb::Remove { target, save },
        } => json!({"verb": "target-remove", "target": target, "save": save.save}),
        Verb::Group {
            what:
                GroupVerb::Add {
                    target,
                    group,
                    admits,
                    save,
                },
        } => json!({"verb": "group-add", "target": target, "group": group,
                    "initiators": admits.initiators, "any_initiator": admits.any_initiator,
                    "save": save.save}),
        Verb::Group {
            what:
                GroupVerb::Remove {
                    target,
                    group,
                    save,
                },
        } => json!({"verb": "group-remove", "target": target, "group": group, "save": save.save}),
        Verb::Auth {
            what:
                AuthVerb::Set {
                    target,
                    mode,
                    group,
                    save,
                },
        } => json!({"verb": "auth-set", "target": target, "mode": mode, "group": group,
                    "save": save.save}),
        Verb::PortalGroup { what } => match what {
            PortalGroupVerb::Alua { tag, state, save } => {
                json!({"verb": "portal-group-alua", "tag": tag, "state": state, "save": save})
            }
            PortalGroupVerb::Add {
                tag,
                address,
                nvme,
                state,
                targets,
                save,
            } => {
                let mut r = json!({"verb": "portal-group-add", "tag": tag, "address": address,
                                   "nvme": nvme, "state": state, "save": save.save});
                if !targets.is_empty() {
                    r["targets"] = json!(targets);
                }
                r
            }
            PortalGroupVerb::Remove { tag, save } => {
                json!({"verb": "portal-group-remove", "tag": tag, "save": save.save})
            }
            PortalGroupVerb::Listen {
                tag,
                address,
                nvme,
                save,
            } => json!({"verb": "portal-group-listen", "tag": tag, "address": address,
                        "nvme": nvme, "save": save.save}),
            PortalGroupVerb::Unlisten {
                tag,
                address,
                nvme,
                save,
            } => json!({"verb": "portal-group-unlisten", "tag": tag, "address": address,
                        "nvme": nvme, "save": save.save}),
        },
        Verb::Pool {
            what:
                PoolVerb::Add {
                    name,
                    path,
                    vg,
                    thin_pool,
                    rbd_pool,
                    ceph_conf,
                    ceph_client,
                    save,
                },
        } => json!({"verb": "pool-add", "name": name, "path": path, "rbd_pool": rbd_pool,
                    "ceph_conf": ceph_conf, "ceph_client": ceph_client, "vg": vg,
                    "thin_pool": thin_pool, "save": save.save}),
        Verb::Pool {
            what: PoolVerb::List { name },
        } => json!({"verb": "pool-list", "pool": name}),
        Verb::Volume { what } => volume_request(what),
        Verb::Snapshot {
            what: SnapshotVerb::List { volume },
        } => json!({"verb": "snapshot-list", "volume": volume}),
        Verb::Snapshot {
            what: SnapshotVerb::Delete { volume, snapshot },
        } => json!({"verb": "snapshot-delete", "volume": volume, "snapshot": snapshot}),
        _ => return None,
    })
}

fn volume_request(what: &VolumeVerb) -> Value {
    match what {
        VolumeVerb::Create {
            pool,
            name,
            size,
            adopt,
            save,
        } => json!({"verb": "volume-create", "pool": pool, "name": name, "size": size,
                    "adopt": adopt, "save": save.save}),
        VolumeVerb::Resize { volume, size, save } => {
            json!({"verb": "resize", "device": volume, "size": size, "save": save.save})
        }
        VolumeVerb::Snapshot { volume, snapshot } => {
            json!({"verb": "volume-snapshot", "volume": volume, "snapshot": snapshot})
        }
        VolumeVerb::Clone {
            volume,
            name,
            snapshot,
            save,
        } => json!({"verb": "volume-clone", "volume": volume, "name": name,
                    "snapshot": snapshot, "save": save.save}),
        VolumeVerb::Rollback { volume, snapshot } => {
            json!({"verb": "volume-rollback", "volume": volume, "snapshot": snapshot})
        }
        VolumeVerb::Delete { volume, save } => {
            json!({"verb": "volume-delete", "volume": volume, "save": save.save})
        }
        VolumeVerb::List { volume } => json!({"verb": "volume-list", "volume": volume}),
        VolumeVerb::Export {
            volume,
            initiator,
            target,
            lun,
            read_only,
            exclusive,
            save,
        } => json!({"verb": "volume-export", "volume": volume, "initiator": initiator,
                    "target": target, "lun": lun, "read_only": read_only,
                    "exclusive": exclusive, "save": save.save}),
        VolumeVerb::Unexport {
            volume,
            initiator,
            target,
            save,
        } => json!({"verb": "volume-unexport", "volume": volume, "initiator": initiator,
                    "target": target, "save": save.save}),
        VolumeVerb::Flatten { volume } => json!({"verb": "volume-flatten", "volume": volume}),
    }
}

fn lun_request(what: &LunVerb) -> Value {
    match what {
        LunVerb::Map {
            target,
            group,
            lun,
            device,
            read_only,
            save,
        } => json!({"verb": "lun-map", "target": target, "group": group, "lun": lun,
                    "device": device, "read_only": read_only, "save": save}),
        LunVerb::Unmap {
            target,
            group,
            lun,
            save,
        } => {
            json!({"verb": "lun-unmap", "target": target, "group": group, "lun": lun, "save": save})
        }
    }
}

fn chap_request(what: &ChapVerb) -> Result<Value, String> {
    let ChapVerb::Set {
        target,
        group,
        initiator,
        mutual,
        user,
        secret_file,
        save,
    } = what;
    let mut r = json!({"verb": "chap-set", "target": target, "user": user,
                       "mutual": mutual, "save": save});
    match secret_file {
        Some(path) => r["secret_file"] = json!(path),
        // Never on the command line, where `ps` shows it to every user.
        None => r["secret"] = json!(read_secret(user)?),
    }
    if let Some(g) = group {
        r["group"] = json!(g);
    }
    if let Some(i) = initiator {
        r["initiator"] = json!(i);
    }
    Ok(r)
}

/// The secret for `user`: asked twice without echo on a terminal, else stdin's first line.
fn read_secret(user: &str) -> Result<String, String> {
    use std::io::IsTerminal as _;
    if std::io::stdin().is_terminal() {
        let ask = |prompt: &str| {
            rpassword::prompt_password(prompt).map_err(|e| format!("reading the secret: {e}"))
        };
        let secret = ask(&format!("CHAP secret for {user}: "))?;
        if ask("Again: ")? != secret {
            return Err("the two secrets differ; nothing changed".into());
        }
        return Ok(secret);
    }
    let mut secret = String::new();
    std::io::stdin()
        .take(4096)
        .read_to_string(&mut secret)
        .map_err(|e| format!("reading the secret from stdin: {e}"))?;
    Ok(secret.trim_end_matches(['\r', '\n']).to_string())
}

pub(crate) fn exchange(socket: &PathBuf, request: &Value) -> Result<Value, String> {
    let located = |e: std::io::Error| format!("{}: {e}", socket.display());
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot reach the daemon at {}: {e} (is it running? --socket PATH)",
            socket.display()
        )
    })?;
    // Nothing is sent (a CHAP secret, say) before the listener is known to be the daemon.
    let peer = rustix::net::sockopt::socket_peercred(&stream)
        .map_err(|e| format!("{}: the listener's credentials: {e}", socket.display()))?;
    let me = rustix::process::geteuid().as_raw();
    if !engine::control::trusted_daemon(socket, peer.uid.as_raw(), me) {
        return Err(format!(
            "{}: the process listening there runs as uid {}, neither root nor you, nor the user of a service directory: not sending it anything",
            socket.display(),
            peer.uid.as_raw()
        ));
    }
    let copying = request
        .get("verb")
        .and_then(Value::as_str)
        .is_some_and(|v| COPYING_VERBS.contains(&v));
    stream
        .set_read_timeout((!copying).then_some(REPLY_TIMEOUT))
        .map_err(located)?;
    let mut line = request.to_string();
    line.push('\n');
    stream.write_all(line.as_bytes()).map_err(located)?;
    let mut reply = String::new();
    BufReader::new(stream.take(64 << 20))
        .read_line(&mut reply)
        .map_err(located)?;
    serde_json::from_str(&reply).map_err(|e| format!("bad reply from the daemon: {e}"))
}

/// Where `ctl` sends its request: the local socket, or a daemon's remote API.
enum Endpoint {
    Socket(PathBuf),
    Remote(client::Remote),
}

impl Endpoint {
    fn of(args: &CtlArgs) -> Result<Endpoint, String> {
        if let Some(url) = &args.url {
            let credentials = client::Credentials {
                token_file: args.token_file.as_deref(),
                certificate: args.cert_file.as_deref().zip(args.key_file.as_deref()),
            };
            if credentials.token_file.is_none() && credentials.certificate.is_none() {
                return Err("--url needs --token-file, or --cert-file and --key-file".into());
            }
            return client::Remote::new(url, &credentials, args.ca_file.as_deref())
                .map(Endpoint::Remote)
                .map_err(|e| e.to_string());
        }
        args.socket
            .clone()
            .or_else(engine::control::default_socket_path)
            .map(Endpoint::Socket)
            .ok_or_else(|| "no default control socket (neither XDG_RUNTIME_DIR nor HOME is set): give --socket PATH".into())
    }

    fn exchange(&self, request: &Value) -> Result<Value, String> {
        match self {
            Endpoint::Socket(socket) => exchange(socket, request),
            Endpoint::Remote(remote) => remote.exchange(request).map_err(|e| e.to_string()),
        }
    }
}

pub fn run(args: CtlArgs) -> ExitCode {
    let endpoint = match Endpoint::of(&args) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ferrosan ctl: {e}");
            return ExitCode::from(2);
        }
    };
    let reply = request(&args.verb)
        .map(|mut r| {
            if let Some(generation) = args.if_generation {
                r["if_generation"] = json!(generation);
            }
            r
        })
        .and_then(|r| endpoint.exchange(&r));
    let reply = match reply {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ferrosan ctl: {e}");
            return ExitCode::from(2);
        }
    };
    let ok = reply.get("ok").and_then(Value::as_bool).unwrap_or(false);
    if args.json {
        println!("{reply}");
    } else if !ok {
        eprintln!(
            "ferrosan ctl: {}",
            reply
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("failed")
        );
    } else {
        print!("{}", human(&args.verb, &reply));
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// A LUN's MODE column: OFFLINE, ro or rw, and under RBD gateways whether this gateway owns
/// the image (`owner`), ships commands to the owner (`non-optimized`) or is standby, naming
/// the owner.
fn lun_mode(x: &Value) -> String {
    let mut mode = match (x["offline"].as_bool(), x["read_only"].as_bool()) {
        (Some(true), _) => "OFFLINE".to_string(),
        (_, Some(true)) => "ro".to_string(),
        _ => "rw".to_string(),
    };
    match (x["owner_here"].as_bool(), x["gateway_owner"].as_str()) {
        (Some(true), _) => mode.push_str(" owner"),
        (Some(false), Some(owner)) if x["ships_to_owner"].as_bool() == Some(true) => {
            mode.push_str(&format!(" non-optimized (owner {owner})"))
        }
        (Some(false), Some(owner)) => mode.push_str(&format!(" standby (owner {owner})")),
        (Some(false), None) => mode.push_str(" standby (no owner)"),
        (None, _) => {}
    }
    mode
}

/// A JSON value as table text (strings unquoted, null as `-`).
pub(crate) fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

pub(crate) fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  "));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

fn human(verb: &Verb, r: &Value) -> String {
    match verb {
        Verb::Status => human_status(r),
        Verb::Sessions => human_sessions(r),
        Verb::Luns => human_luns(r),
        Verb::Config { .. } => text(&r["toml"]),
        Verb::Volume {
            what: VolumeVerb::List { .. },
        } => human_volumes(r),
        Verb::Pool {
            what: PoolVerb::List { .. },
        } => human_pools(r),
        Verb::Device {
            what: DeviceVerb::List,
        } => human_devices(r),
        Verb::Snapshot {
            what: SnapshotVerb::List { .. },
        } => human_snapshots(r),
        Verb::Token { what } => human_token(what, r),
        _ => human_change(r),
    }
}

fn human_token(what: &TokenVerb, r: &Value) -> String {
    match what {
        TokenVerb::Create { .. } => format!(
            "{}\n(token {:?}, role {}: shown this once, the daemon keeps only its hash)\n",
            text(&r["token"]),
            text(&r["name"]),
            text(&r["role"])
        ),
        TokenVerb::List => {
            let mut out = String::new();
            for t in r["tokens"].as_array().into_iter().flatten() {
                out.push_str(&format!(
                    "{:<24} {:<7} created {}\n",
                    text(&t["name"]),
                    text(&t["role"]),
                    text(&t["created"])
                ));
            }
            if out.is_empty() {
                out.push_str("no tokens\n");
            }
            out
        }
        TokenVerb::Revoke { .. } => format!("revoked {}\n", text(&r["revoked"])),
    }
}

fn human_status(r: &Value) -> String {
    let mut out = String::new();
    for key in [
        "version",
        "pid",
        "uptime_s",
        "generation",
        "config_file",
        "sessions",
        "connections",
        "targets",
        "devices",
    ] {
        out.push_str(&format!("{key:<13} {}\n", text(&r[key])));
    }
    match r["unsaved_changes"].as_array() {
        Some(list) if !list.is_empty() => {
            out.push_str(&format!(
                "UNSAVED       {} change(s) not in the config file (ferrosan ctl save):\n",
                list.len()
            ));
            for c in list {
                out.push_str(&format!("  {}\n", text(c)));
            }
        }
        _ => out.push_str("unsaved       none\n"),
    }
    if let Some(list) = r["left_out_devices"].as_array().filter(|l| !l.is_empty()) {
        let names: Vec<String> = list.iter().map(text).collect();
        out.push_str(&format!(
            "LEFT OUT      {} (cluster unreachable at start; retried until it answers)\n",
            names.join(", ")
        ));
    }
    out
}

fn human_sessions(r: &Value) -> String {
    let rows = r["sessions"]
        .as_array()
        .map(|l| {
            l.iter()
                .map(|x| {
                    vec![
                        text(&x["tsih"]),
                        door_name(&x["door"]),
                        text(&x["initiator"]),
                        text(&x["target"]),
                        text(&x["source"]),
                        text(&x["portal"]),
                        format!("{}/{}", text(&x["header_digest"]), text(&x["data_digest"])),
                        text(&x["chap_user"]),
                        text(&x["age_s"]),
                        text(&x["reads"]),
                        text(&x["writes"]),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    table(
        &[
            "ID",
            "DOOR",
            "INITIATOR",
            "TARGET",
            "SOURCE",
            "PORTAL",
            "DIGESTS",
            "CHAP",
            "AGE_S",
            "READS",
            "WRITES",
        ],
        rows,
    )
}

/// A session's door as a person reads it (`ctl sessions` answers `iscsi` or `nvme`).
fn door_name(door: &Value) -> String {
    match door.as_str() {
        Some("iscsi") => "iSCSI".into(),
        Some("nvme") => "NVMe/TCP".into(),
        _ => text(door),
    }
}

fn human_luns(r: &Value) -> String {
    let rows = r["luns"]
        .as_array()
        .map(|l| {
            l.iter()
                .map(|x| {
                    vec![
                        text(&x["target"]),
                        text(&x["group"]),
                        text(&x["lun"]),
                        text(&x["device"]),
                        text(&x["store"]),
                        size(&x["size_bytes"]),
                        text(&x["block_size"]),
                        lun_mode(x),
                        text(&x["path"]),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = table(
        &[
            "TARGET", "GROUP", "LUN", "DEVICE", "STORE", "SIZE", "BLOCK", "MODE", "PATH",
        ],
        rows,
    );
    if let Some(list) = r["unmapped_devices"].as_array().filter(|l| !l.is_empty()) {
        let names: Vec<String> = list.iter().map(text).collect();
        out.push_str(&format!("unmapped devices: {}\n", names.join(", ")));
    }
    out
}

/// `pool list`: a row per pool, its medium's size and free space beside what its volumes
/// promise (a thin pool may promise more than it has).
fn human_pools(r: &Value) -> String {
    let rows = r["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let place = match text(&p["kind"]).as_str() {
                "dir" => text(&p["path"]),
                "rbd" => format!("ceph pool {}", text(&p["rbd_pool"])),
                _ => format!("{}/{}", text(&p["vg"]), text(&p["thin_pool"])),
            };
            let (total, available) = match p.get("error") {
                Some(e) => ("?".into(), format!("cannot tell: {}", text(e))),
                None => (size(&p["total_bytes"]), size(&p["available_bytes"])),
            };
            vec![
                text(&p["pool"]),
                text(&p["kind"]),
                place,
                text(&p["volumes"]),
                size(&p["provisioned_bytes"]),
                total,
                available,
            ]
        })
        .collect();
    table(
        &[
            "POOL",
            "KIND",
            "WHERE",
            "VOLUMES",
            "PROMISED",
            "SIZE",
            "AVAILABLE",
        ],
        rows,
    )
}

/// `device list`: a row per device from the `stats` answer.
fn human_devices(r: &Value) -> String {
    let rows = r["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            let luns: Vec<String> = d["luns"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|l| format!("{} LUN {}", text(&l["group"]), text(&l["lun"])))
                .collect();
            vec![
                text(&d["device"]),
                size(&d["size_bytes"]),
                if d["offline"] == true {
                    "offline"
                } else {
                    "online"
                }
                .into(),
                text(&d["reads"]),
                text(&d["writes"]),
                text(&d["errors"]),
                text(&d["in_flight"]),
                if luns.is_empty() {
                    "-".into()
                } else {
                    luns.join(", ")
                },
            ]
        })
        .collect();
    table(
        &[
            "DEVICE",
            "SIZE",
            "STATE",
            "READS",
            "WRITES",
            "ERRORS",
            "IN FLIGHT",
            "LUNS",
        ],
        rows,
    )
}

/// `volume list`: a row per volume, its size, snapshots and maps.
fn human_volumes(r: &Value) -> String {
    let mut out = format!(
        "{:<12} {:<20} {:>14}  {:<10} MAPPED\n",
        "POOL", "VOLUME", "SIZE", "SNAPSHOTS"
    );
    for v in r["volumes"].as_array().into_iter().flatten() {
        let snaps: Vec<String> = v["snapshots"]
            .as_array()
            .into_iter()
            .flatten()
            .map(text)
            .collect();
        let mapped: Vec<String> = v["mapped"]
            .as_array()
            .into_iter()
            .flatten()
            .map(text)
            .collect();
        out.push_str(&format!(
            "{:<12} {:<20} {:>14}  {:<10} {}\n",
            text(&v["pool"]),
            text(&v["volume"]),
            size(&v["size_bytes"]),
            if snaps.is_empty() {
                "-".to_string()
            } else {
                snaps.join(",")
            },
            if mapped.is_empty() {
                "-".to_string()
            } else {
                mapped.join("; ")
            },
        ));
    }
    out
}

fn human_snapshots(r: &Value) -> String {
    let mut out = format!(
        "{:<12} {:<20} {:<20} {:>14}\n",
        "POOL", "VOLUME", "SNAPSHOT", "SIZE"
    );
    for s in r["snapshots"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<12} {:<20} {:<20} {:>14}\n",
            text(&s["pool"]),
            text(&s["volume"]),
            text(&s["snapshot"]),
            size(&s["size_bytes"]),
        ));
    }
    out
}

/// A size in bytes as a person reads it (`2G`, `1536M`; the bytes where no unit holds it
/// whole); `--json` keeps the bytes.
fn size(v: &Value) -> String {
    v.as_u64()
        .map_or_else(|| text(v), engine::config::size_text)
}

/// `volume export` and `unexport`: where the volume is for its host (or was), in words.
fn human_export(r: &Value) -> String {
    let (Some(volume), Some(target)) = (r.get("volume"), r.get("target")) else {
        return String::new();
    };
    let (volume, target) = (text(volume), text(target));
    match (r.get("unexported"), r.get("lun"), r.get("group")) {
        (Some(Value::Bool(false)), ..) => {
            format!(
                "volume {volume} was not exported through {target} to that host: nothing to do\n"
            )
        }
        (Some(Value::Bool(true)), Some(lun), _) => {
            format!(
                "volume {volume} unexported (it was LUN {} of {target})\n",
                text(lun)
            )
        }
        (None, Some(lun), Some(group)) => {
            let how = if r.get("existed") == Some(&Value::Bool(true)) {
                "already exported"
            } else {
                "exported"
            };
            let ro = if r.get("read_only") == Some(&Value::Bool(true)) {
                ", read-only"
            } else {
                ""
            };
            let naa = r
                .get("naa")
                .filter(|n| n.is_string())
                .map_or(String::new(), |n| format!(", NAA {}", text(n)));
            format!(
                "volume {volume} {how}: LUN {} of {target}, group {}{ro}{naa}\n",
                text(lun),
                text(group)
            )
        }
        _ => String::new(),
    }
}

fn human_change(r: &Value) -> String {
    let mut out = human_export(r);
    if r.get("existed") == Some(&Value::Bool(true)) && out.is_empty() {
        out.push_str("already there: nothing to do\n");
    }
    match r.get("deleted") {
        Some(Value::Bool(true)) => out.push_str("deleted\n"),
        Some(Value::Bool(false)) => out.push_str("already gone: nothing to do\n"),
        _ => {}
    }
    if let (Some(device), Some(n)) = (r.get("device"), r.get("registrations_cleared")) {
        out.push_str(&format!(
            "device {}: reservation and {} registrations cleared\n",
            text(device),
            text(n)
        ));
    }
    if let Some(method) = r.get("method") {
        out.push_str(&format!("method: {}\n", text(method)));
    }
    if let (Some(device), Some(owner)) = (r.get("device"), r.get("owner")) {
        out.push_str(&format!(
            "device {} is owned by gateway {} (active/optimized here)\n",
            text(device),
            text(owner)
        ));
    }
    for key in ["applied", "closed", "saved"] {
        if let Some(v) = r.get(key) {
            if key == "saved" && v.as_bool() == Some(false) {
                out.push_str("not saved to the config file (ferrosan ctl save, or --save)\n");
            } else if key != "saved" || v.is_string() {
                out.push_str(&format!("{key}: {}\n", text(v)));
            }
        }
    }
    if let Some(changes) = r["changes"].as_array() {
        if changes.is_empty() {
            out.push_str("no change\n");
        }
        for c in changes {
            out.push_str(&format!("  {}\n", text(c)));
        }
    }
    if let Some(g) = r.get("generation") {
        out.push_str(&format!("generation {}\n", text(g)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_of_both_doors_read_alike_with_their_door_named() {
        let r = json!({"sessions": [
            {"door": "iscsi", "tsih": 3, "initiator": "iqn.1993-08.org.debian:01:a",
             "target": "iqn.2026-11.org.ferrosan:t", "source": "10.0.0.2:5000",
             "portal": "10.0.0.1:3260", "header_digest": "CRC32C", "data_digest": "None",
             "chap_user": null, "age_s": 7, "reads": 1, "writes": 2},
            {"door": "nvme", "tsih": 9, "initiator": "nqn.2014-08.org.nvmexpress:uuid:x",
             "target": "nqn.2026-11.org.ferrosan:t", "source": "10.0.0.2:5001",
             "portal": "10.0.0.1:4420", "header_digest": "None", "data_digest": "None",
             "chap_user": null, "age_s": 1, "reads": 0, "writes": 0},
        ]});
        let text = human_sessions(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("ID") && lines[0].contains("DOOR"),
            "{text}"
        );
        assert!(
            lines[1].contains("iSCSI") && lines[1].contains("CRC32C/None"),
            "{text}"
        );
        assert!(
            lines[2].contains("NVMe/TCP") && lines[2].contains("None/None"),
            "{text}"
        );
    }
}
