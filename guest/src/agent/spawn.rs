//! Starting processes, the exec hot path. Every child is started
//! vfork-style (it borrows our memory until it execs: no page tables
//! copied), with a pidfd from the clone itself, which the pump polls and
//! reaps through. The clone asks for no exit signal, but execve gives the
//! child SIGCHLD back (the kernel resets it at exec), so the reaper thread
//! may collect an exec'ed child first and hand its status over (see
//! `Procs::register`); only a child that fails before its exec is found
//! by its pidfd alone:
//! - [`vfork_spawn`] (glibc `clone`) for plain children;
//! - [`vfork_exec`] (raw `clone3`) for children that change uid/gid, take
//!   a controlling terminal, or, with the agent as the VM's init, start
//!   under user limits ([`UserLimits`]): `CLONE_INTO_CGROUP` places them in
//!   their cgroup atomically (moving a child afterwards races with its
//!   first fork).
//!
//! `posix_spawn` and `fork` remain as fallbacks for kernels without
//! `CLONE_PIDFD` or `clone3`. We never `wait` for those here: the agent's
//! single reaper owns every child that signals its exit (it must, as PID 1),
//! so std::process::Command, which waits on exec failure, is not usable.

use super::sys::{ctx, cvt};
use crate::sync::lock;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::OnceLock;

/// Limits every user process starts under (set once by init, PID 1 only).
pub struct UserLimits {
    /// The sandbox cgroup's directory (`pids.max`, `memory.max`).
    pub cgroup: OwnedFd,
    /// Its path, when each exec gets a child cgroup of its own there.
    pub per_exec: Option<std::path::PathBuf>,
    /// pids.max of each exec's cgroup: below the sandbox's, so one runaway
    /// exec leaves room for the next.
    pub exec_pids_max: Option<u64>,
    /// memory.max of each exec's cgroup, below the sandbox's for the same
    /// reason: an exec held at its limit (a fork bomb's forks fail with
    /// ENOMEM and its page cache thrashes; nothing gets OOM-killed) must
    /// leave the next exec memory to start in, or that one thrashes too.
    pub exec_mem_max: Option<u64>,
    /// RLIMIT_NOFILE (soft, hard).
    pub nofile: (u64, u64),
    /// RLIMIT_NPROC; only binds non-root users (root bypasses it), which
    /// is why the cgroup's pids.max is the real fork-bomb limit.
    pub nproc: u64,
}

static LIMITS: OnceLock<UserLimits> = OnceLock::new();

pub fn set_user_limits(l: UserLimits) {
    if LIMITS.set(l).is_err() {
        log::warn!("user limits set twice; keeping the first");
    }
}

pub fn user_limits() -> Option<&'static UserLimits> {
    LIMITS.get()
}

/// One exec's own cgroup below the sandbox cgroup: its process tree gets
/// one CPU share (a fork bomb cannot starve the next exec), an OOM kills
/// the whole tree (`memory.oom.group`), and a timeout or cancel kills every
/// process in it (`cgroup.kill`), even those that left the process group.
/// Removed when dropped; while detached descendants keep it populated it
/// waits in [`BUSY`] and is retried at each later spawn.
pub struct ExecCgroup {
    path: std::path::PathBuf,
}

static BUSY: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());
static NEXT_CG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
/// The next exec's cgroup, made before it is needed: by init (so a
/// snapshot holds one) and after each exec is answered. Making a cgroup
/// with the memory, pids and cpu controllers is the largest single step of
/// an exec: 2,000 of the 16,000 blocks QEMU/TCG translates for the first
/// exec after a restore (docs/images.md), a few hundred µs under KVM.
static SPARE: std::sync::Mutex<Option<(ExecCgroup, OwnedFd)>> = std::sync::Mutex::new(None);

fn lock_spare() -> std::sync::MutexGuard<'static, Option<(ExecCgroup, OwnedFd)>> {
    lock(&SPARE)
}

/// Makes the spare exec cgroup if there is none (and user limits give
/// each exec one). Called off the exec path; failures only cost the next
/// exec the mkdir it would have made anyway.
pub fn prepare_exec_cgroup() {
    let Some(l) = user_limits() else { return };
    let Some(parent) = l.per_exec.as_deref() else {
        return;
    };
    if lock_spare().is_some() {
        return;
    }
    match ExecCgroup::create(parent, l) {
        Ok(made) => {
            // An exec may have raced us to an empty slot and made its own;
            // a second spare is dropped (removed) rather than kept.
            let mut spare = lock_spare();
            if spare.is_none() {
                *spare = Some(made);
            }
        }
        Err(e) => log::warn!("spare exec cgroup: {e}"),
    }
}

impl ExecCgroup {
    /// The spare cgroup, or a new one.
    fn take(parent: &std::path::Path, l: &UserLimits) -> io::Result<(ExecCgroup, OwnedFd)> {
        if let Some(s) = lock_spare().take() {
            return Ok(s);
        }
        Self::create(parent, l)
    }

