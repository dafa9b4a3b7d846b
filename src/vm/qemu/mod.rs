//! QEMU backend: `-M microvm` under KVM where KVM really works, TCG
//! elsewhere. Same kernel and rootfs as Firecracker; the agent is reached
//! over a virtio-serial port exposed as a Unix socket in the run dir; QMP
//! (another Unix socket there) drives pause, save and resume.
//!
//! A booted guest's RAM is a memfd the daemon makes and hands to QEMU
//! (`memory-backend-file,share=on` on `/proc/self/fd/N`): never a file on
//! persistent disk, freed with the VM, and readable by the daemon, so a
//! snapshot is the device state (`x-ignore-shared` leaves RAM out of the
//! migration stream; tens of KiB, written in milliseconds) plus a sparse
//! copy of that memfd into the snapshot dir ([`GuestRam`]). A restore
//! maps the snapshot's RAM privately (`share=off`): the guest reads the
//! snapshot's pages, its writes go to copy-on-write pages of its own, and
//! nothing is copied per restore. QEMU 7.2 opens a RAM file read-write even
//! for a private mapping, and the pristine snapshot must not be writable by
//! any VMM, so QEMU gets it as a sealed memfd ([`SnapshotMemory`]): loaded
//! once per snapshot, shared by every VM restored from it, and immutable
//! (`F_SEAL_WRITE`, `F_SEAL_SEAL`).
//!
//! A checkpoint of a running VM ([`Vm::checkpoint`]) writes the same
//! snapshot format and lets the guest run on. A booted VM's is made like a
//! snapshot (device state, then a copy of the memfd, the guest stopped). A
//! restored VM's dirtied pages exist only in QEMU's private mapping, so
//! its RAM comes through the migration stream (`x-ignore-shared` does not
//! leave out a `share=off` block), read from a pipe by the calling thread
//! and split into `memory` and `state` (`stream.rs`); a first pass while
//! the guest runs has QEMU map all of it in, so the guest is stopped only
//! for the copy.
//!
//! Migration uses `fd:` URIs because `-sandbox spawn=deny` forbids `exec:`.

mod accel;
mod argv;
mod console;
mod jail;
mod memory;
mod stream;
mod vm;

pub use accel::{kvm_device_usable, probe_kvm, Accel};
pub use argv::{cmdline, qemu_limits, DEFAULT_CMDLINE, TCG_CMDLINE};
pub use console::CONSOLE_LOG_MAX;
pub use memory::{GuestRam, SnapshotMemory};
pub use vm::QemuVm;

use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use self::argv::{build_argv, validate_mac, version_string, ArgvSpec, MEM_FD, STATE_FD, TAP_FD};
use self::console::Console;
use super::cgroup;
use super::launch::{self, Launcher};
use super::launch::{validate_id, Bind, Pidfd};
use super::qmp::Qmp;
use super::snapshot;
use super::{Backend, NetAttachment, PreparedRestore, Result, Vm, VmConfig, VmError};
use crate::net;

const NAME: &str = super::BackendKind::Qemu.as_str();

/// Snapshot file names inside a snapshot directory.
pub const SNAP_STATE_FILE: &str = "state";
pub const SNAP_MEM_FILE: &str = "memory";

/// Files in a VM's run dir.
pub const QMP_SOCK: &str = "qmp.sock";
pub const AGENT_SOCK: &str = "agent.sock";
pub const CONSOLE_LOG: &str = "console.log";
/// Where a jailed QEMU's root is mounted (in its own mount namespace; on
/// the host an empty directory).
pub const JAIL_ROOT: &str = "jail";

/// The agent prints this on the console once it listens.
pub const READY_MARKER: &[u8] = b"SANDBOX-AGENT READY";

