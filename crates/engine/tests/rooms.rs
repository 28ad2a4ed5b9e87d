//! The engine's rooms import one way (docs/ARCHITECTURE.md, "Rooms of the engine"):
//! server → {control, dataplane} → shared → admission → topology → {io, config, metrics};
//! `log_limit` (a leaf) is used by the server, the dataplane and metrics (a device's slow commands).
//! This reads every source file and fails on an import that runs back up or sideways.

mod tree;

use std::path::Path;

/// Each room, and the rooms it may import (besides itself).
const ALLOWED: &[(&str, &[&str])] = &[
    (
        "server",
        &[
            "control",
            "dataplane",
            "shared",
            "admission",
            "topology",
            "io",
            "config",
            "metrics",
            "log_limit",
        ],
    ),
    (
        "control",
        &["shared", "admission", "topology", "io", "config", "metrics"],
    ),
    (
        "dataplane",
        &[
            "shared",
            "admission",
            "topology",
            "io",
            "config",
            "metrics",
            "log_limit",
        ],
    ),
    (
        "shared",
        &["admission", "topology", "io", "config", "metrics"],
    ),
    ("admission", &["topology", "io", "config", "metrics"]),
    ("topology", &["io", "config", "metrics"]),
    ("io", &["config", "metrics"]),
    ("config", &[]),
    ("metrics", &["log_limit"]),
    ("log_limit", &[]),
];

/// The room a source file belongs to: its folder, or its own name at the top.
fn room_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Every `crate::ROOM` a file names outside comments.
fn imports(text: &str) -> Vec<String> {
    let mut rooms = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let room: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !room.is_empty() {
                rooms.push(room);
            }
        }
    }
    rooms
}

#[test]
fn imports_run_one_way_between_rooms() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = tree::sources(&src, &[]);
    assert!(files.len() > 30, "only {} source files found", files.len());
    let mut checked = 0;
    let mut wrong = Vec::new();
    for file in &files {
        let room = room_of(&src, file);
        if room == "lib" {
            continue;
        }
        let allowed = ALLOWED
            .iter()
            .find(|(r, _)| *r == room)
            .unwrap_or_else(|| panic!("{}: room {room} is not in ALLOWED", file.display()))
            .1;
        for import in imports(&std::fs::read_to_string(file).unwrap()) {
            checked += 1;
            if import != room && !allowed.contains(&import.as_str()) {
                wrong.push(format!("{}: {room} imports {import}", file.display()));
            }
        }
    }
    assert!(checked > 100, "only {checked} imports seen");
    assert!(
        wrong.is_empty(),
        "imports against the rooms' order:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_sees_a_wrong_import() {
    assert_eq!(
        imports("use crate::dataplane::x; // crate::server\nlet a = crate::io::ring::X;"),
        ["dataplane", "io"]
    );
}

/// The doors (docs/ARCHITECTURE.md, "The seam"): these files are the iSCSI door, and only they
/// may use the iSCSI protocol crate; `dataplane/nvme/` is the NVMe/TCP door, the only user of
/// the NVMe crate's wire and queue modules. Every other file meets a door through the `seam`
/// crate.
const ISCSI_DOOR: &[&str] = &[
    "dataplane/connection.rs",
    "dataplane/login.rs",
    "dataplane/send.rs",
    "dataplane/iscsi_backend.rs",
];
const NVME_DOOR: &str = "dataplane/nvme/";

/// Protocol vocabulary outside the doors, each with why it is there. A new entry is a decision
/// to state in docs/ARCHITECTURE.md, not a way around the rule.
const VOCABULARY: &[(&str, &str)] = &[
    // The config validates what an admin writes for either door: CHAP secrets and algorithms,
    // DH-HMAC-CHAP keys, TLS PSKs; the resolved CHAP credential is what an iSCSI login checks.
    ("config/", "iscsi::chap"),
    ("config/", "nvme::"),
    // A gateway peer logs in to its owner with a CHAP secret derived from the ownership.
    ("topology/mod.rs", "iscsi::chap"),
    // NVMe controller IDs come from the session number range both doors share; the gateway
    // numbering splits that range.
    ("admission/registry.rs", "nvme::controller::CNTLID_MAX"),
    ("topology/gateway/mod.rs", "nvme::controller::CNTLID_MAX"),
    // The table of NVMe controllers (a host's queues span connections) and the TLS proof a
    // queue's admission checks live with the other admission decisions.
    ("admission/controllers.rs", "nvme::controller"),
    ("admission/mod.rs", "nvme::tls"),
    // The DH-HMAC-CHAP policy (which groups and hashes) is daemon-wide, set from the config.
    ("shared/mod.rs", "nvme::auth::controller::Policy"),
];

/// Every path of the external crate `krate` a file names outside comments (`iscsi::chap::X`),
/// not the engine's own modules of that name (`crate::dataplane::nvme::x`, `super::nvme`).
fn crate_paths(text: &str, krate: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let needle = format!("{krate}::");
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut from = 0;
        while let Some(at) = code[from..].find(&needle) {
            let start = from + at;
            from = start + needle.len();
            let before = code[..start].chars().next_back();
            if before.is_some_and(|c| c == ':' || c == '_' || c.is_ascii_alphanumeric()) {
                continue;
            }
            let path: String = code[start..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':' || *c == '{')
                .collect();
            paths.push(path);
        }
    }
    paths
}

#[test]
fn each_protocol_crate_is_used_by_its_door_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = tree::sources(&src, &[]);
    let mut seen = [0usize; 2];
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .to_string();
        let text = std::fs::read_to_string(file).unwrap();
        let iscsi_door = ISCSI_DOOR.contains(&rel.as_str());
        let nvme_door = rel.starts_with(NVME_DOOR);
        for (i, krate) in ["iscsi", "nvme"].into_iter().enumerate() {
            for path in crate_paths(&text, krate) {
                seen[i] += 1;
                let door = if krate == "iscsi" {
                    iscsi_door
                } else {
                    nvme_door
                };
                let vocabulary = VOCABULARY
                    .iter()
                    .any(|(place, prefix)| rel.starts_with(place) && path.starts_with(prefix));
                if !door && !vocabulary {
                    wrong.push(format!("{rel}: {path}"));
                }
            }
        }
    }
    assert!(seen[0] > 10 && seen[1] > 10, "only {seen:?} uses seen");
    assert!(
        wrong.is_empty(),
        "a protocol crate used outside its door (meet the door through `seam`):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_crate_check_tells_the_crate_from_a_module_of_its_name() {
    let text = "use nvme::queue::Queue; // nvme::x\nuse crate::dataplane::nvme::serve;\n\
                let s = super::nvme::y; let t = my_nvme::z; use iscsi::{pdu, session};";
    assert_eq!(crate_paths(text, "nvme"), ["nvme::queue::Queue"]);
    assert_eq!(crate_paths(text, "iscsi"), ["iscsi::{pdu"]);
}
