//! The engine's rooms import one way (docs/ARCHITECTURE.md, "Rooms of the engine"):
//! server → {control, dataplane} → shared → admission → topology → {io, config, metrics}.
//! This reads every source file and fails on an import that runs back up or sideways.

use std::path::{Path, PathBuf};

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
        ],
    ),
    (
        "control",
        &["shared", "admission", "topology", "io", "config", "metrics"],
    ),
    (
        "dataplane",
        &["shared", "admission", "topology", "io", "config", "metrics"],
    ),
    (
        "shared",
        &["admission", "topology", "io", "config", "metrics"],
    ),
    ("admission", &["topology", "io", "config", "metrics"]),
    ("topology", &["io", "config", "metrics"]),
    ("io", &["config", "metrics"]),
    ("config", &[]),
    ("metrics", &[]),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

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
    let mut files = Vec::new();
    sources(&src, &mut files);
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
