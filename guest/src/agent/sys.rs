//! Thin, checked wrappers over the few raw syscalls the agent needs.

use crate::proto::{ResourceUsage, UsageSource};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

pub fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Adds the failing call's name to an OS error, so logs say which syscall.
pub fn ctx(err: io::Error, what: &str) -> io::Error {
    io::Error::new(err.kind(), format!("{what}: {err}"))
}

/// Wakes a thread blocked in `poll` (eventfd). Cheap to signal repeatedly:
/// the counter coalesces wake-ups.
pub struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub fn new() -> io::Result<Waker> {
        // SAFETY: eventfd has no memory-safety preconditions.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
            .map_err(|e| ctx(e, "eventfd"))?;
        Ok(Waker {
            // SAFETY: fd is the fresh descriptor eventfd returned; nothing
            // else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64. A full counter (EAGAIN)
        // already means "wake", so the result is irrelevant.
        unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                &one as *const u64 as *const libc::c_void,
                8,
            )
        };
    }

    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN when not signalled.
        unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                &mut v as *mut u64 as *mut libc::c_void,
                8,
            )
        };
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A pipe with both ends close-on-exec. The child's ends become its stdio
/// through dup2 in the spawn path, which clears the flag on the copies.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid 2-element array.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }).map_err(|e| ctx(e, "pipe2"))?;
    // SAFETY: both descriptors are fresh and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    let flags = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags) }).map(|_| ())
}

/// Bigger pipe buffers mean fewer, larger reads on the streaming path.
/// Best effort: the limit in /proc/sys/fs/pipe-max-size may refuse it.
pub fn grow_pipe(fd: RawFd, size: usize) {
    // SAFETY: fcntl on a descriptor the caller owns.
    unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, size as libc::c_int) };
}

/// read(2) that maps EAGAIN to `Ok(None)`.
pub fn read_nb(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is valid for buf.len() bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// write(2) that maps EAGAIN to `Ok(None)`.
pub fn write_nb(fd: RawFd, buf: &[u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is valid for buf.len() bytes.
        let n = unsafe { libc::write(fd, buf.as_ptr() as *const libc::c_void, buf.len()) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// poll(2) over `fds`; `None` waits forever. EINTR counts as "nothing ready".
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = match timeout {
        None => -1,
        // Round up: a 0.4 ms wait must not become a busy poll.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    };
    // SAFETY: fds is a valid slice of pollfd.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(0);
        }
        return Err(ctx(e, "poll"));
    }
    Ok(n as usize)
}

/// Sends `sig` to the process group led by `pgid`. ESRCH (already gone) is fine.
pub fn kill_group(pgid: i32, sig: i32) -> io::Result<()> {
    if pgid <= 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to signal pgid <= 1",
        ));
    }
    // SAFETY: kill has no memory-safety preconditions.
    let r = unsafe { libc::kill(-pgid, sig) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            return Err(ctx(e, "kill"));
        }
    }
    Ok(())
}

pub fn cstring(s: &str, what: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Makes sure fds 0, 1 and 2 are open, so a descriptor we create later never
/// lands on a stdio number (dup2 onto itself would keep CLOEXEC set).
pub fn ensure_stdio() {
    for fd in 0..3 {
        // SAFETY: F_GETFD probes a descriptor number.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            // SAFETY: path is a valid NUL-terminated string.
            unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
        }
    }
}

/// Sends `sig` to the process behind `pidfd` (no pid-reuse race). ESRCH
/// (already exited) is fine.
pub fn pidfd_signal(pidfd: RawFd, sig: i32) -> io::Result<()> {
    // SAFETY: plain syscall with integer arguments (no siginfo).
    let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd, sig, 0usize, 0u32) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            return Err(ctx(e, "pidfd_send_signal"));
        }
    }
    Ok(())
}

/// A pollable handle on a child process (Linux 5.3+). `None` if the
/// kernel lacks pidfds or the child is already gone; callers then wait for
/// the reaper instead.
pub fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fresh descriptor we own.
    Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Reaps the child behind `pidfd` if it has exited: `Ok(Some((raw wait
/// status, its rusage)))`, `Ok(None)` while it runs, an error if someone
/// else reaped it. `__WALL`: children started without an exit signal (see
/// spawn.rs) are "clone" children to waitid and are found only with it.
/// The raw syscall, not glibc's waitid: only the syscall's fifth argument
/// returns the child's rusage.
pub fn reap_pidfd(pidfd: RawFd) -> io::Result<Option<(i32, ResourceUsage)>> {
    const P_PIDFD: libc::idtype_t = 3;
    // SAFETY: siginfo_t is plain data (all-zero is valid), filled by the kernel.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as `info`: rusage is plain data.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointers for the kernel's waitid(which, id,
    // infop, options, rusage).
    let r = unsafe {
        libc::syscall(
            libc::SYS_waitid,
            P_PIDFD,
            pidfd as libc::id_t,
            &mut info as *mut libc::siginfo_t,
            libc::WEXITED | libc::WNOHANG | libc::__WALL,
            &mut ru as *mut libc::rusage,
        )
    };
    if r < 0 {
        // Bare: ECHILD (another reaper won) is routine, and its callers
        // only ask whether it failed, so no context string is formatted.
        return Err(io::Error::last_os_error());
    }
    // SAFETY: si_pid/si_status are valid for SIGCHLD siginfo.
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return Ok(None);
    }
    // Rebuild a classic wait status so one decoder serves both paths.
    let raw = match info.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => status & 0x7f,
    };
    Ok(Some((raw, rusage_usage(&ru))))
}

/// A reaped child's rusage as [`ResourceUsage`]: the child's own and
/// that of the descendants it reaped (the kernel folds those in).
pub fn rusage_usage(ru: &libc::rusage) -> ResourceUsage {
    let us = |t: libc::timeval| t.tv_sec.max(0) as u64 * 1_000_000 + t.tv_usec.max(0) as u64;
    ResourceUsage {
        // ru_maxrss is in KiB.
        memory_peak_bytes: ru.ru_maxrss.max(0) as u64 * 1024,
        cpu_usec: us(ru.ru_utime) + us(ru.ru_stime),
        source: UsageSource::Rusage,
    }
}
