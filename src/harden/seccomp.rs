//! seccomp-bpf allowlists per thread kind, compiled in-process with
//! `seccompiler`.
//!
//! Filters belong to a thread and are inherited by every thread it creates;
//! stacked filters only ever narrow (the kernel runs all of them and takes
//! the strictest answer). Hence the layout:
//!
//! - [`ThreadKind::Baseline`] (the union of every kind) goes on the main
//!   thread by `harden::apply`, so whatever the main thread or a library
//!   started from it does stays inside the daemon's whole syscall surface.
//! - Each other thread adds the allowlist of its kind before its loop:
//!   [`install_current`] at the top of the thread body, or
//!   `harden::thread::spawn`, which starts the thread from a broker thread
//!   that holds only the baseline (a session thread started from an HTTP
//!   worker would otherwise be limited to what HTTP workers may do).
//!
//! A forbidden syscall raises SIGSYS (`SECCOMP_RET_TRAP`); the handler
//! writes one line naming the syscall, its number and the thread kind to
//! stderr with write(2), then ends the whole process with exit status 159
//! (128 + SIGSYS). The whole process, not the thread: a thread that vanished
//! could hold locks or leave a session half torn down; a clean restart
//! sweeps orphans instead. [`Mode::Log`] (`AGENT_SANDBOX_SECCOMP=log`)
//! lets forbidden syscalls run and has the kernel log them
//! (`SECCOMP_RET_LOG`; `dmesg | grep type=1326`), for development.

use crate::sync::lock;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Once};

use super::HardenError;

/// What to do with a syscall outside the allowlist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// SIGSYS: log the syscall name, end the process.
    Enforce,
    /// Allow it, have the kernel log it (audit type 1326).
    Log,
    /// No filters at all.
    Off,
}

impl Mode {
    /// `AGENT_SANDBOX_SECCOMP` = `enforce` (default) | `log` | `off`.
    pub fn from_env() -> Result<Mode, HardenError> {
        match std::env::var("AGENT_SANDBOX_SECCOMP").as_deref() {
            Err(_) | Ok("") | Ok("enforce") => Ok(Mode::Enforce),
            Ok("log") => Ok(Mode::Log),
            Ok("off") => Ok(Mode::Off),
            Ok(other) => Err(HardenError::Config(format!(
                "AGENT_SANDBOX_SECCOMP={other:?}: want enforce, log or off"
            ))),
        }
    }

    fn mismatch(self) -> SeccompAction {
        match self {
            Mode::Log => SeccompAction::Log,
            _ => SeccompAction::Trap,
        }
    }
}

/// Kinds of daemon threads, each with its own allowlist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum ThreadKind {
    /// Union of all kinds; the main thread after `harden::apply`.
    Baseline = 1,
    /// HTTP acceptor and connection threads, stream pumps: TCP and Unix sockets,
    /// the key file.
    Http,
    /// Session and warm-pool threads: create and destroy sandboxes
    /// (network namespaces, netlink, jail files, agent sockets, spawner
    /// requests, pidfds).
    Session,
    /// Session reaper: looks at timers, sends stop commands.
    Reaper,
    /// Reads one agent connection (`src/agent`).
    AgentReader,
    /// Network teardown reaper (`src/net`): netlink, unmounting namespaces.
    NetReaper,
    /// Reads replies and exit notifications from the spawner process.
    SpawnerClient,
    /// A session's DNS forwarder (`src/net/dnsfwd`): moves to the host
    /// namespace, forwards queries upstream over UDP/TCP, adds answers to
    /// the session's nf_tables set.
    Dns,
    /// A session's inspection proxy (`src/net/proxy`): acceptor and
    /// connection threads inside the session namespace; TCP to the guest
    /// and upstream, UDP to the session's DNS forwarder.
    Proxy,
    /// The preview listener (`src/server/preview`): accepts on its own
    /// listening socket and relays between a client and a guest
    /// connection another thread made; it opens no socket and no file.
    Preview,
    /// The audit log's writer (`src/audit`): appends, fsyncs, renames and
    /// removes files under the audit dir; datagrams to /dev/log.
    Audit,
    /// The audit log's HTTP sink: POSTs batches over TCP.
    AuditSink,
}

