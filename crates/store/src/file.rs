//! File and block-device store: positional I/O (pread/pwrite) on one shared descriptor, so
//! workers never seek and never take a lock. In [`Caching::Direct`] mode reads and writes go
//! around the page cache (O_DIRECT, through an aligned bounce buffer when called here; an
//! asynchronous engine submits to [`BlockStore::direct_io`]'s descriptor itself); the other
//! operations (hole punching, zeroing, extent maps) keep the ordinary descriptor, and the
//! kernel keeps the two coherent (a direct read writes back, a direct write invalidates, the
//! cached pages of its range).

use crate::aligned::AlignedBuf;
use crate::{check_range, BlockStore, DirectIo, Extent, FileRange};
use rustix::fs::{FallocateFlags, SeekFrom};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Size of the zero buffer used when zeroes must be written out (thick stores, no fallocate).
const ZERO_BUFFER_BYTES: u64 = 1 << 20;

pub struct FileStore {
    /// Shared with the transport while it sends page-cached ranges ([`FileRange`]).
    file: Arc<File>,
    /// Grows with [`BlockStore::resize`]; never shrinks.
    size_bytes: AtomicU64,
    thin: bool,
    block_device: bool,
    /// Cleared once the filesystem answers that it cannot do non-blocking reads (RWF_NOWAIT);
    /// reads then always wait.
    nowait_reads: AtomicBool,
    /// Cleared once the filesystem answers that it cannot do non-blocking buffered writes
    /// (RWF_NOWAIT: XFS can, ext4 and tmpfs cannot, measured on Linux 6.18; btrfs untested).
    nowait_writes: AtomicBool,
    /// Cleared once the kernel answers that it has no `cachestat` (before 6.5) or forbids it:
    /// reads are then always copied.
    cachestat: AtomicBool,
    /// The file lives in memory (tmpfs, ramfs): nothing it does waits for a device.
    in_memory: bool,
    /// The O_DIRECT descriptor in [`Caching::Direct`] mode.
    direct: Option<DirectIo>,
    /// A block device whose discarded blocks read as zeros in whole units of this many bytes
    /// (an LVM thin LV: dm-thin unmaps whole chunks, and unmapped chunks read as zeros). Its
    /// deallocation discards those chunks instead of writing zeros over them, which would
    /// allocate them in the thin pool.
    discard_zeroes: Option<u64>,
}

/// How a file store's reads and writes reach the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caching {
    /// Through the page cache: cached reads are served from memory, writes are absorbed there.
    Page,
    /// Around it (O_DIRECT): every read and write reaches the device.
    Direct,
}

/// The alignment O_DIRECT needs for offsets and lengths on `file`: what `statx` reports
/// (STATX_DIOALIGN, Linux 6.1+), else a block device's logical block size, else a page (safe
/// for every device).
fn direct_alignment(file: &File, block_device: bool) -> u32 {
    use rustix::fs::{AtFlags, StatxFlags};
    if let Ok(st) = rustix::fs::statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
        if st.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && st.stx_dio_offset_align != 0 {
            return st.stx_dio_offset_align;
        }
    }
    if block_device {
        if let Ok(n) = rustix::fs::ioctl_blksszget(file) {
            if n.is_power_of_two() {
                return n;
            }
        }
    }
    crate::aligned::DIRECT_ALIGN_BYTES as u32
}

/// Opens `path` again with O_DIRECT. A filesystem without direct I/O (tmpfs) refuses with
/// EINVAL: reported as `Unsupported`, so a caller can choose the page cache instead. Not
/// O_EXCL: the store's other descriptor, opened first, holds a block device's claim.
fn open_direct(path: &Path, block_device: bool) -> io::Result<DirectIo> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "{}: the filesystem does not support direct I/O",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })?;
    let alignment = direct_alignment(&file, block_device);
    Ok(DirectIo {
        file: Arc::new(file),
        alignment,
    })
}

/// Whether `file` lives on a filesystem held in memory (tmpfs, ramfs). A filesystem that cannot
/// be inspected counts as a disk: the safe side (durable operations then leave the workers).
fn in_memory_filesystem(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    match rustix::fs::fstatfs(file) {
        #[allow(clippy::unnecessary_cast)] // f_type's width differs between platforms
        Ok(st) => matches!(st.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC),
        Err(_) => false,
    }
}

/// An existing medium whose size is not the one configured: exporting it either way could
/// cut off or invent blocks an initiator holds, so the caller is told what to do instead.
fn size_mismatch(what: &str, has: u64, want: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{what} has {has} bytes but {want} are configured: nothing was changed; remove \
             `size` to export it as it is, set `size = {has}`, or grow it first \
             (truncate -s, or `ferrosan ctl resize` on the running daemon)"
        ),
    )
}

/// What opening a file or block device would do, found without changing anything
/// ([`FileStore::inspect`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inspection {
    /// A missing regular file, created sparse with this size (its directory is writable).
    Create(u64),
    /// An existing file or block device of this size, readable and writable.
    Open { size_bytes: u64, block_device: bool },
}

