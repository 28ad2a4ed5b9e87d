//! Exclusive claims on the block devices stores serve. A store opens its block device with
//! O_EXCL, as LIO and SCST claim their backstores: while it is open another exclusive open
//! fails with EBUSY (mkfs, mount, LVM and md assembling it, another target, `ferrosan bench
//! --destructive`), and the device cannot be mounted. Plain opens still work (udev's probes,
//! `dd`, a read-only bench).
//!
//! The kernel ties a claim to one open file description, so a second O_EXCL open from this
//! process would fail too. The daemon does open one device twice: a reload that renames a
//! device opens it under the new name before the old store closes, a device removed and added
//! back may be reopened while the old store still waits for its sessions (`close_when_idle`),
//! and `cache = "auto"` opens a direct store beside the paged one. Each such store shares the
//! descriptor that holds the claim: the registry below hands it out while any store has it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The descriptors holding this process's claims, by device number.
static CLAIMS: Mutex<Vec<(u64, Weak<File>)>> = Mutex::new(Vec::new());

/// Block device `path` opened for reading and writing, claimed exclusively for this process:
/// the descriptor of a claim a store here holds already, else a new O_EXCL open. EBUSY (a
/// claim or a mount of someone else's) is an error that says so and names the device.
pub(crate) fn open_claimed(path: &Path) -> io::Result<Arc<File>> {
    let device = std::fs::metadata(path)?.rdev();
    // Held across the open: two stores opening the same device at once share one claim.
    let mut claims = CLAIMS.lock().unwrap_or_else(PoisonError::into_inner);
    claims.retain(|(_, held)| held.strong_count() > 0);
    let held = claims.iter().find(|(d, _)| *d == device);
    if let Some(file) = held.and_then(|(_, held)| held.upgrade()) {
        return Ok(file);
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_EXCL)
        .open(path)
        .map_err(|e| in_use(path, e))?;
    // Keyed by what was opened: the path may name another device by now (a link udev moved).
    let device = file.metadata()?.rdev();
    let file = Arc::new(file);
    claims.push((device, Arc::downgrade(&file)));
    Ok(file)
}

/// EBUSY explained: who may hold the device, and that ferrosan claims what it serves.
fn in_use(path: &Path, e: io::Error) -> io::Error {
    if e.raw_os_error() != Some(libc::EBUSY) {
        return e;
    }
    io::Error::new(
        e.kind(),
        format!(
            "{} is in use by another program (EBUSY): mounted, held by LVM, md or \
             device-mapper, or claimed by another target (another ferrosan, LIO, SCST) or a \
             destructive benchmark; a served device is claimed exclusively, so nothing else \
             can write it meanwhile",
            path.display()
        ),
    )
}