impl ThreadKind {
    pub const ALL: &'static [ThreadKind] = &[
        ThreadKind::Baseline,
        ThreadKind::Http,
        ThreadKind::Session,
        ThreadKind::Reaper,
        ThreadKind::AgentReader,
        ThreadKind::NetReaper,
        ThreadKind::SpawnerClient,
        ThreadKind::Dns,
        ThreadKind::Proxy,
        ThreadKind::Preview,
        ThreadKind::Audit,
        ThreadKind::AuditSink,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Baseline => "baseline",
            ThreadKind::Http => "http",
            ThreadKind::Session => "session",
            ThreadKind::Reaper => "reaper",
            ThreadKind::AgentReader => "agent-reader",
            ThreadKind::NetReaper => "net-reaper",
            ThreadKind::SpawnerClient => "spawner-client",
            ThreadKind::Dns => "dns",
            ThreadKind::Proxy => "proxy",
            ThreadKind::Preview => "preview",
            ThreadKind::Audit => "audit",
            ThreadKind::AuditSink => "audit-sink",
        }
    }

    fn from_u8(v: u8) -> Option<ThreadKind> {
        ThreadKind::ALL.iter().copied().find(|k| *k as u8 == v)
    }

    /// The syscalls this kind may make.
    pub fn rules(self) -> Result<Rules, HardenError> {
        let mut r = Rules::default();
        base(&mut r)?;
        match self {
            ThreadKind::Baseline => {
                for k in ThreadKind::ALL
                    .iter()
                    .filter(|k| **k != ThreadKind::Baseline)
                {
                    r.merge(k.rules()?);
                }
                // The main thread waits for SIGTERM/SIGINT with sigwait.
                r.allow(
                    "the main thread waits for SIGTERM/SIGINT with sigwait",
                    &[libc::SYS_rt_sigtimedwait, libc::SYS_rt_sigpending],
                );
            }
            ThreadKind::Http => {
                threads(&mut r)?;
                fs_read(&mut r)?;
                fs_write(&mut r);
                sockets(&mut r, &[libc::AF_UNIX, libc::AF_INET, libc::AF_INET6])?;
            }
            ThreadKind::Session => {
                threads(&mut r)?;
                fs_read(&mut r)?;
                fs_write(&mut r);
                chown(&mut r);
                // INET: the session's DNS forwarder binds port 53 inside
                // the session namespace on the session thread.
                sockets(
                    &mut r,
                    &[
                        libc::AF_UNIX,
                        libc::AF_NETLINK,
                        libc::AF_INET,
                        libc::AF_INET6,
                    ],
                )?;
                netns(&mut r)?;
                pidfd(&mut r);
                // The sealed in-memory copy of a snapshot's RAM that
                // restored QEMUs map (vm/qemu/memory.rs, SnapshotMemory).
                r.allow(
                    "the sealed in-memory copy of a snapshot's RAM (SnapshotMemory)",
                    &[libc::SYS_memfd_create],
                );
            }
            ThreadKind::Reaper => {}
            ThreadKind::AgentReader => socket_io(&mut r),
            ThreadKind::NetReaper => {
                fs_read(&mut r)?;
                fs_write(&mut r);
                sockets(&mut r, &[libc::AF_NETLINK])?;
                netns(&mut r)?;
            }
            ThreadKind::SpawnerClient => {
                socket_io(&mut r);
                pidfd(&mut r);
            }
            ThreadKind::Proxy => {
                threads(&mut r)?;
                sockets(&mut r, &[libc::AF_INET])?;
            }
            ThreadKind::Preview => {
                threads(&mut r)?;
                socket_io(&mut r);
                r.allow(
                    "accepting on the preview listener",
                    &[libc::SYS_accept, libc::SYS_accept4],
                );
            }
            ThreadKind::Audit => {
                fs_read(&mut r)?;
                fs_write(&mut r);
                // Unbound datagram sockets for the syslog sink.
                sockets(&mut r, &[libc::AF_UNIX])?;
            }
            ThreadKind::AuditSink => {
                // Name lookups read resolv.conf/hosts; ureq may resolve
                // on a helper thread.
                threads(&mut r)?;
                fs_read(&mut r)?;
                sockets(
                    &mut r,
                    &[
                        libc::AF_INET,
                        libc::AF_INET6,
                        libc::AF_UNIX,
                        libc::AF_NETLINK,
                    ],
                )?;
                r.allow(
                    "glibc's resolver sends its A and AAAA queries together",
                    &[libc::SYS_sendmmsg, libc::SYS_recvmmsg],
                );
                r.allow("glibc's resolver names the host", &[libc::SYS_uname]);
            }
            ThreadKind::Dns => {
                fs_read(&mut r)?;
                sockets(&mut r, &[libc::AF_INET, libc::AF_INET6, libc::AF_NETLINK])?;
                r.allow_when(
                    "moving to the host namespace to forward queries upstream",
                    libc::SYS_setns,
                    vec![eq32(1, libc::CLONE_NEWNET as u64)],
                );
            }
        }
        Ok(r)
    }
}

