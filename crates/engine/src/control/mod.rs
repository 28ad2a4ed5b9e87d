//! The control plane: a Unix socket beside the data plane, speaking one JSON object per line
//! each way (docs/OPERATIONS.md, "Control socket"). `ferrosan ctl` is its client. Reading verbs
//! look at the running state; each changing verb is one transaction ([`transact`]): under the
//! apply lock it edits the running config of that moment ([`edit`], pure) and applies it
//! through the same difference as a reload (reload.rs), so a change made here and the same
//! change made in the file and reloaded have exactly the same effect, and no verb undoes
//! another.
//!
//! Bounds: at most [`CLIENTS_MAX`] clients at once, requests of at most [`REQUEST_BYTES_MAX`],
//! and a client silent for [`CLIENT_IDLE`] is closed; none of them can delay the data plane,
//! which never takes a lock the control plane holds for long.

pub mod api;
pub mod edit;
pub mod error;
mod export;
mod listings;
pub mod reload;
mod volumes;

pub use error::{ControlError, SocketError};
pub use volumes::recover_pools;

use std::io::ErrorKind;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::admission::registry::DoorFacts;
use crate::config::{Config, ConfigErrors};
use crate::shared::Shared;
use edit::{edit, text, EDIT_VERBS};
use error::SaveError;
use reload::ApplyLock;

/// Largest request line, in bytes.
pub const REQUEST_BYTES_MAX: usize = 64 * 1024;
/// Clients served at once; more are told so and closed.
pub const CLIENTS_MAX: usize = 16;
/// A client that sends nothing for this long is closed.
pub const CLIENT_IDLE: Duration = Duration::from_secs(30);

/// The default socket path: `/run/ferrosan/control.sock` for root, else
/// `$XDG_RUNTIME_DIR/ferrosan/control.sock`, else `$HOME/.local/state/ferrosan/control.sock`;
/// `None` without either variable. Never a shared directory such as `/tmp`, where another
/// user could make the directory first and listen in the daemon's place.
pub fn default_socket_path() -> Option<PathBuf> {
    if rustix::process::geteuid().is_root() {
        return Some(PathBuf::from("/run/ferrosan/control.sock"));
    }
    let var = |name: &str| std::env::var_os(name).filter(|d| !d.is_empty());
    match (var("XDG_RUNTIME_DIR"), var("HOME")) {
        (Some(dir), _) => Some(PathBuf::from(dir).join("ferrosan/control.sock")),
        (None, Some(home)) => Some(PathBuf::from(home).join(".local/state/ferrosan/control.sock")),
        (None, None) => None,
    }
}

/// Whether `dir` may hold the control socket of a daemon running as `owner`: a directory
/// owned by `owner` that no one else may write to (who can write there can put their own
/// socket in the daemon's place, and receive the secrets `ctl chap set` sends).
pub fn check_socket_dir(dir: &Path, owner: u32) -> Result<(), SocketError> {
    let meta =
        std::fs::metadata(dir).map_err(|e| SocketError(format!("{}: {e}", dir.display())))?;
    if !meta.is_dir() {
        return Err(SocketError(format!("{}: not a directory", dir.display())));
    }
    if meta.uid() != owner {
        return Err(SocketError(format!(
            "{}: owned by uid {}, not by the daemon's user ({owner})",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(SocketError(format!(
            "{}: writable by others (mode {:o}); make it 0755 or stricter",
            dir.display(),
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Whether the process listening on `socket` (user `peer`) is a daemon `ctl`, running as
/// `me`, may send a request to: root or `me` itself; or, when `me` is root, the user the
/// system made the socket's directory for (a directory owned by `peer`, not writable by
/// others, in a root-owned directory no one else may write to: systemd's `RuntimeDirectory`
/// of a service with its own user).
pub fn trusted_daemon(socket: &Path, peer: u32, me: u32) -> bool {
    if peer == 0 || peer == me {
        return true;
    }
    let Some(dir) = socket.parent() else {
        return false;
    };
    me == 0
        && check_socket_dir(dir, peer).is_ok()
        && dir
            .parent()
            .is_some_and(|up| check_socket_dir(up, 0).is_ok())
}

/// A bound control socket; the file is removed when the daemon exits (if it is still ours).
pub struct ControlSocket {
    pub path: PathBuf,
    /// The socket file's inode (see [`remove_if_ours`]).
    pub inode: u64,
    listener: std::os::unix::net::UnixListener,
    /// The group allowed besides the owner, by id.
    group: Option<u32>,
}

/// Binds the control socket. `explicit`: the path was configured, so a failure stops the
/// start; the default path in use by another running daemon only costs this one its socket
/// (logged), so several daemons can run side by side without configuring one each.
pub fn bind(
    path: &Path,
    explicit: bool,
    group: Option<&str>,
) -> Result<Option<ControlSocket>, SocketError> {
    let fail = |message: String| -> Result<Option<ControlSocket>, SocketError> {
        if explicit {
            Err(SocketError(message))
        } else {
            tracing::warn!("{message}; no control socket (set control_socket or --control-socket)");
            Ok(None)
        }
    };
    let group = match group {
        Some(name) => match group_id(name) {
            Some(gid) => Some(gid),
            None => {
                return Err(SocketError(format!(
                    "control_socket_group {name}: no such group in /etc/group"
                )))
            }
        },
        None => None,
    };
    if let Err(e) = prepare_socket_path(path) {
        return fail(e.0);
    }
    // Created with no permission for anyone but the owner, then opened to the group if asked:
    // never a moment where others could connect.
    let old_mask = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = std::os::unix::net::UnixListener::bind(path);
    rustix::process::umask(old_mask);
    let listener = match bound {
        Ok(l) => l,
        Err(e) => return fail(format!("control socket {}: {e}", path.display())),
    };
    if let Some(gid) = group {
        let result = rustix::fs::chown(path, None, Some(rustix::fs::Gid::from_raw(gid)))
            .map_err(std::io::Error::from)
            .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)));
        if let Err(e) = result {
            let _ = std::fs::remove_file(path);
            return Err(SocketError(format!(
                "control socket {}: group access: {e}",
                path.display()
            )));
        }
    }
    if let Err(e) = listener.set_nonblocking(true) {
        return Err(SocketError(format!(
            "control socket {}: {e}",
            path.display()
        )));
    }
    let inode = std::fs::metadata(path).map_or(0, |m| m.ino());
    Ok(Some(ControlSocket {
        path: path.to_path_buf(),
        listener,
        group,
        inode,
    }))
}

/// Readies `path` for a new socket: its directory made (0755) if missing and checked
/// ([`check_socket_dir`]), a stale socket of a killed daemon removed. A live daemon's socket,
/// or a file that is not a socket, is an error.
fn prepare_socket_path(path: &Path) -> Result<(), SocketError> {
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| SocketError(format!("control socket {}: {e}", dir.display())))?;
        }
        let me = rustix::process::geteuid().as_raw();
        check_socket_dir(dir, me)
            .map_err(|e| SocketError(format!("control socket directory {e}")))?;
    }
    if !path.exists() {
        return Ok(());
    }
    // A live daemon answers on it; a stale socket (a daemon killed) refuses: replace it.
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(SocketError(format!(
            "control socket {} is in use by another process",
            path.display()
        )));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            let _ = std::fs::remove_file(path);
            Ok(())
        }
        Ok(_) => Err(SocketError(format!(
            "control socket {}: exists and is not a socket",
            path.display()
        ))),
        Err(_) => Ok(()),
    }
}

