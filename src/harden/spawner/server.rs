//! The spawner process: one thread, a poll loop over the daemon's socket
//! and a signalfd for SIGCHLD. Never returns.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::wire::{self, Reply, Request};
use super::{Policy, SpawnRequest};

/// Fds the spawned program gets are placed at numbers below this.
pub const MAX_TARGET_FD: i32 = 256;
const STAGE_FD: i32 = 512;
const ERRPIPE_FD: i32 = 1000;

struct Server {
    sock: OwnedFd,
    policy: Policy,
    /// Processes we started: pid -> leads its own process group.
    children: BTreeMap<i32, bool>,
}

/// Entry point in the forked child. `sock` is the spawner's end.
pub(super) fn run(sock: OwnedFd, policy: Policy) -> ! {
    let mut s = Server {
        sock,
        policy,
        children: BTreeMap::new(),
    };
    let code = match s.main_loop() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("agent-sandbox spawner: {e}");
            1
        }
    };
    s.kill_all();
    // SAFETY: ending this process without running the daemon's atexit
    // handlers or destructors (they belong to the parent's state).
    unsafe { libc::_exit(code) }
}

fn err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Server {
    fn main_loop(&mut self) -> io::Result<()> {
        // Orphaned grandchildren (the VMM a daemonizing jailer leaves behind)
        // become ours, so their exits are seen and reported too.
        // SAFETY: prctl with integer arguments.
        if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
            return Err(err("prctl(PR_SET_CHILD_SUBREAPER)"));
        }
        let sigfd = sigchld_fd()?;
        loop {
            let mut p = [
                libc::pollfd {
                    fd: self.sock.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: sigfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds.
            let r = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
            if r < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err("poll"));
            }
            if p[1].revents != 0 {
                let hup = drain_signalfd(&sigfd);
                self.reap()?;
                if hup {
                    return Ok(()); // parent death signal: the daemon is gone
                }
            }
            if p[0].revents != 0 {
                match wire::recv(self.sock.as_raw_fd()) {
                    Ok(None) => return Ok(()), // the daemon is gone
                    Ok(Some(m)) => self.handle(&m.data, m.fds)?,
                    Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                        self.reply(
                            &Reply::Error {
                                id: 0,
                                msg: format!("bad message: {e}"),
                            },
                            None,
                        )?;
                    }
                    Err(e) => return Err(io::Error::new(e.kind(), format!("recvmsg: {e}"))),
                }
            }
        }
    }

    fn reply(&self, r: &Reply, fd: Option<RawFd>) -> io::Result<()> {
        let data = serde_json::to_vec(r).map_err(io::Error::other)?;
        let fds: Vec<RawFd> = fd.into_iter().collect();
        wire::send(self.sock.as_raw_fd(), &data, &fds)
            .map_err(|e| io::Error::new(e.kind(), format!("send reply: {e}")))
    }

    fn handle(&mut self, data: &[u8], fds: Vec<OwnedFd>) -> io::Result<()> {
        let req: Request = match serde_json::from_slice(data) {
            Ok(r) => r,
            Err(e) => {
                return self.reply(
                    &Reply::Error {
                        id: 0,
                        msg: format!("malformed request: {e}"),
                    },
                    None,
                )
            }
        };
        match req {
            Request::Spawn { id, req } => match self.spawn(&req, fds) {
                Ok((pid, pidfd)) => {
                    self.children.insert(pid, req.new_process_group);
                    self.reply(&Reply::Spawned { id, pid }, Some(pidfd.as_raw_fd()))
                }
                Err(msg) => self.reply(&Reply::Error { id, msg }, None),
            },
            Request::Kill {
                id,
                pid,
                signal,
                group,
            } => {
                let r = match self.children.get(&pid) {
                    None => Reply::Error {
                        id,
                        msg: format!("pid {pid} is not a running process of this spawner"),
                    },
                    Some(_) if !(0..=64).contains(&signal) => Reply::Error {
                        id,
                        msg: format!("bad signal {signal}"),
                    },
                    Some(&own_group) => {
                        let target = if group && own_group { -pid } else { pid };
                        // SAFETY: kill with integer arguments; pid is our child
                        // and not yet reaped, so it cannot have been reused.
                        if unsafe { libc::kill(target, signal) } == 0 {
                            Reply::Killed { id }
                        } else {
                            Reply::Error {
                                id,
                                msg: format!(
                                    "kill({target}, {signal}): {}",
                                    io::Error::last_os_error()
                                ),
                            }
                        }
                    }
                };
                self.reply(&r, None)
            }
        }
    }

    fn reap(&mut self) -> io::Result<()> {
        loop {
            let mut status = 0;
            // SAFETY: waitpid on any child, non-blocking.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                return Ok(());
            }
            let ours = self.children.remove(&pid).is_some();
            let (code, signal) = if libc::WIFEXITED(status) {
                (Some(libc::WEXITSTATUS(status)), None)
            } else if libc::WIFSIGNALED(status) {
                (None, Some(libc::WTERMSIG(status)))
            } else {
                continue;
            };
            self.reply(
                &Reply::Exit {
                    pid,
                    code,
                    signal,
                    ours,
                },
                None,
            )?;
        }
    }

    /// The daemon is gone: nothing would ever stop or reap what we started.
    fn kill_all(&mut self) {
        for (&pid, &group) in &self.children {
            // SAFETY: signalling our own unreaped children.
            unsafe { libc::kill(if group { -pid } else { pid }, libc::SIGKILL) };
        }
        while self.reap_blocking() {}
    }

    fn reap_blocking(&mut self) -> bool {
        if self.children.is_empty() {
            return false;
        }
        let mut status = 0;
        // SAFETY: waitpid on any child.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid <= 0 {
            return false;
        }
        self.children.remove(&pid);
        true
    }

    /// Check `req` against the policy, fork, set the child up and exec.
    /// Returns the pid and a pidfd once exec succeeded.
    fn spawn(&self, req: &SpawnRequest, fds: Vec<OwnedFd>) -> Result<(i32, OwnedFd), String> {
        self.policy.check(req, fds.len())?;
        let prep = Prepared::new(req, fds)?;
        let mut pipe = [0; 2];
        // SAFETY: pipe2 writes two fds into our array.
        if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("pipe2: {}", io::Error::last_os_error()));
        }
        // SAFETY: both fds were just created and are owned here.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
        // SAFETY: this process is single-threaded, so the child may run
        // anything; it only makes plain syscalls on data prepared above.
        // A jailed child is cloned straight into its new namespaces (a
        // pid namespace applies only to children, so it cannot be entered
        // after fork); with no stack given, clone returns twice like fork.
        let pid = unsafe {
            match &prep.jail {
                None => libc::fork(),
                Some(_) => {
                    let mut flags =
                        libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::SIGCHLD;
                    if prep.netns.is_none() {
                        flags |= libc::CLONE_NEWNET;
                    }
                    libc::syscall(
                        libc::SYS_clone,
                        flags as libc::c_ulong,
                        0usize,
                        0usize,
                        0usize,
                        0usize,
                    ) as libc::pid_t
                }
            }
        };
        if pid < 0 {
            return Err(format!("fork: {}", io::Error::last_os_error()));
        }
        if pid == 0 {
            drop(rd);
            prep.exec_child(wr);
        }
        drop(wr);
        // The child reports (step, errno) before exec fails; EOF = exec ok.
        let mut buf = [0u8; 8];
        let n = loop {
            // SAFETY: reading into a local buffer.
            let n = unsafe { libc::read(rd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break n;
            }
        };
        if n > 0 {
            let step = i32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
            let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
            let mut st = 0;
            // SAFETY: reaping the child that just failed.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            let what = match (step.checked_sub(BIND_STEP), &req.jail) {
                (Some(i), Some(j)) if i >= 0 => format!(
                    "jail: bind mount of {}",
                    j.binds.get(i as usize).map_or("?", |b| b.path.as_str())
                ),
                _ => STEPS
                    .get(step as usize)
                    .copied()
                    .unwrap_or("setup")
                    .to_string(),
            };
            return Err(format!(
                "{}: {what} failed: {}",
                req.argv.first().map(String::as_str).unwrap_or("?"),
                io::Error::from_raw_os_error(errno)
            ));
        }
        // SAFETY: our unreaped child, so the pid cannot have been reused.
        let pfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if pfd < 0 {
            return Err(format!("pidfd_open({pid}): {}", io::Error::last_os_error()));
        }
        // SAFETY: a new fd from the kernel.
        Ok((pid, unsafe { OwnedFd::from_raw_fd(pfd as RawFd) }))
    }
}

