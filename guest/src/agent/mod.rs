//! The guest agent: PID 1 of every sandbox VM (or an ordinary process in
//! tests). Accepts host connections and serves protocol requests.

pub mod audit;
pub mod conn;
mod exec;
mod files;
pub mod init;
pub mod mailbox;
mod procs;
mod spawn;
pub mod sys;

use crate::proto::{self, limits, ErrorBody, ErrorCode, Request, Response};
use mailbox::{Mailbox, Req};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Vsock(u32),
    /// virtio-serial port by name (`/sys/class/virtio-ports/*/name`).
    Serial(String),
}

impl std::str::FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, rest) = s.split_once(':').ok_or("expected KIND:ADDRESS")?;
        match kind {
            "unix" if !rest.is_empty() => Ok(Listen::Unix(rest.into())),
            "vsock" => rest
                .parse()
                .map(Listen::Vsock)
                .map_err(|e| format!("bad vsock port {rest:?}: {e}")),
            "serial" if !rest.is_empty() => Ok(Listen::Serial(rest.into())),
            _ => Err(format!(
                "unknown listen address {s:?} (unix:PATH, vsock:PORT, serial:NAME)"
            )),
        }
    }
}

pub struct Config {
    pub listen: Vec<Listen>,
    pub workspace: PathBuf,
    /// Running as the VM's init: reap orphans, power off on shutdown.
    pub pid1: bool,
    /// Environment every process starts with (before request overrides).
    pub env: Vec<(String, String)>,
    /// uid/gid of processes whose request names none (an image's `User`).
    pub default_user: Option<(u32, u32)>,
}

pub struct Agent {
    pub procs: procs::Procs,
    pub pool: procs::Pool,
    pub workspace: PathBuf,
    /// [`Config::default_user`].
    pub default_user: Option<(u32, u32)>,
    pub base_env: Vec<(String, String)>,
    /// `base_env` as ready-made `KEY=VALUE` C strings: most execs add
    /// nothing, so they reuse these instead of formatting every variable.
    pub base_envp: Vec<std::ffi::CString>,
    pub base_path: String,
    /// Kept open: stdin of every process started without one.
    pub dev_null: OwnedFd,
    pub started: Instant,
    pub pid1: bool,
    /// SIGIO arrivals, for the virtio-serial listener.
    sigio: (
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    ),
}

impl Agent {
    /// Relative paths live under the workspace; absolute paths are used as
    /// given (the VM itself is the isolation boundary).
    pub fn resolve(&self, p: &str) -> Result<PathBuf, String> {
        if p.len() > limits::MAX_PATH {
            return Err(format!("path longer than {} bytes", limits::MAX_PATH));
        }
        if p.contains('\0') {
            return Err("path contains a NUL byte".into());
        }
        if p.is_empty() {
            return Ok(self.workspace.clone());
        }
        let path = Path::new(p);
        Ok(if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.workspace.join(path)
        })
    }
}

/// Signals the agent handles synchronously on its signal thread. They are
/// blocked in every thread (set before any thread starts) and unblocked in
/// children by the spawn path.
fn handled_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local value.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [
            libc::SIGCHLD,
            libc::SIGIO,
            libc::SIGTERM,
            libc::SIGINT,
            libc::SIGHUP,
            libc::SIGPWR,
        ] {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Keeps freed memory in the allocator instead of handing it back to the
/// kernel after each request: with glibc's defaults every exec trimmed its
/// thread's heap (madvise) or unmapped its larger buffers, then faulted them
/// in again (plus mprotect to regrow a heap) on the next one. Those are
/// syscalls and page faults on the exec path, and under TCG the first exec
/// after a restore translates all of that kernel code anew. The agent's
/// peak use is a few MiB; this keeps at most that much more resident.
/// Must run before any other thread exists.
pub fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator parameters; no thread races it.
    unsafe {
        // Two arenas: the request threads share one instead of each growing
        // (and trimming) heaps of their own.
        libc::mallopt(libc::M_ARENA_MAX, 2);
        // Buffers up to 1 MiB come from the heap, not mmap/munmap per use.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        // Free memory at the top of a heap stays there up to 4 MiB.
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
    }
}

