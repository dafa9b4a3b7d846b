//! The spawner: a small process forked at daemon start, before any
//! capability is dropped or filter installed, that starts the jailer and
//! QEMU for the daemon.
//!
//! Why a process: seccomp filters and no_new_privs are inherited across
//! fork and exec, and the daemon's filters forbid fork and exec outright.
//! The spawner keeps [`caps::SPAWNER`](super::caps::SPAWNER), not the
//! daemon's full privileges, and only runs programs its [`Policy`] names:
//! a compromised daemon can start the configured VMM tools, as root only
//! where the policy allows (the jailer, which drops to the VM's uid
//! itself), nothing else.
//!
//! Its own filter is a denylist (kernel modules, kexec, ptrace, bpf,
//! perf, keyrings, clock setting, open_by_handle_at, ...; see
//! [`SPAWNER_DENY`]): whatever it installs is inherited by the jailer,
//! Firecracker and QEMU, so it can only take away what none of them needs.
//!
//! Lifecycle: if the daemon goes away (EOF on the socket) the spawner kills
//! every process group it started and exits. If the spawner dies, the
//! client fails every pending and later request with
//! [`SpawnError::Died`] and calls the death hook; it cannot be restarted
//! because the daemon no longer holds the privileges to fork a new one, so
//! the daemon should exit and be restarted by its supervisor (which sweeps
//! orphans at start).

mod server;
pub mod wire;

use crate::sync::{lock, wait_timeout};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};

use super::seccomp::{Mode, ThreadKind};
use super::{caps, HardenError};
// The seam is `vm::launch`'s: the spawner serves its requests (their
// paths here stay for the spawner's users) and implements its traits.
pub use crate::vm::launch::{Bind, ExitStatus, Jail, ProcLimits, SpawnError, SpawnRequest};
use crate::vm::launch::{SpawnService, SpawnedChild};

/// Device nodes a jail may bind (every other bind is `nodev`).
pub const JAIL_DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/kvm",
];

/// Most binds one jail may have.
pub const MAX_JAIL_BINDS: usize = 128;

/// A program the spawner may run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub path: PathBuf,
    /// May run as uid 0 (the jailer, which must start as root).
    pub may_run_as_root: bool,
}

/// What the spawner agrees to do. Fixed at fork; the daemon cannot change it.
#[derive(Debug, Clone)]
pub struct Policy {
    pub programs: Vec<Program>,
    /// uids/gids a non-root program may run as.
    pub uids: std::ops::RangeInclusive<u32>,
    pub gids: std::ops::RangeInclusive<u32>,
    /// uid/gid of a short-lived tool that may not run as root (e.g.
    /// `firecracker --version`; [`SpawnerClient::tool_identity`]).
    pub tool_uid: u32,
    pub tool_gid: u32,
    /// Directories `netns` must be in.
    pub netns_dirs: Vec<PathBuf>,
    /// Directories `cgroup` must be below.
    pub cgroup_dirs: Vec<PathBuf>,
}

fn under(p: &str, dirs: &[PathBuf]) -> bool {
    let p = Path::new(p);
    p.is_absolute()
        && p.components().all(|c| {
            matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::RootDir
            )
        })
        && dirs.iter().any(|d| p.starts_with(d) && p != d)
}

impl Policy {
    fn program(&self, path: &str) -> Option<&Program> {
        self.programs.iter().find(|p| p.path == Path::new(path))
    }

    /// Why `req` is refused, if it is.
    pub fn check(&self, req: &SpawnRequest, nfds: usize) -> Result<(), String> {
        let Some(prog) = req.argv.first() else {
            return Err("empty argv".into());
        };
        let Some(rule) = self.program(prog) else {
            return Err(format!(
                "program {prog:?} is not in the spawner's allowlist"
            ));
        };
        if req.argv.len() > 512 || req.env.len() > 256 {
            return Err("more than 512 arguments or 256 environment entries".into());
        }
        let root = req.uid == 0 || req.gid == 0;
        if root && !(rule.may_run_as_root && req.uid == 0 && req.gid == 0) {
            if !rule.may_run_as_root {
                return Err(format!("{prog} may not run as uid/gid 0"));
            }
            return Err(format!(
                "{prog}: uid and gid must both be 0 or both unprivileged"
            ));
        }
        if !root && (!self.uids.contains(&req.uid) || !self.gids.contains(&req.gid)) {
            return Err(format!(
                "uid {} / gid {} outside the allowed ranges {:?} / {:?}",
                req.uid, req.gid, self.uids, self.gids
            ));
        }
        if nfds != req.fds.len() {
            return Err(format!(
                "{} fd targets listed but {nfds} fds passed",
                req.fds.len()
            ));
        }
        let mut seen = Vec::new();
        for t in &req.fds {
            if !(0..server::MAX_TARGET_FD).contains(t) || seen.contains(t) {
                return Err(format!("bad or repeated target fd {t}"));
            }
            seen.push(*t);
        }
        if let Some(ns) = &req.netns {
            if !under(ns, &self.netns_dirs) {
                return Err(format!("netns {ns:?} is not under {:?}", self.netns_dirs));
            }
        }
        if req.cgroups.len() > 16 {
            return Err("more than 16 cgroups".into());
        }
        for cg in &req.cgroups {
            if !under(cg, &self.cgroup_dirs) {
                return Err(format!("cgroup {cg:?} is not under {:?}", self.cgroup_dirs));
            }
        }
        if let Some(cwd) = &req.cwd {
            if !Path::new(cwd).is_absolute() {
                return Err(format!("cwd {cwd:?} must be absolute"));
            }
        }
        if let Some(j) = &req.jail {
            check_jail(j)?;
        }
        Ok(())
    }
}