/// The id of group `name` from /etc/group (local groups; no NSS lookup).
fn group_id(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then_some(())?;
        fields.nth(1)?.parse().ok()
    })
}

/// Removes the socket file at `path` if it is still the one with `inode` (another daemon may
/// have replaced it meanwhile).
pub fn remove_if_ours(path: &Path, inode: u64) {
    if std::fs::metadata(path).is_ok_and(|m| m.ino() == inode) {
        let _ = std::fs::remove_file(path);
    }
}

/// Serves the control socket until the daemon shuts down (run on the acceptor's runtime).
pub async fn serve(shared: Arc<Shared>, socket: ControlSocket) {
    let ControlSocket {
        path,
        listener,
        group,
        inode,
    } = socket;
    let listener = match UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("control socket: {e}");
            return;
        }
    };
    let clients = Arc::new(AtomicUsize::new(0));
    let me = rustix::process::geteuid().as_raw();
    let mut shutdown = shared.shutdown_signal();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = Shared::wait_for_shutdown(&mut shutdown) => break,
        };
        let mut stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("control socket: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // The file's permissions keep others out (the kernel checks them at connect, with
        // every group of the client); without a group the peer's user is checked as well, in
        // case the socket's directory or mode is loosened.
        let allowed = group.is_some()
            || stream
                .peer_cred()
                .is_ok_and(|c| c.uid() == 0 || c.uid() == me);
        if !allowed {
            let _ = reply(
                &mut stream,
                &error("permission denied: not the daemon's owner"),
            )
            .await;
            continue;
        }
        if clients.fetch_add(1, Ordering::AcqRel) >= CLIENTS_MAX {
            clients.fetch_sub(1, Ordering::AcqRel);
            let _ = reply(&mut stream, &error("too many control clients")).await;
            continue;
        }
        let shared = Arc::clone(&shared);
        let clients = Arc::clone(&clients);
        tokio::spawn(async move {
            client(shared, stream).await;
            clients.fetch_sub(1, Ordering::AcqRel);
        });
    }
    remove_if_ours(&path, inode);
}

async fn reply<W: tokio::io::AsyncWrite + Unpin>(
    stream: &mut W,
    value: &Value,
) -> std::io::Result<()> {
    reply_line(stream, value.to_string()).await
}

async fn reply_line<W: tokio::io::AsyncWrite + Unpin>(
    stream: &mut W,
    mut line: String,
) -> std::io::Result<()> {
    line.push('\n');
    stream.write_all(line.as_bytes()).await
}

fn error(message: impl Into<String>) -> Value {
    json!({ "ok": false, "error": message.into(), "kind": "bad_request" })
}

/// The answer to a request that failed: the message, and its kind for a program to act on.
fn failed(e: &ControlError) -> Value {
    json!({ "ok": false, "error": e.to_string(), "kind": e.kind() })
}