/// Must run before any other thread exists.
pub fn block_signals() {
    let set = handled_signals();
    // SAFETY: valid sigset pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

fn signal_thread(agent: Arc<Agent>) {
    let set = handled_signals();
    loop {
        // SAFETY: valid sigset pointer; info may be null.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        match sig {
            libc::SIGCHLD => procs::reap_all(&agent.procs),
            libc::SIGIO => {
                let _ = agent.sigio.0.try_send(());
            }
            libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGPWR => {
                if agent.pid1 {
                    // The kernel sends these to init on ctrl-alt-del and the
                    // like; only an explicit request ends the VM.
                    log::info!("ignoring signal {sig} as init");
                } else {
                    log::info!("signal {sig}: exiting");
                    kill_children(&agent);
                    std::process::exit(0);
                }
            }
            _ => {}
        }
    }
}

fn kill_children(agent: &Agent) {
    for pid in agent.procs.running_pids() {
        let _ = sys::kill_group(pid, libc::SIGKILL);
    }
}

/// Starts the agent and serves until shutdown. Returns only on a startup
/// error.
pub fn run(cfg: Config) -> Result<(), String> {
    sys::ensure_stdio();
    if !cfg.pid1 {
        // Orphans of our children come back to us to be reaped, as they
        // would to PID 1 in the VM, so no test leaves zombies behind.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    std::fs::create_dir_all(&cfg.workspace)
        .map_err(|e| format!("workspace {}: {e}", cfg.workspace.display()))?;
    let agent = Arc::new(Agent {
        procs: procs::Procs::default(),
        pool: procs::Pool::default(),
        workspace: cfg.workspace.clone(),
        default_user: cfg.default_user,
        base_envp: cfg
            .env
            .iter()
            .filter_map(|(k, v)| std::ffi::CString::new(format!("{k}={v}")).ok())
            .collect(),
        base_path: cfg
            .env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| DEFAULT_PATH.to_string()),
        base_env: cfg.env.clone(),
        dev_null: std::fs::File::open("/dev/null")
            .map(OwnedFd::from)
            .map_err(|e| format!("/dev/null: {e}"))?,
        started: Instant::now(),
        pid1: cfg.pid1,
        sigio: crossbeam_channel::bounded(1),
    });
    {
        let a = agent.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || signal_thread(a))
            .map_err(|e| format!("signal thread: {e}"))?;
    }
    let mut threads = Vec::new();
    for l in &cfg.listen {
        let a = agent.clone();
        let t = match l {
            Listen::Unix(path) => {
                let _ = std::fs::remove_file(path);
                let lst = std::os::unix::net::UnixListener::bind(path)
                    .map_err(|e| format!("bind {}: {e}", path.display()))?;
                std::thread::Builder::new()
                    .name("listen-unix".into())
                    .spawn(move || {
                        for s in lst.incoming() {
                            match s {
                                Ok(s) => spawn_conn(&a, OwnedFd::from(s)),
                                Err(e) => log::warn!("accept: {e}"),
                            }
                        }
                    })
            }
            Listen::Vsock(port) => {
                let lst = vsock::VsockListener::bind_with_cid_port(vsock::VMADDR_CID_ANY, *port)
                    .map_err(|e| format!("bind vsock port {port}: {e}"))?;
                let mut refused = Refusals::default();
                std::thread::Builder::new()
                    .name("listen-vsock".into())
                    .spawn(move || loop {
                        match lst.accept() {
                            // Only the host: a guest process reaching us
                            // through vsock loopback (CID 1) or its own CID
                            // would run as root whatever uid the API asked.
                            Ok((s, peer)) if peer.cid() != vsock::VMADDR_CID_HOST => {
                                drop(s);
                                refused.note(peer.cid(), peer.port());
                            }
                            Ok((s, _)) => {
                                // SAFETY: into_raw_fd hands over the stream's
                                // descriptor: the OwnedFd is its one owner.
                                let fd = unsafe { OwnedFd::from_raw_fd(s.into_raw_fd()) };
                                spawn_conn(&a, fd)
                            }
                            Err(e) => {
                                log::warn!("vsock accept: {e}");
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                    })
            }
            Listen::Serial(name) => {
                let dev = find_serial_port(name)
                    .ok_or_else(|| format!("no virtio-serial port named {name:?}"))?;
                std::thread::Builder::new()
                    .name("serial".into())
                    .spawn(move || serial_loop(&a, &dev))
            }
        }
        .map_err(|e| format!("listener thread: {e}"))?;
        threads.push(t);
    }
    // One line the host (and a human on the console) can wait for.
    println!("{} pid={}", proto::READY_LINE, std::process::id());
    for t in threads {
        let _ = t.join();
    }
    Err("all listeners stopped".into())
}

/// Connections refused for their peer, logged the first time and then at
/// most once per [`Refusals::EVERY`] with a count, so a guest process that
/// keeps trying cannot flood the console.
#[derive(Default)]
pub struct Refusals {
    last_log: Option<Instant>,
    unlogged: u64,
}

impl Refusals {
    pub const EVERY: Duration = Duration::from_secs(60);

    /// Count one refusal; true when it was logged.
    pub fn note(&mut self, cid: u32, port: u32) -> bool {
        self.unlogged += 1;
        if self.last_log.is_some_and(|t| t.elapsed() < Self::EVERY) {
            return false;
        }
        log::warn!(
            "refused {} vsock connection(s) not from the host (last from CID {cid} port {port})",
            self.unlogged
        );
        self.last_log = Some(Instant::now());
        self.unlogged = 0;
        true
    }
}

fn spawn_conn(agent: &Arc<Agent>, fd: OwnedFd) {
    let a = agent.clone();
    let r = std::thread::Builder::new()
        .name("conn".into())
        .spawn(move || {
            let reader = match fd.try_clone() {
                Ok(r) => File::from(r),
                Err(e) => {
                    log::error!("dup connection fd: {e}");
                    return;
                }
            };
            conn::serve(&a, reader, File::from(fd));
        });
    if let Err(e) = r {
        log::error!("cannot start connection thread: {e}");
    }
}

pub fn find_serial_port(name: &str) -> Option<PathBuf> {
    let rd = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for e in rd.flatten() {
        let n = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if n.trim() == name {
            return Some(Path::new("/dev").join(e.file_name()));
        }
    }
    None
}

/// virtio-serial has no accept(): the port reads EOF / polls HUP while no
/// host is attached and SIGIO announces a new one. Each attachment is a
/// fresh protocol connection (the host starts with a hello).
fn serial_loop(agent: &Arc<Agent>, dev: &Path) {
    let file = match std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        Ok(f) => f,
        Err(e) => {
            log::error!("open {}: {e}", dev.display());
            return;
        }
    };
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        libc::fcntl(fd, libc::F_SETOWN, libc::getpid());
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_ASYNC);
    }
    loop {
        let mut p = [libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }];
        let _ = sys::poll(&mut p, Some(Duration::from_millis(0)));
        if p[0].revents & libc::POLLHUP != 0 {
            // No host. SIGIO wakes us on connect; the timeout is only a
            // safety net against a lost signal.
            let _ = agent.sigio.1.recv_timeout(Duration::from_millis(500));
            continue;
        }
        let (r, w) = match (file.try_clone(), file.try_clone()) {
            (Ok(r), Ok(w)) => (r, w),
            _ => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        conn::serve(agent, r, w);
        log::info!("host detached from {}", dev.display());
    }
}