#[derive(Debug, Clone)]
pub struct Timeouts {
    /// VMM start to QMP answering; one ordinary QMP command.
    pub qmp: Duration,
    /// VMM start to the agent's READY line (TCG on a loaded host is slow).
    pub boot: Duration,
    /// Saving or loading the device state.
    pub migrate: Duration,
    /// Kill to exit.
    pub teardown: Duration,
    /// KVM probe boot: kernel start to its panic message.
    pub kvm_probe: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            qmp: Duration::from_secs(10),
            boot: Duration::from_secs(60),
            migrate: Duration::from_secs(60),
            teardown: Duration::from_secs(5),
            kvm_probe: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// `qemu-system-x86_64`, looked up in PATH when not absolute.
    pub binary: PathBuf,
    pub accel: Accel,
    pub timeouts: Timeouts,
    /// Where the `auto` probe result is remembered across restarts.
    pub accel_cache: Option<PathBuf>,
    /// How QEMU is started: the daemon's spawner, or directly (tools, tests).
    pub launcher: Arc<dyn Launcher>,
    /// cgroup directories (one per hierarchy, see `cgroup::Prepared`)
    /// under which each VM gets `<id>/` with its limits (empty: no per-VM
    /// cgroup).
    pub cgroup_parents: Vec<PathBuf>,
    /// The VMM's memory beyond guest RAM in its memory limit (`None`:
    /// [`cgroup::MEMORY_OVERHEAD_MIB`], plus [`cgroup::TCG_TB_MIB`] under
    /// TCG).
    pub mem_overhead_mib: Option<u64>,
    /// `io.max` lines of each VM's cgroup (see `cgroup::io_max_lines`).
    pub io_max: Vec<String>,
    /// A fixed `cpu.max` for every VM in place of one CPU per vCPU.
    pub cpu_max: Option<cgroup::CpuMax>,
    /// QEMU's RLIMIT_NOFILE (`None`: [`launch::DEFAULT_NOFILE`]).
    pub nofile: Option<u64>,
}

impl std::fmt::Debug for dyn Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())
    }
}

impl Default for QemuConfig {
    fn default() -> Self {
        QemuConfig {
            binary: PathBuf::from("qemu-system-x86_64"),
            accel: Accel::Auto,
            timeouts: Timeouts::default(),
            accel_cache: None,
            launcher: launch::direct(),
            cgroup_parents: Vec::new(),
            mem_overhead_mib: None,
            io_max: Vec::new(),
            cpu_max: None,
            nofile: None,
        }
    }
}

pub struct QemuBackend {
    cfg: QemuConfig,
    /// Sealed in-memory copies of snapshot RAM files, by path.
    snap_mem: Mutex<std::collections::HashMap<PathBuf, Arc<SnapshotMemory>>>,
    /// Resolved accelerator (never `Auto`), once known.
    accel: Mutex<Option<Accel>>,
    version: Mutex<Option<String>>,
    /// A kernel to probe KVM with when `vmm_version` is asked first.
    probe_kernel: Mutex<Option<PathBuf>>,
    /// What every jailed QEMU sees besides its VM's own files, once known.
    jail_base: Mutex<Option<Arc<Vec<Bind>>>>,
    /// Whether running unjailed was logged.
    unjailed_said: std::sync::Once,
}

/// The poison-tolerant lock of both crates, for the submodules too.
pub(crate) use crate::sync::lock;

fn io_err(what: String, source: io::Error) -> VmError {
    VmError::Io {
        backend: NAME,
        what,
        source,
    }
}

impl QemuBackend {
    /// What a VMM of `mem_mib` guest RAM may use beyond it (its memory
    /// limit's slack). Under TCG also the capped translation cache and
    /// once more the guest's RAM: measured, a fork bomb in a 512 MiB TCG
    /// guest reached 615 MiB anon (softmmu TLBs, code buffer, copied
    /// pages) beside 455 MiB of its RAM's shmem.
    fn mem_overhead(&self, accel: Accel, mem_mib: u32) -> u64 {
        self.cfg.mem_overhead_mib.unwrap_or(match accel {
            Accel::Kvm => cgroup::MEMORY_OVERHEAD_MIB,
            _ => cgroup::MEMORY_OVERHEAD_MIB + cgroup::TCG_TB_MIB + u64::from(mem_mib),
        })
    }

    pub fn new(cfg: QemuConfig) -> Self {
        let accel = match cfg.accel {
            Accel::Auto => None,
            a => Some(a),
        };
        QemuBackend {
            cfg,
            snap_mem: Mutex::new(std::collections::HashMap::new()),
            accel: Mutex::new(accel),
            version: Mutex::new(None),
            probe_kernel: Mutex::new(None),
            jail_base: Mutex::new(None),
            unjailed_said: std::sync::Once::new(),
        }
    }

    pub fn config(&self) -> &QemuConfig {
        &self.cfg
    }

    /// Kernel used for the KVM probe if `vmm_version` runs before any boot.
    pub fn set_probe_kernel(&self, kernel: &Path) {
        *lock(&self.probe_kernel) = Some(kernel.to_path_buf());
    }

    fn binary(&self) -> PathBuf {
        find_in_path(&self.cfg.binary).unwrap_or_else(|| self.cfg.binary.clone())
    }