/// One client: requests one per line, answers one per line, until it closes or idles.
async fn client(shared: Arc<Shared>, stream: UnixStream) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut line = Vec::new();
    loop {
        line.clear();
        let got = tokio::time::timeout(
            CLIENT_IDLE,
            read_line_bounded(&mut read, &mut line, REQUEST_BYTES_MAX),
        )
        .await;
        let answer = match got {
            Err(_) => return, // idle
            Ok(Ok(0)) => return,
            Ok(Ok(_)) => {
                let shared = Arc::clone(&shared);
                let request = std::mem::take(&mut line);
                // Verbs may open devices or write files: never on this runtime's thread.
                tokio::task::spawn_blocking(move || handle_line(&shared, &request))
                    .await
                    .unwrap_or_else(|e| error(format!("internal error: {e}")).to_string())
            }
            Ok(Err(e)) if e.kind() == ErrorKind::InvalidData => {
                let _ = reply(&mut write, &error(e.to_string())).await;
                return;
            }
            Ok(Err(_)) => return,
        };
        if reply_line(&mut write, answer).await.is_err() {
            return;
        }
    }
}

/// Reads one line (without its newline) of at most `max` bytes; a longer one is an
/// `InvalidData` error (the connection is closed: the rest of it cannot be trusted to be a
/// request boundary).
async fn read_line_bounded<R: tokio::io::AsyncBufRead + Unpin>(
    read: &mut R,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<usize> {
    loop {
        let buf = read.fill_buf().await?;
        if buf.is_empty() {
            return Ok(line.len());
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > max + 1 {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("request longer than {max} bytes"),
            ));
        }
        line.extend_from_slice(&buf[..take]);
        read.consume(take);
        if done {
            line.pop();
            // An empty line is not end of stream.
            return Ok(line.len().max(1));
        }
    }
}

/// An answer: a JSON value, or (`stats`, `luns`, `volume-list`: a row per device, LUN or
/// volume) the text of a
/// successful one, written straight from typed rows (see `listings.rs`).
enum Answer {
    Value(Value),
    Text(String),
}

/// Answers one request line.
pub fn handle(shared: &Shared, request: &[u8]) -> Value {
    match answer(shared, request) {
        Answer::Value(value) => value,
        Answer::Text(text) => serde_json::from_str(&text)
            .unwrap_or_else(|e| error(format!("internal error: an answer is not JSON: {e}"))),
    }
}

/// Answers one request line, as the line to send (without its newline).
pub fn handle_line(shared: &Shared, request: &[u8]) -> String {
    match answer(shared, request) {
        Answer::Value(value) => value.to_string(),
        Answer::Text(text) => text,
    }
}

fn answer(shared: &Shared, request: &[u8]) -> Answer {
    let request: Value = match serde_json::from_slice(request) {
        Ok(v) => v,
        Err(e) => return Answer::Value(error(format!("not a JSON request: {e}"))),
    };
    let Some(args) = request.as_object() else {
        return Answer::Value(error("a request is a JSON object with a \"verb\""));
    };
    let Some(verb) = args.get("verb").and_then(Value::as_str) else {
        return Answer::Value(error("missing \"verb\""));
    };
    let result = match verb {
        "stats" => Ok(Answer::Text(listings::stats(shared))),
        "luns" => Ok(Answer::Text(listings::luns(shared))),
        "volume-list" => volumes::list(shared, args).map(Answer::Text),
        _ => run_verb(shared, verb, args).map(Answer::Value),
    };
    if let Some(verb) = known_verb(verb) {
        let kind = result.as_ref().map_or_else(ControlError::kind, |_| "ok");
        shared.metrics.control_request(verb, kind);
    }
    match result {
        Ok(Answer::Value(Value::Object(mut fields))) => {
            fields.insert("ok".into(), Value::Bool(true));
            Answer::Value(Value::Object(fields))
        }
        Ok(Answer::Value(other)) => Answer::Value(json!({ "ok": true, "result": other })),
        Ok(text) => text,
        Err(e) => {
            tracing::warn!(kind = e.kind(), "ctl: {e}");
            Answer::Value(failed(&e))
        }
    }
}

/// Runs every verb but `stats`, `luns` and `volume-list`.
fn run_verb(shared: &Shared, verb: &str, args: &Map<String, Value>) -> Result<Value, ControlError> {
    match verb {
        "status" => Ok(status(shared)),
        "sessions" => Ok(sessions(shared)),
        "config" => Ok(json!({ "toml": shared.topology().config.to_toml() })),
        "reload" => reload(shared, args),
        "save" => save(shared),
        "session-close" => close_session(shared, args),
        "device-take" => take_device(shared, args),
        "device-clear-reservations" => clear_reservations(shared, args),
        "token-create" => token_create(shared, args),
        "token-list" => Ok(shared.tokens.list()),
        "token-revoke" => token_revoke(shared, args),
        _ if volumes::VERBS.contains(&verb) => volumes::handle(shared, verb, args),
        _ if EDIT_VERBS.contains(&verb) => change(shared, verb, args),
        _ => Err(ControlError::BadRequest(format!(
            "unknown verb {verb:?} (status, sessions, luns, stats, config, reload, save, \
             session-close, device-take, device-clear-reservations, token-create, token-list, \
             token-revoke, {})",
            EDIT_VERBS.join(", ")
        ))),
    }
}

/// The verbs the socket serves, besides the edits and the volume verbs.
const READ_AND_FILE_VERBS: &[&str] = &[
    "status",
    "sessions",
    "luns",
    "stats",
    "config",
    "reload",
    "save",
    "session-close",
    "device-take",
    "device-clear-reservations",
    "token-create",
    "token-list",
    "token-revoke",
];

pub use crate::admission::tokens::changes;

fn name_arg<'a>(args: &'a Map<String, Value>, key: &str) -> Result<&'a str, ControlError> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ControlError::BadRequest(format!("missing \"{key}\"")))
}