/// Absolute, only normal components, not `/` itself.
fn plain_abs(p: &str) -> bool {
    let p = Path::new(p);
    p.is_absolute()
        && p.components().count() > 1
        && p.components().all(|c| {
            matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::RootDir
            )
        })
}

fn check_jail(j: &Jail) -> Result<(), String> {
    if !plain_abs(&j.root) {
        return Err(format!(
            "jail root {:?} is not a plain absolute path",
            j.root
        ));
    }
    if j.binds.len() > MAX_JAIL_BINDS {
        return Err(format!("more than {MAX_JAIL_BINDS} jail binds"));
    }
    let root = Path::new(&j.root);
    for (i, b) in j.binds.iter().enumerate() {
        if !plain_abs(&b.path) {
            return Err(format!(
                "jail bind {:?} is not a plain absolute path",
                b.path
            ));
        }
        let p = Path::new(&b.path);
        // Under the root it would be hidden by the root's own mount.
        if p.starts_with(root) {
            return Err(format!("jail bind {:?} is under the jail root", b.path));
        }
        // Nested binds would need mount points inside a read-only bind.
        if let Some(o) = j.binds[..i].iter().find(|o| {
            let o = Path::new(&o.path);
            o.starts_with(p) || p.starts_with(o)
        }) {
            return Err(format!("jail binds {:?} and {:?} overlap", o.path, b.path));
        }
        if p.starts_with("/proc") {
            return Err(format!("jail bind {:?}: no host /proc in a jail", b.path));
        }
    }
    Ok(())
}

/// Syscalls the spawner (and so every VMM it starts) may not make: they
/// answer EPERM (logged instead in [`Mode::Log`]).
pub const SPAWNER_DENY: &[libc::c_long] = &[
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_uselib,
    libc::SYS_vhangup,
    libc::SYS_lookup_dcookie,
    libc::SYS_fanotify_init,
];

fn deny_filter(mode: Mode) -> Result<BpfProgram, HardenError> {
    let e = |e: seccompiler::BackendError| HardenError::Seccomp(e.to_string());
    let rules = SPAWNER_DENY.iter().map(|nr| (*nr, Vec::new())).collect();
    let action = match mode {
        Mode::Log => SeccompAction::Log,
        _ => SeccompAction::Errno(libc::EPERM as u32),
    };
    let arch = std::env::consts::ARCH.try_into().map_err(e)?;
    BpfProgram::try_from(SeccompFilter::new(rules, SeccompAction::Allow, action, arch).map_err(e)?)
        .map_err(e)
}

/// A forked spawner whose client side is not started yet (starting it
/// starts a thread, which must wait until `harden::apply` has run).
pub struct Forked {
    sock: OwnedFd,
    pid: i32,
    policy: Policy,
}

/// Fork the spawner. Call while the process is single-threaded and before
/// `harden::apply`. The child drops to [`caps::SPAWNER`], sets
/// no_new_privs (which still lets the jailer, exec'd as root, keep the
/// spawner's capabilities and setuid itself), installs the denylist and
/// serves requests.
pub fn fork_spawner(policy: Policy, mode: Mode) -> Result<Forked, HardenError> {
    super::require_single_threaded("spawner::fork_spawner")?;
    let filter = if mode == Mode::Off {
        None
    } else {
        Some(deny_filter(mode)?)
    };
    let mut sv = [0; 2];
    // SAFETY: socketpair writes two fds into our array.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    } != 0
    {
        return Err(super::sys("socketpair(AF_UNIX, SOCK_SEQPACKET)"));
    }
    // SAFETY: both fds are new and owned here.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    // SAFETY: single-threaded (checked above), so the child can run Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(super::sys("fork spawner"));
    }
    if pid == 0 {
        drop(ours);
        if let Err(e) = spawner_setup(filter.as_ref()) {
            eprintln!("agent-sandbox spawner: {e}");
            // SAFETY: leave without the parent's destructors.
            unsafe { libc::_exit(1) };
        }
        server::run(theirs, policy);
    }
    drop(theirs);
    Ok(Forked {
        sock: ours,
        pid,
        policy,
    })
}

