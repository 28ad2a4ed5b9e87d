//! A directory pool's files (docs/VOLUMES.md): volume `NAME` is the regular file `NAME.img`,
//! snapshot `SNAP` of it `.snapshots/NAME@SNAP.img`. Every entry is reached relative to the
//! pool's directory and never through a symbolic link (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`),
//! and `.snapshots` must be a real directory of the daemon's user: a link planted in a pool
//! cannot make a verb read a file outside it or write one elsewhere.
//!
//! The pool owns what it makes: a new file is created exclusively (`O_EXCL`: one that is
//! already there is the caller's conflict, never adopted), and a failed verb removes only a
//! file it made ([`Made`]: still the same device and inode). Data that takes time to copy
//! goes into a hidden partial file (`.NAME.img.partial`) renamed into place, without
//! replacing anything, once complete and durable: a crash leaves the state before or the
//! state after, and at most a partial file nothing reads as a volume or a snapshot.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};

/// Where the snapshots of a directory pool live, inside it.
pub const SNAPSHOTS_DIR: &str = ".snapshots";

/// A directory pool: the directory its volumes are files of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirPool {
    dir: PathBuf,
}

/// A file this process created: removed again only while it is still that file (its device
/// and inode), never one another process put at the same path meanwhile. It holds the file
/// open, so its inode number cannot be reused by another file while it lives.
#[derive(Debug)]
#[must_use = "a file made for a verb is kept (publish) or removed (forget)"]
pub struct Made {
    /// Its directory, and its name there.
    dir: PathBuf,
    name: String,
    dev: u64,
    ino: u64,
    _held: File,
    /// A new volume's intent (`.NAME.img.new` in `dir`): there until the verb committed it.
    intent: Option<String>,
}

impl Made {
    /// Where it is.
    pub fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// The verb committed the volume to the config: the file is kept, its intent goes (a
    /// failure to remove it is logged: the start after the next crash keeps a file the config
    /// holds).
    pub fn committed(self) {
        if let Some(intent) = &self.intent {
            if let Err(e) = remove_regular(&self.dir, intent) {
                tracing::warn!("{}: {e}", self.dir.join(intent).display());
            }
        }
    }

    /// Removes the file if it is still the one made (true), else leaves the path alone; and
    /// its intent.
    pub fn forget(self) -> io::Result<bool> {
        if let Some(intent) = &self.intent {
            remove_regular(&self.dir, intent)?;
        }
        let dir = open_dir(&self.dir)?;
        match rustix::fs::statat(&dir, self.name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if st.st_dev == self.dev && st.st_ino == self.ino => {
                rustix::fs::unlinkat(&dir, self.name.as_str(), AtFlags::empty())?;
                Ok(true)
            }
            Ok(_) | Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    Ok(rustix::fs::open(dir, flags, Mode::empty())?)
}

/// Opens entry `name` of `dir` without following a link; it must be a regular file.
fn open_regular(dir: impl AsFd, name: &str, write: bool) -> io::Result<File> {
    let access = if write { OFlags::RDWR } else { OFlags::RDONLY };
    let fd = rustix::fs::openat(
        dir,
        name,
        access | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| not_a_link(e, name))?;
    let file = File::from(fd);
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name}: not a regular file"),
        ));
    }
    Ok(file)
}

/// ELOOP from `O_NOFOLLOW` says what it means.
fn not_a_link(e: rustix::io::Errno, name: &str) -> io::Error {
    if e == rustix::io::Errno::LOOP {
        return io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name} is a symbolic link: a pool's files are never followed out of it"),
        );
    }
    e.into()
}

