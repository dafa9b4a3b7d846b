//! Exec: start a process and pump its stdio. One thread per process; it
//! sleeps in poll(2) on the process's pipes and an eventfd that the
//! connection reader and the reaper use to wake it.

use super::mailbox::{Grant, Mailbox, Msg, Req};
use super::procs::{exit_status, Proc, ProcState, Ring};
use super::spawn::{resolve_program, spawn, SpawnSpec};
use super::sys::{self, kill_group, read_nb, write_nb, Waker};
use super::Agent;
use crate::proto::{
    channel, fill_data_header, limits, ErrorBody, ErrorCode, Event, ExecRequest, Response,
    HEADER_LEN, INITIAL_WINDOW, MAX_DATA_CHUNK,
};
use crate::sync::lock;
use crossbeam_channel::Receiver;
use std::collections::VecDeque;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PIPE_SIZE: usize = 1 << 20;
/// After the process exits, how long a PTY may stay silent before we stop
/// waiting for the terminal layer to hand over its last bytes.
const PTY_DRAIN_GRACE: Duration = Duration::from_millis(100);
/// How long after its SIGKILL an exec's answer may wait for the process to
/// be reaped. Thousands of processes of a fork bomb in memory reclaim take
/// tens of seconds to die under emulation; the caller learns of the kill
/// now, and the rest is reaped in the background.
const KILL_GRACE: Duration = Duration::from_secs(2);

struct Prepared {
    path: CString,
    argv: Vec<CString>,
    argv_str: Vec<String>,
    envp: Vec<CString>,
    cwd: CString,
    uid: Option<u32>,
    gid: Option<u32>,
}

fn invalid(msg: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::Invalid, msg)
}

fn prepare(agent: &Agent, e: &ExecRequest) -> Result<Prepared, ErrorBody> {
    let argv_str: Vec<String> = match (&e.shell, e.argv.is_empty()) {
        (Some(s), true) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        (None, false) => e.argv.clone(),
        (Some(_), false) => return Err(invalid("set either argv or shell, not both")),
        (None, true) => return Err(invalid("argv is empty and no shell command given")),
    };
    if argv_str.len() > limits::MAX_ARGS {
        return Err(invalid(format!("more than {} arguments", limits::MAX_ARGS)));
    }
    if e.env.len() > limits::MAX_ENV {
        return Err(invalid(format!("more than {} variables", limits::MAX_ENV)));
    }
    for k in e.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(format!("bad environment variable name {k:?}")));
        }
    }
    let to_c = |s: &str, what: &str| sys::cstring(s, what).map_err(|e| invalid(e.to_string()));
    // The common case (no overrides) reuses the prepared base environment.
    let (envp, path_var) = if e.env.is_empty() && !e.clear_env {
        (agent.base_envp.clone(), agent.base_path.clone())
    } else {
        let mut env: Vec<(String, String)> = if e.clear_env {
            Vec::new()
        } else {
            agent.base_env.clone()
        };
        for (k, v) in &e.env {
            env.retain(|(ek, _)| ek != k);
            env.push((k.clone(), v.clone()));
        }
        let path = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| super::DEFAULT_PATH.to_string());
        let envp = env
            .iter()
            .map(|(k, v)| to_c(&format!("{k}={v}"), "environment"))
            .collect::<Result<Vec<_>, _>>()?;
        (envp, path)
    };
    let cwd = agent
        .resolve(e.cwd.as_deref().unwrap_or(""))
        .map_err(|m| invalid(format!("cwd: {m}")))?;
    if !cwd.is_dir() {
        return Err(ErrorBody::new(
            ErrorCode::NotFound,
            format!("cwd {} is not a directory", cwd.display()),
        ));
    }
    let prog = &argv_str[0];
    let path = resolve_program(prog, &path_var, &cwd).ok_or_else(|| {
        ErrorBody::new(ErrorCode::SpawnFailed, format!("{prog}: command not found"))
    })?;
    let argv = argv_str
        .iter()
        .map(|a| to_c(a, "argument"))
        .collect::<Result<Vec<_>, _>>()?;
    let cwd = CString::new(cwd.into_os_string().into_encoded_bytes())
        .map_err(|_| invalid("cwd contains a NUL byte"))?;
    // A request that names an identity gets exactly that; otherwise the
    // template's (an image's `User`), else root.
    let (uid, gid) = if e.uid.is_some() || e.gid.is_some() {
        (e.uid, e.gid)
    } else {
        agent
            .default_user
            .map_or((None, None), |(u, g)| (Some(u), Some(g)))
    };
    Ok(Prepared {
        uid,
        gid,
        path,
        argv,
        argv_str,
        envp,
        cwd,
    })
}

