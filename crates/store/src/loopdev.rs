//! Loop devices for tests that need a real block device (an exclusive claim, EBUSY): tests run
//! as root here, and `losetup` makes one over a sparse file. Compiled for this crate's tests
//! and, with the feature `test-support`, for other crates' tests.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A loop device over a sparse file, detached and its file removed on drop, so a failing test
/// leaves none behind.
pub struct LoopDevice {
    pub device: PathBuf,
    backing: PathBuf,
}

impl LoopDevice {
    /// A loop device of `bytes` over a file in `dir`. None without root or `losetup`, having
    /// printed `skipped: …` with the reason: the caller's test then tests nothing, and says so.
    pub fn attach(dir: &Path, tag: &str, bytes: u64) -> Option<LoopDevice> {
        if !rustix::process::geteuid().is_root() {
            println!("skipped: {tag}: loop devices need root");
            return None;
        }
        let backing = dir.join(format!("{tag}-{}.img", std::process::id()));
        let made = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::File::create(&backing))
            .and_then(|f| f.set_len(bytes));
        if let Err(e) = made {
            println!("skipped: {tag}: cannot make {}: {e}", backing.display());
            return None;
        }
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&backing)
            .output();
        match out {
            Ok(out) if out.status.success() => {
                let device = String::from_utf8_lossy(&out.stdout).trim().into();
                Some(LoopDevice { device, backing })
            }
            other => {
                let _ = std::fs::remove_file(&backing);
                println!("skipped: {tag}: losetup -f --show failed: {other:?}");
                None
            }
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
        let _ = std::fs::remove_file(&self.backing);
    }
}

/// Opens `path` exclusively (O_EXCL), as another program claiming it would; EBUSY is retried
/// for `within`. A claim is released with the last descriptor of it, and a process another
/// test thread forks holds copies of every descriptor until it execs (close-on-exec): a claim
/// just given up can stay held that long.
pub fn claim(path: &Path, within: Duration) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let started = Instant::now();
    loop {
        let opened = File::options()
            .read(true)
            .write(true)
            .custom_flags(libc::O_EXCL)
            .open(path);
        match opened {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && started.elapsed() < within => {
                std::thread::sleep(Duration::from_millis(10))
            }
            other => return other,
        }
    }
}
