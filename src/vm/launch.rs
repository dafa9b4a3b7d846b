//! How VMM processes (QEMU) and short tools (the jailer, `--version`, the
//! KVM probe) are started: through the daemon's spawner process (the
//! hardened daemon cannot fork or exec at all), or directly for tools and
//! tests that run unhardened. Both behind one small interface, so backend
//! code is the same either way: [`Spawner`] runs a tool to completion,
//! [`Launcher`] also starts a VMM and hands back its [`Pidfd`]; every VM id
//! passes [`validate_id`]. The seam is shared by all backends (the
//! Firecracker jailer, QEMU), so it lives here, not with either.
//!
//! Either way the VMM gets: its own session and process group, exactly the
//! fds listed (at the given numbers; 0-2 default to /dev/null), an empty
//! environment, the given uid/gid with no supplementary groups, optionally
//! a cgroup, and `PR_SET_PDEATHSIG(SIGKILL)`: it dies with whoever started
//! it (the spawner, which itself dies with the daemon, or the starting
//! thread on the direct path).

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use super::{Result, VmError};

mod spawn;
use spawn::{cloexec_pipe, read_both};
pub use spawn::{
    Bind, ExitStatus, Jail, ProcLimits, SpawnError, SpawnRequest, SpawnService, SpawnedChild,
};

const NAME: &str = "launch";
/// Errors of runs through the spawner process.
const SPAWNER: &str = "spawner";

// ---- the seam -------------------------------------------------------------

/// A VM id: alphanumeric and '-', 1..=64 chars. The jailer's rule, which
/// every backend keeps: ids name jails, run dirs, sockets and cgroups.
pub fn validate_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(VmError::Other(format!(
            "invalid VM id {id:?}: the jailer allows 1-64 characters from [A-Za-z0-9-]"
        )))
    }
}

/// Output of a finished helper process.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// Exit code; `None` when killed by a signal.
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    /// The first non-empty line of a successful `BIN --version`: the VMM
    /// version every backend records in its snapshots' manifests.
    pub fn version_line(&self, backend: &'static str, bin: &Path) -> Result<String> {
        String::from_utf8_lossy(&self.stdout)
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .filter(|_| self.code == Some(0))
            .map(str::to_string)
            .ok_or_else(|| VmError::Api {
                backend,
                msg: format!(
                    "{} --version gave no version (exit code {:?}): {}",
                    bin.display(),
                    self.code,
                    String::from_utf8_lossy(&self.stderr).trim()
                ),
            })
    }
}

/// Runs a short-lived process (the jailer, `firecracker --version`) to
/// completion. The daemon plugs in its unfiltered spawner process here.
pub trait Spawner: Send + Sync {
    fn run(&self, argv: &[OsString], deadline: Instant) -> Result<Output>;
}

/// Spawns from the calling process. Fine for tools and tests; the daemon
/// should route this through its seccomp-free spawner.
#[derive(Debug, Default, Clone, Copy)]
pub struct DirectSpawner;

impl Spawner for DirectSpawner {
    fn run(&self, argv: &[OsString], deadline: Instant) -> Result<Output> {
        self.run_env(argv, None, deadline)
    }
}