impl FileStore {
    /// The checks [`FileStore::open_with`] makes before it opens `path` for writing: the
    /// file exists or may be created with `create_size`, it is a regular file or a block
    /// device of that size, and this process may read and write it (or create it). Nothing
    /// is created or changed: `check-config --deep` asks the same questions the start does.
    pub fn inspect(path: impl AsRef<Path>, create_size: Option<u64>) -> io::Result<Inspection> {
        let path = path.as_ref();
        let meta = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let Some(size) = create_size else {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("{}: missing and no size given to create it", path.display()),
                    ));
                };
                let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
                let dir = dir.unwrap_or(Path::new("."));
                rustix::fs::access(
                    dir,
                    rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
                )
                .map_err(|e| {
                    io::Error::new(
                        io::Error::from(e).kind(),
                        format!(
                            "{}: cannot create it in {}: {e}",
                            path.display(),
                            dir.display()
                        ),
                    )
                })?;
                return Ok(Inspection::Create(size));
            }
            Err(e) => return Err(e),
        };
        let block_device = meta.file_type().is_block_device();
        if !block_device && !meta.file_type().is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: neither a regular file nor a block device",
                    path.display()
                ),
            ));
        }
        // Read-only: the size of a device needs an open descriptor, and nothing is written.
        let file = File::open(path)?;
        rustix::fs::access(
            path,
            rustix::fs::Access::READ_OK | rustix::fs::Access::WRITE_OK,
        )?;
        let size_bytes = if block_device {
            rustix::fs::seek(&file, SeekFrom::End(0))?
        } else {
            meta.len()
        };
        match create_size {
            Some(want) if want != size_bytes => Err(size_mismatch(
                if block_device {
                    "the device"
                } else {
                    "the file"
                },
                size_bytes,
                want,
            )),
            _ => Ok(Inspection::Open {
                size_bytes,
                block_device,
            }),
        }
    }

    /// Opens `path` (a regular file or a block device). A missing regular file is created sparse
    /// with `create_size`; an existing file or device must have exactly that size. Without
    /// `create_size` the store is as large as the file or device.
    pub fn open(path: impl AsRef<Path>, create_size: Option<u64>, thin: bool) -> io::Result<Self> {
        Self::open_with(path, create_size, thin, Caching::Page)
    }

    /// Like [`FileStore::open`], with the given caching. Direct mode fails with `Unsupported`
    /// where the filesystem has no direct I/O (tmpfs).
    pub fn open_with(
        path: impl AsRef<Path>,
        create_size: Option<u64>,
        thin: bool,
        caching: Caching,
    ) -> io::Result<Self> {
        let path = path.as_ref();
        // Every refusal is inspect's (check-config --deep asks the same).
        let plan = Self::inspect(path, create_size)?;
        let exists = !matches!(plan, Inspection::Create(_));
        let file = match plan {
            // Claimed: nothing else writes a served disk (crate::claim).
            Inspection::Open {
                block_device: true, ..
            } => crate::claim::open_claimed(path)?,
            // A LUN file this call creates is the initiators' data: no one else's to read,
            // whatever the umask (0644 outside the service unit).
            _ => {
                use std::os::unix::fs::OpenOptionsExt as _;
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(!exists)
                    .mode(0o600)
                    .open(path)?;
                Arc::new(file)
            }
        };
        let (size_bytes, block_device) = match plan {
            // Only a file this call created is sized here; an existing one must already have
            // the size asked for (never grown or cut short without being told).
            Inspection::Create(size) => {
                file.set_len(size)?; // sparse
                (size, false)
            }
            Inspection::Open {
                size_bytes,
                block_device,
            } => (size_bytes, block_device),
        };
        debug_assert_eq!(block_device, file.metadata()?.file_type().is_block_device());
        let in_memory = !block_device && in_memory_filesystem(&file);
        let direct = match caching {
            Caching::Page => None,
            Caching::Direct => Some(open_direct(path, block_device)?),
        };
        let discard_zeroes = if block_device {
            thin_lv_chunk(&file.metadata()?)
        } else {
            None
        };
        Ok(FileStore {
            direct,
            discard_zeroes,
            in_memory,
            file,
            size_bytes: AtomicU64::new(size_bytes),
            thin,
            block_device,
            nowait_reads: AtomicBool::new(true),
            nowait_writes: AtomicBool::new(true),
            cachestat: AtomicBool::new(true),
        })
    }

    /// Deallocates `[offset, offset + len)` of a thin LV: its whole `chunk`s discarded (they
    /// read as zeros after), the partial chunks at either end written with zeros. False when
    /// the device refuses discards (a thin pool with `ignore_discard`): nothing was changed.
    fn discard_chunks(&self, chunk: u64, offset: u64, len: u64) -> io::Result<bool> {
        let end = offset + len;
        let first = offset.div_ceil(chunk) * chunk;
        let last = end / chunk * chunk;
        if first >= last {
            self.write_zero_bytes(offset, len)?;
            return Ok(true);
        }
        match crate::sys::discard(&self.file, first, last - first) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(false),
            Err(e) => return Err(e),
        }
        self.write_zero_bytes(offset, first - offset)?;
        self.write_zero_bytes(last, end - last)?;
        Ok(true)
    }

    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// Reads `buf.len()` bytes at `offset` around the page cache: the aligned range around it
    /// lands in a bounce buffer, then the asked-for bytes are copied out.
    fn read_direct(&self, direct: &DirectIo, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let align = u64::from(direct.alignment);
        let start = offset / align * align;
        let end = (offset + buf.len() as u64).next_multiple_of(align);
        let span = usize::try_from(end - start).map_err(|_| io::ErrorKind::InvalidInput)?;
        let mut bounce = AlignedBuf::zeroed(span).ok_or(io::ErrorKind::OutOfMemory)?;
        direct.file.read_exact_at(&mut bounce, start)?;
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&bounce[skip..skip + buf.len()]);
        Ok(())
    }

    /// Writes `buf` at `offset` around the page cache; `durable` adds RWF_DSYNC (the device's
    /// cache is flushed or the write is FUA). The range must be aligned: a read-modify-write
    /// here could tear a concurrent write, so LUs whose blocks are smaller than the alignment
    /// are refused at configuration instead.
    fn write_direct(
        &self,
        direct: &DirectIo,
        buf: &[u8],
        offset: u64,
        durable: bool,
    ) -> io::Result<()> {
        use rustix::io::{Errno, ReadWriteFlags};
        let align = u64::from(direct.alignment);
        if !offset.is_multiple_of(align) || !(buf.len() as u64).is_multiple_of(align) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("direct write {offset}+{} not aligned to {align}", buf.len()),
            ));
        }
        let mut bounce = AlignedBuf::zeroed(buf.len()).ok_or(io::ErrorKind::OutOfMemory)?;
        bounce.copy_from_slice(buf);
        let flags = if durable {
            ReadWriteFlags::DSYNC
        } else {
            ReadWriteFlags::empty()
        };
        let mut done = 0;
        while done < bounce.len() {
            let slice = [io::IoSlice::new(&bounce[done..])];
            match rustix::io::pwritev2(&*direct.file, &slice, offset + done as u64, flags) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn write_zero_bytes(&self, offset: u64, len: u64) -> io::Result<()> {
        let zeros = vec![0u8; len.min(ZERO_BUFFER_BYTES) as usize];
        let mut done = 0u64;
        while done < len {
            let piece = (len - done).min(ZERO_BUFFER_BYTES) as usize;
            self.file.write_all_at(&zeros[..piece], offset + done)?;
            done += piece as u64;
        }
        Ok(())
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        if let Some(chunk) = self.discard_zeroes {
            if self.discard_chunks(chunk, offset, len)? {
                return Ok(());
            }
        }
        let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(&self.file, flags, offset, len) {
            Ok(()) => Ok(()),
            // Filesystems and devices without hole punching still owe zeros on read-back
            // (some drivers answer EINVAL rather than EOPNOTSUPP).
            Err(
                rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS | rustix::io::Errno::INVAL,
            ) => self.write_zero_bytes(offset, len),
            Err(e) => Err(e.into()),
        }
    }
}

