//! A running QEMU: its process, console, QMP connection and RAM, and the
//! [`Vm`] operations on it (agent socket, snapshot, teardown).

use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::argv::MEM_BACKEND_ID;
use super::console::{Console, ConsoleLog};
use super::memory::{new_ram_file, GuestRam};
use super::stream::{self, MemTarget};
use super::{
    io_err, Accel, Timeouts, AGENT_SOCK, CONSOLE_LOG, NAME, SNAP_MEM_FILE, SNAP_STATE_FILE,
};
use crate::vm::cgroup;
use crate::vm::launch::Pidfd;
use crate::vm::launch::{Jail, Launch, Launcher, ProcLimits, VmmProcess};
use crate::vm::qmp::Qmp;
use crate::vm::snapshot::{self, Manifest};
use crate::vm::{CheckpointStats, Result, Vm, VmConfig, VmError};

pub struct QemuVm {
    pub(super) id: String,
    pub(super) cfg: VmConfig,
    pub(super) child: Option<Box<dyn VmmProcess>>,
    pub(super) pidfd: Option<Pidfd>,
    /// Its cgroups (`<cgroup parent>/<id>` in each hierarchy), removed at
    /// teardown.
    pub(super) cgroups: Vec<PathBuf>,
    pub(super) console: Arc<Console>,
    pub(super) qmp: Option<Qmp>,
    pub(super) timeouts: Timeouts,
    pub(super) vmm_version: String,
    pub(super) destroyed: bool,
    /// A booted VM's RAM (a restored one maps its snapshot's), kept to
    /// copy into a snapshot; dropped at teardown, which frees it.
    pub(super) ram: Option<GuestRam>,
    /// Saved into a snapshot: it must never run again.
    pub(super) saved: bool,
    /// Restored from a snapshot: its RAM is a private mapping, not a file.
    pub(super) restored: bool,
    /// KVM or TCG (resolved, never `Auto`).
    pub(super) accel: Accel,
}