    fn create(parent: &std::path::Path, l: &UserLimits) -> io::Result<(ExecCgroup, OwnedFd)> {
        use std::os::unix::fs::OpenOptionsExt;
        retry_busy();
        let n = NEXT_CG.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = parent.join(format!("x{n}"));
        std::fs::create_dir(&path).map_err(|e| ctx(e, &format!("mkdir {}", path.display())))?;
        let cg = ExecCgroup { path };
        let oom = cg.path.join("memory.oom.group");
        std::fs::write(&oom, "1").map_err(|e| ctx(e, &format!("write {}", oom.display())))?;
        for (file, limit) in [
            ("pids.max", l.exec_pids_max),
            ("memory.max", l.exec_mem_max),
        ] {
            if let Some(n) = limit {
                let f = cg.path.join(file);
                std::fs::write(&f, n.to_string())
                    .map_err(|e| ctx(e, &format!("write {}", f.display())))?;
            }
        }
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&cg.path)
            .map_err(|e| ctx(e, &format!("open {}", cg.path.display())))?;
        Ok((cg, dir.into()))
    }

    /// Applies an exec's own limits (`memory_max` no higher than the
    /// per-exec maximum `exec_mem_max`). The cgroup is this exec's alone
    /// and removed after it, so nothing carries over to the next one.
    fn limit(
        &self,
        exec_mem_max: Option<u64>,
        memory_max: Option<u64>,
        cpu_max_us: Option<u64>,
    ) -> io::Result<()> {
        let write = |file: &str, v: String| {
            let f = self.path.join(file);
            std::fs::write(&f, v).map_err(|e| ctx(e, &format!("write {}", f.display())))
        };
        if let Some(m) = memory_max {
            let m = exec_mem_max.map_or(m, |cap| m.min(cap));
            write("memory.max", m.to_string())?;
        }
        if let Some(q) = cpu_max_us {
            // The kernel takes no quota below 1 ms.
            let q = q.max(1_000);
            write(
                "cpu.max",
                format!("{q} {}", crate::proto::limits::CPU_PERIOD_US),
            )?;
        }
        Ok(())
    }

    /// What the exec's processes used so far, and whether the OOM killer
    /// struck in the cgroup. Read when the exec ends, before the cgroup
    /// is removed.
    pub fn usage(&self) -> (Option<crate::proto::ResourceUsage>, bool) {
        let read = |file: &str| std::fs::read_to_string(self.path.join(file)).ok();
        let field = |text: &str, key: &str| {
            text.lines().find_map(|l| {
                l.strip_prefix(key)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
        };
        let peak = read("memory.peak").and_then(|t| t.trim().parse::<u64>().ok());
        let cpu = read("cpu.stat").and_then(|t| field(&t, "usage_usec"));
        let oom = read("memory.events")
            .and_then(|t| field(&t, "oom_kill"))
            .is_some_and(|n| n > 0);
        let usage = match (peak, cpu) {
            (Some(memory_peak_bytes), Some(cpu_usec)) => Some(crate::proto::ResourceUsage {
                memory_peak_bytes,
                cpu_usec,
                source: crate::proto::UsageSource::Cgroup,
            }),
            _ => {
                log::warn!("{}: no memory.peak or cpu.stat", self.path.display());
                None
            }
        };
        (usage, oom)
    }

    /// SIGKILL to every process in the cgroup, held first (see [`hold`]):
    /// a fork bomb at its memory.max survives a plain `cgroup.kill`.
    pub fn kill(&self) {
        hold(&self.path);
        let f = self.path.join("cgroup.kill");
        if let Err(e) = std::fs::write(&f, "1") {
            log::warn!("write {}: {e}", f.display());
        }
        thaw(&self.path);
    }
}

/// Holds exec cgroup `c` for a kill: frozen (no fork between listing and
/// killing; SIGKILL still ends frozen tasks) and its memory.max lifted to
/// the sandbox's own limit, which still bounds it, so tasks the memcg OOM
/// killer already sent SIGKILL (which `cgroup.kill` skips) are not held in
/// reclaim at the limit while the rest forks on. Best effort: a cgroup
/// emptied meanwhile needs neither. [`thaw`] after the kill, on every way
/// out.
fn hold(c: &std::path::Path) {
    let _ = std::fs::write(c.join("cgroup.freeze"), "1");
    let _ = std::fs::write(c.join("memory.max"), "max");
}

fn thaw(c: &std::path::Path) {
    let _ = std::fs::write(c.join("cgroup.freeze"), "0");
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        if std::fs::remove_dir(&self.path).is_err() {
            let mut busy = lock(&BUSY);
            busy.push(std::mem::take(&mut self.path));
        }
    }
}

/// Processes in cgroup `dir` and every cgroup below it.
fn count_procs(dir: &std::path::Path) -> u64 {
    let here = std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().count() as u64)
        .unwrap_or(0);
    let below: u64 = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| count_procs(&e.path()))
                .sum()
        })
        .unwrap_or(0);
    here + below
}

