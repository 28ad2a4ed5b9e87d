//! A filesystem on a loop device, mounted in a scratch directory; unmounted and detached on
//! drop. Needs root (losetup, mount), as the test command runs.

use std::path::PathBuf;
use std::process::Command;

use super::Scratch;

/// Runs `program`; its trimmed stdout (a failure panics with its stderr).
pub fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

pub struct LoopFs {
    device: String,
    pub mountpoint: PathBuf,
    _scratch: Scratch,
}

impl LoopFs {
    /// A fresh `kind` filesystem (`mkfs.KIND`) of `bytes`, mounted.
    pub fn new(kind: &str, bytes: u64) -> LoopFs {
        let scratch = Scratch::new("loopfs");
        let image = scratch.file("fs.img");
        let file = std::fs::File::create(&image).unwrap();
        file.set_len(bytes).unwrap();
        let force = if kind == "xfs" { "-f" } else { "-F" };
        sh(
            &format!("mkfs.{kind}"),
            &["-q", force, image.to_str().unwrap()],
        );
        let device = sh("losetup", &["-f", "--show", image.to_str().unwrap()]);
        let mountpoint = scratch.file("mnt");
        std::fs::create_dir_all(&mountpoint).unwrap();
        let fs = LoopFs {
            device,
            mountpoint,
            _scratch: scratch,
        };
        sh("mount", &[&fs.device, fs.mountpoint.to_str().unwrap()]);
        fs
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mountpoint).status();
        let _ = Command::new("losetup").args(["-d", &self.device]).status();
    }
}