/// Runs one request on a worker thread.
pub fn handle(
    agent: &Arc<Agent>,
    mut req: Req,
    r: Request,
    mailbox: Mailbox,
    waker: Option<Arc<sys::Waker>>,
) {
    match r {
        Request::Exec(e) => match waker {
            Some(w) => exec::run(agent, req, mailbox, w, e),
            None => req.fail(ErrorBody::new(ErrorCode::Io, "exec without a waker")),
        },
        Request::Attach {
            proc,
            stdin,
            replay,
        } => exec::attach(agent, req, mailbox, proc, stdin, replay),
        Request::Signal { proc, signal } => {
            if !proto::signal::RANGE.contains(&signal) {
                return req.fail(ErrorBody::new(
                    ErrorCode::Invalid,
                    format!("bad signal number {signal}"),
                ));
            }
            with_running(agent, &mut req, proc, |p| {
                sys::kill_group(p.pid, signal).map_err(|e| ErrorBody::from_io(&e, "kill"))
            })
        }
        Request::Resize { proc, rows, cols } => with_running(agent, &mut req, proc, |p| {
            p.mailbox.send(mailbox::Msg::Resize { rows, cols });
            Ok(())
        }),
        Request::CloseStdin { proc } => with_running(agent, &mut req, proc, |p| {
            p.mailbox.send(mailbox::Msg::CloseStdin);
            Ok(())
        }),
        Request::ReadFile { path, offset, len } => files::read_file(agent, req, &path, offset, len),
        Request::WriteFile {
            path,
            mode,
            create_parents,
            append,
        } => files::write_file(agent, req, &path, mode, create_parents, append),
        Request::Stat { path } => files::stat(agent, req, &path),
        Request::List {
            path,
            recursive,
            max_entries,
        } => files::list(agent, req, &path, recursive, max_entries),
        Request::Mkdir {
            path,
            parents,
            mode,
        } => files::mkdir(agent, req, &path, parents, mode),
        Request::Remove { path, recursive } => files::remove(agent, req, &path, recursive),
        Request::Rename {
            from,
            to,
            overwrite,
        } => files::rename(agent, req, &from, &to, overwrite),
        Request::Restored {
            unix_time_ns,
            entropy_hex,
        } => match init::restored(unix_time_ns, &entropy_hex) {
            Ok(()) => req.respond(&Response::Ok),
            Err(e) => req.fail(e),
        },
        Request::Shutdown { poweroff } => {
            req.respond(&Response::Ok);
            drop(req);
            kill_children(agent);
            if agent.pid1 {
                init::power_down(poweroff);
            }
            std::process::exit(0);
        }
        Request::Ping => req.respond(&Response::Pong {
            uptime_ms: agent.started.elapsed().as_millis() as u64,
        }),
        Request::ListProcs => req.respond(&Response::Procs {
            procs: agent.procs.list(),
        }),
        Request::KillAll => kill_all(agent, req),
    }
}