/// Exec cgroups directly below `dir` that hold a process now.
fn populated_children(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .filter(|p| {
                    std::fs::read_to_string(p.join("cgroup.events"))
                        .is_ok_and(|e| e.lines().any(|l| l == "populated 1"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// SIGKILLs every user process with `cgroup.kill` on the sandbox cgroup
/// (every exec's cgroup and whatever its processes left behind, whatever
/// their uid or process group), then waits up to `wait` until none is left
/// in it. `(found, remaining)`; `None`
/// without user limits (not the VM's init), where the caller falls back to
/// the process groups it started. Root in the guest can move a process out
/// of the sandbox cgroup; that one survives (the session's VM still bounds
/// it; destroying the session ends everything).
///
/// Against a fork bomb held at its exec cgroup's memory.max, SIGKILL alone
/// was not always enough under TCG (CI, 2026-12-01: 2065 found, 2065 left
/// after 5 s, more 30 s later): tasks the memcg OOM killer had already sent
/// SIGKILL are skipped by `cgroup.kill` and may sit in reclaim at the
/// limit, while the rest forks on. So each populated exec cgroup is first
/// frozen (no fork between here and the kill; SIGKILL still ends frozen
/// tasks) and its memory.max lifted to the sandbox's own limit (which still
/// bounds them all) so dying tasks are not held in reclaim; thawed after.
pub fn kill_all(wait: std::time::Duration) -> Option<io::Result<(u64, u64)>> {
    let l = user_limits()?;
    let path = l.per_exec.clone().unwrap_or_else(|| {
        std::path::PathBuf::from(format!("/proc/self/fd/{}", l.cgroup.as_raw_fd()))
    });
    let found = count_procs(&path);
    let held = if l.per_exec.is_some() {
        populated_children(&path)
    } else {
        Vec::new()
    };
    for c in &held {
        hold(c);
    }
    let kill = path.join("cgroup.kill");
    let killed = std::fs::write(&kill, "1");
    // Thaws what was frozen on every way out: a thawed empty cgroup is
    // removed as usual, one still holding a task must not keep it frozen.
    let thaw_all = || {
        for c in &held {
            thaw(c);
        }
    };
    if let Err(e) = killed {
        thaw_all();
        return Some(Err(ctx(e, &format!("write {}", kill.display()))));
    }
    // Waits on `cgroup.events` (one short file), not on a count of every
    // cgroup.procs below, which under a bomb is thousands of lines a read.
    let events = path.join("cgroup.events");
    let deadline = std::time::Instant::now() + wait;
    let left = loop {
        let populated = match std::fs::read_to_string(&events) {
            Ok(e) => e.lines().any(|l| l == "populated 1"),
            Err(_) => count_procs(&path) > 0,
        };
        if !populated {
            break 0;
        }
        if std::time::Instant::now() >= deadline {
            break count_procs(&path);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        // Again while anything is left: an exec that raced the first write
        // (a request handled on another thread) started after it.
        let _ = std::fs::write(&kill, "1");
    };
    thaw_all();
    Some(Ok((found, left)))
}

/// Removes exec cgroups whose last process has gone.
fn retry_busy() {
    let mut busy = lock(&BUSY);
    busy.retain(|p| std::fs::remove_dir(p).is_err_and(|e| e.kind() != io::ErrorKind::NotFound));
}

pub struct SpawnSpec<'a> {
    pub path: &'a CStr,
    pub argv: &'a [CString],
    pub envp: &'a [CString],
    pub cwd: &'a CStr,
    /// Descriptors that become the child's 0, 1 and 2.
    pub stdio: [RawFd; 3],
    /// New session with the terminal on fd 0 as controlling tty (PTY mode);
    /// otherwise a new process group.
    pub pty: bool,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// This exec's own limits ([`crate::proto::ExecRequest::memory_max`],
    /// `cpu_max_us`), set on its cgroup before it starts.
    pub memory_max: Option<u64>,
    pub cpu_max_us: Option<u64>,
}

/// A started child: its pid, its cgroup (with user limits) and, when the
/// spawn made one, a pidfd.
pub struct Spawned {
    pub pid: i32,
    pub cgroup: Option<ExecCgroup>,
    /// Set for children of the vfork-style clones: the pump polls it and
    /// reaps through it (the reaper thread may still get there first).
    pub pidfd: Option<OwnedFd>,
}

/// Starts the child. It leads its own process group (or session, with a
/// PTY), so signals reach everything it starts.
pub fn spawn(spec: &SpawnSpec) -> io::Result<Spawned> {
    let mut argv: Vec<*mut libc::c_char> = spec
        .argv
        .iter()
        .map(|a| a.as_ptr() as *mut libc::c_char)
        .collect();
    argv.push(ptr::null_mut());
    let mut envp: Vec<*mut libc::c_char> = spec
        .envp
        .iter()
        .map(|a| a.as_ptr() as *mut libc::c_char)
        .collect();
    envp.push(ptr::null_mut());
    // posix_spawn cannot change identity or claim a controlling terminal
    // (TIOCSCTTY), so those children take the fork path.
    let limits = user_limits();
    let (cg, cg_fd) = match limits.and_then(|l| Some((l.per_exec.as_deref()?, l))) {
        Some((parent, l)) => match ExecCgroup::take(parent, l) {
            Ok((cg, fd)) => (Some(cg), Some(fd)),
            // The sandbox cgroup itself cannot take processes once it has
            // child controllers: no fallback.
            Err(e) => return Err(e),
        },
        None => (None, None),
    };
    if spec.memory_max.is_some() || spec.cpu_max_us.is_some() {
        match (&cg, limits) {
            (Some(cg), Some(l)) => cg.limit(l.exec_mem_max, spec.memory_max, spec.cpu_max_us)?,
            // Refused rather than run without the limits asked for.
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "per-command memory and CPU limits need a cgroup per exec (the agent as the VM's init)",
                ))
            }
        }
    }
    if spec.uid.is_some() || spec.gid.is_some() || spec.pty || limits.is_some() {
        let target = cg_fd
            .as_ref()
            .map(AsRawFd::as_raw_fd)
            .or(limits.map(|l| l.cgroup.as_raw_fd()));
        match vfork_exec(spec, &argv, &envp, limits, target) {
            Ok((pid, pidfd)) => Ok(Spawned {
                pid,
                cgroup: cg,
                pidfd: Some(pidfd),
            }),
            // No clone3 (before Linux 5.3; 5.7 for CLONE_INTO_CGROUP).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::E2BIG)) => {
                fork_exec(spec, &argv, &envp, limits, target).map(|pid| Spawned {
                    pid,
                    cgroup: cg,
                    pidfd: None,
                })
            }
            Err(e) => Err(e),
        }
    } else {
        match vfork_spawn(spec, &argv, &envp) {
            Ok((pid, pidfd)) => Ok(Spawned {
                pid,
                cgroup: None,
                pidfd: Some(pidfd),
            }),
            // A kernel without CLONE_PIDFD (before 5.2).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => posix_spawn(spec, &argv, &envp)
                .map(|pid| Spawned {
                    pid,
                    cgroup: None,
                    pidfd: None,
                }),
            Err(e) => Err(e),
        }
    }
}

/// Stack of a [`vfork_spawn`] child: it only makes a few syscalls.
const VFORK_STACK: usize = 64 * 1024;

/// Signals whose disposition is not the default in this process, read once.
/// The agent sets dispositions at startup only (Rust ignores SIGPIPE and
/// installs SIGSEGV/SIGBUS handlers; the signals it handles are blocked and
/// taken with sigwaitinfo), so the list stays true.
fn non_default_signals() -> &'static [libc::c_int] {
    static SIGS: OnceLock<Vec<libc::c_int>> = OnceLock::new();
    SIGS.get_or_init(|| {
        (1..libc::SIGRTMAX())
            .filter(|&sig| {
                // SAFETY: sigaction is plain data; all-zero is a valid value.
                let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
                // SAFETY: a query only (null new action), valid out pointer.
                let r = unsafe { libc::sigaction(sig, ptr::null(), &mut old) };
                r == 0 && old.sa_sigaction != libc::SIG_DFL
            })
            .collect()
    })
}