impl BlockStore for FileStore {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// A file grows (sparse) to `new_bytes`; a block device grows to `new_bytes` if the
    /// device is that large now (it was grown underneath). Shrinking is refused: it would cut
    /// off blocks an initiator may hold data in.
    fn medium_bytes(&self) -> io::Result<Option<u64>> {
        if self.block_device {
            Ok(Some(rustix::fs::seek(&*self.file, SeekFrom::End(0))?))
        } else {
            Ok(Some(self.file.metadata()?.len()))
        }
    }

    /// A file's filesystem, measured as `df` does; a block device allocates nothing.
    fn space(&self) -> io::Result<Option<crate::Space>> {
        if self.block_device {
            return Ok(None);
        }
        Ok(Some(statfs_space(&rustix::fs::fstatfs(&*self.file)?)))
    }

    fn resize(&self, new_bytes: u64) -> io::Result<()> {
        let now = self.size_bytes();
        if new_bytes < now {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("shrinking from {now} to {new_bytes} bytes is refused"),
            ));
        }
        if self.block_device {
            let device_bytes = self.medium_bytes()?.unwrap_or(0);
            if new_bytes > device_bytes {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("the device has {device_bytes} bytes, {new_bytes} requested"),
                ));
            }
        } else if self.file.metadata()?.len() < new_bytes {
            self.file.set_len(new_bytes)?;
        }
        self.size_bytes.store(new_bytes, Ordering::Release);
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        match &self.direct {
            Some(direct) => self.read_direct(direct, buf, offset),
            None => self.file.read_exact_at(buf, offset),
        }
    }

    fn direct_io(&self) -> Option<DirectIo> {
        self.direct.clone()
    }

    /// `cachestat` first: only a range whose every page is cached is lent, so a transport's
    /// `sendfile` does not wait for the device (unless the pages are evicted in between).
    fn cached_file_range(&self, offset: u64, len: u64) -> io::Result<Option<FileRange>> {
        check_range(self.size_bytes(), offset, len)?;
        let Ok(len_bytes) = usize::try_from(len) else {
            return Ok(None);
        };
        if len == 0 || self.direct.is_some() || !self.cachestat.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match crate::sys::cached_pages(&self.file, offset, len) {
            Ok(cached) => {
                let page = rustix::param::page_size() as u64;
                let pages = (offset + len).div_ceil(page) - offset / page;
                Ok((cached >= pages).then(|| (Arc::clone(&self.file), offset, len_bytes)))
            }
            Err(e) => {
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOSYS | libc::EPERM | libc::EOPNOTSUPP | libc::EINVAL)
                ) {
                    self.cachestat.store(false, Ordering::Relaxed);
                }
                // Not knowing is not a read error: the read copies instead.
                Ok(None)
            }
        }
    }

    /// preadv2(RWF_NOWAIT): copies what the page cache holds and reports instead of waiting for
    /// the device, so a network worker can serve cached reads itself (a hand-off to a thread
    /// costs ~10 µs here) and send only real device reads elsewhere.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        use rustix::io::{Errno, ReadWriteFlags};
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        if self.direct.is_some() {
            // Every direct read waits for the device.
            return Ok(false);
        }
        let mut done = 0;
        while done < buf.len() && self.nowait_reads.load(Ordering::Relaxed) {
            let mut slice = [io::IoSliceMut::new(&mut buf[done..])];
            let at = offset + done as u64;
            match rustix::io::preadv2(&self.file, &mut slice, at, ReadWriteFlags::NOWAIT) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(Errno::AGAIN) => return Ok(false),
                Err(Errno::INTR) => {}
                Err(Errno::OPNOTSUPP | Errno::NOSYS) => {
                    self.nowait_reads.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e.into()),
            }
        }
        if done < buf.len() {
            self.file
                .read_exact_at(&mut buf[done..], offset + done as u64)?;
        }
        Ok(true)
    }

    fn write_at(&self, buf: &[u8], offset: u64, durable: bool) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        if let Some(direct) = &self.direct {
            return self.write_direct(direct, buf, offset, durable);
        }
        self.file.write_all_at(buf, offset)?;
        if durable {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// pwritev2(RWF_NOWAIT) where the filesystem supports it, so a network worker never sleeps
    /// in a buffered write: the kernel answers EAGAIN instead (see `try_read_at`).
    fn try_write_at(&self, buf: &[u8], offset: u64) -> io::Result<bool> {
        use rustix::io::{Errno, ReadWriteFlags};
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        if self.direct.is_some() {
            // Every direct write waits for the device.
            return Ok(false);
        }
        let mut done = 0;
        while done < buf.len() && self.nowait_writes.load(Ordering::Relaxed) {
            let slice = [io::IoSlice::new(&buf[done..])];
            let at = offset + done as u64;
            match rustix::io::pwritev2(&*self.file, &slice, at, ReadWriteFlags::NOWAIT) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(Errno::AGAIN) => return Ok(false),
                Err(Errno::INTR) => {}
                Err(Errno::OPNOTSUPP | Errno::NOSYS) => {
                    self.nowait_writes.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e.into()),
            }
        }
        if done < buf.len() {
            self.file.write_all_at(&buf[done..], offset + done as u64)?;
        }
        Ok(true)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn copy_file(&self) -> Option<&File> {
        (!self.block_device).then_some(&*self.file)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.thin {
            self.punch(offset, len)
        } else {
            // A thick store keeps its allocation: discard only has to read back as zeros.
            self.write_zero_bytes(offset, len)
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64, deallocate: bool) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if deallocate && self.thin {
            return self.punch(offset, len);
        }
        if !self.block_device {
            let flags = FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE;
            if rustix::fs::fallocate(&self.file, flags, offset, len).is_ok() {
                return Ok(());
            }
        }
        self.write_zero_bytes(offset, len)
    }

    fn mapping(&self, offset: u64) -> io::Result<Extent> {
        let to_end = crate::bytes_to_end(self.size_bytes(), offset)?;
        if self.block_device {
            return Ok(Extent {
                mapped: true,
                len: to_end,
            });
        }
        // lseek moves the shared file position, which nothing else uses (all I/O is positional).
        let data = match rustix::fs::seek(&self.file, SeekFrom::Data(offset)) {
            Ok(pos) => pos,
            Err(rustix::io::Errno::NXIO) => {
                return Ok(Extent {
                    mapped: false,
                    len: to_end,
                })
            }
            // No SEEK_DATA support: everything counts as mapped.
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::OPNOTSUPP) => {
                return Ok(Extent {
                    mapped: true,
                    len: to_end,
                })
            }
            Err(e) => return Err(e.into()),
        };
        if data > offset {
            let len = (data - offset).min(to_end);
            return Ok(Extent { mapped: false, len });
        }
        let hole = rustix::fs::seek(&self.file, SeekFrom::Hole(offset))?;
        let len = hole.saturating_sub(offset).clamp(1, to_end);
        Ok(Extent { mapped: true, len })
    }

    fn is_thin(&self) -> bool {
        self.thin
    }

    fn capabilities(&self) -> crate::Capabilities {
        crate::Capabilities {
            waits_for_device: !self.in_memory,
            lends_memory: false,
            lends_file_ranges: self.direct.is_none(),
            page_cache: self.direct.is_none(),
            direct: self.direct.is_some(),
            asynchronous: false,
            thin: self.thin,
        }
    }
}