impl DirectSpawner {
    /// [`Spawner::run`]; with `Some(env)` that is the whole environment
    /// (else ours is inherited).
    pub fn run_env(
        &self,
        argv: &[OsString],
        env: Option<&[(String, String)]>,
        deadline: Instant,
    ) -> Result<Output> {
        let Some((prog, args)) = argv.split_first() else {
            return Err(VmError::Other("empty argv".into()));
        };
        let prog_s = prog.to_string_lossy().into_owned();
        let mut cmd = Command::new(prog);
        if let Some(env) = env {
            cmd.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| VmError::Io {
                backend: NAME,
                what: format!("spawn {prog_s}"),
                source: e,
            })?;
        let budget_ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis() as u64;
        let pid = child.id() as i32;
        let exited = match Pidfd::open(pid) {
            Ok(pfd) => pfd.wait_exit(deadline),
            Err(_) => true, // already gone; wait() below collects it
        };
        if !exited {
            let _ = child.kill();
            let _ = child.wait();
            return Err(VmError::Timeout {
                backend: NAME,
                what: format!("{prog_s} to exit"),
                ms: budget_ms,
            });
        }
        let status = child.wait().map_err(|e| VmError::Io {
            backend: NAME,
            what: format!("wait for {prog_s}"),
            source: e,
        })?;
        // The process has exited; with --daemonize its child holds
        // /dev/null, not our pipes, so these reads end at EOF. Non-blocking
        // anyway, so a misbehaving grandchild cannot hang us.
        let mut out = Output {
            code: status.code(),
            ..Output::default()
        };
        if let Some(mut s) = child.stdout.take() {
            read_available(&mut s, &mut out.stdout);
        }
        if let Some(mut s) = child.stderr.take() {
            read_available(&mut s, &mut out.stderr);
        }
        Ok(out)
    }
}