/// What a [`vfork_spawn`] child reads (and writes: `errno` on failure).
/// It shares our memory until it execs, so plain pointers suffice.
struct VforkCtx<'a> {
    spec: &'a SpawnSpec<'a>,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
    reset: &'static [libc::c_int],
    empty: libc::sigset_t,
    /// errno of the step that failed; 0 if the child reached execve.
    err: libc::c_int,
}

/// The child half of [`vfork_spawn`]. Runs on its own stack in our address
/// space with every signal blocked, until execve replaces it: only raw
/// syscalls, no allocation, no locks.
extern "C" fn vfork_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: arg is the VforkCtx the parent keeps alive (and does not
    // touch) until this child has exec'ed or exited: CLONE_VFORK suspends it.
    unsafe {
        let ctx = &mut *(arg as *mut VforkCtx);
        let fail = |ctx: &mut VforkCtx| -> ! {
            ptr::write_volatile(&mut ctx.err, (*libc::__errno_location()).max(1));
            libc::_exit(127)
        };
        if libc::setpgid(0, 0) < 0 {
            fail(ctx);
        }
        // Move the stdio sources out of 0..3 first so that dup2 of one
        // cannot clobber another (and dup2 onto itself would keep CLOEXEC).
        let mut src = ctx.spec.stdio;
        for s in src.iter_mut() {
            if *s < 3 {
                let n = libc::fcntl(*s, libc::F_DUPFD_CLOEXEC, 3);
                if n < 0 {
                    fail(ctx);
                }
                *s = n;
            }
        }
        for (target, &s) in src.iter().enumerate() {
            if libc::dup2(s, target as libc::c_int) < 0 {
                fail(ctx);
            }
        }
        if libc::chdir(ctx.spec.cwd.as_ptr()) < 0 {
            fail(ctx);
        }
        exec_with_default_signals(
            ctx.reset,
            &ctx.empty,
            ctx.spec.path.as_ptr(),
            ctx.argv as *const *const libc::c_char,
            ctx.envp as *const *const libc::c_char,
        );
        fail(ctx)
    }
}