/// Creates entry `name` of `dir` exclusively (mode 0600), for writing.
fn create_new(dir: &Path, fd: impl AsFd, name: &str) -> io::Result<(File, Made)> {
    let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let file = match rustix::fs::openat(fd, name, flags, Mode::from_raw_mode(0o600)) {
        Ok(fd) => File::from(fd),
        Err(rustix::io::Errno::EXIST) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{}: there already, and not made by this verb",
                    dir.join(name).display()
                ),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let st = rustix::fs::fstat(&file)?;
    let made = Made {
        dir: dir.to_path_buf(),
        name: name.to_string(),
        dev: st.st_dev,
        ino: st.st_ino,
        _held: file.try_clone()?,
        intent: None,
    };
    Ok((file, made))
}

fn partial_name(name: &str) -> String {
    format!(".{name}.partial")
}

/// The intent of volume file `file` made and not yet committed (`.NAME.img.new`).
fn intent_name(file: &str) -> String {
    format!(".{file}.new")
}

/// Writes intent `name` of `dir`: the new file's device and inode numbers, fsynced.
fn write_intent(dir: &OwnedFd, name: &str, dev: u64, ino: u64) -> io::Result<()> {
    use std::io::Write as _;
    let flags =
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut file = File::from(rustix::fs::openat(
        dir,
        name,
        flags,
        Mode::from_raw_mode(0o600),
    )?);
    writeln!(file, "{dev} {ino}")?;
    file.sync_all()
}