const STEPS: &[&str] = &[
    "setsid",
    "sigmask",
    "setns",
    "cgroup",
    "fd setup",
    "close fds",
    "chdir",
    "setgroups",
    "setgid",
    "setuid",
    "execve",
    "prctl(PR_SET_PDEATHSIG)",
    "setrlimit",
    "jail: making mounts private",
    "jail: tmpfs root",
    "jail: mount point",
    "jail: procfs",
    "jail: read-only root",
    "jail: pivot_root",
];

/// Error step of the jail's bind mount `i`: `BIND_STEP + i`.
const BIND_STEP: i32 = 100;

/// A [`super::Jail`] resolved before fork.
struct PreparedJail {
    root: CString,
    /// Directories to create in the new root, parents first.
    dirs: Vec<CString>,
    binds: Vec<PreparedBind>,
    /// Where the jail's procfs goes.
    proc_dir: Option<CString>,
}

struct PreparedBind {
    src: CString,
    /// The same path under the new root.
    dst: CString,
    is_dir: bool,
    /// Flags of the remount that makes it read-only (or noexec) and
    /// keeps the source mount's own restrictions.
    remount: libc::c_ulong,
}

impl PreparedJail {
    fn new(j: &super::Jail) -> Result<PreparedJail, String> {
        use std::os::unix::fs::FileTypeExt;
        let root = j.root.trim_end_matches('/');
        let inside = |p: &std::path::Path| cstr(&format!("{root}{}", p.display()), "jail path");
        let mut dirs: Vec<std::path::PathBuf> = Vec::new();
        let mut binds = Vec::with_capacity(j.binds.len());
        let add_dir = |d: &std::path::Path, dirs: &mut Vec<std::path::PathBuf>| {
            let mut anc: Vec<&std::path::Path> =
                d.ancestors().filter(|a| a.parent().is_some()).collect();
            anc.reverse();
            for a in anc {
                if !dirs.iter().any(|x| x == a) {
                    dirs.push(a.to_path_buf());
                }
            }
        };
        for b in &j.binds {
            let p = std::path::Path::new(&b.path);
            let m = std::fs::metadata(p).map_err(|e| format!("jail bind {}: {e}", b.path))?;
            if let Some(parent) = p.parent() {
                add_dir(parent, &mut dirs);
            }
            if m.is_dir() {
                add_dir(p, &mut dirs);
            }
            let src = cstr(&b.path, "jail bind")?;
            // SAFETY: statvfs is plain data; all-zero is a valid value.
            let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
            // SAFETY: a valid C string and a local struct to fill.
            if unsafe { libc::statvfs(src.as_ptr(), &mut st) } != 0 {
                return Err(format!(
                    "statvfs {}: {}",
                    b.path,
                    io::Error::last_os_error()
                ));
            }
            let mut remount = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID;
            for (st_flag, ms) in [
                (libc::ST_RDONLY, libc::MS_RDONLY),
                (libc::ST_NOEXEC, libc::MS_NOEXEC),
                (libc::ST_NODEV, libc::MS_NODEV),
            ] {
                if st.f_flag & st_flag != 0 {
                    remount |= ms;
                }
            }
            remount |= if b.writable {
                libc::MS_NOEXEC
            } else {
                libc::MS_RDONLY
            };
            let device =
                m.file_type().is_char_device() && super::JAIL_DEVICES.contains(&b.path.as_str());
            if !device {
                remount |= libc::MS_NODEV;
            }
            binds.push(PreparedBind {
                src,
                dst: inside(p)?,
                is_dir: m.is_dir(),
                remount,
            });
        }
        let proc_dir = if j.proc {
            let p = std::path::Path::new("/proc");
            add_dir(p, &mut dirs);
            Some(inside(p)?)
        } else {
            None
        };
        Ok(PreparedJail {
            root: cstr(root, "jail root")?,
            dirs: dirs.iter().map(|d| inside(d)).collect::<Result<_, _>>()?,
            binds,
            proc_dir,
        })
    }
}