/// posix_spawn done by hand, for the exec hot path: a vfork-style clone
/// (the child borrows our memory until it execs, so no page tables are
/// copied) that, unlike glibc's posix_spawn, does not walk all 64 signal
/// dispositions (~130 syscalls) nor re-read RLIMIT_NOFILE per file action,
/// returns a pidfd from the clone itself (CLONE_PIDFD: no pidfd_open), and
/// asks for no exit signal, which lasts until the child's execve (the
/// kernel restores SIGCHLD there): a child that fails before it is reaped
/// through its pidfd alone ([`reap_failed`]); one that ran is reaped by the
/// pump or the reaper thread, whichever is first.
fn vfork_spawn(
    spec: &SpawnSpec,
    argv: &[*mut libc::c_char],
    envp: &[*mut libc::c_char],
) -> io::Result<(i32, OwnedFd)> {
    let reset = non_default_signals();
    let mut stack: Vec<std::mem::MaybeUninit<u8>> = Vec::with_capacity(VFORK_STACK);
    // SAFETY: a zeroed sigset is valid storage; sigemptyset initialises it.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid sigset pointer.
    unsafe { libc::sigemptyset(&mut empty) };
    let mut cx = VforkCtx {
        spec,
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        reset,
        empty,
        err: 0,
    };
    // The stack grows down from the end of the buffer, 16-byte aligned.
    let top = {
        let end = stack.as_mut_ptr() as usize + VFORK_STACK;
        (end & !15) as *mut libc::c_void
    };
    let mut pidfd: libc::c_int = -1;
    // Every signal blocked across the clone: no handler may run in the
    // child while it shares our memory; it sets its own mask before execve.
    // SAFETY: zeroed sigsets are valid storage, filled before use.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as `all`; pthread_sigmask fills it.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid sigset pointers.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    // SAFETY: `top` is the aligned end of a live buffer of VFORK_STACK bytes
    // that outlives the child's use of it (CLONE_VFORK returns only after
    // the child has exec'ed or exited); ctx likewise; pidfd is a valid out
    // pointer for CLONE_PIDFD. Exit signal 0 (the low byte of flags).
    let pid = unsafe {
        libc::clone(
            vfork_child,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD,
            &mut cx as *mut VforkCtx as *mut libc::c_void,
            &mut pidfd as *mut libc::c_int,
        )
    };
    let clone_err = io::Error::last_os_error();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, ptr::null_mut()) };
    drop(stack);
    if pid < 0 {
        return Err(ctx(clone_err, "clone(CLONE_VFORK)"));
    }
    // SAFETY: CLONE_PIDFD stored a fresh descriptor we now own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    // SAFETY: the child is done with cx (it exec'ed or exited).
    let err = unsafe { ptr::read_volatile(&cx.err) };
    if err != 0 {
        reap_failed(&pidfd);
        return Err(io::Error::from_raw_os_error(err));
    }
    Ok((pid, pidfd))
}

struct FileActions(libc::posix_spawn_file_actions_t);
impl Drop for FileActions {
    fn drop(&mut self) {
        // SAFETY: initialised in posix_spawn() before this guard exists.
        unsafe { libc::posix_spawn_file_actions_destroy(&mut self.0) };
    }
}
struct Attr(libc::posix_spawnattr_t);
impl Drop for Attr {
    fn drop(&mut self) {
        // SAFETY: initialised in posix_spawn() before this guard exists.
        unsafe { libc::posix_spawnattr_destroy(&mut self.0) };
    }
}

fn spawn_err(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc != 0 {
        return Err(ctx(io::Error::from_raw_os_error(rc), what));
    }
    Ok(())
}

fn posix_spawn(
    spec: &SpawnSpec,
    argv: &[*mut libc::c_char],
    envp: &[*mut libc::c_char],
) -> io::Result<i32> {
    // SAFETY: every pointer handed to libc below is valid for the duration
    // of the call: CStrings and the argv/envp arrays outlive posix_spawn, the
    // attr/file-action objects are initialised before use and destroyed by
    // their guards.
    unsafe {
        let mut fa = FileActions(std::mem::zeroed());
        spawn_err(
            libc::posix_spawn_file_actions_init(&mut fa.0),
            "posix_spawn_file_actions_init",
        )?;
        for (target, &src) in spec.stdio.iter().enumerate() {
            spawn_err(
                libc::posix_spawn_file_actions_adddup2(&mut fa.0, src, target as libc::c_int),
                "posix_spawn_file_actions_adddup2",
            )?;
        }
        spawn_err(
            libc::posix_spawn_file_actions_addchdir_np(&mut fa.0, spec.cwd.as_ptr()),
            "posix_spawn_file_actions_addchdir_np",
        )?;

        let mut attr = Attr(std::mem::zeroed());
        spawn_err(
            libc::posix_spawnattr_init(&mut attr.0),
            "posix_spawnattr_init",
        )?;
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        // The agent blocks SIGCHLD and friends for its signal thread and
        // ignores SIGPIPE: none of that may leak into user processes.
        spawn_err(
            libc::posix_spawnattr_setsigmask(&mut attr.0, &empty),
            "posix_spawnattr_setsigmask",
        )?;
        // Only SIGPIPE is ignored by the agent (Rust's runtime does it);
        // listing every signal here would cost the child ~60 sigaction
        // calls on the exec hot path.
        let mut dfl: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut dfl);
        libc::sigaddset(&mut dfl, libc::SIGPIPE);
        spawn_err(
            libc::posix_spawnattr_setsigdefault(&mut attr.0, &dfl),
            "posix_spawnattr_setsigdefault",
        )?;
        let flags = libc::POSIX_SPAWN_SETSIGMASK
            | libc::POSIX_SPAWN_SETSIGDEF
            | libc::POSIX_SPAWN_SETPGROUP;
        spawn_err(
            libc::posix_spawnattr_setpgroup(&mut attr.0, 0),
            "posix_spawnattr_setpgroup",
        )?;
        spawn_err(
            libc::posix_spawnattr_setflags(&mut attr.0, flags as libc::c_short),
            "posix_spawnattr_setflags",
        )?;
        let mut pid: libc::pid_t = 0;
        let rc = libc::posix_spawn(
            &mut pid,
            spec.path.as_ptr(),
            &fa.0,
            &attr.0,
            argv.as_ptr(),
            envp.as_ptr(),
        );
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(pid)
    }
}

