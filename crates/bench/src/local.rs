//! Local files and block devices, the physical limit: O_DIRECT I/O on an io_uring per job,
//! through the same ring code the target's device path uses (`engine::io::ring`).

use crate::runner::{Done, Engine, Op, Target, TargetInfo};
use engine::io::ring::{DeviceRing, Finished, RingOp};
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use store::{AlignedBuf, PooledBuf};

pub struct LocalTarget {
    info: TargetInfo,
    file: Arc<File>,
    /// Writes with RWF_DSYNC: durable when done, like a write-through LUN.
    dsync: bool,
    /// How long a job spins on its ring's completions before it sleeps in `io_uring_enter`.
    busy_poll: std::time::Duration,
}

impl LocalTarget {
    /// Its jobs spin on their rings' completions for up to `spin` before they sleep.
    pub fn busy_polling(mut self, spin: std::time::Duration) -> LocalTarget {
        self.busy_poll = spin;
        self.info.notes.extend(crate::busy_poll_note(spin));
        self
    }

    /// Opens `path` for direct I/O; `writes`: read-write (the caller has checked it may).
    pub fn open(path: &Path, writes: bool, dsync: bool) -> Result<LocalTarget, String> {
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
        let block = meta.file_type().is_block_device();
        if !block && !meta.is_file() {
            return Err(format!(
                "{shown}: neither a regular file nor a block device"
            ));
        }
        let mut file = open_direct(path, block, writes)?;
        let capacity = if block {
            file.seek(SeekFrom::End(0))
                .map_err(|e| format!("{shown}: size: {e}"))?
        } else {
            meta.len()
        };
        if capacity == 0 {
            return Err(format!(
                "{shown}: empty; give it a size and real data first (e.g. dd if=/dev/urandom of={shown} bs=1M count=4096 oflag=direct)"
            ));
        }
        let block_size = if block {
            rustix::fs::ioctl_blksszget(&file)
                .map_err(|e| format!("{shown}: logical block size: {e}"))?
        } else {
            direct_alignment(&file)
        };
        let mut notes = Vec::new();
        if !block && meta.blocks().saturating_mul(512) < capacity / 2 {
            notes.push(format!(
                "{} of {} bytes allocated: reads of holes never reach the device (write the file first for honest read figures)",
                meta.blocks().saturating_mul(512),
                capacity
            ));
        }
        Ok(LocalTarget {
            info: TargetInfo {
                name: shown.to_string(),
                kind: if block { "block" } else { "file" }.into(),
                capacity_bytes: capacity,
                block_size,
                notes,
                node: None,
                metrics: None,
            },
            file: Arc::new(file),
            dsync,
            busy_poll: std::time::Duration::ZERO,
        })
    }
}

/// `path` opened for direct I/O (`writes`: read-write, and a block device exclusively), with
/// the errors a user meets said plainly.
fn open_direct(path: &Path, block: bool, writes: bool) -> Result<File, String> {
    let shown = path.display();
    let mut options = std::fs::OpenOptions::new();
    options
        .read(true)
        .write(writes)
        .custom_flags(libc_o_direct());
    if block && writes {
        // The kernel refuses O_EXCL on a block device that is mounted or claimed (LVM, md,
        // a target serving it: ferrosan, LIO and SCST claim theirs): the last word on "in
        // use". Reads disturb nobody and open it as it is.
        options.custom_flags(libc_o_direct() | rustix::fs::OFlags::EXCL.bits() as i32);
    }
    options.open(path).map_err(|e| match e.raw_os_error() {
        // EBUSY
        Some(16) => format!(
            "{shown} is served or mounted by another program (EBUSY: a target such as \
             ferrosan, a mount, LVM or md holds it); not writing to it"
        ),
        Some(22) => {
            format!("{shown}: the filesystem does not support direct I/O (O_DIRECT), e.g. tmpfs")
        }
        _ => format!("{shown}: {e}"),
    })
}

fn libc_o_direct() -> i32 {
    rustix::fs::OFlags::DIRECT.bits() as i32
}

