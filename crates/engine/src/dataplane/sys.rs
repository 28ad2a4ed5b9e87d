//! The system calls the engine needs that no maintained crate offers safely: for
//! [`crate::dataplane::coalesce`], the receive low-water mark (`rustix`, `socket2` and `nix` all lack
//! `SO_RCVLOWAT`); for [`crate::dataplane::alarm`], a timerfd registered with tokio's reactor
//! (`AsyncFd::register` is `unsafe` since tokio 1.5x); for [`crate::io::stall`], the thread's voluntary context switches
//! (`getrusage(RUSAGE_THREAD)`, not in `rustix` 1.x); for the heap trim after connections
//! parked, glibc's `malloc_trim`. The only `unsafe` of the crate.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A non-blocking monotonic timerfd watched by the current tokio runtime (microsecond
/// resolution; tokio's own timers tick in milliseconds). Must be called inside a runtime.
pub fn microsecond_timer() -> io::Result<AsyncFd<OwnedFd>> {
    let fd = timerfd_create(
        TimerfdClockId::Monotonic,
        TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
    )?;
    // SAFETY: the AsyncFd owns the OwnedFd, which keeps the descriptor open, unchanged and
    // returned by every as_raw_fd() call until the AsyncFd is dropped.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(io::Error::from)
}

/// Sets `SO_RCVLOWAT`: the socket reports readable (and wakes its reader) only once `bytes`
/// are queued. Linux clamps the value to half the receive buffer.
pub fn set_receive_low_water(socket: impl AsFd, bytes: usize) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: the descriptor is borrowed (open for the call), and the option value is a live
    // c_int whose exact size is passed, as setsockopt(2) requires for SO_RCVLOWAT.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&value).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// How many times the calling thread has slept in the kernel (blocked on a lock, I/O, a wait):
/// its voluntary context switches. Preemption is not counted (those are involuntary), so a
/// stretch during which this does not change ran or waited for a CPU, but never blocked.
/// Returns 0 if the kernel refuses, which only makes every stretch look unblocked.
pub fn voluntary_context_switches() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage(2) writes a whole rusage into the pointer it is given, which points to
    // a live, correctly sized and aligned rusage; RUSAGE_THREAD is valid on Linux >= 2.6.26.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: zero-initialised, then filled by the successful call above; all-zero is a valid
    // rusage (plain integers) in any case.
    let usage = unsafe { usage.assume_init() };
    u64::try_from(usage.ru_nvcsw).unwrap_or(0)
}

/// Gives the pages of the heap that hold no live allocation back to the kernel (glibc's
/// `malloc_trim(0)`, every arena); true if any was. Elsewhere than glibc, nothing.
pub fn trim_heap() -> bool {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: malloc_trim takes no pointer; it only releases memory glibc's allocator owns
        // and no allocation holds, under the arenas' own locks.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    /// Whether `socket` reports readable within `ms` milliseconds.
    fn readable(socket: &TcpStream, ms: i64) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(socket, PollFlags::IN)];
        let timeout = Timespec {
            tv_sec: ms / 1000,
            tv_nsec: ms % 1000 * 1_000_000,
        };
        poll(&mut fds, Some(&timeout)).unwrap() == 1
    }

    #[test]
    fn a_socket_is_not_readable_below_the_low_water_mark() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        set_receive_low_water(&server, 100).unwrap();
        client.write_all(&[1; 60]).unwrap();
        assert!(!readable(&server, 100), "readable with 60 of 100 bytes");
        client.write_all(&[2; 40]).unwrap();
        assert!(
            readable(&server, 5000),
            "not readable with 100 of 100 bytes"
        );
        let mut buf = [0u8; 256];
        let mut got = 0;
        while got < 100 {
            got += server.read(&mut buf[got..]).unwrap();
        }
        assert_eq!(&buf[..60], &[1; 60]);
        assert_eq!(&buf[60..100], &[2; 40]);
        // Back to the default: one byte makes it readable.
        set_receive_low_water(&server, 1).unwrap();
        client.write_all(&[3]).unwrap();
        assert!(readable(&server, 5000));
        assert_eq!(server.read(&mut buf).unwrap(), 1);
    }

    #[test]
    fn sleeping_counts_as_a_voluntary_switch_and_spinning_does_not() {
        let before = voluntary_context_switches();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let after_sleep = voluntary_context_switches();
        assert!(after_sleep > before, "a sleep is a voluntary switch");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(2) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        std::hint::black_box(x);
        // A busy loop never blocks (it may be preempted, which is not voluntary).
        assert_eq!(voluntary_context_switches(), after_sleep);
    }

    #[test]
    fn a_trim_after_freeing_leaves_the_heap_usable() {
        let freed: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; 64 << 10]).collect();
        drop(freed);
        super::trim_heap();
        let after = vec![7u8; 1 << 20];
        assert!(after.iter().all(|&b| b == 7));
    }
}