/// What a [`vfork_exec`] child needs, all prepared before the clone (it
/// shares our memory until it execs, so it only reads this, and writes
/// `err` on failure).
struct FullCtx<'a> {
    spec: &'a SpawnSpec<'a>,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    reset: &'static [libc::c_int],
    empty: libc::sigset_t,
    rlimits: Option<[(libc::__rlimit_resource_t, libc::rlimit); 2]>,
    err: libc::c_int,
}

/// The last steps of a vfork-style child: default the handlers it could
/// run in our memory between the unblock and execve (execve keeps ignored
/// signals ignored and resets handlers itself, but only once it runs),
/// unblock, execve. Returns only if execve failed (errno set).
///
/// # Safety
/// Only in a child between clone and exec.
unsafe fn exec_with_default_signals(
    reset: &[libc::c_int],
    empty: &libc::sigset_t,
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) {
    for &sig in reset {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, ptr::null_mut());
    }
    libc::sigprocmask(libc::SIG_SETMASK, empty, ptr::null_mut());
    libc::execve(path, argv, envp);
}

/// The resource limits a user process gets (prepared before the clone).
fn rlimits_of(l: &UserLimits) -> [(libc::__rlimit_resource_t, libc::rlimit); 2] {
    [
        (
            libc::RLIMIT_NOFILE,
            libc::rlimit {
                rlim_cur: l.nofile.0,
                rlim_max: l.nofile.1,
            },
        ),
        (
            libc::RLIMIT_NPROC,
            libc::rlimit {
                rlim_cur: l.nproc,
                rlim_max: l.nproc,
            },
        ),
    ]
}

/// The steps every exec child takes between clone and exec: process group
/// or session, stdio, controlling terminal, cwd, user limits and OOM
/// score, identity. False (errno set) at the first that fails.
/// Async-signal-safe; identity changes are raw syscalls (glibc's setuid()
/// would try to broadcast the change to the agent's threads, which a vfork
/// child is not).
///
/// # Safety
/// Only in a child between clone/fork and exec.
unsafe fn child_steps(
    spec: &SpawnSpec<'_>,
    rlimits: Option<&[(libc::__rlimit_resource_t, libc::rlimit); 2]>,
) -> bool {
    if spec.pty {
        if libc::setsid() < 0 {
            return false;
        }
    } else if libc::setpgid(0, 0) < 0 {
        return false;
    }
    // Move the stdio sources out of 0..3 first so that dup2 of one cannot
    // clobber another.
    let mut src = spec.stdio;
    for s in src.iter_mut() {
        if *s < 3 {
            let n = libc::fcntl(*s, libc::F_DUPFD_CLOEXEC, 3);
            if n < 0 {
                return false;
            }
            *s = n;
        }
    }
    for (target, &s) in src.iter().enumerate() {
        if libc::dup2(s, target as libc::c_int) < 0 {
            return false;
        }
    }
    if spec.pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
        return false;
    }
    if libc::chdir(spec.cwd.as_ptr()) < 0 {
        return false;
    }
    if let Some(rl) = rlimits {
        for (res, lim) in rl {
            if libc::setrlimit(*res, lim) < 0 {
                return false;
            }
        }
        // No oom_score_adj to undo: the agent (PID 1, which the OOM
        // killer never picks) keeps the default 0 that children inherit.
    }
    if let Some(gid) = spec.gid {
        if libc::syscall(libc::SYS_setgroups, 0usize, ptr::null::<libc::gid_t>()) < 0
            || libc::syscall(libc::SYS_setgid, gid as libc::c_long) < 0
        {
            return false;
        }
    }
    if let Some(uid) = spec.uid {
        if libc::syscall(libc::SYS_setuid, uid as libc::c_long) < 0 {
            return false;
        }
    }
    true
}

/// The child half of [`vfork_exec`]: the fork_exec child's steps, on its
/// own stack in our address space with every signal blocked. Identity
/// changes are raw syscalls: glibc's setuid() would try to broadcast the
/// change to our threads, which this child is not.
extern "C" fn full_child(arg: *mut libc::c_void) -> ! {
    // SAFETY: arg is the FullCtx the parent keeps alive, untouched, until
    // this child has exec'ed or exited (CLONE_VFORK suspends the parent).
    unsafe {
        let ctx = &mut *(arg as *mut FullCtx);
        let fail = |ctx: &mut FullCtx| -> ! {
            ptr::write_volatile(&mut ctx.err, (*libc::__errno_location()).max(1));
            libc::_exit(127)
        };
        let spec = ctx.spec;
        if !child_steps(spec, ctx.rlimits.as_ref()) {
            fail(ctx);
        }
        exec_with_default_signals(
            ctx.reset,
            &ctx.empty,
            spec.path.as_ptr(),
            ctx.argv,
            ctx.envp,
        );
        fail(ctx)
    }
}

