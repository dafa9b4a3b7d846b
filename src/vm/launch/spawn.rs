//! What crosses the launch seam to a process-starting service (the
//! daemon's spawner process): the request, its jail and limits, the
//! service's errors and exit statuses, and the traits the service and its
//! children implement. `harden::spawner` implements [`SpawnService`] and
//! sends [`SpawnRequest`] as it is serialized here (its wire format), so
//! `vm` never names the spawner.

use serde::{Deserialize, Serialize};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// A process to start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpawnRequest {
    /// `argv[0]` is the absolute path of the program (no PATH lookup).
    pub argv: Vec<String>,
    /// The whole environment (nothing is inherited).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    #[serde(default)]
    pub cwd: Option<String>,
    pub uid: u32,
    pub gid: u32,
    /// Network namespace to enter (e.g. `/run/netns/asbx-...`).
    #[serde(default)]
    pub netns: Option<String>,
    /// cgroup directories to start in, one per hierarchy (v2 and v1 alike:
    /// the child writes itself into each one's `cgroup.procs`).
    #[serde(default)]
    pub cgroups: Vec<String>,
    /// Where the passed fds go in the child, in the order they are passed.
    /// 0, 1, 2 not listed are /dev/null; everything else is closed.
    #[serde(default)]
    pub fds: Vec<i32>,
    /// `setsid()`: own session and process group, so a kill of the group
    /// takes every process the program starts.
    #[serde(default)]
    pub new_process_group: bool,
    /// Resource limits set (soft = hard) before exec.
    #[serde(default)]
    pub limits: ProcLimits,
    /// Start it in namespaces of its own with a minimal root.
    #[serde(default)]
    pub jail: Option<Jail>,
}

/// What a jailed program gets, as the Firecracker jailer gives Firecracker:
/// new mount, pid and IPC namespaces, a new empty network namespace
/// (unless `netns` names one to enter), and as its root a read-only tmpfs
/// holding only `binds`, each at its host path (so its argv needs no
/// rewriting), and optionally a procfs of its own pid namespace.
///
/// Binds give no access the program's uid would not have on the host
/// (permissions still apply); they only decide what it can name at all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Jail {
    /// An existing directory the new root is mounted on (in the child's
    /// own mount namespace only; on the host it stays an empty directory).
    pub root: String,
    /// Host files and directories visible inside, in mount order.
    pub binds: Vec<Bind>,
    /// `/proc` with only the jail's own processes (`subset=pid`).
    #[serde(default)]
    pub proc: bool,
}

/// One host path made visible inside a [`Jail`] at the same path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bind {
    pub path: String,
    /// Read-write (then also noexec); read-only otherwise.
    #[serde(default)]
    pub writable: bool,
}

/// Resource limits of a started program. Lowering a limit needs no
/// privilege, so the spawner applies whatever it is asked (up to the hard
/// limits it has itself).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcLimits {
    /// `RLIMIT_FSIZE`: the largest file it may write, bytes.
    #[serde(default)]
    pub fsize: Option<u64>,
    /// `RLIMIT_NOFILE`: open files.
    #[serde(default)]
    pub nofile: Option<u64>,
}

impl ProcLimits {
    /// In a forked child before exec (async-signal-safe: setrlimit only).
    /// Returns false with errno set on failure.
    ///
    /// # Safety
    /// Plain syscalls; meant for a child between fork and exec.
    pub unsafe fn apply(&self) -> bool {
        for (res, v) in [
            (libc::RLIMIT_FSIZE, self.fsize),
            (libc::RLIMIT_NOFILE, self.nofile),
        ] {
            if let Some(v) = v {
                let l = libc::rlimit {
                    rlim_cur: v,
                    rlim_max: v,
                };
                if libc::setrlimit(res, &l) != 0 {
                    return false;
                }
            }
        }
        true
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The spawner process is gone; no process can be started any more.
    #[error("the spawner process died ({0}); VMs cannot be started until the daemon restarts")]
    Died(String),
    #[error("spawner refused or failed: {0}")]
    Failed(String),
    #[error("spawner: {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("spawner did not answer within {0:?}")]
    Timeout(Duration),
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// A process-starting service (the daemon's spawner): every
/// `SpawnService` is a [`Launcher`](super::Launcher) and a
/// [`Spawner`](super::Spawner).
pub trait SpawnService: Send + Sync {
    type Child: SpawnedChild + 'static;
    /// Start a process. `fds[i]` becomes fd `req.fds[i]` in the child.
    fn spawn(&self, req: &SpawnRequest, fds: &[BorrowedFd<'_>]) -> Result<Self::Child, SpawnError>;
    /// The uid/gid a short-lived tool `prog` runs as.
    fn tool_identity(&self, prog: &str) -> (u32, u32);
}

/// A process a [`SpawnService`] started (and reaps).
pub trait SpawnedChild: Send {
    fn pid(&self) -> i32;
    /// A pidfd for the process, valid however long the process lives.
    fn pidfd(&self) -> BorrowedFd<'_>;
    /// Signal it (its whole group if it was started in one).
    fn kill(&self, signal: i32) -> Result<(), SpawnError>;
    /// Its exit status once known.
    fn try_status(&self) -> Result<Option<ExitStatus>, SpawnError>;
    /// Wait for the exit status until `deadline`; `Ok(None)` on timeout.
    fn wait_until(&self, deadline: Instant) -> Result<Option<ExitStatus>, SpawnError>;
}

/// A pipe (read end, write end), both close-on-exec.
pub(super) fn cloexec_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0; 2];
    // SAFETY: pipe2 writes two fds into our array.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: new fds owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) })
}

/// Read two pipes to EOF (each capped at 64 KiB) or until `deadline`.
pub(super) fn read_both(out: OwnedFd, err: OwnedFd, deadline: Instant) -> (Vec<u8>, Vec<u8>) {
    const CAP: usize = 64 * 1024;
    let mut files = [
        Some(std::fs::File::from(out)),
        Some(std::fs::File::from(err)),
    ];
    let mut bufs = [Vec::new(), Vec::new()];
    while files.iter().any(Option::is_some) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let mut p: Vec<libc::pollfd> = files
            .iter()
            .map(|f| libc::pollfd {
                fd: f.as_ref().map_or(-1, |f| f.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: valid pollfd array (negative fds are ignored).
        let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
        if r < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        for i in 0..2 {
            if p[i].revents == 0 {
                continue;
            }
            let mut chunk = [0u8; 4096];
            let done = match files[i].as_mut().map(|f| f.read(&mut chunk)) {
                Some(Ok(0)) | Some(Err(_)) | None => true,
                Some(Ok(n)) => {
                    if bufs[i].len() < CAP {
                        bufs[i].extend_from_slice(&chunk[..n.min(CAP - bufs[i].len())]);
                    }
                    false
                }
            };
            if done {
                files[i] = None;
            }
        }
    }
    let [a, b] = bufs;
    (a, b)
}