/// `token-create name=N role=admin|reader`: the token, shown this once.
fn token_create(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let name = name_arg(args, "name")?;
    let role = crate::admission::tokens::Role::parse(name_arg(args, "role")?)?;
    let token = shared.tokens.create(name, role)?;
    tracing::info!(name, role = role.name(), "API token created");
    Ok(json!({ "name": name, "role": role.name(), "token": token }))
}

/// `token-revoke name=N`: refused from the next request on.
fn token_revoke(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let name = name_arg(args, "name")?;
    shared.tokens.revoke(name)?;
    tracing::info!(name, "API token revoked");
    Ok(json!({ "revoked": name }))
}

/// Every verb the socket (and the remote API) serves.
pub fn all_verbs() -> impl Iterator<Item = &'static str> {
    READ_AND_FILE_VERBS
        .iter()
        .chain(EDIT_VERBS)
        .chain(volumes::VERBS)
        .copied()
}

/// `verb` as a known verb's name (a metric label must not take a client's arbitrary text).
fn known_verb(verb: &str) -> Option<&'static str> {
    all_verbs().find(|v| *v == verb)
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn status(shared: &Shared) -> Value {
    use crate::topology::portals::ListenerKind;
    let topology = shared.topology();
    let unsaved = shared.unsaved.list();
    let listeners = shared.listening.list();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "started": unix_seconds(shared.started),
        "uptime_s": shared.started.elapsed().map_or(0, |d| d.as_secs()),
        "generation": topology.generation,
        "config_file": shared.source.path.as_ref().map(|p| p.display().to_string()),
        "unsaved_changes": unsaved,
        "left_out_devices": shared.left_out().iter().map(|o| o.device.name.clone()).collect::<Vec<_>>(),
        "sessions": shared.registry.session_count(),
        "connections": shared.doors.open_connections(),
        "prelogin_connections": shared.doors.prelogin_connections(),
        "targets": topology.targets.len(),
        "devices": topology.devices.len(),
        "portals": listeners.iter().filter(|(k, _, _)| *k == ListenerKind::Iscsi).map(|(_, a, tag)| json!({"address": a.to_string(), "tag": tag})).collect::<Vec<_>>(),
        "listeners": listeners.iter().map(|(k, a, tag)| json!({"kind": k.name(), "address": a.to_string(), "tag": tag})).collect::<Vec<_>>(),
        "shutting_down": shared.is_shutting_down(),
    })
}

fn sessions(shared: &Shared) -> Value {
    let mut answer = Map::new();
    answer.insert("sessions".into(), Value::Array(session_rows(shared)));
    Value::Object(answer)
}

/// Every session's row of `sessions` and `stats`.
fn session_rows(shared: &Shared) -> Vec<Value> {
    let now = SystemTime::now();
    shared
        .registry
        .sessions()
        .iter()
        .map(|s| {
            let mut row = json!({
                "door": s.door.name(),
                "initiator": s.initiator,
                "initiator_alias": s.initiator_alias,
                "target": s.target,
                "tsih": s.tsih,
                "portal": s.portal.to_string(),
                "portal_group_tag": s.portal_group_tag,
                "source": s.source.to_string(),
                "chap_user": s.chap_user,
                "age_s": now.duration_since(s.started).map_or(0, |d| d.as_secs()),
                "reads": s.reads.load(Ordering::Relaxed),
                "writes": s.writes.load(Ordering::Relaxed),
                "read_bytes": s.read_bytes.load(Ordering::Relaxed),
                "write_bytes": s.write_bytes.load(Ordering::Relaxed),
                "read_latency": s.latency(0).to_json(),
                "write_latency": s.latency(1).to_json(),
            });
            add_door_facts(&mut row, &s.door);
            row
        })
        .collect()
}

/// A session's own door's facts beside the common ones: an iSCSI session's ISID, CID and
/// negotiated keys; an NVMe controller's ID, keep-alive and transfer limits.
fn add_door_facts(row: &mut Value, facts: &DoorFacts) {
    let digest = |on: bool| if on { "CRC32C" } else { "None" };
    let more = match facts {
        DoorFacts::Iscsi(f) => json!({
            "isid": f.isid.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            "cid": f.cid,
            "header_digest": digest(f.header_digest),
            "data_digest": digest(f.data_digest),
            "max_recv_data_segment_length": f.max_recv_data_segment_length,
            "max_xmit_data_segment_length": f.max_xmit_data_segment_length,
            "max_burst_length": f.max_burst_length,
            "first_burst_length": f.first_burst_length,
            "immediate_data": f.immediate_data,
            "initial_r2t": f.initial_r2t,
        }),
        DoorFacts::Nvme(f) => json!({
            "header_digest": digest(f.header_digest),
            "data_digest": digest(f.data_digest),
            "kato_ms": f.kato_ms,
            "max_transfer": f.max_transfer,
            "in_capsule": f.in_capsule,
            "tls": f.tls,
        }),
    };
    if let (Some(row), Value::Object(more)) = (row.as_object_mut(), more) {
        row.extend(more);
    }
}

/// The devices of `config` no LUN maps.
pub(super) fn unmapped(config: &crate::config::Config) -> Vec<&String> {
    let maps = edit::maps_by_device(config);
    (config.devices.iter())
        .map(|d| &d.name)
        .filter(|name| !maps.contains_key(name.as_str()))
        .collect()
}