    /// First line of `qemu-system-x86_64 --version`.
    pub fn qemu_version(&self) -> Result<String> {
        let mut cached = lock(&self.version);
        if let Some(v) = cached.as_ref() {
            return Ok(v.clone());
        }
        let bin = self.binary();
        let out = self.cfg.launcher.run(
            &[bin.clone().into_os_string(), "--version".into()],
            Instant::now() + self.cfg.timeouts.qmp,
        )?;
        let v = out.version_line(NAME, &bin)?;
        *cached = Some(v.clone());
        Ok(v)
    }

    /// Everything a run dir needs, or an error naming what is wrong.
    fn prepare_run_dir(cfg: &VmConfig) -> Result<()> {
        let dir = &cfg.run_dir;
        match fs::read_dir(dir) {
            Ok(mut it) => {
                if it.next().is_some() {
                    return Err(VmError::BadFile {
                        path: dir.clone(),
                        problem: "run dir is not empty (left over from an earlier VM?)".into(),
                        fix: "remove it or use a fresh run dir".into(),
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| io_err(format!("create run dir {}", dir.display()), e))?;
            }
            Err(e) => return Err(io_err(format!("read run dir {}", dir.display()), e)),
        }
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| io_err(format!("chmod {}", dir.display()), e))?;
        chown(dir, cfg.uid, cfg.gid)
    }

    /// [`Backend::restore`], keeping the concrete type (benchmarks and
    /// diagnostics use its QMP).
    pub fn restore_vm(&self, cfg: &VmConfig, snapshot_dir: &Path) -> Result<QemuVm> {
        self.prepare_restore_vm(cfg, snapshot_dir)?.finish_vm()
    }

    /// [`Backend::prepare_restore`], keeping the concrete type: QEMU
    /// started with `-incoming defer`, the snapshot's state and RAM handed
    /// over as fds, QMP connected.
    pub fn prepare_restore_vm(&self, cfg: &VmConfig, snapshot_dir: &Path) -> Result<QemuPrepared> {
        let version = self.vmm_version_for(&cfg.kernel)?;
        snapshot::check_fresh(snapshot_dir, &snapshot::Inputs::of(NAME, &version, cfg))?;
        let state = snapshot_dir.join(SNAP_STATE_FILE);
        let mem = snapshot_dir.join(SNAP_MEM_FILE);
        let vm = self.launch(cfg, Some((&state, &mem)))?;
        Ok(QemuPrepared {
            vm,
            state_path: state,
        })
    }

    fn launch(&self, cfg: &VmConfig, incoming: Option<(&Path, &Path)>) -> Result<QemuVm> {
        validate_id(&cfg.id)?;
        check_input(&cfg.kernel, "kernel", cfg)?;
        check_input(&cfg.rootfs, "rootfs", cfg)?;
        if cfg.vcpus == 0 || cfg.mem_mib < 64 {
            return Err(VmError::Other(format!(
                "VM {}: {} vCPUs / {} MiB is not a VM",
                cfg.id, cfg.vcpus, cfg.mem_mib
            )));
        }
        let accel = self.resolve_accel(Some(&cfg.kernel))?;
        let version = self.vmm_version_for(&cfg.kernel)?;
        // Open the TAP before creating anything, so a failure leaves nothing.
        let tap = match &cfg.net {
            Some(n) => {
                validate_mac(&n.guest_mac)?;
                Some(tap_fd(n)?)
            }
            None => None,
        };
        Self::prepare_run_dir(cfg)?;
        let mut vm = QemuVm {
            id: cfg.id.clone(),
            cfg: cfg.clone(),
            child: None,
            pidfd: None,
            cgroups: Vec::new(),
            console: Arc::new(Console::default()),
            qmp: None,
            timeouts: self.cfg.timeouts.clone(),
            vmm_version: version,
            destroyed: false,
            ram: None,
            saved: false,
            restored: incoming.is_some(),
            accel,
        };
        // From here on, dropping `vm` on error removes everything.
        let (state, snap_mem, ram) = match incoming {
            Some((state, snap_mem)) => {
                let f = fs::File::open(state).map_err(|e| VmError::BadFile {
                    path: state.to_path_buf(),
                    problem: format!("cannot open snapshot state: {e}"),
                    fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>"
                        .into(),
                })?;
                let m = self.snapshot_memory(snap_mem, cfg.mem_mib as u64 * 1024 * 1024)?;
                (Some(f), Some(m), None)
            }
            None => (None, None, Some(GuestRam::new(cfg.mem_mib)?)),
        };
        let spec = ArgvSpec {
            accel,
            tap_fd: tap.as_ref().map(|_| TAP_FD),
            incoming: state.is_some(),
        };
        let argv = build_argv(cfg, &spec);
        let mut pass: Vec<(BorrowedFd<'_>, RawFd)> = Vec::new();
        if let Some(t) = &tap {
            pass.push((t.as_fd(), TAP_FD));
        }
        if let Some(s) = &state {
            pass.push((s.as_fd(), STATE_FD));
        }
        if let Some(m) = &snap_mem {
            pass.push((m.fd.as_fd(), MEM_FD));
        }
        if let Some(r) = &ram {
            pass.push((r.fd.as_fd(), MEM_FD));
        }
        if !self.cfg.cgroup_parents.is_empty() {
            let limits = cgroup::Limits {
                io_max: self.cfg.io_max.clone(),
                ..cgroup::Limits::for_vm(
                    cfg.vcpus,
                    cfg.mem_mib,
                    self.mem_overhead(accel, cfg.mem_mib),
                )
                .with_cpu_max(self.cfg.cpu_max)
            };
            vm.cgroups = cgroup::create(&self.cfg.cgroup_parents, &cfg.id, &limits)?;
        }
        let jail = self.jail_for(cfg, accel, state.is_some())?;
        vm.spawn(
            self.cfg.launcher.as_ref(),
            &self.binary(),
            &argv,
            &pass,
            jail,
            qemu_limits(cfg.mem_mib, self.cfg.nofile),
        )?;
        drop(pass);
        drop(tap);
        vm.ram = ram;
        let deadline = Instant::now() + self.cfg.timeouts.qmp;
        let qmp = {
            let pidfd = vm.pidfd.as_ref();
            Qmp::connect(&cfg.run_dir.join(QMP_SOCK), deadline, &|| {
                pidfd.is_some_and(Pidfd::is_alive)
            })
        };
        match qmp {
            Ok(q) => vm.qmp = Some(q),
            Err(e) => return Err(vm.explain(e, "starting")),
        }
        if state.is_some() {
            // RAM stays out of the stream (it is the mapped snapshot file).
            // Set now, so the state load (`QemuPrepared::finish_vm`) is only
            // migrate-incoming and `cont`.
            let t = self.cfg.timeouts.qmp;
            let caps =
                json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] });
            let set = vm
                .qmp()
                .and_then(|q| q.execute("migrate-set-capabilities", Some(caps), t));
            if let Err(e) = set {
                return Err(vm.explain(e, "setting up the snapshot load"));
            }
        }
        Ok(vm)
    }
}