/// One argument condition: `args[arg] <op> val`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cond {
    arg: u8,
    wide: bool,
    op: CondOp,
    val: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CondOp {
    Eq,
    /// `args[arg] & mask == val`
    Masked(u64),
}

fn eq32(arg: u8, val: u64) -> Cond {
    Cond {
        arg,
        wide: false,
        op: CondOp::Eq,
        val,
    }
}

fn eq64(arg: u8, val: u64) -> Cond {
    Cond {
        arg,
        wide: true,
        op: CondOp::Eq,
        val,
    }
}

fn masked64(arg: u8, mask: u64, val: u64) -> Cond {
    Cond {
        arg,
        wide: true,
        op: CondOp::Masked(mask),
        val,
    }
}

/// Allowed syscalls: unconditionally, or when any of several condition
/// lists (each ANDed) holds; each with the reasons it is allowed (as
/// `caps.rs` keeps a `why` with every capability), so the surface of a
/// thread kind is explained where it is defined.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    map: BTreeMap<i64, Allowed>,
}

#[derive(Debug, Clone, Default)]
struct Allowed {
    /// `None`: unconditionally.
    conds: Option<Vec<Vec<Cond>>>,
    why: Vec<&'static str>,
}

impl Allowed {
    fn because(&mut self, why: &'static str) {
        if !self.why.contains(&why) {
            self.why.push(why);
        }
    }
}

impl Rules {
    fn allow(&mut self, why: &'static str, nrs: &[libc::c_long]) {
        for nr in nrs {
            let a = self.map.entry(*nr).or_default();
            a.conds = None;
            a.because(why);
        }
    }

    fn allow_when(&mut self, why: &'static str, nr: libc::c_long, conds: Vec<Cond>) {
        let a = self.map.entry(nr).or_insert_with(|| Allowed {
            conds: Some(Vec::new()),
            why: Vec::new(),
        });
        a.because(why);
        // `None` means already unconditional: nothing to add.
        if let Some(v) = &mut a.conds {
            if !v.contains(&conds) {
                v.push(conds)
            }
        }
    }

    fn merge(&mut self, other: Rules) {
        for (nr, a) in other.map {
            for why in a.why {
                match &a.conds {
                    None => self.allow(why, &[nr]),
                    Some(list) => {
                        for c in list {
                            self.allow_when(why, nr, c.clone());
                        }
                    }
                }
            }
        }
    }

    /// Is `nr` allowed at all (with or without conditions)?
    pub fn mentions(&self, nr: libc::c_long) -> bool {
        self.map.contains_key(&nr)
    }

    /// Why `nr` is allowed (empty: it is not).
    pub fn why(&self, nr: libc::c_long) -> &[&'static str] {
        self.map.get(&nr).map_or(&[], |a| &a.why)
    }

    fn compile(&self, mode: Mode) -> Result<BpfProgram, HardenError> {
        let bpf = |e: seccompiler::BackendError| HardenError::Seccomp(e.to_string());
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        for (nr, a) in &self.map {
            let mut list = Vec::new();
            if let Some(alts) = &a.conds {
                for alt in alts {
                    let mut cs = Vec::new();
                    for c in alt {
                        let len = if c.wide { Len::Qword } else { Len::Dword };
                        let op = match c.op {
                            CondOp::Eq => Op::Eq,
                            CondOp::Masked(m) => Op::MaskedEq(m),
                        };
                        cs.push(SeccompCondition::new(c.arg, len, op, c.val).map_err(bpf)?);
                    }
                    list.push(SeccompRule::new(cs).map_err(bpf)?);
                }
            }
            rules.insert(*nr, list);
        }
        let filter = SeccompFilter::new(rules, mode.mismatch(), SeccompAction::Allow, arch()?)
            .map_err(bpf)?;
        BpfProgram::try_from(filter).map_err(bpf)
    }
}

fn arch() -> Result<TargetArch, HardenError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| HardenError::Seccomp(e.to_string()))
}

// ---- ioctl requests ---------------------------------------------------------