/// The chunk size of an LVM thin LV (its discard granularity), None for any other block
/// device. An LVM thin LV is a device-mapper device whose UUID LVM made (`LVM-…`) on top of a
/// thin pool's device (UUID `LVM-…-tpool`): discarding its whole chunks unmaps them, and
/// unmapped chunks read as zeros. Other devices promise nothing of discarded blocks.
fn thin_lv_chunk(meta: &std::fs::Metadata) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let rdev = meta.rdev();
    let dev = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        rustix::fs::major(rdev),
        rustix::fs::minor(rdev)
    ));
    let read = |p: PathBuf| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    if !read(dev.join("dm/uuid"))?.starts_with("LVM-") {
        return None;
    }
    let mut below = std::fs::read_dir(dev.join("slaves")).ok()?.peekable();
    below.peek()?;
    let on_thin_pool = below.all(|s| {
        s.ok()
            .and_then(|s| read(s.path().join("dm/uuid")))
            .is_some_and(|u| u.starts_with("LVM-") && u.ends_with("-tpool"))
    });
    let chunk: u64 = read(dev.join("queue/discard_granularity"))?.parse().ok()?;
    (on_thin_pool && chunk >= 512 && chunk.is_power_of_two()).then_some(chunk)
}

/// A filesystem's space from its statfs counts (blocks of `unit` bytes): what is in use is what
/// is not free, and the space is what is in use plus what an unprivileged writer may still
/// take (as `df` counts it). The blocks reserved for root are neither: counting them as in
/// use made a filesystem with a large reservation look nearly full while it was nearly empty.
/// The space of the filesystem `path` is on, measured as a file device's (`df`'s way): one
/// `statfs` for every file device in one directory.
pub fn path_space(path: &std::path::Path) -> io::Result<crate::Space> {
    Ok(statfs_space(&rustix::fs::statfs(path)?))
}

