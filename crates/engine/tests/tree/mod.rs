//! The source files the structure tests (`rooms.rs`, `lengths.rs`) read.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, but none under a directory named in `skip`, nor a file named
/// in it.
pub fn sources(dir: &Path, skip: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(dir, skip, &mut out);
    out
}

fn walk(dir: &Path, skip: &[&str], out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if skip.contains(&name.as_str()) {
            continue;
        }
        if path.is_dir() {
            walk(&path, skip, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}