fn kill_all(agent: &Agent, mut req: Req) {
    let wait = Duration::from_millis(limits::KILL_ALL_WAIT_MS);
    match spawn::kill_all(wait) {
        Some(Ok((processes, remaining))) => req.respond(&Response::Killed {
            processes,
            remaining,
        }),
        Some(Err(e)) => req.fail(ErrorBody::from_io(&e, "kill all")),
        // Not the VM's init (the local-process backend): the process
        // groups of our execs, which is all we know of.
        None => {
            let pids = agent.procs.running_pids();
            kill_children(agent);
            let deadline = Instant::now() + wait;
            let remaining = loop {
                let left = agent.procs.running_pids();
                let n = pids.iter().filter(|p| left.contains(p)).count() as u64;
                if n == 0 || Instant::now() >= deadline {
                    break n;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            req.respond(&Response::Killed {
                processes: pids.len() as u64,
                remaining,
            })
        }
    }
}

fn with_running(
    agent: &Agent,
    req: &mut Req,
    id: u64,
    f: impl FnOnce(&procs::Proc) -> Result<(), ErrorBody>,
) {
    let Some(p) = agent.procs.get(id) else {
        return req.fail(ErrorBody::new(
            ErrorCode::NotFound,
            format!("no process {id}"),
        ));
    };
    if crate::sync::lock(&p.state).exit.is_some() {
        return req.fail(ErrorBody::new(
            ErrorCode::NotFound,
            format!("process {id} has exited"),
        ));
    }
    match f(&p) {
        Ok(()) => req.respond(&Response::Ok),
        Err(e) => req.fail(e),
    }
}

#[cfg(test)]
mod tests {
    use super::Refusals;

    #[test]
    fn refusals_log_once_then_rate_limited() {
        let mut r = Refusals::default();
        assert!(r.note(1, 1024), "first refusal is logged");
        for _ in 0..1000 {
            assert!(!r.note(3, 1025), "repeats within the window are not");
        }
        assert_eq!(r.unlogged, 1000, "but counted for the next line");
    }
}