fn statfs_space(st: &rustix::fs::StatFs) -> crate::Space {
    #[allow(clippy::unnecessary_cast)] // the fields' widths differ between platforms
    filesystem_space(
        st.f_blocks as u64,
        st.f_bfree as u64,
        st.f_bavail as u64,
        st.f_frsize as u64,
    )
}

fn filesystem_space(blocks: u64, free: u64, available: u64, unit: u64) -> crate::Space {
    let used = blocks.saturating_sub(free);
    crate::Space {
        total_bytes: used.saturating_add(available).saturating_mul(unit),
        used_bytes: used.saturating_mul(unit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_filesystem_is_as_full_as_df_says() {
        // The numbers of a 252 GiB filesystem with most of its free blocks reserved: 12 % in
        // use (df rounds up to 13 %; counting the reserve as used said 68 %).
        let space = filesystem_space(66_053_021, 63_163_859, 20_932_310, 4096);
        assert_eq!(space.used_percent(), 12);
        assert_eq!(space.used_bytes, (66_053_021 - 63_163_859) * 4096);
        // Nothing reserved: in use is what is not free.
        let plain = filesystem_space(1000, 50, 50, 512);
        assert_eq!(
            (plain.total_bytes, plain.used_bytes),
            (1000 * 512, 950 * 512)
        );
        assert_eq!(plain.used_percent(), 95);
        // Full to the reserve: every byte a writer may take is taken.
        assert_eq!(filesystem_space(1000, 30, 0, 512).used_percent(), 100);
        assert_eq!(space.used_per_mille(), 121);
        // An exabyte space neither overflows nor reads empty.
        let huge = crate::Space {
            total_bytes: u64::MAX,
            used_bytes: u64::MAX / 2,
        };
        assert_eq!((huge.used_percent(), huge.used_per_mille()), (49, 499));
        let empty = crate::Space {
            total_bytes: 0,
            used_bytes: 0,
        };
        assert_eq!((empty.used_percent(), empty.used_per_mille()), (0, 0));
    }

    #[test]
    fn a_directory_is_as_full_as_a_file_in_it() {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("ferrosan-space-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let _cleanup = TempPath(path.clone());
        let file = std::fs::File::open(&path).unwrap();
        let of_file = statfs_space(&rustix::fs::fstatfs(&file).unwrap());
        let of_dir = path_space(&dir).unwrap();
        // The same filesystem, moments apart: about the same size and use.
        let near = |a: u64, b: u64| a.abs_diff(b) <= of_dir.total_bytes / 100;
        assert!(of_dir.total_bytes > 0);
        assert!(
            near(of_file.total_bytes, of_dir.total_bytes),
            "{of_file:?} {of_dir:?}"
        );
        assert!(
            near(of_file.used_bytes, of_dir.used_bytes),
            "{of_file:?} {of_dir:?}"
        );
    }

    struct TempPath(PathBuf);
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    fn temp_path() -> TempPath {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("ferrosan-store-test-{}-{n}", std::process::id());
        let p = std::env::temp_dir().join(name);
        let _ = std::fs::remove_file(&p);
        TempPath(p)
    }

    const MIB: u64 = 1 << 20;

    /// The store, not the engine, says whether it waits for a device: a file on tmpfs does
    /// not, a file on a disk does, RAM never.
    #[test]
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between platforms
    fn only_files_on_disks_wait_for_a_device() {
        assert!(!crate::RamStore::new(MIB).capabilities().waits_for_device);
        if rustix::fs::statfs("/dev/shm").is_ok_and(|st| st.f_type as i64 == 0x0102_1994) {
            let path = format!("/dev/shm/ferrosan-store-caps-{}", std::process::id());
            let s = FileStore::open(&path, Some(MIB), true).unwrap();
            let _ = std::fs::remove_file(&path);
            assert!(!s.capabilities().waits_for_device, "tmpfs is memory");
        }
        // /var/tmp is on the root filesystem here (a real disk), never tmpfs by convention.
        let path = format!("/var/tmp/ferrosan-store-caps-{}", std::process::id());
        let s = FileStore::open(&path, Some(MIB), false).unwrap();
        let _ = std::fs::remove_file(&path);
        let on_tmpfs =
            rustix::fs::statfs("/var/tmp").is_ok_and(|st| st.f_type as i64 == 0x0102_1994);
        assert_eq!(s.capabilities().waits_for_device, !on_tmpfs);
        assert!(!s.capabilities().thin);
        assert!(s.capabilities().page_cache);
    }

    #[test]
    fn non_blocking_writes_land_whole() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(1 << 20), true).unwrap();
        let data: Vec<u8> = (0..200_000).map(|i| (i % 249) as u8).collect();
        // RWF_NOWAIT where the filesystem has it (XFS), else a plain write: either way
        // nothing here waits for long, so the write is accepted whole.
        assert!(s.try_write_at(&data, 4096).unwrap());
        let mut back = vec![0u8; data.len()];
        s.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, data);
        assert!(s.try_write_at(&data, 1 << 20).is_err(), "beyond the end");
    }

    #[test]
    fn only_fully_cached_ranges_are_lent() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(4 << 20), true).unwrap();
        let data: Vec<u8> = (0..256 * 1024).map(|i| (i % 251) as u8).collect();
        s.write_at(&data, 4096, false).unwrap();
        assert!(s.cached_file_range(0, 5 << 20).is_err(), "beyond the end");
        let Some((file, offset, len)) = s.cached_file_range(4096 + 512, 100_000).unwrap() else {
            // Only kernels before 6.5 (no cachestat) lend nothing; the read then copies.
            assert!(!s.cachestat.load(Ordering::Relaxed));
            return;
        };
        assert_eq!((offset, len), (4096 + 512, 100_000));
        let mut back = vec![0u8; len];
        file.read_exact_at(&mut back, offset).unwrap();
        assert_eq!(back, data[512..512 + 100_000]);
        // A never-written hole has no cached page; neither has a range that reaches into one.
        assert!(s.cached_file_range(2 << 20, 64 * 1024).unwrap().is_none());
        assert!(s.cached_file_range(4096, 300 * 1024).unwrap().is_none());
        assert!(s.cached_file_range(4096, 0).unwrap().is_none());
    }

    #[test]
    fn missing_file_without_size_is_an_error() {
        let p = temp_path();
        assert!(FileStore::open(&p.0, None, true).is_err());
    }

    #[test]
    fn create_sparse_round_trip_and_reopen() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(8 * MIB), true).unwrap();
        assert_eq!(s.size_bytes(), 8 * MIB);
        assert!(!s.is_block_device());
        let mut buf = vec![1u8; 4096];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        s.write_at(&data, MIB - 4096, true).unwrap();
        s.flush().unwrap();
        drop(s);
        let s = FileStore::open(&p.0, None, true).unwrap();
        assert_eq!(s.size_bytes(), 8 * MIB);
        let mut back = vec![0u8; 8192];
        s.read_at(&mut back, MIB - 4096).unwrap();
        assert_eq!(back, data);
        // The same size again is fine; any other is refused and the file is left as it was.
        drop(s);
        assert_eq!(
            FileStore::open(&p.0, Some(8 * MIB), true)
                .unwrap()
                .size_bytes(),
            8 * MIB
        );
        for other in [16 * MIB, 4 * MIB] {
            let e = FileStore::open(&p.0, Some(other), true).err().unwrap();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            let said = e.to_string();
            assert!(
                said.contains("8388608") && said.contains("nothing was changed"),
                "{said}"
            );
            assert_eq!(std::fs::metadata(&p.0).unwrap().len(), 8 * MIB);
        }
        // Grown underneath: the medium shows it, the store keeps its size until resized.
        let s = FileStore::open(&p.0, None, true).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&p.0)
            .unwrap()
            .set_len(12 * MIB)
            .unwrap();
        assert_eq!(s.medium_bytes().unwrap(), Some(12 * MIB));
        assert_eq!(s.size_bytes(), 8 * MIB);
        s.resize(12 * MIB).unwrap();
        assert_eq!(s.size_bytes(), 12 * MIB);
    }

    #[test]
    fn nonblocking_reads_copy_cached_data_and_decline_uncached() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(4 * MIB), true).unwrap();
        let data: Vec<u8> = (0..MIB as u32).map(|i| (i % 253) as u8).collect();
        s.write_at(&data, MIB, true).unwrap();
        let mut back = vec![0u8; MIB as usize];
        assert!(
            s.try_read_at(&mut back, MIB).unwrap(),
            "just written: cached"
        );
        assert_eq!(back, data);
        assert!(s.try_read_at(&mut back, 4 * MIB - 1).is_err());
        // Drop the (clean, synced) pages from the cache: a disk filesystem must now decline.
        let fs = rustix::fs::fstatfs(&s.file).unwrap();
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        let tmpfs = fs.f_type as i64 == TMPFS_MAGIC;
        let pages = MIB / rustix::param::page_size() as u64;
        // DONTNEED is advice (a page in another CPU's LRU batch survives a round): repeat until
        // cachestat sees a page gone, where it can tell (6.5+).
        for _ in 0..50 {
            rustix::fs::fadvise(&s.file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            match crate::sys::cached_pages(&s.file, MIB, MIB) {
                Ok(cached) if cached >= pages && !tmpfs => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                _ => break,
            }
        }
        if tmpfs {
            // tmpfs pages are the data itself: never uncached.
            assert!(s.try_read_at(&mut back, MIB).unwrap());
        } else {
            let mut partial = vec![0u8; MIB as usize];
            assert!(
                !s.try_read_at(&mut partial, MIB).unwrap(),
                "uncached: declined"
            );
        }
        // The blocking read still gets it, and afterwards it is cached again.
        s.read_at(&mut back, MIB).unwrap();
        assert_eq!(back, data);
        assert!(s.try_read_at(&mut back, MIB).unwrap());
    }

    #[test]
    fn out_of_range_is_an_error() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(MIB), true).unwrap();
        let mut buf = [0u8; 512];
        assert!(s.read_at(&mut buf, MIB - 511).is_err());
        assert!(s.write_at(&buf, u64::MAX, false).is_err());
        assert!(s.discard(MIB, 1).is_err());
        assert!(s.write_zeroes(u64::MAX - 1, 4, true).is_err());
        assert!(s.mapping(MIB).is_err());
        s.read_at(&mut [], MIB).unwrap();
    }

    #[test]
    fn short_file_reads_are_errors_not_panics() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(MIB), true).unwrap();
        // Someone truncates the file under us.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p.0)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let mut buf = vec![0u8; 8192];
        assert!(s.read_at(&mut buf, 0).is_err());
    }

    #[test]
    fn punch_reads_zero_and_shows_in_extents() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(4 * MIB), true).unwrap();
        assert!(s.is_thin());
        assert!(!s.mapping(0).unwrap().mapped);
        s.write_at(&vec![0xEEu8; (4 * MIB) as usize], 0, false)
            .unwrap();
        s.flush().unwrap();
        let e = s.mapping(0).unwrap();
        assert!(e.mapped);
        assert_eq!(e.len, 4 * MIB);
        s.discard(MIB, MIB).unwrap();
        let mut buf = vec![1u8; (4 * MIB) as usize];
        s.read_at(&mut buf, 0).unwrap();
        let (a, rest) = buf.split_at(MIB as usize);
        let (hole, tail) = rest.split_at(MIB as usize);
        assert!(a.iter().all(|&b| b == 0xEE));
        assert!(hole.iter().all(|&b| b == 0));
        assert!(tail.iter().all(|&b| b == 0xEE));
        // tmpfs, ext4, xfs and btrfs all report the punched hole at 4 KiB granularity.
        assert_eq!(
            s.mapping(0).unwrap(),
            Extent {
                mapped: true,
                len: MIB
            }
        );
        assert_eq!(
            s.mapping(MIB).unwrap(),
            Extent {
                mapped: false,
                len: MIB
            }
        );
        assert_eq!(
            s.mapping(MIB + 4096).unwrap(),
            Extent {
                mapped: false,
                len: MIB - 4096
            }
        );
        assert_eq!(
            s.mapping(2 * MIB).unwrap(),
            Extent {
                mapped: true,
                len: 2 * MIB
            }
        );
        s.write_zeroes(2 * MIB, MIB, true).unwrap();
        assert_eq!(
            s.mapping(MIB).unwrap(),
            Extent {
                mapped: false,
                len: 2 * MIB
            }
        );
        s.write_zeroes(0, 4096, false).unwrap();
        let mut first = vec![1u8; 4096];
        s.read_at(&mut first, 0).unwrap();
        assert!(first.iter().all(|&b| b == 0));
    }

    #[test]
    fn thick_discard_zeroes_without_punching() {
        let p = temp_path();
        let s = FileStore::open(&p.0, Some(2 * MIB), false).unwrap();
        assert!(!s.is_thin());
        s.write_at(&vec![3u8; (2 * MIB) as usize], 0, true).unwrap();
        s.discard(0, MIB).unwrap();
        let mut buf = vec![1u8; MIB as usize];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(
            s.mapping(0).unwrap(),
            Extent {
                mapped: true,
                len: 2 * MIB
            }
        );
    }

    #[test]
    fn concurrent_writers_on_different_ranges() {
        let p = temp_path();
        let s = Arc::new(FileStore::open(&p.0, Some(2 * MIB), true).unwrap());
        let handles: Vec<_> = (0..2u8)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..64u64 {
                        s.write_at(&[t + 1; 4096], t as u64 * MIB + i * 4096, false)
                            .unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut buf = vec![0u8; 64 * 4096];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 1));
        s.read_at(&mut buf, MIB).unwrap();
        assert!(buf.iter().all(|&b| b == 2));
    }

    /// Where these tests keep files: in the build's target directory (`CARGO_TARGET_DIR` if
    /// absolute, else the workspace's `target`), on the disk the build is on (the temp dir may
    /// be tmpfs, which has no direct I/O), never in the source tree when the build is
    /// elsewhere.
    fn scratch_dir() -> PathBuf {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .filter(|dir| dir.is_absolute())
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"))
            .join("store-tests")
    }

    /// A path on the disk the build lives on.
    fn disk_path(tag: &str) -> TempPath {
        let dir = scratch_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TempPath(p)
    }

    #[test]
    fn direct_mode_reads_what_it_wrote_around_the_page_cache() {
        let p = disk_path("direct");
        let s = match FileStore::open_with(&p.0, Some(4 * MIB), true, Caching::Direct) {
            Ok(s) => s,
            // A workspace on a filesystem without direct I/O: nothing to test here.
            Err(e) if e.kind() == io::ErrorKind::Unsupported => return,
            Err(e) => panic!("{e}"),
        };
        let caps = s.capabilities();
        assert!(caps.direct && !caps.page_cache && !caps.lends_file_ranges);
        let direct = s.direct_io().expect("a direct store gives its descriptor");
        assert!(direct.alignment.is_power_of_two() && direct.alignment <= 4096);
        let block = direct.alignment as usize;
        let data: Vec<u8> = (0..8 * block).map(|i| (i % 251) as u8).collect();
        s.write_at(&data, 3 * block as u64, false).unwrap();
        s.write_at(&data[..block], MIB, true).unwrap();
        let mut back = vec![0u8; data.len()];
        s.read_at(&mut back, 3 * block as u64).unwrap();
        assert_eq!(back, data);
        // Unaligned reads are served from the aligned range around them.
        let mut middle = vec![0u8; 100];
        s.read_at(&mut middle, 3 * block as u64 + 7).unwrap();
        assert_eq!(middle, data[7..107]);
        // Unaligned writes are refused, not torn.
        let err = s.write_at(&[1u8; 100], 7, false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        // A worker never waits on a direct store: it is told to go elsewhere.
        assert!(!s.try_read_at(&mut back, 0).unwrap());
        assert!(!s.try_write_at(&data, 0).unwrap());
        assert!(s.cached_file_range(0, 4096).unwrap().is_none());
        // Operations on the ordinary descriptor stay coherent with direct reads.
        s.write_zeroes(3 * block as u64, block as u64, false)
            .unwrap();
        s.read_at(&mut back[..block], 3 * block as u64).unwrap();
        assert!(back[..block].iter().all(|&b| b == 0));
        s.flush().unwrap();
        // Out of range is refused like in page mode.
        assert!(s.read_at(&mut back, 4 * MIB - 1).is_err());
    }

    #[test]
    fn direct_mode_is_refused_where_the_filesystem_has_none() {
        let dir = PathBuf::from("/dev/shm");
        if !dir.is_dir() {
            return;
        }
        let p = TempPath(dir.join(format!("ferrosan-direct-shm-{}", std::process::id())));
        match FileStore::open_with(&p.0, Some(MIB), true, Caching::Direct) {
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}"),
            // Kernels since 6.6 let tmpfs accept O_DIRECT; then it must work like a disk.
            Ok(s) => {
                s.write_at(&[3u8; 4096], 0, true).unwrap();
                let mut b = [0u8; 4096];
                s.read_at(&mut b, 0).unwrap();
                assert_eq!(b, [3u8; 4096]);
            }
        }
    }

    /// A loop device for the claim tests (None: skipped, the reason printed).
    fn loop_device(tag: &str) -> Option<crate::loopdev::LoopDevice> {
        crate::loopdev::LoopDevice::attach(&scratch_dir(), tag, 8 * MIB)
    }

    /// Opens `path` as another program claiming it would (mkfs, mount, `ferrosan bench
    /// --destructive`, another target): O_EXCL, at once.
    fn claim(path: &Path) -> io::Result<File> {
        crate::loopdev::claim(path, std::time::Duration::ZERO)
    }

    /// [`claim`], once a released claim is free (see `loopdev::claim`).
    fn claim_released(path: &Path) -> io::Result<File> {
        crate::loopdev::claim(path, std::time::Duration::from_secs(5))
    }

    /// A served disk is claimed, so no other program writes it.
    #[test]
    fn a_block_device_is_claimed_while_a_store_of_this_process_has_it() {
        let Some(dev) = loop_device("claimed") else {
            return;
        };
        drop(claim(&dev.device).expect("a free loop device opens exclusively"));
        let store = FileStore::open(&dev.device, None, false).unwrap();
        let busy = claim(&dev.device).err().map(|e| e.raw_os_error());
        assert_eq!(busy, Some(Some(libc::EBUSY)), "another program's claim");
        // The daemon's own second store of the device (a device renamed by a reload, one
        // re-added while its old store still closes, auto caching trying direct I/O)
        // shares the claim instead of locking itself out.
        let again = FileStore::open_with(&dev.device, None, false, Caching::Direct).unwrap();
        drop(store);
        let busy = claim(&dev.device).err().map(|e| e.raw_os_error());
        assert_eq!(busy, Some(Some(libc::EBUSY)), "held while any store has it");
        drop(again);
        drop(claim_released(&dev.device).expect("released with the last store"));
    }

    #[test]
    fn a_block_device_another_program_claimed_is_refused_by_name() {
        let Some(dev) = loop_device("refused") else {
            return;
        };
        let other = claim(&dev.device).unwrap();
        let e = FileStore::open(&dev.device, None, false).err().unwrap();
        let said = e.to_string();
        assert!(
            said.contains(&dev.device.display().to_string())
                && said.contains("in use by another program (EBUSY)"),
            "{said}"
        );
        drop(other);
        drop(claim_released(&dev.device).unwrap());
        FileStore::open(&dev.device, None, false).unwrap();
    }
}