/// clone3 with `args` (which must carry CLONE_VM and a stack) whose child
/// calls `f(arg)` on that stack. Returns what the syscall returns in the
/// parent: the child's pid or -errno.
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_call(
    args: &CloneArgs,
    f: extern "C" fn(*mut libc::c_void) -> !,
    arg: *mut libc::c_void,
) -> libc::c_long {
    let ret: libc::c_long;
    // The child returns from `syscall` on the new stack (the kernel sets
    // rsp to stack + stack_size, 16-byte aligned by the caller) with our
    // registers, and calls f(arg), which never returns.
    // SAFETY: the caller guarantees args describes a valid stack and flags.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") args as *const CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") arg,
            in("r13") f,
            lateout("rcx") _,
            lateout("r11") _,
        );
    }
    ret
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_call(
    _args: &CloneArgs,
    _f: extern "C" fn(*mut libc::c_void) -> !,
    _arg: *mut libc::c_void,
) -> libc::c_long {
    -(libc::ENOSYS as libc::c_long)
}

/// The exec path for children that change identity, take a terminal, or
/// start under the VM's user limits (every exec when the agent is init):
/// a vfork-style clone3 (no page-table copy: ~150 µs less than fork here)
/// that also places the child in its cgroup atomically
/// (CLONE_INTO_CGROUP), returns a pidfd and, like [`vfork_spawn`], gives
/// the child no exit signal until its execve. ENOSYS/E2BIG mean an older kernel: the caller
/// falls back to [`fork_exec`].
fn vfork_exec(
    spec: &SpawnSpec,
    argv: &[*mut libc::c_char],
    envp: &[*mut libc::c_char],
    limits: Option<&UserLimits>,
    cgroup: Option<RawFd>,
) -> io::Result<(i32, OwnedFd)> {
    let reset = non_default_signals();
    // SAFETY: a zeroed sigset is valid storage; sigemptyset initialises it.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid sigset pointer.
    unsafe { libc::sigemptyset(&mut empty) };
    let rlimits = limits.map(rlimits_of);
    let mut cx = FullCtx {
        spec,
        argv: argv.as_ptr() as *const *const libc::c_char,
        envp: envp.as_ptr() as *const *const libc::c_char,
        reset,
        empty,
        rlimits,
        err: 0,
    };
    let mut stack: Vec<std::mem::MaybeUninit<u8>> = Vec::with_capacity(VFORK_STACK + 16);
    let base = (stack.as_mut_ptr() as usize).next_multiple_of(16);
    let mut pidfd: libc::c_int = -1;
    let target = limits.and(cgroup);
    let mut flags = (libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD) as u64;
    if target.is_some() {
        flags |= CLONE_INTO_CGROUP;
    }
    let args = CloneArgs {
        flags,
        pidfd: &mut pidfd as *mut libc::c_int as u64,
        exit_signal: 0,
        stack: base as u64,
        stack_size: VFORK_STACK as u64,
        cgroup: target.unwrap_or(0) as u64,
        ..Default::default()
    };
    // Every signal blocked across the clone: no handler may run in the
    // child while it shares our memory; it sets its own mask before execve.
    // SAFETY: zeroed sigsets are valid storage, filled before use.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as `all`; pthread_sigmask fills it.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid sigset pointers.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    // SAFETY: args describes a live, 16-byte aligned stack of VFORK_STACK
    // bytes that outlives the child's use of it (CLONE_VFORK returns only
    // once the child has exec'ed or exited), as does cx; pidfd is a valid
    // out pointer for CLONE_PIDFD.
    let r = unsafe {
        clone3_call(
            &args,
            full_child,
            &mut cx as *mut FullCtx as *mut libc::c_void,
        )
    };
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, ptr::null_mut()) };
    drop(stack);
    if r < 0 {
        let err = io::Error::from_raw_os_error(-r as i32);
        let what = match (target.is_some(), err.raw_os_error()) {
            // The pids controller answers EAGAIN at pids.max.
            (true, Some(libc::EAGAIN)) => {
                "clone3 into the sandbox cgroup: its process limit (pids.max) is reached"
            }
            (true, _) => "clone3 into the sandbox cgroup",
            (false, _) => "clone3",
        };
        return Err(ctx(err, what));
    }
    // SAFETY: CLONE_PIDFD stored a fresh descriptor we now own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    // SAFETY: the child is done with cx (it exec'ed or exited).
    let err = unsafe { ptr::read_volatile(&cx.err) };
    if err != 0 {
        reap_failed(&pidfd);
        return Err(io::Error::from_raw_os_error(err));
    }
    Ok((r as i32, pidfd))
}

/// Reaps a vfork child that failed before its exec (it has _exited, sends
/// no SIGCHLD, and only its pidfd finds it).
fn reap_failed(pidfd: &OwnedFd) {
    // SAFETY: siginfo_t is plain data; valid out pointer.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own pidfd.
    unsafe {
        libc::waitid(
            3, // P_PIDFD
            pidfd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::__WALL,
        )
    };
}