/// The smallest direct-I/O size the file's filesystem and device accept: 512 if a 512-byte
/// read works, else 4096.
fn direct_alignment(file: &File) -> u32 {
    let Some(mut buf) = AlignedBuf::zeroed(512) else {
        return 4096;
    };
    if file.read_at(&mut buf, 0).is_ok() {
        512
    } else {
        4096
    }
}

impl Target for LocalTarget {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn open(&self, queue_depth: usize, max_len: u32) -> Result<Box<dyn Engine>, String> {
        let ring = DeviceRing::blocking().map_err(|e| format!("io_uring: {e}"))?;
        // Data that does not compress or deduplicate, so writes cost what real data costs.
        let mut pattern = vec![0u8; max_len as usize];
        initiator::driver::random_bytes(&mut pattern);
        let mut buffers = Vec::with_capacity(queue_depth);
        for _ in 0..queue_depth {
            let mut buf = AlignedBuf::zeroed(max_len as usize)
                .ok_or_else(|| format!("no memory for {queue_depth} buffers of {max_len} bytes"))?;
            buf.copy_from_slice(&pattern);
            buffers.push(Some(PooledBuf::unpooled(buf)));
        }
        Ok(Box::new(LocalEngine {
            ring,
            file: Arc::clone(&self.file),
            buffers,
            finished: Vec::new(),
            dsync: self.dsync,
            busy_poll: self.busy_poll,
        }))
    }
}

struct LocalEngine {
    ring: DeviceRing<usize>,
    file: Arc<File>,
    /// A buffer per tag, in the ring while its I/O is.
    buffers: Vec<Option<PooledBuf>>,
    finished: Vec<Finished<usize>>,
    dsync: bool,
    busy_poll: std::time::Duration,
}

impl Engine for LocalEngine {
    fn submit(&mut self, tag: usize, op: Op, offset: u64, len: u32) -> Result<(), String> {
        let mut buf = self
            .buffers
            .get_mut(tag)
            .and_then(Option::take)
            .ok_or_else(|| format!("tag {tag} has no buffer (in flight?)"))?;
        if len as usize > buf.capacity() {
            return Err(format!(
                "{len}-byte I/O over a {}-byte buffer",
                buf.capacity()
            ));
        }
        buf.set_len(len as usize);
        let op = match op {
            Op::Read => RingOp::Read,
            Op::Write => RingOp::Write { dsync: self.dsync },
        };
        self.ring
            .push(op, &self.file, offset, Some(buf), tag)
            .map_err(|_| "io_uring full".to_string())
    }

    fn complete(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), String> {
        let before = out.len();
        self.spin(min, out)?;
        while out.len() - before < min && self.ring.in_flight() > 0 {
            self.ring
                .wait(min - (out.len() - before))
                .map_err(|e| format!("io_uring: {e}"))?;
            self.take(out);
        }
        Ok(())
    }

    fn data(&self, tag: usize) -> Option<&[u8]> {
        self.buffers.get(tag)?.as_ref().map(|b| &b[..])
    }
}