fn reload(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let discard = args
        .get("discard")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let applied = reload::reload_file(shared, &shared.source, discard)?;
    Ok(json!({ "generation": applied.generation, "changes": applied.changes.lines() }))
}

fn save(shared: &Shared) -> Result<Value, ControlError> {
    let lock = reload::lock(shared);
    let path = save_running(shared, &lock)?;
    Ok(json!({ "saved": path.display().to_string() }))
}

/// Writes the running config over its file (atomically), under the apply lock: what is saved
/// is one state the daemon ran, and no change slips between it and the unsaved list being
/// cleared once the file holds it.
fn save_running(shared: &Shared, _lock: &reload::ApplyLock) -> Result<PathBuf, SaveError> {
    let path = shared.source.path.as_deref().ok_or(SaveError::NoFile)?;
    // Devices left out at start (their cluster down) stay in the file. Command-line
    // overrides do not reach it: the merge never writes `[server]` (`config::edit`).
    let config = shared.config_to_keep();
    let mut base = shared.file_base.lock().unwrap_or_else(|e| e.into_inner());
    reload::save_config(path, &mut base, &config, Some(&shared.source))?;
    shared.unsaved.clear();
    Ok(path.to_path_buf())
}

/// The running device `name`, or `not_found`.
fn open_device<'t>(
    topology: &'t crate::topology::Topology,
    name: &str,
) -> Result<&'t crate::topology::OpenDevice, ControlError> {
    topology
        .devices
        .get(name)
        .map(|d| &**d)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))
}

/// Makes this gateway the owner of an RBD image (explicit ALUA), fencing the previous owner.
fn take_device(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let name = text(args, "name")?;
    let topology = shared.topology();
    let device = open_device(&topology, name)?;
    let ownership = device.ownership.as_ref().ok_or_else(|| {
        ControlError::Conflict(format!(
            "device {name} has no owner to move: only RBD images under gateways do"
        ))
    })?;
    let me = ownership
        .take_here(&device.unit)
        .map_err(|e| ControlError::Device(format!("device {name}: taking it over: {e}")))?;
    Ok(json!({ "device": name, "owner": me }))
}

/// Clears a device's persistent reservation and every registration, as PERSISTENT RESERVE OUT
/// CLEAR does but without a key: for an operator whose hosts left registrations behind (or
/// filled the LU's places). Every registrant gets RESERVATIONS PREEMPTED.
fn clear_reservations(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let name = text(args, "name")?;
    let topology = shared.topology();
    let device = open_device(&topology, name)?;
    let cleared = device.unit.clear_reservations().map_err(|sense| {
        ControlError::Device(format!(
            "device {name}: clearing its reservations failed (sense {:02x}/{:02x}/{:02x}): \
             its state could not be saved; nothing changed",
            sense.key, sense.asc, sense.ascq
        ))
    })?;
    tracing::warn!(
        device = name,
        registrations = cleared,
        "persistent reservations cleared by ctl"
    );
    Ok(json!({ "device": name, "registrations_cleared": cleared }))
}

fn close_session(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let tsih = args
        .get("tsih")
        .and_then(Value::as_u64)
        .and_then(|t| u16::try_from(t).ok())
        .ok_or_else(|| {
            ControlError::BadRequest("\"tsih\": a session's TSIH (1..65535) is required".into())
        })?;
    if shared.registry.close(tsih, "closed by ferrosan ctl") {
        Ok(json!({ "closed": tsih }))
    } else {
        Err(ControlError::NotFound(format!(
            "no session with TSIH {tsih}"
        )))
    }
}

fn change(shared: &Shared, verb: &str, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let running = shared.topology().config.clone();
    let mut args = args.clone();
    if verb == "resize" && args.contains_key("size") && volumes::grow_thin(&running, &mut args)? {
        // The LV is grown for good (LVM does not shrink safely); the same verb again takes it.
        let result = change(shared, verb, &args);
        if let Err(e) = &result {
            let device = text(&args, "device").unwrap_or_default();
            tracing::warn!(%device, error = %e, "ctl: the volume's LV grew but its LU did not take the size; resize it again");
        }
        return result;
    }
    if verb == "resize" && !args.contains_key("size") {
        // A medium grown underneath: the size the open store sees now, never a second open
        // of the path (which may name another file by now).
        let name = text(&args, "device")?;
        let topology = shared.topology();
        let device = topology
            .devices
            .get(name)
            .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))?;
        let medium = device
            .unit
            .medium_bytes()
            .map_err(|e| ControlError::Device(format!("device {name}: {e}")))?
            .ok_or_else(|| {
                ControlError::BadRequest(format!("device {name} is a RAM device: give a size"))
            })?;
        if running
            .device(name)
            .is_some_and(|d| d.store.sized_by_medium())
        {
            return grow_to_medium(shared, name, medium);
        }
        // The config records a file's new size.
        args.insert("size".into(), Value::String(medium.to_string()));
    }
    let args = &args;
    transact(shared, verb, args, |running| {
        let mut config = running.clone();
        let what = edit(&mut config, verb, args)?;
        Ok(Step::Apply {
            config: Box::new(config),
            what,
        })
    })
}

/// What a change computed from the running config of its moment decided.
pub(crate) enum Step {
    /// Run `config` (the running one, edited), the change described by `what`.
    Apply { config: Box<Config>, what: String },
    /// Nothing to change (what was asked for is there already): this is the answer.
    Answer(Value),
}