/// What [`spawn`] needs for request `e`, prepared and with its stdio.
fn spawn_spec<'a>(prep: &'a Prepared, io: &Stdio, e: &ExecRequest) -> SpawnSpec<'a> {
    SpawnSpec {
        path: &prep.path,
        argv: &prep.argv,
        envp: &prep.envp,
        cwd: &prep.cwd,
        stdio: io.child_fds,
        pty: e.pty.is_some(),
        uid: prep.uid,
        gid: prep.gid,
        memory_max: e.memory_max,
        cpu_max_us: e.cpu_max_us,
    }
}

/// The host-facing ends of the child's stdio.
struct Stdio {
    /// stdout (or the PTY master), stderr.
    outs: [Option<OwnedFd>; 2],
    stdin: Option<OwnedFd>,
    /// Child ends, closed once the child has them.
    child: Vec<OwnedFd>,
    child_fds: [RawFd; 3],
}

fn open_stdio(agent: &Agent, e: &ExecRequest) -> std::io::Result<Stdio> {
    if let Some(size) = e.pty {
        let mut master: libc::c_int = -1;
        let mut slave: libc::c_int = -1;
        let ws = libc::winsize {
            ws_row: size.rows.max(1),
            ws_col: size.cols.max(1),
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: valid out pointers and winsize; termios may be null.
        let r = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &ws,
            )
        };
        sys::cvt(r).map_err(|e| sys::ctx(e, "openpty"))?;
        // SAFETY: fresh descriptors we own.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        for fd in [master.as_raw_fd(), slave.as_raw_fd()] {
            // SAFETY: fcntl on descriptors we own.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        sys::set_nonblocking(master.as_raw_fd(), true)?;
        let writer = master.try_clone()?;
        let s = slave.as_raw_fd();
        return Ok(Stdio {
            outs: [Some(master), None],
            stdin: Some(writer),
            child_fds: [s, s, s],
            child: vec![slave],
        });
    }
    let (out_r, out_w) = sys::pipe()?;
    let (err_r, err_w) = sys::pipe()?;
    sys::grow_pipe(out_r.as_raw_fd(), PIPE_SIZE);
    sys::grow_pipe(err_r.as_raw_fd(), PIPE_SIZE);
    sys::set_nonblocking(out_r.as_raw_fd(), true)?;
    sys::set_nonblocking(err_r.as_raw_fd(), true)?;
    let mut child = Vec::with_capacity(3);
    let (stdin_host, stdin_child) = if e.stdin {
        let (r, w) = sys::pipe()?;
        sys::set_nonblocking(w.as_raw_fd(), true)?;
        let fd = r.as_raw_fd();
        child.push(r);
        (Some(w), fd)
    } else {
        // The agent's own /dev/null handle: dup'ed onto the child's fd 0.
        (None, agent.dev_null.as_raw_fd())
    };
    let child_fds = [stdin_child, out_w.as_raw_fd(), err_w.as_raw_fd()];
    child.push(out_w);
    child.push(err_w);
    Ok(Stdio {
        outs: [Some(out_r), Some(err_r)],
        stdin: stdin_host,
        child_fds,
        child,
    })
}

/// Runs an exec request to the end on the calling thread.
pub fn run(agent: &Arc<Agent>, req: Req, mailbox: Mailbox, waker: Arc<Waker>, e: ExecRequest) {
    if let Some(r) = start(agent, req, mailbox, waker, e) {
        r.run_to_end();
    }
}