/// `KVM_GET_API_VERSION` (`_IO(KVMIO, 0x00)`): the QEMU backend's probe of
/// `/dev/kvm` (libc does not define the KVM ioctls).
pub const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

// ---- syscall groups -------------------------------------------------------

/// Every thread: memory, futexes, time, signals, I/O on fds it already has,
/// naming itself, installing further (narrower) filters, exiting.
fn base(r: &mut Rules) -> Result<(), HardenError> {
    use libc::*;
    r.allow(
        "I/O on descriptors the thread already holds",
        &[
            SYS_read,
            SYS_write,
            SYS_readv,
            SYS_writev,
            SYS_pread64,
            SYS_pwrite64,
            SYS_close,
            SYS_lseek,
            SYS_fstat,
            SYS_newfstatat,
            SYS_statx,
        ],
    );
    r.allow(
        "the allocator and thread stacks",
        &[
            SYS_mmap,
            SYS_munmap,
            SYS_mprotect,
            SYS_madvise,
            SYS_mremap,
            SYS_brk,
        ],
    );
    r.allow(
        "std::sync locks, condvars and thread parking",
        &[SYS_futex, SYS_sched_yield],
    );
    r.allow(
        "std::thread::available_parallelism",
        &[SYS_sched_getaffinity],
    );
    r.allow(
        "clocks, sleeps and timeouts",
        &[
            SYS_clock_gettime,
            SYS_clock_getres,
            SYS_gettimeofday,
            SYS_clock_nanosleep,
            SYS_nanosleep,
        ],
    );
    r.allow(
        "waiting on descriptors: poll loops, wakers, I/O timeouts",
        &[
            SYS_poll,
            SYS_ppoll,
            SYS_epoll_create1,
            SYS_epoll_ctl,
            SYS_epoll_wait,
            SYS_epoll_pwait,
            SYS_eventfd2,
            SYS_pipe2,
        ],
    );
    r.allow(
        "duplicating descriptors, O_NONBLOCK and FD_CLOEXEC",
        &[SYS_dup, SYS_dup3, SYS_fcntl],
    );
    r.allow("HashMap seeds, ids and tokens", &[SYS_getrandom]);
    r.allow(
        "signal masks and handlers: std's stack-overflow guard, the SIGSYS reporter",
        &[
            SYS_rt_sigprocmask,
            SYS_rt_sigaction,
            SYS_rt_sigreturn,
            SYS_sigaltstack,
            SYS_restart_syscall,
        ],
    );
    r.allow(
        "ending a thread or the process",
        &[SYS_exit, SYS_exit_group],
    );
    r.allow(
        "own ids, for logs and ownership checks",
        &[
            SYS_getpid,
            SYS_gettid,
            SYS_getuid,
            SYS_geteuid,
            SYS_getgid,
            SYS_getegid,
        ],
    );
    r.allow("glibc's thread start-up", &[SYS_set_robust_list, SYS_rseq]);
    r.allow(
        "abort() on a panic in a no-unwind path: tgkill(self, SIGABRT)",
        &[SYS_tgkill],
    );
    for (req, why) in [
        (FIONBIO, "ioctl FIONBIO: set_nonblocking on sockets"),
        (FIOCLEX, "ioctl FIOCLEX: close-on-exec"),
        (FIONCLEX, "ioctl FIONCLEX: clear close-on-exec"),
        (
            FIONREAD,
            "ioctl FIONREAD: bytes waiting on a socket or pipe",
        ),
        (TCGETS, "ioctl TCGETS: isatty, for the log's colours"),
    ] {
        r.allow_when(why, SYS_ioctl, vec![eq32(1, req)]);
    }
    for (op, why) in [
        (PR_SET_NAME, "prctl PR_SET_NAME: thread names"),
        (PR_GET_NAME, "prctl PR_GET_NAME: thread names"),
        (
            PR_SET_NO_NEW_PRIVS,
            "prctl PR_SET_NO_NEW_PRIVS: before a thread's own filter",
        ),
        (
            PR_GET_NO_NEW_PRIVS,
            "prctl PR_GET_NO_NEW_PRIVS: checking it",
        ),
        (
            PR_GET_DUMPABLE,
            "prctl PR_GET_DUMPABLE: checking the daemon stays undumpable",
        ),
    ] {
        r.allow_when(why, SYS_prctl, vec![eq32(0, op as u64)]);
    }
    r.allow_when(
        "installing a thread's own, narrower filter",
        SYS_seccomp,
        vec![eq32(0, SECCOMP_SET_MODE_FILTER as u64)],
    );
    r.allow_when(
        "reading rlimits (new_limit == NULL)",
        SYS_prlimit64,
        vec![eq64(2, 0)],
    );
    Ok(())
}