/// Everything the child needs, allocated before fork.
struct Prepared {
    path: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    cwd: Option<CString>,
    netns: Option<OwnedFd>,
    cgroup_procs: Vec<OwnedFd>,
    devnull: OwnedFd,
    fds: Vec<OwnedFd>,
    targets: Vec<i32>,
    uid: u32,
    gid: u32,
    new_process_group: bool,
    limits: super::ProcLimits,
    jail: Option<PreparedJail>,
}

fn cstr(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} {s:?} contains a NUL byte"))
}

fn open(path: &str, flags: i32, what: &str) -> Result<OwnedFd, String> {
    let c = cstr(path, what)?;
    // SAFETY: open with a valid C string.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "open {what} {path}: {}",
            io::Error::last_os_error()
        ));
    }
    // SAFETY: a new fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Prepared {
    fn new(req: &SpawnRequest, fds: Vec<OwnedFd>) -> Result<Prepared, String> {
        let argv = req
            .argv
            .iter()
            .map(|a| cstr(a, "argument"))
            .collect::<Result<Vec<_>, _>>()?;
        let env = req
            .env
            .iter()
            .map(|(k, v)| {
                if k.is_empty() || k.contains('=') {
                    Err(format!("bad environment variable name {k:?}"))
                } else {
                    cstr(&format!("{k}={v}"), "environment entry")
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let netns = match &req.netns {
            Some(p) => Some(open(p, libc::O_RDONLY, "netns")?),
            None => None,
        };
        let cgroup_procs = req
            .cgroups
            .iter()
            .map(|p| {
                open(
                    &format!("{}/cgroup.procs", p.trim_end_matches('/')),
                    libc::O_WRONLY,
                    "cgroup",
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Prepared {
            path: cstr(&req.argv[0], "program")?,
            argv,
            env,
            cwd: req.cwd.as_deref().map(|c| cstr(c, "cwd")).transpose()?,
            netns,
            cgroup_procs,
            devnull: open("/dev/null", libc::O_RDWR, "null device")?,
            fds,
            targets: req.fds.clone(),
            uid: req.uid,
            gid: req.gid,
            new_process_group: req.new_process_group,
            limits: req.limits,
            jail: req.jail.as_ref().map(PreparedJail::new).transpose()?,
        })
    }

    /// In the forked child: never returns.
    fn exec_child(&self, errpipe: OwnedFd) -> ! {
        // SAFETY: plain syscalls on fds and buffers prepared before fork.
        unsafe {
            let ep = libc::fcntl(errpipe.as_raw_fd(), libc::F_DUPFD_CLOEXEC, ERRPIPE_FD);
            let fail = |step: i32| -> ! {
                let e = *libc::__errno_location();
                let mut b = [0u8; 8];
                b[..4].copy_from_slice(&step.to_ne_bytes());
                b[4..].copy_from_slice(&e.to_ne_bytes());
                libc::write(ep, b.as_ptr().cast(), 8);
                libc::_exit(127)
            };
            if ep < 0 {
                fail(4);
            }
            if self.new_process_group && libc::setsid() < 0 {
                fail(0);
            }
            // Blocked signals and ignored dispositions survive exec: reset.
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            if libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) != 0 {
                fail(1);
            }
            for sig in 1..32 {
                if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                    libc::signal(sig, libc::SIG_DFL);
                }
            }
            if let Some(ns) = &self.netns {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    fail(2);
                }
            }
            for cg in &self.cgroup_procs {
                if libc::write(cg.as_raw_fd(), b"0\n".as_ptr().cast(), 2) != 2 {
                    fail(3);
                }
            }
            // Received fds -> high staging numbers -> their targets, so a
            // target never overwrites a source still to be placed.
            let mut staged = Vec::with_capacity(self.fds.len());
            for f in &self.fds {
                let s = libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, STAGE_FD);
                if s < 0 {
                    fail(4);
                }
                staged.push(s);
            }
            for (s, t) in staged.iter().zip(&self.targets) {
                if libc::dup2(*s, *t) < 0 {
                    fail(4);
                }
            }
            for std in 0..3 {
                if !self.targets.contains(&std) && libc::dup2(self.devnull.as_raw_fd(), std) < 0 {
                    fail(4);
                }
            }
            // Everything else is closed at exec.
            let mut lo: u32 = 3;
            let mut sorted = self.targets.clone();
            sorted.sort_unstable();
            for t in sorted.into_iter().filter(|t| *t >= 3) {
                let t = t as u32;
                if t > lo
                    && libc::syscall(libc::SYS_close_range, lo, t - 1, libc::CLOSE_RANGE_CLOEXEC)
                        != 0
                {
                    fail(5);
                }
                lo = t + 1;
            }
            if libc::syscall(
                libc::SYS_close_range,
                lo,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            ) != 0
            {
                fail(5);
            }
            if let Some(j) = &self.jail {
                if let Err(step) = j.enter() {
                    fail(step);
                }
            }
            if let Some(cwd) = &self.cwd {
                if libc::chdir(cwd.as_ptr()) != 0 {
                    fail(6);
                }
            }
            if !self.limits.apply() {
                fail(12);
            }
            if libc::geteuid() == 0 && (self.uid != 0 || self.gid != 0) {
                if libc::setgroups(0, std::ptr::null()) != 0 {
                    fail(7);
                }
                if libc::setgid(self.gid) != 0 {
                    fail(8);
                }
                if libc::setuid(self.uid) != 0 {
                    fail(9);
                }
            }
            // Dies with the spawner, which dies with the daemon: no VMM
            // outlives them even if the spawner is killed outright (its
            // kill-all on exit covers only the ways it can notice). Set
            // after setuid, which clears it; the spawner is alive here (it
            // waits on our error pipe), so there is no missed-death race.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                fail(11);
            }
            let mut argv: Vec<*const libc::c_char> = self.argv.iter().map(|a| a.as_ptr()).collect();
            argv.push(std::ptr::null());
            let mut envp: Vec<*const libc::c_char> = self.env.iter().map(|a| a.as_ptr()).collect();
            envp.push(std::ptr::null());
            libc::execve(self.path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            fail(10)
        }
    }
}