/// After a restore under an emulator that translates guest code as it
/// first runs (see [`crate::proto::RestoreFixup::warm_up`]), called by the
/// connection thread after the hello (and after each ping that follows
/// it): if the host sends nothing on `stream` for
/// [`limits::WARM_UP_IDLE_MS`], runs one throwaway exec of `true` through
/// the same steps as a user's (resolve, pipes, spare cgroup, clone, child
/// steps, exec, exit, reap, cgroup refill) and returns true, so a command
/// sent later finds that path already translated. False when the host
/// sent something first: a host that sends its first command at once gets
/// no warm-up competing with it (and pays nothing for it: no thread is
/// made unless the wait ran out). The warm-up thread and its child run
/// under SCHED_IDLE, so a command that arrives meanwhile takes the vCPU
/// from them. Nothing of it is visible to the host: no process is
/// registered, no output kept.
pub fn warm_up_if_idle(agent: &Arc<Agent>, stream: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd: stream,
        events: libc::POLLIN,
        revents: 0,
    }];
    let wait = Duration::from_millis(limits::WARM_UP_IDLE_MS);
    if !matches!(sys::poll(&mut p, Some(wait)), Ok(0)) {
        return false;
    }
    let agent = agent.clone();
    let started = std::thread::Builder::new()
        .name("warm-up".into())
        .spawn(move || {
            let idle = libc::sched_param { sched_priority: 0 };
            // SAFETY: plain syscall on the calling thread with a valid param.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } < 0 {
                log::debug!("warm-up: SCHED_IDLE: {}", std::io::Error::last_os_error());
            }
            match warm_up(&agent) {
                Ok(()) => log::debug!("warm-up exec done"),
                Err(e) => log::info!("warm-up exec: {e}"),
            }
        });
    if let Err(e) = started {
        log::info!("warm-up thread: {e}");
    }
    true
}