/// Starting threads (never processes: CLONE_THREAD must be set; clone3,
/// whose flags sit in memory where BPF cannot see them, is answered with
/// ENOSYS by the baseline's extra filter so glibc falls back to clone).
fn threads(r: &mut Rules) -> Result<(), HardenError> {
    let t = libc::CLONE_THREAD as u64;
    r.allow_when(
        "starting threads (CLONE_THREAD set)",
        libc::SYS_clone,
        vec![masked64(0, t, t)],
    );
    r.allow(
        "glibc tries clone3 first; the baseline's extra filter answers ENOSYS",
        &[libc::SYS_clone3],
    );
    Ok(())
}

fn fs_read(r: &mut Rules) -> Result<(), HardenError> {
    use libc::*;
    // Read-only opens: no O_WRONLY/O_RDWR, no O_CREAT/O_TRUNC.
    let wmask = (O_ACCMODE | O_CREAT | O_TRUNC) as u64;
    let why = "opening files read-only (no O_WRONLY/O_RDWR, O_CREAT, O_TRUNC)";
    r.allow_when(why, SYS_openat, vec![masked64(2, wmask, 0)]);
    r.allow_when(why, SYS_open, vec![masked64(1, wmask, 0)]);
    r.allow(
        "reading directories, links and file metadata",
        &[
            SYS_getdents64,
            SYS_readlink,
            SYS_readlinkat,
            SYS_access,
            SYS_faccessat,
            SYS_faccessat2,
            SYS_stat,
            SYS_lstat,
            SYS_statfs,
            SYS_fstatfs,
            SYS_getcwd,
        ],
    );
    Ok(())
}

fn fs_write(r: &mut Rules) {
    use libc::*;
    r.allow(
        "creating, changing and removing files (state dir, key file, jails, run dirs)",
        &[
            SYS_openat,
            SYS_open,
            SYS_mkdir,
            SYS_mkdirat,
            SYS_unlink,
            SYS_unlinkat,
            SYS_rmdir,
            SYS_rename,
            SYS_renameat,
            SYS_renameat2,
            SYS_link,
            SYS_linkat,
            SYS_symlink,
            SYS_symlinkat,
            SYS_chmod,
            SYS_fchmod,
            SYS_fchmodat,
            SYS_ftruncate,
            SYS_fsync,
            SYS_fdatasync,
            SYS_fallocate,
            SYS_utimensat,
            SYS_copy_file_range,
            SYS_sendfile,
        ],
    );
    r.allow("the VM id lock file, image locks", &[SYS_flock]);
}

fn chown(r: &mut Rules) {
    use libc::*;
    r.allow(
        "handing jail files, run dirs and snapshots to the VM's uid (caps.rs CAP_CHOWN)",
        &[SYS_chown, SYS_fchown, SYS_fchownat, SYS_lchown],
    );
}

/// I/O on sockets the thread already holds.
fn socket_io(r: &mut Rules) {
    use libc::*;
    r.allow(
        "I/O and options on sockets the thread already holds",
        &[
            SYS_sendmsg,
            SYS_recvmsg,
            SYS_sendto,
            SYS_recvfrom,
            SYS_shutdown,
            SYS_getsockopt,
            SYS_setsockopt,
            SYS_getsockname,
            SYS_getpeername,
        ],
    );
}

/// Creating sockets of the given families, and using them.
fn sockets(r: &mut Rules, families: &[libc::c_int]) -> Result<(), HardenError> {
    use libc::*;
    socket_io(r);
    r.allow(
        "connecting, listening and accepting",
        &[SYS_connect, SYS_bind, SYS_listen, SYS_accept, SYS_accept4],
    );
    for f in families {
        let why = match *f {
            AF_UNIX => "AF_UNIX sockets: agent, VMM and spawner sockets, the admin socket",
            AF_INET | AF_INET6 => "AF_INET/AF_INET6 sockets: the API, DNS forwarding",
            AF_NETLINK => "AF_NETLINK sockets: rtnetlink and nf_tables",
            _ => "sockets of a family this thread kind names",
        };
        r.allow_when(why, SYS_socket, vec![eq32(0, *f as u64)]);
        r.allow_when(why, SYS_socketpair, vec![eq32(0, *f as u64)]);
    }
    Ok(())
}