fn spawner_setup(filter: Option<&BpfProgram>) -> Result<(), HardenError> {
    // SAFETY: prctl with integer arguments.
    unsafe {
        // The spawner must not outlive the daemon even if the socket EOF
        // were missed: SIGHUP (blocked, read from a signalfd) when the
        // daemon dies, handled like EOF: kill what we started, exit. It
        // also must not be ptraced or dumped.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGHUP, 0, 0, 0);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::setsid();
    }
    super::apply_rlimits(None)?;
    caps::drop_to(caps::SPAWNER)?;
    if let Some(f) = filter {
        // Sets no_new_privs first; audited (FLAG_LOG), so a syscall the
        // denylist refuses QEMU leaves a record.
        super::seccomp::apply_logged(f)
            .map_err(|e| HardenError::Seccomp(format!("spawner filter: {e}")))?;
    } else {
        // SAFETY: prctl with integer arguments.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(super::sys("prctl(PR_SET_NO_NEW_PRIVS)"));
        }
    }
    Ok(())
}

impl Forked {
    /// Pid of the spawner process.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Start the client's reader thread (kind [`ThreadKind::SpawnerClient`]).
    pub fn start_client(self) -> Result<SpawnerClient, HardenError> {
        let inner = Arc::new(Inner {
            sock: self.sock,
            pid: self.pid,
            policy: self.policy,
            next_id: AtomicU64::new(1),
            state: Mutex::new(State::default()),
            exits: Mutex::new(HashMap::new()),
            on_death: Mutex::new(None),
        });
        let r = inner.clone();
        super::thread::spawn(
            ThreadKind::SpawnerClient,
            std::thread::Builder::new().name("spawner-client".into()),
            move || r.read_loop(),
        )
        .map_err(|e| HardenError::Sys {
            what: "spawn spawner-client thread".into(),
            source: e,
        })?;
        Ok(SpawnerClient { inner })
    }
}

#[derive(Debug, Clone)]
enum ExitState {
    Exited(ExitStatus),
    SpawnerDied(String),
}

#[derive(Default)]
struct ExitSlot {
    st: Mutex<Option<ExitState>>,
    cv: Condvar,
}

impl ExitSlot {
    fn set(&self, s: ExitState) {
        let mut g = lock(&self.st);
        if g.is_none() {
            *g = Some(s);
        }
        self.cv.notify_all();
    }
}

type Answer = (wire::Reply, Vec<OwnedFd>, Option<Arc<ExitSlot>>);

#[derive(Default)]
struct State {
    pending: HashMap<u64, Sender<Answer>>,
    dead: Option<String>,
}

type DeathHook = Box<dyn FnOnce(&str) + Send>;

struct Inner {
    sock: OwnedFd,
    pid: i32,
    policy: Policy,
    next_id: AtomicU64,
    state: Mutex<State>,
    exits: Mutex<HashMap<i32, Arc<ExitSlot>>>,
    on_death: Mutex<Option<DeathHook>>,
}