impl QemuVm {
    pub(super) fn spawn(
        &mut self,
        launcher: &dyn Launcher,
        bin: &Path,
        argv: &[OsString],
        pass: &[(BorrowedFd<'_>, RawFd)],
        jail: Option<Jail>,
        limits: ProcLimits,
    ) -> Result<()> {
        let (rd, wr) = pipe().map_err(|e| io_err("create console pipe".into(), e))?;
        let log_path = self.cfg.run_dir.join(CONSOLE_LOG);
        let log = ConsoleLog::open(log_path.clone())
            .map_err(|e| io_err(format!("create {}", log_path.display()), e))?;
        let mut full = vec![bin.as_os_str().to_owned()];
        full.extend(argv.iter().cloned());
        let l = Launch {
            argv: full,
            cwd: self.cfg.run_dir.clone(),
            uid: self.cfg.uid,
            gid: self.cfg.gid,
            cgroups: self.cgroups.clone(),
            limits,
            jail,
        };
        let mut fds: Vec<(BorrowedFd<'_>, RawFd)> = vec![(wr.as_fd(), 1), (wr.as_fd(), 2)];
        fds.extend_from_slice(pass);
        let child = launcher.start(&l, &fds)?;
        let pidfd = child.pidfd();
        self.pidfd = Some(Pidfd::from_owned(
            pidfd.pid(),
            pidfd
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| io_err(format!("dup pidfd of QEMU pid {}", pidfd.pid()), e))?,
        ));
        self.child = Some(child);
        drop(fds);
        drop(wr); // only QEMU holds the console's write end now
        let console = self.console.clone();
        std::thread::Builder::new()
            .name(format!("console-{}", self.id))
            .spawn(move || console.run(rd, Some(log)))
            .map_err(|e| io_err("spawn console reader".into(), e))?;
        Ok(())
    }

    pub(super) fn alive(&self) -> bool {
        self.pidfd.as_ref().is_some_and(Pidfd::is_alive)
    }

    /// Turn a failure into one that says whether the VMM died, with the
    /// console tail, and tear everything down.
    pub(super) fn explain(&mut self, e: VmError, when: &str) -> VmError {
        // Let the console reader catch the last words of a dying VMM.
        if let Some(p) = &self.pidfd {
            p.wait_exit(Instant::now() + Duration::from_millis(100));
        }
        let died = !self.alive();
        if died {
            self.console
                .wait_eof(Instant::now() + Duration::from_millis(500));
        }
        let status = if died {
            self.child.as_mut().and_then(|c| c.exit_status())
        } else {
            None
        };
        let tail = self.console.tail();
        let _ = self.destroy();
        let what = if died {
            // QEMU's own complaints ("invalid kernel header") omit the file.
            format!(
                "VM {}: QEMU exited while {when} ({}; kernel {}, rootfs {})",
                self.id,
                status.unwrap_or_else(|| "status unknown".into()),
                self.cfg.kernel.display(),
                self.cfg.rootfs.display()
            )
        } else {
            format!("VM {}: {e} while {when}", self.id)
        };
        VmError::Api {
            backend: NAME,
            msg: if tail.is_empty() {
                format!("{what}; no console output")
            } else {
                format!("{what}; console: {tail}")
            },
        }
    }

    pub(super) fn wait_ready(&mut self, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        match self.console.wait_ready(deadline) {
            Ok(true) => Ok(()),
            Ok(false) => Err(VmError::Api {
                backend: NAME,
                msg: "QEMU exited before the agent was ready".into(),
            }),
            Err(()) => Err(VmError::Timeout {
                backend: NAME,
                what: "the agent's READY line on the console".into(),
                ms: start.elapsed().as_millis() as u64,
            }),
        }
    }

    pub(super) fn qmp(&mut self) -> Result<&mut Qmp> {
        self.qmp.as_mut().ok_or_else(|| VmError::Api {
            backend: NAME,
            msg: "no QMP connection".into(),
        })
    }

    /// Migrate the state in from `fd` and run (x-ignore-shared was set at
    /// launch).
    pub(super) fn load_state(&mut self, fd: RawFd) -> Result<()> {
        let t = self.timeouts.qmp;
        let deadline = Instant::now() + self.timeouts.migrate;
        let q = self.qmp()?;
        q.execute(
            "migrate-incoming",
            Some(json!({ "uri": format!("fd:{fd}") })),
            t,
        )?;
        q.wait_migration(deadline)?;
        // The source was paused when saved, so the VM stays paused until told.
        q.execute("cont", None, t)?;
        Ok(())
    }

    /// Path of the agent socket (for tools and tests).
    pub fn agent_socket(&self) -> PathBuf {
        self.cfg.run_dir.join(AGENT_SOCK)
    }

    /// The last lines of the console.
    pub fn console_tail(&self) -> String {
        self.console.tail()
    }

    /// How many blocks TCG has translated in this QEMU (HMP `info jit`),
    /// or `None` under KVM. The work of a restored guest under TCG is
    /// mostly translation, so this counts it independently of host speed.
    pub fn translated_blocks(&mut self) -> Option<u64> {
        let out = self
            .qmp_execute(
                "human-monitor-command",
                Some(json!({ "command-line": "info jit" })),
            )
            .ok()?;
        parse_tb_count(out.as_str()?)
    }

    /// Run a QMP command (diagnostics, tests).
    pub fn qmp_execute(&mut self, cmd: &str, args: Option<Value>) -> Result<Value> {
        if self.saved && cmd == "cont" {
            return Err(VmError::Other(format!(
                "VM {}: its RAM now belongs to a snapshot; it cannot run again",
                self.id
            )));
        }
        let t = self.timeouts.qmp;
        self.qmp()?.execute(cmd, args, t)
    }
}

/// `TB count            24018` in `info jit`.
pub(super) fn parse_tb_count(info_jit: &str) -> Option<u64> {
    info_jit
        .lines()
        .find_map(|l| l.trim().strip_prefix("TB count"))
        .and_then(|n| n.trim().parse().ok())
}

pub(super) fn pipe() -> io::Result<(fs::File, fs::File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are new and ours.
    Ok(unsafe { (fs::File::from_raw_fd(fds[0]), fs::File::from_raw_fd(fds[1])) })
}

/// `max-bandwidth` (bytes/s) of a checkpoint's migration: in effect
/// none (QEMU's default, 128 MiB/s, throttles even a stopped guest's).
const CKPT_BANDWIDTH: u64 = 64 << 30;

/// Migration capabilities that leave the stream as [`stream::split`] reads
/// it; a checkpoint refuses to run with any other switched on.
const STREAM_NEUTRAL_CAPS: &[&str] = &[
    "x-ignore-shared",
    "events",
    "validate-uuid",
    "late-block-activate",
    "zero-blocks",
    "auto-converge",
];

/// The files of a checkpoint being written into `dir`: temp files until
/// [`CkptFiles::commit`]; [`CkptFiles::discard`] removes every file (and
/// the directory, if this made it).
struct CkptFiles {
    dir: PathBuf,
    made_dir: bool,
    state_tmp: PathBuf,
    mem_tmp: PathBuf,
    /// `state` and `memory` (the temp files), open for writing.
    files: Option<(fs::File, fs::File)>,
    committed: Vec<PathBuf>,
}

impl CkptFiles {
    fn create(dir: &Path, mem_mib: u32) -> Result<CkptFiles> {
        let made_dir = match fs::metadata(dir) {
            Ok(m) if m.is_dir() => false,
            Ok(_) => {
                return Err(VmError::Other(format!(
                    "checkpoint dir {} is not a directory",
                    dir.display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| io_err(format!("create checkpoint dir {}", dir.display()), e))?;
                true
            }
            Err(e) => return Err(io_err(format!("stat {}", dir.display()), e)),
        };
        for f in [SNAP_STATE_FILE, SNAP_MEM_FILE, snapshot::MANIFEST_FILE] {
            if dir.join(f).exists() {
                return Err(VmError::Other(format!(
                    "checkpoint dir {} already holds {f}: a checkpoint goes into a new directory",
                    dir.display()
                )));
            }
        }
        let state_tmp = dir.join(format!(".{SNAP_STATE_FILE}.tmp"));
        let mem_tmp = dir.join(format!(".{SNAP_MEM_FILE}.tmp"));
        // Temp files of a checkpoint that did not finish (the daemon died).
        let _ = fs::remove_file(&state_tmp);
        let _ = fs::remove_file(&mem_tmp);
        let files = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&state_tmp)
            .map_err(|e| io_err(format!("create {}", state_tmp.display()), e))
            .and_then(|state| Ok((state, new_ram_file(&mem_tmp, mem_mib)?)));
        let mut c = CkptFiles {
            dir: dir.to_path_buf(),
            made_dir,
            state_tmp,
            mem_tmp,
            files: None,
            committed: Vec::new(),
        };
        match files {
            Ok(f) => {
                c.files = Some(f);
                Ok(c)
            }
            Err(e) => {
                c.discard();
                Err(e)
            }
        }
    }

    /// The open `state` and `memory` temp files.
    fn open(&self) -> Result<&(fs::File, fs::File)> {
        self.files.as_ref().ok_or_else(|| {
            VmError::Other(format!("checkpoint {}: files closed", self.dir.display()))
        })
    }

    /// Renames the temp files into place and writes the manifest last.
    fn commit(&mut self, inputs: &snapshot::Inputs<'_>) -> Result<()> {
        self.files = None;
        for (tmp, name) in [
            (self.state_tmp.clone(), SNAP_STATE_FILE),
            (self.mem_tmp.clone(), SNAP_MEM_FILE),
        ] {
            let to = self.dir.join(name);
            fs::rename(&tmp, &to)
                .map_err(|e| io_err(format!("rename {} to {}", tmp.display(), to.display()), e))?;
            self.committed.push(to);
        }
        Manifest::seal(&self.dir, inputs, &[SNAP_STATE_FILE, SNAP_MEM_FILE])?;
        self.committed.push(self.dir.join(snapshot::MANIFEST_FILE));
        Ok(())
    }

    fn discard(&mut self) {
        self.files = None;
        // The manifest's temp file too: a full disk can fail its write.
        let manifest_tmp = self.dir.join(format!(".{}.tmp", snapshot::MANIFEST_FILE));
        for p in [&self.state_tmp, &self.mem_tmp, &manifest_tmp]
            .into_iter()
            .chain(self.committed.iter())
        {
            let _ = fs::remove_file(p);
        }
        if self.made_dir {
            let _ = fs::remove_dir(&self.dir);
        }
    }

    /// Bytes the checkpoint takes on disk (allocated blocks).
    fn bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.committed
            .iter()
            .filter_map(|p| fs::metadata(p).ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }
}

/// A pipe's read end that waits at most until `deadline` for each read.
struct DeadlineReader {
    f: fs::File,
    deadline: Instant,
}

impl io::Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "QEMU sent no migration data in time",
                ));
            }
            let mut p = libc::pollfd {
                fd: self.f.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one pollfd we own, for the duration of the call.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n > 0 {
                return self.f.read(buf);
            }
        }
    }
}