/// What `src/net` does on the calling thread: enter/leave session network
/// namespaces, pin them with bind mounts under /run/netns, open TAPs.
fn netns(r: &mut Rules) -> Result<(), HardenError> {
    use libc::*;
    r.allow_when(
        "creating a session's network namespace",
        SYS_unshare,
        vec![eq64(0, CLONE_NEWNET as u64)],
    );
    r.allow_when(
        "entering and leaving session network namespaces",
        SYS_setns,
        vec![eq32(1, CLONE_NEWNET as u64)],
    );
    for flags in [MS_BIND, MS_BIND | MS_REC, MS_SHARED | MS_REC] {
        r.allow_when(
            "pinning namespaces with bind mounts under /run/netns",
            SYS_mount,
            vec![eq64(3, flags)],
        );
    }
    r.allow_when(
        "unpinning a session's namespace",
        SYS_umount2,
        vec![eq32(1, MNT_DETACH as u64)],
    );
    for (req, why) in [
        (
            TUNSETIFF,
            "ioctl TUNSETIFF: creating or attaching a session's TAP",
        ),
        (
            TUNSETPERSIST,
            "ioctl TUNSETPERSIST: keeping the TAP for its VMM",
        ),
        (
            TUNSETOWNER,
            "ioctl TUNSETOWNER: the TAP's owner is the VM's uid",
        ),
        (
            TUNSETGROUP,
            "ioctl TUNSETGROUP: the TAP's group is the VM's gid",
        ),
        (
            KVM_GET_API_VERSION,
            "ioctl KVM_GET_API_VERSION: the QEMU backend's KVM probe",
        ),
    ] {
        r.allow_when(why, SYS_ioctl, vec![eq32(1, req)]);
    }
    Ok(())
}

/// Watching, signalling and reaping VMM processes by pidfd. Plain `kill`
/// too (QEMU teardown signals the VMM's process group): with CAP_KILL and
/// pidfd_send_signal allowed it adds no power.
fn pidfd(r: &mut Rules) {
    use libc::*;
    r.allow(
        "watching, signalling and reaping VMMs by pidfd",
        &[SYS_pidfd_open, SYS_pidfd_send_signal, SYS_waitid, SYS_wait4],
    );
    r.allow(
        "QEMU teardown signals the VMM's process group (no more power than pidfd_send_signal)",
        &[SYS_kill],
    );
}

// ---- installing -----------------------------------------------------------

type Cache = Mutex<BTreeMap<(ThreadKind, Mode), Arc<BpfProgram>>>;

fn cache() -> &'static Cache {
    static C: std::sync::OnceLock<Cache> = std::sync::OnceLock::new();
    C.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// The compiled filter of `kind` (cached).
pub fn program(kind: ThreadKind, mode: Mode) -> Result<Arc<BpfProgram>, HardenError> {
    let mut c = lock(cache());
    if let Some(p) = c.get(&(kind, mode)) {
        return Ok(p.clone());
    }
    let p = Arc::new(kind.rules()?.compile(mode)?);
    c.insert((kind, mode), p.clone());
    Ok(p)
}

/// The mode `harden::apply` chose; threads installing their own filter use it.
static MODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

pub(crate) fn set_mode(m: Mode) {
    let v = match m {
        Mode::Enforce => 1,
        Mode::Log => 2,
        Mode::Off => 3,
    };
    MODE.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The process-wide mode; `Off` until `harden::apply` (or [`set_mode`]) ran.
pub fn mode() -> Mode {
    match MODE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Mode::Enforce,
        2 => Mode::Log,
        _ => Mode::Off,
    }
}

thread_local! {
    /// The kind of the calling thread's newest filter, for the SIGSYS message.
    static KIND: Cell<u8> = const { Cell::new(0) };
}

/// Install the allowlist of `kind` on the calling thread in the process-wide
/// mode (nothing when hardening is off). Call it first thing in the thread
/// body, before the thread's loop.
pub fn install_current(kind: ThreadKind) -> Result<(), HardenError> {
    install_current_with(kind, mode())
}