impl Inner {
    fn read_loop(&self) {
        let why = loop {
            match wire::recv(self.sock.as_raw_fd()) {
                Ok(None) => break "it closed its socket".to_string(),
                Ok(Some(m)) => match serde_json::from_slice::<wire::Reply>(&m.data) {
                    Ok(r) => self.dispatch(r, m.fds),
                    Err(e) => log::error!("spawner sent an unreadable reply: {e}"),
                },
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    log::error!("spawner reply: {e}")
                }
                Err(e) => break format!("recvmsg: {e}"),
            }
        };
        self.died(why);
    }

    fn died(&self, why: String) {
        let mut status = 0;
        // SAFETY: reaping our own child, the spawner; it has closed its
        // socket, so it is exiting.
        let r = unsafe { libc::waitpid(self.pid, &mut status, 0) };
        let how = if r == self.pid && libc::WIFSIGNALED(status) {
            format!(
                "pid {} killed by signal {}",
                self.pid,
                libc::WTERMSIG(status)
            )
        } else if r == self.pid && libc::WIFEXITED(status) {
            format!("pid {} exited with {}", self.pid, libc::WEXITSTATUS(status))
        } else {
            format!("pid {}", self.pid)
        };
        let msg = format!("{how}; {why}");
        log::error!("spawner died: {msg}");
        {
            let mut st = lock(&self.state);
            st.dead = Some(msg.clone());
            st.pending.clear(); // dropping the senders wakes every caller
        }
        for (_, slot) in lock(&self.exits).drain() {
            slot.set(ExitState::SpawnerDied(msg.clone()));
        }
        if let Some(hook) = lock(&self.on_death).take() {
            hook(&msg);
        }
    }

    fn dispatch(&self, r: wire::Reply, fds: Vec<OwnedFd>) {
        let id = match &r {
            wire::Reply::Exit {
                pid,
                code,
                signal,
                ours,
            } => {
                match lock(&self.exits).remove(pid) {
                    Some(slot) => slot.set(ExitState::Exited(ExitStatus {
                        code: *code,
                        signal: *signal,
                    })),
                    None if !ours => log::debug!("spawner reaped adopted pid {pid}"),
                    None => log::debug!("exit of pid {pid} nobody waits for"),
                }
                return;
            }
            wire::Reply::Spawned { id, .. } | wire::Reply::Killed { id } => *id,
            wire::Reply::Error { id, msg } => {
                if *id == 0 {
                    log::error!("spawner: {msg}");
                    return;
                }
                *id
            }
        };
        // Register the exit slot before anyone can see the pid, so an exit
        // notification right behind this reply is not lost.
        let slot = if let wire::Reply::Spawned { pid, .. } = &r {
            let s = Arc::new(ExitSlot::default());
            lock(&self.exits).insert(*pid, s.clone());
            Some(s)
        } else {
            None
        };
        let tx = lock(&self.state).pending.remove(&id);
        match tx {
            Some(tx) => {
                let _ = tx.send((r, fds, slot));
            }
            None => log::warn!("spawner answered request {id} nobody waits for"),
        }
    }

    fn call(
        &self,
        req: &wire::Request,
        id: u64,
        fds: &[RawFd],
        timeout: Duration,
    ) -> Result<Answer, SpawnError> {
        let data = serde_json::to_vec(req).map_err(|e| SpawnError::Failed(e.to_string()))?;
        let (tx, rx) = bounded(1);
        {
            let mut st = lock(&self.state);
            if let Some(d) = &st.dead {
                return Err(SpawnError::Died(d.clone()));
            }
            st.pending.insert(id, tx);
        }
        if let Err(e) = wire::send(self.sock.as_raw_fd(), &data, fds) {
            lock(&self.state).pending.remove(&id);
            return Err(SpawnError::Io {
                what: "send request".into(),
                source: e,
            });
        }
        match rx.recv_timeout(timeout) {
            Ok(a) => Ok(a),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                lock(&self.state).pending.remove(&id);
                Err(SpawnError::Timeout(timeout))
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(SpawnError::Died(
                lock(&self.state)
                    .dead
                    .clone()
                    .unwrap_or_else(|| "request dropped".into()),
            )),
        }
    }
}

/// The daemon's handle to the spawner. Cheap to clone; usable from any
/// thread.
#[derive(Clone)]
pub struct SpawnerClient {
    inner: Arc<Inner>,
}

/// How long a spawn or kill request may take to be answered (fork + exec
/// of a large binary under nested virtualisation is a few ms).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

impl SpawnerClient {
    pub fn pid(&self) -> i32 {
        self.inner.pid
    }

    /// The uid/gid a short-lived tool `prog` runs as: root where the
    /// policy lets that program run as root (the jailer), else the
    /// policy's tool uid/gid.
    pub fn tool_identity(&self, prog: &str) -> (u32, u32) {
        let policy = &self.inner.policy;
        if policy.program(prog).is_some_and(|p| p.may_run_as_root) {
            (0, 0)
        } else {
            (policy.tool_uid, policy.tool_gid)
        }
    }

    /// `Some(reason)` once the spawner has died.
    pub fn dead(&self) -> Option<String> {
        lock(&self.inner.state).dead.clone()
    }

    /// Called once, on the client thread, when the spawner dies (the
    /// daemon should mark itself not ready and exit for a restart).
    pub fn on_death(&self, hook: impl FnOnce(&str) + Send + 'static) {
        *lock(&self.inner.on_death) = Some(Box::new(hook));
    }