impl QemuVm {
    /// Stops the guest, runs `save` and lets the guest run on, whatever
    /// `save` did; returns how long the guest was stopped.
    fn stopped<T>(&mut self, save: impl FnOnce(&mut Self) -> Result<T>) -> Result<(T, Duration)> {
        let t = self.timeouts.qmp;
        let t0 = Instant::now();
        self.qmp()?.execute("stop", None, t)?;
        let r = save(self);
        let c = self.qmp().and_then(|q| q.execute("cont", None, t));
        let paused = t0.elapsed();
        let v = r?;
        c.map_err(|e| {
            VmError::Other(format!(
                "VM {}: checkpoint written, but the guest did not run on: {e}",
                self.id
            ))
        })?;
        Ok((v, paused))
    }

    /// RAM shared with the daemon stays out of the stream, and nothing
    /// throttles it.
    fn set_ignore_shared(&mut self) -> Result<()> {
        let t = self.timeouts.qmp;
        let q = self.qmp()?;
        q.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] })),
            t,
        )?;
        q.execute(
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": CKPT_BANDWIDTH })),
            t,
        )?;
        Ok(())
    }

    /// A booted VM: the device state migrates into `state` (its RAM is the
    /// memfd, left out by x-ignore-shared), then the memfd is copied while
    /// the guest is still stopped.
    fn checkpoint_booted(&mut self, files: &CkptFiles) -> Result<Duration> {
        let t = self.timeouts.qmp;
        self.set_ignore_shared()?;
        let (state, mem) = files.open()?;
        self.qmp()?.getfd("checkpoint", state, t)?;
        let deadline = Instant::now() + self.timeouts.migrate;
        let mem_mib = self.cfg.mem_mib;
        let ((), paused) = self.stopped(|vm| {
            let q = vm.qmp()?;
            q.execute("migrate", Some(json!({ "uri": "fd:checkpoint" })), t)?;
            q.wait_migration(deadline)?;
            let ram = vm.ram.as_ref().ok_or_else(|| {
                VmError::Other(format!("VM {}: has no RAM of its own to save", vm.id))
            })?;
            ram.copy_to(mem, &files.mem_tmp, mem_mib).map(|_| ())
        })?;
        Ok(paused)
    }

    /// A restored VM: its RAM (a private mapping) comes through the
    /// migration stream, read here from a pipe and split into `state` and
    /// `memory` ([`stream::split`]), the guest stopped throughout. Not a
    /// live (precopy) migration: under TCG, QEMU 7.2 misses pages the guest
    /// dirties while one runs (the restored guest oopses; measured with the
    /// unsplit stream too).
    fn checkpoint_restored(&mut self, files: &CkptFiles) -> Result<Duration> {
        let id = self.id.clone();
        let t = self.timeouts.qmp;
        let deadline_in = self.timeouts.migrate;
        let mem_len = u64::from(self.cfg.mem_mib) << 20;
        self.set_ignore_shared()?;
        let q = self.qmp()?;
        let caps = q.execute("query-migrate-capabilities", None, t)?;
        let on: Vec<&str> = caps
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c.get("state").and_then(Value::as_bool) == Some(true))
            .filter_map(|c| c.get("capability").and_then(Value::as_str))
            .filter(|c| !STREAM_NEUTRAL_CAPS.contains(c))
            .collect();
        if !on.is_empty() {
            return Err(VmError::Other(format!(
                "VM {id}: migration capabilities {on:?} are on; a checkpoint reads only plain streams",
            )));
        }
        // No warm-up migration while the guest runs first: it cut the pause
        // to a third, but live migration under TCG is what broke guests
        // before, and the file it was blamed for losing (issue #21) was a
        // test's race (it read a counter file mid-rewrite), so nothing here
        // needs it. The guest is stopped for one plain migration, the path
        // QEMU's own savevm takes.
        let (state, mem) = files.open()?;
        let (rd, wr) = pipe().map_err(|e| io_err("create the migration pipe".into(), e))?;
        {
            use std::os::fd::AsRawFd;
            // Fewer wake-ups for both sides; the default 64 KiB works too.
            // SAFETY: fcntl on our own fd.
            unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        }
        self.qmp()?.getfd("checkpoint", &wr, t)?;
        drop(wr); // QEMU holds the only write end: its close is our EOF
        let (split, paused) = self.stopped(|vm| {
            let deadline = Instant::now() + deadline_in;
            vm.qmp()?
                .execute("migrate", Some(json!({ "uri": "fd:checkpoint" })), t)?;
            let r = stream::split(
                DeadlineReader { f: rd, deadline },
                io::BufWriter::with_capacity(1 << 16, state),
                &files.state_tmp,
                MemTarget {
                    file: mem,
                    path: &files.mem_tmp,
                    block: MEM_BACKEND_ID,
                    len: mem_len,
                },
                true,
            );
            // The read end is closed by now: a QEMU still writing fails.
            match r {
                Ok(s) => vm.qmp()?.wait_migration(deadline).map(|()| s),
                Err(e) => {
                    let _ = vm.qmp().and_then(|q| q.execute("migrate_cancel", None, t));
                    let _ = vm.qmp().and_then(|q| q.wait_migration(Instant::now() + t));
                    Err(e)
                }
            }
        })?;
        log::debug!(
            "qemu VM {id}: checkpoint stream: {} MiB of RAM, {} KiB of state",
            split.mem_bytes >> 20,
            split.state_bytes >> 10
        );
        Ok(paused)
    }
}