/// Like [`install_current`] with an explicit mode.
pub fn install_current_with(kind: ThreadKind, mode: Mode) -> Result<(), HardenError> {
    if mode == Mode::Off {
        return Ok(());
    }
    install_sigsys_handler()?;
    let prog = program(kind, mode)?;
    if kind == ThreadKind::Baseline {
        // clone3 -> ENOSYS so glibc uses clone, whose flags BPF can check.
        let mut m = BTreeMap::new();
        m.insert(libc::SYS_clone3, Vec::new());
        let f = SeccompFilter::new(
            m,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
            arch()?,
        )
        .map_err(|e| HardenError::Seccomp(e.to_string()))?;
        let p = BpfProgram::try_from(f).map_err(|e| HardenError::Seccomp(e.to_string()))?;
        seccompiler::apply_filter(&p)
            .map_err(|e| HardenError::Seccomp(format!("install clone3 filter: {e}")))?;
    }
    apply_logged(&prog)
        .map_err(|e| HardenError::Seccomp(format!("install {} filter: {e}", kind.name())))?;
    KIND.with(|k| k.set(kind as u8));
    Ok(())
}

/// Installs `prog` on the calling thread under no_new_privs with
/// `SECCOMP_FILTER_FLAG_LOG`: the kernel then audits every action but
/// ALLOW (a trapped syscall of the daemon, one the spawner's denylist
/// refuses in QEMU), so `.ci/seccomp-audit` sees what it claims to see.
/// (seccompiler's `apply_filter` passes no flags: a RET_TRAP or RET_ERRNO
/// left no record.) Raw syscalls only, nothing allocated: fit for a child
/// between fork and exec.
pub fn apply_logged(prog: &BpfProgram) -> std::io::Result<()> {
    let len =
        u16::try_from(prog.len()).map_err(|_| std::io::Error::from_raw_os_error(libc::E2BIG))?;
    let fprog = libc::sock_fprog {
        len,
        // seccompiler's sock_filter is the kernel's struct sock_filter.
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with integer arguments; seccomp reads `fprog` and the
    // `len` instructions it points to, which outlive the call.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_LOG,
            &fprog as *const libc::sock_fprog,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

// ---- SIGSYS ---------------------------------------------------------------

/// Exit status of a process stopped for a forbidden syscall (128 + SIGSYS).
pub const SIGSYS_EXIT: i32 = 128 + libc::SIGSYS;

/// Name of syscall `nr` on this architecture ("?" when unknown).
pub fn syscall_name(nr: i64) -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(n) = usize::try_from(nr)
            .ok()
            .and_then(|i| super::sysnames_x86_64::NAMES.get(i))
        {
            if !n.is_empty() {
                return n;
            }
        }
    }
    let _ = nr;
    "?"
}

fn install_sigsys_handler() -> Result<(), HardenError> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        // SAFETY: installing a handler that only does async-signal-safe work.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                res = Err(HardenError::Seccomp(format!(
                    "sigaction(SIGSYS): {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
    });
    res
}

/// Small fixed buffer for building the message without allocating.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Line {
    fn push(&mut self, s: &[u8]) {
        for &b in s {
            if self.len < self.buf.len() {
                self.buf[self.len] = b;
                self.len += 1;
            }
        }
    }

    fn num(&mut self, mut v: u64) {
        let mut d = [0u8; 20];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&d[i..]);
    }
}