/// Runs one change as a transaction, the one way every changing verb takes. Under the apply
/// lock, `change` computes the next config from the running config of this moment (never from
/// a copy taken earlier: installing that would undo whatever was acknowledged meanwhile), and
/// re-checks there what it assumed; the result is validated whole, as a file would be (written
/// out and read back), applied by difference as a reload, and saved with `"save": true` (else
/// listed as unsaved). With `"if_generation": N` it is refused (`conflict`) unless the running
/// config is still generation N: a client that read, decided and writes knows nothing changed
/// in between. Slow work (copying data, LVM, librbd) is done by the caller before, never under
/// the lock.
pub(crate) fn transact(
    shared: &Shared,
    verb: &str,
    args: &Map<String, Value>,
    change: impl FnOnce(&Config) -> Result<Step, ControlError>,
) -> Result<Value, ControlError> {
    let lock = reload::lock(shared);
    let current = shared.topology();
    expect_generation(args, current.generation)?;
    let (edited, what) = match change(&current.config)? {
        Step::Answer(answer) => return Ok(answer),
        Step::Apply { config, what } => (*config, what),
    };
    let validated = edited
        .revalidated_from(&current.config, "(ctl edit)")
        .map_err(|errors| ControlError::Invalid(of_the_verb(errors, verb)))?;
    drop(current);
    let applied = reload::apply_locked(shared, &lock, validated)?;
    let saved = commit_to_file(shared, &lock, args, &what)?;
    tracing::info!(saved, generation = applied.generation, "ctl: {what}");
    Ok(json!({
        "applied": what,
        "generation": applied.generation,
        "changes": applied.changes.lines(),
        "saved": saved,
    }))
}

/// `"if_generation"`: the generation the client read; the change goes ahead only if it is
/// still the running one.
fn expect_generation(args: &Map<String, Value>, running: u64) -> Result<(), ControlError> {
    let Some(expected) = args.get("if_generation") else {
        return Ok(());
    };
    let expected = expected.as_u64().ok_or_else(|| {
        ControlError::BadRequest("\"if_generation\": a generation number is required".into())
    })?;
    if expected != running {
        return Err(ControlError::Conflict(format!(
            "the running config is generation {running}, not {expected}: it changed since it \
             was read; read it again and decide anew"
        )));
    }
    Ok(())
}

/// After a change applied: saved into the file with `"save": true` (true), else listed as
/// unsaved (false). A failed save leaves the change running and listed.
fn commit_to_file(
    shared: &Shared,
    lock: &ApplyLock,
    args: &Map<String, Value>,
    what: &str,
) -> Result<bool, ControlError> {
    shared.unsaved.add(what.to_string());
    if !args.get("save").and_then(Value::as_bool).unwrap_or(false) {
        return Ok(false);
    }
    save_running(shared, lock).map_err(ControlError::NotSaved)?;
    Ok(true)
}

/// A `ctl` edit's validation errors as the verb's, not as places in the text the edited
/// config was written to for validation (which the operator never saw): `VERB: FIELD:
/// MESSAGE`.
pub(super) fn of_the_verb(mut errors: ConfigErrors, verb: &str) -> ConfigErrors {
    for e in &mut errors.errors {
        e.file = verb.to_string();
        e.line = 0;
        e.column = 0;
    }
    errors
}