impl DirPool {
    pub fn new(dir: impl Into<PathBuf>) -> DirPool {
        DirPool { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The filesystem of the pool's directory: (its size, the bytes still free to an
    /// unprivileged writer), as `df` counts them.
    pub fn usage(&self) -> io::Result<(u64, u64)> {
        let st = rustix::fs::statvfs(&self.dir)?;
        let block = st.f_frsize;
        Ok((st.f_blocks * block, st.f_bavail * block))
    }

    /// The file name of volume `name`.
    pub fn volume_file(name: &str) -> String {
        format!("{name}.img")
    }

    /// The file name of snapshot `snap` of volume `volume`, in [`SNAPSHOTS_DIR`].
    pub fn snapshot_file(volume: &str, snap: &str) -> String {
        format!("{volume}@{snap}.img")
    }

    pub fn volume_path(&self, name: &str) -> PathBuf {
        self.dir.join(Self::volume_file(name))
    }

    pub fn snapshot_path(&self, volume: &str, snap: &str) -> PathBuf {
        self.dir
            .join(SNAPSHOTS_DIR)
            .join(Self::snapshot_file(volume, snap))
    }

    /// Makes the pool's directory if it is missing (its parent must exist), mode 0750.
    pub fn make_dir(&self) -> io::Result<()> {
        match rustix::fs::mkdir(&self.dir, Mode::from_raw_mode(0o750)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        open_dir(&self.dir).map(drop)
    }

    /// Creates volume `name`: a new sparse file of `size` bytes, durable (file and directory
    /// entry) when this returns.
    pub fn create_volume(&self, name: &str, size: u64) -> io::Result<Made> {
        let (file, partial) = self.begin_volume(name)?;
        match file.set_len(size).and_then(|()| file.sync_all()) {
            Ok(()) => self.publish_volume(partial, name),
            Err(e) => {
                let _ = partial.forget();
                Err(e)
            }
        }
    }

    /// Makes a complete partial file (fsynced by its writer) volume `name`'s file, never over
    /// one that is there, with an intent naming its inode (`.NAME.img.new`, written first):
    /// until [`Made::committed`] removes it, a crash leaves a file that [`DirPool::recover`]
    /// removes at the next start unless the config holds the volume. On failure the partial
    /// file and the intent are removed.
    pub fn publish_volume(&self, partial: Made, name: &str) -> io::Result<Made> {
        let file = Self::volume_file(name);
        let intent = intent_name(&file);
        let written = open_dir(&self.dir).and_then(|dir| {
            write_intent(&dir, &intent, partial.dev, partial.ino)?;
            Ok(rustix::fs::fsync(&dir)?)
        });
        if let Err(e) = written {
            let _ = remove_regular(&self.dir, &intent);
            let _ = partial.forget();
            return Err(e);
        }
        match self.publish(partial, &file) {
            Ok(made) => Ok(Made {
                intent: Some(intent),
                ..made
            }),
            Err(e) => {
                let _ = remove_regular(&self.dir, &intent);
                Err(e)
            }
        }
    }

    /// Volume `name`'s file, to read (or write).
    pub fn open_volume(&self, name: &str, write: bool) -> io::Result<File> {
        open_regular(open_dir(&self.dir)?, &Self::volume_file(name), write)
    }

    /// A new, empty partial file for volume `name` (not a volume until [`DirPool::publish`]).
    pub fn begin_volume(&self, name: &str) -> io::Result<(File, Made)> {
        let dir = open_dir(&self.dir)?;
        create_new(&self.dir, &dir, &partial_name(&Self::volume_file(name)))
    }

    /// Makes a complete partial file (fsynced by its writer) the entry `final_name` of its
    /// directory, never over a file that is there (`AlreadyExists`). On failure the partial
    /// file is removed.
    pub fn publish(&self, partial: Made, final_name: &str) -> io::Result<Made> {
        let renamed = open_dir(&partial.dir).and_then(|dir| rename_new(&partial, &dir, final_name));
        match renamed {
            Ok(()) => Ok(Made {
                name: final_name.to_string(),
                ..partial
            }),
            Err(e) => {
                let _ = partial.forget();
                Err(e)
            }
        }
    }

    /// Removes volume `name`'s file (a regular file; a link or anything else is refused):
    /// false when it is gone already.
    pub fn remove_volume(&self, name: &str) -> io::Result<bool> {
        remove_regular(&self.dir, &Self::volume_file(name))
    }

    /// The snapshots directory: a real directory of this process's user, made (0700) when
    /// `make` and missing; None when missing and not made.
    fn snapshots_dir(&self, make: bool) -> io::Result<Option<(PathBuf, OwnedFd)>> {
        let dir = open_dir(&self.dir)?;
        let st = match rustix::fs::statat(&dir, SNAPSHOTS_DIR, AtFlags::SYMLINK_NOFOLLOW) {
            Err(rustix::io::Errno::NOENT) if !make => return Ok(None),
            Err(rustix::io::Errno::NOENT) => {
                match rustix::fs::mkdirat(&dir, SNAPSHOTS_DIR, Mode::from_raw_mode(0o700)) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                rustix::fs::statat(&dir, SNAPSHOTS_DIR, AtFlags::SYMLINK_NOFOLLOW)?
            }
            other => other?,
        };
        let path = self.dir.join(SNAPSHOTS_DIR);
        let real = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
        if !real || st.st_uid != rustix::process::geteuid().as_raw() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: not a directory of this daemon's user (a link, or another's): \
                     snapshots are kept only in a directory the daemon owns",
                    path.display()
                ),
            ));
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&dir, SNAPSHOTS_DIR, flags, Mode::empty())?;
        Ok(Some((path, fd)))
    }

    /// A new, empty partial file for snapshot `snap` of `volume`, in the snapshots directory
    /// (made if missing); published under [`DirPool::snapshot_file`].
    pub fn begin_snapshot(&self, volume: &str, snap: &str) -> io::Result<(File, Made)> {
        let Some((path, dir)) = self.snapshots_dir(true)? else {
            unreachable!("made when missing")
        };
        create_new(
            &path,
            &dir,
            &partial_name(&Self::snapshot_file(volume, snap)),
        )
    }

    /// Snapshot `snap` of `volume`, to read.
    pub fn open_snapshot(&self, volume: &str, snap: &str) -> io::Result<File> {
        let Some((_, dir)) = self.snapshots_dir(false)? else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no snapshot {volume}@{snap}"),
            ));
        };
        open_regular(&dir, &Self::snapshot_file(volume, snap), false)
    }

    /// When snapshot `snap` of `volume` was taken: its file's modification time, which the
    /// copy that made it set last (a snapshot is never written after).
    pub fn snapshot_time(&self, volume: &str, snap: &str) -> io::Result<std::time::SystemTime> {
        self.open_snapshot(volume, snap)?.metadata()?.modified()
    }

    /// Removes snapshot `snap` of `volume`: false when it is gone already.
    pub fn remove_snapshot(&self, volume: &str, snap: &str) -> io::Result<bool> {
        if self.snapshots_dir(false)?.is_none() {
            return Ok(false);
        }
        remove_regular(
            &self.dir.join(SNAPSHOTS_DIR),
            &Self::snapshot_file(volume, snap),
        )
    }

    /// Puts snapshot `snap`'s data back into volume `name`'s file, in place (the volume's
    /// store keeps its file open). A crash in the middle would leave part of each, so an
    /// intent (`.NAME.img.rollback`: the snapshot and the volume's size) is made durable
    /// first and removed once the volume is: [`DirPool::recover`] finishes an interrupted one
    /// at the next start. A volume grown since the snapshot keeps its size (the blocks past
    /// the snapshot read as zeros).
    pub fn restore(
        &self,
        name: &str,
        snap: &str,
        progress: crate::clone::Progress<'_>,
    ) -> io::Result<crate::clone::CloneMethod> {
        let size = self.open_volume(name, false)?.metadata()?.len();
        let intent = format!(".{}.rollback", Self::volume_file(name));
        let dir = open_dir(&self.dir)?;
        {
            let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW;
            let fd = rustix::fs::openat(&dir, intent.as_str(), flags, Mode::from_raw_mode(0o600))?;
            let file = File::from(fd);
            std::io::Write::write_all(&mut &file, format!("{snap}\n{size}\n").as_bytes())?;
            file.sync_all()?;
            rustix::fs::fsync(&dir)?;
        }
        let method = self.copy_back(name, snap, size, progress)?;
        remove_regular(&self.dir, &intent)?;
        Ok(method)
    }

    /// The copy of [`DirPool::restore`]: the snapshot's data over the volume's, `size` kept.
    fn copy_back(
        &self,
        name: &str,
        snap: &str,
        size: u64,
        progress: crate::clone::Progress<'_>,
    ) -> io::Result<crate::clone::CloneMethod> {
        let from = self.open_snapshot(name, snap)?;
        let to = self.open_volume(name, true)?;
        let method = crate::clone::clone_into(&from, &to, progress)?;
        if to.metadata()?.len() < size {
            to.set_len(size)?;
        }
        to.sync_all()?;
        Ok(method)
    }

    /// What a crash interrupted, put right at start, before any verb or device uses the pool:
    /// a rollback is finished from its intent, partial copies are removed. One line each, for
    /// the log.
    pub fn recover(&self, committed: &dyn Fn(&str) -> bool) -> io::Result<Vec<String>> {
        let mut done = self.recover_new(committed)?;
        for entry in std::fs::read_dir(&self.dir)? {
            let file_name = entry?.file_name();
            let Some(marker) = file_name.to_str() else {
                continue;
            };
            let Some(volume) = marker
                .strip_prefix('.')
                .and_then(|m| m.strip_suffix(".img.rollback"))
            else {
                continue;
            };
            let text = std::fs::read_to_string(self.dir.join(marker))?;
            let mut lines = text.lines();
            let (Some(snap), Some(size)) =
                (lines.next(), lines.next().and_then(|s| s.parse().ok()))
            else {
                done.push(format!(
                    "{marker}: not an intent this daemon wrote; left alone"
                ));
                continue;
            };
            self.copy_back(volume, snap, size, &mut |_, _| {})?;
            remove_regular(&self.dir, marker)?;
            done.push(format!(
                "rollback of {volume} to {snap}, interrupted by a crash, finished"
            ));
        }
        for path in self.sweep_partials()? {
            done.push(format!(
                "removed {}, left by a verb a crash interrupted",
                path.display()
            ));
        }
        Ok(done)
    }

    /// The volumes made by verbs a crash interrupted before their commit (an intent left):
    /// each file removed if it is the one the intent names and `committed(volume)` (the config
    /// holds it) is false; the intent removed. One line each.
    fn recover_new(&self, committed: &dyn Fn(&str) -> bool) -> io::Result<Vec<String>> {
        let mut done = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let file_name = entry?.file_name();
            let Some(intent) = file_name.to_str() else {
                continue;
            };
            let Some(volume) = intent
                .strip_prefix('.')
                .and_then(|m| m.strip_suffix(".img.new"))
            else {
                continue;
            };
            let text = std::fs::read_to_string(self.dir.join(intent))?;
            let mut numbers = text.split_whitespace().map(str::parse::<u64>);
            let named = match (numbers.next(), numbers.next()) {
                (Some(Ok(dev)), Some(Ok(ino))) => Some((dev, ino)),
                _ => None,
            };
            let file = Self::volume_file(volume);
            let dir = open_dir(&self.dir)?;
            let same = match rustix::fs::statat(&dir, file.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => named == Some((st.st_dev, st.st_ino)),
                Err(rustix::io::Errno::NOENT) => false,
                Err(e) => return Err(e.into()),
            };
            if same && !committed(volume) {
                remove_regular(&self.dir, &file)?;
                done.push(format!(
                    "removed volume {volume}'s file, made by a verb a crash interrupted before \
                     its commit"
                ));
            }
            remove_regular(&self.dir, intent)?;
        }
        Ok(done)
    }

    /// Removes the partial files a verb interrupted by a crash left (in the pool and its
    /// snapshots directory): run at start, before any verb, when none can be in progress.
    /// Returns their paths.
    pub fn sweep_partials(&self) -> io::Result<Vec<PathBuf>> {
        let mut swept = Vec::new();
        let mut dirs = vec![self.dir.clone()];
        if let Some((path, _)) = self.snapshots_dir(false)? {
            dirs.push(path);
        }
        for dir in dirs {
            for entry in std::fs::read_dir(&dir)? {
                let entry = entry?;
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                let partial = name.starts_with('.') && name.ends_with(".partial");
                if partial && remove_regular(&dir, name)? {
                    swept.push(dir.join(name));
                }
            }
        }
        Ok(swept)
    }

    /// The snapshots of the pool (of `volume` only, when given), sorted: (volume, snapshot).
    /// Only regular files count: links, directories and partial files are not snapshots.
    pub fn snapshots(&self, volume: Option<&str>) -> io::Result<Vec<(String, String)>> {
        let Some((path, _)) = self.snapshots_dir(false)? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&path)? {
            let entry = entry?;
            // The entry's own type: a link is a link here, not what it points to.
            if !entry.file_type()?.is_file() {
                continue;
            }
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".img")) else {
                continue;
            };
            let Some((vol, snap)) = stem.split_once('@') else {
                continue;
            };
            if !vol.starts_with('.') && volume.is_none_or(|v| v == vol) {
                out.push((vol.to_string(), snap.to_string()));
            }
        }
        out.sort();
        Ok(out)
    }
}

