//! Making the daemon a small target: capabilities, no_new_privs, rlimits,
//! seccomp filters per thread kind, and a separate spawner process for
//! everything that has to exec.
//!
//! Order at daemon start (see `docs/security.md`):
//! 1. [`spawner::Spawner::start`] while the process is still
//!    single-threaded and unfiltered: the spawner keeps what the jailer needs.
//! 2. [`apply`] on the main thread, before any other thread: rlimits,
//!    not-dumpable, capabilities down to [`caps::DAEMON`], no_new_privs, the
//!    baseline seccomp filter, the thread broker.
//! 3. Every thread: [`thread::spawn`] with its kind (or
//!    [`seccomp::install_current`] first thing in its body).

pub mod caps;
pub mod random;
pub mod seccomp;
pub mod spawner;
#[cfg(target_arch = "x86_64")]
mod sysnames_x86_64;
pub mod thread;

use std::io;

pub use seccomp::{install_current, Mode, ThreadKind};

#[derive(Debug, thiserror::Error)]
pub enum HardenError {
    #[error("capabilities: {what}: {msg}")]
    Caps { what: String, msg: String },
    #[error("seccomp: {0}")]
    Seccomp(String),
    #[error("{what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("hardening config: {0}")]
    Config(String),
}

fn sys(what: impl Into<String>) -> HardenError {
    HardenError::Sys {
        what: what.into(),
        source: io::Error::last_os_error(),
    }
}

/// What [`apply`] should do.
#[derive(Debug, Clone)]
pub struct Options {
    /// Capabilities to keep, by purpose.
    pub needs: Vec<caps::Need>,
    pub seccomp: Mode,
    /// RLIMIT_NOFILE soft and hard limit; `None` raises the soft limit to
    /// the hard one. Every session holds a few fds (agent socket, pidfd,
    /// netlink, TAP while opening), every HTTP connection one.
    pub nofile: Option<u64>,
}

impl Options {
    /// The daemon: [`caps::DAEMON`], seccomp mode from
    /// `AGENT_SANDBOX_SECCOMP`.
    pub fn daemon() -> Result<Options, HardenError> {
        Ok(Options {
            needs: caps::DAEMON.to_vec(),
            seccomp: Mode::from_env()?,
            nofile: None,
        })
    }
}

/// What [`apply`] did, for the start-up log.
#[derive(Debug, Clone)]
pub struct Report {
    pub caps: caps::Dropped,
    pub seccomp: Mode,
    pub nofile: u64,
}

fn threads_in_process() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Fail unless the process has exactly one thread: capabilities and
/// filters set now would otherwise miss the threads already running, and a
/// fork would copy locks other threads hold.
pub fn require_single_threaded(what: &str) -> Result<(), HardenError> {
    match threads_in_process() {
        Some(1) => Ok(()),
        Some(n) => Err(HardenError::Config(format!(
            "{what} must run while the process has one thread; it has {n}"
        ))),
        None => Err(HardenError::Config(format!(
            "{what}: cannot read the thread count from /proc/self/status"
        ))),
    }
}

fn set_rlimit(
    res: libc::__rlimit_resource_t,
    name: &str,
    soft: u64,
    hard: u64,
) -> Result<(), HardenError> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads a struct we own.
    if unsafe { libc::setrlimit(res, &lim) } != 0 {
        return Err(sys(format!("setrlimit({name}, {soft}, {hard})")));
    }
    Ok(())
}

fn get_rlimit(res: libc::__rlimit_resource_t, name: &str) -> Result<(u64, u64), HardenError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes a struct we own.
    if unsafe { libc::getrlimit(res, &mut lim) } != 0 {
        return Err(sys(format!("getrlimit({name})")));
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// rlimits for the daemon: no core dumps (they would hold API keys and
/// guest data), NOFILE as configured.
pub fn apply_rlimits(nofile: Option<u64>) -> Result<u64, HardenError> {
    set_rlimit(libc::RLIMIT_CORE, "RLIMIT_CORE", 0, 0)?;
    let (_, hard) = get_rlimit(libc::RLIMIT_NOFILE, "RLIMIT_NOFILE")?;
    let n = nofile.unwrap_or(hard);
    // Raising the hard limit needs CAP_SYS_RESOURCE, which is dropped next.
    set_rlimit(libc::RLIMIT_NOFILE, "RLIMIT_NOFILE", n, n.max(hard))?;
    Ok(n)
}

fn no_new_privs() -> Result<(), HardenError> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(sys("prctl(PR_SET_NO_NEW_PRIVS)"));
    }
    Ok(())
}

/// Harden the calling process. Call on the main thread while it is the only
/// thread, after starting the spawner: rlimits, not dumpable (no ptrace by
/// same-uid processes, /proc/<pid> files owned by root), capabilities,
/// no_new_privs, SIGSYS handler, the baseline filter, the thread broker.
pub fn apply(opts: &Options) -> Result<Report, HardenError> {
    require_single_threaded("harden::apply")?;
    // glibc gives threads their own malloc arenas, and shrinking one reads
    // /proc/sys/vm/overcommit_memory (openat) the first time, on whatever
    // thread gets there: a filtered thread would be killed for it (seen on
    // an agent-reader thread). One arena for all threads never does.
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt with integer arguments, before any other thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    let nofile = apply_rlimits(opts.nofile)?;
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(sys("prctl(PR_SET_DUMPABLE, 0)"));
    }
    let dropped = caps::drop_to(&opts.needs)?;
    no_new_privs()?;
    seccomp::set_mode(opts.seccomp);
    seccomp::install_current_with(ThreadKind::Baseline, opts.seccomp)?;
    thread::start_broker()?;
    Ok(Report {
        caps: dropped,
        seccomp: opts.seccomp,
        nofile,
    })
}
