//! Copies that the filesystem makes, not ferrosan: a whole file cloned (FICLONE: a reflink on
//! XFS and btrfs, no data copied), or a range copied inside the kernel (copy_file_range:
//! XFS and btrfs share the extents when the range is block-aligned, other filesystems copy
//! without the data crossing into this process). Where neither works the caller is told, and
//! copies itself.

use std::fs::File;
use std::io;

/// How a file was cloned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloneMethod {
    /// Sharing the source's extents (reflink): instant, no space used until either changes.
    Reflink,
    /// Copying the data (holes kept): the filesystem cannot share extents.
    Copy,
}

impl CloneMethod {
    pub fn name(self) -> &'static str {
        match self {
            CloneMethod::Reflink => "reflink",
            CloneMethod::Copy => "copy",
        }
    }
}

/// Told how far a copy has come: (bytes of the file passed, its length), after each piece of
/// at most [`PROGRESS_STEP`] bytes. A reflink tells nothing: it is done at once.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// The most a copy moves between two reports of its progress.
pub const PROGRESS_STEP: u64 = 256 << 20;

/// Makes `to` share `from`'s extents (a reflink) and durable: false, `to` untouched, where
/// the filesystem cannot.
pub fn reflink(from: &File, to: &File) -> io::Result<bool> {
    match rustix::fs::ioctl_ficlone(to, from) {
        Ok(()) => to.sync_all().map(|()| true),
        Err(e) if cannot_share(e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Replaces the whole content of `to` with `from`'s (a reflink, else a sparse copy whose
/// progress `progress` is told), and makes it durable.
pub fn clone_into(from: &File, to: &File, progress: Progress<'_>) -> io::Result<CloneMethod> {
    match rustix::fs::ioctl_ficlone(to, from) {
        Ok(()) => return Ok(CloneMethod::Reflink),
        Err(e) if cannot_share(e) => {}
        Err(e) => return Err(e.into()),
    }
    let len = from.metadata()?.len();
    to.set_len(0)?;
    to.set_len(len)?;
    copy_sparse(from, to, len, progress)?;
    to.sync_data()?;
    Ok(CloneMethod::Copy)
}

/// The answers that mean "this filesystem (or this pair of files) cannot share extents".
fn cannot_share(e: rustix::io::Errno) -> bool {
    use rustix::io::Errno;
    [
        Errno::OPNOTSUPP,
        Errno::XDEV,
        Errno::INVAL,
        Errno::NOTTY,
        Errno::BADF,
    ]
    .contains(&e)
}

/// Copies the data extents of `from` (SEEK_DATA / SEEK_HOLE) into `to` at the same offsets, in
/// pieces of at most [`PROGRESS_STEP`] bytes, `progress` told after each.
fn copy_sparse(from: &File, to: &File, len: u64, progress: Progress<'_>) -> io::Result<()> {
    use rustix::fs::{seek, SeekFrom};
    let mut at = 0u64;
    while at < len {
        let data = match seek(from, SeekFrom::Data(at)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break, // only a hole is left
            Err(e) => return Err(e.into()),
        };
        let hole = seek(from, SeekFrom::Hole(data))
            .map_err(io::Error::from)?
            .min(len);
        let mut piece = data;
        while piece < hole {
            let n = (hole - piece).min(PROGRESS_STEP);
            copy_range(from, piece, to, piece, n)?;
            piece += n;
            progress(piece, len);
        }
        at = hole;
    }
    progress(len, len);
    Ok(())
}

/// Copies `len` bytes from `from` at `src_off` to `to` at `dst_off` inside the kernel. Errors
/// with `Unsupported` where the kernel cannot (a block device, two filesystems on an old
/// kernel): the caller copies through memory then.
pub fn copy_range(from: &File, src_off: u64, to: &File, dst_off: u64, len: u64) -> io::Result<()> {
    let (mut src, mut dst, mut left) = (src_off, dst_off, len);
    while left > 0 {
        let chunk = usize::try_from(left.min(1 << 30)).unwrap_or(1 << 30);
        match rustix::fs::copy_file_range(from, Some(&mut src), to, Some(&mut dst), chunk) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => left -= n as u64,
            Err(e) if cannot_share(e) || e == rustix::io::Errno::NOSYS => {
                return Err(io::Error::new(io::ErrorKind::Unsupported, e))
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_clone_reads_as_its_source_holes_and_all() {
        let dir = std::env::temp_dir().join(format!("ferrosan-clone-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, dst) = (dir.join("src.img"), dir.join("dst.img"));
        let f = File::create(&src).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[7u8; 4096], 1 << 20).unwrap();
        f.write_all_at(&[9u8; 4096], (8 << 20) - 4096).unwrap();
        let to = File::create(&dst).unwrap();
        let mut told = Vec::new();
        let method = clone_into(&File::open(&src).unwrap(), &to, &mut |done, len| {
            told.push((done, len))
        })
        .unwrap();
        let (a, b) = (std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        assert!(a == b, "the clone ({method:?}) differs from its source");
        // A copy tells its progress, forward only, ending at the whole file; a reflink is done
        // at once and tells nothing.
        match method {
            CloneMethod::Copy => {
                assert_eq!(told.last(), Some(&(8 << 20, 8 << 20)), "{told:?}");
                assert!(told.windows(2).all(|w| w[0].0 <= w[1].0), "{told:?}");
            }
            CloneMethod::Reflink => assert!(told.is_empty(), "{told:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_range_is_copied_inside_the_kernel() {
        let dir = std::env::temp_dir().join(format!("ferrosan-range-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let open = |name: &str| {
            let mut o = std::fs::OpenOptions::new();
            o.create(true).read(true).write(true).truncate(false);
            o.open(dir.join(name)).unwrap()
        };
        let from = open("a");
        from.write_all_at(&[3u8; 65536], 0).unwrap();
        let to = open("b");
        to.set_len(1 << 20).unwrap();
        copy_range(&from, 4096, &to, 8192, 16384).unwrap();
        let mut got = vec![0u8; 16384 + 8192];
        to.read_exact_at(&mut got, 0).unwrap();
        assert!(got[..8192].iter().all(|b| *b == 0));
        assert!(got[8192..].iter().all(|b| *b == 3));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