/// A QEMU waiting in `-incoming defer` for [`QemuPrepared::finish_vm`]
/// ([`Backend::prepare_restore`]). It already holds the snapshot's state
/// file (fd [`STATE_FD`]) and RAM (fd [`MEM_FD`]).
pub struct QemuPrepared {
    vm: QemuVm,
    state_path: PathBuf,
}

impl QemuPrepared {
    /// Load the state and run the guest: migrate-incoming from the fd QEMU
    /// was started with, then `cont`.
    pub fn finish_vm(mut self) -> Result<QemuVm> {
        if let Err(e) = self.vm.load_state(STATE_FD) {
            let why = self.vm.explain(e, "loading the snapshot");
            return Err(VmError::BadFile {
                path: self.state_path,
                problem: format!("snapshot state does not load: {why}"),
                fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
            });
        }
        Ok(self.vm)
    }
}

impl PreparedRestore for QemuPrepared {
    fn id(&self) -> &str {
        &self.vm.id
    }

    fn pid(&self) -> Option<i32> {
        Vm::pid(&self.vm)
    }

    fn alive(&self) -> bool {
        self.vm.alive()
    }

    fn finish(self: Box<Self>) -> Result<Box<dyn Vm>> {
        Ok(Box::new(self.finish_vm()?))
    }

    fn destroy(&mut self) -> Result<()> {
        Vm::destroy(&mut self.vm)
    }
}