/// For a forbidden `open`/`openat`, the path it asked for (from the
/// saved registers: x86_64 passes arguments in rdi, rsi, ...).
#[cfg(target_arch = "x86_64")]
fn push_open_path(l: &mut Line, nr: i32, ctx: *mut libc::c_void) {
    let reg = match i64::from(nr) {
        libc::SYS_open => libc::REG_RDI,
        libc::SYS_openat => libc::REG_RSI,
        _ => return,
    };
    if ctx.is_null() {
        return;
    }
    // SAFETY: for SA_SIGINFO handlers the third argument is the interrupted
    // context; the register holds the pointer the thread passed to open,
    // a NUL-terminated string in this process (read at most 96 bytes).
    unsafe {
        let uc = ctx as *const libc::ucontext_t;
        let p = (*uc).uc_mcontext.gregs[reg as usize] as *const u8;
        if p.is_null() {
            return;
        }
        l.push(b" path \"");
        for i in 0..96 {
            let b = *p.add(i);
            if b == 0 {
                break;
            }
            l.push(&[b]);
        }
        l.push(b"\"");
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn push_open_path(_: &mut Line, _: i32, _: *mut libc::c_void) {}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // siginfo for SIGSYS: signo, errno, code (12 bytes + 4 padding), then
    // `void *_call_addr; int _syscall; unsigned _arch;`.
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers.
    let nr = unsafe { (info as *const u8).add(24).cast::<i32>().read_unaligned() };
    let kind = KIND.with(|k| k.get());
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    let mut l = Line {
        buf: [0; 256],
        len: 0,
    };
    l.push(b"agent-sandbox: seccomp: forbidden syscall ");
    l.push(syscall_name(i64::from(nr)).as_bytes());
    l.push(b" (");
    l.num(nr.max(0) as u64);
    l.push(b")");
    push_open_path(&mut l, nr, ctx);
    l.push(b" on ");
    l.push(
        ThreadKind::from_u8(kind)
            .map_or("unfiltered", |k| k.name())
            .as_bytes(),
    );
    l.push(b" thread ");
    l.num(tid.max(0) as u64);
    l.push(b"; stopping the process\n");
    // SAFETY: write(2) and exit_group(2) are async-signal-safe and allowed by
    // every filter.
    unsafe {
        libc::write(2, l.buf.as_ptr().cast(), l.len);
        libc::syscall(libc::SYS_exit_group, SIGSYS_EXIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(syscall_name(libc::SYS_read), "read");
        assert_eq!(syscall_name(libc::SYS_mount), "mount");
        assert_eq!(syscall_name(libc::SYS_ptrace), "ptrace");
        assert_eq!(syscall_name(libc::SYS_clone3), "clone3");
        assert_eq!(syscall_name(-1), "?");
        assert_eq!(syscall_name(100_000), "?");
    }

    #[test]
    fn every_kind_compiles_and_keeps_the_essentials() {
        for k in ThreadKind::ALL {
            let r = k.rules().expect("rules");
            for nr in [
                libc::SYS_write,
                libc::SYS_exit_group,
                libc::SYS_rt_sigreturn,
                libc::SYS_futex,
            ] {
                assert!(r.mentions(nr), "{k:?} lacks {}", syscall_name(nr));
            }
            for mode in [Mode::Enforce, Mode::Log] {
                assert!(!program(*k, mode).expect("compile").is_empty());
            }
        }
    }

    /// Every allowed syscall of every kind says why; the baseline keeps
    /// the reasons of the kinds it is the union of.
    #[test]
    fn every_rule_carries_its_reason() {
        let base = ThreadKind::Baseline.rules().expect("rules");
        for k in ThreadKind::ALL {
            let r = k.rules().expect("rules");
            for nr in r.map.keys() {
                let why = r.why(*nr);
                assert!(
                    !why.is_empty() && why.iter().all(|w| !w.trim().is_empty()),
                    "{k:?}: {} has no reason",
                    syscall_name(*nr)
                );
                for w in why {
                    assert!(base.why(*nr).contains(w), "baseline lost {w:?}");
                }
            }
        }
        let s = ThreadKind::Session.rules().expect("rules");
        assert!(s.why(libc::SYS_memfd_create)[0].contains("snapshot"));
        // One syscall, one reason per allowed argument: ioctl's names its requests.
        let ioctl = s.why(libc::SYS_ioctl);
        assert!(
            ioctl.iter().any(|w| w.starts_with("ioctl TUNSETIFF")),
            "{ioctl:?}"
        );
        assert!(ioctl
            .iter()
            .any(|w| w.starts_with("ioctl KVM_GET_API_VERSION")));
        assert!(s.why(libc::SYS_ptrace).is_empty());
    }

    #[test]
    fn nobody_execs_or_ptraces_and_baseline_covers_all() {
        let base = ThreadKind::Baseline.rules().expect("rules");
        for k in ThreadKind::ALL {
            let r = k.rules().expect("rules");
            for nr in [
                libc::SYS_execve,
                libc::SYS_execveat,
                libc::SYS_ptrace,
                libc::SYS_fork,
                libc::SYS_vfork,
                libc::SYS_init_module,
                libc::SYS_kexec_load,
                libc::SYS_bpf,
            ] {
                assert!(!r.mentions(nr), "{k:?} allows {}", syscall_name(nr));
            }
            for nr in r.map.keys() {
                assert!(base.mentions(*nr), "baseline lacks {}", syscall_name(*nr));
            }
        }
        let http = ThreadKind::Http.rules().expect("rules");
        assert!(!http.mentions(libc::SYS_mount));
        assert!(!http.mentions(libc::SYS_setns));
        assert!(!http.mentions(libc::SYS_unshare));
    }
}