fn warm_up(agent: &Agent) -> std::io::Result<()> {
    let e = ExecRequest {
        argv: vec!["true".into()],
        ..ExecRequest::default()
    };
    let prep = prepare(agent, &e).map_err(|e| std::io::Error::other(e.message))?;
    let mut io = open_stdio(agent, &e)?;
    let super::spawn::Spawned { pid, cgroup, pidfd } = spawn(&spawn_spec(&prep, &io, &e))?;
    io.child.clear();
    // Without a pidfd (kernels before 5.3) the reaper collects it; its
    // cgroup is removed once empty, like any busy exec cgroup.
    if let Some(fd) = pidfd.or_else(|| sys::pidfd_open(pid)) {
        let wait = |ms: u64| {
            let mut p = [libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            matches!(sys::poll(&mut p, Some(Duration::from_millis(ms))), Ok(1))
        };
        if !wait(limits::WARM_UP_TIMEOUT_MS) {
            match &cgroup {
                Some(cg) => cg.kill(),
                None => {
                    let _ = kill_group(pid, libc::SIGKILL);
                }
            }
            wait(1_000);
        }
        // The reaper thread may have collected it first: either is fine.
        let _ = sys::reap_pidfd(fd.as_raw_fd());
    }
    drop(io);
    drop(cgroup);
    super::spawn::prepare_exec_cgroup();
    Ok(())
}

/// A started exec whose process is being pumped. The connection reader
/// drives one foreground exec itself ([`Running::step`]), which keeps the
/// thread hop to a worker off the exec round trip; anything else runs on a
/// worker ([`Running::run_to_end`]).
pub struct Running {
    pump: Pump,
    req: Req,
    pfds: Vec<libc::pollfd>,
    slots: Vec<usize>,
}

/// Poll slot of a descriptor the caller of [`Running::step`] adds.
const SLOT_EXTRA: usize = usize::MAX - 1;

impl Running {
    pub fn run_to_end(mut self) {
        while !self.pump.done() {
            self.step(None);
        }
        self.finish();
    }

    /// Waits once for the process's descriptors, its mailbox and `extra`
    /// (readable), and handles what is ready. Returns whether `extra` is.
    pub fn step(&mut self, extra: Option<RawFd>) -> bool {
        let timeout = self.pump.poll_set(true, &mut self.pfds, &mut self.slots);
        if let Some(fd) = extra {
            self.pfds.push(libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
            self.slots.push(SLOT_EXTRA);
        }
        self.pump
            .wait_and_handle(&mut self.pfds, &self.slots, timeout, Some(&mut self.req))
    }

    pub fn done(&self) -> bool {
        self.pump.done()
    }

    /// Answers the request once the process is done.
    pub fn finish(mut self) {
        self.pump.conclude();
        let proc = self.pump.proc.clone();
        if self.pump.cancelled {
            self.req.fail(ErrorBody::new(
                ErrorCode::Cancelled,
                "cancelled; process group killed",
            ));
        } else if let Some(st) = lock(&proc.state).exit.clone() {
            self.req.respond(&Response::Exited(st));
        }
        self.pump.agent.procs.finished(&proc);
        // Answered: remove this exec's cgroup, then make the next one's.
        drop(self);
        super::spawn::prepare_exec_cgroup();
    }
}

/// Spawns the process of an exec request. A foreground exec is returned
/// for the caller to pump; a background one is answered at once and pumped
/// here to the end (`None`), as is a request that fails.
pub fn start(
    agent: &Arc<Agent>,
    mut req: Req,
    mailbox: Mailbox,
    waker: Arc<Waker>,
    e: ExecRequest,
) -> Option<Running> {
    let prep = match prepare(agent, &e) {
        Ok(p) => p,
        Err(err) => {
            req.fail(err);
            return None;
        }
    };
    let mut io = match open_stdio(agent, &e) {
        Ok(io) => io,
        Err(err) => {
            req.fail(ErrorBody::from_io(&err, "exec stdio"));
            return None;
        }
    };
    if e.audit && e.background {
        req.fail(invalid(
            "audit is for foreground execs: the record comes with the exec's answer",
        ));
        return None;
    }
    // Before the spawn: the "before" scan, and subscribed to process
    // events before the process exists.
    let audit = e.audit.then(|| super::audit::begin(&agent.workspace));
    let spec = spawn_spec(&prep, &io, &e);
    let started = Instant::now();
    let super::spawn::Spawned { pid, cgroup, pidfd } = match spawn(&spec) {
        Ok(r) => r,
        Err(err) => {
            req.fail(ErrorBody::new(
                ErrorCode::SpawnFailed,
                format!("cannot start {}: {err}", prep.argv_str[0]),
            ));
            return None;
        }
    };
    io.child.clear();
    if let Some(a) = &audit {
        a.spawned(pid);
    }
    let proc = Arc::new(Proc {
        id: agent.procs.next_id(),
        pid,
        argv: prep.argv_str,
        tag: e.tag.clone(),
        background: e.background,
        pty: e.pty.is_some(),
        started_unix_ms: sys::now_unix_ms(),
        started,
        mailbox,
        state: std::sync::Mutex::new(ProcState {
            exit: None,
            ring: Ring::new(if e.background {
                limits::BACKGROUND_BUFFER
            } else {
                0
            }),
            attachers: Vec::new(),
        }),
    });
    agent.procs.register(proc.clone(), started);
    let rx = req.rx.clone();
    let mut pump = Pump {
        pidfd: pidfd.or_else(|| sys::pidfd_open(pid)),
        cgroup,
        audit,
        agent: agent.clone(),
        proc: proc.clone(),
        outs: io.outs,
        stdin: io.stdin,
        stdin_q: VecDeque::new(),
        stdin_close: false,
        stdin_queued: 0,
        credit: [INITIAL_WINDOW as i64; 2],
        exit: None,
        rusage: None,
        exited_at: None,
        killed_at: None,
        deadline: e.timeout_ms.map(|ms| started + Duration::from_millis(ms)),
        timed_out: false,
        cancelled: false,
        pty: e.pty.is_some(),
        buf: vec![0u8; HEADER_LEN + MAX_DATA_CHUNK],
        waker,
        rx,
    };
    if e.background {
        req.respond(&Response::Started { proc: proc.id, pid });
        drop(req);
        super::spawn::prepare_exec_cgroup();
        pump.run();
        agent.procs.finished(&proc);
        return None;
    }
    if e.notify_start || e.pty.is_some() {
        req.event(&Event::Started { proc: proc.id, pid });
    }
    Some(Running {
        pump,
        req,
        pfds: Vec::with_capacity(5),
        slots: Vec::with_capacity(5),
    })
}

struct Pump {
    /// Exit notification straight from the kernel: saves the hop through
    /// the reaper thread on the exec hot path. The reaper remains the
    /// fallback (and races harmlessly: a child is reaped exactly once).
    pidfd: Option<OwnedFd>,
    /// The exec's own cgroup (PID 1 with user limits): removed with the
    /// pump, killed with the group.
    cgroup: Option<super::spawn::ExecCgroup>,
    /// Set for an audited exec: its record goes into the exit status.
    audit: Option<super::audit::Session>,
    agent: Arc<Agent>,
    proc: Arc<Proc>,
    outs: [Option<OwnedFd>; 2],
    stdin: Option<OwnedFd>,
    stdin_q: VecDeque<(Vec<u8>, usize, Option<Grant>)>,
    stdin_close: bool,
    /// Bytes queued for stdin and not yet written (and so not yet granted back).
    stdin_queued: usize,
    /// Bytes we may still send on channels 1 and 2 (foreground only).
    credit: [i64; 2],
    exit: Option<i32>,
    /// The reaped child's rusage: what is reported without a cgroup.
    rusage: Option<crate::proto::ResourceUsage>,
    exited_at: Option<Instant>,
    /// When [`Pump::kill`] first ran: the answer waits for the exit at
    /// most [`KILL_GRACE`] longer.
    killed_at: Option<Instant>,
    deadline: Option<Instant>,
    timed_out: bool,
    cancelled: bool,
    pty: bool,
    buf: Vec<u8>,
    waker: Arc<Waker>,
    rx: Receiver<Msg>,
}

impl Pump {
    fn kill(&mut self) {
        self.killed_at.get_or_insert_with(Instant::now);
        if let Err(e) = kill_group(self.proc.pid, libc::SIGKILL) {
            log::warn!("proc {}: {e}", self.proc.id);
        }
        // The process itself too, should it have left its group (without
        // a cgroup nothing else catches it): once it is SIGKILLed, the
        // answer may say so even before it is reaped (see reap_later).
        if let (Some(fd), None) = (&self.pidfd, self.exit) {
            if let Err(e) = sys::pidfd_signal(fd.as_raw_fd(), libc::SIGKILL) {
                log::warn!("proc {}: {e}", self.proc.id);
            }
        }
        if let Some(cg) = &self.cgroup {
            cg.kill();
        }
    }

    /// Pumps a background process to the end (output goes to its ring).
    fn run(&mut self) {
        let mut pfds: Vec<libc::pollfd> = Vec::with_capacity(4);
        let mut slots: Vec<usize> = Vec::with_capacity(4);
        while !self.done() {
            let timeout = self.poll_set(false, &mut pfds, &mut slots);
            self.wait_and_handle(&mut pfds, &slots, timeout, None);
        }
        self.conclude();
    }

    /// The process has exited and its output is drained.
    fn done(&self) -> bool {
        self.exit.is_some() && !self.outs.iter().any(Option::is_some)
    }

    /// Records the exit status for listings and attachers, with what the
    /// exec used: from its cgroup (still there: it goes with the pump),
    /// else the reaped child's rusage.
    fn conclude(&mut self) {
        let mut status = exit_status(self.exit.unwrap_or(0), self.proc.started, self.timed_out);
        match &self.cgroup {
            Some(cg) => {
                (status.usage, status.oom_killed) = cg.usage();
                // An OOM kill in the exec's cgroup kills its whole tree
                // (memory.oom.group); what a bomb forked in the kill's
                // window, or what still sits in reclaim, goes now.
                if status.oom_killed {
                    cg.kill();
                }
            }
            None => status.usage = self.rusage,
        }
        if let Some(a) = self.audit.take() {
            status.audit = Some(a.finish());
        }
        let mut st = lock(&self.proc.state);
        st.exit = Some(status);
        st.notify_attachers();
    }

    /// Fills the poll set; returns the poll timeout. `direct`: output goes
    /// to the foreground request (with flow control), not to the ring.
    fn poll_set(
        &self,
        direct: bool,
        pfds: &mut Vec<libc::pollfd>,
        slots: &mut Vec<usize>,
    ) -> Option<Duration> {
        pfds.clear();
        slots.clear();
        pfds.push(libc::pollfd {
            fd: self.waker.raw(),
            events: libc::POLLIN,
            revents: 0,
        });
        slots.push(usize::MAX);
        for (i, o) in self.outs.iter().enumerate() {
            if let Some(fd) = o {
                if !direct || self.credit[i] > 0 {
                    pfds.push(libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    slots.push(i);
                }
            }
        }
        if let (Some(fd), None) = (&self.pidfd, self.exit) {
            pfds.push(libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            slots.push(3);
        }
        if let Some(fd) = &self.stdin {
            if !self.stdin_q.is_empty() {
                pfds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                });
                slots.push(2);
            }
        }
        let now = Instant::now();
        let mut timeout = self.deadline.map(|d| d.saturating_duration_since(now));
        let grace = match (self.exited_at, self.killed_at) {
            // Process gone: output still in flight gets a short grace.
            (Some(t), _) => Some(t + PTY_DRAIN_GRACE),
            (None, Some(k)) => Some(k + KILL_GRACE),
            (None, None) => None,
        };
        if let Some(g) = grace {
            let g = g.saturating_duration_since(now);
            timeout = Some(timeout.map_or(g, |x| x.min(g)));
        }
        timeout
    }

    /// One poll over `pfds` and the handling of what is ready. Returns
    /// whether the caller's extra descriptor ([`SLOT_EXTRA`]) is ready.
    fn wait_and_handle(
        &mut self,
        pfds: &mut [libc::pollfd],
        slots: &[usize],
        timeout: Option<Duration>,
        mut direct: Option<&mut Req>,
    ) -> bool {
        let mut extra = false;
        let ready = match sys::poll(pfds, timeout) {
            Ok(n) => n,
            Err(e) => {
                log::error!("proc {}: {e}", self.proc.id);
                self.kill();
                std::thread::sleep(Duration::from_millis(10));
                0
            }
        };
        if ready > 0 {
            for (k, p) in pfds.iter().enumerate() {
                if p.revents == 0 {
                    continue;
                }
                match slots[k] {
                    usize::MAX => {
                        self.waker.drain();
                        self.drain_mailbox(direct.as_deref_mut());
                    }
                    SLOT_EXTRA => extra = true,
                    2 => self.write_stdin(),
                    3 => self.reap_pidfd(),
                    i => {
                        if !self.read_out(i, direct.as_deref_mut()) {
                            self.cancelled = true;
                            self.kill();
                        }
                    }
                }
            }
        }
        if let Some(d) = self.deadline {
            if Instant::now() >= d {
                self.timed_out = true;
                self.deadline = None;
                self.kill();
            }
        }
        if let (None, Some(k)) = (self.exit, self.killed_at) {
            if k.elapsed() >= KILL_GRACE {
                self.reap_later();
            }
        }
        if let Some(t) = self.exited_at {
            self.drain_after_exit(t, direct);
        }
        extra
    }

    /// The process was SIGKILLed [`KILL_GRACE`] ago and is still dying:
    /// record the kill as its end (SIGKILL cannot be caught, so that is how
    /// it ends) and leave the reaping to a worker. Its cgroup is removed
    /// once empty (see `ExecCgroup`).
    fn reap_later(&mut self) {
        log::warn!(
            "proc {} (pid {}): not reaped {KILL_GRACE:?} after SIGKILL; answering now, reaping in the background",
            self.proc.id,
            self.proc.pid
        );
        self.exit = Some(libc::SIGKILL);
        self.exited_at = Some(Instant::now());
        // Without a pidfd, the SIGCHLD reaper collects it (its status goes
        // to the unclaimed table, which is bounded).
        self.agent.procs.forget_pid(self.proc.pid);
        let Some(fd) = self.pidfd.take() else { return };
        let (id, pid) = (self.proc.id, self.proc.pid);
        self.agent.pool.execute(Box::new(move || {
            let mut p = [libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            loop {
                match sys::poll(&mut p, None) {
                    Ok(0) => continue,
                    Ok(_) => break,
                    Err(e) => {
                        log::error!("proc {id} (pid {pid}): {e}; left unreaped");
                        return;
                    }
                }
            }
            match sys::reap_pidfd(fd.as_raw_fd()) {
                Ok(Some(_)) => log::info!("proc {id} (pid {pid}): reaped after its answer"),
                Ok(None) => log::error!("proc {id} (pid {pid}): pidfd ready but not exited"),
                // The SIGCHLD reaper got it first (its status is unclaimed).
                Err(_) => log::info!("proc {id} (pid {pid}): reaped after its answer"),
            }
        }));
    }

    fn reap_pidfd(&mut self) {
        let Some(fd) = &self.pidfd else { return };
        match sys::reap_pidfd(fd.as_raw_fd()) {
            Ok(Some((raw, usage))) => {
                self.agent.procs.forget_pid(self.proc.pid);
                self.exit = Some(raw);
                self.rusage = Some(usage);
                self.exited_at = Some(Instant::now());
            }
            Ok(None) => {}
            // The reaper won the race; its message is on the way.
            Err(_) => self.pidfd = None,
        }
    }

    /// After the exit, pipes are read until empty, not until EOF: a
    /// grandchild left running in the background may hold them open
    /// forever. A PTY gets a grace period, because the terminal layer hands
    /// over the last output asynchronously.
    fn drain_after_exit(&mut self, exited_at: Instant, mut direct: Option<&mut Req>) {
        for i in 0..2 {
            while let Some(fd) = &self.outs[i] {
                if direct.is_some() && self.credit[i] <= 0 {
                    break;
                }
                let fd = fd.as_raw_fd();
                let mut probe = [libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                }];
                let readable =
                    matches!(sys::poll(&mut probe, Some(Duration::ZERO)), Ok(n) if n > 0);
                if readable {
                    if !self.read_out(i, direct.as_deref_mut()) {
                        self.cancelled = true;
                    }
                    continue;
                }
                if !self.pty || exited_at.elapsed() >= PTY_DRAIN_GRACE {
                    self.close_out(i, direct.as_deref_mut());
                }
                break;
            }
        }
    }

    /// No `Eof` frame: the final `Exited` answer ends every output channel,
    /// which saves two frames (and two host wake-ups) per exec.
    fn close_out(&mut self, i: usize, _direct: Option<&mut Req>) {
        self.outs[i] = None;
    }

    /// One read from output `i`. Returns false if the host connection is gone.
    fn read_out(&mut self, i: usize, direct: Option<&mut Req>) -> bool {
        let Some(fd) = &self.outs[i] else { return true };
        let max = match direct {
            Some(_) => (self.credit[i].max(0) as usize).min(MAX_DATA_CHUNK),
            None => MAX_DATA_CHUNK,
        };
        if max == 0 {
            return true;
        }
        let n = match read_nb(fd.as_raw_fd(), &mut self.buf[HEADER_LEN..HEADER_LEN + max]) {
            Ok(Some(0)) => {
                self.close_out(i, direct);
                return true;
            }
            Ok(Some(n)) => n,
            Ok(None) => return true,
            // EIO: PTY master after the last slave closed.
            Err(_) => {
                self.close_out(i, direct);
                return true;
            }
        };
        let ch = i as u16 + 1;
        match direct {
            Some(r) => {
                self.credit[i] -= n as i64;
                let frame = &mut self.buf[..HEADER_LEN + n];
                fill_data_header(frame, r.id, ch);
                r.writer().send(frame)
            }
            None => {
                let mut st = lock(&self.proc.state);
                st.ring.push(ch, &self.buf[HEADER_LEN..HEADER_LEN + n]);
                st.notify_attachers();
                true
            }
        }
    }

    fn write_stdin(&mut self) {
        let Some(fd) = &self.stdin else {
            self.stdin_q.clear();
            return;
        };
        let fd = fd.as_raw_fd();
        while let Some((data, off, grant)) = self.stdin_q.front_mut() {
            match write_nb(fd, &data[*off..]) {
                Ok(Some(n)) => {
                    *off += n;
                    if *off < data.len() {
                        continue;
                    }
                    if let Some(g) = grant {
                        g.writer.window(g.id, channel::STDIN, data.len() as u32);
                    }
                    self.stdin_queued -= data.len();
                    self.stdin_q.pop_front();
                }
                Ok(None) => return,
                Err(_) => {
                    // EPIPE: the process closed its stdin. Discard what is
                    // queued but hand the credit back so writers don't stall.
                    self.stdin_queued = 0;
                    for (d, _, g) in self.stdin_q.drain(..) {
                        if let Some(g) = g {
                            g.writer.window(g.id, channel::STDIN, d.len() as u32);
                        }
                    }
                    self.stdin = None;
                    return;
                }
            }
        }
        if self.stdin_close {
            self.stdin = None;
        }
    }

    fn queue_stdin(&mut self, bytes: Vec<u8>, grant: Option<Grant>) {
        if self.stdin.is_none() {
            if let Some(g) = grant {
                g.writer.window(g.id, channel::STDIN, bytes.len() as u32);
            }
            return;
        }
        self.stdin_queued += bytes.len();
        self.stdin_q.push_back((bytes, 0, grant));
        self.write_stdin();
    }

    fn drain_mailbox(&mut self, mut direct: Option<&mut Req>) {
        while let Ok(m) = self.rx.try_recv() {
            match m {
                Msg::Data { channel: 0, bytes } => {
                    let Some(r) = direct.as_deref_mut() else {
                        continue;
                    };
                    // Unwritten stdin may never exceed the window we granted.
                    if self.stdin_queued + bytes.len() > INITIAL_WINDOW as usize {
                        log::warn!("proc {}: host overran its stdin window", self.proc.id);
                        self.cancelled = true;
                        self.kill();
                        continue;
                    }
                    let g = r.grant();
                    self.queue_stdin(bytes, Some(g));
                }
                Msg::Data { .. } => {}
                Msg::Eof { channel: 0 } | Msg::CloseStdin => self.close_stdin(),
                Msg::Eof { .. } => {}
                Msg::Window { channel, credit } => {
                    if (1..=2).contains(&channel) {
                        let c = &mut self.credit[channel as usize - 1];
                        *c = (*c + credit as i64).min(i64::from(u32::MAX));
                    }
                }
                Msg::Cancel | Msg::Closed => {
                    if direct.is_some() {
                        self.cancelled = true;
                        self.kill();
                    }
                }
                Msg::Stdin { bytes, grant } => self.queue_stdin(bytes, Some(grant)),
                Msg::Resize { rows, cols } => self.resize(rows, cols),
                Msg::Exited(raw, usage) => {
                    if self.exit.is_none() {
                        self.exit = Some(raw);
                        self.rusage = usage;
                        self.exited_at = Some(Instant::now());
                    }
                }
                Msg::Notify => {}
            }
        }
    }

    fn close_stdin(&mut self) {
        if self.pty {
            // A terminal has no half-close: send EOF the way a user would.
            self.queue_stdin(vec![4], None);
            return;
        }
        self.stdin_close = true;
        if self.stdin_q.is_empty() {
            self.stdin = None;
        }
    }

    fn resize(&self, rows: u16, cols: u16) {
        let Some(fd) = &self.outs[0] else { return };
        if !self.pty {
            return;
        }
        let ws = libc::winsize {
            ws_row: rows.max(1),
            ws_col: cols.max(1),
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a valid winsize.
        unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    }
}

/// Attach to a background process: replay its buffered output, follow it
/// live, and optionally feed its stdin.
pub fn attach(
    agent: &Agent,
    mut req: Req,
    self_box: Mailbox,
    proc_id: u64,
    stdin: bool,
    replay: bool,
) {
    let Some(p) = agent.procs.get(proc_id) else {
        return req.fail(ErrorBody::new(
            ErrorCode::NotFound,
            format!("no process {proc_id}"),
        ));
    };
    if !p.background {
        return req.fail(invalid(format!(
            "process {proc_id} is a foreground exec; its output belongs to that request"
        )));
    }
    let pending = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut cursor = {
        let mut st = lock(&p.state);
        st.attachers.push(super::procs::Attacher {
            mailbox: self_box,
            pending: pending.clone(),
        });
        if replay {
            // From the very beginning: output already evicted is reported
            // as a `Dropped` event before the replay.
            0
        } else {
            st.ring.end
        }
    };
    let mut credit = [INITIAL_WINDOW as i64; 2];
    let mut buf = vec![0u8; HEADER_LEN + MAX_DATA_CHUNK];
    let outcome: Result<(), ErrorBody> = 'outer: loop {
        pending.store(false, std::sync::atomic::Ordering::Release);
        // Send everything the credit allows.
        loop {
            let st = lock(&p.state);
            if cursor < st.ring.start {
                let dropped = st.ring.start - cursor;
                cursor = st.ring.start;
                drop(st);
                req.event(&Event::Dropped { bytes: dropped });
                continue;
            }
            let Some(ch) = st.ring.channel_at(cursor) else {
                if let Some(exit) = st.exit.clone() {
                    drop(st);
                    req.respond(&Response::Exited(exit));
                    break 'outer Ok(());
                }
                break;
            };
            let c = &mut credit[ch as usize - 1];
            if *c <= 0 {
                break;
            }
            let Some((_, data)) = st.ring.read(cursor, (*c as usize).min(MAX_DATA_CHUNK)) else {
                break;
            };
            let n = data.len();
            buf[HEADER_LEN..HEADER_LEN + n].copy_from_slice(data);
            drop(st);
            *c -= n as i64;
            cursor += n as u64;
            fill_data_header(&mut buf[..HEADER_LEN + n], req.id, ch);
            if !req.writer().send(&buf[..HEADER_LEN + n]) {
                break 'outer Err(ErrorBody::new(ErrorCode::Unavailable, "connection closed"));
            }
        }
        let Ok(m) = req.rx.recv() else {
            break Err(ErrorBody::new(ErrorCode::Unavailable, "connection closed"));
        };
        match m {
            Msg::Window { channel, credit: n } if (1..=2).contains(&channel) => {
                let c = &mut credit[channel as usize - 1];
                *c = (*c + n as i64).min(i64::from(u32::MAX));
            }
            // The pump grants the credit back to this request once written.
            Msg::Data { channel: 0, bytes } if stdin => {
                p.mailbox.send(Msg::Stdin {
                    bytes,
                    grant: req.grant(),
                });
            }
            Msg::Eof { channel: 0 } if stdin => p.mailbox.send(Msg::CloseStdin),
            Msg::Cancel | Msg::Closed => {
                break Err(ErrorBody::new(ErrorCode::Cancelled, "attach cancelled"));
            }
            _ => {}
        }
    };
    lock(&p.state)
        .attachers
        .retain(|a| !Arc::ptr_eq(&a.pending, &pending));
    if let Err(e) = outcome {
        req.fail(e);
    }
}