impl PreparedJail {
    /// In the cloned child (own mount namespace), as root: build the new
    /// root and make it the process's `/`. `Err(step)` with errno set.
    ///
    /// # Safety
    /// Plain syscalls on prepared buffers; for a child between fork and exec.
    unsafe fn enter(&self) -> Result<(), i32> {
        let null = std::ptr::null::<libc::c_char>();
        let errno = || *libc::__errno_location();
        // Nothing mounted below may propagate to the host's mount table.
        if libc::mount(
            null,
            c"/".as_ptr(),
            null,
            libc::MS_REC | libc::MS_PRIVATE,
            null.cast(),
        ) != 0
        {
            return Err(13);
        }
        let tmpfs = c"tmpfs".as_ptr();
        if libc::mount(
            tmpfs,
            self.root.as_ptr(),
            tmpfs,
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"mode=0755,size=64k".as_ptr().cast(),
        ) != 0
        {
            return Err(14);
        }
        // The program's uid must traverse what is made here.
        let old_mask = libc::umask(0o022);
        for d in &self.dirs {
            if libc::mkdir(d.as_ptr(), 0o755) != 0 && errno() != libc::EEXIST {
                return Err(15);
            }
        }
        for (i, b) in self.binds.iter().enumerate() {
            let step = BIND_STEP + i as i32;
            if !b.is_dir {
                let fd = libc::open(
                    b.dst.as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o644,
                );
                if fd < 0 {
                    return Err(step);
                }
                libc::close(fd);
            }
            if libc::mount(
                b.src.as_ptr(),
                b.dst.as_ptr(),
                null,
                libc::MS_BIND,
                null.cast(),
            ) != 0
                || libc::mount(null, b.dst.as_ptr(), null, b.remount, null.cast()) != 0
            {
                return Err(step);
            }
        }
        libc::umask(old_mask);
        if let Some(p) = &self.proc_dir {
            let proc_ = c"proc".as_ptr();
            if libc::mount(
                proc_,
                p.as_ptr(),
                proc_,
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"subset=pid".as_ptr().cast(),
            ) != 0
            {
                return Err(16);
            }
        }
        if libc::mount(
            null,
            self.root.as_ptr(),
            null,
            libc::MS_REMOUNT
                | libc::MS_BIND
                | libc::MS_RDONLY
                | libc::MS_NOSUID
                | libc::MS_NODEV
                | libc::MS_NOEXEC,
            null.cast(),
        ) != 0
        {
            return Err(17);
        }
        // pivot_root(".", ".") stacks the old root on the new one; the
        // detach then drops the old root (and every host mount) for good.
        let dot = c".".as_ptr();
        if libc::chdir(self.root.as_ptr()) != 0
            || libc::syscall(libc::SYS_pivot_root, dot, dot) != 0
            || libc::umount2(dot, libc::MNT_DETACH) != 0
            || libc::chdir(c"/".as_ptr()) != 0
        {
            return Err(18);
        }
        Ok(())
    }
}

fn sigchld_fd() -> io::Result<OwnedFd> {
    // SAFETY: signal-set manipulation and signalfd on local data.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigaddset(&mut set, libc::SIGHUP);
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(err("sigprocmask(SIGCHLD, SIGHUP)"));
        }
        let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
        if fd < 0 {
            return Err(err("signalfd(SIGCHLD, SIGHUP)"));
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Read every pending signal; true if SIGHUP (parent death) was among them.
fn drain_signalfd(fd: &OwnedFd) -> bool {
    // struct signalfd_siginfo is 128 bytes, ssi_signo (u32) first.
    let mut buf = [0u8; 128 * 8];
    let mut hup = false;
    loop {
        // SAFETY: non-blocking read into a local buffer.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            return hup;
        }
        for rec in buf[..n as usize].chunks_exact(128) {
            let signo = u32::from_ne_bytes([rec[0], rec[1], rec[2], rec[3]]);
            hup |= signo == libc::SIGHUP as u32;
        }
    }
}