/// Renames `partial` to `final_name` in its directory `dir`, never over an entry, durably.
fn rename_new(partial: &Made, dir: &OwnedFd, final_name: &str) -> io::Result<()> {
    let name = partial.name.as_str();
    rustix::fs::renameat_with(dir, name, dir, final_name, RenameFlags::NOREPLACE).map_err(|e| {
        match e {
            rustix::io::Errno::EXIST => io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{}: there already", partial.dir.join(final_name).display()),
            ),
            e => e.into(),
        }
    })?;
    Ok(rustix::fs::fsync(dir)?)
}

/// Unlinks regular file `name` of `dir` (never a link or a directory): false when missing.
fn remove_regular(dir: &Path, name: &str) -> io::Result<bool> {
    let fd = open_dir(dir)?;
    let st = match rustix::fs::statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{}: not a regular file; not removed",
                dir.join(name).display()
            ),
        ));
    }
    rustix::fs::unlinkat(&fd, name, AtFlags::empty())?;
    rustix::fs::fsync(&fd)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(tag: &str) -> DirPool {
        let dir =
            std::env::temp_dir().join(format!("ferrosan-dirpool-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        DirPool::new(dir)
    }

    #[test]
    fn a_directorys_usage_is_its_filesystems() {
        let dir = std::env::temp_dir();
        let (total, free) = DirPool::new(dir.clone()).usage().unwrap();
        assert!(total > 0 && free <= total, "{total} {free}");
        let missing = DirPool::new(dir.join("ferrosan-no-such-pool-dir"));
        assert_eq!(missing.usage().unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_volume_is_created_exclusively_and_removed_only_while_it_is_ours() {
        let p = pool("excl");
        std::fs::write(p.volume_path("taken"), b"SECRET-TENANT-A-DATA").unwrap();
        let e = p.create_volume("taken", 1 << 20).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(
            std::fs::read(p.volume_path("taken")).unwrap(),
            b"SECRET-TENANT-A-DATA"
        );
        let made = p.create_volume("new", 1 << 20).unwrap();
        assert_eq!(std::fs::metadata(made.path()).unwrap().len(), 1 << 20);
        // Another file put in its place meanwhile is not ours to remove.
        std::fs::remove_file(made.path()).unwrap();
        std::fs::write(p.volume_path("new"), b"another's").unwrap();
        assert!(!made.forget().unwrap());
        assert_eq!(std::fs::read(p.volume_path("new")).unwrap(), b"another's");
        let made = p.create_volume("mine", 4096).unwrap();
        assert!(made.forget().unwrap());
        assert!(!p.volume_path("mine").exists());
        let _ = std::fs::remove_dir_all(p.dir());
    }

    #[test]
    fn links_are_never_followed_out_of_a_pool() {
        let p = pool("links");
        let outside = p.dir().with_extension("outside");
        std::fs::write(&outside, b"root-only").unwrap();
        std::os::unix::fs::symlink(&outside, p.volume_path("link")).unwrap();
        let e = p.open_volume("link", false).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(
            p.remove_volume("link").is_err(),
            "a link is not a volume file"
        );
        // A snapshot that is a link is neither listed nor opened.
        std::fs::create_dir(p.dir().join(SNAPSHOTS_DIR)).unwrap();
        std::os::unix::fs::symlink(&outside, p.snapshot_path("v", "s")).unwrap();
        assert!(p.snapshots(None).unwrap().is_empty());
        assert!(p.open_snapshot("v", "s").is_err());
        // A `.snapshots` that is a link is refused whole.
        std::fs::remove_dir_all(p.dir().join(SNAPSHOTS_DIR)).unwrap();
        let elsewhere = p.dir().with_extension("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, p.dir().join(SNAPSHOTS_DIR)).unwrap();
        let e = p.begin_snapshot("v", "s").unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
        assert!(p.snapshots(None).is_err());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(p.dir());
        let _ = std::fs::remove_dir_all(&elsewhere);
        let _ = std::fs::remove_file(&outside);
    }

    #[test]
    fn a_partial_file_becomes_a_snapshot_only_when_published_and_never_over_one() {
        let p = pool("partial");
        let (file, made) = p.begin_snapshot("v", "s").unwrap();
        std::io::Write::write_all(&mut &file, b"data").unwrap();
        assert!(
            p.snapshots(None).unwrap().is_empty(),
            "a partial is no snapshot"
        );
        let kept = p.publish(made, &DirPool::snapshot_file("v", "s")).unwrap();
        assert_eq!(p.snapshots(None).unwrap(), [("v".into(), "s".into())]);
        assert_eq!(kept.path(), p.snapshot_path("v", "s"));
        let (_, again) = p.begin_snapshot("v", "s").unwrap();
        let e = p.publish(again, &DirPool::snapshot_file("v", "s"));
        assert_eq!(e.unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        // A rollback interrupted by a crash (its intent there, the volume half copied) is
        // finished by the next start's recovery.
        let made = p.create_volume("v", 8).unwrap();
        std::fs::write(made.path(), b"new data").unwrap();
        let (snapshot, partial) = p.begin_snapshot("v", "old").unwrap();
        std::io::Write::write_all(&mut &snapshot, b"old").unwrap();
        drop(
            p.publish(partial, &DirPool::snapshot_file("v", "old"))
                .unwrap(),
        );
        p.restore("v", "old", &mut |_, _| {}).unwrap();
        assert_eq!(std::fs::read(made.path()).unwrap(), b"old\0\0\0\0\0");
        std::fs::write(made.path(), b"torn").unwrap();
        std::fs::write(p.dir().join(".v.img.rollback"), "old\n8\n").unwrap();
        let recovered = p.recover(&|_| true).unwrap();
        assert_eq!(recovered.len(), 1, "{recovered:?}");
        assert_eq!(std::fs::read(made.path()).unwrap(), b"old\0\0\0\0\0");
        assert!(!p.dir().join(".v.img.rollback").exists());
        assert!(p.recover(&|_| true).unwrap().is_empty());
        p.remove_snapshot("v", "old").unwrap();
        // A crash leaves partial files; the start sweeps them, and only them.
        let (_, left) = p.begin_volume("w").unwrap();
        let (_, left_snapshot) = p.begin_snapshot("v", "t").unwrap();
        let swept = p.sweep_partials().unwrap();
        assert_eq!(swept, [left.path(), left_snapshot.path()]);
        assert_eq!(p.snapshots(None).unwrap(), [("v".into(), "s".into())]);
        let mut data = String::new();
        std::io::Read::read_to_string(&mut p.open_snapshot("v", "s").unwrap(), &mut data).unwrap();
        assert_eq!(data, "data");
        assert!(p.remove_snapshot("v", "s").unwrap());
        assert!(!p.remove_snapshot("v", "s").unwrap());
        let _ = std::fs::remove_dir_all(p.dir());
    }

    /// A volume made and never committed (a crash between the two) is removed at the next
    /// start unless the config holds it; a file the intent does not name is left alone.
    #[test]
    fn a_volume_a_crash_left_uncommitted_goes_at_the_start() {
        let p = pool("uncommitted");
        p.make_dir().unwrap();
        let crashed = |p: &DirPool, name: &str| {
            let made = p.create_volume(name, 4096).unwrap();
            assert!(p.dir().join(format!(".{name}.img.new")).exists());
            // The verb is gone: neither committed nor forgotten.
            std::mem::forget(made);
        };
        crashed(&p, "lost");
        crashed(&p, "saved");
        let recovered = p.recover(&|v| v == "saved").unwrap();
        assert_eq!(recovered.len(), 1, "{recovered:?}");
        assert!(
            !p.volume_path("lost").exists(),
            "the uncommitted volume stayed"
        );
        assert!(p.volume_path("saved").exists(), "the config's volume went");
        // Someone's file where an intent names another inode: left alone.
        crashed(&p, "theirs");
        std::fs::remove_file(p.volume_path("theirs")).unwrap();
        std::fs::write(p.volume_path("theirs"), b"not ours").unwrap();
        assert!(p.recover(&|_| false).unwrap().is_empty());
        assert_eq!(std::fs::read(p.volume_path("theirs")).unwrap(), b"not ours");
        // Committed: the intent goes at once, and the start keeps the file.
        p.create_volume("kept", 4096).unwrap().committed();
        assert!(!p.dir().join(".kept.img.new").exists());
        assert!(p.recover(&|_| false).unwrap().is_empty());
        assert!(p.volume_path("kept").exists());
        let _ = std::fs::remove_dir_all(p.dir());
    }
}