    /// Start a process. `fds[i]` becomes fd `req.fds[i]` in the child.
    pub fn spawn(&self, req: &SpawnRequest, fds: &[BorrowedFd<'_>]) -> Result<Child, SpawnError> {
        // Checked here too, for an error before any message is sent.
        self.inner
            .policy
            .check(req, fds.len())
            .map_err(SpawnError::Failed)?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let msg = wire::Request::Spawn {
            id,
            req: Box::new(req.clone()),
        };
        let (reply, mut got, slot) = self.inner.call(&msg, id, &raw, CALL_TIMEOUT)?;
        match (reply, slot) {
            (wire::Reply::Spawned { pid, .. }, Some(exit)) if got.len() == 1 => Ok(Child {
                pid,
                pidfd: got.remove(0),
                exit,
                group: req.new_process_group,
                client: self.clone(),
            }),
            (wire::Reply::Error { msg, .. }, _) => Err(SpawnError::Failed(msg)),
            (other, _) => Err(SpawnError::Failed(format!(
                "unexpected answer to spawn: {other:?} with {} fds",
                got.len()
            ))),
        }
    }

    /// Signal a process the spawner started (its process group if `group`
    /// and it was started with `new_process_group`).
    pub fn kill(&self, pid: i32, signal: i32, group: bool) -> Result<(), SpawnError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let msg = wire::Request::Kill {
            id,
            pid,
            signal,
            group,
        };
        match self.inner.call(&msg, id, &[], CALL_TIMEOUT)?.0 {
            wire::Reply::Killed { .. } => Ok(()),
            wire::Reply::Error { msg, .. } => Err(SpawnError::Failed(msg)),
            other => Err(SpawnError::Failed(format!(
                "unexpected answer to kill: {other:?}"
            ))),
        }
    }

    /// Send raw bytes as one message (tests: malformed requests).
    #[doc(hidden)]
    pub fn send_raw(&self, data: &[u8]) -> io::Result<()> {
        wire::send(self.inner.sock.as_raw_fd(), data, &[])
    }
}

/// A process started by the spawner (which is its parent and reaps it).
pub struct Child {
    pid: i32,
    pidfd: OwnedFd,
    exit: Arc<ExitSlot>,
    group: bool,
    client: SpawnerClient,
}

impl std::fmt::Debug for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Child").field("pid", &self.pid).finish()
    }
}

impl Child {
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A pidfd for the process, valid however long the process lives.
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    pub fn into_pidfd(self) -> OwnedFd {
        self.pidfd
    }

    /// Signal it (its whole group if it was started in one).
    pub fn kill(&self, signal: i32) -> Result<(), SpawnError> {
        self.client.kill(self.pid, signal, self.group)
    }

    /// Its exit status once known.
    pub fn try_status(&self) -> Result<Option<ExitStatus>, SpawnError> {
        match &*lock(&self.exit.st) {
            None => Ok(None),
            Some(ExitState::Exited(s)) => Ok(Some(*s)),
            Some(ExitState::SpawnerDied(m)) => Err(SpawnError::Died(m.clone())),
        }
    }

    /// Wait for the exit status until `deadline`; `Ok(None)` on timeout.
    pub fn wait_until(&self, deadline: Instant) -> Result<Option<ExitStatus>, SpawnError> {
        let mut g = lock(&self.exit.st);
        loop {
            match &*g {
                Some(ExitState::Exited(s)) => return Ok(Some(*s)),
                Some(ExitState::SpawnerDied(m)) => return Err(SpawnError::Died(m.clone())),
                None => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            g = wait_timeout(&self.exit.cv, g, left);
        }
    }
}

impl SpawnService for SpawnerClient {
    type Child = Child;

    fn spawn(&self, req: &SpawnRequest, fds: &[BorrowedFd<'_>]) -> Result<Child, SpawnError> {
        SpawnerClient::spawn(self, req, fds)
    }

    fn tool_identity(&self, prog: &str) -> (u32, u32) {
        SpawnerClient::tool_identity(self, prog)
    }
}

impl SpawnedChild for Child {
    fn pid(&self) -> i32 {
        Child::pid(self)
    }

    fn pidfd(&self) -> BorrowedFd<'_> {
        Child::pidfd(self)
    }

    fn kill(&self, signal: i32) -> Result<(), SpawnError> {
        Child::kill(self, signal)
    }

    fn try_status(&self) -> Result<Option<ExitStatus>, SpawnError> {
        Child::try_status(self)
    }

    fn wait_until(&self, deadline: Instant) -> Result<Option<ExitStatus>, SpawnError> {
        Child::wait_until(self, deadline)
    }
}