impl LocalEngine {
    /// Submits what is queued and reaps the ring without sleeping, for up to `busy_poll`,
    /// until `min` I/Os completed (a polling client, as the socket's spins over the network).
    fn spin(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), String> {
        if self.busy_poll.is_zero() {
            return Ok(());
        }
        let before = out.len();
        let began = std::time::Instant::now();
        while out.len() - before < min
            && self.ring.in_flight() > 0
            && began.elapsed() < self.busy_poll
        {
            // What is queued (new, or retried by the last reap) goes to the kernel first.
            self.ring.submit().map_err(|e| format!("io_uring: {e}"))?;
            self.take(out);
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Moves what completed into `out`, giving each tag its buffer back.
    fn take(&mut self, out: &mut Vec<Done>) {
        self.ring.reap(&mut self.finished);
        for f in self.finished.drain(..) {
            if let Some(slot) = self.buffers.get_mut(f.tag) {
                *slot = f.buf;
            }
            out.push((f.tag, f.result.map_err(|e| e.to_string())));
        }
    }
}

/// Why writing to `path` would destroy something in use, if it would: a mounted or claimed
/// block device (or one of its partitions), a file backing a loop device, or (unless
/// `even_if_open`) a file another process has open.
pub fn in_use(path: &Path, even_if_open: bool) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.file_type().is_block_device() {
        return block_device_in_use(path, meta.rdev());
    }
    let shown = path.display();
    let canonical = std::fs::canonicalize(path).ok()?;
    if let Ok(loops) = std::fs::read_dir("/sys/block") {
        for l in loops.flatten() {
            let backing = l.path().join("loop/backing_file");
            if std::fs::read_to_string(&backing).is_ok_and(|b| Path::new(b.trim()) == canonical) {
                return Some(format!(
                    "{shown} backs loop device /dev/{}",
                    l.file_name().to_string_lossy()
                ));
            }
        }
    }
    if even_if_open {
        return None;
    }
    open_elsewhere(path, &canonical)
}

/// Whether block device `path` (device number `rdev`), or a partition of it, is mounted or
/// held by another device (LVM, md, dm).
fn block_device_in_use(path: &Path, rdev: u64) -> Option<String> {
    let shown = path.display();
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let mut devices = vec![format!("{major}:{minor}")];
    // Its partitions: subdirectories with a `partition` file.
    if let Ok(entries) = std::fs::read_dir(&sys) {
        for e in entries.flatten() {
            if e.path().join("partition").exists() {
                if let Ok(dev) = std::fs::read_to_string(e.path().join("dev")) {
                    devices.push(dev.trim().to_string());
                }
            }
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in mounts.lines() {
        let mut f = line.split(' ');
        let (Some(dev), Some(point)) = (f.nth(2), f.nth(1)) else {
            continue;
        };
        if devices.iter().any(|d| d == dev) {
            return Some(format!(
                "{shown} (or a partition of it) is mounted on {point}"
            ));
        }
    }
    if std::fs::read_dir(sys.join("holders")).is_ok_and(|mut h| h.next().is_some()) {
        return Some(format!("{shown} is held by another device (LVM, md, dm)"));
    }
    None
}

/// The first other process that has `canonical` open, as the reason `path` is in use.
fn open_elsewhere(path: &Path, canonical: &Path) -> Option<String> {
    let me = std::process::id().to_string();
    for p in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = p.file_name().to_string_lossy().to_string();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| t == canonical) {
                let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
                return Some(format!(
                    "{} is open in process {pid} ({})",
                    path.display(),
                    comm.trim()
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan, Timing};
    use std::time::Duration;

    /// Where the tests' files go: under the build's target directory, on the disk (the temp
    /// dir may be tmpfs, which has no direct I/O).
    fn disk_dir() -> PathBuf {
        option_env!("CARGO_TARGET_DIR")
            .map_or_else(
                || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"),
                PathBuf::from,
            )
            .join("bench-tests")
    }

    fn scratch(tag: &str, len: usize) -> PathBuf {
        let dir = disk_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{tag}-{}", std::process::id()));
        std::fs::write(&path, vec![0x5a; len]).unwrap();
        // Written back now, so the first direct I/O does not wait for 8 MiB of dirty pages.
        std::fs::File::open(&path).unwrap().sync_all().unwrap();
        path
    }

    #[test]
    fn reads_and_writes_run_on_a_real_file_and_land() {
        if DeviceRing::<u32>::probe().is_err() {
            eprintln!("SKIPPED: no io_uring here");
            return;
        }
        let path = scratch("rw", 8 << 20);
        let target = match LocalTarget::open(&path, true, true) {
            Ok(t) => t,
            Err(e) if e.contains("direct I/O") => {
                eprintln!("SKIPPED: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(target.info().capacity_bytes, 8 << 20);
        assert!(target.info().notes.is_empty(), "{:?}", target.info().notes);
        // A window long enough that one slow write on a busy CI disk (a journal commit of
        // another test's fsync) does not leave a QD1 workload with no completion in it.
        let timing = Timing {
            ramp: Duration::from_millis(50),
            runtime: Duration::from_millis(800),
        };
        for w in plan(true, true) {
            let s = crate::runner::run(&target, &w, &timing, 8 << 20, None).unwrap();
            assert_eq!(s.errors, 0, "{}: {:?}", w.id, s.first_error);
            assert!(s.iops > 0.0, "{}: {s:?}", w.id);
        }
        drop(target);
        // The writes replaced the 0x5a filler with their pattern.
        let data = std::fs::read(&path).unwrap();
        assert!(data.iter().filter(|&&b| b == 0x5a).count() < data.len() / 2);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn unusable_paths_get_clear_errors() {
        let empty = scratch("empty", 0);
        assert!(LocalTarget::open(&empty, false, false)
            .err()
            .unwrap()
            .contains("empty"));
        std::fs::remove_file(&empty).unwrap();
        let missing = Path::new("/nonexistent/ferrosan-bench");
        assert!(LocalTarget::open(missing, false, false)
            .err()
            .unwrap()
            .contains("No such file"));
        assert!(LocalTarget::open(Path::new("/proc"), false, false)
            .err()
            .unwrap()
            .contains("neither"));
        // tmpfs refused O_DIRECT before Linux 6.6: then the error says so.
        if std::fs::write("/dev/shm/ferrosan-bench-test", [1u8; 4096]).is_ok() {
            let r = LocalTarget::open(Path::new("/dev/shm/ferrosan-bench-test"), false, false);
            let _ = std::fs::remove_file("/dev/shm/ferrosan-bench-test");
            if let Err(e) = r {
                assert!(e.contains("direct I/O"), "{e}");
            }
        }
    }

    #[test]
    fn a_sparse_file_is_noted() {
        let dir = disk_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("sparse-{}", std::process::id()));
        let f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        drop(f);
        if let Ok(t) = LocalTarget::open(&path, false, false) {
            assert!(
                t.info().notes.iter().any(|n| n.contains("holes")),
                "{:?}",
                t.info().notes
            );
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_file_open_elsewhere_or_a_mounted_device_is_in_use() {
        let path = scratch("busy", 4096);
        assert_eq!(in_use(&path, false), None);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(File::open(&path).unwrap())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let why = in_use(&path, false);
        // Asked to write even so (a benchmark keeping a target on the same file).
        assert_eq!(in_use(&path, true), None);
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            why.as_deref().is_some_and(|w| w.contains("sleep")),
            "{why:?}"
        );
        std::fs::remove_file(&path).unwrap();
        // The root filesystem's device is mounted.
        let root = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .find(|l| l.split(' ').nth(4) == Some("/"))
            .and_then(|l| {
                l.split(" - ")
                    .nth(1)
                    .and_then(|t| t.split(' ').nth(1))
                    .map(str::to_string)
            });
        if let Some(dev) = root.filter(|d| d.starts_with("/dev/") && Path::new(d).exists()) {
            let why = in_use(Path::new(&dev), true);
            assert!(
                why.as_deref().is_some_and(|w| w.contains("mounted")),
                "{dev}: {why:?}"
            );
        }
    }

    /// `ferrosan bench --destructive` never writes a disk a running daemon serves: the daemon's store claims it (O_EXCL), and a destructive run's own O_EXCL open is
    /// refused; a read-only run opens it without a claim.
    #[test]
    fn a_device_a_store_serves_is_refused_for_writes_and_read_for_reads() {
        let dir = disk_dir();
        let Some(dev) = store::loopdev::LoopDevice::attach(&dir, "served", 8 << 20) else {
            return;
        };
        let served = store::FileStore::open(&dev.device, None, false).unwrap();
        let e = LocalTarget::open(&dev.device, true, false).err().unwrap();
        assert!(e.contains("is served or mounted by another program"), "{e}");
        LocalTarget::open(&dev.device, false, false).unwrap();
        drop(served);
        // Free once no process another test forked holds a copy of the store's descriptor.
        drop(store::loopdev::claim(&dev.device, Duration::from_secs(5)).unwrap());
        LocalTarget::open(&dev.device, true, false).unwrap();
    }
}