/// A block device grown underneath (lvextend, a bigger RBD image): the LU takes the device's
/// size now (`whole`, in whole blocks) and raises CAPACITY DATA HAS CHANGED. Nothing in the
/// config changes (a block device's size is the device's), so nothing is unsaved.
fn grow_to_medium(shared: &Shared, name: &str, whole: u64) -> Result<Value, ControlError> {
    let topology = shared.topology();
    let device = topology
        .devices
        .get(name)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))?;
    let was = device.unit.capacity_bytes();
    if whole < was {
        return Err(ControlError::Conflict(format!(
            "device {name}: the device has {whole} bytes now, less than the LU's {was}: \
             shrinking is refused"
        )));
    }
    device
        .unit
        .resize(whole)
        .map_err(|e| ControlError::Device(format!("device {name}: {e}")))?;
    let what = if whole == was {
        format!("device {name}: still {was} bytes, nothing to do")
    } else {
        format!("device {name} grew from {was} to {whole} bytes")
    };
    tracing::info!("ctl: {what}");
    Ok(json!({
        "applied": what,
        "generation": topology.generation,
        "changes": if whole == was { vec![] } else { vec![what.clone()] },
        "saved": true,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_directory_is_the_daemons_own_and_closed_to_others() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("ferrosan-sockdir-{}", std::process::id()));
        let own = dir.join("own");
        std::fs::create_dir_all(&own).unwrap();
        let me = rustix::process::geteuid().as_raw();
        let set =
            |p: &Path, mode| std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
        set(&dir, 0o755).unwrap();
        set(&own, 0o755).unwrap();
        assert!(check_socket_dir(&own, me).is_ok());
        assert!(check_socket_dir(&own, me + 1)
            .unwrap_err()
            .to_string()
            .contains("not by the daemon's user"));
        for mode in [0o775, 0o777, 0o1777] {
            set(&own, mode).unwrap();
            assert!(check_socket_dir(&own, me)
                .unwrap_err()
                .to_string()
                .contains("writable by others"));
        }
        set(&own, 0o700).unwrap();
        // ctl: itself and root are trusted; another user only as root, in a directory root
        // made for that user (as systemd's RuntimeDirectory).
        let socket = own.join("control.sock");
        assert!(trusted_daemon(&socket, me, me));
        assert!(trusted_daemon(&socket, 0, me));
        assert!(!trusted_daemon(&socket, me + 1, me + 2));
        if me == 0 {
            rustix::fs::chown(&own, Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
            assert!(
                trusted_daemon(&socket, 65534, 0),
                "a service directory under a root-owned one"
            );
            set(&dir, 0o1777).unwrap();
            assert!(
                !trusted_daemon(&socket, 65534, 0),
                "a directory in a /tmp-like place"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    fn base() -> Config {
        Config::from_toml_str(
            r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[device]]
name = "a"
store = "ram"
size = "16M"
[[target]]
iqn = "iqn.2026-11.test:t"
  [[target.group]]
  name = "g"
  initiators = ["iqn.2026-11.test:i"]
  luns = [ { lun = 0, device = "a" } ]
"#,
            "t.toml",
        )
        .unwrap()
    }

    fn valid(c: &Config) -> Config {
        Config::from_toml_str(&c.to_toml_with_secrets(), "edit").unwrap()
    }

    #[test]
    fn every_verb_edits_and_stays_valid() {
        let mut c = base();
        edit(
            &mut c,
            "device-add",
            &args(json!({"name": "b", "spec": "ram:8M"})),
        )
        .unwrap();
        edit(
            &mut c,
            "lun-map",
            &args(json!({"target": "iqn.2026-11.test:t", "group": "g", "lun": 2, "device": "b"})),
        )
        .unwrap();
        edit(
            &mut c,
            "initiator-add",
            &args(json!({"target": "iqn.2026-11.test:t", "group": "g", "initiator": "iqn.2026-11.test:j"})),
        )
        .unwrap();
        edit(
            &mut c,
            "chap-set",
            &args(json!({"target": "iqn.2026-11.test:t", "group": "g", "user": "u", "secret": "a-secret-of-16-bytes"})),
        )
        .unwrap();
        let v = valid(&c);
        assert_eq!(v.targets[0].groups[0].luns.len(), 2);
        assert_eq!(v.targets[0].groups[0].initiators.len(), 2);
        assert_eq!(
            v.targets[0].groups[0].auth.users[0].secret.expose(),
            b"a-secret-of-16-bytes"
        );
        assert!(
            !v.to_toml().contains("a-secret-of-16-bytes"),
            "shown configs redact"
        );
        edit(
            &mut c,
            "lun-unmap",
            &args(json!({"target": "iqn.2026-11.test:t", "group": "g", "lun": 2})),
        )
        .unwrap();
        edit(&mut c, "device-remove", &args(json!({"name": "b"}))).unwrap();
        edit(
            &mut c,
            "initiator-remove",
            &args(json!({"target": "iqn.2026-11.test:t", "group": "g", "initiator": "IQN.2026-11.TEST:J"})),
        )
        .unwrap();
        std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].auth =
            base().targets[0].groups[0].auth.clone();
        assert_eq!(valid(&c), base());
    }

    #[test]
    fn offline_online_and_every_chap_scope() {
        let mut c = base();
        let name = args(json!({"name": "a"}));
        assert_eq!(
            edit(&mut c, "device-offline", &name).unwrap(),
            "device a taken offline"
        );
        assert!(valid(&c).devices[0].offline);
        assert!(edit(&mut c, "device-offline", &name)
            .unwrap_err()
            .to_string()
            .contains("offline already"));
        edit(&mut c, "device-online", &name).unwrap();
        assert!(edit(&mut c, "device-online", &name)
            .unwrap_err()
            .to_string()
            .contains("online already"));
        assert!(edit(&mut c, "device-offline", &args(json!({"name": "zz"})))
            .unwrap_err()
            .to_string()
            .contains("no device"));
        assert_eq!(c, base());
        let t = "iqn.2026-11.test:t";
        let i = "iqn.2026-11.test:i";
        let secret = "a-secret-of-16-bytes";
        // Mutual for an initiator without credentials of its own: refused.
        assert!(edit(
            &mut c,
            "chap-set",
            &args(json!({"target": t, "initiator": i, "user": "tgt", "secret": secret, "mutual": true}))
        )
        .unwrap_err()
        .to_string()
        .contains("no CHAP user of its own"));
        edit(
            &mut c,
            "chap-set",
            &args(json!({"target": t, "initiator": i, "user": "host", "secret": secret})),
        )
        .unwrap();
        edit(
            &mut c,
            "chap-set",
            &args(json!({"target": t, "initiator": i, "user": "tgt", "secret": "another-secret-16b", "mutual": true})),
        )
        .unwrap();
        // The target's mutual name alone: the edit is made, the whole-config check refuses it
        // (mutual CHAP needs a user to authenticate first).
        let mut alone = c.clone();
        edit(
            &mut alone,
            "chap-set",
            &args(
                json!({"target": t, "user": "tm", "secret": "target-mutual-16b", "mutual": true}),
            ),
        )
        .unwrap();
        assert!(
            alone.targets[0].auth.users.is_empty(),
            "mutual sets no user"
        );
        assert!(Config::from_toml_str(&alone.to_toml_with_secrets(), "edit").is_err());
        for (user, secret, mutual) in [
            ("tu", "target-user-16-by", false),
            ("tm", "target-mutual-16b", true),
        ] {
            edit(
                &mut c,
                "chap-set",
                &args(json!({"target": t, "user": user, "secret": secret, "mutual": mutual})),
            )
            .unwrap();
        }
        let v = valid(&c);
        let cred = &v.targets[0].credentials[0];
        assert_eq!(cred.initiator.as_str(), i);
        assert_eq!(cred.users[0].user, "host");
        assert_eq!(cred.mutual.as_ref().unwrap().user, "tgt");
        assert_eq!(v.targets[0].auth.mutual.as_ref().unwrap().user, "tm");
        assert_eq!(v.targets[0].auth.users[0].user, "tu");
        // Setting it again replaces, never duplicates.
        edit(
            &mut c,
            "chap-set",
            &args(json!({"target": t, "initiator": i, "user": "host2", "secret": secret})),
        )
        .unwrap();
        let v = valid(&c);
        assert_eq!(v.targets[0].credentials.len(), 1);
        assert_eq!(v.targets[0].credentials[0].users.len(), 1);
        assert!(edit(
            &mut c,
            "chap-set",
            &args(
                json!({"target": t, "initiator": i, "group": "g", "user": "x", "secret": secret})
            )
        )
        .unwrap_err()
        .to_string()
        .contains("not both"));
    }

    #[test]
    fn refusals_say_their_kind() {
        let kind = |verb: &str, a: Value| edit(&mut base(), verb, &args(a)).unwrap_err().kind();
        let t = "iqn.2026-11.test:t";
        assert_eq!(
            kind("device-add", json!({"name": "a", "spec": "ram:8M"})),
            "conflict"
        );
        assert_eq!(
            kind("device-add", json!({"name": "b", "spec": "floppy:1"})),
            "bad_request"
        );
        assert_eq!(kind("device-add", json!({"name": "b"})), "bad_request");
        assert_eq!(kind("device-remove", json!({"name": "a"})), "conflict");
        assert_eq!(kind("device-remove", json!({"name": "zz"})), "not_found");
        assert_eq!(
            kind("resize", json!({"device": "a", "size": "lots"})),
            "bad_request"
        );
        let lun = |group: &str, lun: u64, device: &str| json!({"target": t, "group": group, "lun": lun, "device": device});
        assert_eq!(kind("lun-map", lun("g", 0, "a")), "conflict");
        assert_eq!(kind("lun-map", lun("g", 1, "zz")), "not_found");
        assert_eq!(kind("lun-map", lun("nope", 1, "a")), "not_found");
        assert_eq!(kind("frobnicate", json!({})), "bad_request");
    }

    #[test]
    fn bad_edits_are_refused_and_change_nothing() {
        let refused = |verb: &str, a: Value| {
            let mut c = base();
            let e = edit(&mut c, verb, &args(a)).unwrap_err();
            assert_eq!(c, base(), "{verb} changed the config before refusing: {e}");
            e.to_string()
        };
        assert!(refused("device-add", json!({"name": "a", "spec": "ram:8M"})).contains("exists"));
        assert!(!refused("device-add", json!({"name": "b", "spec": "floppy:1"})).is_empty());
        assert!(refused("device-remove", json!({"name": "a"})).contains("mapped"));
        assert!(refused("device-remove", json!({"name": "zz"})).contains("no device"));
        let t = "iqn.2026-11.test:t";
        assert!(refused(
            "lun-map",
            json!({"target": t, "group": "g", "lun": 0, "device": "a"})
        )
        .contains("already"));
        assert!(refused(
            "lun-map",
            json!({"target": t, "group": "g", "lun": 1, "device": "zz"})
        )
        .contains("no device"));
        assert!(refused(
            "lun-map",
            json!({"target": t, "group": "nope", "lun": 1, "device": "a"})
        )
        .contains("no group"));
        assert!(
            refused("lun-unmap", json!({"target": t, "group": "g", "lun": 9})).contains("no LUN")
        );
        assert!(refused(
            "lun-map",
            json!({"target": "iqn.2026-11.test:x", "group": "g", "lun": 1, "device": "a"})
        )
        .contains("no target"));
        assert!(refused(
            "lun-map",
            json!({"target": t, "group": "g", "lun": "one", "device": "a"})
        )
        .contains("number"));
        assert!(refused(
            "initiator-remove",
            json!({"target": t, "group": "g", "initiator": "iqn.2026-11.test:zz"})
        )
        .contains("not in"));
        assert!(!refused("resize", json!({"device": "a", "size": "lots"})).is_empty());
        assert!(refused("frobnicate", json!({})).contains("unknown"));
    }

    #[test]
    fn a_long_line_is_refused_and_lines_are_split() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let input = b"{\"verb\":\"status\"}\n\n{}\n".to_vec();
            let mut r = BufReader::new(&input[..]);
            let mut line = Vec::new();
            assert!(read_line_bounded(&mut r, &mut line, 100).await.unwrap() > 0);
            assert_eq!(line, b"{\"verb\":\"status\"}");
            line.clear();
            assert_eq!(read_line_bounded(&mut r, &mut line, 100).await.unwrap(), 1);
            assert!(
                line.is_empty(),
                "an empty line is a (bad) request, not the end"
            );
            line.clear();
            read_line_bounded(&mut r, &mut line, 100).await.unwrap();
            assert_eq!(line, b"{}");
            line.clear();
            assert_eq!(read_line_bounded(&mut r, &mut line, 100).await.unwrap(), 0);
            let long = vec![b'x'; 300];
            let mut r = BufReader::new(&long[..]);
            let e = read_line_bounded(&mut r, &mut Vec::new(), 100)
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidData);
        });
    }
}