fn read_available<R: Read + AsRawFd>(r: &mut R, out: &mut Vec<u8>) {
    // SAFETY: fcntl on an fd we own; only toggles O_NONBLOCK.
    unsafe {
        let fd = r.as_raw_fd();
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
    let mut buf = [0u8; 4096];
    while out.len() < 64 * 1024 {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// A process handle that cannot be confused with a later process reusing
/// the pid.
#[derive(Debug)]
pub struct Pidfd {
    fd: OwnedFd,
    pid: i32,
}

impl std::os::fd::AsFd for Pidfd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Pidfd {
    pub fn open(pid: i32) -> io::Result<Self> {
        if pid <= 0 {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        // SAFETY: plain syscall; returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just handed us this fd and nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(Pidfd { fd, pid })
    }

    /// A pidfd obtained elsewhere (e.g. passed by the spawner).
    pub fn from_owned(pid: i32, fd: OwnedFd) -> Self {
        Pidfd { fd, pid }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Wait until the process exits or `deadline` passes; true if it exited.
    pub fn wait_exit(&self, deadline: Instant) -> bool {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            let mut p = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            if r > 0 {
                return true;
            }
            if r == 0 {
                return false;
            }
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return false;
            }
        }
    }

    pub fn is_alive(&self) -> bool {
        !self.wait_exit(Instant::now())
    }

    pub fn kill(&self) -> io::Result<()> {
        // SAFETY: plain syscall on our fd.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Collect the exit status if the process is our child (it is not when
    /// the jailer forked it, unless we are a child subreaper).
    pub fn reap(&self) {
        let mut status = 0;
        // SAFETY: waitpid with WNOHANG on a specific pid.
        unsafe {
            libc::waitpid(self.pid, &mut status, libc::WNOHANG);
        }
    }
}

// ---- VMMs -----------------------------------------------------------------

/// A VMM's open files (QEMU's and Firecracker's RLIMIT_NOFILE unless the
/// operator sets one): its disks, TAP, sockets, eventfds per queue.
pub const DEFAULT_NOFILE: u64 = 1024;

/// A long-running VMM process to start.
#[derive(Debug, Clone)]
pub struct Launch {
    /// `argv[0]` is the absolute path of the program.
    pub argv: Vec<OsString>,
    pub cwd: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// cgroup directories the process starts in (one per hierarchy).
    pub cgroups: Vec<PathBuf>,
    /// File-size and open-file limits.
    pub limits: ProcLimits,
    /// Own namespaces and a minimal root ([`Launcher::can_jail`] only).
    pub jail: Option<Jail>,
}

/// A started VMM. Dropping it does not kill it (the owner's teardown does).
pub trait VmmProcess: Send {
    fn pidfd(&self) -> &Pidfd;
    /// SIGKILL its whole process group.
    fn kill_group(&self) -> io::Result<()>;
    /// How it ended, once it has (reaps it on the direct path).
    fn exit_status(&mut self) -> Option<String>;
}

/// Starts VMMs, and runs short tools (`--version`, the KVM probe) to
/// completion through [`Spawner::run`].
pub trait Launcher: Spawner {
    /// `fds[i].0` becomes fd `fds[i].1` in the new process.
    fn start(&self, l: &Launch, fds: &[(BorrowedFd<'_>, RawFd)]) -> Result<Box<dyn VmmProcess>>;
    /// `direct` or `spawner`, for logs.
    fn kind(&self) -> &'static str;
    /// Whether [`Launch::jail`] can be honoured: new namespaces and mounts
    /// need the privileged spawner of a daemon running as root.
    fn can_jail(&self) -> bool;
    /// [`Spawner::run`] with `env` as the whole environment.
    fn run_env(
        &self,
        argv: &[OsString],
        env: &[(String, String)],
        deadline: Instant,
    ) -> Result<Output>;
}

/// The launcher tools and tests get by default.
pub fn direct() -> Arc<dyn Launcher> {
    Arc::new(Direct)
}

fn io_err(what: String, source: io::Error) -> VmError {
    VmError::Io {
        backend: NAME,
        what,
        source,
    }
}

fn utf8(a: &std::ffi::OsStr, what: &str) -> Result<String> {
    a.to_str()
        .map(str::to_string)
        .ok_or_else(|| VmError::Other(format!("{what} {a:?} is not UTF-8")))
}

// ---- through the spawner ---------------------------------------------------
//
// Written once for any [`SpawnService`] (the daemon's spawner client is
// the one in production), so `vm` needs no name from `harden::spawner`.

/// A VMM a [`SpawnService`] started.
struct Spawned<C> {
    child: C,
    pidfd: Pidfd,
}

impl<C: SpawnedChild> VmmProcess for Spawned<C> {
    fn pidfd(&self) -> &Pidfd {
        &self.pidfd
    }

    fn kill_group(&self) -> io::Result<()> {
        // The spawner signals the group (it started it with setsid). If it
        // is gone, its children got SIGKILL from their parent-death signal
        // already; the pidfd signal covers the window before that.
        let via_spawner = self.child.kill(libc::SIGKILL);
        self.pidfd.kill()?;
        match via_spawner {
            Ok(()) => Ok(()),
            Err(e) if !self.pidfd.is_alive() => {
                log::debug!("pid {}: spawner kill: {e}", self.pidfd.pid());
                Ok(())
            }
            Err(e) => Err(io::Error::other(e.to_string())),
        }
    }

    fn exit_status(&mut self) -> Option<String> {
        match self.child.try_status() {
            Ok(Some(st)) => Some(match (st.code, st.signal) {
                (Some(c), _) => format!("exit status: {c}"),
                (_, Some(s)) => format!("killed by signal {s}"),
                _ => "exited".into(),
            }),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        }
    }
}

impl<S: SpawnService> Launcher for S {
    fn start(&self, l: &Launch, fds: &[(BorrowedFd<'_>, RawFd)]) -> Result<Box<dyn VmmProcess>> {
        let argv = l
            .argv
            .iter()
            .map(|a| utf8(a, "argument"))
            .collect::<Result<Vec<_>>>()?;
        let prog = argv.first().cloned().unwrap_or_default();
        let req = SpawnRequest {
            argv,
            env: vec![],
            cwd: Some(utf8(l.cwd.as_os_str(), "cwd")?),
            uid: l.uid,
            gid: l.gid,
            netns: None,
            cgroups: l
                .cgroups
                .iter()
                .map(|c| utf8(c.as_os_str(), "cgroup"))
                .collect::<Result<Vec<_>>>()?,
            fds: fds.iter().map(|(_, t)| *t).collect(),
            new_process_group: true,
            limits: l.limits,
            jail: l.jail.clone(),
        };
        let pass: Vec<BorrowedFd<'_>> = fds.iter().map(|(f, _)| *f).collect();
        let child = self
            .spawn(&req, &pass)
            .map_err(|e| VmError::Other(format!("start {prog} through the spawner: {e}")))?;
        let fd = child
            .pidfd()
            .try_clone_to_owned()
            .map_err(|e| io_err(format!("dup pidfd of {prog} pid {}", child.pid()), e))?;
        let pidfd = Pidfd::from_owned(child.pid(), fd);
        Ok(Box::new(Spawned { child, pidfd }))
    }

    fn kind(&self) -> &'static str {
        SPAWNER
    }

    fn can_jail(&self) -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    fn run_env(
        &self,
        argv: &[OsString],
        env: &[(String, String)],
        deadline: Instant,
    ) -> Result<Output> {
        spawner_run_env(self, argv, env, deadline)
    }
}

impl<S: SpawnService> Spawner for S {
    fn run(&self, argv: &[OsString], deadline: Instant) -> Result<Output> {
        spawner_run_env(self, argv, &[], deadline)
    }
}

/// [`Spawner::run`] through the spawner, with `env` as the whole
/// environment: stdout and stderr captured, killed at `deadline`.
fn spawner_run_env(
    client: &impl SpawnService,
    argv: &[OsString],
    env: &[(String, String)],
    deadline: Instant,
) -> Result<Output> {
    let budget_ms = deadline
        .saturating_duration_since(Instant::now())
        .as_millis() as u64;
    let argv: Vec<String> = argv
        .iter()
        .map(|a| {
            a.to_str()
                .map(str::to_string)
                .ok_or_else(|| VmError::Other(format!("spawner: argument {a:?} is not UTF-8")))
        })
        .collect::<Result<_>>()?;
    let prog = argv.first().cloned().unwrap_or_default();
    let (uid, gid) = client.tool_identity(&prog);
    let io_err = |what: String, source: io::Error| VmError::Io {
        backend: SPAWNER,
        what,
        source,
    };
    let (out_r, out_w) = cloexec_pipe().map_err(|e| io_err("pipe".into(), e))?;
    let (err_r, err_w) = cloexec_pipe().map_err(|e| io_err("pipe".into(), e))?;
    let req = SpawnRequest {
        argv,
        env: env.to_vec(),
        cwd: Some("/".into()),
        uid,
        gid,
        fds: vec![1, 2],
        new_process_group: true,
        ..SpawnRequest::default()
    };
    let child = client
        .spawn(&req, &[out_w.as_fd(), err_w.as_fd()])
        .map_err(|e| VmError::Other(format!("start {prog}: {e}")))?;
    drop((out_w, err_w));
    let (stdout, stderr) = read_both(out_r, err_r, deadline);
    match child.wait_until(deadline) {
        Ok(Some(st)) => Ok(Output {
            code: st.code,
            stdout,
            stderr,
        }),
        Ok(None) => {
            let _ = child.kill(libc::SIGKILL);
            Err(VmError::Timeout {
                backend: SPAWNER,
                what: format!("{prog} (pid {}) to exit", child.pid()),
                ms: budget_ms,
            })
        }
        Err(e) => Err(VmError::Other(format!("{prog}: {e}"))),
    }
}

// ---- directly --------------------------------------------------------------

/// Fork and exec from the calling process (tools, tests, unhardened runs).
#[derive(Debug, Default, Clone, Copy)]
pub struct Direct;

impl Spawner for Direct {
    fn run(&self, argv: &[OsString], deadline: Instant) -> Result<Output> {
        DirectSpawner.run(argv, deadline)
    }
}

struct DirectChild {
    child: std::process::Child,
    pidfd: Pidfd,
}

impl VmmProcess for DirectChild {
    fn pidfd(&self) -> &Pidfd {
        &self.pidfd
    }

    fn kill_group(&self) -> io::Result<()> {
        // SAFETY: plain kill of our unreaped child's process group (setsid
        // made it the leader, so the pid cannot name another group).
        unsafe { libc::kill(-self.pidfd.pid(), libc::SIGKILL) };
        self.pidfd.kill()
    }

    fn exit_status(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(|s| s.to_string())
    }
}

/// In the child before exec: SIGKILL this VMM if the thread that started
/// it dies. Must run after any uid change, which clears the setting.
pub(crate) fn die_with_parent(parent: libc::pid_t) -> io::Result<()> {
    // SAFETY: prctl/getppid are async-signal-safe.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
        // The parent may already be gone.
        if libc::getppid() != parent {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

fn open_cgroup_procs(dir: &Path) -> Result<OwnedFd> {
    let p = dir.join("cgroup.procs");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .map_err(|e| io_err(format!("open {}", p.display()), e))?;
    Ok(f.into())
}

impl Launcher for Direct {
    fn start(&self, l: &Launch, fds: &[(BorrowedFd<'_>, RawFd)]) -> Result<Box<dyn VmmProcess>> {
        let Some((prog, args)) = l.argv.split_first() else {
            return Err(VmError::Other("launch: empty argv".into()));
        };
        if l.jail.is_some() {
            return Err(VmError::Other(
                "launch: the direct launcher cannot jail (see Launcher::can_jail)".into(),
            ));
        }
        let cg = l
            .cgroups
            .iter()
            .map(|d| open_cgroup_procs(d))
            .collect::<Result<Vec<_>>>()?;
        let cg_raw: Vec<RawFd> = cg.iter().map(AsRawFd::as_raw_fd).collect();
        let pairs: Vec<(RawFd, RawFd)> = fds.iter().map(|(f, t)| (f.as_raw_fd(), *t)).collect();
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .current_dir(&l.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_clear();
        let (uid, gid, limits) = (l.uid, l.gid, l.limits);
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the closure only makes async-signal-safe syscalls on fds
        // and plain data captured before fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                for cg in &cg_raw {
                    if libc::write(*cg, b"0\n".as_ptr().cast(), 2) != 2 {
                        return Err(io::Error::last_os_error());
                    }
                }
                // Sources to high numbers first, so placing one target
                // never overwrites a source still to be placed.
                let mut staged = [0 as RawFd; 16];
                if pairs.len() > staged.len() {
                    return Err(io::Error::from_raw_os_error(libc::EMFILE));
                }
                for (i, (src, _)) in pairs.iter().enumerate() {
                    let s = libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, 512);
                    if s < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    staged[i] = s;
                }
                for (i, (_, target)) in pairs.iter().enumerate() {
                    // dup2 clears close-on-exec on the target.
                    if libc::dup2(staged[i], *target) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if !limits.apply() {
                    return Err(io::Error::last_os_error());
                }
                if libc::geteuid() == 0 {
                    if libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0
                    {
                        return Err(io::Error::last_os_error());
                    }
                } else if libc::geteuid() != uid {
                    return Err(io::Error::from_raw_os_error(libc::EPERM));
                }
                die_with_parent(parent)
            });
        }
        let child = cmd.spawn().map_err(|e| {
            io_err(
                format!("start {} as uid {uid}", Path::new(prog).display()),
                e,
            )
        })?;
        drop(cg);
        let pidfd = Pidfd::open(child.id() as i32)
            .map_err(|e| io_err(format!("pidfd_open {}", child.id()), e))?;
        Ok(Box::new(DirectChild { child, pidfd }))
    }

    fn kind(&self) -> &'static str {
        "direct"
    }

    /// Namespaces need a fresh child of a single-threaded parent (a pid
    /// namespace cannot be entered after fork): only the spawner jails.
    fn can_jail(&self) -> bool {
        false
    }

    fn run_env(
        &self,
        argv: &[OsString],
        env: &[(String, String)],
        deadline: Instant,
    ) -> Result<Output> {
        DirectSpawner.run_env(argv, Some(env), deadline)
    }
}