impl Backend for QemuBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// QEMU's version, the accelerator and the machine: a snapshot made
    /// under TCG (`-cpu max`) does not restore under KVM (`-cpu host`) and
    /// vice versa, and one booted with another fixed command line holds
    /// a guest set up differently.
    fn vmm_version(&self) -> Result<String> {
        let v = self.qemu_version()?;
        let a = self.resolve_accel(None)?;
        Ok(version_string(&v, a))
    }

    fn vmm_version_for(&self, kernel: &Path) -> Result<String> {
        let v = self.qemu_version()?;
        let a = self.resolve_accel(Some(kernel))?;
        Ok(version_string(&v, a))
    }

    fn boot(&self, cfg: &VmConfig) -> Result<Box<dyn Vm>> {
        let mut vm = self.launch(cfg, None)?;
        let deadline = Instant::now() + self.cfg.timeouts.boot;
        if let Err(e) = vm.wait_ready(deadline) {
            return Err(vm.explain(e, "booting"));
        }
        Ok(Box::new(vm))
    }

    fn restore(&self, cfg: &VmConfig, snapshot_dir: &Path) -> Result<Box<dyn Vm>> {
        Ok(Box::new(self.restore_vm(cfg, snapshot_dir)?))
    }

    fn prepare_restore(
        &self,
        cfg: &VmConfig,
        snapshot_dir: &Path,
    ) -> Result<Box<dyn PreparedRestore>> {
        Ok(Box::new(self.prepare_restore_vm(cfg, snapshot_dir)?))
    }

    /// Drops the sealed RAM copies of files under `dir`: checkpoints come
    /// and go, and the cache would keep each one's RAM for good. VMs
    /// restored from it keep their own reference.
    fn forget_snapshot(&self, dir: &Path) {
        lock(&self.snap_mem).retain(|path, _| !path.starts_with(dir));
    }
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(()); // unprivileged: the VMM runs as us and owns what we make
    }
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .map_err(|e| io_err(format!("chown {uid}:{gid} {}", path.display()), e))
}

/// A file the VMM opens itself must exist and be readable by its uid/gid.
fn check_input(path: &Path, what: &str, cfg: &VmConfig) -> Result<()> {
    let fix = "agent-sandbox image build";
    let m = fs::metadata(path).map_err(|e| VmError::BadFile {
        path: path.to_path_buf(),
        problem: format!("{what}: {e}"),
        fix: fix.into(),
    })?;
    if !m.is_file() {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!("{what} is not a regular file"),
            fix: fix.into(),
        });
    }
    if m.len() == 0 {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!("{what} is empty"),
            fix: fix.into(),
        });
    }
    let mode = m.mode();
    let readable = mode & 0o004 != 0
        || (m.uid() == cfg.uid && mode & 0o400 != 0)
        || (m.gid() == cfg.gid && mode & 0o040 != 0);
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    if as_root && !readable {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!(
                "{what} is not readable by the VMM's uid {} / gid {}",
                cfg.uid, cfg.gid
            ),
            fix: format!("chmod o+r {}", path.display()),
        });
    }
    Ok(())
}

/// `bin` itself when it has a directory part, else its first PATH match.
pub fn find_in_path(bin: &Path) -> Option<PathBuf> {
    if bin.components().count() > 1 {
        return Some(bin.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// The session's TAP, opened inside its network namespace by a thread that
/// enters it (the rest of the process never does): QEMU is handed the fd
/// and needs neither /dev/net/tun nor the namespace.
fn tap_fd(n: &NetAttachment) -> Result<OwnedFd> {
    net::tap::check_name(&n.tap).map_err(|e| VmError::Other(e.to_string()))?;
    let ns = net::netns::open(&n.netns).map_err(|e| VmError::BadFile {
        path: n.netns.clone(),
        problem: match e {
            net::NetError::Io { source, .. } => format!("cannot open network namespace: {source}"),
            e => e.to_string(),
        },
        fix: "create the session's network namespace first".into(),
    })?;
    let where_ = format!(
        "open TAP {} in network namespace {}",
        n.tap,
        n.netns.display()
    );
    net::netns::run_in(Some(&ns), &where_, || net::tap::open(&n.tap, true))
        .map(OwnedFd::from)
        .map_err(|e| match e {
            net::NetError::Io { what, source } => io_err(format!("{where_}: {what}"), source),
            e => VmError::Other(format!("{where_}: {e}")),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_and_the_namespace_are_checked() {
        let att = |netns: &str, tap: &str| NetAttachment {
            netns: netns.into(),
            tap: tap.into(),
            guest_mac: "02:00:00:00:00:01".into(),
        };
        // A bad name is refused before any namespace is looked at.
        for bad in ["", "a/b", "a\0b", "0123456789abcdef"] {
            match tap_fd(&att("/nonexistent", bad)) {
                Err(VmError::Other(msg)) => assert!(msg.contains("bad TAP name"), "{msg}"),
                other => panic!("{bad:?}: {:?}", other.err()),
            }
        }
        match tap_fd(&att("/nonexistent/netns", "tap0")) {
            Err(VmError::BadFile { path, .. }) => assert_eq!(path, Path::new("/nonexistent/netns")),
            other => panic!("{:?}", other.err()),
        }
    }
}