impl Vm for QemuVm {
    fn close_note(&self) -> Option<crate::agent::CloseNote> {
        let limit = cgroup::memory_limit_of(&self.cgroups)?;
        // Opened here, read by whichever thread sees the connection close.
        let oom = cgroup::OomCounter::open(&self.cgroups);
        Some(Box::new(move || {
            (oom.kills() > 0).then(|| {
                format!(
                    "the VMM was killed by the host's OOM killer at its cgroup memory limit \
                     of {} MiB (guest RAM + vm_memory_overhead_mib)",
                    limit >> 20
                )
            })
        }))
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn translates_guest_code(&self) -> bool {
        self.accel == Accel::Tcg
    }

    fn pid(&self) -> Option<i32> {
        self.pidfd.as_ref().filter(|p| p.is_alive()).map(Pidfd::pid)
    }

    fn connect_agent(&mut self, deadline: Instant) -> Result<UnixStream> {
        let started = Instant::now();
        let path = self.agent_socket();
        loop {
            match UnixStream::connect(&path) {
                // No reset round trip: virtio-serial cannot signal a new
                // connection to a guest that still holds an old one (a
                // restored guest does), so the protocol's hello itself
                // restarts the agent's connection, and the client skips
                // stale output by the hello's nonce.
                Ok(s) => return Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    if !self.alive() {
                        return Err(VmError::Api {
                            backend: NAME,
                            msg: format!(
                                "VM {}: QEMU is gone; console: {}",
                                self.id,
                                self.console.tail()
                            ),
                        });
                    }
                    if Instant::now() >= deadline {
                        return Err(VmError::Timeout {
                            backend: NAME,
                            what: format!("agent socket {}", path.display()),
                            ms: started.elapsed().as_millis() as u64,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(io_err(format!("connect {}", path.display()), e)),
            }
        }
    }

    fn snapshot(&mut self, dir: &Path) -> Result<()> {
        if self.saved {
            return Err(VmError::Other(format!(
                "VM {}: already saved into a snapshot; boot or restore a new VM",
                self.id
            )));
        }
        if self.restored {
            // Its RAM is copy-on-write over another snapshot's, in no file.
            return Err(VmError::Other(format!(
                "VM {}: was restored from a snapshot; snapshots are made from booted VMs",
                self.id
            )));
        }
        fs::create_dir_all(dir)
            .map_err(|e| io_err(format!("create snapshot dir {}", dir.display()), e))?;
        // A stale manifest must not describe the files about to be replaced.
        let _ = fs::remove_file(dir.join(snapshot::MANIFEST_FILE));
        let state_tmp = dir.join(format!(".{SNAP_STATE_FILE}.tmp"));
        let mem_tmp = dir.join(format!(".{SNAP_MEM_FILE}.tmp"));
        let _ = fs::remove_file(&mem_tmp);
        let state = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&state_tmp)
            .map_err(|e| io_err(format!("create {}", state_tmp.display()), e))?;
        let t = self.timeouts.qmp;
        let deadline = Instant::now() + self.timeouts.migrate;
        let r = (|| {
            let q = self.qmp()?;
            q.execute("stop", None, t)?;
            q.execute(
                "migrate-set-capabilities",
                Some(
                    json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }),
                ),
                t,
            )?;
            q.getfd("snapshot", &state, t)?;
            q.execute("migrate", Some(json!({ "uri": "fd:snapshot" })), t)?;
            q.wait_migration(deadline)
        })();
        drop(state);
        if let Err(e) = r {
            let _ = fs::remove_file(&state_tmp);
            return Err(if self.alive() {
                e
            } else {
                self.explain(e, "saving a snapshot")
            });
        }
        // The paused VM's RAM is complete in its memfd: copy its data into
        // the snapshot (a file of the daemon's, 0600: no VMM can alter what
        // later sessions start from). The VM is never resumed after a
        // snapshot (`saved` forbids it): the daemon lets go of its RAM now.
        self.saved = true;
        let res = match self.ram.take() {
            Some(ram) => ram.save(&mem_tmp, self.cfg.mem_mib),
            None => Err(VmError::Other(format!(
                "VM {}: has no RAM of its own to save",
                self.id
            ))),
        }
        .and_then(|_| {
            fs::rename(&state_tmp, dir.join(SNAP_STATE_FILE))
                .map_err(|e| io_err(format!("rename {}", state_tmp.display()), e))
        })
        .and_then(|_| {
            fs::rename(&mem_tmp, dir.join(SNAP_MEM_FILE))
                .map_err(|e| io_err(format!("rename {}", mem_tmp.display()), e))
        });
        if let Err(e) = res {
            let _ = fs::remove_file(&state_tmp);
            let _ = fs::remove_file(&mem_tmp);
            return Err(e);
        }
        Manifest::seal(
            dir,
            &snapshot::Inputs::of(NAME, &self.vmm_version, &self.cfg),
            &[SNAP_STATE_FILE, SNAP_MEM_FILE],
        )
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<CheckpointStats> {
        if self.destroyed || !self.alive() {
            return Err(VmError::Other(format!(
                "VM {}: is not running (destroyed or exited): nothing to checkpoint",
                self.id
            )));
        }
        if self.saved {
            return Err(VmError::Other(format!(
                "VM {}: already saved into a snapshot; it cannot be checkpointed",
                self.id
            )));
        }
        let mut files = CkptFiles::create(dir, self.cfg.mem_mib)?;
        let r = if self.restored {
            self.checkpoint_restored(&files)
        } else {
            self.checkpoint_booted(&files)
        }
        .and_then(|paused| {
            let inputs = snapshot::Inputs::of(NAME, &self.vmm_version, &self.cfg);
            files.commit(&inputs).map(|()| paused)
        });
        match r {
            Ok(paused) => Ok(CheckpointStats {
                paused,
                bytes: files.bytes(),
            }),
            Err(e) => {
                files.discard();
                Err(if self.alive() {
                    e
                } else {
                    self.explain(e, "writing a checkpoint")
                })
            }
        }
    }

    fn destroy(&mut self) -> Result<()> {
        if self.destroyed {
            return Ok(());
        }
        self.qmp = None;
        let mut first_err = None;
        if let (Some(p), Some(child)) = (&self.pidfd, self.child.as_mut()) {
            // Its own process group (setsid): take anything it started.
            if let Err(e) = child.kill_group() {
                first_err.get_or_insert(io_err(format!("kill QEMU pid {}", p.pid()), e));
            }
            if !p.wait_exit(Instant::now() + self.timeouts.teardown) {
                first_err.get_or_insert(VmError::Timeout {
                    backend: NAME,
                    what: format!("QEMU pid {} to exit after SIGKILL", p.pid()),
                    ms: self.timeouts.teardown.as_millis() as u64,
                });
            } else {
                let _ = child.exit_status(); // reaps a direct child
            }
        }
        // The last reference to its RAM once QEMU is gone: frees it.
        self.ram = None;
        if !self.cgroups.is_empty() {
            match cgroup::remove_all(&self.cgroups, Instant::now() + self.timeouts.teardown) {
                Ok(()) => self.cgroups.clear(),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match fs::remove_dir_all(&self.cfg.run_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                first_err.get_or_insert(io_err(
                    format!("remove run dir {}", self.cfg.run_dir.display()),
                    e,
                ));
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.child = None;
        self.pidfd = None;
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            log::warn!("qemu VM {}: teardown on drop: {e}", self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tb_count_is_read_from_info_jit() {
        let out = "Translation buffer state:\r\ngen code size       8459827/1073736704\r\n\
                   TB count            24018\r\nTB avg target size  352 max=2336 bytes\r\n";
        assert_eq!(parse_tb_count(out), Some(24018));
        assert_eq!(parse_tb_count("TCG is not enabled"), None);
    }
}