/// `struct clone_args` up to `cgroup` (CLONE_ARGS_SIZE_VER2, Linux 5.7).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// fork(), or with limits a fork straight into the sandbox cgroup. No
/// CLONE_VM: the child gets a copy-on-write copy of this thread's stack, so
/// the raw syscall returns into it exactly like fork() (which is also why no
/// glibc atfork handlers run: the child makes only async-signal-safe calls).
fn fork_into(limits: Option<&UserLimits>, cgroup: Option<RawFd>) -> io::Result<libc::pid_t> {
    let pid = match limits.and(cgroup) {
        None => {
            // SAFETY: see fork_exec: the child only calls async-signal-safe
            // functions before exec.
            unsafe { libc::fork() }
        }
        Some(fd) => {
            let args = CloneArgs {
                flags: CLONE_INTO_CGROUP,
                exit_signal: libc::SIGCHLD as u64,
                cgroup: fd as u64,
                ..Default::default()
            };
            // SAFETY: args is a valid clone_args of the given size; without
            // CLONE_VM the child continues on its own copy of the stack.
            unsafe {
                libc::syscall(
                    libc::SYS_clone3,
                    &args as *const CloneArgs,
                    std::mem::size_of::<CloneArgs>(),
                ) as libc::pid_t
            }
        }
    };
    if pid < 0 {
        let err = io::Error::last_os_error();
        let what = match (limits.is_some(), err.raw_os_error()) {
            // The pids controller answers EAGAIN at pids.max.
            (true, Some(libc::EAGAIN)) => {
                "clone3 into the sandbox cgroup: its process limit (pids.max) is reached"
            }
            (true, _) => "clone3 into the sandbox cgroup",
            (false, _) => "fork",
        };
        return Err(ctx(err, what));
    }
    Ok(pid)
}

/// fork + exec for children that change identity or need a controlling
/// terminal, and for every child once user limits are set. Between fork and
/// exec only async-signal-safe calls are made; everything is prepared before
/// the fork.
fn fork_exec(
    spec: &SpawnSpec,
    argv: &[*mut libc::c_char],
    envp: &[*mut libc::c_char],
    limits: Option<&UserLimits>,
    cgroup: Option<RawFd>,
) -> io::Result<i32> {
    // Exec failure is reported through a close-on-exec pipe: EOF means the
    // exec succeeded, 4 bytes are the child's errno.
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid 2-element array.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }).map_err(|e| ctx(e, "pipe2"))?;
    // SAFETY: fresh descriptors we own.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: a zeroed sigset is valid storage; sigemptyset initialises it.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid sigset pointer.
    unsafe { libc::sigemptyset(&mut empty) };
    let wr_fd = wr.as_raw_fd();
    let rlimits = limits.map(rlimits_of);
    let pid = fork_into(limits, cgroup)?;
    if pid == 0 {
        // SAFETY: this is the child of fork_into (fork, or clone3 without
        // CLONE_VM): a copy-on-write image of the agent with this one thread,
        // whose other threads' locks (malloc's among them) may be held
        // forever. So it makes only async-signal-safe calls (signal,
        // sigprocmask, write, execve, _exit, and child_steps, whose contract
        // is exactly this point) and allocates nothing: argv, envp, `empty`
        // and `rlimits` were built before the fork and live in this image
        // until execve replaces it. argv and envp are the NUL-terminated
        // pointer arrays of CStrings the caller keeps alive; `wr_fd` is the
        // open write end of the pipe; `fail` and execve's failure path end
        // in _exit, so the child never returns into the agent's code.
        unsafe {
            let fail = |wr_fd: RawFd| -> ! {
                let errno = *libc::__errno_location();
                let b = errno.to_ne_bytes();
                libc::write(wr_fd, b.as_ptr() as *const libc::c_void, 4);
                libc::_exit(127)
            };
            for sig in 1..libc::SIGRTMIN() {
                if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                    libc::signal(sig, libc::SIG_DFL);
                }
            }
            if !child_steps(spec, rlimits.as_ref()) {
                fail(wr_fd);
            }
            libc::sigprocmask(libc::SIG_SETMASK, &empty, ptr::null_mut());
            libc::execve(spec.path.as_ptr(), argv.as_ptr() as _, envp.as_ptr() as _);
            fail(wr_fd);
        }
    }
    drop(wr);
    let mut b = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        // SAFETY: reads into the valid remainder of b.
        let n = unsafe {
            libc::read(
                rd.as_raw_fd(),
                b[got..].as_mut_ptr() as *mut libc::c_void,
                4 - got,
            )
        };
        if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if n <= 0 {
            break;
        }
        got += n as usize;
    }
    if got == 4 {
        // The child has _exited; the reaper collects it.
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(b)));
    }
    Ok(pid)
}

/// Finds `prog` on `path` like execvp would, so that "command not found"
/// is an error we report instead of an exit code 127 with no message.
pub fn resolve_program(prog: &str, path: &str, cwd: &std::path::Path) -> Option<CString> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &std::path::Path| {
        std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if prog.contains('/') {
        let p = if prog.starts_with('/') {
            std::path::PathBuf::from(prog)
        } else {
            cwd.join(prog)
        };
        return CString::new(p.into_os_string().into_encoded_bytes()).ok();
    }
    for dir in path.split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let cand = std::path::Path::new(dir).join(prog);
        if executable(&cand) {
            return CString::new(cand.into_os_string().into_encoded_bytes()).ok();
        }
    }
    None
}
